"""The whole engine with the Triton attention backend against HF transformers (greedy,
float32, token for token), and decode steps replayed from captured graphs.

Without a GPU the kernels run under Triton's interpreter on CPU (tests/conftest.py), and
graphs are stood in for by `rerun_capture`, which replays by running the captured forward
again over the same static buffers: what is checked is that the runner fills, pads and
reads those buffers right, and that the graph plans read them.
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import assert_engine_drained
from hf_models import load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy
from test_engine_vs_hf import PROMPTS

pytest.importorskip("triton", reason="Triton is not installed (pip install 'pagellm[gpu]')")

from pagellm import LLM
from pagellm.worker.step_paths import cuda_graphs

NEW_TOKENS = 12
DEVICE_ARGS = {"attention_backend": "triton", "max_model_len": 128}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-triton"), "llama", seed=5)
    ref = load_hf_reference(folder)
    expected = [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    return str(folder), expected


def test_chunked_prefill_and_prefix_caching(tiny_model):
    folder, expected = tiny_model
    llm = LLM(folder, max_num_batched_tokens=16, **DEVICE_ARGS)
    assert llm.engine.runner.model.backend.name == "triton"
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert pagellm_greedy(llm, PROMPTS[-4:], NEW_TOKENS) == expected[-4:]
    assert llm.engine.get_stats().num_prefix_hit_tokens >= 4 * 48
    assert_engine_drained(llm)


def test_preemption_under_a_tiny_kv_cache(tiny_model):
    folder, expected = tiny_model
    llm = LLM(folder, num_gpu_blocks_override=11, enable_prefix_caching=False, **DEVICE_ARGS)
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert llm.engine.get_stats().num_preemptions_recompute > 0
    assert_engine_drained(llm)


def test_decode_graphs_pad_and_replay(tiny_model, monkeypatch):
    folder, expected = tiny_model
    llm = LLM(folder, max_num_seqs=6, **DEVICE_ARGS)
    runner = llm.engine.runner
    runner.capture_decode_graphs([1, 2, 4, 8], 128, capture=cuda_graphs.rerun_capture)
    batch_sizes: list[int] = []
    original_run = cuda_graphs.DecodeGraphs.run

    def counting_run(self, sequences):
        batch_sizes.append(len(sequences))
        return original_run(self, sequences)

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run", counting_run)
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    # Decode steps ran from the graphs, at sizes that needed padding (6 -> 8, 3 -> 4) too.
    assert sum(batch_sizes) > len(PROMPTS) * (NEW_TOKENS // 2)
    assert {3, 5, 6} & set(batch_sizes)
    assert_engine_drained(llm)


def test_graphs_refuse_other_backends(tiny_model):
    folder, _ = tiny_model
    llm = LLM(folder, attention_backend="torch", max_model_len=128)
    with pytest.raises(TypeError, match="Triton"):
        llm.engine.runner.capture_decode_graphs([1, 2], 128, capture=cuda_graphs.rerun_capture)


def test_capture_sizes():
    assert cuda_graphs.capture_sizes(1) == [1]
    assert cuda_graphs.capture_sizes(6) == [1, 2, 4, 6]
    sizes = cuda_graphs.capture_sizes(512)
    assert sizes[:6] == [1, 2, 4, 8, 16, 32] and sizes[-1] == 512
    # Padding a batch up to the next size wastes at most about a tenth past 256.
    assert all(b / a <= 2 for a, b in zip(sizes, sizes[1:]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_greedy_with_real_cuda_graphs(tiny_model, monkeypatch):
    folder, expected = tiny_model
    replays: list[int] = []
    original_run = cuda_graphs.DecodeGraphs.run

    def counting_run(self, sequences):
        replays.append(len(sequences))
        return original_run(self, sequences)

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run", counting_run)
    llm = LLM(folder, device="cuda", dtype="float32", max_num_batched_tokens=16, max_num_seqs=8,
              num_gpu_blocks_override=64, max_model_len=128)
    assert llm.engine.runner.decode_graphs is not None  # captured by default on CUDA
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert replays
    assert_engine_drained(llm)
    eager = LLM(folder, device="cuda", dtype="float32", enforce_eager=True, num_gpu_blocks_override=64,
                max_model_len=128)
    assert eager.engine.runner.decode_graphs is None
    assert pagellm_greedy(eager, PROMPTS, NEW_TOKENS) == expected
