"""Entrypoints stage: HTTP: OpenAI tool calling on /v1/chat/completions.

- `tool_choice` "required" and a named function are enforced by a constraint: the
  output is a JSON array of `{"name", "arguments"}` calls of offered functions (one call
  unless parallel_tool_calls), or the named function's arguments object, each checked
  against the function's parameter schema as it is generated.
- "auto" lets the model choose. The tools reach the model through its chat template
  where the template takes `tools`; otherwise (and for conversations that carry tool
  calls and results) they are written in the Hermes format, which Qwen2.5, Hermes and
  many other templates use: a system message listing the functions, calls as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and results as
  `<tool_response>...</tool_response>`. The output is parsed for such calls.
- "none" (or no tools) is plain chat.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall
from pagellm.structured_outputs_params import StructuredOutputsParams
from pagellm.tokenizer import Tokenizer

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolMode:
    """How this request's tools are handled: "none", "auto", "required" or "named"."""

    kind: str
    name: str | None = None  # the named function


def tool_mode(request: ChatCompletionRequest) -> ToolMode:
    tools = request.tools or []
    choice = request.tool_choice
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique.", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(
                400, f"tool_choice names function {choice.function.name!r}, which is not in tools ({names}).",
                param="tool_choice",
            )  # fmt: skip
        return ToolMode("named", choice.function.name)
    if choice == "required" and not tools:
        raise APIError(400, 'tool_choice "required" needs tools.', param="tool_choice")
    if not tools or choice == "none":
        return ToolMode("none")
    return ToolMode(choice or "auto")


def tool_constraint(request: ChatCompletionRequest, mode: ToolMode) -> StructuredOutputsParams | None:
    """The output constraint that enforces "required" or a named function."""
    functions = {t.function.name: t.function.parameters or _NO_ARGUMENTS for t in request.tools or []}
    if mode.kind == "named":
        assert mode.name is not None
        return StructuredOutputsParams(json=functions[mode.name])
    if mode.kind != "required":
        return None
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, parameters in functions.items()
        ]
    }
    array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not request.parallel_tool_calls:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


# ---------------------------------------------------------------------------- prompt


def template_takes_tools(tokenizer: Tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template and "tool_call" in template


def prompt_messages(
    messages: list[dict[str, Any]], request: ChatCompletionRequest | None, mode: ToolMode, native: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages (and extra template arguments) that carry tools, tool calls and tool
    results to the model (`request` None: a conversation without tools, e.g. /tokenize)."""
    offered = request.tools if request is not None and mode.kind != "none" else None
    tools = [t.model_dump(exclude_none=True) for t in offered or []]
    if native:
        return messages, ({"tools": tools} if tools else {})
    rendered = [_plain_message(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        system = (
            "You may call functions. Their signatures are in <tools></tools>:\n<tools>\n"
            f"{listing}\n</tools>\nTo call one, answer with <tool_call>{{\"name\": <function name>, "
            "\"arguments\": <arguments object>}</tool_call> (one per call)."
        )
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{system}"}
        else:
            rendered.insert(0, {"role": "system", "content": system})
    return rendered, {}


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message with tool calls or a tool result, as text any template can render."""
    content = message.get("content") or ""
    if message.get("role") == "assistant" and message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            arguments = function.get("arguments", "{}")
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:
                pass
            calls.append(f"<tool_call>{json.dumps({'name': function.get('name'), 'arguments': arguments})}</tool_call>")
        content = "\n".join([content, *calls]) if content else "\n".join(calls)
        return {"role": "assistant", "content": content}
    if message.get("role") == "tool":
        return {"role": "tool", "content": f"<tool_response>{content}</tool_response>"}
    return {**message, "content": content}


# ---------------------------------------------------------------------------- output


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, mode: ToolMode, request: ChatCompletionRequest) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output; no calls when it holds none."""
    if mode.kind == "named":
        assert mode.name is not None
        return None, [ToolCall(id=new_call_id(), function=FunctionCall(name=mode.name, arguments=text))]
    if mode.kind == "required":
        # The constraint allows nothing but the calls: never text, even cut short.
        items, rest = complete_array_items(text)
        calls = [_call(c["name"], c["arguments"]) for c in items]
        cut = _PARTIAL_CALL.match(rest)
        if cut is not None:  # cut by max_tokens inside a call whose name is whole
            calls.append(ToolCall(id=new_call_id(), function=FunctionCall(name=json.loads(f'"{cut[1]}"'), arguments=cut[2])))
        return None, calls
    if mode.kind != "auto":
        return text, []
    names = {t.function.name for t in request.tools or []}
    calls: list[ToolCall] = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") in names:
            calls.append(_call(call["name"], call.get("arguments", {})))
    if not calls:
        return text, []
    rest = _TOOL_CALL.sub("", text).strip()
    return rest or None, calls


def complete_array_items(text: str) -> tuple[list[Any], str]:
    """The whole items of a JSON array, which may be cut off after any of them (the
    constraint guarantees the rest is well formed), and the text of the item it was cut
    in ("" when none)."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    position = text.find("[") + 1
    if position == 0:
        return items, ""
    while True:
        while position < len(text) and text[position] in " \n\r\t,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return items, ""
        try:
            item, position = decoder.raw_decode(text, position)
        except ValueError:
            return items, text[position:]
        items.append(item)


def salvage_json_object(text: str) -> dict[str, Any] | None:
    """What a JSON object cut short says so far: the longest prefix that parses once its
    open strings' members are dropped and its brackets closed (None: not even "{"). A
    number or literal at the cut may be incomplete, so it is dropped too."""
    closers = _closers_by_end(text)
    for end in range(len(text), 0, -1):
        closing = closers[end]
        if closing is None:  # inside a string
            continue
        if text[end - 1] in _SCALAR_CHARS and (end == len(text) or text[end] in _SCALAR_CHARS):
            continue  # a number or literal that may go on
        try:
            value = json.loads(text[:end] + closing)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None


_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
# A call of the "required" array as the constraint writes it (no free whitespace), cut
# after its name: the name's JSON string body, and the arguments' text so far.
_PARTIAL_CALL = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": (.*)', re.DOTALL)


def _closers_by_end(text: str) -> list[str | None]:
    """For each prefix length, the brackets that close it (None inside a string)."""
    closers: list[str | None] = [""]
    stack: list[str] = []
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]" and stack:
            stack.pop()
        closers.append(None if in_string else "".join(reversed(stack)))
    return closers


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=text))


def tool_call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Streamed form: each call whole, with its index."""
    return [
        {"index": i, "id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for i, c in enumerate(calls)
    ]
