"""Sim stage: one simulation from parsed flags to a JSON record.

Shared by `pagellm simulate` (one configuration) and `pagellm tune` (a grid of them):
resolve the target and the workload once, then simulate engine configurations on them.
A configuration may be data-parallel: that many replicas of the engine share the
workload (data_parallel.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

from pagellm.config.engine_args import EngineArgs
from pagellm.errors import ConfigError
from pagellm.sim.calibrated import CalibratedCostModel
from pagellm.sim.gpu_presets import GiB, GpuSpec, get_gpu_preset
from pagellm.sim.interconnect_presets import default_interconnect, get_interconnect_preset
from pagellm.sim.data_parallel import ROUTING, run_replicas
from pagellm.sim.command_args import roofline_params_from, sim_workload_spec_from
from pagellm.sim.report import summarize_sim
from pagellm.sim.speculation import SimSpeculationConfig
from pagellm.sim.target import (
    SimEngineConfig,
    SimTarget,
    calibrated_target,
    resolve_engine_config,
    roofline_target,
)
from pagellm.sim.request_stream import (
    SimRequest,
    SyntheticWorkload,
    make_synthetic_requests,
    read_trace,
)
from pagellm.sim.simulator import SimResult, SimTier
from pagellm.sim.tensor_parallel_costs import TensorParallelLink


@dataclass(frozen=True)
class Workload:
    description: dict[str, Any]
    requests: list[SimRequest]


@dataclass(frozen=True)
class SimRun:
    engine_args: EngineArgs
    engine_config: SimEngineConfig
    result: SimResult
    summary: dict[str, Any]
    data_parallel_size: int = 1


def target_from_args(args: argparse.Namespace, tensor_parallel_size: int | None = None) -> SimTarget:
    """The flags' target; `tensor_parallel_size` overrides --tensor-parallel-size."""
    tp = args.tensor_parallel_size if tensor_parallel_size is None else tensor_parallel_size
    read_gbps = getattr(args, "kv_offload_read_gbps", 2.0)
    if not read_gbps > 0:
        raise ConfigError(f"--kv-offload-read-gbps must be positive, got {read_gbps}")
    if args.calibration:
        if tp != 1:
            raise ConfigError(
                "--tensor-parallel-size needs the roofline model: a calibration measures one "
                "device (--data-parallel-size works with it)"
            )
        target = calibrated_target(CalibratedCostModel.load(args.calibration))
    else:
        gpu = get_gpu_preset(args.gpu)
        target = roofline_target(args.model, gpu, roofline_params_from(args), tensor_parallel_from(args, gpu, tp))
    return dataclasses.replace(target, tier_read_bytes_per_s=read_gbps * 1e9)


def tensor_parallel_from(args: argparse.Namespace, gpu: GpuSpec, tensor_parallel_size: int) -> TensorParallelLink | None:
    if tensor_parallel_size == 1:
        return None
    interconnect = get_interconnect_preset(args.interconnect) if args.interconnect else default_interconnect(gpu)
    latency_us = args.allreduce_latency_us
    return TensorParallelLink(
        tensor_parallel_size, interconnect, args.allreduce_efficiency,
        None if latency_us is None else latency_us * 1e-6,
    )  # fmt: skip


def workload_from_args(args: argparse.Namespace, max_model_len: int) -> Workload:
    """The requests to simulate, their lengths clipped to fit max_model_len."""
    if args.trace:
        requests = read_trace(args.trace)
        return Workload({"kind": "trace", "path": args.trace, "num_requests": len(requests),
                         "description": f"trace {args.trace}, {len(requests)} requests"}, requests)  # fmt: skip
    spec = sim_workload_spec_from(args)
    synthetic = SyntheticWorkload(
        spec, args.request_rate, args.burstiness, args.duration, args.shared_prefix_share
    )
    requests = make_synthetic_requests(synthetic, max_model_len)
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    lengths = (
        "ShareGPT-like lengths" if spec.kind == "sharegpt"
        else f"prompt {spec.prompt_len[0]}" if spec.kind == "fixed"
        else f"prompt {spec.prompt_len[0]}-{spec.prompt_len[1]}"
    )  # fmt: skip
    if spec.kind == "fixed":
        lengths += f", output {spec.output_len[0]}"
    elif spec.kind != "sharegpt":
        lengths += f", output {spec.output_len[0]}-{spec.output_len[1]}"
    arrivals = "all at 0" if rate == "inf" else f"{rate} req/s (burstiness {args.burstiness})"
    prefix = ""
    if spec.kind == "shared-prefix" or args.shared_prefix_share:
        share = 1.0 if spec.kind == "shared-prefix" else args.shared_prefix_share
        prefix = f", {share:.0%} share a {spec.shared_prefix_len}-token prefix"
    description = {
        "kind": spec.kind, "num_requests": len(requests), "prompt_len": list(spec.prompt_len),
        "output_len": list(spec.output_len), "shared_prefix_len": spec.shared_prefix_len,
        "shared_prefix_share": 1.0 if spec.kind == "shared-prefix" else args.shared_prefix_share,
        "request_rate": rate, "burstiness": args.burstiness, "duration_s": args.duration,
        "seed": spec.seed,
        "description": f"{spec.kind}: {len(requests)} requests, {lengths}, arrivals {arrivals}{prefix}",
    }  # fmt: skip
    return Workload(description, requests)


