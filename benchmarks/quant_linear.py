"""One quantized linear layer: pagellm's kernels against what PyTorch ships and bf16.

    python benchmarks/quant_linear.py [--threads 2] [--rows 1 4 8 16 32 64] [--types Q4_0 Q4_K Q6_K]

For each shape and row count it times (median of interleaved repeats, weights rotated over
enough copies to exceed the last-level cache, as a model's layers do):
  - pagellm Q4_0 (kernels/weights.py, the stored blocks; --types for others), with bf16
    activations (the default) and, where the build has the kernel, with activations rounded
    to int8 (--int8-activations, csrc/quant_int8.c: Q4_0 / Q4_1 / MXFP4 rows repacked into its
    lane order as the engine does where the CPU has AVX-512 VNNI, as stored on AVX2;
    quant_int8_k.c: the K-quants and IQ4_XS, quant_int8_q8.c: Q8_0, as stored, VNNI only; up
    to 8 rows),
  - torch `_weight_int4pack_mm_for_cpu` (group-32 affine int4: Q4_0 re-expressed exactly),
  - pagellm int8 rows and torch `_weight_int8pack_mm` (per-channel int8),
  - pagellm's bf16 linear kernel (the dequantized path).
Prints the CPU, a table, and one JSON line; writes benchmarks/results/quant_linear.json.
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
from pagellm.kernels.build import load_kernels
from pagellm.kernels.linear_bindings import LinearImpl
from pagellm.kernels.weights import VNNI_OF, PackedWeight, WeightPart, WeightType, bf16_weight, int8_kernel_part, quantize_int8_rows

SHAPES = {"smollm2 gate_up 3072x576": (3072, 576), "gpt-oss bench expert gate_up 2048x1024": (2048, 1024),
          "gpt-oss bench LM head 32000x1024": (32000, 1024), "1B gate_up 11264x2048": (11264, 2048), "1B down 2048x5632": (2048, 5632)}
CACHE_BYTES = 256 << 20  # rotate over copies worth 8x the L3 cache (32 MiB here): at 2x, part of them stayed in it


def _copies(bytes_per_copy: int) -> int:
    return max(2, CACHE_BYTES // max(bytes_per_copy, 1) + 1)


def build(n: int, k: int, rng: np.random.Generator, types: list[str]) -> tuple[dict[str, list], dict[str, int]]:
    """Every variant's copies (enough to stream from memory) and bytes per copy."""
    stored: dict[str, PackedWeight] = {}
    for name in types:
        weight_type = WeightType[name]
        part = WeightPart(weight_type, packed(weight_type, random_blocks(weight_type, n, k, rng), k))
        stored[name.lower()] = PackedWeight([part], k)
        if int8_kernel_reads(weight_type):  # as --int8-activations holds it (Q4_0 / Q4_1 / MXFP4 repacked on VNNI)
            stored[f"{name.lower()} int8 act"] = PackedWeight([int8_kernel_part(part, k)], k)
    dense = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
    stored["int8 rows"] = PackedWeight([quantize_int8_rows(dense)], k)
    bf16 = bf16_weight(dense.to(torch.bfloat16))
    nibbles = torch.randint(0, 16, (n, k), dtype=torch.int32)
    t_int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
    t_sz = (torch.randn(k // 32, n, 2) * 0.01).to(torch.bfloat16)
    t_i8 = dense.mul(127 / dense.abs().amax()).round().to(torch.int8)
    t_s8 = torch.full((n,), 0.01, dtype=torch.bfloat16)
    sizes = {name: weight.nbytes for name, weight in stored.items()}
    sizes.update({"torch int4": t_int4.numel() + t_sz.numel() * 2, "torch int8": t_i8.numel() + n * 2, "bf16": bf16.nbytes})
    others = {
        "torch int4": lambda: (t_int4.clone(), t_sz.clone()),
        "torch int8": lambda: (t_i8.clone(), t_s8.clone()),
        "bf16": lambda: bf16_weight(bf16.parts[0].data.clone()),
    }
    # Distinct copies for the ones that must stream from memory (ours share data: copy it).
    out = {}
    for name, base in stored.items():
        out[name] = [PackedWeight([WeightPart(p.type, p.data.clone(), None if p.row_scales is None else p.row_scales.clone()) for p in base.parts], k)
                     for _ in range(_copies(sizes[name]))]  # fmt: skip
    for name, make in others.items():
        out[name] = [make() for _ in range(_copies(sizes[name]))]
    return out, sizes


def int8_kernel_reads(weight_type: WeightType) -> bool:
    library = load_kernels()
    vnni = VNNI_OF.get(weight_type, weight_type)
    return library is not None and bool(library.quant_int8_supported(int(weight_type)) or library.quant_int8_supported(int(vnni)))


def run_one(name: str, weight, x: torch.Tensor, threads: int) -> None:
    if name.endswith("int8 act"):
        weight.linear(x, None, threads, int(LinearImpl.STREAMING_INT8))
    elif name == "torch int4":
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight[0], 32, weight[1])
    elif name == "torch int8":
        torch.ops.aten._weight_int8pack_mm(x, weight[0], weight[1])
    else:
        weight.linear(x, None, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--types", nargs="+", default=["Q4_0"], help="stored types, e.g. Q4_0 Q4_K Q6_K")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--output", default="benchmarks/results/quant_linear.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"CPU: {describe_cpu(cpu_info())}; threads {args.threads}; torch {torch.__version__}")
    results = []
    for label in args.shapes:
        n, k = SHAPES[label]
        weights, sizes = build(n, k, rng, args.types)
        for rows in args.rows:
            x = torch.randn(rows, k).to(torch.bfloat16)
            # The int8 kernel serves decode steps (the measured choice takes it up to 8 rows at most).
            variants = {name: copies for name, copies in weights.items() if not name.endswith("int8 act") or rows <= 8}
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
                for name, copies in variants.items():
                    start = time.perf_counter()
                    for weight in copies:
                        run_one(name, weight, x, args.threads)
                    times[name].append((time.perf_counter() - start) / len(copies))
            row = {"shape": label, "rows": rows}
            for name, samples in times.items():
                ms = statistics.median(samples) * 1e3
                row[name] = {"ms": round(ms, 4), "GB/s": round(sizes[name] / ms / 1e6, 1)}
            results.append(row)
            print(f"{label:26s} rows {rows:3d}: " + "  ".join(f"{nm} {v['ms']:.3f} ms" for nm, v in row.items() if isinstance(v, dict)))
    record = {"benchmark": "quant_linear", "cpu": cpu_info(), "threads": args.threads, "results": results}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
