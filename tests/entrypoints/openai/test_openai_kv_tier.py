"""The prefix cache's disk tier behind the server: a conversation evicted by other
traffic comes back through the openai client with its history counted in
usage.prompt_tokens_details.cached_tokens, and /metrics shows the tier's traffic."""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator

import openai
import pytest
from serve_helpers import API_KEY, ServerProcess, engine_cli_flags, get_metrics


@pytest.fixture(scope="module")
def tier_server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tier = tmp_path_factory.mktemp("kv-tier")
    # 12 usable blocks of 16 tokens: one 70-token prompt and its answer take 5 of them.
    flags = engine_cli_flags(max_model_len=128, num_gpu_blocks_override=13)
    process = ServerProcess(["--model", tiny_model, *flags, "--kv-offload-path", str(tier)], api_key=API_KEY)
    yield process
    assert process.stop(signal.SIGINT) == 0, process.log


def test_a_returning_conversation_is_served_from_the_tier(tier_server, model_name) -> None:
    rng = random.Random(5)
    history = [rng.randrange(3, 256) for _ in range(70)]
    with openai.OpenAI(base_url=tier_server.api_url, api_key=API_KEY, max_retries=0, timeout=120) as client:

        def complete(prompt: list[int]):  # noqa: ANN202
            return client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0)

        assert complete(history).usage.prompt_tokens_details.cached_tokens == 0
        for _ in range(3):  # other traffic evicts the conversation from the KV cache
            complete([rng.randrange(3, 256) for _ in range(70)])
        returning = complete(history + [rng.randrange(3, 256) for _ in range(9)])
    # The history's 4 full blocks come back from the tier.
    assert returning.usage.prompt_tokens_details.cached_tokens == 64
    metrics = get_metrics(tier_server.api_url.removesuffix("/v1"))
    assert metrics["pagellm:kv_tier_hit_blocks_total"] == 4
    assert metrics["pagellm:kv_tier_written_blocks_total"] >= 16
    assert metrics["pagellm:kv_tier_read_bytes_total"] > 0 and metrics["pagellm:kv_tier_bytes"] > 0
    assert metrics["pagellm:kv_tier_load_seconds_count"] == 1


def test_cache_diagnostics_tell_a_tier_hit_from_a_tier_miss(model_name, tiny_model, tmp_path) -> None:
    """A conversation evicted from the KV cache and found in the tier is a hit; on a server
    whose tier holds almost nothing (--kv-offload-bytes), the same is a miss the diagnosis
    puts on the tier (pagellm's `detail`; Anthropic's cache_miss_reason stays null)."""
    anthropic = pytest.importorskip("anthropic")
    rng = random.Random(9)

    def words(count: int) -> str:
        return " ".join(f"w{rng.randrange(1000)}" for _ in range(count))

    turn, others = [{"role": "user", "content": words(12)}], [words(12) for _ in range(4)]

    def evict_and_return(server: ServerProcess) -> dict:
        with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120) as claude:
            first = claude.messages.create(model=model_name, max_tokens=2, messages=turn)
            for other in others:  # evicts the conversation from the 12-block KV cache
                claude.messages.create(model=model_name, max_tokens=2, messages=[{"role": "user", "content": other}])
            back = claude.messages.create(
                model=model_name, max_tokens=2, messages=turn, extra_body={"diagnostics": {"previous_message_id": first.id}}
            )
            return back.model_dump()["diagnostics"] | back.diagnostics.model_extra

    flags = engine_cli_flags(max_model_len=128, num_gpu_blocks_override=13)

    def tier_server_of(name: str, *extra: str) -> ServerProcess:
        # A fresh server: its tier cost rule has measured no read yet, so it loads what the
        # tier holds. (tier_server, after the test above, may have timed a slow read on a
        # busy machine against this tiny model's cheap compute, and then computes instead.)
        return ServerProcess(["--model", tiny_model, *flags, "--kv-offload-path", str(tmp_path / name), *extra], api_key=API_KEY)

    whole = tier_server_of("tier")
    try:
        found = evict_and_return(whole)
    finally:
        assert whole.stop(signal.SIGINT) == 0, whole.log
    assert found["cache_miss_reason"] is None and found["cached_tokens"] > 0  # served from the tier
    small_tier = tier_server_of("small-tier", "--kv-offload-bytes", "1")
    try:
        lost = evict_and_return(small_tier)
    finally:
        assert small_tier.stop(signal.SIGINT) == 0, small_tier.log
    # Anthropic's vocabulary has no engine-side reason (its comparison is of the requests):
    # cache_miss_reason stays null, as the SDK's types expect; pagellm's detail names the tier.
    assert lost["cache_miss_reason"] is None and lost["cached_tokens"] < found["cached_tokens"]
    assert lost["detail"] == "tier_miss" and lost["cache_missed_input_tokens"] > 0
    assert "detail" not in found
