"""Entrypoints stage: HTTP: why a request's prompt was (not) served from the prefix cache,
against an earlier answer the client names, as the hosted APIs' diagnostics do:

- Responses: `prompt_cache_options.comparison_response_id` -> `prompt_cache_diagnostics`
  {status: cache_hit | cache_miss | comparison_response_not_found | unavailable,
  cache_missed_tokens, reason};
- Messages: `diagnostics.previous_message_id` -> `diagnostics.cache_miss_reason`
  (model_changed, system_changed, tools_changed, messages_changed,
  previous_message_not_found, unavailable);
- chat completions: `prompt_cache_options.comparison_id` -> `prompt_cache_diagnostics`.

Every answer's prompt is remembered (its token ids, the model or adapter, and the parts a
client changes: system, tools, messages), the most recent `capacity` of them. Then, once
the new request ran, what its prompt shares with the earlier one (whole blocks, up to
the first token where they differ) is what the cache could have served; what it did
serve is the request's cached tokens. A miss names the request-side change where there
is one, and otherwise the engine's side: the blocks were evicted from the KV cache (and,
with a disk tier, not found there either).
"""

from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


@dataclass(frozen=True)
class PromptRecord:
    """What an answered request's prompt was made of."""

    model: str  # the served name, or the LoRA adapter's
    prompt_ids: array = field(repr=False)  # array("i")
    system: str = ""
    tools: str = ""
    messages: tuple[str, ...] = ()  # each message's canonical JSON

    @classmethod
    def of(cls, model: str, prompt_ids: list[int], system: Any = None, tools: Any = None, messages: Any = ()) -> PromptRecord:
        return cls(model, array("i", prompt_ids), canonical(system), canonical(tools), tuple(canonical(m) for m in messages))


class PromptRecords:
    """The most recent answers' prompts, by answer id (least recently stored evicted first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, PromptRecord] = OrderedDict()

    def put(self, answer_id: str, record: PromptRecord) -> None:
        self._records[answer_id] = record
        self._records.move_to_end(answer_id)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    def get(self, answer_id: str) -> PromptRecord | None:
        return self._records.get(answer_id)


@dataclass(frozen=True)
class Diagnosis:
    status: str  # "cache_hit", "cache_miss", "not_found", "unavailable"
    change: str | None  # what the request changed: model_changed, system_changed, tools_changed, messages_changed
    engine_reason: str | None  # on the engine's side: evicted, tier_miss
    cached_tokens: int = 0
    cache_missed_tokens: int = 0  # of the shared whole blocks, those the cache did not serve
    first_divergent_token: int | None = None  # where the prompts first differ (None: one is a prefix of the other)
    reusable_tokens: int = 0  # the shared whole blocks: what the cache could have served

    @property
    def reason(self) -> str | None:
        return self.change or self.engine_reason


def _shared_prefix(first: array, second: array) -> int:
    limit = min(len(first), len(second))
    if first[:limit] == second[:limit]:
        return limit
    low, high = 0, limit  # the first difference, by halving (the prefixes compare in C)
    while low < high:
        middle = (low + high) // 2
        if first[: middle + 1] == second[: middle + 1]:
            low = middle + 1
        else:
            high = middle
    return low


def diagnose(
    previous: PromptRecord | None, current: PromptRecord, num_cached_tokens: int, block_size: int,
    prefix_caching: bool, has_tier: bool,
) -> Diagnosis:  # fmt: skip
    """`current` ran and `num_cached_tokens` of its prompt came from the prefix cache."""
    if not prefix_caching:
        return Diagnosis("unavailable", None, None, num_cached_tokens)
    if previous is None:
        return Diagnosis("not_found", None, None, num_cached_tokens)
    shared = _shared_prefix(previous.prompt_ids, current.prompt_ids)
    divergent = shared if shared < min(len(previous.prompt_ids), len(current.prompt_ids)) else None
    # The prompt's last token is always computed; the cache serves whole blocks.
    cacheable = min(shared, len(current.prompt_ids) - 1) // block_size * block_size
    change = _change(previous, current)
    if cacheable and num_cached_tokens >= cacheable:  # (tokens cached from other prompts say nothing here)
        return Diagnosis("cache_hit", None, None, num_cached_tokens, 0, divergent, cacheable)
    missed = max(cacheable - num_cached_tokens, 0)
    engine_reason = None
    if change is None:
        # Nothing changed on the request's side: the blocks left the cache, or the prompts
        # share less than a whole block.
        engine_reason = ("tier_miss" if has_tier else "evicted") if missed else "shared_prefix_under_a_block"
    return Diagnosis("cache_miss", change, engine_reason, num_cached_tokens, missed, divergent, cacheable)


def _change(previous: PromptRecord, current: PromptRecord) -> str | None:
    if previous.model != current.model:
        return "model_changed"
    if previous.system != current.system:
        return "system_changed"
    if previous.tools != current.tools:
        return "tools_changed"
    if current.messages[: len(previous.messages)] != previous.messages:
        return "messages_changed"
    return None


class DiagnosticsService:
    """The server's prompt records and how it diagnoses against them."""

    def __init__(self, capacity: int, block_size: int, prefix_caching: bool, has_tier: bool) -> None:
        self.records = PromptRecords(capacity)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.has_tier = has_tier

    def record(self, answer_id: str, record: PromptRecord, num_cached_tokens: int, compare_with: str | None) -> Diagnosis | None:
        """Remember this answer's prompt; the diagnosis against `compare_with`'s when asked."""
        diagnosis = None
        if compare_with is not None:
            diagnosis = diagnose(
                self.records.get(compare_with), record, num_cached_tokens, self.block_size, self.prefix_caching, self.has_tier
            )
        self.records.put(answer_id, record)
        return diagnosis


