"""Qwen3.5, dense and MoE, and Qwen3-Next (hybrids: Gated DeltaNet linear attention in three layers of four,
gated full attention in the fourth) through the whole engine, against HF transformers in float32 on
the same tiny random weights: greedy tokens equal under batching, chunked prefill that
cuts prompts mid-block, one request at a time, recompute preemption and n > 1 forks;
log-probabilities within 1e-4. Each feature of the family is shown to matter: switched
off in the reference, the tokens change."""

from __future__ import annotations

import contextlib
import logging
import math
import random
from pathlib import Path
from unittest import mock

import pytest
import torch
from engine_checks import assert_engine_drained
from hf_models import load_hf_multimodal_reference, load_hf_reference, make_tiny_hf_checkpoint, make_tiny_qwen3_5_multimodal
from reference import hf_greedy, pagellm_greedy

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.config.engine_config import hybrid_model_args
from pagellm.core.kv_tier import block_digest, state_key
from pagellm.errors import ConfigError
from pagellm.model.loader import load_model_config, resolve_model_source
from pagellm.request import Request

NEW_TOKENS = 24
MAX_MODEL_LEN = 160


def make_prompts() -> list[list[int]]:
    rng = random.Random(7)
    # Lengths on both sides of the delta rule's 64-token chunk, and single tokens.
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 3, 9, 16, 17, 33, 70, 100)]


PROMPTS = make_prompts()


FAMILIES = {
    "qwen3_5": {},
    # Qwen3.5-MoE: every layer sparse, 4 experts top-2 renormalized, a shared expert behind
    # its sigmoid gate.
    "qwen3_5_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 48},  # fmt: skip
    # Qwen3-Next: Qwen3.5-MoE's layers with q, k, v, z (and b, a) fused per key head in the
    # checkpoint, a dense MLP in layer 1, the chosen experts' weights not renormalized.
    "qwen3_next": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48, "mlp_only_layers": [1], "norm_topk_prob": False},  # fmt: skip
}


_BUILT: dict[str, tuple[str, object, list[list[int]]]] = {}


