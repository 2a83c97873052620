"""Qwen3.5 (dense and MoE) and Qwen3-Next from GGUF files written as llama.cpp's converter
writes them (`qwen35`, `qwen35moe`, `qwen3next`: Qwen3-Next's q, k, v and z split, its b and a
kept fused per key head): the (1 + w) norms stored with the 1 added, A_log as -exp(A_log),
the conv weights squeezed, the Gated DeltaNet's value heads reordered to tile their key
heads, and a multi-token-prediction block after the model's layers. From the same tiny
random weights the file gives HF transformers' greedy tokens; quantized projections stay
as stored."""

from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import numpy as np
import pytest
from gguf_models import write_gguf_from_hf
from hf_models import load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy

from pagellm import LLM, SamplingParams
from pagellm.errors import ModelLoadError
from pagellm.kernels.weights import WeightType, kernels_support
from pagellm.model.checkpoint import gguf_metadata
from pagellm.model.loader import ModelSource, load_model_config

T = gguf.GGMLQuantizationType
PROMPTS = [list(range(5, 40)), [3, 4], [99, 100, 101, 7, 8, 250, 17], list(range(200, 120, -1))]
NEW_TOKENS = 24
FAMILIES = {
    "qwen35": ("qwen3_5", {}),
    "qwen35moe": ("qwen3_5_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                  "shared_expert_intermediate_size": 48}),
    # llama.cpp runs every Qwen3-Next layer sparse, its chosen experts' weights renormalized.
    "qwen3next": ("qwen3_next", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "shared_expert_intermediate_size": 48, "norm_topk_prob": True}),
}  # fmt: skip
# The Gated DeltaNet's projections and the attention's in quantized and float types.
QUANTIZED = {"token_embd": T.Q8_0, "attn_qkv": T.Q8_0, "attn_gate": T.Q4_0, "ssm_beta": T.Q8_0, "ssm_alpha": T.F16,
             "ssm_out": T.Q8_0, "attn_q": T.Q8_0, "attn_k": T.F16, "attn_v": T.Q8_0, "attn_output": T.Q8_0,
             "ffn_gate": T.Q8_0, "ffn_up": T.Q8_0, "ffn_down": T.Q8_0, "output": T.Q8_0}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(GGUF file, HF folder, HF's greedy tokens) of one family, a Qwen3.5 file with an MTP block."""
    gguf_arch = request.param
    arch, overrides = FAMILIES[gguf_arch]
    root = tmp_path_factory.mktemp(gguf_arch)
    folder = make_tiny_hf_checkpoint(root / "hf", arch, seed=3, **overrides)
    cfg = json.loads((folder / "config.json").read_text())
    mtp_blocks = 0 if gguf_arch == "qwen3next" else 1  # its converter drops them
    path = write_gguf_from_hf(folder, root / "model.gguf", cfg, quant_by_kind={}, arch=gguf_arch, mtp_blocks=mtp_blocks)
    ref = load_hf_reference(folder)
    expected = [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert len({t for out in expected for t in out}) > 10, "degenerate model: the test would prove little"
    return path, folder, expected


def test_config_from_the_file_is_the_folders(family):
    """The layer pattern and shapes come from `full_attention_interval` and `ssm.*`; the
    MTP block is not a layer; a qwen35 file's value heads are tiled, a qwen3next one's not."""
    path, folder, _ = family
    from_gguf = load_model_config(ModelSource("gguf", path, "m"))
    from_hf = load_model_config(ModelSource("hf", folder, "m"))
    assert from_gguf.num_hidden_layers == from_hf.num_hidden_layers == 4
    tiled = from_gguf.architecture != "qwen3next"
    assert from_gguf.linear_attention == dataclasses.replace(from_hf.linear_attention, value_heads_tiled=tiled)
    assert from_gguf.linear_attention.layers == (0, 1, 2)
    for field in ("attention_output_gate", "norm_weight_offset", "qk_norm", "rotary_dim", "num_experts",
                  "num_experts_per_tok", "expert_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob"):  # fmt: skip
        assert getattr(from_gguf, field) == getattr(from_hf, field), field


def test_tokens_equal_hf_under_batching_and_chunked_prefill(family):
    path, _, expected = family
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, max_model_len=160)
    assert type(llm.engine.runner.model).__name__ in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected


def test_tensor_parallel_2_splits_the_files_value_heads(family):
    """Each of two ranks keeps one key head and the value heads that read it: in a qwen35
    file's tiled order heads 0 and 2 (rank 0) and 1 and 3 (rank 1), a strided set of rows
    and of out_proj's columns; HF's tokens all the same."""
    path, _, expected = family
    config = load_model_config(ModelSource("gguf", path, "m"))
    if config.num_experts or not config.linear_attention.value_heads_tiled:
        pytest.skip("the dense qwen35 file shows the tiled split; grouped heads and experts split as in the HF folders' test")
    with LLM(str(path), dtype="float32", max_model_len=160, tensor_parallel_size=2) as llm:
        assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected


def test_the_value_head_order_matters(family, monkeypatch):
    """Paired the other way (a qwen35 file's tiled value heads as grouped, a qwen3next
    file's grouped ones as tiled), the file gives other tokens."""
    path, _, expected = family
    spec = gguf_metadata.LinearAttentionSpec
    swapped = lambda **fields: spec(**{**fields, "value_heads_tiled": not fields["value_heads_tiled"]})  # noqa: E731
    monkeypatch.setattr(gguf_metadata, "LinearAttentionSpec", swapped)
    llm = LLM(str(path), dtype="float32", max_model_len=160)
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) != expected


