"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the
official `anthropic` client against a real `pagellm serve`.

The reference is the offline API greedy on the chat prompt the same conversation makes
(`system` as the system turn). Errors come in Anthropic's shape; `x-api-key` authenticates
as Bearer does.
"""

from __future__ import annotations

import json

import httpx2
import pytest
from serve_helpers import API_KEY, greedy_offline

anthropic = pytest.importorskip("anthropic")

# Recent clients no longer take sampling fields as arguments; the API (and this server)
# still reads them from the body.
GREEDY = {"temperature": 0}

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture
def claude(server):  # noqa: ANN001, ANN201
    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture
def smol_claude(smol_server):  # noqa: ANN001, ANN201
    with anthropic.Anthropic(base_url=smol_server.base_url, api_key="none", max_retries=0, timeout=120) as client:
        yield client


def chat_greedy(llm, messages, max_tokens: int, **params: object):  # noqa: ANN001, ANN201
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    return prompt_ids, greedy_offline(llm, prompt_ids, max_tokens, **params)


def test_a_message_equals_offline_chat(claude, model_name, offline_llm):
    result = claude.messages.create(
        model=model_name, max_tokens=12, extra_body=GREEDY, system="You are terse.",
        messages=[{"role": "user", "content": "Name a colour."}],
    )  # fmt: skip
    prompt_ids, expected = chat_greedy(
        offline_llm, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}], 12
    )
    assert result.type == "message" and result.role == "assistant" and result.model == model_name
    assert result.id.startswith("msg_")
    text = "".join(block.text for block in result.content if block.type == "text")
    assert text == expected.outputs[0].text
    assert result.stop_reason == ("max_tokens" if expected.outputs[0].finish_reason == "length" else "end_turn")
    assert result.usage.input_tokens + result.usage.cache_read_input_tokens == len(prompt_ids)
    assert result.usage.output_tokens == len(expected.outputs[0].token_ids)


def test_a_streamed_message_adds_up_to_the_same(claude, model_name):
    kwargs = {"model": model_name, "max_tokens": 16, "extra_body": GREEDY, "messages": [{"role": "user", "content": "Say hello."}]}
    whole = claude.messages.create(**kwargs)
    events = list(claude.messages.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:3] == ["content_block_start", "content_block_delta"] and "content_block_stop" in kinds
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == whole.usage.output_tokens
    with claude.messages.stream(**kwargs) as stream:  # the client's helper
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    # The prompt (a whole block of it) is cached by now: streamed usage splits it as the whole answer's does.
    again = claude.messages.create(**kwargs).usage
    assert again.cache_read_input_tokens > 0
    with claude.messages.stream(**kwargs) as stream:
        streamed_usage = stream.get_final_message().usage
    assert events[0].message.usage.input_tokens + events[0].message.usage.cache_read_input_tokens == again.input_tokens + again.cache_read_input_tokens
    assert (streamed_usage.input_tokens, streamed_usage.cache_read_input_tokens, streamed_usage.output_tokens) == (
        again.input_tokens, again.cache_read_input_tokens, again.output_tokens
    )


def test_stop_sequences_and_multi_turn(claude, model_name, offline_llm):
    def conversation(question: str) -> list[dict]:
        return [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
            {"role": "user", "content": [{"type": "text", "text": question}]},
        ]

    # The first question whose greedy answer is a few characters long (the tiny model may end at once).
    for question in ("Another one.", "And then?", "More please.", "Go on, write more words.", "Why?"):
        plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]} for m in conversation(question)]
        _, expected = chat_greedy(offline_llm, plain, 24)
        text = expected.outputs[0].text
        if len(text) >= 6 and "\x02" not in text[:4]:
            break
    else:
        pytest.fail("no question got a long enough greedy answer")
    stop = text[2:4]  # a stop sequence inside what greedy decoding writes
    result = claude.messages.create(model=model_name, max_tokens=24, extra_body=GREEDY, messages=conversation(question), stop_sequences=[stop])
    assert result.stop_reason == "stop_sequence" and result.stop_sequence == stop
    assert result.content[0].text == text[: text.index(stop)]


def test_tool_use_round_trip(smol_claude):
    # SmolLM2: a constrained call needs a real tokenizer.
    first = smol_claude.messages.create(
        model="smol", max_tokens=64, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    uses = [block for block in first.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert set(uses[0].input) == {"city"}
    named = smol_claude.messages.create(
        model="smol", max_tokens=64, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather?"}],
    )  # fmt: skip
    assert named.content[0].type == "tool_use" and "city" in named.content[0].input
    answer = smol_claude.messages.create(
        model="smol", max_tokens=32, extra_body=GREEDY, tools=[WEATHER],
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 24C"}]},
        ],
    )  # fmt: skip
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with smol_claude.messages.stream(
        model="smol", max_tokens=64, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather?"}],
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == named.content[0].input


def test_count_tokens_is_the_prompts_length(claude, model_name, offline_llm):
    messages = [{"role": "user", "content": "Name a colour."}]
    counted = claude.messages.count_tokens(model=model_name, system="You are terse.", messages=messages)
    prompt_ids, _ = chat_greedy(offline_llm, [{"role": "system", "content": "You are terse."}, *messages], 1)
    assert counted.input_tokens == len(prompt_ids)


def test_errors_are_in_anthropics_shape(claude, server, model_name):
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=model_name, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error" and bad.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=model_name, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    with anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            wrong.messages.create(model=model_name, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert denied.value.body["error"]["type"] == "authentication_error"
    # x-api-key and Bearer both authenticate, on any route.
    body = {"model": model_name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        assert httpx2.post(server.base_url + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
    raw = httpx2.post(server.base_url + "/v1/messages", content=b"{not json", headers={"x-api-key": API_KEY}, timeout=60)
    assert raw.status_code == 400 and json.loads(raw.text)["type"] == "error"
    # A named tool needs its name: the published schema says so, and the request is refused.
    named = {**body, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": None}}
    refused = httpx2.post(server.base_url + "/v1/messages", json=named, headers={"x-api-key": API_KEY}, timeout=60)
    assert refused.status_code == 400 and "tool_choice" in refused.json()["error"]["message"]
    schema = httpx2.get(server.base_url + "/openapi.json", timeout=60).json()["components"]["schemas"]
    assert schema["ToolChoiceTool"]["required"] == ["type", "name"]


def test_an_assistant_prefill_is_continued(claude, model_name, offline_llm):
    """The last assistant turn is left open and the answer holds only what the model adds:
    the reference is the offline API on the prompt written out by hand (the tiny template's
    turns, the prefill's turn not closed)."""
    messages = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "The capital is"}]
    result = claude.messages.create(model=model_name, max_tokens=10, extra_body=GREEDY, messages=messages)
    expected = greedy_offline(offline_llm, "<user>What is the capital of France?\n<assistant>The capital is", 10)
    assert result.content[0].text == expected.outputs[0].text
    assert result.usage.input_tokens + result.usage.cache_read_input_tokens == len(expected.prompt_token_ids)
    # Streamed, the same text; count_tokens counts the open turn.
    with claude.messages.stream(model=model_name, max_tokens=10, extra_body=GREEDY, messages=messages) as stream:
        assert "".join(stream.text_stream) == expected.outputs[0].text
    counted = claude.messages.count_tokens(model=model_name, messages=messages)
    assert counted.input_tokens == len(expected.prompt_token_ids)
    # As Anthropic's API: a prefill may not end in whitespace; an empty one leaves the turn to the model.
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        claude.messages.create(model=model_name, max_tokens=4, messages=[messages[0], {"role": "assistant", "content": "It is "}])
    empty = claude.messages.create(
        model=model_name, max_tokens=6, extra_body=GREEDY, messages=[messages[0], {"role": "assistant", "content": ""}]
    )
    fresh = greedy_offline(offline_llm, "<user>What is the capital of France?\n<assistant>", 6)
    assert empty.content[0].text == fresh.outputs[0].text


