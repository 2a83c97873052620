"""Compile the Triton kernels for an NVIDIA GPU (sm_90) without one: Triton's own
compiler and the ptxas it ships turn them into GPU code on any machine. The interpreter
runs the kernels' arithmetic; this catches what only the compiler refuses (non-constexpr
globals, type and shape errors, unsupported operations) and reports each variant's
shared memory. Run with TRITON_INTERPRET unset: `python tests/attention/compile_triton_kernels.py`.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run with TRITON_INTERPRET unset")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagellm.attention import triton_gated_delta as delta_kernels
from pagellm.attention import triton_kernels as kernels
from pagellm.attention.triton_backend import TritonTuning, _next_power_of_2

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200


def compile_one(fn, types: dict[str, str], constexprs: dict[str, object]) -> int:
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    # As at run time: torch's allocations are 16-byte aligned and the shapes' strides are
    # multiples of 16, so Triton specializes every pointer and integer as divisible by 16.
    # That is what switches on the async-copy pipelining, and where Triton 3.6 refused a
    # data-dependent branch in the loop on an H200 while this script, without the
    # attributes, compiled it.
    aligned = [i for i, name in enumerate(fn.arg_names) if name not in constexprs and types[name][0] in "*i"]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=TARGET)
    return compiled.metadata.shared


def main() -> None:
    tuning = TritonTuning()
    # (heads, kv heads, head_dim, soft-capping, sinks): Llama-3-8B, SmolLM2, Gemma-2-9B, gpt-oss-20b.
    shapes = ((32, 8, 128, False, False), (9, 3, 64, False, False), (16, 8, 256, True, False), (64, 8, 64, False, True))
    for num_heads, num_kv_heads, head_dim, softcap, sinks in shapes:
        group = num_heads // num_kv_heads
        decode_m = max(16, _next_power_of_2(group))
        prefill_m = max(16, tuning.prefill_block_m, _next_power_of_2(group))
        # (model dtype, cache dtype): the model's own, or fp8 (--kv-cache-dtype). Every pair on
        # the first shape; the others (other constants: head_dim, group, the cap) with two
        # pairs each, since each compile costs seconds and a cold CI machine pays them all.
        pairs = (("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("bf16", "fp8e4nv"), ("bf16", "fp8e5"),
                 ("fp32", "fp8e4nv"))
        if num_heads != 32:
            pairs = (("bf16", "bf16"), ("fp32", "fp32")) if softcap else (("bf16", "bf16"), ("bf16", "fp8e4nv"))
        if sinks:
            pairs = (("bf16", "bf16"),)
        for dtype, cache in pairs:
            fp8 = {"fp8e4nv": (3, 7, 0x43E00000), "fp8e5": (2, 15, 0x47600000)}.get(cache)
            stored = "u8" if fp8 else cache  # store_kv writes fp8 caches' bytes
            compile_one(
                kernels.store_kv_kernel,
                dict(key_ptr=f"*{dtype}", value_ptr=f"*{dtype}", key_cache_ptr=f"*{stored}",
                     value_cache_ptr=f"*{stored}", slot_mapping_ptr="*i64", key_stride_token="i32",
                     key_stride_head="i32", value_stride_token="i32", value_stride_head="i32"),
                dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                     BLOCK_HEADS=_next_power_of_2(num_kv_heads), BLOCK_D=head_dim,
                     FP8_MANT=fp8[0] if fp8 else 0, FP8_BIAS=fp8[1] if fp8 else 0,
                     FP8_MAX_BITS=fp8[2] if fp8 else 0),
            )  # fmt: skip
            types = dict(
                query_ptr=f"*{dtype}", key_cache_ptr=f"*{cache}", value_cache_ptr=f"*{cache}",
                block_tables_ptr="*i64", seq_lens_ptr="*i32", query_start_loc_ptr="*i32",
                tile_req_ptr="*i32", tile_start_ptr="*i32", output_ptr=f"*{dtype}",
                partial_out_ptr="*fp32", partial_max_ptr="*fp32", partial_sum_ptr="*fp32", sinks_ptr="*fp32",
                query_stride_token="i32", query_stride_head="i32", output_stride_token="i32",
                output_stride_head="i32", block_table_stride="i32", scale_log2="fp32", window="i32",
                softcap_in="fp32", softcap_out="fp32",
            )  # fmt: skip
            for name, block_q, block_m, splits in (
                ("decode", 1, decode_m, 1),
                ("split decode", 1, decode_m, 8),
                ("prefill", prefill_m // group, prefill_m, 1),
            ):
                shared = compile_one(
                    kernels.paged_attention_kernel, types,
                    dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                         BLOCK_SIZE=16, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
                         BLOCK_N=tuning.block_n, BLOCK_D=head_dim, NUM_SPLITS=splits,
                         IEEE_FP32=dtype == "fp32", DOT_IN_FP32=False, SOFTCAP=softcap, HAS_SINKS=sinks),
                )  # fmt: skip
                print(f"paged_attention {name} {dtype} (cache {cache}) heads {num_heads}/{num_kv_heads}x{head_dim}"
                      f"{' softcap' if softcap else ''}{' sinks' if sinks else ''}: "
                      f"shared {shared} B")
            compile_one(
                kernels.merge_splits_kernel,
                dict(partial_out_ptr="*fp32", partial_max_ptr="*fp32", partial_sum_ptr="*fp32",
                     output_ptr=f"*{dtype}", rows_ptr="*i32", sinks_ptr="*fp32", output_stride_token="i32",
                     output_stride_head="i32"),
                dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=8, BLOCK_D=head_dim, HAS_SINKS=sinks),
            )  # fmt: skip
    # The Gated DeltaNet decode step (attention/triton_gated_delta.py): Qwen3.5-27B's layer
    # (16 key / 48 value heads of 128, tiled as llama.cpp orders them) and Qwen3-Next's.
    for key_heads, value_heads, tiled in ((16, 48, True), (16, 32, False)):
        channels = 2 * key_heads * 128 + value_heads * 128
        for dtype in ("bf16", "fp16", "fp32"):
            compile_one(
                delta_kernels.conv_step_kernel,
                dict(mixed_ptr=f"*{dtype}", weight_ptr="*fp32", conv_states_ptr="*fp32", slots_ptr="*i64",
                     out_ptr="*fp32", mixed_stride="i32"),
                dict(CHANNELS=channels, KERNEL=4, BLOCK_C=1024),
            )  # fmt: skip
            shared = compile_one(
                delta_kernels.delta_rule_step_kernel,
                dict(conv_ptr="*fp32", b_ptr=f"*{dtype}", a_ptr=f"*{dtype}", a_log_ptr="*fp32", dt_bias_ptr="*fp32",
                     states_ptr="*fp32", slots_ptr="*i64", out_ptr="*fp32", gate_stride="i32", scale="fp32"),
                dict(KEY_HEADS=key_heads, VALUE_HEADS=value_heads, KEY_DIM=128, VALUE_DIM=128, TILED=tiled,
                     BLOCK_K=128, BLOCK_V=64),
            )  # fmt: skip
            print(f"gated delta decode {dtype} heads {key_heads}/{value_heads}x128: shared {shared} B")
        shared = compile_one(
            delta_kernels.delta_rule_run_kernel,
            dict(q_ptr="*fp32", k_ptr="*fp32", v_ptr="*fp32", g_ptr="*fp32", beta_ptr="*fp32", state_ptr="*fp32",
                 out_ptr="*fp32", tokens="i32"),
            dict(HEADS=value_heads, KEY_DIM=128, VALUE_DIM=128, BLOCK_K=128, BLOCK_V=64),
        )  # fmt: skip
        print(f"gated delta prefill run heads {value_heads}x128: shared {shared} B")
    print("all kernels compiled for sm_90")


if __name__ == "__main__":
    main()
