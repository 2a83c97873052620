"""Decode attention over a bf16 KV cache against fp8 ones (--kv-cache-dtype), through the
CPU backend's kernel (csrc/paged_decode.c; bf16 queries take paged_decode_bf16.c).

    python benchmarks/kv_fp8_attention.py [--threads 2] [--requests 64] [--context 1000] [--repeats 15] [--output FILE]

One decode step of `requests` rows with `context` tokens each, SmolLM2-135M's shapes (9
query heads, 3 KV heads, head_dim 64, blocks of 16 tokens, 30 layers), blocks scattered
over the cache as an engine hands them out. Each timed call is one layer's attention; the
calls rotate over several layers' caches (more bytes than the last-level cache), so each
call reads its K/V from memory as a real step does. Cache types are interleaved within
every repeat (in a rotating order) so a busy machine slows them alike; the median and the
spread (min, max) of each are reported, with the per-token figure: a layer's time x 30
layers / requests. Prints the configuration, the CPU and one JSON line; writes it to
--output (benchmarks/results/kv_fp8_attention.json by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.cpu_backend import CpuAttentionBackend
from pagellm.attention.kv_cache_dtype import to_cache_dtype
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.kernels.build import load_kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ROTATION_BYTES = 192 << 20  # layers' caches rotated per type: well past the L3 (32 MiB here)
RESULT = Path(__file__).resolve().parent / "results" / "kv_fp8_attention.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", type=Path, default=RESULT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels could not be built (no C compiler?)")
    backend = CpuAttentionBackend(kernels)

    gen = torch.Generator().manual_seed(0)
    blocks_per_request = -(-args.context // BLOCK_SIZE)
    num_blocks = args.requests * blocks_per_request + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(args.requests, blocks_per_request)
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        block_tables=order.contiguous(),
        query_start_loc=list(range(args.requests + 1)),
        seq_lens=[args.context] * args.requests,
    )
    query = torch.randn(args.requests, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    layer_bytes = 2 * num_blocks * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2  # bf16
    num_copies = max(2, -(-ROTATION_BYTES // layer_bytes))
    base = [torch.randn(shape, generator=gen) for _ in range(num_copies)]
    caches = {name: [to_cache_dtype(b, dtype) for b in base] for name, dtype in CACHE_DTYPES.items()}
    del base
    scale = HEAD_DIM**-0.5
    # The plan (rows, lengths) is built once per step in the engine: build it here once.
    backend.attend_cached(query, caches["bf16"][0], metadata, scale)

    outputs = {}
    for name in CACHE_DTYPES:  # warm-up: every copy once
        for cache in caches[name]:
            outputs[name] = backend.attend_cached(query, cache, metadata, scale)
    times: dict[str, list[float]] = {name: [] for name in CACHE_DTYPES}
    names = list(CACHE_DTYPES)
    for repeat in range(args.repeats):
        rotated = names[repeat % len(names):] + names[: repeat % len(names)]
        for name in rotated:
            for cache in caches[name]:
                start = time.perf_counter()
                backend.attend_cached(query, cache, metadata, scale)
                times[name].append(time.perf_counter() - start)

    reference = outputs["bf16"].float()
    results = {}
    for name in names:
        median = statistics.median(times[name])
        results[name] = {
            "layer_ms_median": round(median * 1e3, 3),
            "layer_ms_min": round(min(times[name]) * 1e3, 3),
            "layer_ms_max": round(max(times[name]) * 1e3, 3),
            "per_token_us": round(median * NUM_LAYERS / args.requests * 1e6, 1),
            "vs_bf16": None,
            "cache_mib_per_layer": round(caches[name][0].nbytes / (1 << 20), 1),
            "output_rel_error_vs_bf16_cache": round(
                float((outputs[name].float() - reference).norm() / reference.norm()), 4
            ),
        }
    for name in names:
        results[name]["vs_bf16"] = round(results[name]["layer_ms_median"] / results["bf16"]["layer_ms_median"], 3)

    cpu = cpu_info()
    config = {
        "requests": args.requests, "context": args.context, "num_heads": NUM_HEADS,
        "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "threads": args.threads,
        "repeats": args.repeats, "layer_copies": num_copies, "query_dtype": "bfloat16",
    }  # fmt: skip
    print("config:", ", ".join(f"{k}={v}" for k, v in config.items()))
    print("cpu:", describe_cpu(cpu))
    print(f"{'cache':10} {'layer ms (median)':>18} {'min':>7} {'max':>7} {'us/token (30 layers)':>21} {'vs bf16':>8}")
    for name, r in results.items():
        print(
            f"{name:10} {r['layer_ms_median']:18.3f} {r['layer_ms_min']:7.3f} {r['layer_ms_max']:7.3f} "
            f"{r['per_token_us']:21.1f} {r['vs_bf16']:8.3f}"
        )
    record = {
        "benchmark": "kv_fp8_attention", "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu": cpu, "config": config, "results": results,
    }  # fmt: skip
    line = json.dumps(record)
    print(line)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(line + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
