"""Decode on a Qwen3.5-shaped hybrid GGUF (Q4_0, random weights): pagellm against llama.cpp
on the same file, single stream and 32 requests.

    python benchmarks/hybrid_decode.py                       # the 1B-class shape below
    python benchmarks/hybrid_decode.py --layers 4 --hidden 256 --intermediate 512 --heads 2 \
        --linear-key-heads 2 --linear-value-heads 4 --vocab 1000 --rounds 1   # a smoke test

1. The model: llama.cpp's `qwen35` layout (tests/gguf_models.py writes the same from HF
   weights and checks it against transformers): three Gated DeltaNet layers of four (the
   fourth gated attention, head size 256, rotary on a quarter of it), every matrix (the
   Gated DeltaNet's attn_qkv / attn_gate / ssm_beta / ssm_alpha / ssm_out, attention, MLP,
   embedding and LM head) as random valid Q4_0 blocks (pagellm/bench/quant_blocks.py) with
   weights of RMS about 0.02; the conv, decay, norms in F32 as llama.cpp's converter keeps
   them. Written to /tmp/pagellm-bench/ and reused while its spec matches.
2. Speed: `pagellm bench throughput` subprocesses on the same request lists, one after the
   other, --rounds times in turn: single stream (1 request, 16 prompt tokens, 64 output) and
   32 requests (16 prompt, 32 output each); pagellm bfloat16 with the weights as stored and
   llama.cpp (llama-cpp-python) on the file. Each backend reports its median round; the
   ratio is the median of the rounds' ratios.
Prints the CPU, the shape and a table; writes benchmarks/results/hybrid_decode.json (--out).
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
from quant_1b import SPEC_KEY, add_vocabulary, block_scale, file_spec
from llamacpp_decode import SCENARIOS, compare_decode, report

from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.quant_blocks import random_blocks
from pagellm.kernels.weights import WeightType, file_row_bytes

SHAPE = {"layers": 24, "hidden": 2048, "intermediate": 4096, "heads": 8, "kv_heads": 2, "head_dim": 256,
         "linear_key_heads": 16, "linear_value_heads": 16, "linear_head_dim": 128, "conv_kernel": 4,
         "vocab": 32000}  # fmt: skip
FORMAT_VERSION = 1


def tensor_plan(spec: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, type, shape as rows x k or a vector) of every tensor, in file order."""
    h, t = spec["hidden"], spec["type"]
    nk, nv, d = spec["linear_key_heads"], spec["linear_value_heads"], spec["linear_head_dim"]
    conv, value = 2 * nk * d + nv * d, nv * d
    q, kv = spec["heads"] * spec["head_dim"], spec["kv_heads"] * spec["head_dim"]
    plan = [("token_embd.weight", t, (spec["vocab"], h))]
    for layer in range(spec["layers"]):
        blk = f"blk.{layer}."
        plan.append((blk + "attn_norm.weight", "F32", (h,)))
        if (layer + 1) % 4:  # a Gated DeltaNet
            plan += [(blk + "attn_qkv.weight", t, (conv, h)), (blk + "attn_gate.weight", t, (value, h)),
                     (blk + "ssm_beta.weight", t, (nv, h)), (blk + "ssm_alpha.weight", t, (nv, h)),
                     (blk + "ssm_conv1d.weight", "F32", (conv, spec["conv_kernel"])), (blk + "ssm_dt.bias", "F32", (nv,)),
                     (blk + "ssm_a", "F32", (nv,)), (blk + "ssm_norm.weight", "F32", (d,)),
                     (blk + "ssm_out.weight", t, (h, value))]  # fmt: skip
        else:  # gated attention: q_proj holds each head's query and its gate
            plan += [(blk + "attn_q.weight", t, (2 * q, h)), (blk + "attn_k.weight", t, (kv, h)),
                     (blk + "attn_v.weight", t, (kv, h)), (blk + "attn_output.weight", t, (h, q)),
                     (blk + "attn_q_norm.weight", "F32", (spec["head_dim"],)),
                     (blk + "attn_k_norm.weight", "F32", (spec["head_dim"],))]  # fmt: skip
        plan += [(blk + "post_attention_norm.weight", "F32", (h,)), (blk + "ffn_gate.weight", t, (spec["intermediate"], h)),
                 (blk + "ffn_up.weight", t, (spec["intermediate"], h)), (blk + "ffn_down.weight", t, (h, spec["intermediate"]))]  # fmt: skip
    plan += [("output_norm.weight", "F32", (h,)), ("output.weight", t, (spec["vocab"], h))]
    return plan


