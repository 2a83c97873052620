"""Decode on a gpt-oss-shaped GGUF (MXFP4 experts, random weights): pagellm against llama.cpp
on the same file, single stream and 32 requests.

    python benchmarks/gpt_oss_decode.py                     # the shape below (gpt-oss-20b scaled down)
    python benchmarks/gpt_oss_decode.py --layers 2 --hidden 256 --intermediate 256 --experts 4 \
        --vocab 1000 --rounds 1                             # a smoke test

1. The model: llama.cpp's `gpt-oss` layout (tests/gguf_models.py writes the same from HF
   weights and checks it against transformers): q/k/v/o with biases and a sink per head,
   every other layer on a 128-token window, a biased router over --experts experts of which
   4 run per token, each with biased gate, up and down projections. The experts' matrices are
   random valid MXFP4 blocks (as gpt-oss ships them), attention, embedding and LM head Q8_0,
   norms, biases, sinks and the router F32. gpt-oss-20b is 24 layers of hidden 2880 with 32
   experts of 2880 and 201k tokens; the default here keeps its structure at a size a 2-core
   machine decodes in seconds. Written to /tmp/pagellm-bench/ and reused while its spec matches.
2. Speed: `pagellm bench throughput` subprocesses on the same request lists, one after the
   other, --rounds times in turn: single stream (1 request, 16 prompt tokens, 64 output) and 32
   requests (16 prompt, 32 output each); pagellm bfloat16 with the weights as stored (--backends:
   pagellm with bf16 activations, pagellm-int8 with --int8-activations, as llama.cpp rounds its
   activations to 8 bits) and llama.cpp (llama-cpp-python) on the file. Each backend reports its median round; the ratio is
   the median of the rounds' ratios.
Prints the CPU, the shape and a table; writes benchmarks/results/gpt_oss_decode.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from quant_1b import SPEC_KEY, add_vocabulary, block_scale, check_llamacpp_loads, file_spec
from llamacpp_decode import SCENARIOS, compare_decode, report

from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.quant_blocks import random_blocks
from pagellm.kernels.weights import WeightType, file_row_bytes

SHAPE = {"layers": 12, "hidden": 1024, "intermediate": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64,
         "experts": 32, "experts_used": 4, "window": 128, "vocab": 32000}  # fmt: skip
FORMAT_VERSION = 1


def tensor_plan(spec: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, type, shape: rows x k, experts x rows x k, or a vector) in file order."""
    h, inter, experts = spec["hidden"], spec["intermediate"], spec["experts"]
    q, kv = spec["heads"] * spec["head_dim"], spec["kv_heads"] * spec["head_dim"]
    plan = [("token_embd.weight", "Q8_0", (spec["vocab"], h))]
    for layer in range(spec["layers"]):
        blk = f"blk.{layer}."
        plan += [(blk + "attn_norm.weight", "F32", (h,)),
                 (blk + "attn_q.weight", "Q8_0", (q, h)), (blk + "attn_q.bias", "F32", (q,)),
                 (blk + "attn_k.weight", "Q8_0", (kv, h)), (blk + "attn_k.bias", "F32", (kv,)),
                 (blk + "attn_v.weight", "Q8_0", (kv, h)), (blk + "attn_v.bias", "F32", (kv,)),
                 (blk + "attn_output.weight", "Q8_0", (h, q)), (blk + "attn_output.bias", "F32", (h,)),
                 (blk + "attn_sinks.weight", "F32", (spec["heads"],)),
                 (blk + "post_attention_norm.weight", "F32", (h,)),
                 (blk + "ffn_gate_inp.weight", "F32", (experts, h)), (blk + "ffn_gate_inp.bias", "F32", (experts,)),
                 (blk + "ffn_gate_exps.weight", "MXFP4", (experts, inter, h)), (blk + "ffn_gate_exps.bias", "F32", (experts, inter)),
                 (blk + "ffn_up_exps.weight", "MXFP4", (experts, inter, h)), (blk + "ffn_up_exps.bias", "F32", (experts, inter)),
                 (blk + "ffn_down_exps.weight", "MXFP4", (experts, h, inter)), (blk + "ffn_down_exps.bias", "F32", (experts, h))]  # fmt: skip
    plan += [("output_norm.weight", "F32", (h,)), ("output.weight", "Q8_0", (spec["vocab"], h))]
    return plan


