"""Tokenizer stage: render a model's Jinja chat template into the prompt text.

Chat templates are written for Hugging Face's renderer, so this follows its rules: a sandboxed
environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, the helpers
`raise_exception` and `strftime_now`, and a `tojson` filter that neither escapes HTML nor
non-ASCII text (Jinja's own `tojson` does both, which would change the prompt).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagellm.errors import ChatTemplateError, InvalidRequestError

logger = logging.getLogger(__name__)

Message = Mapping[str, Any]

# Compiled templates kept; a server renders the same one or two templates for every request.
_MAX_CACHED_TEMPLATES = 32


class _TemplateRaisedError(Exception):
    """`raise_exception(...)` called by a template: the messages do not suit the template."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    Templates written for training mark the assistant's part with this tag; for inference the
    marking carries no meaning, but without the extension such templates would not compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise _TemplateRaisedError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _make_environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENVIRONMENT = _make_environment()


@functools.lru_cache(maxsize=_MAX_CACHED_TEMPLATES)
def compile_chat_template(template: str) -> jinja2.Template:
    """The compiled template (cached by its source text)."""
    try:
        return _ENVIRONMENT.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the conversation's shape and return it as a list of plain dicts.

    Every message needs a non-empty string `role` and a string `content`; `content` may be
    None only on a message that carries `tool_calls` (an assistant calling a tool), as in
    the OpenAI API.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}",
            parameter="messages",
        )
    checked: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{index}] must be a dict with 'role' and 'content', got {type(message).__name__}",
                parameter="messages",
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{index}] needs a non-empty string 'role'", parameter="messages")
        if "content" not in message:
            raise InvalidRequestError(f"messages[{index}] ({role}) has no 'content'", parameter="messages")
        content = message["content"]
        calls_a_tool = content is None and bool(message.get("tool_calls"))
        if not isinstance(content, str) and not calls_a_tool:
            raise InvalidRequestError(
                f"messages[{index}] ({role}): 'content' must be a string, got {type(content).__name__}",
                parameter="messages",
            )
        checked.append(dict(message))
    return checked


def render_chat_template(
    template: str | None,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    special_tokens: Mapping[str, str | None] | None = None,
    **extra: Any,
) -> str:
    """The prompt text for `messages` under `template`.

    `special_tokens` (bos_token, eos_token, ...) and `extra` (tools, documents, options such
    as enable_thinking) become template variables, as Hugging Face passes them.
    `continue_final_message`: the last message (an assistant's prefill) is left open, so
    that the model continues its text rather than answering it in a turn of its own.
    """
    if continue_final_message:
        if add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message continues the last message; add_generation_prompt would open a new one: "
                "set at most one of them", parameter="continue_final_message",
            )  # fmt: skip
        return _continued(template, messages, special_tokens, extra)
    if template is None:
        raise ChatTemplateError(
            "this model has no chat template, so chat messages cannot be turned into a prompt; "
            "use a plain text prompt (completions) or supply a chat template"
        )
    compiled = compile_chat_template(template)
    checked = validate_messages(messages)
    variables: dict[str, Any] = {"tools": None, "documents": None}
    variables.update({name: value for name, value in (special_tokens or {}).items() if value is not None})
    variables.update(extra)
    variables["messages"] = checked
    variables["add_generation_prompt"] = add_generation_prompt
    try:
        return compiled.render(**variables)
    except _TemplateRaisedError as e:
        raise InvalidRequestError(f"the chat template rejected the messages: {e}", parameter="messages") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed to render: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        # Templates index into messages freely; a message missing what the template expects
        # surfaces as a Python error raised inside the template.
        raise ChatTemplateError(f"the chat template failed to render these messages: {e!r}") from None


def _final_text(messages: Any) -> str:
    final = messages[-1] if isinstance(messages, list) and messages else None
    content = final.get("content") if isinstance(final, Mapping) else None
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError(
            "continue_final_message needs a last message with text to continue", parameter="messages"
        )
    return content


def _continued(template: str | None, messages: Any, special_tokens: Mapping[str, str | None] | None, extra: Any) -> str:
    """The conversation rendered closed, then cut right after the last message's text: what
    the template writes after it (an end-of-turn token, a newline) is what the model must
    not see. Templates often strip a message's outer spaces; then the cut comes after the
    stripped text."""
    final = _final_text(messages)
    rendered = render_chat_template(
        template, messages, add_generation_prompt=False, special_tokens=special_tokens, **extra
    )
    stripped = final.strip()
    at = rendered.rfind(stripped)
    if at < 0:
        raise InvalidRequestError(
            "the chat template does not write the last message's text as it is, so it cannot be continued",
            parameter="messages",
        )
    kept = final.lstrip()
    end = at + len(kept) if rendered[at : at + len(kept)] == kept else at + len(stripped)
    return rendered[:end]
