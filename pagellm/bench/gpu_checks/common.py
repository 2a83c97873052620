"""Bench stage: the GPU check's configuration (GPU and smoke sizes), section results, and
timing helpers."""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.bench.synthetic_model import SHAPES

SECTION_NAMES = ("gpu_tests", "kernels", "equality", "throughput", "bandwidth", "roofline", "tp")
SECTION_TITLES = {
    "gpu_tests": "gpu tests",
    "kernels": "kernel checks",
    "equality": "greedy equality vs HF",
    "throughput": "throughput vs HF generate",
    "bandwidth": "decode kernel bandwidth",
    "roofline": "decode step vs roofline",
    "tp": "tensor parallel",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class CheckConfig:
    """Every size the sections use; `gpu_config` and `smoke_config` fill it."""

    smoke: bool
    device: str
    deadline_s: float  # the whole run
    budgets_s: dict[str, float]  # a section is skipped when less than this remains
    # 1. gpu tests
    pytest_timeout_s: float
    pytest_workers: int  # pytest-xdist workers where it is installed
    # 2. kernel checks: name -> (num_heads, num_kv_heads, head_dim)
    kernel_shapes: dict[str, tuple[int, int, int]]
    block_size: int
    mixed_decode_contexts: tuple[int, ...]
    mixed_prefills: tuple[tuple[int, int], ...]  # (new tokens, cached tokens before them)
    long_decode: tuple[int, int]  # (requests, context tokens each)
    # 3. equality
    equality_shape: dict[str, Any]
    equality_prompt_lens: tuple[int, ...]
    equality_shared_prefix: int
    equality_suffix_lens: tuple[int, ...]
    equality_max_tokens: int
    equality_max_model_len: int
    equality_num_blocks: int  # small enough to force preemption
    # 4. throughput
    throughput_shape: str  # a SHAPES preset
    throughput_dtype: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    hf_batch_sizes: tuple[int, ...]  # swept largest first, on one batch each
    hf_sweep_budget_s: float  # the sweep that picks HF's batch size
    hf_budget_s: float  # HF over the whole request list at that size
    max_model_len: int
    kv_cache_bytes: int
    max_num_batched_tokens: int
    # 5. bandwidth
    copy_bytes: int  # source tensor size
    decode_bench_heads: tuple[int, int, int]
    decode_bench: tuple[int, int]  # (requests, context tokens each)
    # 6. roofline
    roofline_batch: int
    roofline_context: int
    roofline_steps: int
    matmul_size: int
    # 7. tensor parallel (its models: equality_shape in float32 for the tokens,
    # throughput_shape in throughput_dtype for the decode steps)
    tp_prompt_lens: tuple[int, ...]
    tp_max_tokens: int
    tp_decode_batches: tuple[int, ...]
    tp_decode_context: int  # prompt tokens of each request in a timed decode step
    tp_decode_steps: int
    tp_kv_cache_bytes: int


GiB = 1 << 30


def gpu_config(deadline_s: float = 540.0) -> CheckConfig:
    return CheckConfig(
        smoke=False,
        device="cuda",
        deadline_s=deadline_s,
        budgets_s={
            "gpu_tests": 150, "kernels": 40, "equality": 50, "throughput": 200, "bandwidth": 15, "roofline": 40,
            # Last: after a full run the deadline seldom leaves it this much, so on a
            # machine with 2+ GPUs run it on its own (--sections tp). With fewer GPUs it
            # is skipped at once, whatever the time.
            "tp": 120,
        },
        pytest_timeout_s=240,
        pytest_workers=4,
        kernel_shapes={"llama-3-8b": (32, 8, 128), "smollm2": (9, 3, 64)},
        block_size=16,
        mixed_decode_contexts=(1, 17, 300, 1000, 2500, 4097),
        mixed_prefills=((100, 0), (257, 512), (600, 1200), (333, 37)),
        long_decode=(2, 16384),
        equality_shape=dict(
            vocab_size=2048,
            hidden_size=1024,
            intermediate_size=2048,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,  # head_dim 128, 4 query heads per KV head
            max_position_embeddings=1024,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
        equality_prompt_lens=(1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 65, 100, 127, 150, 199, 256, 300),
        equality_shared_prefix=80,
        equality_suffix_lens=(1, 5, 16, 20, 33, 48, 70),
        equality_max_tokens=32,
        equality_max_model_len=512,
        equality_num_blocks=40,  # 39 usable blocks of 16 for 24 requests of up to 332 tokens
        throughput_shape="llama-3-8b",
        throughput_dtype="bfloat16",
        num_requests=300,
        prompt_len=(64, 1024),
        output_len=(64, 512),
        hf_batch_sizes=(256, 128, 64, 16),
        hf_sweep_budget_s=45,
        hf_budget_s=100,
        max_model_len=2048,
        kv_cache_bytes=48 * GiB,
        max_num_batched_tokens=8192,
        copy_bytes=2 * GiB,
        decode_bench_heads=(32, 8, 128),
        decode_bench=(64, 4096),
        roofline_batch=256,
        roofline_context=512,
        roofline_steps=32,
        matmul_size=8192,
        tp_prompt_lens=(1, 7, 33, 100, 257),
        tp_max_tokens=32,
        tp_decode_batches=(1, 32),
        tp_decode_context=128,
        tp_decode_steps=32,
        tp_kv_cache_bytes=4 * GiB,
    )


def smoke_config(deadline_s: float = 600.0) -> CheckConfig:
    """Tiny shapes on CPU: every section's plumbing in a few minutes on 2 cores."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return CheckConfig(
        smoke=True,
        device="cpu" if interpreted or not torch.cuda.is_available() else "cuda",
        deadline_s=deadline_s,
        budgets_s={
            "gpu_tests": 60, "kernels": 20, "equality": 30, "throughput": 60, "bandwidth": 15, "roofline": 20, "tp": 30,
        },
        pytest_timeout_s=90,
        pytest_workers=1,
        kernel_shapes={"tiny": (4, 2, 16)},
        block_size=16,
        mixed_decode_contexts=(1, 17, 40),
        mixed_prefills=((20, 0), (33, 30)),
        long_decode=(2, 600),
        equality_shape=SHAPES["tiny"],
        equality_prompt_lens=(1, 3, 16, 17, 40),
        equality_shared_prefix=20,
        equality_suffix_lens=(1, 5, 9),
        equality_max_tokens=16,
        equality_max_model_len=96,
        equality_num_blocks=8,  # 7 usable blocks of 16 for 8 requests of up to 56 tokens
        throughput_shape="tiny",
        throughput_dtype="float32",
        num_requests=12,
        prompt_len=(8, 40),
        output_len=(4, 16),
        hf_batch_sizes=(8, 4),
        hf_sweep_budget_s=10,
        hf_budget_s=20,
        max_model_len=128,
        kv_cache_bytes=64 << 20,
        max_num_batched_tokens=256,
        copy_bytes=64 << 20,
        decode_bench_heads=(4, 2, 16),
        decode_bench=(4, 256),
        roofline_batch=4,
        roofline_context=32,
        roofline_steps=6,
        matmul_size=512,
        tp_prompt_lens=(1, 7, 33),
        tp_max_tokens=8,
        tp_decode_batches=(1, 4),
        tp_decode_context=16,
        tp_decode_steps=4,
        tp_kv_cache_bytes=16 << 20,
    )


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    check: str
    result: str
    target: str = ""
    met: bool | None = None  # None: informational


@dataclass
class SectionOutput:
    """What a section reports; filled as it goes, so a failure keeps what came before."""

    name: str
    status: str = "ok"  # ok | FAILED | SKIPPED
    applies: bool = True  # False: skipped because this machine cannot run it (not a failure)
    wall_s: float = 0.0
    rows: list[Row] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def row(self, check: str, result: str, target: str = "", met: bool | None = None) -> None:
        self.rows.append(Row(check, result, target, met))


Context = dict[str, Any]  # state handed from one section to the next (engine, ceilings)


def device_of(cfg: CheckConfig) -> torch.device:
    return torch.device(cfg.device)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def median_seconds(fn: Callable[[], object], device: torch.device, calls: int = 10, rounds: int = 5) -> float:
    """Median over `rounds` of the mean time of `calls` back-to-back calls of fn.

    On CUDA the calls are queued between two events: the GPU never waits for Python to
    launch the next one, so launch overhead does not count against a kernel that runs
    longer than its launch.
    """
    fn()  # warm-up (and compilation)
    sync_device(device)
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - begin) / calls)
    return statistics.median(times)


def format_gb_per_s(bytes_per_s: float) -> str:
    gb = bytes_per_s / 1e9
    return f"{gb:,.0f} GB/s" if gb >= 100 else f"{gb:.3g} GB/s"


def measure_copy_bandwidth(num_bytes: int, device: torch.device) -> float:
    """Bytes/s of dst.copy_(src) for a bf16 tensor of num_bytes (read + write counted)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, calls=5, rounds=7)
    return 2.0 * num_bytes / seconds