def f32_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norms of 1, sinks of the scores' size, small biases, a router of RMS 0.02."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if name.endswith("attn_sinks.weight"):
        return rng.normal(0.0, 1.0, shape).astype(np.float32)
    return rng.normal(0.0, 0.02, shape).astype(np.float32)


def write_gguf(path: Path, spec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    rng = np.random.default_rng(spec["seed"])
    writer = gguf.GGUFWriter(str(partial), "gpt-oss")
    writer.add_name("pagellm random-weight gpt-oss benchmark model")
    writer.add_block_count(spec["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(spec["hidden"])
    writer.add_feed_forward_length(spec["intermediate"])
    writer.add_head_count(spec["heads"])
    writer.add_head_count_kv(spec["kv_heads"])
    writer.add_key_length(spec["head_dim"])
    writer.add_value_length(spec["head_dim"])
    writer.add_rope_freq_base(150000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(spec["experts"])
    writer.add_expert_used_count(spec["experts_used"])
    writer.add_expert_feed_forward_length(spec["intermediate"])
    writer.add_sliding_window(spec["window"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_rope_scaling_orig_ctx_len(4096)
    writer.add_vocab_size(spec["vocab"])
    writer.add_string(SPEC_KEY, json.dumps(spec, sort_keys=True))
    add_vocabulary(writer, spec["vocab"])
    plan = tensor_plan(spec)
    for name, type_name, shape in plan:
        if type_name == "F32":
            writer.add_tensor_info(name, list(shape), np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            wtype = WeightType[type_name]
            *outer, k = shape
            rows = int(np.prod(outer))
            writer.add_tensor_info(name, [*outer, file_row_bytes(wtype, k)], np.dtype(np.uint8), rows * file_row_bytes(wtype, k),
                                   raw_dtype=gguf.GGMLQuantizationType(int(wtype)))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, type_name, shape in plan:
        if type_name == "F32":
            writer.write_tensor_data(f32_values(name, shape, rng))
        else:
            wtype = WeightType[type_name]
            *outer, k = shape
            blocks = random_blocks(wtype, int(np.prod(outer)), k, rng, block_scale(WeightType.Q8_0, rng) if type_name == "Q8_0" else 2**-7)
            writer.write_tensor_data(blocks.reshape(*outer, -1))
    writer.close()
    os.replace(partial, path)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in SHAPE.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["llamacpp"])
    parser.add_argument("--backends", nargs="+", default=["pagellm", "pagellm-int8"],
                        help="pagellm's variants: pagellm (bf16 activations), pagellm-int8 (--int8-activations)")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpt_oss_decode.json"))
    args = parser.parse_args()
    spec = {key: getattr(args, key) for key in SHAPE} | {"seed": args.seed, "format": FORMAT_VERSION}
    path = Path("/tmp/pagellm-bench") / ("gpt-oss-" + "-".join(str(spec[k]) for k in SHAPE) + "-mxfp4.gguf")
    if file_spec(path) != spec:
        write_gguf(path, spec)
    cpu = cpu_info()
    print(describe_cpu(cpu), flush=True)
    with_llamacpp = "llamacpp" not in args.skip
    if with_llamacpp:
        print(check_llamacpp_loads(path), flush=True)
    scenarios = {name: SCENARIOS[name] for name in args.scenarios}
    results = compare_decode(path, scenarios, args.rounds, with_llamacpp, ours=tuple(args.backends))
    report(path, spec, cpu, results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
