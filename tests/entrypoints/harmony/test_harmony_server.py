"""A harmony model (gpt-oss) behind the server, through the openai and anthropic clients.

The model is a tiny random gpt-oss whose tokenizer has harmony's special tokens; its output
is forced with a grammar (Lark, harmony's markers as special tokens) that applies from the
first output token (`enable_in_reasoning`), so every answer is known: the analysis channel
must come back as chat's `reasoning_content`, Responses' reasoning item and Messages'
thinking block, the final channel as the content, a call to a function as a tool call, whole
and streamed. A second server shows a response_format holding the final channel only (the
analysis before it free), with the channel steered by a logit bias."""

from __future__ import annotations

import json
import signal

import pytest
from hf_models import make_tiny_harmony_model
from serve_helpers import ServerProcess

ANALYSIS = "the user asks the capital"
ANSWER = "Paris is the capital."
SAYS = (f'start: <|channel|> "analysis" <|message|> "{ANALYSIS}" <|end|> <|start|> "assistant" '
        f'<|channel|> "final" <|message|> "{ANSWER}" <|return|>')  # fmt: skip
ARGUMENTS = '{"city": "Paris"}'
CALLS = ('start: <|channel|> "analysis" <|message|> "need weather" <|end|> <|start|> "assistant" '
         f'<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> {json.dumps(ARGUMENTS)} <|call|>')  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return make_tiny_harmony_model(tmp_path_factory.mktemp("harmony"))


@pytest.fixture(scope="module")
def forced_server(model_folder):  # noqa: ANN001, ANN201
    process = ServerProcess(["--model", str(model_folder), "--served-model-name", "oss", "--max-model-len", "2048",
                             "--structured-outputs-config", '{"enable_in_reasoning": true}'])  # fmt: skip
    yield process
    assert process.stop(signal.SIGINT) == 0, process.log


def _openai(server: ServerProcess):  # noqa: ANN202
    import openai

    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0, timeout=120)


