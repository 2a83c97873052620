"""Each model family beyond Llama through the whole engine, against HF transformers in
float32 on the same tiny random weights: greedy tokens equal under batching, chunked
prefill, both preemptions and prefix caching, and log-probabilities within 1e-4.

The Llama-family scenarios in full are in test_engine_vs_hf.py; here each family runs the
regimes that cut the work differently (a family-specific layer must be right at every
chunk boundary and after every kind of preemption)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from engine_checks import assert_engine_drained
from hf_models import GEMMA4_MOE_SHAPE, load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy

from pagellm import LLM, SamplingParams
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.model.loader import load_model_config, resolve_model_source

NEW_TOKENS = 24
MAX_MODEL_LEN = 160

FAMILIES = {
    # Qwen3: per-head q/k RMSNorm; a YaRN context so that the rotary scaling is on too.
    "qwen3": ("qwen3", {"head_dim": 32, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                         "original_max_position_embeddings": 64}}),  # fmt: skip
    # Phi-3: fused qkv/gate_up in the checkpoint, LongRoPE whose long factors start at
    # position 72 (every prompt stays inside, generation crosses it), partial rotary.
    "phi3": ("phi3", {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 72,
                      "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0],
                                       "long_factor": [1.0, 3.0, 7.0, 15.0]}}),  # fmt: skip
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Sliding windows far shorter than most prompts: every layer (Mistral), or a hybrid of
    # full and sliding layers (Qwen2 with max_window_layers, the layout Gemma uses).
    "mistral_sliding": ("mistral", {"sliding_window": 12}),
    "qwen2_hybrid": ("qwen2", {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 1,
                               "num_hidden_layers": 3}),  # fmt: skip
    # Gemma 2: sandwich norms of (1 + w), GeGLU, scaled embeddings, query_pre_attn_scalar,
    # caps low enough to bite on these weights, every other layer sliding (tied embeddings
    # make these tiny random models repeat a few tokens: the GGUF tests tie them).
    "gemma2": ("gemma2", {"num_hidden_layers": 3, "sliding_window": 12, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 6.0}),  # fmt: skip
    # Gemma 3: q/k norms, five sliding layers to one global (six KV cache groups), the
    # sliding layers on their own rotary base, the global one with linear scaling.
    "gemma3": ("gemma3", {"num_hidden_layers": 6, "sliding_window": 10, "rope_theta": 100000.0,
                          "rope_local_base_freq": 1000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),  # fmt: skip
    # Qwen2-MoE: q/k/v biases, 4 experts top-2 unnormalized, a shared expert of its own width
    # behind a sigmoid gate, the second of three layers dense.
    "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48, "num_hidden_layers": 3,
                                "mlp_only_layers": [1]}),  # fmt: skip
    # Qwen3-MoE: q/k norms, 8 narrow experts, top-2 unnormalized, one dense layer.
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                "mlp_only_layers": [0]}),  # fmt: skip
    # SmolLM3: every second layer without rotary (NoPE), q/k/v/o biases.
    "smollm3": ("smollm3", {"no_rope_layer_interval": 2, "attention_bias": True}),
    # gpt-oss: attention sinks, a window of 8 in every other layer, biased router and
    # experts, a SwiGLU clamp low enough to bite, YaRN (tests/hf_models.py GPT_OSS_SHAPE).
    "gpt_oss": ("gpt_oss", {}),
    # Gemma 4 (tests/hf_models.py GEMMA4_SHAPE): per-layer inputs, the last two layers
    # reading earlier layers' K/V, global heads twice the sliding ones' size (two sliding
    # layers side by side in a cache tensor), "proportional" rotary, double-wide MLPs in
    # the shared layers, logits soft-capped; and the experts' kind (GEMMA4_MOE_SHAPE):
    # keys as values in the global layers, experts beside every MLP.
    "gemma4": ("gemma4", {}),
    "gemma4_moe": ("gemma4", GEMMA4_MOE_SHAPE),
}


def make_prompts() -> list[list[int]]:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 3, 9, 16, 17, 33, 50, 70)]
    shared = [rng.randrange(3, 256) for _ in range(40)]  # 2 full blocks and a half
    return prompts + [shared + [rng.randrange(3, 256) for _ in range(k)] for k in (2, 12)]


PROMPTS = make_prompts()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=5, **overrides)
    ref = load_hf_reference(folder)
    expected = [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert len({t for out in expected for t in out}) > 10, "degenerate model: the test would prove little"
    return str(folder), ref, expected


def run(folder: str, **engine_args: object) -> tuple[LLM, list[list[int]]]:
    engine_args.setdefault("max_model_len", MAX_MODEL_LEN)
    llm = LLM(folder, **engine_args)
    outputs = pagellm_greedy(llm, PROMPTS, NEW_TOKENS)
    assert_engine_drained(llm)
    return llm, outputs


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_num_batched_tokens": 7}, {"max_num_seqs": 1}],
    ids=["batched", "chunked-prefill-7", "one-at-a-time"],
)
def test_greedy_tokens_equal_hf(family, engine_args):
    folder, _, expected = family
    _, outputs = run(folder, **engine_args)
    assert outputs == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(family, mode):
    folder, _, expected = family
    # Ten blocks per KV cache group (a hybrid model's request holds blocks in each).
    num_groups = len(kv_cache_layout(load_model_config(resolve_model_source(folder))).groups)
    llm, outputs = run(
        folder, max_model_len=96, num_gpu_blocks_override=10 * num_groups, preemption_mode=mode, swap_space=0.01,
        enable_prefix_caching=False,
    )  # fmt: skip
    assert outputs == expected
    stats = llm.engine.get_stats()
    assert (stats.num_preemptions_recompute if mode == "recompute" else stats.num_preemptions_swap) > 0
    if num_groups > 1 or "sliding" in folder:
        # The windows' passed blocks went back to the pool while the requests ran.
        assert llm.engine.scheduler.kv_cache_manager.stats.num_window_freed_blocks > 0


def test_prefix_caching(family):
    folder, _, expected = family
    llm = LLM(folder, max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert llm.engine.get_stats().num_prefix_hit_tokens >= 2 * 32
    assert_engine_drained(llm)


@torch.inference_mode()
def test_logprobs_within_1e_4_of_hf(family):
    folder, ref, _ = family
    prompts = PROMPTS[3:6]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    outputs = LLM(folder, max_model_len=MAX_MODEL_LEN).generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        generated = output.outputs[0].token_ids
        sequence = torch.tensor([prompt + generated[:-1]])
        hf_logprobs = torch.log_softmax(ref(sequence).logits[0].float(), dim=-1)  # [positions, vocab]
        for step, top in enumerate(output.outputs[0].logprobs):
            row = hf_logprobs[len(prompt) - 1 + step]
            for token, logprob in top.items():
                assert math.isclose(logprob.logprob, float(row[token]), abs_tol=1e-4)
        for position, top in enumerate(output.prompt_logprobs[1:], start=1):
            row = hf_logprobs[position - 1]
            for token, logprob in top.items():
                assert math.isclose(logprob.logprob, float(row[token]), abs_tol=1e-4)
