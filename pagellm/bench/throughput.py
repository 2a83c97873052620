"""Bench stage: `pagellm bench throughput`, offline throughput on one request list.

Prints its configuration and results as a table (or, with --json, as one JSON document)
and appends the record as a JSON line to --result-file. Achieved GFLOP/s (matmul FLOPs of the work actually asked
for, over wall time) is reported against the matmul ceiling measured at start. Beside
the figures: the CPU they were measured on (bench/machine.py) and how far the first
requests' greedy outputs agree with a reference (bench/agreement.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import resource
import time
from pathlib import Path
from typing import Any

import torch

from pagellm.bench.agreement import check_agreement, describe_agreement
from pagellm.bench.backends import BackendResult, run_hf, run_pagellm
from pagellm.bench.peers import PEERS, peer_model_path, peer_settings, run_peer
from pagellm.bench.ceiling import model_matmul_ceiling, workload_flops
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.errors import PagellmError
from pagellm.workload.command_output import emit_result
from pagellm.workload.synthetic import make_workload, workload_spec_from_args

logger = logging.getLogger(__name__)


def run_bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from pagellm.model.checkpoint import load_model_config, resolve_model_source

    if args.repeats < 1:
        raise PagellmError(f"--repeats must be at least 1, got {args.repeats}")
    source = resolve_model_source(args.model)
    config = load_model_config(source)
    spec = workload_spec_from_args(args)
    # Prompt ids must exist in this model's vocabulary.
    high = min(spec.vocab_high, config.vocab_size)
    spec = dataclasses.replace(spec, vocab_high=high, vocab_low=min(spec.vocab_low, high // 2))
    requests = make_workload(spec, max_model_len=args.max_model_len)
    # The ceiling of the dtype the backend computes in (llama.cpp: the weights it runs).
    computes_bf16 = args.dtype == "bfloat16"
    if args.backend == "llamacpp":
        computes_bf16 = getattr(args, "llamacpp_weights", "stored") == "bfloat16"
    elif args.backend == "vllm":
        # vLLM on CPU runs a float32 checkpoint (the HF folder of a GGUF) in bf16 unless told.
        computes_bf16 = str(peer_settings(args.peer_setting).get("dtype", "auto")) in ("auto", "bfloat16")
    torch_dtype = torch.bfloat16 if computes_bf16 else torch.float32
    ceiling = model_matmul_ceiling(torch_dtype)
    if getattr(args, "structured_output", "none") != "none":
        return _run_structured(args, source.name, requests, ceiling)
    if args.backend == "pagellm":
        engine_args: dict[str, Any] = {
            "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
            "quantization": getattr(args, "quantization", "auto"),
            "int8_activations": getattr(args, "int8_activations", False),
            "num_scheduler_steps": getattr(args, "num_scheduler_steps", 1),
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
        }  # fmt: skip
        if args.max_num_batched_tokens:
            engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
        # The engine's own bar (requests done / total) shows when stderr is a terminal.
        result = run_pagellm(requests, args.model, args.dtype, engine_args, repeats=args.repeats, show_progress=True)
    elif args.backend == "hf":
        result = run_hf(requests, source.path, args.dtype, args.hf_batch_sizes)
    elif args.backend in PEERS:
        spec = PEERS[args.backend]
        model_path = peer_model_path(spec, source.path, source.format)
        result = run_peer(spec, requests, model_path, repeats=args.repeats, settings=peer_settings(args.peer_setting))
    else:
        from pagellm.bench.llamacpp_backend import run_llamacpp_isolated

        if source.format != "gguf":
            raise PagellmError("the llama.cpp backend needs a GGUF model")
        model_path = source.path
        if args.llamacpp_weights != "stored":
            model_path = float_gguf_copy(source.path, args.llamacpp_weights)
        result = run_llamacpp_isolated(requests, model_path, args.llamacpp_parallel, repeats=args.repeats)
        result.settings["weights"] = (
            "GGUF as stored" if args.llamacpp_weights == "stored" else f"GGUF dequantized to {args.llamacpp_weights}"
        )
    if result.peak_rss_bytes is None and args.backend in ("pagellm", "hf"):
        # These ran in this process: its peak so far is theirs (and the imports').
        result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    # After the timed run: the reference model is loaded only now (and the backend's
    # is no longer referenced).
    agreement = check_agreement(source.path, requests, result.output_token_ids, args.check_requests, args.check_tokens)
    flops = workload_flops(config, [len(r.prompt_token_ids) for r in requests], [r.output_len for r in requests])
    record = make_record(args, source.name, result, flops, ceiling, len(requests), agreement)
    emit_result(record, print_result, args.json, args.result_file)
    return record


def _run_structured(args: argparse.Namespace, model: str, requests: list[Any], ceiling: float) -> dict[str, Any]:
    """The json-schema workload: constrained against unconstrained at the same lengths."""
    from pagellm.bench.structured_workload import run_structured_pagellm

    if args.backend != "pagellm":
        raise PagellmError("--structured-output runs on the pagellm backend only")
    engine_args: dict[str, Any] = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    figures = run_structured_pagellm(requests, args.model, args.dtype, engine_args, repeats=args.repeats)
    record = {
        "bench": "throughput-structured",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine_description(),
        "cpu": cpu_info(),
        "model": model,
        "dtype": args.dtype,
        "workload": {
            "kind": args.workload, "num_requests": len(requests), "prompt_len": list(args.prompt_len),
            "output_len": list(args.output_len), "seed": args.seed, "structured_output": args.structured_output,
        },
        "settings": engine_args,
        "matmul_ceiling_gflop_s": round(ceiling, 1),
        **figures,
    }  # fmt: skip
    emit_result(record, print_structured_result, args.json, args.result_file)
    return record


def print_structured_result(record: dict[str, Any]) -> None:
    """The structured workload's record as aligned lines on stdout."""
    print(f"{record['model']} on {record['machine']}; CPU {describe_cpu(record['cpu'])}")
    rows = [
        ("requests", f"{record['num_requests']} ({record['valid_outputs']} outputs validate, "
                     f"{record['ended_by_schema']} ended by their schema)"),
        ("output tokens", record["output_tokens"]),
        ("constrained", f"{record['constrained_s']:.2f} s, {record['constrained_output_tok_s']} tok/s"),
        ("unconstrained, same lengths", f"{record['unconstrained_s']:.2f} s, {record['unconstrained_output_tok_s']} tok/s"),
        ("constrained / unconstrained", f"{record['ratio']:.3f}x"),
        ("mask time", f"{record['mask_s']:.3f} s ({100 * record['mask_share']:.1f}% of the constrained run)"),
        ("schema compile", ", ".join(f"{ms} ms" for ms in record["schema_compile_ms"])
                           + f" (after waiting {record['grammar_tokenizer_wait_ms']} ms for the vocabulary's setup)"),
        ("first token, new / cached schema", f"{record['ttft_new_schema_ms']} / {record['ttft_cached_schema_ms']} ms"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def make_record(
    args: argparse.Namespace,
    model: str,
    result: BackendResult,
    flops: float,
    ceiling: float,
    num_requests: int,
    agreement: dict[str, Any] | None = None,
) -> dict[str, Any]:
    elapsed = result.elapsed_s
    achieved = flops / elapsed / 1e9
    return {
        "bench": "throughput",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine_description(),
        "cpu": cpu_info(),
        "model": model,
        "backend": result.backend,
        # llama.cpp runs the GGUF's own (quantized) weights unless asked for a float copy.
        # A peer: the type it computes in where it says (vLLM), else the GGUF as stored (OpenVINO).
        "dtype": _llamacpp_dtype(args) if result.backend == "llamacpp"
        else result.settings.get("dtype", "gguf") if result.backend in PEERS else args.dtype,
        "workload": {
            "kind": args.workload, "num_requests": num_requests,
            "prompt_len": list(args.prompt_len), "output_len": list(args.output_len), "seed": args.seed,
        },
        "settings": result.settings,
        "sweep": result.sweep,
        "elapsed_s": round(elapsed, 6),
        "output_tokens": result.output_tokens,
        "prompt_tokens": result.prompt_tokens,
        "requests_per_s": round(num_requests / elapsed, 3),
        "output_tok_s": round(result.output_tokens / elapsed, 2),
        "total_tok_s": round((result.output_tokens + result.prompt_tokens) / elapsed, 2),
        "achieved_gflop_s": round(achieved, 1),
        "matmul_ceiling_gflop_s": round(ceiling, 1),
        "fraction_of_ceiling": round(achieved / ceiling, 3) if ceiling else None,
        # Of the backend's process(es), where known: peers sum the peaks of their process tree.
        "peak_rss_bytes": result.peak_rss_bytes,
        "agreement": agreement,
    }  # fmt: skip


def _llamacpp_dtype(args: argparse.Namespace) -> str:
    return "gguf" if args.llamacpp_weights == "stored" else args.llamacpp_weights


def float_gguf_copy(source: Path, dtype: str) -> Path:
    """A dequantized copy of `source`, written once and kept in the cache folder."""
    from pagellm.bench.gguf_convert import write_float_gguf
    from pagellm.bench.hf_folder import cache_root

    stat = source.stat()
    cache = cache_root() / "gguf"
    target = cache / f"{source.stem}-{stat.st_size}-{int(stat.st_mtime)}-{dtype}.gguf"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        write_float_gguf(source, partial, dtype)
        os.replace(partial, target)
    return target


def machine_description() -> str:
    cores = os.cpu_count()
    return f"{platform.machine()} {platform.processor() or ''} {cores} cores, torch {torch.__version__}".replace("  ", " ")


def print_result(record: dict[str, Any]) -> None:
    print(f"{record['model']} on {record['machine']}; CPU {describe_cpu(record['cpu'])}")
    rows = [
        ("backend", f"{record['backend']} ({record['dtype']})"),
        ("requests", record["workload"]["num_requests"]),
        ("elapsed", f"{record['elapsed_s']:.2f} s"),
        ("requests/s", record["requests_per_s"]),
        ("output tok/s", record["output_tok_s"]),
        ("total tok/s", record["total_tok_s"]),
        ("achieved GFLOP/s", f"{record['achieved_gflop_s']} of {record['matmul_ceiling_gflop_s']} "
                             f"({100 * (record['fraction_of_ceiling'] or 0):.0f}%)"),
        ("peak RSS", f"{record['peak_rss_bytes'] / 2**20:.0f} MiB" if record.get("peak_rss_bytes") else "not measured"),
        ("agreement", describe_agreement(record["agreement"])),
    ]  # fmt: skip
    for sweep in record["sweep"]:
        rows.append((f"  batch {sweep['batch_size']}", f"{sweep['output_tok_s']} tok/s"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