def simulate(
    target: SimTarget,
    engine_args: EngineArgs,
    requests: list[SimRequest],
    data_parallel_size: int = 1,
    speculation: SimSpeculationConfig | None = None,
) -> SimRun:
    """Resolve the engine configuration on the target and run the workload through it
    (through `data_parallel_size` replicas of it), speculating as `speculation` says."""
    if data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size must be at least 1, got {data_parallel_size}")
    engine_config = resolve_engine_config(target, engine_args)
    cache = engine_config.cache_config
    tier = None
    if cache.kv_offload_bytes:
        entry_bytes = engine_config.kv.kv_cache_bytes // cache.num_usable_gpu_blocks
        tier = SimTier(
            read_bytes_per_s=target.tier_read_bytes_per_s, entry_bytes=entry_bytes,
            state_entry_bytes=target.model_config.state_bytes_per_request(),
        )  # fmt: skip
    result = run_replicas(
        engine_config.scheduler_config, cache, target.cost_model, requests, data_parallel_size, speculation, tier
    )
    return SimRun(engine_args, engine_config, result, summarize_sim(result), data_parallel_size)


def engine_description(run: SimRun, target: SimTarget) -> dict[str, Any]:
    scheduler = run.engine_config.scheduler_config
    description = {
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_model_len": scheduler.max_model_len,
        "block_size": run.engine_config.cache_config.block_size,
    }
    if target.gpu is not None:
        description["gpu_memory_utilization"] = run.engine_args.gpu_memory_utilization
    for knob in ("max_num_partial_prefills", "long_prefill_token_threshold"):
        if getattr(scheduler, knob) is not None:
            description[knob] = getattr(scheduler, knob)
    if scheduler.prefill_share != 1.0:
        description["prefill_share"] = scheduler.prefill_share
    if scheduler.scheduling_policy != "fcfs":
        description["scheduling_policy"] = scheduler.scheduling_policy
    if target.tensor_parallel_size > 1:
        description["tensor_parallel_size"] = target.tensor_parallel_size
    if run.data_parallel_size > 1:
        description["data_parallel_size"] = run.data_parallel_size
    if run.engine_config.cache_config.kv_offload_bytes:
        description["kv_offload_bytes"] = run.engine_config.cache_config.kv_offload_bytes
        description["kv_offload_read_gbps"] = target.tier_read_bytes_per_s / 1e9
    description.update({
        "preemption_mode": scheduler.preemption_mode,
        "enable_prefix_caching": run.engine_config.cache_config.enable_prefix_caching,
        "enable_chunked_prefill": scheduler.enable_chunked_prefill,
    })  # fmt: skip
    return description


def make_record(target: SimTarget, workload: Workload, run: SimRun) -> dict[str, Any]:
    """The JSON line of one simulation: configuration, then results."""
    kv = run.engine_config.kv
    return {
        "bench": "simulate",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cost_model": {"name": target.cost_model.name, **target.cost_model.describe()},
        "target": {"model": target.model_name, "device": target.device_name},
        "engine": engine_description(run, target),
        "parallel": parallel_description(target, run.data_parallel_size),
        "kv_cache": {
            # One replica's (with tensor parallelism, one GPU's bytes; every GPU of the
            # group holds the same blocks). results.kv_capacity_tokens is all replicas'.
            "num_gpu_blocks": kv.num_gpu_blocks, "num_cpu_blocks": kv.num_cpu_blocks,
            "kv_cache_gib": round(kv.kv_cache_bytes / GiB, 3), "how": kv.how,
        },  # fmt: skip
        "workload": workload.description,
        "results": run.summary,
    }


def parallel_description(target: SimTarget, data_parallel_size: int) -> dict[str, Any]:
    tp = target.tensor_parallel_size
    description: dict[str, Any] = {
        "tensor_parallel_size": tp,
        "data_parallel_size": data_parallel_size,
        "num_gpus": tp * data_parallel_size,
    }
    if target.tensor_parallel is not None:
        description.update(target.tensor_parallel.describe())
    if data_parallel_size > 1:
        description["routing"] = ROUTING
    return description
