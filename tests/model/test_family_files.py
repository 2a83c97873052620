"""The new families from both kinds of file: GGUF files written by the test with
llama.cpp's architecture and tensor names, and HF folders in both config dialects (the
`rope_parameters` transformers 5.x writes, the `rope_theta`/`rope_scaling` most downloaded
checkpoints carry)."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from gguf_models import write_gguf_from_hf
from hf_models import load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy

from pagellm import LLM
from pagellm.kernels.weights import WeightType, kernels_support
from pagellm.model.loader import ModelSource, load_model_config
from pagellm.model.qwen3 import Qwen3ForCausalLM

T = gguf.GGMLQuantizationType
PROMPTS = [list(range(5, 40)), [3, 4], [99, 100, 101, 7, 8, 250, 17]]
NEW_TOKENS = 24
# One quantized type and one float type across the layers (the norms stay float32).
QWEN3_TYPES = {"token_embd": T.Q8_0, "attn_q": T.Q8_0, "attn_k": T.F16, "attn_v": T.Q8_0, "attn_output": T.F16,
               "ffn_gate": T.Q8_0, "ffn_up": T.F16, "ffn_down": T.Q8_0, "output": T.F16}  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    # head_dim 128: what transformers assumes for a qwen3 GGUF (it does not read key_length).
    folder = make_tiny_hf_checkpoint(root / "hf", "qwen3", head_dim=128)
    cfg = json.loads((folder / "config.json").read_text())
    return write_gguf_from_hf(folder, root / "qwen3.gguf", cfg, quant_by_kind=QWEN3_TYPES, arch="qwen3")


def test_qwen3_gguf_config_and_tokens_equal_hf_on_the_same_file(qwen3_gguf):
    """transformers dequantizes the file to float32; so does pagellm in float32."""
    import transformers

    config = load_model_config(ModelSource("gguf", qwen3_gguf, "q"))
    assert config.architecture == "qwen3" and config.qk_norm and config.head_dim == 128
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        qwen3_gguf.parent, gguf_file=qwen3_gguf.name, dtype=torch.float32
    ).eval()
    llm = LLM(str(qwen3_gguf), dtype="float32", max_num_batched_tokens=16)
    assert isinstance(llm.engine.runner.model, Qwen3ForCausalLM)
    outputs = pagellm_greedy(llm, PROMPTS, NEW_TOKENS)
    assert outputs == [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert len({t for out in outputs for t in out}) > 8


@pytest.mark.skipif(not kernels_support(WeightType.Q8_0), reason="quantized kernels need x86-64 with AVX2")
def test_qwen3_gguf_stays_as_stored_and_agrees_with_its_float32_run(qwen3_gguf):
    default = LLM(str(qwen3_gguf), dtype="bfloat16")
    attention = default.engine.runner.model.layers[0].self_attn
    assert attention.qkv_proj.weight is None
    assert {t.label for t in attention.qkv_proj.packed.types} == {"Q8_0", "BF16"}  # F16 k rows widen to bf16
    bf16 = pagellm_greedy(default, PROMPTS, 8)
    float32 = pagellm_greedy(LLM(str(qwen3_gguf), dtype="float32"), PROMPTS, 8)
    # bf16 rounding may flip a near-tie late in a sequence; the first tokens agree.
    assert [out[:3] for out in bf16] == [out[:3] for out in float32]


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory):
    """Fused attn_qkv and ffn_up (gate and up) as llama.cpp writes Phi-3, in Q8_0 and F16."""
    root = tmp_path_factory.mktemp("phi3")
    folder = make_tiny_hf_checkpoint(root / "hf", "phi3")
    cfg = json.loads((folder / "config.json").read_text())
    types = {"token_embd": T.Q8_0, "attn_qkv": T.Q8_0, "attn_output": T.F16, "ffn_up": T.Q8_0, "ffn_down": T.F16,
             "output": T.Q8_0}  # fmt: skip
    return write_gguf_from_hf(folder, root / "phi3.gguf", cfg, quant_by_kind=types, arch="phi3")


def test_phi3_gguf_tokens_equal_hf_on_the_same_file(phi3_gguf):
    import transformers

    config = load_model_config(ModelSource("gguf", phi3_gguf, "p"))
    assert config.architecture == "phi3" and config.partial_rotary_factor == 1.0
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        phi3_gguf.parent, gguf_file=phi3_gguf.name, dtype=torch.float32
    ).eval()
    outputs = pagellm_greedy(LLM(str(phi3_gguf), dtype="float32", max_num_batched_tokens=16), PROMPTS, NEW_TOKENS)
    assert outputs == [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    assert len({t for out in outputs for t in out}) > 8


@pytest.mark.skipif(not kernels_support(WeightType.Q8_0), reason="quantized kernels need x86-64 with AVX2")
def test_phi3_gguf_fused_tensors_stay_as_stored_in_their_projections(phi3_gguf):
    model = LLM(str(phi3_gguf), dtype="bfloat16").engine.runner.model
    qkv, gate_up = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
    assert qkv.weight is None and [t.label for t in qkv.packed.types] == ["Q8_0"] * 3
    assert [p.rows for p in qkv.packed.parts] == [64, 32, 32]  # q (4 heads), k and v (2 heads) of one attn_qkv
    assert gate_up.weight is None and [p.rows for p in gate_up.packed.parts] == [128, 128]


def test_phi3_longrope_and_partial_rotary_from_gguf_equal_the_hf_folder(tmp_path):
    """The rope factors travel as tensors, the original context and rotary dimensions as
    metadata: the float32 GGUF gives the HF folder's tokens (which equal transformers')."""
    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 4.0, 9.0, 20.0]}
    folder = make_tiny_hf_checkpoint(tmp_path / "hf", "phi3", partial_rotary_factor=0.5,
                                     original_max_position_embeddings=40, rope_scaling=rope)  # fmt: skip
    cfg = json.loads((folder / "config.json").read_text())
    path = write_gguf_from_hf(folder, tmp_path / "phi3.gguf", cfg, quant_by_kind={}, arch="phi3")
    from_gguf, from_hf = (load_model_config(ModelSource(kind, p, "p")) for kind, p in (("gguf", path), ("hf", folder)))
    assert from_gguf.rope_scaling == from_hf.rope_scaling and from_gguf.rotary_dim == from_hf.rotary_dim == 8
    assert from_gguf.rope_scaling.original_max_position_embeddings == 40
    assert pagellm_greedy(LLM(str(path)), PROMPTS, 32) == pagellm_greedy(LLM(str(folder)), PROMPTS, 32)


@pytest.mark.parametrize("arch,gguf_arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama"), ("qwen2_moe", "qwen2moe")])
def test_moe_gguf_with_stacked_experts_equals_the_hf_folder(tmp_path, arch, gguf_arch):
    """llama.cpp's [experts, rows, cols] tensors (F32 here, so the weights are the folder's
    exactly): the same tokens as the HF folder, whose tokens equal transformers'."""
    experts = {"num_experts": 4, "num_experts_per_tok": 2}
    if arch == "qwen3_moe":
        experts |= {"moe_intermediate_size": 32, "norm_topk_prob": True}
    elif arch == "qwen2_moe":  # a shared expert (F32 like the rest), top-k weights not renormalized
        experts |= {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
    else:
        experts = {"num_local_experts": 4, "num_experts_per_tok": 2}
    folder = make_tiny_hf_checkpoint(tmp_path / "hf", arch, **experts)
    cfg = json.loads((folder / "config.json").read_text())
    path = write_gguf_from_hf(folder, tmp_path / "moe.gguf", cfg, quant_by_kind={}, arch=gguf_arch)
    from_gguf, from_hf = (load_model_config(ModelSource(kind, p, "m")) for kind, p in (("gguf", path), ("hf", folder)))
    for field in ("num_experts", "num_experts_per_tok", "expert_intermediate_size", "norm_topk_prob", "qk_norm",
                  "shared_expert_intermediate_size", "attention_bias"):  # fmt: skip
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    gguf_llm = LLM(str(path), max_num_batched_tokens=16)
    classes = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
    assert type(gguf_llm.engine.runner.model).__name__ == classes[arch]
    assert pagellm_greedy(gguf_llm, PROMPTS, NEW_TOKENS) == pagellm_greedy(LLM(str(folder)), PROMPTS, NEW_TOKENS)


@pytest.mark.skipif(not kernels_support(WeightType.Q8_0), reason="quantized kernels need x86-64 with AVX2")
def test_quantized_experts_stay_as_stored(tmp_path):
    folder = make_tiny_hf_checkpoint(tmp_path / "hf", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32)  # fmt: skip
    cfg = json.loads((folder / "config.json").read_text())
    types = {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q8_0, "ffn_down_exps": T.Q8_0}
    path = write_gguf_from_hf(folder, tmp_path / "moe.gguf", cfg, quant_by_kind=types, arch="qwen3moe")
    llm = LLM(str(path), dtype="bfloat16")
    expert = llm.engine.runner.model.layers[0].mlp.experts[3]
    assert expert.gate_up_proj.weight is None and [p.rows for p in expert.gate_up_proj.packed.parts] == [32, 32]
    assert expert.down_proj.weight is None and expert.down_proj.packed.types[0].label == "Q8_0"
    float32 = pagellm_greedy(LLM(str(path), dtype="float32"), PROMPTS, 6)
    assert [out[:2] for out in pagellm_greedy(llm, PROMPTS, 6)] == [out[:2] for out in float32]


def test_q4_0_experts_with_int8_activations(tmp_path, monkeypatch, kernel_isa):
    # The experts' gate_up (k = hidden) and down (k = 32: one group, the kernel's tail)
    # through the one-call decode layer and the layer ops with x rounded to int8, forced on
    # every linear, on each kernel build (VNNI: the rows repacked; AVX2: as stored): the
    # leading greedy tokens are float32's.
    from pagellm.kernels.build import load_kernels

    folder = make_tiny_hf_checkpoint(tmp_path / "hf", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32)  # fmt: skip
    cfg = json.loads((folder / "config.json").read_text())
    types = {"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q4_0, "ffn_down_exps": T.Q4_0, "attn_q": T.Q4_0}
    path = write_gguf_from_hf(folder, tmp_path / "moe.gguf", cfg, quant_by_kind=types, arch="qwen3moe")
    float32 = pagellm_greedy(LLM(str(path), dtype="float32"), PROMPTS, 6)
    monkeypatch.setenv("PAGELLM_LINEAR_KERNEL", "streaming-int8")
    llm = LLM(str(path), dtype="bfloat16", int8_activations=True)
    repacks = bool(load_kernels().quant_int8_supported(int(WeightType.Q4_0_VNNI)))
    stored = WeightType.Q4_0_VNNI if repacks else WeightType.Q4_0
    assert llm.engine.runner.model.layers[0].mlp.experts[3].down_proj.packed.types == [stored]
    assert load_kernels().quant_int8_supported(int(stored))
    int8 = pagellm_greedy(llm, PROMPTS, 6)
    assert [out[:2] for out in int8] == [out[:2] for out in float32]


def _rewrite_in_the_old_dialect(folder) -> dict:
    """config.json as most downloaded checkpoints have it: rope_theta at the top, the
    scaling under rope_scaling with `type`, no rope_parameters."""
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type", "default")
    if kind != "default":
        cfg["rope_scaling"] = {"type": kind, **rope}
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen3", {"rope_theta": 5000.0}),
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),  # fmt: skip
    ],
    ids=["qwen3-theta", "qwen3-yarn", "llama3"],
)
def test_both_config_dialects_load_the_same_model(tmp_path, arch, overrides):
    new = make_tiny_hf_checkpoint(tmp_path / "new", arch, seed=2, **overrides)
    old = make_tiny_hf_checkpoint(tmp_path / "old", arch, seed=2, **overrides)
    assert "rope_parameters" in json.loads((new / "config.json").read_text())
    old_cfg = _rewrite_in_the_old_dialect(old)
    assert "rope_parameters" not in old_cfg and "rope_theta" in old_cfg
    config_new = load_model_config(ModelSource("hf", new, "m"))
    assert load_model_config(ModelSource("hf", old, "m")) == config_new
    assert config_new.rope_theta == overrides.get("rope_theta", 10000.0)
    scaling = overrides.get("rope_scaling")
    assert (config_new.rope_scaling is None) == (scaling is None)
    if scaling:
        assert config_new.rope_scaling.rope_type == scaling["rope_type"]
        assert config_new.rope_scaling.factor == scaling["factor"]
        assert config_new.rope_scaling.original_max_position_embeddings == scaling["original_max_position_embeddings"]
    # transformers reads the old dialect too: the reference for the old folder's tokens.
    ref = load_hf_reference(old)
    assert pagellm_greedy(LLM(str(old)), PROMPTS, 16) == [hf_greedy(ref, p, 16) for p in PROMPTS]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_equals_the_hf_folder(tmp_path, arch):
    """llama.cpp's Gemma files: norms stored as 1 + w, `ffn_norm` before the MLP and post-norms
    of their own, tied embeddings, the window and Gemma 2's caps as metadata, the sliding
    pattern and Gemma 3's local rotary base implied. In F32 the file gives the HF folder's
    tokens (which equal transformers', tests/e2e/test_families_vs_hf.py); quantized, its
    linear layers stay as stored."""
    overrides = {"num_hidden_layers": 6, "sliding_window": 10, "tie_word_embeddings": True}
    if arch == "gemma2":
        overrides |= {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 6.0}
    else:
        overrides |= {"rope_theta": 100000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    folder = make_tiny_hf_checkpoint(tmp_path / "hf", arch, seed=3, **overrides)
    cfg = json.loads((folder / "config.json").read_text())
    path = write_gguf_from_hf(folder, tmp_path / f"{arch}.gguf", cfg, quant_by_kind={}, arch=arch)
    from_gguf, from_hf = (load_model_config(ModelSource(kind, p, "g")) for kind, p in (("gguf", path), ("hf", folder)))
    for field in ("sliding_window", "sliding_window_layers", "attention_scale", "embedding_multiplier",
                  "attn_logit_softcapping", "final_logit_softcapping", "local_rope_theta", "rope_theta",
                  "hidden_activation", "qk_norm", "tie_word_embeddings"):  # fmt: skip
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    scalings = [(c.rope_scaling.rope_type, c.rope_scaling.factor) if c.rope_scaling else None for c in (from_gguf, from_hf)]
    assert scalings[0] == scalings[1]
    assert from_gguf.sliding_window_layers == ((0, 2, 4) if arch == "gemma2" else (0, 1, 2, 3, 4))
    prompts = PROMPTS + [list(range(60, 90))]  # past the window
    assert pagellm_greedy(LLM(str(path), max_num_batched_tokens=16), prompts, 12) == pagellm_greedy(
        LLM(str(folder)), prompts, 12
    )
    if kernels_support(WeightType.Q8_0):
        quantized = write_gguf_from_hf(folder, tmp_path / "q8.gguf", cfg, quant_by_kind=QWEN3_TYPES, arch=arch)
        layer = LLM(str(quantized), dtype="bfloat16").engine.runner.model.layers[0]
        assert {t.label for t in layer.self_attn.qkv_proj.packed.types} == {"Q8_0", "BF16"}
        assert layer.mlp.down_proj.packed.types[0].label == "Q8_0"


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_config_dialects_load_the_same_model(tmp_path, arch):
    """transformers 5.x's layer_types and (Gemma 3) per-layer-type rope_parameters, against
    what downloaded Gemma checkpoints carry: no layer_types (Gemma 2 slides every other
    layer; Gemma 3 says sliding_window_pattern), rope_theta / rope_scaling for the global
    layers and rope_local_base_freq for the sliding ones."""
    overrides = {"num_hidden_layers": 6, "sliding_window": 10}
    if arch == "gemma3":
        overrides |= {"rope_theta": 100000.0, "rope_local_base_freq": 1000.0,
                      "rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # fmt: skip
    new = make_tiny_hf_checkpoint(tmp_path / "new", arch, seed=4, **overrides)
    old = make_tiny_hf_checkpoint(tmp_path / "old", arch, seed=4, **overrides)
    cfg = json.loads((old / "config.json").read_text())
    assert "layer_types" in cfg
    del cfg["layer_types"]
    rope = cfg.pop("rope_parameters")
    if arch == "gemma3":
        cfg.pop("_sliding_window_pattern", None)
        cfg |= {"sliding_window_pattern": 6, "rope_theta": rope["full_attention"]["rope_theta"],
                "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
                "rope_scaling": {"rope_type": "linear", "factor": rope["full_attention"]["factor"]}}  # fmt: skip
    else:
        cfg["rope_theta"] = rope["rope_theta"]
    (old / "config.json").write_text(json.dumps(cfg))
    config_new = load_model_config(ModelSource("hf", new, "g"))
    assert load_model_config(ModelSource("hf", old, "g")) == config_new
    if arch == "gemma3":
        assert (config_new.rope_theta, config_new.local_rope_theta) == (100000.0, 1000.0)
        assert config_new.sliding_window_layers == (0, 1, 2, 3, 4)
    else:
        assert config_new.sliding_window_layers == (0, 2, 4)
    # transformers reads the old dialect too.
    ref = load_hf_reference(old)
    assert pagellm_greedy(LLM(str(old)), PROMPTS, 16) == [hf_greedy(ref, p, 16) for p in PROMPTS]


def test_an_unknown_activation_or_a_bad_cap_is_refused_by_name(tmp_path):
    from pagellm.errors import UnsupportedModelError

    folder = make_tiny_hf_checkpoint(tmp_path / "g", "gemma2", num_hidden_layers=2)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"hidden_activation": "relu"}))
    with pytest.raises(UnsupportedModelError, match="activation 'relu'"):
        load_model_config(ModelSource("hf", folder, "g"))
    (folder / "config.json").write_text(json.dumps(cfg | {"attn_logit_softcapping": -1.0}))
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping must be positive"):
        load_model_config(ModelSource("hf", folder, "g"))


def test_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration: pagellm reads the text_config
    (over transformers' defaults, which downloaded configs leave out) and the language
    model's tensors, skips the vision tower, and on text equals transformers' multimodal
    model token for token."""
    import transformers

    from pagellm.bench.synthetic_model import write_byte_tokenizer

    text = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=10, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
        eoi_token_index=298, eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(-0.2, 0.2) if "norm" in name else param.normal_(0.0, 1.0 if "embed" in name else 0.15)
    folder = tmp_path / "gemma3-mm"
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert len({t for out in expected for t in out}) > 8
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=16)
    assert llm.engine.model_config.sliding_window_layers == (0, 1, 2, 3, 4)
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    # A config as the downloads have it: text_config without the keys at their defaults.
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"] = {k: v for k, v in cfg["text_config"].items()
                          if k not in ("rms_norm_eps", "hidden_activation", "layer_types", "rope_parameters")}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(ModelSource("hf", folder, "g")) == llm.engine.model_config
