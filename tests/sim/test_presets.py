"""GPU and model presets: every figure has a source; the SmolLM2 shape is the embedded model's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagellm.errors import ConfigError
from pagellm.sim.gpu_presets import GPU_PRESETS, get_gpu_preset
from pagellm.sim.model_presets import MODEL_PRESETS, get_model_preset


def test_the_issue_asks_for_these_presets():
    assert set(GPU_PRESETS) == {"A100-40GB", "A100-80GB", "H100-SXM", "H200", "L4", "A10G"}
    assert set(MODEL_PRESETS) >= {"Llama-3-8B", "Llama-3-70B", "Qwen2.5-7B", "SmolLM2-135M", "Llama-3.1-8B",
                                  "Llama-3.1-70B", "Qwen3-8B", "Qwen3-32B", "Phi-4", "Mixtral-8x7B", "Qwen3-30B-A3B",
                                  "Gemma-2-9B", "Gemma-3-27B"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GPU_PRESETS))
def test_gpu_figures_name_their_source(name):
    gpu = GPU_PRESETS[name]
    assert len(gpu.source) > 40
    # Each figure appears in its source text as printed there (the dense FLOP/s either
    # as such or as half the sparse figure).
    assert f"{gpu.memory_gib:g} GB" in gpu.source.replace(",", "")
    assert f"{gpu.peak_tflops:g}" in gpu.source or f"{2 * gpu.peak_tflops:,.0f}" in gpu.source


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_model_figures_name_their_source(name):
    preset = MODEL_PRESETS[name]
    assert preset.source.startswith("huggingface.co/")
    config = preset.config
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):  # fmt: skip
        assert f"{field}={getattr(config, field)}" in preset.source


def test_parameter_counts_match_the_model_names():
    assert get_model_preset("llama-3-8b").config.num_parameters() == pytest.approx(8.03e9, rel=0.01)
    assert get_model_preset("LLAMA-3-70B").config.num_parameters() == pytest.approx(70.6e9, rel=0.01)
    assert get_model_preset("qwen2.5-7b").config.num_parameters() == pytest.approx(7.62e9, rel=0.01)
    assert get_model_preset("SmolLM2-135M").config.num_parameters() == pytest.approx(134.5e6, rel=0.01)
    assert get_model_preset("Llama-3.1-8B").config.num_parameters() == pytest.approx(8.03e9, rel=0.01)
    assert get_model_preset("Qwen3-8B").config.num_parameters() == pytest.approx(8.19e9, rel=0.01)
    assert get_model_preset("Qwen3-32B").config.num_parameters() == pytest.approx(32.8e9, rel=0.01)
    assert get_model_preset("Phi-4").config.num_parameters() == pytest.approx(14.7e9, rel=0.01)
    assert get_model_preset("Mixtral-8x7B").config.num_parameters() == pytest.approx(46.7e9, rel=0.01)
    assert get_model_preset("Qwen3-30B-A3B").config.num_parameters() == pytest.approx(30.5e9, rel=0.01)
    assert get_model_preset("Gemma-2-9B").config.num_parameters() == pytest.approx(9.24e9, rel=0.01)
    assert get_model_preset("Gemma-3-27B").config.num_parameters() == pytest.approx(27.0e9, rel=0.01)  # text only


def test_mixtures_of_experts_compute_with_their_active_parameters_and_hold_all():
    """Qwen3-30B-A3B: ~3.3B parameters work per token (the name's A3B), all 30.5B are held;
    one decode token reads its 8 of 128 experts, a large batch reads nearly all."""
    from pagellm.model.costs import ModelCosts

    config = get_model_preset("Qwen3-30B-A3B").config
    costs = ModelCosts.from_config(config, 2)
    # Counted as Qwen counts activated parameters: the projections a token uses, the LM
    # head and the embedding.
    active = costs.linear_flops_per_token / 2 + 2 * config.vocab_size * config.hidden_size
    assert active == pytest.approx(3.3e9, rel=0.03)
    assert costs.weight_bytes == pytest.approx(30.5e9 * 2, rel=0.01)
    one, many = costs.linear_bytes_read(1), costs.linear_bytes_read(4096)
    assert one < 0.15 * costs.linear_weight_bytes and many == pytest.approx(costs.linear_weight_bytes, rel=1e-3)
    dense = ModelCosts.from_config(get_model_preset("Qwen3-8B").config, 2)
    assert dense.linear_bytes_read(1) == dense.linear_weight_bytes


def test_smollm2_preset_is_the_embedded_model(smollm2_path):
    from pagellm.model.loader import ModelSource, load_model_config

    embedded = load_model_config(ModelSource("gguf", smollm2_path, "smollm2"))
    preset = get_model_preset("SmolLM2-135M").config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings"):  # fmt: skip
        assert getattr(embedded, field) == getattr(preset, field), field


def test_unknown_names_list_the_presets():
    with pytest.raises(ConfigError, match="H100-SXM"):
        get_gpu_preset("B200")
    with pytest.raises(ConfigError, match="Llama-3-8B"):
        get_model_preset("gpt-5")
    assert get_gpu_preset("h200").name == "H200"


@pytest.mark.parametrize("name,parameters,weight_gb", [("gpt-oss-20b", 21e9, 13.8), ("gpt-oss-120b", 117e9, 65.2)])
def test_gpt_oss_presets_count_the_experts_as_mxfp4(name, parameters, weight_gb):
    """OpenAI's figures: 21B and 117B parameters; the checkpoints (MXFP4 experts, the rest
    bf16) are 13.8 and 65.2 GB. At bf16 throughout the experts alone would be ~40 and ~230 GB."""
    from pagellm.model.costs import ModelCosts

    preset = get_model_preset(name)
    costs = ModelCosts.from_config(preset.config, preset.dtype_bytes)
    assert abs(preset.config.num_parameters() / parameters - 1) < 0.01
    assert abs(costs.weight_bytes / 1e9 / weight_gb - 1) < 0.02
    bf16 = ModelCosts.from_config(replace(preset.config, expert_bits_per_weight=None), preset.dtype_bytes)
    assert bf16.expert_weight_bytes / costs.expert_weight_bytes == pytest.approx(16 / 4.25)


@pytest.mark.parametrize("name,parameters", [("Gemma-4-31B", 30.7e9), ("Gemma-4-26B-A4B", 25.2e9)])
def test_gemma4_presets_count_their_parameters(name, parameters):
    """Google's figures for the 31B dense and the 26B mixture of experts (total parameters)."""
    assert abs(get_model_preset(name).config.num_parameters() / parameters - 1) < 0.01


def test_gemma4_e4b_counts_only_the_layers_that_keep_kv():
    """E4B's last 18 of 42 layers read earlier layers' K/V: the cost model and the cache
    count the 24 others (4 global with 2 heads of 512, 20 sliding with 2 heads of 256)."""
    from pagellm.config.kv_layout import kv_bytes_per_token, kv_cache_layout
    from pagellm.model.costs import ModelCosts

    preset = get_model_preset("Gemma-4-E4B")
    config = preset.config
    assert len(config.kv_layers) == 24
    global_bytes, sliding_bytes = kv_bytes_per_token(config, 2)
    assert (global_bytes, sliding_bytes) == (4 * 2 * 1024 * 2, 20 * 2 * 512 * 2)
    assert ModelCosts.from_config(config, 2).kv_bytes_per_token == global_bytes + sliding_bytes
    layout = kv_cache_layout(config)
    assert len(layout.shared) == 18 and layout.wasted_share == 0
    assert sorted(layer for group in layout.groups for layer in group.layers) == list(config.kv_layers)
