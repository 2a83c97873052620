"""Qwen3.5's hybrid layers on the default CPU path (bfloat16 through the hybrid layer ops,
model/native/hybrid_layers.py: the linear layers on their measured kernels, the Gated
DeltaNet's native step, csrc/hybrid_layer_ops.c between them) against HF transformers in
float32, judged as tests/default_path.py judges bf16: teacher-forced top-1 agreement and
log-probability bounds from bf16 rounding, under every scheduling regime of the standard
scenarios (batching, chunked prefill, recompute and swap preemption, prefix caching with
the state's snapshots, n > 1), the schedule itself the same as in float32.

tests/e2e/test_hybrid_vs_hf.py holds float32 to HF's tokens exactly; this file is what a
user on a CPU gets by default."""

import dataclasses

import pytest
from hf_models import load_hf_reference

import default_path as dp

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


CASES = [("qwen3_5", name) for name in SCENARIOS] + [("qwen3_5_moe", name) for name in MOE_SCENARIOS]


@pytest.mark.parametrize("arch,name", CASES, ids=[f"{a}-{n}" for a, n in CASES])
def test_bf16_agrees_with_hf_float32(arch, name, tmp_path_factory):
    folder, reference = _family(arch, tmp_path_factory)
    scenario = SCENARIOS[name]
    run = dp.run_scenario(folder, scenario, "bfloat16")
    dp.check_native_paths(run)
    assert run.paths is not None and run.paths.native_layers_decode, "no decode step took the hybrid layer ops"
    result = dp.teacher_forced(reference, run.completions)
    # Routing can flip under bf16 rounding: HF's own bf16 run calibrates the bound.
    calibrated = dp.hf_bf16_worst_logprob_error(reference, run.completions) if "moe" in arch else None
    dp.check_against_reference(result, NUM_LAYERS, f"{arch} {name}", reference_bf16_worst=calibrated)
    dp.check_same_schedule(run, dp.run_scenario(folder, scenario, "float32"))
