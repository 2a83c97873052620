"""Sleep and wake-up (LLMEngine.sleep / LLM.sleep): the same tokens after as before, memory
handed back, the device's prefix cache forgotten and the disk tier's kept, a request
waking a sleeping engine."""

from __future__ import annotations

import random

import pytest
from hf_models import make_tiny_hf_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.errors import InvalidRequestError
from pagellm.metrics.resident_memory import read_resident_memory

rng = random.Random(5)
PROMPT = [rng.randrange(3, 256) for _ in range(40)]  # two full blocks of 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # noqa: ANN201
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("sleep-model"), "llama", seed=4))


def greedy(llm: LLM, prompt: list[int] = PROMPT):  # noqa: ANN201 - RequestOutput
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]


def test_the_same_tokens_after_each_level_and_a_request_wakes_the_engine(tiny):
    llm = LLM(tiny, dtype="float32", max_model_len=128)
    before = greedy(llm)
    assert greedy(llm).num_cached_tokens == 32  # the prompt's two blocks are a prefix hit now
    for level in (1, 2):
        llm.sleep(level)
        assert llm.engine.sleep_level == level and llm.engine.executor.driver.runner is None
        assert (llm.engine.executor.driver.model is None) == (level == 2)
        after = greedy(llm)  # the request wakes it
        assert llm.engine.sleep_level is None
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
        assert after.num_cached_tokens == 0  # the KV blocks it cached are gone with the cache
    llm.sleep(1)
    llm.wake_up()
    assert greedy(llm).outputs[0].token_ids == before.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="level must be 1 or 2"):
        llm.sleep(3)
    llm.engine.add_request("in-flight", PROMPT, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="in flight"):
        llm.sleep(1)
    llm.engine.abort_request("in-flight")
    llm.shutdown()


def test_the_disk_tier_keeps_the_prefix_cache_across_a_sleep(tiny, tmp_path):
    llm = LLM(tiny, dtype="float32", max_model_len=128, kv_offload_path=str(tmp_path / "tier"))
    before = greedy(llm)
    llm.sleep(1)
    after = greedy(llm)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert after.num_cached_tokens == after.metrics.num_tier_cached_tokens == 32  # loaded from the tier
    llm.shutdown()


def test_level_2_hands_the_weights_memory_back(smollm2_path):
    llm = LLM(str(smollm2_path), max_model_len=256)
    before = greedy(llm, list(range(100, 140)))
    weights = dict(llm.engine.executor_report.memory)["weights"]
    resident = read_resident_memory()
    if resident is None:
        pytest.skip("no /proc/self/status here")
    llm.sleep(2)
    asleep = read_resident_memory()
    assert resident.total - asleep.total > 0.8 * weights, (resident, asleep, weights)
    assert greedy(llm, list(range(100, 140))).outputs[0].token_ids == before.outputs[0].token_ids
    llm.shutdown()