def _checkpoint(arch: str, tmp_path_factory) -> tuple[str, object, list[list[int]]]:  # noqa: ANN001
    """The family's tiny checkpoint, its HF model and HF's greedy tokens (built once)."""
    if arch not in _BUILT:
        folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=3, **FAMILIES[arch])
        ref = load_hf_reference(folder)
        expected = [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
        assert len({t for out in expected for t in out}) > 10, "degenerate model: the test would prove little"
        _BUILT[arch] = (str(folder), ref, expected)
    return _BUILT[arch]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hybrid(request, tmp_path_factory):
    """Each family: the regimes that cut the work differently."""
    return _checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The dense family alone, for what the experts do not change."""
    return _checkpoint("qwen3_5", tmp_path_factory)


def run(folder: str, **engine_args: object) -> tuple[LLM, list[list[int]]]:
    engine_args.setdefault("max_model_len", MAX_MODEL_LEN)
    llm = LLM(folder, **engine_args)
    outputs = pagellm_greedy(llm, PROMPTS, NEW_TOKENS)
    assert_engine_drained(llm)
    return llm, outputs


@pytest.mark.parametrize(
    "engine_args", [{}, {"max_num_batched_tokens": 7}], ids=["batched", "chunked-prefill-7"]
)
def test_greedy_tokens_equal_hf(hybrid, engine_args):
    folder, _, expected = hybrid
    _, outputs = run(folder, **engine_args)
    assert outputs == expected


@pytest.mark.parametrize(
    "engine_args",
    [{"max_num_seqs": 1}, {"max_num_seqs": 3, "max_num_batched_tokens": 40}],
    ids=["one-at-a-time", "three-seats"],
)
def test_greedy_tokens_equal_hf_in_other_batches(dense, engine_args):
    folder, _, expected = dense
    _, outputs = run(folder, **engine_args)
    assert outputs == expected


def test_tensor_parallel_2_splits_the_linear_heads_and_equals_hf(hybrid):
    """Two ranks, each with half the attention and linear-attention heads (and the recurrent
    state of its heads), its share of the experts' width: HF's tokens, under chunked prefill."""
    folder, _, expected = hybrid
    llm, outputs = run(folder, tensor_parallel_size=2, max_num_batched_tokens=24)
    assert outputs == expected
    spec = llm.engine.config.model_config.linear_attention
    assert spec is not None and llm.engine.runner.model.config.linear_attention.num_key_heads == spec.num_key_heads // 2
    llm.shutdown()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_recomputes_or_swaps_the_state(hybrid, mode):
    """Recompute rebuilds a preempted request's state from its tokens; swap copies it to a
    host slot with its KV and back into a device slot."""
    folder, _, expected = hybrid
    llm, outputs = run(folder, max_model_len=128, num_gpu_blocks_override=10, preemption_mode=mode, swap_space=0.01)
    assert outputs == expected
    stats = llm.engine.get_stats()
    if mode == "recompute":
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
    else:
        assert stats.num_preemptions_swap > 0
        assert llm.engine.config.cache_config.num_host_state_slots == llm.engine.config.cache_config.num_state_slots


def test_seats_are_cut_to_the_states_half_the_budget_holds(dense, caplog):
    """Each running request's state (5376 bytes here) and its snapshot come off the cache
    budget: 100 kB holds them for 4 requests in its half, so the engine runs 4 at a time
    (not the default 256), and gives HF's tokens."""
    folder, _, expected = dense
    with caplog.at_level(logging.INFO, logger="pagellm"):
        llm, outputs = run(folder, kv_cache_memory_bytes=100_000, max_model_len=128)
    assert outputs == expected
    assert llm.engine.config.scheduler_config.max_num_seqs == llm.engine.config.cache_config.num_state_slots == 4
    assert llm.engine.config.cache_config.num_state_snapshots == 4
    assert "recurrent states for 4 requests (not 256: more would take over 50% of the budget)" in caplog.text


def test_forked_completions_start_from_the_parents_state(hybrid):
    folder, _, expected = hybrid
    llm = LLM(folder, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0.0, n=3, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS[2:6], params, use_tqdm=False)
    for output, want in zip(outputs, expected[2:6], strict=True):
        assert [list(c.token_ids) for c in output.outputs] == [want] * 3
    assert_engine_drained(llm)


@torch.inference_mode()
def test_logprobs_within_1e_4_of_hf(hybrid):
    folder, ref, _ = hybrid
    prompts = PROMPTS[3:7]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    outputs = LLM(folder, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=24).generate(prompts, params, use_tqdm=False)
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


def test_prefix_caching_resumes_from_snapshots(dense):
    folder, _, expected = dense
    llm = LLM(folder, max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    # Each prompt of 64 tokens or more resumes the second time after its 64th (interval 4).
    assert llm.engine.get_stats().num_prefix_hit_tokens == 64 * sum(len(p) > 64 for p in PROMPTS)
    assert_engine_drained(llm)


@pytest.mark.parametrize("interval,resumed", [(4, 128), (1, 176)])
def test_a_second_turn_resumes_from_the_first_turns_snapshot(dense, interval, resumed, caplog):
    """Turn 2 = turn 1's prompt + its answer + new text: served from the state kept after
    the last snapshot boundary inside turn 1's cached blocks, it computes only the rest,
    and equals HF's greedy continuation."""
    folder, ref, _ = dense
    turn1 = PROMPTS[-1] + PROMPTS[-2][:50]  # 150 tokens
    answer = hf_greedy(ref, turn1, 40)
    turn2 = turn1 + answer + PROMPTS[-3][:30]
    # Chunks of 48 cut the prompts mid-block; snapshots are taken inside chunks.
    llm = LLM(folder, max_model_len=MAX_MODEL_LEN * 2, max_num_batched_tokens=48, state_snapshot_interval=interval)
    assert pagellm_greedy(llm, [turn1], 40) == [answer]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with caplog.at_level(logging.DEBUG, logger="pagellm.core.scheduler"):
        output = llm.generate([turn2], params, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(ref, turn2, 16)
    # Turn 1 computed 189 tokens (its last answer token is never fed back): 11 full blocks.
    assert output.num_cached_tokens == resumed
    line = f"{len(turn2)} prompt tokens ({resumed} from the KV cache and a state snapshot, 0 from its tier, "
    assert line + f"{len(turn2) - resumed} computed)" in caplog.text
    assert_engine_drained(llm)


def _two_turns(ref) -> tuple[list[int], list[int], list[int]]:  # noqa: ANN001
    turn1 = PROMPTS[-1] + PROMPTS[-2][:50]  # 150 tokens
    answer = hf_greedy(ref, turn1, 40)
    return turn1, answer, turn1 + answer + PROMPTS[-3][:30]


def _tier_engine(folder: str, tier: Path) -> LLM:
    return LLM(folder, max_model_len=MAX_MODEL_LEN * 2, max_num_batched_tokens=48, kv_offload_path=str(tier))


def _first_turn_on_disk(folder: str, ref, tier: Path) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Turn 1 served by an engine that then shuts down; returns (turn 1 + its answer, turn 2)."""
    turn1, answer, turn2 = _two_turns(ref)
    llm = _tier_engine(folder, tier)
    assert pagellm_greedy(llm, [turn1], 40) == [answer]
    stats = llm.engine.get_stats()
    # Turn 1 computed 189 tokens: 11 full blocks, and snapshots after 64 and 128 tokens.
    assert stats.num_tier_written_blocks == 11 and stats.num_tier_written_states == 2
    llm.shutdown()
    return turn1 + answer, turn2


def test_a_conversation_resumes_after_a_restart_from_the_disk_tier(dense, tmp_path, caplog):
    """The engine of turn 1 shuts down; a new one on the same --kv-offload-path finds turn
    1's blocks and its last snapshot there (nothing on its device), loads them and computes
    only from the snapshot on: turn 2 equals HF's greedy continuation."""
    folder, ref, _ = dense
    _, turn2 = _first_turn_on_disk(folder, ref, tmp_path / "tier")
    llm = _tier_engine(folder, tmp_path / "tier")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with caplog.at_level(logging.DEBUG, logger="pagellm.core.scheduler"):
        output = llm.generate([turn2], params, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(ref, turn2, 16)
    assert output.num_cached_tokens == 128
    line = f"{len(turn2)} prompt tokens (0 from the KV cache and a state snapshot, 128 from its tier, "
    assert line + f"{len(turn2) - 128} computed)" in caplog.text
    stats = llm.engine.get_stats()
    assert stats.num_tier_loaded_states == 1 and stats.num_tier_hit_blocks == 8 and stats.num_tier_failed_loads == 0
    assert stats.num_prefill_tokens == len(turn2) - 128
    assert_engine_drained(llm)
    llm.shutdown()


def test_a_corrupt_or_truncated_snapshot_is_recomputed_never_trusted(dense, tmp_path):
    """The snapshot after 128 tokens cut short, the one after 64 with a flipped byte: the
    new engine's scan drops the short file; the other fails its checksum when loaded and
    is removed, the request is looked up again, finds no other snapshot and computes its
    whole prompt, and still equals HF; the snapshots it takes on the way replace the bad files."""
    folder, ref, _ = dense
    history, turn2 = _first_turn_on_disk(folder, ref, tmp_path / "tier")
    [store] = [path for path in (tmp_path / "tier").iterdir() if path.is_dir()]
    hashes = Request("turn1", history, SamplingParams()).get_block_hashes(16)
    late, early = (store / f"{state_key(block_digest(hashes[n - 1])).hex()}.kv" for n in (8, 4))
    good_late = late.read_bytes()
    late.write_bytes(good_late[:-100])
    data = bytearray(early.read_bytes())
    data[-7] ^= 0x10
    early.write_bytes(bytes(data))
    llm = _tier_engine(folder, tmp_path / "tier")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    output = llm.generate([turn2], params, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(ref, turn2, 16)
    assert output.num_cached_tokens == 0
    stats = llm.engine.get_stats()
    assert stats.num_tier_failed_loads == 1 and stats.num_tier_loaded_states == 0
    assert_engine_drained(llm)
    llm.shutdown()
    # Turn 2 computed the history again, and its snapshots replaced the bad files.
    assert late.read_bytes() == good_late and early.read_bytes() != bytes(data)


@pytest.mark.parametrize(
    "args",
    [{"enable_lora": True}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}],
    ids=["lora", "speculative"],
)
def test_what_a_hybrid_cannot_run_yet_is_refused_by_name(dense, args):
    folder, _, _ = dense
    config = load_model_config(resolve_model_source(folder))
    with pytest.raises(ConfigError, match="not supported yet on a hybrid model"):
        hybrid_model_args(EngineArgs(model=folder, **args), config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_triton_decode_step_gives_hfs_tokens(hybrid):
    """On an NVIDIA GPU the decode steps of the linear-attention layers run in the Triton
    kernels (attention/triton_gated_delta.py; checked under the interpreter on CPU)."""
    folder, _, expected = hybrid
    _, outputs = run(folder, device="cuda", dtype="float32", enforce_eager=True, max_num_batched_tokens=24)
    assert outputs == expected


def _switch_off(ref, feature: str) -> contextlib.AbstractContextManager:  # noqa: ANN001
    """Switch one feature of the family off in the reference model `ref`."""
    linear = [layer.linear_attn for layer in ref.model.layers if layer.block_type == "linear_attention"]
    if feature == "decay":  # softplus(-inf) = 0: g = 0, the state never fades
        for layer in linear:
            layer.dt_bias.fill_(-1e4)
    elif feature == "convolution":  # only the current token's input passes
        for layer in linear:
            layer.conv1d.weight.zero_()
            layer.conv1d.weight[:, 0, -1] = 1.0
    elif feature == "partial rotary":  # rotary over the whole head instead of a quarter of it
        dim = ref.config.head_dim
        ref.model.rotary_emb.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    elif feature == "output gate":  # the attention output's gate is its only torch.sigmoid
        return mock.patch.object(torch, "sigmoid", torch.ones_like)
    return contextlib.nullcontext()


@pytest.mark.parametrize("feature", ["decay", "convolution", "partial rotary", "output gate"])
@torch.inference_mode()
def test_each_feature_of_the_family_changes_the_tokens(dense, feature):
    folder, _, expected = dense
    ref = load_hf_reference(folder)
    with _switch_off(ref, feature):
        changed = [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS[3:8]]
    assert changed != expected[3:8], f"switching off the {feature} left the tokens as they were"


def test_the_multimodal_checkpoints_language_model(tmp_path):
    """Qwen3_5ForConditionalGeneration as downloaded: its language model runs, its vision
    tower is not loaded, and text-only requests equal the multimodal model's own greedy."""
    folder = make_tiny_qwen3_5_multimodal(tmp_path, seed=4)
    ref = load_hf_multimodal_reference(folder)
    prompts = PROMPTS[2:7]
    expected = [hf_greedy(ref, p, 16) for p in prompts]
    llm = LLM(str(folder), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32)
    assert pagellm_greedy(llm, prompts, 16) == expected
    assert llm.engine.config.model_config.architecture == "Qwen3_5ForCausalLM"
    assert_engine_drained(llm)
