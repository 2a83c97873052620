"""The harmony format (gpt-oss): rendering conversations and parsing outputs, on the format's
own strings: the system message with the reasoning effort, developer instructions and
function tools, multi-turn history with reasoning and tool calls, and outputs split into
reasoning, answer and calls whole and delta by delta (however the text is cut)."""

from __future__ import annotations

import datetime

import pytest

from pagellm.entrypoints.harmony.parse import FINAL, HarmonyParser, parse_harmony
from pagellm.entrypoints.harmony.render import render_conversation, typescript_type

DAY = datetime.date(2025, 6, 28)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            },
            "required": ["location"],
        },
    },
}
LOCATION = {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}}


def test_system_developer_and_tools_as_the_format_declares_them():
    messages = [{"role": "system", "content": "Always respond in riddles"}, {"role": "user", "content": "What is the weather like in SF?"}]
    prompt = render_conversation(messages, [WEATHER, LOCATION], "high", today=DAY)
    assert prompt == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAlways respond in riddles\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n"
        "// Gets the current weather in the provided location.\n"
        "type get_current_weather = (_: {\n"
        "// The city and state, e.g. San Francisco, CA\n"
        "location: string,\n"
        'format?: "celsius" | "fahrenheit", // default: celsius\n'
        "}) => any;\n\n"
        "// Gets the location of the user.\n"
        "type get_location = () => any;\n\n"
        "} // namespace functions<|end|>"
        "<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant"
    )


def test_no_tools_no_instructions_and_each_effort():
    for effort in ("low", "medium", "high"):
        prompt = render_conversation([{"role": "user", "content": "Hi"}], reasoning_effort=effort, today=DAY)
        assert f"Reasoning: {effort}\n" in prompt and "developer" not in prompt and "Calls to these tools" not in prompt
        assert prompt.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    with pytest.raises(ValueError, match="reasoning effort"):
        render_conversation([{"role": "user", "content": "Hi"}], reasoning_effort="extreme")


def test_multi_turn_history_with_calls_results_and_reasoning():
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},  # answered: its reasoning is dropped
        {"role": "user", "content": "Weather in Tokyo?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_current_weather", "arguments": '{"location":"Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 20}'},
    ]  # fmt: skip
    prompt = render_conversation(messages, [WEATHER], "medium", today=DAY)
    turns = prompt.split("<|end|><|start|>user")[1:]
    assert turns[0] == "<|message|>What is 2 + 2?<|end|><|start|>assistant<|channel|>final<|message|>4"
    assert "Simple sum." not in prompt
    assert turns[1] == (
        "<|message|>Weather in Tokyo?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>{"location":"Tokyo"}<|call|>'
        '<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>{"temperature": 20}<|end|>'
        "<|start|>assistant"
    )


def test_schemas_become_typescript_types():
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}},
        "c": {"type": ["string", "null"]}, "d": {"anyOf": [{"type": "number"}, {"type": "boolean"}]},
        "e": {"type": "object", "properties": {"x": {"type": "boolean", "description": "inner"}}},
    }}  # fmt: skip
    assert typescript_type(schema) == (
        "{\na: number,\nb?: string[],\nc?: string | null,\nd?: number | boolean,\ne?: {\n  // inner\n  x?: boolean,\n},\n}"
    )


OUTPUTS = {
    "answer": ("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!<|return|>",
               "The user greets.", "Hello there!", []),
    "call": ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_current_weather "
             '<|constrain|>json<|message|>{"location":"SF"}<|call|>', "Need weather.", None, [("get_current_weather", '{"location":"SF"}')]),
    # The recipient may sit in the role part of the header, before the channel.
    "recipient first": ('<|start|>assistant to=functions.get_location<|channel|>commentary json<|message|>{}<|call|>', None, None,
                        [("get_location", "{}")]),
    "preamble then call": ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.f "
                           "<|constrain|>json<|message|>{}<|call|>", None, "Checking.", [("f", "{}")]),
    "cut off in the answer": ("<|channel|>final<|message|>Half an ans", None, "Half an ans", []),
    "no reasoning": ("<|channel|>final<|message|>Just this.<|return|>", None, "Just this.", []),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_outputs_parse_whole_and_in_every_cut(name):
    text, reasoning, content, calls = OUTPUTS[name]
    whole = parse_harmony(text)
    assert (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.calls]) == (reasoning, content, calls)
    for step in (1, 2, 5, 11):  # deltas cut anywhere, special tokens included
        parser = HarmonyParser()
        deltas = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)] + [parser.finish()]
        assert "".join(d.reasoning for d in deltas) == (reasoning or "")
        assert "".join(d.content for d in deltas) == (content or "")
        streamed: dict[int, list[str]] = {}
        for delta in deltas:
            for index, call_name, arguments in delta.calls:
                streamed.setdefault(index, [call_name, ""])[1] += arguments
        assert [tuple(v) for _, v in sorted(streamed.items())] == calls
        assert not any("<|" in d.reasoning + d.content for d in deltas)


def test_a_continued_final_answer_starts_in_its_content():
    parsed = parse_harmony(" Paris.<|return|>", open_channel=FINAL)
    assert (parsed.reasoning, parsed.content) == (None, " Paris.")
