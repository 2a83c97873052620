"""Sim stage: command-line flags shared by `pagellm simulate` and `pagellm tune`.

Four groups: the target (a model preset or checkpoint on a GPU preset with the
roofline cost model, or a calibration file from `pagellm calibrate`), parallelism
(tensor- and data-parallel sizes, vLLM's flag names, and the interconnect), the workload
(the benchmarks' workload flags plus arrivals, a shared-prefix share, or a trace), and
the engine arguments, with EngineArgs' names and defaults; `simulate` adds speculative
decoding from an assumed acceptance rate. Only argparse-level work
happens here; nothing heavy is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from pagellm.config.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES
from pagellm.config.engine_args import PROFILE_CHOICES, EngineArgs
from pagellm.errors import ConfigError
from pagellm.sim.gpu_presets import GPU_PRESETS
from pagellm.sim.interconnect_presets import INTERCONNECT_PRESETS
from pagellm.sim.model_presets import MODEL_PRESETS
from pagellm.sim.roofline import RooflineParams
from pagellm.sim.speculation import SimSpeculationConfig
from pagellm.sim.tensor_parallel_costs import DEFAULT_ALLREDUCE_EFFICIENCY
from pagellm.sim.tune import simulated_tier
from pagellm.workload.synthetic import add_workload_args, workload_spec_from_args

_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
# The engine arguments a simulation uses, with their types; `tune` can sweep these (the
# first five: the classic memory and batching knobs; then the scheduler's prefill/decode
# balance knobs).
TUNED_KNOBS: dict[str, type] = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "gpu_memory_utilization": float,
    "max_model_len": int,
    "block_size": int,
    "max_num_partial_prefills": int,
    "long_prefill_token_threshold": int,
    "prefill_share": float,
    # The prefix cache's disk tier, simulated (0: none; the simulator's default).
    "kv_offload_bytes": int,
}
# Where the simulator's default differs from the engine's.
_SIM_DEFAULTS: dict[str, object] = {"kv_offload_bytes": 0}
_FIXED_KNOBS: dict[str, type] = {
    "kv_cache_memory_bytes": int,
    "num_gpu_blocks_override": int,
    "swap_space": float,
}
_CHOICE_KNOBS = {
    "preemption_mode": PREEMPTION_MODES,
    "scheduling_policy": SCHEDULING_POLICIES,
    "profile": PROFILE_CHOICES,
}
_BOOL_KNOBS = ("enable_prefix_caching", "enable_chunked_prefill")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_target_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("what to simulate")
    group.add_argument("--model", default="Llama-3-8B",
                       help=f"model preset ({', '.join(MODEL_PRESETS)}) or a GGUF file / HF folder "
                       "whose shape to use (default: Llama-3-8B)")
    group.add_argument("--gpu", default="H100-SXM",
                       help=f"GPU preset: {', '.join(GPU_PRESETS)} (default: H100-SXM)")
    group.add_argument("--calibration", default=None, metavar="FILE",
                       help="a `pagellm calibrate` fit: simulate the measured engine and machine "
                       "instead of a model on a GPU preset (--model and --gpu are then ignored)")
    defaults = RooflineParams()
    group.add_argument("--compute-efficiency", type=float, default=defaults.compute_efficiency,
                       help="roofline: fraction of peak FLOP/s the matmuls reach "
                       f"(default {defaults.compute_efficiency})")
    group.add_argument("--bandwidth-efficiency", type=float, default=defaults.bandwidth_efficiency,
                       help="roofline: fraction of peak memory bandwidth reached "
                       f"(default {defaults.bandwidth_efficiency})")
    group.add_argument("--step-overhead-ms", type=float, default=defaults.step_overhead_s * 1e3,
                       help="roofline: fixed CPU time per step the GPU waits for "
                       f"(default {defaults.step_overhead_s * 1e3:g})")  # fmt: skip


def add_parallel_args(parser: argparse.ArgumentParser, *, tune: bool = False) -> None:
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="GPUs one engine's model is split over (roofline only; default 1)")
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine replicas, each with its own KV cache; requests are routed "
                       "round-robin in arrival order (default 1)")
    if tune:
        group.add_argument("--num-gpus", type=int, default=None,
                           help="compare every layout of this many GPUs (TP x DP = N, e.g. 8: "
                           "TP=8, 2 x TP=4, 4 x TP=2, 8 x TP=1) instead of one --tensor-/"
                           "--data-parallel-size; engine knobs are then swept only where given")
    group.add_argument("--interconnect", choices=list(INTERCONNECT_PRESETS), default=None,
                       help="link of a tensor-parallel group (default: the GPU preset's own: "
                       "NVLink for SXM parts, PCIe for PCIe cards)")
    group.add_argument("--allreduce-efficiency", type=float, default=DEFAULT_ALLREDUCE_EFFICIENCY,
                       help="fraction of the link's per-direction bandwidth an all-reduce reaches "
                       f"(default {DEFAULT_ALLREDUCE_EFFICIENCY})")
    group.add_argument("--allreduce-latency-us", type=float, default=None,
                       help="fixed time of one all-reduce (default: the interconnect preset's "
                       "assumption, 10 us NVLink, 25 us PCIe)")  # fmt: skip


def add_sim_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    add_workload_args(group)  # type: ignore[arg-type]  # the benchmarks' length flags and --seed
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second (default: inf = all at time 0)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more even")
    group.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                       help="simulate the arrivals of this many seconds (replaces --num-requests)")
    group.add_argument("--shared-prefix-share", type=float, default=0.0, metavar="FRACTION",
                       help="this fraction of requests starts with a common --shared-prefix-len "
                       "prefix (e.g. a system prompt)")
    group.add_argument("--kv-offload-read-gbps", type=float, default=2.0, metavar="GB/S",
                       help="read bandwidth of the prefix cache's disk tier, with --kv-offload-bytes "
                       "(default 2.0: a local NVMe drive)")
    group.add_argument("--trace", default=None, metavar="FILE",
                       help="JSONL trace, one request a line: arrival_time, prompt_len, "
                       "output_len (replaces the synthetic workload)")  # fmt: skip


def add_sim_engine_args(parser: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """Engine arguments; with sweep=True the tuned knobs take several values each."""
    group = parser.add_argument_group("engine arguments (EngineArgs' names and defaults)")
    for name, kind in TUNED_KNOBS.items():
        default = _SIM_DEFAULTS.get(name, _ENGINE_DEFAULTS[name])
        if sweep:
            group.add_argument(_flag(name), type=kind, nargs="+", default=None, metavar="V",
                               help=f"values to try (default: {default})")
        else:
            group.add_argument(_flag(name), type=kind, default=default,
                               help=f"(default: {default})")
    for name, kind in _FIXED_KNOBS.items():
        group.add_argument(_flag(name), type=kind, default=_ENGINE_DEFAULTS[name],
                           help=f"(default: {_ENGINE_DEFAULTS[name]})")
    for name, choices in _CHOICE_KNOBS.items():
        group.add_argument(_flag(name), choices=choices, default=_ENGINE_DEFAULTS[name])
    for name in _BOOL_KNOBS:
        group.add_argument(_flag(name), action=argparse.BooleanOptionalAction,
                           default=_ENGINE_DEFAULTS[name])  # fmt: skip


def add_sim_speculation_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (modelled from an acceptance rate)")
    group.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                       help="tokens proposed per decode and verified in the same step, as "
                       "--speculative-config's num_speculative_tokens (default 0: no speculation)")
    group.add_argument("--spec-acceptance-rate", type=float, default=None, metavar="A",
                       help="chance that each proposed token is accepted, given the ones before it "
                       "were (a rejection ends the run); needed with --speculative-tokens")
    group.add_argument("--spec-disable-by-batch-size", type=int, default=8, metavar="N",
                       help="no step speculates with more than N requests running, as the engine's "
                       "disable_by_batch_size (default 8; 0: always speculate)")  # fmt: skip


def speculation_from(args: argparse.Namespace) -> SimSpeculationConfig | None:
    """The speculation flags as a config (None: no speculation); acceptances are drawn
    from the workload's --seed, so a run repeats."""
    k, rate = args.speculative_tokens, args.spec_acceptance_rate
    if k == 0:
        if rate is not None:
            raise ConfigError("--spec-acceptance-rate needs --speculative-tokens K (K >= 1)")
        return None
    if rate is None:
        raise ConfigError("--speculative-tokens needs --spec-acceptance-rate A (0 <= A <= 1)")
    limit = args.spec_disable_by_batch_size
    if limit < 0:
        raise ConfigError(f"--spec-disable-by-batch-size must be >= 0 (0: always speculate), got {limit}")
    return SimSpeculationConfig(k, rate, limit or None, args.seed)