@pytest.mark.parametrize(
    ("choice", "max_tokens"),  # cut inside the arguments (a named tool's output is its arguments alone)
    [({"type": "any"}, 14), ({"type": "tool", "name": "get_weather"}, 4)],
)
def test_a_forced_tool_use_cut_by_max_tokens_is_a_tool_use_block(smol_claude, choice, max_tokens):
    """Never the call's JSON as text: a tool_use block whose input holds what the cut
    arguments say so far, stop_reason max_tokens; streamed the same."""
    request = {
        "model": "smol", "max_tokens": max_tokens, "tools": [WEATHER], "tool_choice": choice, "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    }  # fmt: skip
    whole = smol_claude.messages.create(**request)
    with smol_claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "max_tokens"
        assert [block.type for block in message.content] == ["tool_use"], message.content
        assert message.content[0].name == "get_weather" and set(message.content[0].input) <= {"city"}
    assert whole.content[0].input == streamed.content[0].input


def test_structured_output_through_the_sdks_parse(smol_claude):
    """The current SDK's messages.parse(output_format=...) sends output_config.format: the
    answer is JSON of that schema, parsed by the SDK itself."""
    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        is_capital: bool

    request = {"model": "smol", "max_tokens": 60, "messages": [{"role": "user", "content": "Describe Paris as JSON."}]}
    parsed = smol_claude.messages.parse(output_format=City, extra_body=GREEDY, **request)
    assert isinstance(parsed.parsed_output, City) and parsed.stop_reason == "end_turn"
    # The raw field and its beta name alike; the keys come in the schema's order.
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "boolean"}}, "required": ["b", "a"], "additionalProperties": False}
    for extra in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}}, {"output_format": {"type": "json_schema", "schema": schema}}):
        text = smol_claude.messages.create(**request, extra_body={**GREEDY, **extra}).content[0].text
        assert list(json.loads(text)) == ["b", "a"], text
    with pytest.raises(anthropic.BadRequestError, match="one output constraint"):
        smol_claude.messages.create(
            **request, extra_body={"output_format": {"type": "json_schema", "schema": schema}, "structured_outputs": {"json": schema}}
        )
    with pytest.raises(anthropic.BadRequestError, match="effort"):
        smol_claude.messages.create(**request, extra_body={"output_config": {"effort": "high"}})