def test_chat_reasoning_and_answer_whole_and_streamed(forced_server):
    extra = {"structured_outputs": {"grammar": SAYS}}
    with _openai(forced_server) as client:
        whole = client.chat.completions.create(model="oss", messages=MESSAGES, max_tokens=200, extra_body=extra)
        chunks = list(client.chat.completions.create(model="oss", messages=MESSAGES, max_tokens=200, extra_body=extra, stream=True))
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (ANALYSIS, ANSWER)
    assert whole.choices[0].finish_reason == "stop" and not message.tool_calls
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == ANALYSIS
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_tool_call_whole_and_streamed(forced_server):
    extra = {"structured_outputs": {"grammar": CALLS}}
    with _openai(forced_server) as client:
        whole = client.chat.completions.create(model="oss", messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body=extra)
        chunks = list(client.chat.completions.create(model="oss", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                     extra_body=extra, stream=True))  # fmt: skip
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "need weather"
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS) and call.id
    entries = [entry for c in chunks if c.choices for entry in c.choices[0].delta.tool_calls or []]
    assert entries[0].id and entries[0].function.name == "get_weather"
    assert "".join(e.function.arguments or "" for e in entries) == ARGUMENTS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The call's result goes back in harmony's shape; the prompt grows by it.
    follow = [*MESSAGES, choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    with _openai(forced_server) as client:
        answer = client.chat.completions.create(model="oss", messages=follow, tools=TOOLS, max_tokens=200,
                                                extra_body={"structured_outputs": {"grammar": SAYS}})  # fmt: skip
    assert answer.choices[0].message.content == ANSWER
    assert answer.usage.prompt_tokens > whole.usage.prompt_tokens


def test_reasoning_effort_reaches_the_system_message(forced_server):
    extra = {"structured_outputs": {"grammar": SAYS}}
    with _openai(forced_server) as client:
        counts = {effort: client.chat.completions.create(model="oss", messages=MESSAGES, max_tokens=200, extra_body=extra,
                                                         reasoning_effort=effort).usage.prompt_tokens
                  for effort in ("low", "medium", "high")}  # fmt: skip
        response = client.responses.create(model="oss", input="Hi", reasoning={"effort": "high"}, max_output_tokens=200,
                                           extra_body=extra)  # fmt: skip
        low = client.responses.create(model="oss", input="Hi", reasoning={"effort": "low"}, max_output_tokens=200, extra_body=extra)
    # One token per byte: "Reasoning: low" / "medium" / "high" in the system message.
    assert counts["medium"] - counts["low"] == 3 and counts["high"] - counts["low"] == 1
    assert response.usage.input_tokens - low.usage.input_tokens == 1


def test_responses_reasoning_item_message_and_call(forced_server):
    with _openai(forced_server) as client:
        response = client.responses.create(model="oss", input=MESSAGES[1]["content"], max_output_tokens=200,
                                           extra_body={"structured_outputs": {"grammar": SAYS}})  # fmt: skip
        called = client.responses.create(model="oss", input=MESSAGES[1]["content"], max_output_tokens=200,
                                         tools=[{"type": "function", **TOOLS[0]["function"]}],
                                         extra_body={"structured_outputs": {"grammar": CALLS}})  # fmt: skip
        events = list(client.responses.create(model="oss", input=MESSAGES[1]["content"], max_output_tokens=200, stream=True,
                                              extra_body={"structured_outputs": {"grammar": SAYS}}))  # fmt: skip
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == ANALYSIS and response.output_text == ANSWER
    calls = [item for item in called.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", ARGUMENTS)]
    completed = events[-1].response
    assert [item.type for item in completed.output] == ["reasoning", "message"] and completed.output_text == ANSWER


def test_messages_thinking_text_and_tool_use(forced_server):
    import anthropic

    with anthropic.Anthropic(base_url=forced_server.base_url, api_key="none", max_retries=0, timeout=120) as client:
        message = client.messages.create(model="oss", max_tokens=200, messages=MESSAGES[1:], system="Be brief.",
                                         extra_body={"structured_outputs": {"grammar": SAYS}})  # fmt: skip
        tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": TOOLS[0]["function"]["parameters"]}
        called = client.messages.create(model="oss", max_tokens=200, messages=MESSAGES[1:], tools=[tool],
                                        extra_body={"structured_outputs": {"grammar": CALLS}})  # fmt: skip
        with client.messages.stream(model="oss", max_tokens=200, messages=MESSAGES[1:],
                                    extra_body={"structured_outputs": {"grammar": SAYS}}) as stream:  # fmt: skip
            streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", ANALYSIS), ("text", ANSWER)]
    assert message.stop_reason == "end_turn"
    uses = [b for b in called.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"})] and called.stop_reason == "tool_use"
    assert [b.type for b in streamed.content] == ["thinking", "text"] and streamed.content[1].text == ANSWER


@pytest.fixture(scope="module")
def server(model_folder):  # noqa: ANN001, ANN201
    process = ServerProcess(["--model", str(model_folder), "--served-model-name", "oss", "--max-model-len", "2048"])
    yield process
    assert process.stop(signal.SIGINT) == 0, process.log


def test_response_format_holds_the_final_channel(server):
    """By default a constraint holds the answer's message: the grammar writes its header
    after any analysis; a logit bias on 'f' (102) picks the final channel over analysis."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": False}
    with _openai(server) as client:
        whole = client.chat.completions.create(
            model="oss", messages=MESSAGES, max_tokens=60, logit_bias={"102": 100},
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )  # fmt: skip
    message = whole.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    try:
        answer = json.loads(message.content)
    except ValueError:
        raise AssertionError(f"not one JSON object: {message.content!r}") from None
    assert isinstance(answer["answer"], int), message.content
    assert whole.choices[0].finish_reason == "stop"


def test_tokenize_renders_harmony_as_chat_does(forced_server):
    import httpx2

    tokens = httpx2.post(forced_server.base_url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    text = httpx2.post(forced_server.base_url + "/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    # /detokenize skips the special tokens: what is left is the messages' roles and texts.
    assert text.startswith("systemYou are ChatGPT") and text.endswith("userWhat is the capital of France?assistant")
    assert "Reasoning: medium" in text and "developer# Instructions\n\nBe brief." in text
    with _openai(forced_server) as client:
        chat = client.chat.completions.create(model="oss", messages=MESSAGES, max_tokens=200,
                                              extra_body={"structured_outputs": {"grammar": SAYS}})  # fmt: skip
    assert chat.usage.prompt_tokens == len(tokens)
