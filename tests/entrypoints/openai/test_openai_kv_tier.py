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
