"""The whole engine against HF transformers: greedy, float32, same weights, token for token.

Sixteen+ prompts of different lengths go in together, under every scheduling regime that
changes how the work is cut up: chunked prefill at tiny budgets, a KV cache so small that
requests are preempted (recompute and swap), prefix caching over a long shared prefix,
one request at a time. Each configuration must reproduce HF's tokens exactly, and the
test counts the preemptions / prefix hits so it proves the regime really happened.
"""

import random

import pytest
from engine_checks import assert_engine_drained
from hf_models import load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy

from pagellm import LLM

NEW_TOKENS = 24
MAX_MODEL_LEN = 256


def make_prompts():
    rng = random.Random(7)
    lengths = [1, 2, 3, 5, 8, 13, 15, 16, 17, 21, 31, 32, 33, 40, 47, 64, 70]
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]
    shared = [rng.randrange(3, 256) for _ in range(50)]  # > 3 full blocks
    prompts += [shared + [rng.randrange(3, 256) for _ in range(k)] for k in (1, 5, 16, 20)]
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=3)
    ref = load_hf_reference(folder)
    expected = [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    return str(folder), expected


def run(folder, **engine_args):
    engine_args.setdefault("max_model_len", MAX_MODEL_LEN)
    llm = LLM(folder, **engine_args)
    outputs = pagellm_greedy(llm, PROMPTS, NEW_TOKENS)
    assert_engine_drained(llm)
    return llm, outputs


def test_batched_default(tiny_model):
    folder, expected = tiny_model
    _, outputs = run(folder)
    assert outputs == expected


@pytest.mark.parametrize("budget", [1, 7, 16])
def test_chunked_prefill_small_budgets(tiny_model, budget):
    folder, expected = tiny_model
    _, outputs = run(folder, max_num_batched_tokens=budget)
    assert outputs == expected


def test_max_num_seqs_one(tiny_model):
    folder, expected = tiny_model
    _, outputs = run(folder, max_num_seqs=1)
    assert outputs == expected


def test_no_chunked_prefill(tiny_model):
    folder, expected = tiny_model
    _, outputs = run(folder, enable_chunked_prefill=False)
    assert outputs == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tiny_kv_cache(tiny_model, mode):
    folder, expected = tiny_model
    # 12 usable blocks of 16 tokens; the longest request (70 + 24 tokens) needs 6 of them.
    llm, outputs = run(
        folder,
        max_model_len=96,
        num_gpu_blocks_override=13,
        preemption_mode=mode,
        swap_space=0.01,
        enable_prefix_caching=False,
    )
    assert outputs == expected
    stats = llm.engine.get_stats()
    if mode == "recompute":
        assert stats.num_preemptions_recompute > 0
    else:
        assert stats.num_preemptions_swap > 0
        assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0


def test_prefix_caching_hits_and_matches(tiny_model):
    folder, expected = tiny_model
    llm = LLM(folder, max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    # First the shared-prefix prompts one after another so later ones find the prefix cached.
    first = pagellm_greedy(llm, PROMPTS, NEW_TOKENS)
    again = pagellm_greedy(llm, PROMPTS, NEW_TOKENS)
    assert first == expected and again == expected
    stats = llm.engine.get_stats()
    # The second round hits at least the 3 shared full blocks of each of the 4 prompts.
    assert stats.num_prefix_hit_tokens >= 4 * 48
    assert_engine_drained(llm)


def test_alone_equals_in_batch(tiny_model):
    folder, expected = tiny_model
    llm = LLM(folder, max_model_len=MAX_MODEL_LEN)
    alone = [pagellm_greedy(llm, [p], NEW_TOKENS)[0] for p in PROMPTS[::5]]
    batch = pagellm_greedy(llm, PROMPTS, NEW_TOKENS)
    assert alone == batch[::5] == expected[::5]
    assert_engine_drained(llm)


@pytest.mark.parametrize(
    "knobs",
    [
        {"profile": "interactive", "max_num_batched_tokens": 24},
        {"max_num_partial_prefills": 2, "long_prefill_token_threshold": 5, "prefill_share": 0.3},
        {"scheduling_policy": "shortest-remaining", "max_num_batched_tokens": 12, "num_gpu_blocks_override": 13,
         "max_model_len": 96, "enable_prefix_caching": False},
    ],
)
def test_prefill_balance_knobs_keep_the_tokens(tiny_model, knobs):
    folder, expected = tiny_model
    llm, outputs = run(folder, **knobs)
    assert outputs == expected
    config = llm.engine.scheduler.scheduler_config
    if knobs.get("profile") == "interactive":
        # The profile fills what was left unset; an explicit budget wins.
        assert config.max_num_batched_tokens == 24 and config.max_num_partial_prefills == 1
        assert config.long_prefill_token_threshold == 256 and config.prefill_share == 0.25
