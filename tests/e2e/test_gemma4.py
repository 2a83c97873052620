"""Gemma 4's features each matter, and its KV-shared layers hold no KV cache.

The family's greedy tokens and log-probabilities against HF under every scheduling regime
are in test_families_vs_hf.py (gemma4, gemma4_moe); here each feature is switched off in
the HF reference and the tokens change, so those tests can fail; the paged cache holds
blocks only for the layers that compute K/V (the allocator's accounting, and the bytes
against the same model without sharing); and the bf16 CPU path agrees with float32 HF
as the default-path tests judge bf16."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from engine_checks import assert_engine_drained
from gguf_models import write_gemma4_gguf
from hf_models import GEMMA4_MOE_SHAPE, load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy

import default_path as dp
from pagellm import LLM, SamplingParams
from pagellm.config.cache import kv_bytes_per_block
from pagellm.config.kv_layout import kv_bytes_per_token, kv_cache_layout
from pagellm.core.kv_tier import block_digest, group_key
from pagellm.model.loader import load_model_config, resolve_model_source
from pagellm.request import Request
from pagellm.worker.memory_report import storage_bytes

PROMPTS = [list(range(5, 40)), [40, 41, 42], [7, 200, 13, 90, 91, 92, 93, 17, 250, 3, 4]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("gemma4"), "gemma4", seed=5)
    ref = load_hf_reference(folder)
    return folder, ref, [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory):
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("gemma4_moe"), "gemma4", seed=5, **GEMMA4_MOE_SHAPE)
    ref = load_hf_reference(folder)
    return folder, ref, [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS]


def _switch_off(ref, feature: str) -> None:  # noqa: ANN001
    """One Gemma 4 feature switched off in the reference, in place."""
    layers = ref.model.layers
    if feature == "per-layer inputs":
        for layer in layers:
            layer.hidden_size_per_layer_input = 0
    elif feature == "kv sharing":
        # The shared sliding layer reads layer 0's K/V instead of its owner's (layer 3).
        layers[3].self_attn.store_full_length_kv = False
        layers[0].self_attn.store_full_length_kv = True
    elif feature == "proportional rotary":
        rotary = ref.model.rotary_emb
        head_dim = layers[2].self_attn.head_dim
        every = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        rotary.full_attention_inv_freq.copy_(every)
    elif feature == "value norm":
        for layer in layers:
            if hasattr(layer.self_attn, "v_norm"):
                layer.self_attn.v_norm = torch.nn.Identity()
    elif feature == "layer scalar":
        for layer in layers:
            layer.layer_scalar.fill_(1.0)
    elif feature == "window":
        ref.config.sliding_window = 4096
        for layer in layers:
            layer.self_attn.sliding_window = None
    elif feature == "experts":
        for layer in layers:
            layer.enable_moe_block = False
    elif feature == "per-expert scale":
        for layer in layers:
            layer.router.per_expert_scale.fill_(1.0)
    elif feature == "keys as values":
        # The global layers' values from their own (normalized, rotated) keys, not the projection's.
        for layer in layers:
            attention = layer.self_attn
            if attention.use_alternative_attention:
                attention.v_norm = torch.nn.Identity()
    else:
        raise AssertionError(feature)


@torch.inference_mode()
@pytest.mark.parametrize(
    "feature", ["per-layer inputs", "kv sharing", "proportional rotary", "value norm", "layer scalar", "window"]
)
def test_gemma4_features_bite(gemma4, feature):
    folder, _, expected = gemma4
    ref = load_hf_reference(folder)
    _switch_off(ref, feature)
    assert [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS] != expected


@torch.inference_mode()
@pytest.mark.parametrize("feature", ["experts", "per-expert scale", "keys as values", "window"])
def test_gemma4_moe_features_bite(gemma4_moe, feature):
    folder, _, expected = gemma4_moe
    ref = load_hf_reference(folder)
    _switch_off(ref, feature)
    assert [hf_greedy(ref, prompt, NEW_TOKENS) for prompt in PROMPTS] != expected


def test_kv_shared_layers_hold_no_blocks(gemma4):
    folder, _, expected = gemma4
    config = load_model_config(resolve_model_source(str(folder)))
    layout = kv_cache_layout(config)
    # Layers 4 and 5 read the K/V of layers 3 (sliding) and 2 (global): no group holds them.
    assert dict(layout.shared) == {4: 3, 5: 2}
    held = sorted(layer for group in layout.groups for layer in group.layers)
    assert held == [0, 1, 2, 3]
    # Global heads are 2 x 32 wide, sliding 2 x 16: two sliding layers side by side per tensor.
    assert layout.tensor_width == 64 and not layout.uniform
    assert {group.layers_per_tensor for group in layout.groups if group.window is not None} == {2}

    llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=16)
    runner = llm.engine.runner
    caches = runner.kv_caches
    for shared, owner in layout.shared:
        assert caches[shared].data_ptr() == caches[owner].data_ptr() and caches[shared].shape == caches[owner].shape
    assert caches[0].data_ptr() != caches[1].data_ptr()  # side by side in one tensor, not on top of each other
    assert caches[0].untyped_storage().data_ptr() == caches[1].untyped_storage().data_ptr()
    # The cache's bytes: one tensor 64 wide per block, in every group (float32: 4 bytes).
    num_blocks = caches[0].shape[1]
    assert storage_bytes(caches) == num_blocks * kv_bytes_per_block(config, runner.block_size, "float32")
    assert kv_bytes_per_block(config, 1, "float32") == 2 * 64 * 4
    # A token of context takes a slot in each of the 3 groups: the owners' K/V (global 2 x 32,
    # three sliding 2 x 16) and, in the group of the odd sliding layer, 32 unused columns.
    need = sum(kv_bytes_per_token(config, 4))
    assert need == 2 * 4 * (64 + 3 * 32)
    assert len(layout.groups) * kv_bytes_per_block(config, 1, "float32") * (1 - layout.wasted_share) == pytest.approx(need)
    # The same model with every layer computing its own K/V takes a third more per token.
    unshared = dataclasses.replace(config, num_kv_shared_layers=0)
    allocated = len(layout.groups) * kv_bytes_per_block(config, 1, "float32")
    unshared_allocated = len(kv_cache_layout(unshared).groups) * kv_bytes_per_block(unshared, 1, "float32")
    assert unshared_allocated == sum(kv_bytes_per_token(unshared, 4)) == 2 * 4 * (2 * 64 + 4 * 32)
    assert allocated / unshared_allocated == pytest.approx(3 / 4)

    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    # Each request held blocks in the three groups of owning layers only, and gave them all back.
    manager = llm.engine.scheduler.kv_cache_manager
    assert manager.num_groups == len(layout.groups) == 3
    assert_engine_drained(llm)


DEFAULT_PATH_LAYERS = 6
SCENARIOS = {s.name: s for s in dp.standard_scenarios(256)}


@pytest.fixture(scope="module", params=["gemma4", "gemma4_moe"])
def gemma4_default_path(request, tmp_path_factory):
    if not dp.native_bf16_kernels_available():
        pytest.skip("the default bf16 path needs the native CPU kernels (x86-64 with AVX2, and a C compiler)")
    overrides = {"num_hidden_layers": DEFAULT_PATH_LAYERS, "num_key_value_heads": 1}
    if request.param == "gemma4_moe":
        overrides.update({**GEMMA4_MOE_SHAPE, "num_key_value_heads": 2, "top_k_experts": 4})
    folder = dp.make_default_path_checkpoint(tmp_path_factory.mktemp(request.param), arch="gemma4", **overrides)
    return str(folder), load_hf_reference(folder)


@torch.inference_mode()
def _hf_bf16_against_float32(reference, completions) -> tuple[int, float]:  # noqa: ANN001
    """How close HF's own bf16 run comes to its float32 one on the same sequences: the
    positions where their argmaxes agree, and the largest log-probability gap of an emitted token."""
    bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    agreed, worst = 0, 0.0
    seen = set()
    for completion in completions:
        key = (tuple(completion.prompt), tuple(completion.token_ids))
        if key in seen:  # counted once, as dp.teacher_forced counts it
            continue
        seen.add(key)
        sequence = torch.tensor([completion.prompt + completion.token_ids[:-1]])
        start = len(completion.prompt) - 1
        f32 = torch.log_softmax(reference(sequence).logits[0, start:].double(), -1)
        b16 = torch.log_softmax(bf16(sequence).logits[0, start:].double(), -1)
        agreed += int((f32.argmax(-1) == b16.argmax(-1)).sum())
        emitted = torch.tensor(completion.token_ids)[:, None]
        worst = max(worst, float((f32.gather(1, emitted) - b16.gather(1, emitted)).abs().max()))
    return agreed, worst


@pytest.mark.parametrize("name", ["chunked_prefill", "swap_preemption"])  # prefix hits: test_families_vs_hf.py
def test_bf16_agrees_with_hf_float32(gemma4_default_path, name):
    """The PyTorch layers over the measured linear kernels (neither native step path
    computes Gemma 4's GeGLU, per-layer inputs or shared K/V). Six sandwich-normed layers
    with per-layer inputs and scalars move this tiny model further under bf16 than the
    default-path bounds allow for (HF's own bf16 agrees with its float32 argmax at ~89% of
    these positions), so the bar is HF's own bf16: at least its agreement (less the
    near-tie allowance) and at most twice its worst log-probability gap."""
    folder, reference = gemma4_default_path
    blocks = SCENARIOS[name].engine_args.get("num_gpu_blocks_override")
    groups = len(kv_cache_layout(load_model_config(resolve_model_source(folder))).groups)
    extra = {} if blocks is None else {"num_gpu_blocks_override": blocks * groups}
    run = dp.run_scenario(folder, SCENARIOS[name], "bfloat16", **extra)
    greedy = [c for c in run.completions if c.greedy]
    result = dp.teacher_forced(reference, greedy)
    hf_agreed, hf_worst = _hf_bf16_against_float32(reference, greedy)
    assert result.agreed >= hf_agreed - dp.allowed_mismatches(result.positions), (result.agreed, hf_agreed)
    assert result.logprob_errors and result.max_logprob_error <= 2 * hf_worst + 1e-3, (result.max_logprob_error, hf_worst)


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["gemma4", "gemma4_moe"])
def test_gguf_equals_the_hf_folder(kind, request, tmp_path):
    """llama.cpp's gemma4 file of the same weights (tests/gguf_models.py writes it as its
    converter does): the config read from its metadata, and HF's greedy tokens."""
    folder, _, expected = request.getfixturevalue(kind)
    cfg = json.loads((folder / "config.json").read_text())
    path = write_gemma4_gguf(folder, tmp_path / f"{kind}.gguf", cfg)
    config = load_model_config(resolve_model_source(str(path)))
    hf = load_model_config(resolve_model_source(str(folder)))
    for field in ("head_dim", "global_head_dim", "num_key_value_heads", "num_global_key_value_heads", "attention_k_eq_v",
                  "global_rotated_share", "num_kv_shared_layers", "double_wide_shared_mlp", "per_layer_input_size",
                  "sliding_window", "sliding_window_layers", "num_experts", "experts_beside_mlp", "local_rope_theta",
                  "rope_theta", "final_logit_softcapping", "attention_scale", "intermediate_size"):  # fmt: skip
        assert getattr(config, field) == getattr(hf, field), field
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=16)
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert_engine_drained(llm)


