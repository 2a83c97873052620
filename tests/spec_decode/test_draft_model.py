"""Draft-model speculative decoding (tiny random models, float32): greedy tokens identical
to decoding without speculation with the target as its own draft (every proposal
accepted) and with an unrelated draft (almost none), alone and in batches, under
chunked prefill, preemption (recompute and swap) and prefix caching; sampled tokens
follow the distribution without speculation (5 sigma); bad drafts are refused at start."""

import math
from collections import Counter

import pytest
from engine_checks import assert_engine_drained

import pagellm.spec_decode.speculator as speculator_module
from pagellm import LLM, SamplingParams
from pagellm.errors import ConfigError

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(40, 70)), [100 + i % 7 for i in range(25)]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from hf_models import make_tiny_hf_checkpoint

    target = str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("target"), seed=5))
    other = str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("draft"), seed=6, num_hidden_layers=1))
    return target, other


@pytest.fixture
def always_propose(monkeypatch):
    # The policy would decline proposals that cost more than they save (a draft as large
    # as the target always does on a CPU); here every proposal must be verified.
    monkeypatch.setattr(speculator_module, "best_num_tokens", lambda acceptance, ratio, k: k)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def spec(draft: str, k: int = 3) -> dict:
    return {"model": draft, "num_speculative_tokens": k}


@pytest.mark.parametrize("own_draft", [True, False], ids=["target-as-draft", "other-draft"])
@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 16, "enable_chunked_prefill": True},
        {"num_gpu_blocks_override": 9, "block_size": 16},
        {"num_gpu_blocks_override": 9, "block_size": 16, "preemption_mode": "swap", "swap_space": 0.01},
    ],
    ids=["plain", "chunked", "preempt-recompute", "preempt-swap"],
)
def test_greedy_tokens_are_those_without_speculation(models, always_propose, own_draft, engine_args):
    target, other = models
    plain_llm = LLM(target, max_model_len=128, **engine_args)
    alone = [greedy(plain_llm, [p])[0] for p in PROMPTS]
    together = greedy(plain_llm, PROMPTS)
    llm = LLM(target, max_model_len=128, speculative_config=spec(target if own_draft else other), **engine_args)
    assert [greedy(llm, [p])[0] for p in PROMPTS] == alone
    assert greedy(llm, PROMPTS) == together  # the prompts are cached now: prefix hits
    stats = llm.engine.speculator.stats
    assert stats.num_verifications > 0
    if own_draft:  # float32, the same weights: the draft's argmax is the target's
        assert stats.num_accepted == stats.num_proposed
    else:
        assert stats.num_accepted < stats.num_proposed / 2
    scheduler_stats = llm.engine.get_stats()
    if "num_gpu_blocks_override" in engine_args:
        assert scheduler_stats.num_preemptions_recompute + scheduler_stats.num_preemptions_swap > 0
    else:
        assert scheduler_stats.num_prefix_hit_tokens > 0
    assert_engine_drained(llm)


@pytest.mark.parametrize("own_draft", [True, False], ids=["target-as-draft", "other-draft"])
def test_sampled_tokens_follow_the_distribution_without_speculation(models, always_propose, own_draft):
    target, other = models
    prompt = [10, 20, 30, 40]
    params = SamplingParams(temperature=1.0, top_k=8, top_p=0.9, max_tokens=4, ignore_eos=True)
    draws = 1500
    plain_llm = LLM(target, max_model_len=128, max_num_seqs=256)
    plain = [list(o.outputs[0].token_ids) for o in plain_llm.generate([prompt] * draws, params, use_tqdm=False)]
    config = {**spec(target if own_draft else other, k=2), "disable_by_batch_size": 100000}
    llm = LLM(target, max_model_len=128, max_num_seqs=256, speculative_config=config)
    drafted = [list(o.outputs[0].token_ids) for o in llm.generate([prompt] * draws, params, use_tqdm=False)]
    stats = llm.engine.speculator.stats
    assert stats.num_verifications >= draws  # each request verifies at least once
    if own_draft:  # q = p: rejection is rare (only through the random draws)
        assert stats.num_accepted > 0.9 * stats.num_proposed
    else:
        assert 0 < stats.num_accepted < 0.9 * stats.num_proposed
    for position in range(4):
        a = Counter(tokens[position] for tokens in plain)
        b = Counter(tokens[position] for tokens in drafted)
        for token in set(a) | set(b):
            pa, pb = a[token] / draws, b[token] / draws
            pooled = (a[token] + b[token]) / (2 * draws)
            sigma = math.sqrt(max(pooled * (1 - pooled), 1e-12) * 2 / draws)
            assert abs(pa - pb) <= 5 * sigma + 1e-9, (position, token, pa, pb)
    assert_engine_drained(llm)


def test_seeded_sampling_repeats_with_a_draft(models, always_propose):
    target, other = models
    llm = LLM(target, max_model_len=128, speculative_config=spec(other))
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert llm.engine.speculator.stats.num_verifications > 0
    assert_engine_drained(llm)


def test_bad_drafts_are_refused_at_start(models, tmp_path):
    from hf_models import make_tiny_hf_checkpoint

    target, other = models
    wide = str(make_tiny_hf_checkpoint(tmp_path / "wide", seed=1, vocab_size=300))
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens, the target 256"):
        LLM(target, max_model_len=128, speculative_config=spec(wide))
    with pytest.raises(ConfigError, match="tensor_parallel_size 1 only"):
        LLM(target, max_model_len=128, tensor_parallel_size=2, speculative_config=spec(other))
    with pytest.raises(ConfigError, match="needs method 'draft_model' and a model path"):
        LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="takes no model"):
        LLM(target, speculative_config={"method": "ngram", "model": other, "num_speculative_tokens": 2})
    with pytest.raises(Exception, match="does not exist"):
        LLM(target, speculative_config=spec(str(tmp_path / "missing")))
