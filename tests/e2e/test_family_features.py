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
from hf_models import load_hf_reference, make_tiny_hf_checkpoint
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
