"""Each feature of the newer families matters: switched off in the HF reference, the
greedy tokens change (so the family tests in test_families_vs_hf.py can fail), and
pagellm's tokens equal the reference with the feature on. A GGUF written from the same
weights as llama.cpp's converter writes them runs the same tokens as the HF folder."""

from __future__ import annotations

import json

import pytest
import torch
from engine_checks import assert_engine_drained
from gguf_models import write_gguf_from_hf
from hf_models import load_hf_reference, make_tiny_gpt_oss_mxfp4, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy

from pagellm import LLM
from pagellm.model.loader import load_model_config, resolve_model_source

PROMPTS = [list(range(5, 40)), [40, 41, 42], [7, 200, 13, 90, 91, 92, 93, 17, 250, 3, 4]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    """Four layers, the fourth without rotary: llama.cpp's fixed rule, so the GGUF agrees."""
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("smollm3"), "smollm3", seed=5, num_hidden_layers=4)


@torch.inference_mode()
def test_smollm3_nope_layers_bite(smollm3):
    ref = load_hf_reference(smollm3)
    assert ref.config.no_rope_layers == [1, 1, 1, 0]
    expected = [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS]
    llm = LLM(str(smollm3), max_model_len=128, max_num_batched_tokens=16)
    assert llm.engine.runner.model.config.nope_layers == (3,)
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert_engine_drained(llm)
    ref.model.layers[3].self_attn.use_rope = 1  # the NoPE layer rotated as the others
    assert [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS] != expected


@torch.inference_mode()
def test_smollm3_gguf_equals_the_hf_folder(smollm3, tmp_path):
    cfg = json.loads((smollm3 / "config.json").read_text())
    path = write_gguf_from_hf(smollm3, tmp_path / "smollm3.gguf", cfg, quant_by_kind={}, arch="smollm3")
    config = load_model_config(resolve_model_source(str(path)))
    assert (config.architecture, config.nope_layers) == ("smollm3", (3,))
    ref = load_hf_reference(smollm3)
    expected = [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS]
    assert pagellm_greedy(LLM(str(path), max_model_len=128), PROMPTS, NEW_TOKENS) == expected


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=5)
    ref = load_hf_reference(folder)
    return folder, ref, [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS]


def _switch_off(ref, feature: str) -> None:  # noqa: ANN001
    """One gpt-oss feature switched off in the reference, in place."""
    for layer in ref.model.layers:
        attention, experts = layer.self_attn, layer.mlp.experts
        if feature == "sinks":
            attention.sinks.data.fill_(-1e4)  # a sink of weight e^-10000: none
        elif feature == "window":
            attention.sliding_window = None
        elif feature == "clamp":
            experts.limit = 1e9
        elif feature == "expert biases":
            experts.gate_up_proj_bias.data.zero_()
            experts.down_proj_bias.data.zero_()
        elif feature == "router bias":
            layer.mlp.router.bias.data.zero_()
    if feature == "window":
        ref.config.layer_types = ["full_attention"] * len(ref.model.layers)
        ref.model.config.layer_types = ref.config.layer_types


@torch.inference_mode()
@pytest.mark.parametrize("feature", ["sinks", "window", "clamp", "expert biases", "router bias"])
def test_gpt_oss_features_bite(gpt_oss, feature):
    folder, _, expected = gpt_oss
    ref = load_hf_reference(folder)  # a fresh copy to switch a feature off in
    _switch_off(ref, feature)
    assert [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS] != expected, f"the {feature} changed nothing"


@torch.inference_mode()
def test_gpt_oss_equals_hf(gpt_oss):
    folder, _, expected = gpt_oss
    llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=16)
    config = llm.engine.runner.model.config
    assert config.attention_sinks and config.expert_bias and config.swiglu_limit == 1.0
    assert config.sliding_window == 8 and config.sliding_window_layers == (0,)
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert_engine_drained(llm)


