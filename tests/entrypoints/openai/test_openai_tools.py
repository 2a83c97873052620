"""Tool calling on /v1/chat/completions with the official client: "required" and a named
function are enforced (every call names an offered function and its arguments validate
against that function's schema), streamed and not; tool turns are accepted in the
conversation; the Hermes-format parser of "auto"; bad tool_choice is a 400."""

import json

import jsonschema
import openai
import pytest

from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.tool_calls import complete_array_items, parse_tool_calls, salvage_json_object, tool_mode

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_calls_validate(smol):
    one = smol.chat.completions.create(
        model="smol", messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120
    ).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    # Parallel calls: a 135M model may keep calling until max_tokens; the whole calls
    # made by then come back (finish_reason "length" says it was cut).
    several = smol.chat.completions.create(
        model="smol", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0
    ).choices[0]
    assert several.finish_reason in ("tool_calls", "length") and several.message.tool_calls
    whole = several.message.tool_calls[: -1 if several.finish_reason == "length" else None]  # the last may be cut
    for call in one.message.tool_calls + whole:
        assert call.id.startswith("call_") and call.type == "function"
        check_call(call.function.name, call.function.arguments)


def test_a_named_function_streams_its_arguments(smol):
    chunks = list(
        smol.chat.completions.create(
            model="smol", messages=QUESTION, tools=TOOLS, max_tokens=120, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    first = deltas[0].tool_calls[0]
    assert first.id and first.function.name == "get_weather"
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in deltas if d.tool_calls)
    assert sum(1 for d in deltas if d.tool_calls) > 2  # streamed piece by piece
    check_call("get_weather", arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_streamed_and_one_call_without_parallel_calls(smol):
    chunks = list(
        smol.chat.completions.create(
            model="smol", messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=120, stream=True,
        )  # fmt: skip
    )
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0].index == 0
    check_call(calls[0].function.name, calls[0].function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_turns_in_the_conversation(smol):
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    response = smol.chat.completions.create(model="smol", messages=messages, tools=TOOLS, max_tokens=30)
    assert response.choices[0].message.content


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nosuch"}}}], "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_tool_requests_are_400s(smol, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        smol.chat.completions.create(model="smol", messages=QUESTION, max_tokens=5, **kwargs)
    assert error.value.body["param"] == param, error.value.body


def test_auto_parses_hermes_tool_calls():
    request = ChatCompletionRequest(messages=QUESTION, tools=TOOLS, tool_choice="auto")
    mode = tool_mode(request)
    text = 'Let me check.\n<tool_call>{"name": "get_time", "arguments": {"timezone": "CET"}}</tool_call>\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, mode, request)
    assert content == "Let me check." and [c.function.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments) == {"timezone": "CET"}
    assert parse_tool_calls("No tools needed.", mode, request) == ("No tools needed.", [])


def test_a_cut_array_keeps_its_whole_items():
    assert complete_array_items('[{"a": 1}, {"b": [2, 3]}, {"c"') == ([{"a": 1}, {"b": [2, 3]}], '{"c"')
    assert complete_array_items('[{"a": 1}]') == ([{"a": 1}], "")
    assert complete_array_items('[{"a"') == ([], '{"a"') and complete_array_items("") == ([], "")


def test_a_required_call_cut_short_is_a_call_never_text():
    """OpenAI's answer to a forced call cut by max_tokens: the call, its arguments as far
    as they got, finish_reason "length"; cut before the name is whole, no call and no text."""
    request = ChatCompletionRequest(messages=QUESTION, tools=TOOLS, tool_choice="required")
    mode = tool_mode(request)
    assert parse_tool_calls('[{"name": "get_wea', mode, request) == (None, [])
    assert parse_tool_calls("", mode, request) == (None, [])
    content, calls = parse_tool_calls('[{"name": "get_time", "arguments": {"timezone": "UTC"}}, {"name": "get_weather", "arguments": {"ci', mode, request)
    assert content is None and [c.function.name for c in calls] == ["get_time", "get_weather"]
    assert calls[0].function.arguments == '{"timezone": "UTC"}' and calls[1].function.arguments == '{"ci'


@pytest.mark.parametrize(
    ("cut", "salvaged"),
    [
        ('{"city": "Par', {}),
        ('{"city": "Paris", "unit": "cel', {"city": "Paris"}),
        ('{"city": "Paris", "unit"', {"city": "Paris"}),
        ('{"n": 12', {}),  # the number may go on
        ('{"n": 12, "m": [1, 2, {"x": "a\\"b"}, 3', {"n": 12, "m": [1, 2, {"x": 'a"b'}]}),
        ('{"a": {"b": true}, "c": nul', {"a": {"b": True}}),
        ("", None),
        ('[1, 2', None),
    ],
)
def test_what_a_cut_object_says_so_far(cut, salvaged):
    assert salvage_json_object(cut) == salvaged


@pytest.mark.parametrize(
    ("tool_choice", "max_tokens"),  # cut inside the arguments (a named function's output is its arguments alone)
    [("required", 20), ({"type": "function", "function": {"name": "get_weather"}}, 4)],
)
def test_forced_calls_cut_by_max_tokens_come_back_as_calls(smol, tool_choice, max_tokens):
    for stream in (False, True):
        kwargs = {"model": "smol", "messages": QUESTION, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": max_tokens}
        if stream:
            chunks = [c for c in smol.chat.completions.create(**kwargs, stream=True) if c.choices]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
            if len(calls) > 1:  # a named function's arguments stream in pieces after its opening
                assert {call.index for call in calls} == {0}
                calls[0].function.arguments = "".join(call.function.arguments or "" for call in calls)
                calls = calls[:1]
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = smol.chat.completions.create(**kwargs).choices[0]
            content, calls, finish = choice.message.content or "", choice.message.tool_calls, choice.finish_reason
        assert content == "" and finish == "length"
        assert len(calls) == 1 and calls[0].function.name in SCHEMAS
        assert calls[0].function.arguments.startswith("{")  # as far as it got
        with pytest.raises(ValueError):
            json.loads(calls[0].function.arguments)


def test_tokenize_takes_a_conversation_with_tool_turns(smol_server):
    import httpx2 as httpx

    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]  # fmt: skip
    response = httpx.post(smol_server.base_url + "/tokenize", json={"messages": messages})
    assert response.status_code == 200, response.text
    assert response.json()["count"] > 10
