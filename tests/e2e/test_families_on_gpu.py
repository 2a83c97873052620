"""Every model family on an NVIDIA GPU (Triton attention, CUDA graphs for decode steps)
against HF transformers float32 on the CPU, token for token: the families' own layers
(sliding windows, soft-capping, q/k norms, experts) through the compiled kernels, under
chunked prefill, both preemptions and prefix caching.

On a machine without CUDA these tests are skipped; the same scenarios run on the CPU in
test_families_vs_hf.py, and the Triton kernels under Triton's interpreter in
tests/attention/."""

from __future__ import annotations

import pytest
import torch
from engine_checks import assert_engine_drained
from hf_models import load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy
from test_families_vs_hf import FAMILIES, MAX_MODEL_LEN, NEW_TOKENS, PROMPTS

from pagellm import LLM
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.model.loader import load_model_config, resolve_model_source

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ON_GPU = {"device": "cuda", "dtype": "float32", "max_model_len": MAX_MODEL_LEN}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=5, **overrides)
    ref = load_hf_reference(folder)  # float32 on the CPU: the independent reference
    expected = [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    return str(folder), expected


def test_chunked_prefill_and_prefix_caching(family):
    folder, expected = family
    llm = LLM(folder, max_num_batched_tokens=16, **ON_GPU)
    assert llm.engine.runner.model.backend.name == "triton"
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected  # again, from the prefix cache
    assert llm.engine.get_stats().num_prefix_hit_tokens >= 2 * 32
    assert_engine_drained(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(family, mode):
    folder, expected = family
    num_groups = len(kv_cache_layout(load_model_config(resolve_model_source(folder))).groups)
    llm = LLM(
        folder, **{**ON_GPU, "max_model_len": 96}, num_gpu_blocks_override=10 * num_groups, preemption_mode=mode,
        swap_space=0.01, enable_prefix_caching=False,
    )  # fmt: skip
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    stats = llm.engine.get_stats()
    assert (stats.num_preemptions_recompute if mode == "recompute" else stats.num_preemptions_swap) > 0
    assert_engine_drained(llm)


def test_eager_equals_graphs(family):
    folder, expected = family
    llm = LLM(folder, enforce_eager=True, **ON_GPU)
    assert llm.engine.runner.decode_graphs is None
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert_engine_drained(llm)
