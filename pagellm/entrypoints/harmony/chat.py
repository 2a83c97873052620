"""Entrypoints stage: HTTP: what a chat request becomes for a harmony model (gpt-oss), and its answer back.

A model speaks harmony when it is gpt-oss and its vocabulary has harmony's special tokens.
Then the conversation is rendered by render.py (not by the checkpoint's template), the
output is decoded with its special tokens and parsed by parse.py into reasoning, answer and
tool calls, and generation stops at `<|return|>` or `<|call|>`. The reasoning effort comes
from `reasoning_effort` (chat; `reasoning.effort` in Responses), `chat_template_kwargs`'
reasoning_effort, else medium; OpenAI's "minimal" is harmony's low.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagellm.entrypoints.harmony import tokens
from pagellm.entrypoints.harmony.parse import HarmonyDelta, HarmonyParser
from pagellm.entrypoints.harmony.render import EFFORTS, render_conversation
from pagellm.entrypoints.openai.tool_calls import new_call_id
from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs_params import HarmonyAnswer, StructuredOutputsParams
from pagellm.tokenizer import Tokenizer

HARMONY_ARCHITECTURES = ("GptOssForCausalLM", "gpt-oss")
_EFFORT_ALIASES = {"minimal": "low"}


def speaks_harmony(architecture: str, tokenizer: Tokenizer) -> bool:
    """gpt-oss with harmony's special tokens in its vocabulary, one token each."""
    return architecture in HARMONY_ARCHITECTURES and all(tokenizer.token_to_id(t) is not None for t in tokens.ALL)


def reasoning_effort(requested: str | None, template_kwargs: dict[str, Any] | None) -> str:
    effort = requested or (template_kwargs or {}).get("reasoning_effort") or "medium"
    effort = _EFFORT_ALIASES.get(str(effort), str(effort))
    return effort if effort in EFFORTS else "medium"


def harmony_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    effort: str,
    response_format: dict[str, Any] | None,
    continue_final: bool,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt; with `continue_final`, the last (assistant) message is the start of the
    final answer, left open for the model to go on with."""
    if not continue_final:
        return render_conversation(messages, tools, effort, response_format, add_generation_prompt)
    head = render_conversation(messages[:-1], tools, effort, response_format, add_generation_prompt=False)
    prefill = messages[-1].get("content") or ""
    return f"{head}{tokens.START}assistant{tokens.CHANNEL}final{tokens.MESSAGE}{prefill}"


def harmony_sampling(params: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    """The output decoded with its special tokens (the parser reads them), stopping at the
    end of the turn."""
    stops = tuple(tokenizer.token_to_id(t) for t in tokens.STOPS)
    extra = tuple(t for t in stops if t is not None and t not in params.stop_token_ids)
    return replace(params, skip_special_tokens=False, stop_token_ids=params.stop_token_ids + extra)


def answer_constraint(
    constraint: StructuredOutputsParams, tool_kind: str, tool_name: str | None, offered: tuple[str, ...]
) -> StructuredOutputsParams:
    """A request's constraint holding the answer's message, the analysis before it the
    model's own: a named tool's arguments, a call to any offered function ("required", its
    arguments a JSON object), or the final channel."""
    if tool_kind == "named":
        return replace(constraint, after_think=HarmonyAnswer("commentary", (str(tool_name),)))
    if tool_kind == "required":
        return StructuredOutputsParams(json_object=True, after_think=HarmonyAnswer("commentary", offered))
    return replace(constraint, after_think=HarmonyAnswer())


def chunk_delta(
    parser: HarmonyParser, text: str, finished: bool, with_tools: bool, call_ids: dict[int, str]
) -> dict[str, Any]:
    """A streamed chat chunk's delta for this piece of output: reasoning_content, content and
    (with tools) tool_calls, as the parser finds them; at the end, what it held back too."""
    parsed = parser.feed(text)
    if finished:
        rest = parser.finish()
        parsed = HarmonyDelta(parsed.reasoning + rest.reasoning, parsed.content + rest.content, parsed.calls + rest.calls)
    delta: dict[str, Any] = {}
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.calls and with_tools:
        delta["tool_calls"] = call_deltas(parsed, call_ids)
    return delta


def call_deltas(delta: HarmonyDelta, call_ids: dict[int, str]) -> list[dict[str, Any]]:
    """OpenAI's streamed tool_calls entries of a parser delta (a new call with its id and name)."""
    entries: list[dict[str, Any]] = []
    for index, name, arguments in delta.calls:
        if name is not None:
            call_ids[index] = new_call_id()
            entries.append({"index": index, "id": call_ids[index], "type": "function", "function": {"name": name, "arguments": arguments}})
        else:
            entries.append({"index": index, "function": {"arguments": arguments}})
    return entries
