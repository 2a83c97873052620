"""Tensor parallelism (mp executor, gloo on the CPU) against HF transformers and TP=1.

Every run splits a tiny random model over worker processes and must reproduce HF's greedy
tokens exactly (float32) under chunked prefill, preemption and prefix caching, with KV
heads split or replicated, a vocabulary that does not divide evenly, Qwen2's q/k/v biases
and tied embeddings, Qwen3's q/k norms, Phi-3's fused checkpoint tensors, Qwen3-MoE's experts; log-probabilities must equal TP=1's within 1e-5.
"""

import random

import pytest
from engine_checks import assert_engine_drained
from hf_models import GEMMA4_MOE_SHAPE, load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy

from pagellm import LLM, SamplingParams
from pagellm.errors import ConfigError

NEW_TOKENS = 16


def make_prompts():
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 3, 9, 17, 33, 47)]
    shared = [rng.randrange(3, 256) for _ in range(40)]  # > 2 full blocks
    prompts += [shared + [rng.randrange(3, 256) for _ in range(k)] for k in (2, 7, 19)]
    return prompts


PROMPTS = make_prompts()


def checkpoint(tmp_path_factory, name, arch="llama", **overrides):
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(name), arch, seed=5, **overrides)
    ref = load_hf_reference(folder)
    return str(folder), [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return checkpoint(tmp_path_factory, "llama")  # 4 heads, 2 KV heads


def run(folder, tp, **engine_args):
    engine_args.setdefault("max_model_len", 128)
    with LLM(folder, tensor_parallel_size=tp, **engine_args) as llm:
        outputs = pagellm_greedy(llm, PROMPTS, NEW_TOKENS)
        stats = llm.engine.get_stats()
        assert_engine_drained(llm)
    return outputs, stats


def test_tp2_equals_hf_with_chunking_preemption_and_prefix_hits(llama):
    folder, expected = llama
    outputs, _ = run(folder, 2)
    assert outputs == expected
    # A 5-token budget cuts every prefill into chunks; the shared 40-token prefix gives
    # prefix hits.
    outputs, metrics = run(folder, 2, max_num_batched_tokens=5)
    assert outputs == expected
    assert metrics.num_prefix_hit_tokens >= 2 * 32
    # 8 usable blocks (128 tokens) for requests of up to 75 tokens: preemption, with
    # 32-token chunks and prefix caching still on.
    outputs, metrics = run(folder, 2, max_num_batched_tokens=32, num_gpu_blocks_override=9)
    assert outputs == expected
    assert metrics.num_preemptions_recompute > 0


def test_tp2_swap_preemption(llama):
    folder, expected = llama
    outputs, metrics = run(folder, 2, num_gpu_blocks_override=9, preemption_mode="swap", swap_space=0.01)
    assert outputs == expected
    assert metrics.num_preemptions_swap > 0 and metrics.num_swapped_in_blocks > 0


def test_tp2_logprobs_equal_tp1(llama):
    folder, _ = llama
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3)
    prompts = [list(p) for p in PROMPTS[:4]]
    results = {}
    for tp in (1, 2):
        with LLM(folder, tensor_parallel_size=tp, max_model_len=256) as llm:
            results[tp] = llm.generate(prompts, params, use_tqdm=False)
    for one, two in zip(results[1], results[2], strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            for token in a:
                assert abs(a[token].logprob - b[token].logprob) < 1e-5
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
            for token in a:
                assert abs(a[token].logprob - b[token].logprob) < 1e-5


def test_fewer_kv_heads_than_ranks_replicates_them(tmp_path_factory):
    # 4 q heads, 1 KV head: each of the 2 ranks holds a copy of it.
    folder, expected = checkpoint(tmp_path_factory, "mqa", num_key_value_heads=1)
    outputs, _ = run(folder, 2, max_num_batched_tokens=7)
    assert outputs == expected


def test_qwen2_biases_and_tied_embeddings(tmp_path_factory):
    folder, expected = checkpoint(tmp_path_factory, "qwen2", "qwen2", tie_word_embeddings=True)
    outputs, _ = run(folder, 2)
    assert outputs == expected


def test_qwen3_q_k_norms_with_chunking(tmp_path_factory):
    # The per-head q/k norms are one head_dim weight each: every rank keeps it whole.
    folder, expected = checkpoint(tmp_path_factory, "qwen3", "qwen3", head_dim=32)
    outputs, _ = run(folder, 2, max_num_batched_tokens=7)
    assert outputs == expected


def test_phi3_fused_checkpoint_tensors_split_per_rank(tmp_path_factory):
    # qkv_proj and gate_up_proj come fused: cut into projections before each rank takes its share.
    folder, expected = checkpoint(tmp_path_factory, "phi3", "phi3")
    outputs, _ = run(folder, 2, max_num_batched_tokens=7)
    assert outputs == expected


def test_qwen3_moe_experts_split_per_rank(tmp_path_factory):
    # Every expert's gate/up rows and down columns split like a dense MLP's; the router is whole.
    folder, expected = checkpoint(tmp_path_factory, "qwen3_moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32)  # fmt: skip
    outputs, _ = run(folder, 2, max_num_batched_tokens=7)
    assert outputs == expected


def test_qwen2_moe_shared_expert_split_per_rank(tmp_path_factory):
    # The shared expert splits like a dense MLP of its own width; its one-output gate is whole.
    folder, expected = checkpoint(tmp_path_factory, "qwen2_moe", "qwen2_moe", num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=48)  # fmt: skip
    outputs, _ = run(folder, 2, max_num_batched_tokens=7)
    assert outputs == expected


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_sliding_groups_and_soft_caps_per_rank(tmp_path_factory, arch):
    # Gemma's four norms and q/k norms are whole on every rank, each rank's KV cache keeps
    # the sliding and global groups, and the logit cap applies to the gathered logits.
    overrides = {"num_hidden_layers": 4, "sliding_window": 12}
    if arch == "gemma2":
        overrides |= {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 6.0}
    else:
        overrides |= {"sliding_window_pattern": 2, "rope_local_base_freq": 1000.0}
    folder, expected = checkpoint(tmp_path_factory, arch, arch, **overrides)
    outputs, _ = run(folder, 2, max_num_batched_tokens=7)
    assert outputs == expected


def test_gpt_oss_sinks_and_biased_experts_split_per_rank(tmp_path_factory):
    # Each rank keeps its heads' sinks, its share of every expert (gate and up de-interleaved
    # before the split, biases with their rows; the down bias added once, by rank 0), the
    # biased router whole, and both KV cache groups (sliding and full).
    folder, expected = checkpoint(tmp_path_factory, "gpt_oss", "gpt_oss")
    outputs, _ = run(folder, 2, max_num_batched_tokens=7)
    assert outputs == expected


def test_three_ranks_with_a_vocabulary_that_does_not_divide(tmp_path_factory):
    # 256 tokens over 3 ranks: 86 rows each, the last two padded.
    folder, expected = checkpoint(
        tmp_path_factory, "tp3", hidden_size=96, head_dim=16, num_attention_heads=6,
        num_key_value_heads=3, intermediate_size=192,
    )  # fmt: skip
    outputs, _ = run(folder, 3, max_num_batched_tokens=9)
    assert outputs == expected


def test_a_size_that_does_not_split_the_heads_is_refused(llama):
    folder, _ = llama
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not split.*sizes that work: \[1, 2, 4\]"):
        LLM(folder, tensor_parallel_size=3)


@pytest.mark.parametrize("kind", ["gemma4", "gemma4_moe"])
def test_gemma4_heads_of_two_shapes_and_shared_kv_split_per_rank(tmp_path_factory, kind):
    # Each rank keeps its share of the sliding heads and of the global ones (their own size;
    # gemma4_moe's single global KV head replicated on both ranks, its keys as values), of
    # every MLP (the KV-shared layers' double-wide ones) and expert, whole norms, router and
    # per-layer inputs; the shared layers read their owners' K/V on each rank.
    overrides = GEMMA4_MOE_SHAPE if kind == "gemma4_moe" else {}
    folder, expected = checkpoint(tmp_path_factory, kind, "gemma4", **overrides)
    outputs, _ = run(folder, 2, max_num_batched_tokens=7)
    assert outputs == expected
