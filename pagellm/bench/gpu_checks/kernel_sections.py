"""Bench stage: the GPU check's sections on the kernels: the gpu-marked tests, the Triton
kernels against a float32 reference, and the decode kernel's bandwidth against a device copy."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from pagellm.bench.gpu_checks.common import (
    CheckConfig,
    Context,
    GiB,
    SectionOutput,
    device_of,
    format_gb_per_s,
    free_memory,
    measure_copy_bandwidth,
    median_seconds,
)

# --------------------------------------------------------------------------- 1. gpu tests


def gpu_test_files(tests: Path) -> list[str]:
    """The test files (relative to the checkout) that hold a gpu-marked test."""
    marked = [p for p in sorted(tests.rglob("test_*.py")) if "pytest.mark.gpu" in p.read_text(encoding="utf-8")]
    return [str(p.relative_to(tests.parent)) for p in marked]


def section_gpu_tests(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    # The tests are the source tree's, not the installed package's: run_checks puts the
    # checkout the script belongs to in the context.
    repo_root: Path = ctx["repo_root"]
    # The files holding gpu-marked tests run whole: their other tests put their tensors on
    # the GPU where there is one (the kernels compiled, not interpreted), and only they do;
    # the rest of the suite is the CPU's (and may import what a GPU image lacks).
    files = gpu_test_files(repo_root / "tests")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if cfg.smoke:  # the rest of those files under Triton's interpreter would take minutes
        command += ["-m", "gpu"]
    if cfg.pytest_workers > 1 and importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(cfg.pytest_workers)]
    out.figures["command"] = " ".join(command[1:])
    try:
        proc = subprocess.run(
            command, cwd=repo_root, capture_output=True, text=True, check=False, timeout=cfg.pytest_timeout_s
        )
    except subprocess.TimeoutExpired:
        out.row("pytest (gpu test files)", f"timed out after {cfg.pytest_timeout_s:.0f} s", "all pass", False)
        return
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    out.figures["output_tail"] = tail[-60:]
    if os.environ.get("OUT"):  # the whole log comes back with the results
        (Path(os.environ["OUT"]) / "gpu_tests.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    counts = {kind: 0 for kind in ("passed", "failed", "errors", "skipped", "deselected")}
    summary = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed|skipped|deselected|error)", line)), "")
    for number, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary):
        counts["errors" if kind.startswith("error") else kind] = int(number)
    out.figures.update(counts, returncode=proc.returncode)
    bad = counts["failed"] + counts["errors"]
    result = f"{counts['passed']} passed, {bad} failed, {counts['skipped']} skipped"
    # rc 5: nothing collected; with no GPU every gpu test is skipped, which is not a pass.
    out.row("pytest (gpu test files)", result, "all pass, >0 ran", bad == 0 and counts["passed"] > 0 and proc.returncode == 0)


# --------------------------------------------------------------------------- 2. kernel checks


def kernel_steps(cfg: CheckConfig) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query_lens, context_lens) of the steps the kernels are checked on."""
    mixed_q = [1] * len(cfg.mixed_decode_contexts) + [q for q, _ in cfg.mixed_prefills]
    mixed_ctx = list(cfg.mixed_decode_contexts) + [q + cached for q, cached in cfg.mixed_prefills]
    requests, context = cfg.long_decode
    # Lengths a little apart so the split boundaries differ between requests.
    long_ctx = [context - 97 * i for i in range(requests)]
    return {"mixed": (mixed_q, mixed_ctx), f"decode {requests}x{context}": ([1] * requests, long_ctx)}


