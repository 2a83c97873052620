"""Qwen3.5's hybrid layers on the default CPU path (bfloat16: the one-call hybrid decode layer,
model/native/hybrid_decode.py, for small decode steps, and the hybrid layer ops,
model/native/hybrid_layers.py, for the rest: the linear layers on their measured kernels,
the Gated DeltaNet's native step, csrc/hybrid_layer_ops.c between them) against HF transformers in
float32, judged as tests/default_path.py judges bf16: teacher-forced top-1 agreement and
log-probability bounds from bf16 rounding, under every scheduling regime of the standard
scenarios (batching, chunked prefill, recompute and swap preemption, prefix caching with
the state's snapshots, n > 1), the schedule itself the same as in float32.

tests/e2e/test_hybrid_vs_hf.py holds float32 to HF's tokens exactly; this file is what a
user on a CPU gets by default."""

import dataclasses
import random

import pytest
import torch
from engine_checks import assert_engine_drained
from hf_models import load_hf_reference

import default_path as dp
from pagellm import LLM, SamplingParams
from pagellm.kernels.decode_layer import MAX_ROWS

# Three Gated DeltaNet layers and a gated attention one (Qwen3.5's order); head size 64 so
# the bf16 attention specialisation runs, rotary on a quarter of each head.
HYBRID_SHAPE = {"num_hidden_layers": 4, "head_dim": 64}
FAMILIES = {
    "qwen3_5": HYBRID_SHAPE,
    # Every layer sparse: 4 experts top-2 renormalized, a shared expert behind its gate.
    "qwen3_5_moe": {**HYBRID_SHAPE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "shared_expert_intermediate_size": 96},  # fmt: skip
}
NUM_LAYERS = HYBRID_SHAPE["num_hidden_layers"]
SCENARIOS = {s.name: s for s in dp.standard_scenarios(256)}
# A hybrid resumes a prefix hit from a snapshot of its state, taken every
# state_snapshot_interval blocks and kept as many as there are seats (two here), a decode
# crossing an interval replacing one: at 3 blocks the 3-block shared prefix is snapshotted
# and two of the later prompts still find it.
_prefix = SCENARIOS["prefix_caching"]
SCENARIOS["prefix_caching"] = dataclasses.replace(
    _prefix, engine_args={**_prefix.engine_args, "state_snapshot_interval": 3}, expect={"num_prefix_hit_tokens": 2 * 48}
)
# The experts' block is the dense model's MLP called as a module: two regimes show it runs.
MOE_SCENARIOS = ("plain", "chunked_prefill")


@pytest.fixture(scope="module", autouse=True)
def _needs_native_bf16():
    if not dp.native_bf16_kernels_available():
        pytest.skip("the default bf16 path needs the native CPU kernels (x86-64 with AVX2, and a C compiler)")


_BUILT: dict[str, tuple[str, object]] = {}


def _family(arch: str, tmp_path_factory) -> tuple[str, object]:  # noqa: ANN001
    if arch not in _BUILT:
        folder = dp.make_default_path_checkpoint(tmp_path_factory.mktemp(arch), arch=arch, **FAMILIES[arch])
        _BUILT[arch] = (str(folder), load_hf_reference(folder))
    return _BUILT[arch]


# Both CPU step paths run these layers and a measured choice decides which takes a small
# decode step, so each is forced in turn: the one-call hybrid layer (every regime) and the
# hybrid layer ops (which also run every prefill and larger decode step under either).
_FLOAT32_RUNS: dict[tuple[str, str], dp.ScenarioRun] = {}


def _float32_run(folder: str, name: str) -> dp.ScenarioRun:
    """The scenario in float32 (no native path), once for both forced paths."""
    if (folder, name) not in _FLOAT32_RUNS:
        _FLOAT32_RUNS[folder, name] = dp.run_scenario(folder, SCENARIOS[name], "float32")
    return _FLOAT32_RUNS[folder, name]


CASES = (
    [("qwen3_5", name, "fused") for name in SCENARIOS]
    + [("qwen3_5_moe", name, "fused") for name in MOE_SCENARIOS]
    + [("qwen3_5", name, "layers") for name in ("swap_preemption", "prefix_caching")]
    + [("qwen3_5_moe", "plain", "layers")]
)


