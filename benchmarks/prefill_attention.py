"""Prefill attention on CPU: pagellm's paged kernel against gathering the chunk's context
and calling torch's scaled_dot_product_attention, by chunk and context length.

The engine's CPU backend runs every query row through the paged kernel
(pagellm/attention/cpu_backend.py); this times the alternative on the machine at hand, with
SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16), one
request per call, the kernel build load_kernels() picks (PAGELLM_KERNEL_ISA pins one).

    python benchmarks/prefill_attention.py --out benchmarks/results/prefill_attention.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from pagellm.attention.cpu_backend import CpuAttentionBackend, _plan_step
from pagellm.attention.torch_backend import _sdpa, gather_context
from pagellm.bench.machine import cpu_info
from pagellm.kernels.build import describe_isa, load_kernels

SHAPES = [(128, 128), (512, 512), (1024, 512), (2048, 512), (2048, 2048), (4096, 512)]  # (context, chunk)


def best_seconds(run, repeats: int = 5) -> float:  # noqa: ANN001
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="append one JSON line per shape here")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("no native kernels on this machine")
    backend = CpuAttentionBackend(kernels)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    scale = head_dim**-0.5
    generator = torch.Generator().manual_seed(0)
    for context, chunk in SHAPES:
        blocks = context // block_size
        cache = torch.randn(2, blocks + 1, block_size, kv_heads, head_dim, generator=generator).to(dtype)
        table = torch.arange(1, blocks + 1, dtype=torch.int64).unsqueeze(0)
        query = torch.randn(chunk, heads, head_dim, generator=generator).to(dtype)
        metadata = SimpleNamespace(query_start_loc=[0, chunk], seq_lens=[context], num_reqs=1, block_tables=table)
        plan = _plan_step(metadata)
        out = torch.empty_like(query)

        def paged() -> None:
            backend._attend(query, cache, metadata, plan, scale, out)

        def gathered() -> torch.Tensor:
            k = gather_context(cache[0], table[0], context).transpose(0, 1)
            v = gather_context(cache[1], table[0], context).transpose(0, 1)
            q = query.transpose(0, 1)
            if chunk == context:
                return _sdpa(q, k, v, None, scale, causal=True)
            positions = torch.arange(context - chunk, context).unsqueeze(1)
            return _sdpa(q, k, v, torch.arange(context).unsqueeze(0) <= positions, scale)

        with torch.inference_mode():
            expected = gathered().transpose(0, 1).float()
            paged()
            error = float((out.float() - expected).abs().max())
            paged_s, sdpa_s = best_seconds(paged), best_seconds(gathered)
        record = {
            "benchmark": "prefill_attention", "time": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_info(),
            "isa": describe_isa(), "threads": torch.get_num_threads(), "dtype": args.dtype,
            "context": context, "chunk": chunk, "paged_ms": round(paged_s * 1e3, 3), "sdpa_ms": round(sdpa_s * 1e3, 3),
            "paged_over_sdpa": round(paged_s / sdpa_s, 3), "max_abs_difference": error,
        }  # fmt: skip
        print(f"context {context:5d} chunk {chunk:5d}: paged {paged_s * 1e3:8.2f} ms, gathered SDPA {sdpa_s * 1e3:8.2f} ms"
              f" (paged/SDPA {paged_s / sdpa_s:.2f}; max |difference| {error:.4f})")  # fmt: skip
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
