"""The Responses API (POST /v1/responses and /v1/responses/{id}) through the official
openai client against a real `pagellm serve`.

The reference is the offline API greedy on the chat prompt the same conversation makes:
instructions as the system turn, a previous response's turns before the new input.
"""

from __future__ import annotations

import json

import httpx2
import openai
import pytest
from serve_helpers import greedy_offline, wait_until

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
NUMBER = {
    "type": "json_schema",
    "name": "number",
    "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False},
    "strict": True,
}


def chat_greedy(llm, messages, max_tokens: int):  # noqa: ANN001, ANN201
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    return prompt_ids, greedy_offline(llm, prompt_ids, max_tokens)


def test_a_response_equals_offline_chat(client, model_name, offline_llm):
    result = client.responses.create(
        model=model_name, input="Name a colour.", instructions="You are terse.", max_output_tokens=12, temperature=0
    )
    prompt_ids, expected = chat_greedy(
        offline_llm, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}], 12
    )
    assert result.object == "response" and result.model == model_name and result.id.startswith("resp_")
    assert result.output_text == expected.outputs[0].text
    message = result.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    finished_by_length = expected.outputs[0].finish_reason == "length"
    assert result.status == ("incomplete" if finished_by_length else "completed")
    if finished_by_length:
        assert result.incomplete_details.reason == "max_output_tokens"
    assert result.usage.input_tokens == len(prompt_ids)
    assert result.usage.output_tokens == len(expected.outputs[0].token_ids)
    assert result.usage.total_tokens == result.usage.input_tokens + result.usage.output_tokens
    assert result.instructions == "You are terse." and result.max_output_tokens == 12