@torch.inference_mode()
def test_quantized_gguf_stays_as_stored(tmp_path):
    """A Q8_0 file on the bf16 CPU path: the projections, the per-layer inputs' table and
    projection, and the embedding stay Q8_0 as stored; teacher-forced on the float32 run's
    greedy tokens (the same file dequantized), its argmax agrees at most positions: bf16
    alone moves this tiny model's argmax at ~11% of positions (HF's own bf16 against its
    float32, test_bf16_agrees_with_hf_float32), a wrong stored kernel at nearly all."""
    import gguf

    # Per-layer inputs 16 wide: the table's rows (6 layers x 16) split into Q8_0's blocks of 32.
    folder = make_tiny_hf_checkpoint(tmp_path / "hf", "gemma4", seed=5, hidden_size_per_layer_input=16)
    cfg = json.loads((folder / "config.json").read_text())
    q8 = gguf.GGMLQuantizationType.Q8_0
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd",
             "per_layer_token_embd", "per_layer_model_proj")  # fmt: skip
    path = write_gemma4_gguf(folder, tmp_path / "q8.gguf", cfg, quant_by_kind={kind: q8 for kind in kinds})
    bf16 = LLM(str(path), dtype="bfloat16", max_model_len=128)
    model = bf16.engine.runner.model
    assert model.embed_tokens_per_layer.packed is not None and model.per_layer_model_projection.packed is not None
    assert model.layers[0].self_attn.q_proj.packed is not None and model.embed_tokens.packed is not None
    assert model.weight_bytes_by_format().get("Q8_0 as stored", 0) > 0
    reference = pagellm_greedy(LLM(str(path), dtype="float32", max_model_len=128), PROMPTS, NEW_TOKENS)
    sequences = [prompt + tokens for prompt, tokens in zip(PROMPTS, reference, strict=True)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    agreed = 0
    for prompt, sequence, output in zip(PROMPTS, sequences, bf16.generate(sequences, params, use_tqdm=False), strict=True):
        for position in range(len(prompt), len(sequence)):
            ranked = output.prompt_logprobs[position]
            agreed += ranked[sequence[position]].rank == 1
    assert agreed >= 0.75 * len(PROMPTS) * NEW_TOKENS, agreed
    assert_engine_drained(bf16)


def test_the_disk_tier_stores_only_the_layers_that_keep_kv(tmp_path):
    """The tier stores each block's cache tensors: the four layers that compute K/V, none
    for the two that read them. A new engine on the same path loads turn 1's blocks and
    continues turn 2 as HF does. (Every layer global here: one KV cache group, so the bytes
    per block are the owning layers' alone.)"""
    folder = make_tiny_hf_checkpoint(tmp_path / "hf", "gemma4", seed=5, layer_types=["full_attention"] * 6)
    ref = load_hf_reference(folder)
    turn1 = PROMPTS[0] + PROMPTS[2]  # 46 tokens
    answer = hf_greedy(ref, turn1, NEW_TOKENS)
    turn2 = turn1 + answer + PROMPTS[1]
    args = dict(max_model_len=128, kv_offload_path=str(tmp_path / "tier"))
    first = LLM(str(folder), **args)
    assert pagellm_greedy(first, [turn1], NEW_TOKENS) == [answer]
    written = first.engine.get_stats()
    assert written.num_tier_written_blocks > 0
    # Per block: 4 layers x K and V x 16 tokens x 2 heads of 32 x 4 bytes (float32) and the
    # entry's small header; all six layers would take 49152 bytes.
    per_block = written.num_tier_bytes_written / written.num_tier_written_blocks
    assert 4 * 2 * 16 * 64 * 4 <= per_block < 4 * 2 * 16 * 64 * 4 + 256
    first.shutdown()
    second = LLM(str(folder), **args)
    assert pagellm_greedy(second, [turn2], NEW_TOKENS) == [hf_greedy(ref, turn2, NEW_TOKENS)]
    stats = second.engine.get_stats()
    assert stats.num_tier_hit_blocks > 0 and stats.num_tier_failed_loads == 0
    assert_engine_drained(second)
    second.shutdown()


def test_the_disk_tier_restores_sliding_and_global_groups(gemma4, tmp_path):
    """Each KV cache group's block is a tier entry of its own (the global group's, and the
    sliding ones' whose layers sit side by side in a tensor): a new engine on the same path
    finds every group's entries of turn 1's blocks, loads them, and continues turn 2 as HF
    does. With one sliding group's entry of block 4 gone from the disk the tier's run stops
    before block 4 (every group's entry is needed; a sliding group loads only what its window
    reads at the run's end); with the global group's entry of block 2 corrupted, its load
    fails, the request is looked up again (the bad entry is gone), loads blocks 0 and 1 and
    computes from block 2 on, to the same tokens."""
    folder, ref, _ = gemma4
    turn1 = PROMPTS[0] + PROMPTS[2] + PROMPTS[0]  # 81 tokens: the window (8) passes blocks during the prefill
    answer = hf_greedy(ref, turn1, NEW_TOKENS)
    turn2 = turn1 + answer + PROMPTS[1]
    expected = hf_greedy(ref, turn2, NEW_TOKENS)
    args = dict(max_model_len=160, kv_offload_path=str(tmp_path / "tier"))
    first = LLM(str(folder), **args)
    assert pagellm_greedy(first, [turn1], NEW_TOKENS) == [answer]
    written = first.engine.get_stats().num_tier_written_blocks
    num_groups = len(kv_cache_layout(first.engine.config.model_config).groups)
    # Each full block in every group (the last block's write may still be on its way).
    assert num_groups == 3 and written % num_groups == 0 and written >= num_groups * 5
    first.shutdown()
    second = LLM(str(folder), **args)
    assert pagellm_greedy(second, [turn2], NEW_TOKENS) == [expected]
    stats = second.engine.get_stats()
    assert stats.num_tier_hit_blocks >= 5 and stats.num_tier_failed_loads == 0
    assert_engine_drained(second)
    second.shutdown()

    [store] = [path for path in (tmp_path / "tier").iterdir() if path.is_dir()]
    digests = [block_digest(h) for h in Request("turn1", turn2, SamplingParams()).get_block_hashes(16)]
    (store / f"{group_key(digests[4], 2).hex()}.kv").unlink()
    corrupt = store / f"{group_key(digests[2], 0).hex()}.kv"
    data = bytearray(corrupt.read_bytes())
    data[-7] ^= 0x10
    corrupt.write_bytes(bytes(data))
    third = LLM(str(folder), **args)
    output = third.generate([turn2], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == expected
    stats = third.engine.get_stats()
    assert stats.num_tier_hit_blocks == 4 + 2 and stats.num_tier_failed_loads == 1 and output.num_cached_tokens == 2 * 16
    assert_engine_drained(third)
    third.shutdown()