def f32_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """The float tensors as a trained model's look: norms of 1 (stored as 1 + w: w = 0), a
    decay rate A = -exp(A_log) with A_log in [0, log 16], dt biases near 1, a short conv."""
    if name.endswith("ssm_a"):
        return -np.exp(rng.uniform(0.0, np.log(16.0), shape)).astype(np.float32)
    if name.endswith("ssm_dt.bias"):
        return rng.normal(1.0, 0.2, shape).astype(np.float32)
    if name.endswith("ssm_conv1d.weight"):
        return rng.normal(0.0, 0.3, shape).astype(np.float32)
    return np.ones(shape, dtype=np.float32)


def write_gguf(path: Path, spec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    rng = np.random.default_rng(spec["seed"])
    wtype = WeightType[spec["type"]]
    scale = block_scale(wtype, rng)
    arch = "qwen35"
    writer = gguf.GGUFWriter(str(partial), arch)
    writer.add_name("pagellm random-weight hybrid benchmark model")
    writer.add_block_count(spec["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(spec["hidden"])
    writer.add_feed_forward_length(spec["intermediate"])
    writer.add_head_count(spec["heads"])
    writer.add_head_count_kv(spec["kv_heads"])
    writer.add_key_length(spec["head_dim"])
    writer.add_value_length(spec["head_dim"])
    writer.add_rope_freq_base(10_000_000.0)
    writer.add_rope_dimension_count(spec["head_dim"] // 4)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_ssm_conv_kernel(spec["conv_kernel"])
    writer.add_ssm_state_size(spec["linear_head_dim"])
    writer.add_ssm_group_count(spec["linear_key_heads"])
    writer.add_ssm_time_step_rank(spec["linear_value_heads"])
    writer.add_ssm_inner_size(spec["linear_value_heads"] * spec["linear_head_dim"])
    writer.add_full_attention_interval(4)
    writer.add_vocab_size(spec["vocab"])
    writer.add_string(SPEC_KEY, json.dumps(spec, sort_keys=True))
    add_vocabulary(writer, spec["vocab"])
    plan = tensor_plan(spec)
    for name, type_name, shape in plan:
        if type_name == "F32":
            writer.add_tensor_info(name, list(shape), np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            rows, k = shape
            writer.add_tensor_info(name, [rows, file_row_bytes(wtype, k)], np.dtype(np.uint8), rows * file_row_bytes(wtype, k),
                                   raw_dtype=gguf.GGMLQuantizationType(int(wtype)))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, type_name, shape in plan:
        if type_name == "F32":
            writer.write_tensor_data(f32_values(name, shape, rng))
        else:
            writer.write_tensor_data(random_blocks(wtype, shape[0], shape[1], rng, scale))
    writer.close()
    os.replace(partial, path)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in SHAPE.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    parser.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q8_0"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["llamacpp"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hybrid_decode.json"))
    args = parser.parse_args()
    spec = {key: getattr(args, key) for key in SHAPE} | {"type": args.type, "seed": args.seed, "format": FORMAT_VERSION}
    name = "-".join(f"{spec[k]}" for k in SHAPE)
    path = Path("/tmp/pagellm-bench") / f"qwen35-{name}-{args.type.lower()}.gguf"
    if file_spec(path) != spec:
        write_gguf(path, spec)
    cpu = cpu_info()
    print(describe_cpu(cpu), flush=True)
    results = compare_decode(path, SCENARIOS, args.rounds, with_llamacpp="llamacpp" not in args.skip)
    report(path, spec, cpu, results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
