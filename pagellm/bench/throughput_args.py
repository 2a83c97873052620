"""Bench stage: the command line of `pagellm bench throughput` (kept free of torch so that
building the CLI parser stays cheap)."""

from __future__ import annotations

import argparse

from pagellm.config.cache import KV_CACHE_DTYPES
from pagellm.config.engine_args import QUANTIZATION_CHOICES

from pagellm.bench.agreement import DEFAULT_CHECK_REQUESTS, DEFAULT_CHECK_TOKENS
from pagellm.workload.command_output import add_output_args
from pagellm.workload.synthetic import add_workload_args

# openvino, vllm: bench/peers.py, each in its own environment.
BACKENDS = ("pagellm", "hf", "llamacpp", "openvino", "vllm")


def add_bench_throughput_parser(bench_commands: "argparse._SubParsersAction") -> None:
    p = bench_commands.add_parser(
        "throughput", help="offline throughput on a synthetic workload",
        description="Run one synthetic request list on a backend and report throughput. Prints a "
        "table; --json prints the full result as JSON instead; the result is also appended to "
        "--result-file.",
    )  # fmt: skip
    p.add_argument("--backend", choices=BACKENDS, default="pagellm")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--llamacpp-parallel", type=int, default=64, help="sequences decoded together")
    p.add_argument(
        "--llamacpp-weights",
        choices=("stored", "bfloat16", "float32"),
        default="stored",
        help="llama.cpp runs the GGUF as stored (quantized), or a copy dequantized to this type "
        "(equal work with pagellm's dtype)",
    )
    p.add_argument(
        "--repeats", type=int, default=1,
        help="measured runs of the request list on pagellm and llama.cpp (after the warm-up); "
        "the median is reported. Short runs (one request) vary by 20%% between runs here",
    )  # fmt: skip
    p.add_argument(
        "--quantization", choices=QUANTIZATION_CHOICES, default="auto",
        help="pagellm: keep a GGUF's quantized weights as stored (auto), dequantize them (none), "
        "or int8 weight-only from a float checkpoint",
    )  # fmt: skip
    p.add_argument(
        "--int8-activations", action="store_true",
        help="pagellm: multiply Q4_0 / Q4_1 weights with activations rounded to int8, as llama.cpp does",
    )
    p.add_argument(
        "--structured-output", choices=("none", "json-schema"), default="none",
        help="json-schema: every request asks for JSON of one of a few schemas; reports the run against "
        "the same requests unconstrained at the same output lengths, compile times and first-token latency "
        "for a new vs a cached schema (pagellm only)",
    )  # fmt: skip
    p.add_argument(
        "--num-scheduler-steps", type=int, default=1,
        help="pagellm: decode steps per engine step while every running request decodes (multi-step decoding)",
    )
    p.add_argument(
        "--peer-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of a peer backend (openvino: cache_size_gb, max_num_batched_tokens, max_num_seqs, "
        "dynamic_split_fuse, threads; vllm: dtype, max_num_batched_tokens, max_num_seqs, max_model_len, "
        "enforce_eager, kv_cache_space_gb, threads_bind, reserved_cpus, threads, preload_iomp); repeatable; "
        "unset ones keep the peer's defaults (vllm: but a 4 GiB KV cache, no core kept for a frontend, "
        "Intel OpenMP preloaded)",
    )
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="pagellm's KV cache element type (auto: the model's dtype)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--check-requests", type=int, default=DEFAULT_CHECK_REQUESTS,
                   help="requests whose leading greedy tokens are compared with HF float32's (0 = no check)")
    p.add_argument("--check-tokens", type=int, default=DEFAULT_CHECK_TOKENS,
                   help="leading output tokens compared per checked request")  # fmt: skip
    add_workload_args(p)
    add_output_args(p, default_result_file="bench-results/throughput.jsonl")
    p.set_defaults(run_command=run_bench_throughput_command)


def run_bench_throughput_command(args: argparse.Namespace) -> None:
    # Imported here: building the CLI must not import torch.
    from pagellm.bench.throughput import run_bench_throughput

    run_bench_throughput(args)
