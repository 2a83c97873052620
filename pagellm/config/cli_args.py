"""Config stage: every EngineArgs field as a command-line flag with the same name.

Below every command that builds an engine from flags (entrypoints' generate and serve,
sim's calibrate), so none of them reaches into another's package for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from pagellm.config.cache import KV_CACHE_DTYPES
from pagellm.config.engine_args import (
    ATTENTION_BACKENDS,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    LOAD_FORMATS,
    PROFILE_CHOICES,
    PROFILES,
    QUANTIZATION_CHOICES,
    EngineArgs,
)
from pagellm.config.parallel import DISTRIBUTED_EXECUTOR_BACKENDS
from pagellm.config.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES

_CHOICES = {
    "dtype": DTYPE_CHOICES,
    "device": DEVICE_CHOICES,
    "preemption_mode": PREEMPTION_MODES,
    "scheduling_policy": SCHEDULING_POLICIES,
    "profile": PROFILE_CHOICES,
    "load_format": LOAD_FORMATS,
    "quantization": QUANTIZATION_CHOICES,
    "attention_backend": ATTENTION_BACKENDS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "distributed_executor_backend": DISTRIBUTED_EXECUTOR_BACKENDS,
}
_HELP = {
    "model": "GGUF file or HF checkpoint folder (default: embedded SmolLM2-135M-Instruct)",
    "dtype": "weights and activations; auto = bfloat16 on GPU and on CPUs that run the native kernels (x86-64 with AVX2 and a C compiler), else float32",
    "load_format": "auto = weights from the checkpoint; dummy = random weights of its shapes, made on the "
    "device (benchmarks)",
    "int8_activations": "Q4_0 / Q4_1 (and, with AVX-512 VNNI, K-quant and IQ4_XS) GGUF weights on the CPU kernels: "
    "decode with activations rounded to int8 per 32 values, as llama.cpp does (faster where measured so, at int8 "
    "precision); default: bf16 activations",
    "attention_backend": "auto = triton on GPU, the compiled kernel on CPU; torch = the reference path",
    "enforce_eager": "no CUDA graphs: run decode steps eagerly",
    "max_capture_batch_size": "largest decode batch captured as a CUDA graph (default: max_num_seqs, at most 512)",
    "max_model_len": "longest prompt + output (default: the model's context length)",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one step (default 2048)",
    "block_size": "tokens per KV cache block",
    "kv_cache_dtype": "KV cache element type: auto = the model's dtype; fp8_e4m3 / fp8_e5m2 = 8-bit floats "
    "(half the bytes of bf16, so twice the blocks; scale 1.0, values saturated to the format's range)",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "kv_cache_memory_bytes": "KV cache size in bytes (overrides the default budget)",
    "num_gpu_blocks_override": "exact number of KV blocks (mostly for tests)",
    "swap_space": "GiB of host memory for swapped-out requests (preemption_mode=swap)",
    "kv_offload_path": "directory on local disk for the prefix cache's second tier: full prefix blocks are "
    "written there and loaded back on a later hit, also after a restart (needs prefix caching)",
    "kv_offload_bytes": "size bound of the --kv-offload-path tier in bytes (least recently used entries go first)",
    "kv_offload_host_bytes": "host memory that keeps the tier's latest blocks in front of the disk (default: 4 GiB "
    "when the KV cache is on a GPU, none on CPU)",
    "state_snapshot_interval": "a hybrid model (linear attention) under prefix caching: keep its recurrent state "
    "after every this many full blocks, so that a prefix hit resumes from the last one (more often: less "
    "recomputed on a hit, more snapshot memory)",
    "scheduling_policy": "order of service: fcfs, priority, or shortest-remaining (running requests "
    "closest to finishing first)",
    "max_num_partial_prefills": "most requests given prefill tokens in one step (unset = no limit)",
    "long_prefill_token_threshold": "cap on one request's prefill chunk per step (unset = no cap)",
    "prefill_share": "fraction of the step budget prefills may take while requests decode; the rest "
    "is reserved for decodes (unset = 1.0)",
    "background_token_budget": "tokens background requests (Batch API lines) may take per step, so that an "
    "interactive request never waits long for a step of batch work (0: the whole step budget)",
    "speculative_config": "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
    "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4, \"disable_by_batch_size\": 8}, or a draft model: "
    "{\"model\": PATH, \"num_speculative_tokens\": 4} (same vocabulary); exact for greedy and sampled requests",
    "num_scheduler_steps": "decode steps the runner takes per engine step while every running request "
    "decodes and none waits: the engine's per-step work (scheduling, output processing, stats) once per N "
    "tokens; tokens then reach streams N at a time, and a new request waits at most N steps (default 1)",
    "tensor_parallel_size": "split the model over this many ranks (GPUs, or CPU processes): attention and KV "
    "heads, the MLP and the vocabulary; one all-reduce after each attention and MLP block",
    "distributed_executor_backend": "where tensor-parallel ranks run: mp = processes on this machine "
    "(default); ray = actors of a Ray cluster (pip install 'pagellm[ray]'), across machines",
    "enable_lora": "serve LoRA adapters over the base model (PEFT folders): requests name one by LoRARequest "
    "offline",
    "max_loras": "adapters resident at once (slots beside the model), hence the most distinct adapters in one step",
    "max_lora_rank": "largest adapter rank accepted (the slots are sized for it)",
    "max_cpu_loras": "adapters kept read in host memory, least recently used out (default: max_loras)",
    "profile": "preset of the knobs above: "
    + "; ".join(f"{name}: " + ", ".join(f"{k}={v}" for k, v in knobs.items()) for name, knobs in PROFILES.items()),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineArgs)
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineArgs):
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        # `int | None` -> int
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            kind = args[0]
        help_text = _HELP.get(field.name, "")
        if kind is bool:
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=help_text or None,
            )
        else:
            group.add_argument(
                flag,
                type=kind,
                default=field.default,
                choices=_CHOICES.get(field.name),
                help=(help_text + f" (default: {field.default})").strip(),
            )


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def engine_args_to_cli(args: EngineArgs) -> list[str]:
    """The flags that make `add_engine_args`' parser give back `args` (for the engine
    processes a data-parallel server starts with the settings it was given)."""
    flags: list[str] = []
    for field in dataclasses.fields(EngineArgs):
        value = getattr(args, field.name)
        if value == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + field.name.replace("_", "-"))
        elif value is not None:
            flags += [flag, str(value)]
    return flags