# OpenAI's reasons for a request-side change (instructions and messages are its input).
_OPENAI_REASONS = {"model_changed": "model_changed", "tools_changed": "tools_changed",
                   "system_changed": "input_changed", "messages_changed": "input_changed"}  # fmt: skip


def responses_diagnostics(diagnosis: Diagnosis) -> dict[str, Any]:
    """OpenAI's `prompt_cache_diagnostics` (tagged by `type`), with pagellm's further fields:
    `detail` (the precise reason: system_changed, evicted, tier_miss, ...), `cached_tokens`,
    `first_divergent_token`. A miss on the engine's side has pagellm's reason."""
    extras = {"cached_tokens": diagnosis.cached_tokens, "first_divergent_token": diagnosis.first_divergent_token}
    if diagnosis.status == "not_found":
        return {"type": "comparison_response_not_found"}
    if diagnosis.status == "unavailable":
        return {"type": "unavailable"}
    if diagnosis.status == "cache_hit":
        return {"type": "cache_hit", **extras}
    reason = _OPENAI_REASONS.get(diagnosis.change or "", diagnosis.reason)
    return {
        "type": "cache_miss", "cache_missed_tokens": diagnosis.cache_missed_tokens, "reason": reason,
        "comparison_reusable_tokens": diagnosis.reusable_tokens, "detail": diagnosis.reason, **extras,
    }  # fmt: skip


def messages_diagnostics(diagnosis: Diagnosis | None, previous_message_id: str | None) -> dict[str, Any]:
    """Anthropic's `diagnostics`: `cache_miss_reason` an object tagged by `type` in its
    vocabulary where the request changed (or nothing could be compared), null otherwise: as
    Anthropic's API, whose comparison is of the requests' structure, a miss on the engine's
    side (the blocks evicted, the tier without them) leaves it null and shows in the usage.
    pagellm's further fields: `detail` (a miss's precise reason, the engine's included) with
    `cache_missed_input_tokens`, `cached_tokens`, `first_divergent_token`. No previous message:
    opted in, nothing to compare."""
    answer: dict[str, Any] = {"cache_miss_reason": None, "previous_message_id": previous_message_id}
    if diagnosis is None:
        return answer
    if diagnosis.status == "not_found":
        answer["cache_miss_reason"] = {"type": "previous_message_not_found"}
    elif diagnosis.status == "unavailable":
        answer["cache_miss_reason"] = {"type": "unavailable"}
    elif diagnosis.status == "cache_miss":
        if diagnosis.change is not None:
            answer["cache_miss_reason"] = {"type": diagnosis.change, "cache_missed_input_tokens": diagnosis.cache_missed_tokens}
        answer.update(detail=diagnosis.reason, cache_missed_input_tokens=diagnosis.cache_missed_tokens)
    answer.update(cached_tokens=diagnosis.cached_tokens, first_divergent_token=diagnosis.first_divergent_token)
    return answer