@torch.inference_mode()
def test_gpt_oss_gguf_equals_the_hf_folder(tmp_path_factory):
    """llama.cpp's gpt-oss file: the clamp at the architecture's 7 and 1.702 (the folder's
    too), experts and their biases stacked, the router as ffn_gate_inp, Q8_0 attention."""
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("gpt_oss_gguf"), "gpt_oss", seed=7, swiglu_limit=7.0)
    cfg = json.loads((folder / "config.json").read_text())
    import gguf

    path = write_gguf_from_hf(folder, folder.parent / "gpt-oss.gguf", cfg, arch="gpt-oss",
                              quant_by_kind={"attn_q": gguf.GGMLQuantizationType.F16})  # fmt: skip
    config = load_model_config(resolve_model_source(str(path)))
    assert config.architecture == "gpt-oss" and config.attention_sinks and config.sliding_window_layers == (0,)
    assert config.rope_scaling is not None and not config.rope_scaling.truncate
    ref = load_hf_reference(folder)
    expected = [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS]
    assert pagellm_greedy(LLM(str(path), max_model_len=128), PROMPTS, NEW_TOKENS) == expected


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """An MXFP4 folder as OpenAI ships gpt-oss, its float twin (the reference) and the GGUF
    llama.cpp's converter makes of it (the experts' bytes repacked, not requantized)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    folder, reference = make_tiny_gpt_oss_mxfp4(root, swiglu_limit=7.0)  # llama.cpp's fixed clamp
    cfg = json.loads((folder / "config.json").read_text())
    path = write_gguf_from_hf(folder, root / "gpt-oss-mxfp4.gguf", cfg, arch="gpt-oss", quant_by_kind={})
    ref = load_hf_reference(reference)
    return folder, path, [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS]


@torch.inference_mode()
def test_mxfp4_experts_equal_hf_in_float32(gpt_oss_mxfp4):
    folder, path, expected = gpt_oss_mxfp4
    for source in (folder, path):
        assert load_model_config(resolve_model_source(str(source))).expert_bits_per_weight == 4.25  # what costs count
        assert pagellm_greedy(LLM(str(source), max_model_len=128), PROMPTS, NEW_TOKENS) == expected, source


@torch.inference_mode()
def test_mxfp4_experts_stay_as_stored_and_the_gguf_equals_the_folder(gpt_oss_mxfp4, monkeypatch):
    from pagellm.kernels.weights import WeightType, kernels_support

    if not kernels_support(WeightType.MXFP4):
        pytest.skip("MXFP4 stays as stored on the native CPU kernels (x86-64 with AVX2, and a C compiler)")
    folder, path, _ = gpt_oss_mxfp4
    # One kernel for both loads: measured on a busy machine, the two could choose differently
    # and round differently (seen: tokens parting at a near-tie).
    monkeypatch.setenv("PAGELLM_LINEAR_KERNEL", "gemm")
    outputs = []
    for source in (folder, path):
        llm = LLM(str(source), max_model_len=128, dtype="bfloat16")
        model = llm.engine.runner.model
        experts = [expert for layer in model.layers for expert in layer.mlp.experts]
        assert all(e.gate_up_proj.packed.types == [WeightType.MXFP4] * 2 for e in experts)
        assert all(e.down_proj.packed.types == [WeightType.MXFP4] for e in experts)
        assert "MXFP4 as stored" in model.weight_bytes_by_format()
        outputs.append(pagellm_greedy(llm, PROMPTS, NEW_TOKENS))
    assert outputs[0] == outputs[1]  # the same bytes through the same kernels


@torch.inference_mode()
def test_mxfp4_experts_and_q8_0_attention_with_int8_activations(gpt_oss_mxfp4, monkeypatch, kernel_isa):
    """--int8-activations on gpt-oss as llama.cpp's files hold it: MXFP4 experts (their bytes
    as shipped) and Q8_0 attention and LM head, forced through the int8 kernel on every
    linear of every step, on each kernel build (the VNNI builds read MXFP4 repacked into
    their lane order and Q8_0 as stored, the AVX2 builds MXFP4 as stored, Q8_0 streaming in
    bf16 there): the leading greedy tokens are the same file's in float32."""
    import gguf

    from pagellm.kernels.build import load_kernels
    from pagellm.kernels.weights import WeightType, kernels_support

    if not kernels_support(WeightType.MXFP4):
        pytest.skip("the int8 kernels are native CPU kernels (x86-64 with AVX2, and a C compiler)")
    folder, _, _ = gpt_oss_mxfp4
    q8 = gguf.GGMLQuantizationType.Q8_0
    cfg = json.loads((folder / "config.json").read_text())
    path = write_gguf_from_hf(folder, folder.parent / f"gpt-oss-q8-{kernel_isa}.gguf", cfg, arch="gpt-oss",
                              quant_by_kind={"attn_q": q8, "attn_k": q8, "attn_v": q8, "attn_output": q8, "output": q8})  # fmt: skip
    float32 = pagellm_greedy(LLM(str(path), max_model_len=128, dtype="float32"), PROMPTS, 6)
    repacks = bool(load_kernels().quant_int8_supported(int(WeightType.MXFP4_VNNI)))
    stored = WeightType.MXFP4_VNNI if repacks else WeightType.MXFP4
    assert load_kernels().quant_int8_supported(int(stored))
    monkeypatch.setenv("PAGELLM_LINEAR_KERNEL", "streaming-int8")
    llm = LLM(str(path), max_model_len=128, dtype="bfloat16", int8_activations=True)
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.o_proj.packed.types == [WeightType.Q8_0]
    assert model.layers[0].mlp.experts[0].down_proj.packed.types == [stored]
    int8 = pagellm_greedy(llm, PROMPTS, 6)
    assert [out[:2] for out in int8] == [out[:2] for out in float32]
    assert_engine_drained(llm)