def engine_args_from(args: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """EngineArgs from the parsed flags, with `overrides` for the knobs being swept."""
    values = {name: getattr(args, name) for name in (*_FIXED_KNOBS, *_CHOICE_KNOBS, *_BOOL_KNOBS)}
    for name in TUNED_KNOBS:
        value = getattr(args, name)
        # A list is a sweep (set through `overrides`); None is an unswept default.
        if value is not None and not isinstance(value, list):
            values[name] = value
    values.update(overrides)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
        value = values.get(name)
        if value is not None and value < 1:
            raise ConfigError(f"{_flag(name)} must be at least 1, got {value}")
    values.update(simulated_tier(values.pop("kv_offload_bytes", 0)))
    return EngineArgs(**values)



def roofline_params_from(args: argparse.Namespace) -> RooflineParams:
    return RooflineParams(
        compute_efficiency=args.compute_efficiency,
        bandwidth_efficiency=args.bandwidth_efficiency,
        step_overhead_s=args.step_overhead_ms / 1e3,
    )


def sim_workload_spec_from(args: argparse.Namespace) -> Any:
    """The benchmarks' WorkloadSpec of the length flags, with their checks."""
    for flag, (shortest, longest) in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len)):
        if not 1 <= shortest <= longest:
            raise ConfigError(f"{flag} needs 1 <= LO <= HI, got {shortest} {longest}")
    if args.shared_prefix_len < 0:
        raise ConfigError(f"--shared-prefix-len must be >= 0, got {args.shared_prefix_len}")
    if not (args.request_rate > 0):
        raise ConfigError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    return workload_spec_from_args(args)
