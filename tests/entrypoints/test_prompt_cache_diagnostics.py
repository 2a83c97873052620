"""The prompt-cache diagnosis on its own: what two prompts share, what the cache served,
and the reason a miss gets."""

from __future__ import annotations

from pagellm.entrypoints.openai.prompt_cache_diagnostics import PromptRecord, PromptRecords, diagnose, messages_diagnostics, responses_diagnostics

BLOCK = 16


def record(ids, model="m", system="s", tools=None, messages=("a",)):  # noqa: ANN001, ANN201
    return PromptRecord.of(model, list(ids), system, tools, list(messages))


def run(previous, current, cached, prefix_caching=True, has_tier=False):  # noqa: ANN001, ANN201
    return diagnose(previous, current, cached, BLOCK, prefix_caching, has_tier)


def test_a_hit_a_change_and_the_engines_side():
    base = list(range(100))
    longer = record(base + [7, 8], messages=("a", "b"))
    hit = run(record(base), longer, 96)
    assert (hit.status, hit.reason, hit.reusable_tokens, hit.first_divergent_token) == ("cache_hit", None, 96, None)
    evicted = run(record(base), longer, 32)
    assert (evicted.status, evicted.reason, evicted.cache_missed_tokens) == ("cache_miss", "evicted", 64)
    assert run(record(base), longer, 32, has_tier=True).reason == "tier_miss"
    changed = run(record(base, system="x"), record([1] + base[1:]), 0)
    assert (changed.status, changed.change, changed.first_divergent_token) == ("cache_miss", "system_changed", 0)
    assert run(record(base, model="other"), longer, 0).change == "model_changed"
    assert run(record(base, tools=[{"f": 1}]), longer, 0).change == "tools_changed"
    assert run(record(base, messages=("z",)), longer, 0).change == "messages_changed"
    short = run(record(base[:10]), record(base[:12]), 0)
    assert (short.status, short.reason) == ("cache_miss", "shared_prefix_under_a_block")
    assert run(None, longer, 0).status == "not_found" and run(record(base), longer, 0, prefix_caching=False).status == "unavailable"
    # Tokens cached from some other prompt are no hit against this one.
    assert run(record([9] * 100, system="x"), longer, 48).status == "cache_miss"


def test_the_wire_shapes():
    base = list(range(100))
    miss = run(record(base, system="x"), record([1] + base[1:]), 0)
    assert responses_diagnostics(miss)["type"] == "cache_miss" and responses_diagnostics(miss)["reason"] == "input_changed"
    assert messages_diagnostics(miss, "msg_1")["cache_miss_reason"] == {"type": "system_changed", "cache_missed_input_tokens": 0}
    assert responses_diagnostics(run(None, record(base), 0)) == {"type": "comparison_response_not_found"}
    assert messages_diagnostics(None, None) == {"cache_miss_reason": None, "previous_message_id": None}
    # A miss on the engine's side: no reason in Anthropic's vocabulary (null, as its API), the
    # engine's in pagellm's detail.
    evicted = messages_diagnostics(run(record(base), record(base + [7], messages=("a", "b")), 32), "msg_1")
    assert evicted["cache_miss_reason"] is None
    assert (evicted["detail"], evicted["cache_missed_input_tokens"], evicted["cached_tokens"]) == ("evicted", 64, 32)
    assert messages_diagnostics(miss, "msg_1")["detail"] == "system_changed"


def test_the_records_keep_the_most_recent():
    records = PromptRecords(2)
    for answer in ("a", "b", "c"):
        records.put(answer, record([1, 2]))
    assert records.get("a") is None and records.get("c") is not None
