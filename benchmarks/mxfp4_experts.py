"""gpt-oss's expert layers in MXFP4 against the same shapes in Q4_0, both kept as stored.

    python benchmarks/mxfp4_experts.py [--threads 2] [--rows 1 2 4 8 16 32]

MXFP4 and Q4_0 both stream 4.25 bits per weight (32 four-bit codes and a scale: one byte
for MXFP4, two for Q4_0), so at decode sizes the two should run at the same memory speed.
For gpt-oss-20b's expert shapes (gate_up 5760 x 2880, down 2880 x 2880) and each row count
it times pagellm's kernels on random valid blocks of each type (median of interleaved
repeats, weights rotated over enough copies to exceed the last-level cache, as 32 experts
of 24 layers are), with the row-count rule the engine would apply (streaming up to 8 rows,
the dequantized panel into the bf16 GEMM above). Prints the CPU, a table with GB/s against
the machine's measured copy bandwidth, and one JSON line; writes
benchmarks/results/mxfp4_experts.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.quant_blocks import packed, random_blocks
from pagellm.kernels.weights import PackedWeight, WeightPart, WeightType
from pagellm.metrics.ceilings import measure_bandwidth

SHAPES = {"gpt-oss-20b gate_up 5760x2880": (5760, 2880), "gpt-oss-20b down 2880x2880": (2880, 2880)}
TYPES = (WeightType.MXFP4, WeightType.Q4_0)
CACHE_BYTES = 96 << 20  # rotate over copies worth more than the last-level cache


def weights(weight_type: WeightType, n: int, k: int, rng: np.random.Generator) -> list[PackedWeight]:
    first = PackedWeight([WeightPart(weight_type, packed(weight_type, random_blocks(weight_type, n, k, rng), k))], k)
    copies = max(2, CACHE_BYTES // first.nbytes + 1)
    return [first] + [PackedWeight([WeightPart(weight_type, first.parts[0].data.clone())], k) for _ in range(copies - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--output", default="benchmarks/results/mxfp4_experts.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    copy_gbs = measure_bandwidth() / 1e9
    print(f"CPU: {describe_cpu(cpu_info())}; threads {args.threads}; measured copy bandwidth {copy_gbs:.1f} GB/s")
    results = []
    for label, (n, k) in SHAPES.items():
        layers = {t: weights(t, n, k, rng) for t in TYPES}
        for rows in args.rows:
            x = torch.randn(rows, k).to(torch.bfloat16)
            times: dict[WeightType, list[float]] = {t: [] for t in TYPES}
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                for weight_type, copies in layers.items():
                    start = time.perf_counter()
                    for weight in copies:
                        weight.linear(x, None, args.threads)
                    times[weight_type].append((time.perf_counter() - start) / len(copies))
            row: dict[str, object] = {"shape": label, "rows": rows}
            for weight_type, samples in times.items():
                ms = statistics.median(samples) * 1e3
                gbs = layers[weight_type][0].nbytes / ms / 1e6
                row[weight_type.name] = {"ms": round(ms, 4), "GB/s": round(gbs, 1), "of copy": round(gbs / copy_gbs, 2)}
            row["MXFP4 / Q4_0 time"] = round(row["MXFP4"]["ms"] / row["Q4_0"]["ms"], 3)  # type: ignore[index]
            results.append(row)
            mx, q4 = row["MXFP4"], row["Q4_0"]
            print(f"{label:32s} rows {rows:3d}: MXFP4 {mx['ms']:.3f} ms ({mx['GB/s']} GB/s)  "  # type: ignore[index]
                  f"Q4_0 {q4['ms']:.3f} ms ({q4['GB/s']} GB/s)  ratio {row['MXFP4 / Q4_0 time']}")  # type: ignore[index]
    record = {"benchmark": "mxfp4_experts", "cpu": cpu_info(), "threads": args.threads,
              "copy_bandwidth_GBps": round(copy_gbs, 1), "results": results}  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
