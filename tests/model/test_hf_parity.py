"""Tiny random HF checkpoints: pagellm's logits and greedy tokens equal transformers'."""

import json

import pytest
import torch
from hf_models import load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy  # hf_greedy: plain argmax, EOS not masked

from pagellm.attention.selector import get_attention_backend
from pagellm import LLM
from pagellm.errors import ModelLoadError, UnsupportedModelError
from pagellm.model.loader import ModelSource, load_model, load_model_config
from pagellm.worker.kv_cache import allocate_kv_caches
from pagellm.worker.model_inputs import ScheduledSequence, prepare_model_inputs

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [3, 4],
    [100, 200, 30, 40, 50, 60, 70, 80, 90, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35],
    [42],
]
NEW_TOKENS = 32


def load_pagellm(folder):
    source = ModelSource("hf", folder, "tiny")
    config = load_model_config(source)
    return load_model(source, config, get_attention_backend())


@torch.inference_mode()
def pagellm_prefill_logits(model, prompt):
    kv = allocate_kv_caches(model.config, 8, 16, torch.float32, "cpu")
    blocks = [6, 2, 5, 7][: -(-len(prompt) // 16)]
    inputs = prepare_model_inputs([ScheduledSequence(prompt, 0, [blocks], True)], 16, "cpu")
    hidden = model(inputs.input_ids, inputs.positions, kv, inputs.metadata)
    return model.compute_logits(hidden)  # every position's logits


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
                "head_dim": 32,
            },
        ),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("qwen2", {}),
        ("mistral", {}),
        ("qwen3", {"head_dim": 32}),
        ("qwen3", {"tie_word_embeddings": True, "attention_bias": True}),
        # YaRN with a short original context, so that the ramp cuts through the head's
        # dimensions and the attention factor (0.1 ln 4 + 1) scales cos/sin.
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                                    "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}}),  # fmt: skip
        ("phi3", {}),
        # Phi-4-mini's partial rotary (a quarter of each head turns here) with LongRoPE; the
        # prompt stays inside the original context (transformers' rule and pagellm's agree there).
        ("phi3", {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 40,
                  "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                   "long_factor": [1.0, 4.0, 9.0, 20.0]}}),  # fmt: skip
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        # Qwen3-MoE: 8 experts of their own width, top-2 without renormalization, layer 1 dense.
        ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                       "norm_topk_prob": False, "mlp_only_layers": [1]}),  # fmt: skip
        ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                       "norm_topk_prob": True, "decoder_sparse_step": 2}),  # fmt: skip
    ],
    ids=["llama", "llama-tied", "llama3-rope", "linear-rope", "qwen2-bias", "mistral", "qwen3", "qwen3-tied-bias",
         "qwen3-yarn", "llama-yarn-untruncated", "phi3", "phi3-partial-longrope", "mixtral",
         "qwen3-moe", "qwen3-moe-renormalized-sparse-step"],  # fmt: skip
)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, arch, overrides):
    folder = make_tiny_hf_checkpoint(tmp_path, arch, **overrides)
    ref = load_hf_reference(folder)
    model = load_pagellm(folder)

    prompt = PROMPTS[2]
    with torch.inference_mode():
        ref_logits = ref(torch.tensor([prompt])).logits[0]
    ours = pagellm_prefill_logits(model, prompt)
    torch.testing.assert_close(ours, ref_logits, rtol=1e-4, atol=1e-4)

    # All prompts submitted together: one flattened batch through the engine.
    outputs = pagellm_greedy(LLM(str(folder)), PROMPTS, NEW_TOKENS)
    for prompt, tokens in zip(PROMPTS, outputs):
        assert tokens == hf_greedy(ref, prompt, NEW_TOKENS)
    assert len({t for out in outputs for t in out}) > 10, "degenerate model: test proves little"


def test_sharded_checkpoint_with_index(tmp_path):
    import transformers

    folder = make_tiny_hf_checkpoint(tmp_path / "one", "llama")
    ref = load_hf_reference(folder)
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(
        sharded, max_shard_size="100KB"
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((folder / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert pagellm_greedy(LLM(str(sharded)), [PROMPTS[0]], 16)[0] == hf_greedy(ref, PROMPTS[0], 16)


def test_generation_config_eos_ids_are_collected(tmp_path):
    folder = make_tiny_hf_checkpoint(tmp_path, "llama")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = load_model_config(ModelSource("hf", folder, "tiny"))
    assert config.eos_token_ids == (2, 7)


def test_unsupported_architecture_names_it(tmp_path):
    folder = make_tiny_hf_checkpoint(tmp_path, "llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model_config(ModelSource("hf", folder, "tiny"))


def test_architecture_from_model_type_when_unnamed(tmp_path):
    folder = make_tiny_hf_checkpoint(tmp_path, "qwen2")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["architectures"]  # as XConfig.save_pretrained writes it, without a model
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(ModelSource("hf", folder, "tiny")).architecture == "Qwen2ForCausalLM"
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="None"):
        load_model_config(ModelSource("hf", folder, "tiny"))


def test_corrupt_weights_and_config(tmp_path):
    folder = make_tiny_hf_checkpoint(tmp_path, "llama")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot read weights"):
        load_pagellm(folder)
    (folder / "config.json").write_text("{ broken")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model_config(ModelSource("hf", folder, "tiny"))