@pytest.mark.skipif(not kernels_support(WeightType.Q8_0), reason="quantized kernels need x86-64 with AVX2")
def test_quantized_projections_stay_as_stored(tmp_path):
    """attn_qkv, attn_gate, ssm_beta and ssm_alpha (mixed types) are the Gated DeltaNet's one
    fused input projection, held as stored; its run agrees with the same file in float32."""
    folder = make_tiny_hf_checkpoint(tmp_path / "hf", "qwen3_5", seed=3)
    cfg = json.loads((folder / "config.json").read_text())
    path = write_gguf_from_hf(folder, tmp_path / "q8.gguf", cfg, quant_by_kind=QUANTIZED, arch="qwen35")
    default = LLM(str(path), dtype="bfloat16", max_model_len=160)
    linear = default.engine.runner.model.layers[0].linear_attn
    assert linear.in_proj.weight is None and linear.out_proj.weight is None
    assert [t.label for t in linear.in_proj.packed.types] == ["Q8_0", "Q4_0", "Q8_0", "BF16"]
    assert [p.rows for p in linear.in_proj.packed.parts] == [64, 32, 4, 4]
    # The prompts' log-probabilities agree with the same file's float32 run within bf16
    # rounding (greedy tokens would flip at near-ties); a misplaced part would be off by
    # whole units.
    quantized = prompt_logprobs(default)
    float32 = prompt_logprobs(LLM(str(path), dtype="float32", max_model_len=160))
    for ours, reference in zip(quantized, float32, strict=True):
        assert np.abs(ours - reference).mean() < 0.1 and np.abs(ours - reference).max() < 0.5


def prompt_logprobs(llm: LLM) -> list[np.ndarray]:
    """Each prompt token's log-probability (after the first)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]) for out in outputs]


def test_a_decay_rate_that_is_not_negative_is_refused_by_name(family, tmp_path):
    """llama.cpp's ssm_a holds -exp(A_log): a file whose values are not all negative is
    corrupt, refused with the tensor named rather than loaded as NaN."""
    path, _, _ = family
    broken = tmp_path / "broken.gguf"
    shutil.copy(path, broken)
    tensor = next(t for t in gguf.GGUFReader(broken).tensors if t.name == "blk.1.ssm_a")
    with open(broken, "r+b") as file:
        file.seek(tensor.data_offset)
        file.write(np.ones(tensor.n_elements, dtype=np.float32).tobytes())
    with pytest.raises(ModelLoadError, match=r"layers\.1\.linear_attn\.A_log.*must be negative"):
        LLM(str(broken), dtype="float32", max_model_len=160)


def test_llama_cpp_reads_the_file_as_transformers_runs_the_weights(family, monkeypatch):
    """The file layout checked by llama.cpp itself where llama-cpp-python is installed
    (benchmarks install it; CI does not): its greedy tokens on the file equal HF's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path, folder, expected = family
    original = gguf.GGUFWriter.add_token_merges
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_merges", lambda self, merges: original(self, ["Ġ Ġ"]))  # llama.cpp wants some
    cfg = json.loads((folder / "config.json").read_text())
    arch = gguf.GGUFReader(path).fields["general.architecture"].contents()
    # Without the random MTP block (not a complete one: llama.cpp would refuse it).
    file = write_gguf_from_hf(folder, path.with_name("llama_cpp.gguf"), cfg, quant_by_kind={}, arch=arch)
    llm = llama_cpp.Llama(str(file), n_ctx=256, n_threads=2, verbose=False)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        llm.reset()
        llm.eval(prompt)
        tokens = []
        for _ in range(NEW_TOKENS):
            tokens.append(int(llm.sample(temp=0.0)))
            llm.eval([tokens[-1]])
        assert tokens == want