@pytest.mark.parametrize("arch,name,decode_path", CASES, ids=[f"{a}-{n}-{p}" for a, n, p in CASES])
def test_bf16_agrees_with_hf_float32(arch, name, decode_path, tmp_path_factory, monkeypatch):
    folder, reference = _family(arch, tmp_path_factory)
    monkeypatch.setenv("PAGELLM_DECODE_PATH", decode_path)
    if decode_path == "fused":
        # The one-call layer takes a step only where every linear's measured kernel is a
        # native one; the streaming kernel everywhere keeps this case what it tests.
        monkeypatch.setenv("PAGELLM_LINEAR_KERNEL", "streaming")
    scenario = SCENARIOS[name]
    run = dp.run_scenario(folder, scenario, "bfloat16")
    dp.check_native_paths(run)
    assert run.paths is not None
    if decode_path == "layers":
        assert not run.paths.fused_decode and run.paths.native_layers_decode, run.paths
    else:  # every decode step of <= MAX_ROWS requests took the one-call layer
        assert all(rows > MAX_ROWS for rows in run.paths.native_layers_decode), run.paths
        assert run.paths.fused_decode or name == "parallel_sampling", run.paths  # that one decodes 24 at a time
    result = dp.teacher_forced(reference, run.completions)
    # Routing can flip under bf16 rounding: HF's own bf16 run calibrates the bound.
    calibrated = dp.hf_bf16_worst_logprob_error(reference, run.completions) if "moe" in arch else None
    dp.check_against_reference(result, NUM_LAYERS, f"{arch} {name}", reference_bf16_worst=calibrated)
    dp.check_same_schedule(run, _float32_run(folder, name))


def test_a_second_turn_resumes_from_snapshots_the_one_call_layer_took(tmp_path_factory, monkeypatch):
    """Turn 1's decode steps run on the one-call layer and cross two snapshot boundaries (at
    32 and 48 tokens, one snapshot per block): the layer copies each request's state after
    its token into the snapshot. Turn 2 (turn 1 + its answer + new text) resumes from the
    one at 48 and must still agree with HF float32, as a fresh prefill would."""
    folder, reference = _family("qwen3_5", tmp_path_factory)
    monkeypatch.setenv("PAGELLM_DECODE_PATH", "fused")
    monkeypatch.setenv("PAGELLM_LINEAR_KERNEL", "streaming")
    rng = random.Random(11)
    turn1 = [rng.randrange(3, 256) for _ in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    llm = LLM(folder, dtype="bfloat16", max_model_len=160, state_snapshot_interval=1, disable_log_stats=True)
    with dp.count_native_paths(llm) as paths:
        saved = _check_snapshots_equal_the_states(llm.engine.runner.step_paths.get("fused").fused)
        answer = list(llm.generate([turn1], params, use_tqdm=False)[0].outputs[0].token_ids)
        assert paths is not None and len(paths.fused_decode) == 29, paths  # every decode of turn 1
        assert len(saved) == 2  # at 32 and 48 tokens
        # One new token: the resumed state reaches the first answer token through the conv's
        # three-token history (the tiny model's decay forgets its recurrent state within ten).
        turn2 = turn1 + answer + [rng.randrange(3, 256)]
        output = llm.generate([turn2], params, use_tqdm=False)[0]
    # Turn 1 computed 49 tokens (its last answer token is never fed back): 3 full blocks.
    assert output.num_cached_tokens == 48
    completion = output.outputs[0]
    result = dp.teacher_forced(reference, [dp.Completion(turn2, list(completion.token_ids), completion.logprobs, True)])
    dp.check_against_reference(result, NUM_LAYERS, "second turn")
    assert_engine_drained(llm)


def _check_snapshots_equal_the_states(fused) -> list[int]:  # noqa: ANN001
    """Wrap the one-call layer's run: after each step, every snapshot it was asked to write
    must hold exactly its request's state (conv and recurrent, every Gated DeltaNet layer).
    Returns the snapshots checked (filled as steps run)."""
    run, checked = fused.run, []

    def run_and_check(hidden, positions, kv_caches, metadata):  # noqa: ANN001, ANN202
        out = run(hidden, positions, kv_caches, metadata)
        linear = metadata.linear
        for slot, saves in zip(linear.state_slots, linear.saves or (), strict=False):
            for _, snapshot in saves:
                for state, kept in zip(linear.layer_states, linear.snapshot_states, strict=True):
                    assert torch.equal(kept.conv[snapshot], state.conv[slot])
                    assert torch.equal(kept.recurrent[snapshot], state.recurrent[slot])
                checked.append(snapshot)
        return out

    fused.run = run_and_check
    return checked


def test_tensor_parallel_ranks_run_the_hybrid_layer_ops(tmp_path_factory):
    """Two ranks in bf16: each runs its half of the heads through the hybrid layer ops, the
    out_proj / o_proj / down partial sums all-reduced there, under chunked prefill."""
    folder, reference = _family("qwen3_5", tmp_path_factory)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 17, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    llm = LLM(folder, dtype="bfloat16", tensor_parallel_size=2, max_model_len=128, max_num_batched_tokens=24,
              disable_log_stats=True)  # fmt: skip
    assert llm.engine.runner.step_paths.names == ["layers", "eager"]
    with dp.count_native_paths(llm) as paths:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert paths is not None and paths.native_layers_decode and paths.native_layers_prefill
    completions = [dp.Completion(p, list(o.outputs[0].token_ids), o.outputs[0].logprobs, True) for p, o in zip(prompts, outputs)]
    dp.check_against_reference(dp.teacher_forced(reference, completions), NUM_LAYERS, "tensor parallel")
    llm.shutdown()