def check_kernel_step(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    context_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> dict[str, Any]:
    """Run one random step through the Triton backend and the reference; the figures."""
    from pagellm.bench.paged_steps import random_step

    from pagellm.attention.backend import AttentionMetadata
    from pagellm.attention.torch_backend import TorchAttentionBackend
    from pagellm.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(seed)
    q, k, v, cache, metadata = random_step(
        gen, num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, dtype
    )
    slots, tables = metadata.slot_mapping.to(device), metadata.block_tables.to(device)

    def fresh_metadata() -> AttentionMetadata:
        return AttentionMetadata(slots, tables, metadata.query_start_loc, metadata.seq_lens)

    q, k, v, cache = (x.to(device) for x in (q, k, v, cache))
    scale = head_dim**-0.5
    backend = TritonAttentionBackend()
    kernel_metadata = fresh_metadata()
    plan = backend.plan(kernel_metadata, num_heads, num_kv_heads, head_dim, device)
    kernel_metadata.backend_plan = plan
    kernel_cache = cache.clone()
    actual = backend.forward(q, k, v, kernel_cache, kernel_metadata, scale)
    # The reference sees the same (rounded) inputs, computed in a wider type.
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    reference_cache = cache.to(wide)
    expected = TorchAttentionBackend().forward(
        q.to(wide), k.to(wide), v.to(wide), reference_cache, fresh_metadata(), scale
    )
    error = float((actual.to(wide) - expected).norm() / expected.norm())
    return {
        "rel_error": error,
        "has_nan": bool(torch.isnan(actual).any()),
        "cache_equal": bool(torch.equal(kernel_cache.to(wide), reference_cache)),
        "num_splits": max(launch.num_splits for launch in plan.launches),
        "num_tokens": int(q.shape[0]),
        "reference_dtype": str(wide).removeprefix("torch."),
    }


def section_kernels(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    device = device_of(cfg)
    tolerances = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
    for shape_name, (heads, kv_heads, head_dim) in cfg.kernel_shapes.items():
        for step_index, (step_name, (query_lens, context_lens)) in enumerate(kernel_steps(cfg).items()):
            for dtype, tolerance in tolerances.items():
                dtype_name = str(dtype).removeprefix("torch.")
                label = f"{shape_name} {step_name} {dtype_name}"
                figures = check_kernel_step(
                    heads, kv_heads, head_dim, cfg.block_size, query_lens, context_lens, dtype,
                    device, seed=1000 * step_index + heads,
                )  # fmt: skip
                out.figures[label] = figures
                met = figures["rel_error"] < tolerance and not figures["has_nan"] and figures["cache_equal"]
                notes = "" if figures["cache_equal"] else ", cache differs"
                notes += ", NaN" if figures["has_nan"] else ""
                out.row(f"attn {label}", f"rel err {figures['rel_error']:.2e}{notes}", f"< {tolerance:g}", met)
                if step_name.startswith("decode") and dtype == torch.bfloat16:
                    splits = figures["num_splits"]
                    out.row(f"attn {shape_name} {step_name} split-K", f"num_splits={splits}", "> 1", splits > 1)
                free_memory(device)


# --------------------------------------------------------------------------- 5. bandwidth


def decode_batch(
    num_requests: int,
    context: int,
    heads: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """A decode-only step built on the device: every request one new token at the end of
    `context` tokens whose blocks are scattered over the cache."""
    from pagellm.attention.backend import AttentionMetadata

    num_heads, num_kv_heads, head_dim = heads
    blocks_per_request = -(-context // block_size)
    num_blocks = num_requests * blocks_per_request + 1  # block 0 is the null block
    cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device).normal_()
    tables = (torch.randperm(num_blocks - 1, device=device) + 1).view(num_requests, blocks_per_request)
    last = context - 1
    slots = tables[:, last // block_size] * block_size + last % block_size
    metadata = AttentionMetadata(
        slot_mapping=slots.to(torch.int64),
        block_tables=tables.to(torch.int64),
        query_start_loc=list(range(num_requests + 1)),
        seq_lens=[context] * num_requests,
    )
    q = torch.randn(num_requests, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_requests, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(num_requests, num_kv_heads, head_dim, device=device).to(dtype)
    return q, k, v, cache, metadata


def time_decode_attention(
    num_requests: int, context: int, heads: tuple[int, int, int], block_size: int, device: torch.device
) -> tuple[float, int]:
    """Seconds of one bf16 decode-attention forward (store + kernels, planned once as the
    engine does per step) over a random batch; and the plan's split count."""
    from pagellm.attention.triton_backend import TritonAttentionBackend

    num_heads, num_kv_heads, head_dim = heads
    q, k, v, cache, metadata = decode_batch(num_requests, context, heads, block_size, torch.bfloat16, device)
    backend = TritonAttentionBackend()
    metadata.backend_plan = backend.plan(metadata, num_heads, num_kv_heads, head_dim, device)
    scale = head_dim**-0.5
    seconds = median_seconds(lambda: backend.forward(q, k, v, cache, metadata, scale), device)
    return seconds, max(launch.num_splits for launch in metadata.backend_plan.launches)


def section_bandwidth(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    device = device_of(cfg)
    copy_bw = measure_copy_bandwidth(cfg.copy_bytes, device)
    ctx["copy_bw"] = copy_bw
    out.figures["copy_bytes"] = cfg.copy_bytes
    out.figures["copy_bytes_per_s"] = copy_bw
    out.row(f"copy bandwidth ({cfg.copy_bytes / GiB:g} GiB bf16)", format_gb_per_s(copy_bw), "", None)
    free_memory(device)

    num_requests, context = cfg.decode_bench
    num_heads, num_kv_heads, head_dim = cfg.decode_bench_heads
    seconds, num_splits = time_decode_attention(num_requests, context, cfg.decode_bench_heads, cfg.block_size, device)
    free_memory(device)
    kv_bytes = num_requests * context * 2 * num_kv_heads * head_dim * 2
    achieved = kv_bytes / seconds
    fraction = achieved / copy_bw
    out.figures.update(
        decode_requests=num_requests,
        decode_context=context,
        decode_heads=cfg.decode_bench_heads,
        decode_num_splits=num_splits,
        decode_seconds=seconds,
        decode_kv_bytes=kv_bytes,
        decode_bytes_per_s=achieved,
        fraction_of_copy=fraction,
    )
    out.row(
        f"decode attention {num_requests}x{context} ({num_heads}/{num_kv_heads}x{head_dim}) bf16",
        f"{seconds * 1e3:.3f} ms, {format_gb_per_s(achieved)}",
        "",
        None,
    )
    out.row("  decode attention / copy bandwidth", f"{fraction:.0%}", ">= 70%", fraction >= 0.70)