def test_a_streamed_response_adds_up_to_the_same(client, model_name):
    whole = client.responses.create(model=model_name, input="Say hello.", max_output_tokens=16, temperature=0)
    events = list(client.responses.create(model=model_name, input="Say hello.", max_output_tokens=16, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", f"response.{whole.status}"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[0].response.id == events[-1].response.id != whole.id


def test_the_streaming_helper_gives_the_final_parsed_response(smol):
    # A schema whose JSON ends on its own: the response completes within the limit.
    # (SmolLM2: output constraints need a real tokenizer, whose end token is special.)
    with smol.responses.stream(
        model="smol", input="A number?", max_output_tokens=64, temperature=0, text={"format": NUMBER}
    ) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert "".join(deltas) == final.output_text
    assert isinstance(json.loads(final.output_text)["n"], int)


def test_input_items_list_a_responses_input(client, model_name):
    """The SDK's responses.input_items.list: the request's items with ids, newest first by
    default, paged by limit / after / before."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": "Thanks."},
    ]
    response = client.responses.create(model=model_name, input=items, max_output_tokens=2)
    listed = client.responses.input_items.list(response.id, order="asc")
    kinds = [(item.type, getattr(item, "role", None)) for item in listed.data]
    assert kinds == [("message", "developer"), ("message", "user"), ("function_call", None), ("function_call_output", None), ("message", "user")]
    assert listed.data[1].content[0].text == "Weather?" and listed.data[3].output == "sunny"
    ids = [item.id for item in listed.data]
    assert len(set(ids)) == 5 and all(ids)
    newest_first = client.responses.input_items.list(response.id)
    assert [item.id for item in newest_first.data] == ids[::-1]
    page = client.responses.input_items.list(response.id, order="asc", limit=2, after=ids[0])
    assert [item.id for item in page.data] == ids[1:3] and page.has_more
    before = client.responses.input_items.list(response.id, order="asc", extra_query={"before": ids[2]})
    assert [item.id for item in before.data] == ids[:2]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nosuch")
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(response.id, limit=0)


def test_previous_response_id_continues_the_conversation(client, model_name, offline_llm, server):
    first = client.responses.create(model=model_name, input="Name a colour.", max_output_tokens=8, temperature=0)
    second = client.responses.create(
        model=model_name, input="Another one.", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another one."},
    ]
    _, expected = chat_greedy(offline_llm, messages, 8)
    assert second.output_text == expected.outputs[0].text
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.retrieve(first.id)
    assert error.value.body["code"] == "not_found"
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=model_name, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert error.value.body["param"] == "previous_response_id" and error.value.body["code"] == "previous_response_not_found"
    unstored = client.responses.create(model=model_name, input="x", store=False, max_output_tokens=2)
    response = httpx2.get(server.api_url + f"/responses/{unstored.id}", headers=server.headers(), timeout=30)
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_function_calls_and_their_outputs(smol):
    client, model_name = smol, "smol"
    called = client.responses.create(
        model=model_name, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=64, temperature=0,
    )  # fmt: skip
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert set(json.loads(calls[0].arguments)) == {"city"}  # the constraint follows the schema
    named = client.responses.create(
        model=model_name, input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64, temperature=0,
    )  # fmt: skip
    assert named.output[0].type == "function_call" and "city" in json.loads(named.output[0].arguments)
    answer = client.responses.create(
        model=model_name, previous_response_id=called.id, tools=[WEATHER], max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )  # fmt: skip
    assert answer.output[0].type == "message"
    # The same round trip with the call sent back by the client instead of the store.
    again = client.responses.create(
        model=model_name, max_output_tokens=8, temperature=0, tools=[WEATHER],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
    )  # fmt: skip
    assert again.output_text == answer.output_text


def test_a_json_schema_text_format(smol):
    result = smol.responses.create(model="smol", input="A number?", text={"format": NUMBER}, max_output_tokens=64, temperature=0)
    assert result.status == "completed" and isinstance(json.loads(result.output_text)["n"], int)
    assert result.text.format.type == "json_schema"


def test_a_background_response_is_polled_and_cancelled(client, model_name, server):
    done = client.responses.create(model=model_name, input="Hi", background=True, max_output_tokens=4, temperature=0)
    assert done.status in ("queued", "in_progress")
    finished = wait_until(lambda: (r := client.responses.retrieve(done.id)).status in ("completed", "incomplete") and r, timeout_s=120)
    assert finished and finished.usage.output_tokens <= 4
    long = client.responses.create(
        model=model_name, input="Write a long story.", background=True, max_output_tokens=4000,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    foreground = client.responses.create(model=model_name, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        client.responses.cancel(foreground.id)
    wait_until(lambda: httpx2.get(server.base_url + "/metrics", timeout=30).status_code == 200)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "background": True, "stream": True}, "stream"),
        ({"input": []}, None),
        ({"input": ""}, None),
        ({"input": [{"type": "image", "url": "x"}]}, None),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
        ({"input": "x", "max_output_tokens": 0}, None),
    ],
)
def test_bad_requests_are_400_with_the_field(server, body, param):
    response = httpx2.post(server.api_url + "/responses", json=body, headers=server.headers(), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_input_tokens_are_counted_for_every_body(client, model_name, server, offline_llm):
    """Responses (the SDK's responses.input_tokens.count), chat and Messages count the
    prompt each would run with, equal to the usage a real run reports."""
    first = client.responses.create(model=model_name, input="Name a colour.", max_output_tokens=4, temperature=0)
    request = {"model": model_name, "input": "Another one.", "instructions": "Be terse.", "previous_response_id": first.id}
    counted = client.responses.input_tokens.count(**request)
    assert counted.object == "response.input_tokens"
    ran = client.responses.create(**request, max_output_tokens=2)
    assert counted.input_tokens == ran.usage.input_tokens
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]
    chat_count = httpx2.post(
        server.api_url + "/chat/completions/input_tokens", json={"model": model_name, "messages": messages},
        headers=server.headers(), timeout=60,
    ).json()  # fmt: skip
    chat_run = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    assert chat_count == {"object": "chat.completion.input_tokens", "input_tokens": chat_run.usage.prompt_tokens}
    anthropic_count = httpx2.post(
        server.base_url + "/v1/messages/count_tokens", json={"model": model_name, "system": "Be terse.", "messages": messages[1:]},
        headers=server.headers(), timeout=60,
    ).json()  # fmt: skip
    assert anthropic_count["input_tokens"] == chat_run.usage.prompt_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model=model_name, input="x", previous_response_id="resp_nosuch")
