"""Entrypoints stage: a chat conversation rendered in the harmony format (gpt-oss's prompts).

    <|start|>system<|message|>{identity, dates, Reasoning: effort, valid channels}<|end|>
    <|start|>developer<|message|># Instructions ... # Tools ... # Response Formats ...<|end|>
    <|start|>user<|message|>...<|end|>
    <|start|>assistant<|channel|>final<|message|>...<|end|>                    (an earlier answer)
    <|start|>assistant<|channel|>analysis<|message|>...<|end|>                 (reasoning before calls)
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>
    <|start|>functions.f to=assistant<|channel|>commentary<|message|>{result}<|end|>
    <|start|>assistant                                                         (the turn to write)

The system and developer messages of the chat (OpenAI's roles) become the developer
message's instructions; the system message is harmony's own, carrying the reasoning
effort. Function tools are declared as harmony declares them, a TypeScript-like type per
function in `namespace functions`, built from each JSON schema. Earlier turns' reasoning is
dropped once a final answer followed it (the model never saw its own old reasoning in
training), kept while the turn is still calling tools.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from pagellm.entrypoints.harmony import tokens

EFFORTS = ("low", "medium", "high")
KNOWLEDGE_CUTOFF = "2024-06"
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."


def render_conversation(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    reasoning_effort: str = "medium",
    response_format: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    today: datetime.date | None = None,
) -> str:
    """The prompt for `messages` (OpenAI's chat messages as dicts: role, content, tool_calls,
    tool_call_id, reasoning_content), `tools` (OpenAI's function tools) and the answer's
    `response_format` (a JSON schema's {name, schema, description}), ending in the
    assistant's open turn unless `add_generation_prompt` is false."""
    if reasoning_effort not in EFFORTS:
        raise ValueError(f"reasoning effort must be one of {EFFORTS}, not {reasoning_effort!r}")
    parts = [_message("system", system_text(reasoning_effort, bool(tools), today))]
    instructions = [_text(m) for m in messages if m.get("role") in ("system", "developer")]
    developer = developer_text(instructions, tools, response_format)
    if developer:
        parts.append(_message("developer", developer))
    turns = [m for m in messages if m.get("role") not in ("system", "developer")]
    last_final = max((i for i, m in enumerate(turns) if m.get("role") == "assistant" and m.get("content") and not m.get("tool_calls")), default=-1)
    call_names: dict[str, str] = {}
    for index, message in enumerate(turns):
        role = message.get("role")
        if role == "user":
            parts.append(_message("user", _text(message)))
        elif role == "assistant":
            reasoning = message.get("reasoning_content") or message.get("reasoning") or message.get("thinking")
            if reasoning and index > last_final:  # the current turn's reasoning, before its calls
                parts.append(_message("assistant", reasoning, channel="analysis"))
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                call_names[str(call.get("id"))] = function.get("name", "")
                header = f"{tokens.START}assistant{tokens.CHANNEL}commentary to=functions.{function.get('name', '')} {tokens.CONSTRAIN}json"
                parts.append(f"{header}{tokens.MESSAGE}{function.get('arguments') or '{}'}{tokens.CALL}")
            if message.get("content") and not message.get("tool_calls"):
                parts.append(_message("assistant", _text(message), channel="final"))
            elif message.get("content"):  # text beside calls: a preamble
                parts.append(_message("assistant", _text(message), channel="commentary"))
        elif role == "tool":
            name = message.get("name") or call_names.get(str(message.get("tool_call_id")), "tool")
            header = f"{tokens.START}functions.{name} to=assistant{tokens.CHANNEL}commentary"
            parts.append(f"{header}{tokens.MESSAGE}{_text(message)}{tokens.END}")
    if add_generation_prompt:
        parts.append(f"{tokens.START}assistant")
    return "".join(parts)


def system_text(reasoning_effort: str, has_functions: bool, today: datetime.date | None = None) -> str:
    day = (today or datetime.datetime.now(datetime.UTC).date()).isoformat()
    text = (
        f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {day}\n\n"
        f"Reasoning: {reasoning_effort}\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    )
    if has_functions:
        text += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return text


def developer_text(
    instructions: list[str], tools: list[dict[str, Any]] | None, response_format: dict[str, Any] | None = None
) -> str:
    sections = []
    if any(instructions):
        sections.append("# Instructions\n\n" + "\n\n".join(i for i in instructions if i))
    if tools:
        declarations = "\n\n".join(_function_declaration(tool.get("function", tool)) for tool in tools)
        sections.append(f"# Tools\n\n## functions\n\nnamespace functions {{\n\n{declarations}\n\n}} // namespace functions")
    if response_format:
        name = response_format.get("name") or "response"
        described = f"// {response_format['description']}\n" if response_format.get("description") else ""
        sections.append(f"# Response Formats\n\n## {name}\n\n{described}{json.dumps(response_format.get('schema') or {})}")
    return "\n\n".join(sections)


def _function_declaration(function: dict[str, Any]) -> str:
    comment = "".join(f"// {line}\n" for line in (function.get("description") or "").splitlines())
    parameters = function.get("parameters") or {}
    if not parameters.get("properties"):
        return f"{comment}type {function['name']} = () => any;"
    return f"{comment}type {function['name']} = (_: {typescript_type(parameters, 0)}) => any;"


def typescript_type(schema: dict[str, Any] | bool, depth: int = 0) -> str:
    """A JSON schema as harmony's TypeScript-like type: objects list their properties (one
    per line, a `?` where not required, descriptions as comments above, defaults after),
    enums are unions of literals, arrays `T[]`, nullable types `T | null`."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(typescript_type(option, depth) for option in schema[key])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(typescript_type({**schema, "type": k}, depth) for k in kind)
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required") or [])
        indent = "" if depth == 0 else "  " * depth
        lines = ["{"]
        for name, prop in schema["properties"].items():
            prop = prop if isinstance(prop, dict) else {}
            for line in (prop.get("description") or "").splitlines():
                lines.append(f"{indent}// {line}")
            default = f", // default: {_default_text(prop['default'])}" if "default" in prop else ","
            optional = "" if name in required else "?"
            lines.append(f"{indent}{name}{optional}: {typescript_type(prop, depth + 1)}{default}")
        lines.append(indent[:-2] + "}" if depth else "}")
        return "\n".join(lines)
    if kind == "array":
        item = typescript_type(schema.get("items", {}), depth)
        return f"({item})[]" if " | " in item else f"{item}[]"
    return {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null",
            "object": "object"}.get(str(kind), "any")  # fmt: skip


def _default_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _message(role: str, content: str, channel: str | None = None) -> str:
    header = role if channel is None else f"{role}{tokens.CHANNEL}{channel}"
    return f"{tokens.START}{header}{tokens.MESSAGE}{content}{tokens.END}"


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""
