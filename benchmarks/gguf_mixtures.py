"""The GGUF downloads people pick, made the way they are made: a Llama-shaped random-weight
model written as F16, quantized by llama.cpp's own quantizer (pagellm/bench/llamacpp_quantize.py)
to Q4_K_M, Q3_K_M, Q2_K, IQ4_XS and IQ3_M; for each file, pagellm against llama.cpp.

    python benchmarks/gguf_mixtures.py                       # the 1B shape (quant_1b.py's)
    python benchmarks/gguf_mixtures.py --layers 2 --hidden 256 --intermediate 512 --heads 4 \
        --kv-heads 2 --vocab 1000 --rounds 1 --out /tmp/mixtures.json   # a smoke test

1. Files: quant_1b.py's writer with every matrix F16 (random weights of RMS 0.02, the fp16
   values themselves), then one `llama_model_quantize` call per mixture; all under
   /tmp/pagellm-bench/ and reused while the F16 file's spec matches.
2. Memory: a child process loads each file with pagellm (bfloat16, weights as stored) and
   reports the resident weight bytes by stored type against the file's tensor bytes
   (target: <= 1.05x).
3. Speed: `pagellm bench throughput` (--backends: bf16 activations, and --int8-activations,
   llama.cpp's arithmetic, for the types its kernels read) single stream (1 request, 16 prompt tokens, 64 output)
   and 32 requests (16 prompt, 32 output each), pagellm and llama.cpp on the same file, --rounds
   times in turn; the ratio is the median of the rounds' ratios. Weights read per token (every
   linear layer and the LM head as stored) x the faster backend's single-stream tok/s, against
   the measured copy bandwidth.
Prints the CPU and a table; writes benchmarks/results/gguf_mixtures.json (--out).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from llamacpp_decode import SCENARIOS, compare_decode
from quant_1b import DEFAULT_SHAPE, default_path, file_bytes, file_spec, measure_memory, write_gguf

from pagellm.bench.llamacpp_quantize import quantize
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.metrics.ceilings import measure_bandwidth

MIXTURES = ("Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ3_M")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in DEFAULT_SHAPE.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    parser.add_argument("--mixtures", nargs="+", default=list(MIXTURES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backends", nargs="+", default=["pagellm", "pagellm-int8"],
                        help="pagellm's variants: pagellm (bf16 activations), pagellm-int8 (--int8-activations)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gguf_mixtures.json"))
    args = parser.parse_args()
    spec = {key: getattr(args, key) for key in DEFAULT_SHAPE}
    spec.update(type="F16", output_type="F16", seed=args.seed, context=2048, format=1)
    source = default_path(spec)
    if file_spec(source) != spec:
        write_gguf(source, spec)
    cpu = cpu_info()
    copy_gbs = measure_bandwidth(seconds=1.0) / 1e9
    print(f"CPU: {describe_cpu(cpu)}; measured copy bandwidth {copy_gbs:.1f} GB/s", flush=True)
    records: dict[str, Any] = {}
    for mixture in args.mixtures:
        target = source.with_name(f"{source.stem}-{mixture}.gguf")
        if not target.exists() or target.stat().st_mtime < source.stat().st_mtime:
            start = time.perf_counter()
            quantize(source, target, mixture)
            print(f"{mixture}: quantized by llama.cpp in {time.perf_counter() - start:.0f} s", flush=True)
        sizes = file_bytes(target)
        memory = measure_memory(target, 1024, 256 << 20)
        resident = sum(memory.get("weight_bytes_by_format", {}).values())
        speed = compare_decode(target, SCENARIOS, args.rounds, with_llamacpp=True, ours=tuple(args.backends))
        single = max(speed["single stream"][b] for b in args.backends)
        records[mixture] = {
            "types": sizes["tensor_bytes_by_type"],
            "file_bytes": sizes["tensor_bytes"],
            "resident_weight_bytes": resident,
            "resident_over_file": resident / sizes["tensor_bytes"],
            "weights_by_format": memory.get("weight_bytes_by_format"),
            "single_stream_weight_gbps": sizes["step_bytes"] * single / 1e9,
            "speed": speed,
        }
        print(mixture, json.dumps(records[mixture]), flush=True)
    print(f"\n{'mixture':<9}{'backend':<14}{'MiB':>8}{'resident':>10}{'1 stream':>10}{'llama.cpp':>11}{'ratio':>7}"
          f"{'32 req':>9}{'llama.cpp':>11}{'ratio':>7}{'GB/s':>7}")  # fmt: skip
    for mixture, r in records.items():
        one, many = r["speed"]["single stream"], r["speed"]["32 requests"]
        for b in args.backends:
            print(f"{mixture:<9}{b:<14}{r['file_bytes'] / 2**20:>8.0f}{r['resident_over_file']:>9.2f}x{one[b]:>10.1f}"
                  f"{one['llamacpp']:>11.1f}{one['ratios'][b]:>7.2f}{many[b]:>9.1f}{many['llamacpp']:>11.1f}"
                  f"{many['ratios'][b]:>7.2f}{r['single_stream_weight_gbps']:>7.1f}")  # fmt: skip
    out = {"spec": spec, "cpu": cpu, "copy_bandwidth_GBps": round(copy_gbs, 1), "date": time.strftime("%Y-%m-%d"),
           "results": records}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
