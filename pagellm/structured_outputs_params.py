"""Request-level output constraints (input stage): JSON schema, JSON object, regex, choice
or grammar, with vLLM's names. Pure Python (no torch): the scheduler reads requests.

Exactly one constraint per request. The grammar engine (pagellm/structured/) compiles it;
what can only be checked by compiling (a schema the engine cannot express, a regex or
grammar that does not parse) is refused there, before the request is queued.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagellm.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class ThinkBlock:
    """A think block the output may open with, which the constraint leaves free: the
    constraint applies to the answer after the block's end tag (and the newlines after it).

    opened: the prompt opened the block, so the output starts inside it.
    required: the output's text up to the end tag is reasoning whether or not it writes the
    start tag first (DeepSeek-R1); otherwise the block is optional and, when the output does
    not open with the start tag, the constraint applies from the first token (Qwen3).
    """

    start: str = "<think>"
    end: str = "</think>"
    opened: bool = False
    required: bool = False

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise InvalidRequestError("a think block needs a start and an end tag", "structured_outputs")


@dataclass(frozen=True)
class HarmonyAnswer:
    """The message a constraint holds in a harmony output (gpt-oss): the analysis messages
    before it are the model's own, then the answer's header is written for it: the final
    channel, or a call (commentary to=functions.NAME, JSON) to one of `recipients`."""

    channel: str = "final"
    recipients: tuple[str, ...] = ()


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output.

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object;
    regex: the whole output matches it; choice: the output is one of these strings;
    grammar: a context-free grammar in GBNF (llama.cpp's) or Lark syntax.
    """

    json: str | Mapping[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    # The constraint starts after this block: a think block, or a harmony output's analysis
    # messages and the answer's header.
    after_think: ThinkBlock | HarmonyAnswer | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, Mapping):
            object.__setattr__(self, "json", _canonical_json(self.json, "json"))
        elif isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", "json") from None
            if not isinstance(parsed, (dict, bool)):
                raise InvalidRequestError("a JSON schema must be a JSON object", "json")
            object.__setattr__(self, "json", _canonical_json(parsed, "json"))
        elif self.json is not None:
            raise InvalidRequestError("json must be a JSON schema (an object or its text)", "json")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError("choice must be a list of strings", "choice")
            if not self.choice:
                raise InvalidRequestError("choice must name at least one string", "choice")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"{name} must be a non-empty string", name)
        given = self.kinds
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise InvalidRequestError(
                f"structured outputs take exactly one of {', '.join(KINDS)} (given: {named})", "structured_outputs"
            )

    @property
    def kinds(self) -> list[str]:
        return [k for k in KINDS if (getattr(self, k) is True if k == "json_object" else getattr(self, k) is not None)]

    @property
    def kind(self) -> str:
        return self.kinds[0]

    @property
    def text(self) -> str:
        """The constraint as the grammar engine reads it ("" for any JSON object)."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(list(self.choice or ()))
        return str(getattr(self, kind))

    @property
    def key(self) -> tuple[str, str, ThinkBlock | HarmonyAnswer | None]:
        """What identifies the compiled grammar (the cache key)."""
        return self.kind, self.text, self.after_think


def _canonical_json(value: Any, parameter: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"the JSON schema cannot be serialized: {e}", parameter) from None
