"""A ~1B Llama as Q4_0 (or Q4_K) GGUF, far bigger than the caches: pagellm against llama.cpp.
With --experts, a mixture of experts of that shape (Mixtral's layout: a `llama` GGUF with
stacked `ffn_*_exps` experts and an F32 router `ffn_gate_inp`; with --arch qwen3moe,
Qwen3-MoE's: a `qwen3moe` GGUF with per-head q/k norms and its expert width).

    python benchmarks/quant_1b.py                  # Q4_0, the 1B shape (writes the file once)
    python benchmarks/quant_1b.py --type Q4_K      # Q4_K blocks instead
    python benchmarks/quant_1b.py --output-type Q6_K --skip llamacpp
    python benchmarks/quant_1b.py --layers 2 --hidden 256 --intermediate 512 --heads 4 \
        --kv-heads 2 --vocab 1000 --out /tmp/quant_1b_smoke.json   # a tiny shape (smoke test)
    python benchmarks/quant_1b.py --layers 8 --hidden 1024 --intermediate 512 --heads 16 \
        --kv-heads 4 --experts 32 --experts-used 4 --out benchmarks/results/moe_decode.json  # experts

The quantized-decode target (pagellm against llama.cpp on the same file). Steps:
1. The model: a random-weight GGUF of the Llama shape (default 22 layers, hidden 2048,
   32 heads / 4 KV heads, intermediate 5632, vocab 32000), every linear weight, the token
   embedding and the LM head (`output`, --output-type, default the same type) as random
   valid quantization blocks (pagellm/bench/quant_blocks.py) whose fp16 scales give
   weights of RMS about 0.02; norms are F32 ones. Written tensor by tensor (no float copy
   of the model), to /tmp/pagellm-bench/ by default, and reused while its shape and types
   match. The vocabulary is byte-level ("gpt2"): the 256 byte tokens, "aa".."zz"
   (merges), fillers. A freshly written file is opened by llama_cpp.Llama once, to prove
   llama.cpp takes it.
2. Memory: a child process loads it with pagellm (bfloat16, small KV cache) and reports
   model.weight_bytes_by_format() against the file's tensor bytes (target: <= 1.1x), and
   its RSS (/proc/self/status) before and after the load.
3. Speed: `pagellm bench throughput` subprocesses, one after the other, on the same
   request lists: single stream (1 request, 16 prompt tokens, 64 output, median of 3) and
   32 requests (16 prompt, 32 output each); pagellm bfloat16 (weights as stored, the
   default --quantization auto) and llama.cpp on the GGUF as stored. With --rounds R every
   backend of a scenario runs R times in turn (so a slow minute on a shared machine hits
   all of them alike): each backend reports its median round, and the ratio to llama.cpp
   is the median of the rounds' ratios (each against llama.cpp's run of the same round).
4. Bandwidth: bytes of weights one decode step reads (every linear layer and the LM head,
   as stored) x decode steps/s (single stream: output tok/s; 32 requests: output tok/s /
   32), against the copy bandwidth pagellm.metrics.ceilings.measure_bandwidth measures
   (bytes read + written of a large copy). Output tok/s includes the (short) prefill and
   KV-cache reads are not counted, so achieved GB/s is a slight underestimate.
Prints the configuration, the CPU, a table and one JSON line; writes
benchmarks/results/quant_1b.json (--out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.quant_blocks import random_blocks, reference_weight
from pagellm.kernels.weights import WeightType, file_row_bytes
from pagellm.tokenizer.gguf_tokenizer import byte_level_alphabet

DEFAULT_SHAPE = {"layers": 22, "hidden": 2048, "heads": 32, "kv_heads": 4, "intermediate": 5632, "vocab": 32000}
TYPES = ("Q4_0", "Q4_K", "Q6_K", "Q8_0")
WEIGHT_RMS = 0.02
LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
SPEC_KEY = "pagellm.bench.spec"  # the spec a file was written from (reuse check)
FORMAT_VERSION = 3  # of what write_gguf writes: a file of another version is written again
FILE_TYPES = {"F16": gguf.LlamaFileType.MOSTLY_F16, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,
              "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}  # fmt: skip


# -- 1. the GGUF -----------------------------------------------------------------------------


def model_spec(args: argparse.Namespace) -> dict[str, Any]:
    spec = {key: getattr(args, key) for key in DEFAULT_SHAPE}
    spec.update(type=args.type, output_type=args.output_type or args.type, seed=args.seed, context=args.context,
                format=FORMAT_VERSION)
    if args.experts:  # a mixture of experts: each layer's MLP becomes experts of --intermediate rows
        spec.update(experts=args.experts, experts_used=args.experts_used)
    if args.arch != "llama":  # (kept out of llama specs, so their files are reused)
        if not args.experts:
            raise SystemExit("--arch qwen3moe needs --experts")
        spec["arch"] = args.arch
    return spec


def default_path(spec: dict[str, Any]) -> Path:
    name = "llama-1b" if all(spec[k] == v for k, v in DEFAULT_SHAPE.items()) else (
        f"{spec.get('arch', 'llama')}-{spec['layers']}l-{spec['hidden']}h-{spec['intermediate']}i-{spec['heads']}x{spec['kv_heads']}-"
        f"{spec['vocab']}v"
    )  # fmt: skip
    if spec.get("experts"):
        name += f"-{spec['experts']}e{spec['experts_used']}"
    name += f"-{spec['type'].lower()}"
    if spec["output_type"] != spec["type"]:
        name += f"-out-{spec['output_type'].lower()}"
    return Path("/tmp/pagellm-bench") / f"{name}.gguf"


def tensor_plan(spec: dict[str, Any]) -> list[tuple[str, str, int, int]]:
    """(GGUF name, type, rows, k) of every tensor in file order; type "F32" for norms (rows 0)."""
    h, inter, head_dim = spec["hidden"], spec["intermediate"], spec["hidden"] // spec["heads"]
    kv = spec["kv_heads"] * head_dim
    t = spec["type"]
    shapes = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
              "ffn_gate": (inter, h), "ffn_up": (inter, h), "ffn_down": (h, inter)}  # fmt: skip
    plan = [("token_embd.weight", t, spec["vocab"], h)]
    experts = spec.get("experts", 0)
    for layer in range(spec["layers"]):
        plan.append((f"blk.{layer}.attn_norm.weight", "F32", 0, h))
        for kind in LINEAR[:4]:
            plan.append((f"blk.{layer}.{kind}.weight", t, *shapes[kind]))
        if spec.get("arch") == "qwen3moe":  # Qwen3's per-head q and k norms
            plan.append((f"blk.{layer}.attn_q_norm.weight", "F32", 0, head_dim))
            plan.append((f"blk.{layer}.attn_k_norm.weight", "F32", 0, head_dim))
        plan.append((f"blk.{layer}.ffn_norm.weight", "F32", 0, h))
        if experts:  # the router (float32), then llama.cpp's stacked experts: rows = experts x per expert
            plan.append((f"blk.{layer}.ffn_gate_inp.weight", "F32", experts, h))
            for kind in LINEAR[4:]:
                rows, k = shapes[kind]
                plan.append((f"blk.{layer}.{kind}_exps.weight", t, experts * rows, k))
            continue
        for kind in LINEAR[4:]:
            plan.append((f"blk.{layer}.{kind}.weight", t, *shapes[kind]))
    plan.append(("output_norm.weight", "F32", 0, h))
    plan.append(("output.weight", spec["output_type"], spec["vocab"], h))
    return plan


def block_scale(weight_type: WeightType, rng: np.random.Generator) -> float:
    """The fp16 scale magnitude for random_blocks that gives weights of RMS WEIGHT_RMS
    (values are linear in the scales, so one sample at scale 1 calibrates it)."""
    k = 8 * weight_type.block_elements
    sample = reference_weight(weight_type, random_blocks(weight_type, 64, k, rng, 1.0), k)
    return WEIGHT_RMS / float(np.sqrt(np.mean(sample**2)))


def vocabulary(size: int) -> tuple[list[str], list[str]]:
    """Tokens and merges of a byte-level vocabulary: the 256 byte tokens (spelled as GPT-2
    does), then two-letter tokens "aa".."zz" with their merges (llama.cpp insists on some
    merges), then filler tokens tok<i> up to `size`."""
    if size < 256:
        raise SystemExit(f"--vocab must be at least 256 (the byte tokens), got {size}")
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [a + b for a in letters for b in letters][: size - 256]
    spelling = byte_level_alphabet()
    tokens = [spelling[b] for b in range(256)] + pairs
    tokens += [f"tok{i}" for i in range(len(tokens), size)]
    return tokens, [f"{p[0]} {p[1]}" for p in pairs]


def add_vocabulary(writer: gguf.GGUFWriter, size: int) -> None:
    """The byte-level vocabulary (vocabulary() above) as llama.cpp's "gpt2" tokenizer, BOS 1, EOS 2."""
    tokens, merges = vocabulary(size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(path: Path, spec: dict[str, Any]) -> None:
    plan = tensor_plan(spec)
    for name, type_name, rows, k in plan:
        if type_name != "F32" and k % WeightType[type_name].block_elements:
            raise SystemExit(f"{name}: k={k} is not a multiple of {type_name}'s block of "
                             f"{WeightType[type_name].block_elements}")  # fmt: skip
    if spec["hidden"] % spec["heads"] or spec["heads"] % spec["kv_heads"]:
        raise SystemExit("--hidden must divide by --heads, and --heads by --kv-heads")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    rng = np.random.default_rng(spec["seed"])
    scales = {t: block_scale(WeightType[t], rng) for t in {spec["type"], spec["output_type"]}}
    writer = gguf.GGUFWriter(str(partial), spec.get("arch", "llama"))
    writer.add_name("pagellm random-weight benchmark model")
    writer.add_file_type(FILE_TYPES[spec["type"]])
    writer.add_block_count(spec["layers"])
    writer.add_context_length(spec["context"])
    writer.add_embedding_length(spec["hidden"])
    writer.add_feed_forward_length(spec["intermediate"])
    writer.add_head_count(spec["heads"])
    writer.add_head_count_kv(spec["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(spec["hidden"] // spec["heads"])
    writer.add_vocab_size(spec["vocab"])
    if spec.get("experts"):
        writer.add_expert_count(spec["experts"])
        writer.add_expert_used_count(spec["experts_used"])
        if spec.get("arch") == "qwen3moe":
            writer.add_expert_feed_forward_length(spec["intermediate"])
    writer.add_string(SPEC_KEY, json.dumps(spec, sort_keys=True))
    add_vocabulary(writer, spec["vocab"])
    # Tensor infos first, then each tensor's bytes generated and written one at a time.
    for name, type_name, rows, k in plan:
        if type_name == "F32":
            shape = [k] if rows == 0 else [rows, k]  # a norm, or a router
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * k * max(rows, 1))
        else:
            wtype = WeightType[type_name]
            nbytes = rows * file_row_bytes(wtype, k)
            shape = [rows, file_row_bytes(wtype, k)]
            if name.endswith("_exps.weight"):
                shape = [spec["experts"], rows // spec["experts"], file_row_bytes(wtype, k)]
            writer.add_tensor_info(name, shape, np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType(int(wtype)))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    start = time.perf_counter()
    for name, type_name, rows, k in plan:
        if type_name == "F32" and rows:  # a router: random, so that tokens spread over the experts
            writer.write_tensor_data(rng.normal(0.0, 1.0, (rows, k)).astype(np.float32))
        elif type_name == "F32":
            writer.write_tensor_data(np.ones(k, dtype=np.float32))
        else:
            writer.write_tensor_data(random_blocks(WeightType[type_name], rows, k, rng, scales[type_name]))
    writer.close()
    os.replace(partial, path)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s", flush=True)


def file_spec(path: Path) -> dict[str, Any] | None:
    """The spec a file was written from, or None (absent, unreadable, not ours)."""
    if not path.exists():
        return None
    try:
        field = gguf.GGUFReader(str(path)).fields.get(SPEC_KEY)
        return None if field is None else json.loads(field.contents())
    except Exception:  # truncated or foreign file: write it again
        return None


def check_llamacpp_loads(path: Path) -> str:
    """Open the file with llama_cpp.Llama and round-trip a string through its tokenizer."""
    try:
        import llama_cpp
    except ImportError:
        return "llama-cpp-python not installed: not checked"
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=os.cpu_count() or 1, verbose=False)
    try:
        ids = llm.tokenize(b"hello", add_bos=False)
        text = llm.detokenize(ids).decode()
        llm.eval(ids)
        if text != "hello":
            raise SystemExit(f"llama.cpp tokenizer round trip of 'hello' gave {text!r}")
        return f"llama.cpp {getattr(llama_cpp, '__version__', '?')} loads it (n_vocab {llm.n_vocab()}, evaluated {len(ids)} tokens)"
    finally:
        llm.close()


def file_bytes(path: Path) -> dict[str, Any]:
    """Tensor bytes of the file: all, those one decode step reads (linear layers, routers
    and the LM head; with experts, every expert), and the experts' share of them."""
    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    linear = re.compile(r"^blk\.\d+\.(" + "|".join(LINEAR) + r")(_exps|_inp)?\.weight$")
    types: dict[str, int] = {}
    for t in reader.tensors:
        kind = gguf.GGMLQuantizationType(t.tensor_type).name
        types[kind] = types.get(kind, 0) + int(t.n_bytes)
    return {
        "file_bytes": path.stat().st_size,
        "tensor_bytes": sum(int(t.n_bytes) for t in reader.tensors),
        "step_bytes": sum(int(t.n_bytes) for t in reader.tensors if linear.match(t.name) or t.name == head),
        "expert_bytes": sum(int(t.n_bytes) for t in reader.tensors if t.name.endswith("_exps.weight")),
        "tensor_bytes_by_type": types,
    }


# -- 2. memory (child process) ---------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmRSS / RssAnon / RssFile of this process in bytes (empty where /proc is missing)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def memory_child(path: str, max_model_len: int, kv_bytes: int) -> None:
    import torch  # noqa: F401 - imported before the baseline, as the engine needs it anyway

    from pagellm import LLM

    before = proc_status()
    start = time.perf_counter()
    llm = LLM(path, dtype="bfloat16", max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes,
              max_num_seqs=32, disable_log_stats=True)  # fmt: skip
    load_s = time.perf_counter() - start
    gc.collect()
    after = proc_status()
    by_format = llm.engine.runner.model.weight_bytes_by_format()
    print("MEMORY " + json.dumps({"weight_bytes_by_format": by_format, "rss_before": before, "rss_after": after,
                                  "load_s": round(load_s, 2)}), flush=True)  # fmt: skip


def measure_memory(path: Path, max_model_len: int, kv_bytes: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--memory-child", str(path), str(max_model_len), str(kv_bytes)]
    proc = subprocess.run(command, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("MEMORY "):
            return json.loads(line.removeprefix("MEMORY "))
    print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
    return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}


# -- 3. speed ---------------------------------------------------------------------------------


def run_throughput(path: Path, backend: str, workload: list[str], result_file: Path) -> dict[str, Any]:
    """backend: pagellm (bf16 activations), pagellm-int8 (--int8-activations) or llamacpp;
    a pagellm backend ending in -msN runs with --num-scheduler-steps N."""
    backend, _, steps = backend.partition("-ms")
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "throughput", "--backend",
               backend.removesuffix("-int8"), "--model", str(path), "--check-requests", "0", *workload,
               "--result-file", str(result_file)]  # fmt: skip
    if backend.startswith("pagellm"):
        command += ["--dtype", "bfloat16"] + (["--int8-activations"] if backend == "pagellm-int8" else [])
        command += ["--num-scheduler-steps", steps] if steps else []
    else:
        parallel = workload[workload.index("--num-requests") + 1]
        command += ["--llamacpp-parallel", parallel]
    print("$", " ".join(command[1:]), flush=True)
    # `bench throughput` prints a table and appends its JSON record to --result-file: a
    # fresh file, so a failed run cannot hand back the previous run's record.
    result_file.unlink(missing_ok=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode == 0 and result_file.is_file():
        lines = result_file.read_text(encoding="utf-8").splitlines()
        if lines:
            record = json.loads(lines[-1])
            print(f"  -> {record['output_tok_s']} output tok/s", flush=True)
            return record
    print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
    return {"backend": backend, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}


# -- 4./5. report ------------------------------------------------------------------------------


def step_bytes_read(sizes: dict[str, Any], spec: dict[str, Any], streams: int) -> float:
    """Bytes of weights a decode step of `streams` tokens reads: everything but the experts,
    and of the experts the share some token is routed to (expected for uniform routing,
    1 - (1 - used/experts)^streams; the random routers spread tokens about uniformly)."""
    if not spec.get("experts"):
        return sizes["step_bytes"]
    untouched = (1 - spec["experts_used"] / spec["experts"]) ** streams
    return sizes["step_bytes"] - sizes["expert_bytes"] * untouched


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=DEFAULT_SHAPE["layers"])
    parser.add_argument("--hidden", type=int, default=DEFAULT_SHAPE["hidden"])
    parser.add_argument("--heads", type=int, default=DEFAULT_SHAPE["heads"])
    parser.add_argument("--kv-heads", type=int, default=DEFAULT_SHAPE["kv_heads"])
    parser.add_argument("--intermediate", type=int, default=DEFAULT_SHAPE["intermediate"])
    parser.add_argument("--vocab", type=int, default=DEFAULT_SHAPE["vocab"])
    parser.add_argument("--context", type=int, default=2048, help="the file's context length")
    parser.add_argument("--type", choices=TYPES[:2], default="Q4_0", help="type of the linear weights and embedding")
    parser.add_argument("--output-type", choices=TYPES, default=None, help="type of the LM head (default: --type)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--experts", type=int, default=0,
                        help="a mixture of experts: this many experts of --intermediate rows per layer (0: dense)")
    parser.add_argument("--experts-used", type=int, default=2, help="experts per token (with --experts)")
    parser.add_argument("--arch", choices=("llama", "qwen3moe"), default="llama",
                        help="the GGUF architecture with --experts: Mixtral's layout (llama) or Qwen3-MoE's (q/k norms)")
    parser.add_argument("--model-path", type=Path, default=None, help="the GGUF (default: /tmp/pagellm-bench/...)")
    parser.add_argument("--rewrite", action="store_true", help="write the GGUF even if a matching one exists")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--single-output-len", type=int, default=64)
    parser.add_argument("--single-repeats", type=int, default=3)
    parser.add_argument("--batch-requests", type=int, default=32)
    parser.add_argument("--batch-output-len", type=int, default=32)
    parser.add_argument("--batch-repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run a scenario's backends this many times in turn (median round; paired ratios)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("pagellm", "llamacpp", "memory"))
    parser.add_argument("--activations", nargs="+", choices=("bf16", "int8"), default=["bf16"],
                        help="pagellm's runs: bf16 activations (the default engine), and/or --int8-activations")
    parser.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1],
                        help="pagellm's runs with each of these --num-scheduler-steps (multi-step decoding)")
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="pagellm's KV cache in the memory check")
    parser.add_argument("--out", default="benchmarks/results/quant_1b.json")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child[0], int(args.memory_child[1]), int(args.memory_child[2]))
        return 0

    spec = model_spec(args)
    path = args.model_path or default_path(spec)
    cpu = cpu_info()
    print(f"CPU: {describe_cpu(cpu)}, {os.cpu_count()} cores")
    print(f"model: {spec['layers']} layers, hidden {spec['hidden']}, {spec['heads']} heads / {spec['kv_heads']} KV "
          f"heads, intermediate {spec['intermediate']}, vocab {spec['vocab']}; linear weights and token_embd "
          f"{spec['type']}, output (LM head) {spec['output_type']}, norms F32; weight RMS {WEIGHT_RMS}")  # fmt: skip
    existing = file_spec(path)
    llamacpp_check = "reused file (checked when written)"
    if existing == spec and not args.rewrite:
        print(f"reusing {path}")
    else:
        if path.exists():
            print(f"{path} exists with another shape/type: writing it again")
        write_gguf(path, spec)
        if "llamacpp" not in args.skip:
            try:
                llamacpp_check = check_llamacpp_loads(path)
            except BaseException:
                path.unlink()  # not reused by the next run
                raise
            print(llamacpp_check, flush=True)
    sizes = file_bytes(path)
    print(f"file: {gib(sizes['file_bytes'])}; tensors {gib(sizes['tensor_bytes'])}; "
          f"read per decode step (linear + LM head{', every expert' if spec.get('experts') else ''}) "
          f"{gib(sizes['step_bytes'])}", flush=True)  # fmt: skip

    import torch  # after the file is written (the writer needs none of it)

    from pagellm.metrics.ceilings import measure_bandwidth

    copy_bw = measure_bandwidth(seconds=1.0, megabytes=512)
    print(f"copy bandwidth (measure_bandwidth, read + write): {copy_bw / 1e9:.1f} GB/s; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads", flush=True)  # fmt: skip

    memory: dict[str, Any] = {}
    max_model_len = max(128, args.prompt_len + max(args.single_output_len, args.batch_output_len))
    if "memory" not in args.skip:
        memory = measure_memory(path, max_model_len, args.kv_cache_mib << 20)
        if "error" not in memory:
            weights = sum(memory["weight_bytes_by_format"].values())
            memory["weight_bytes"] = weights
            memory["ratio_to_tensor_bytes"] = round(weights / sizes["tensor_bytes"], 4)
            memory["meets_1_1x"] = weights <= 1.1 * sizes["tensor_bytes"]
            rss_after = memory["rss_after"].get("VmRSS")
            if rss_after:
                memory["rss_growth_bytes"] = rss_after - memory["rss_before"].get("VmRSS", 0)
                memory["rss_growth_ratio"] = round(memory["rss_growth_bytes"] / sizes["tensor_bytes"], 4)

    scenarios = {
        "single stream": (1, args.single_output_len, ["--workload", "fixed", "--num-requests", "1", "--prompt-len",
                          str(args.prompt_len), str(args.prompt_len), "--output-len", str(args.single_output_len),
                          str(args.single_output_len), "--repeats", str(args.single_repeats)]),
        f"{args.batch_requests} requests": (args.batch_requests, args.batch_output_len, ["--workload", "fixed",
                          "--num-requests", str(args.batch_requests), "--prompt-len", str(args.prompt_len),
                          str(args.prompt_len), "--output-len", str(args.batch_output_len),
                          str(args.batch_output_len), "--repeats", str(args.batch_repeats)]),
    }  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for scenario, (streams, _, workload) in scenarios.items():
            workload = [*workload, "--max-model-len", str(max_model_len)]
            pagellm_runs = [{"bf16": "pagellm", "int8": "pagellm-int8"}[a] + (f"-ms{n}" if n > 1 else "")
                            for a in args.activations for n in args.num_scheduler_steps]  # fmt: skip
            backends = [b for b in (*pagellm_runs, "llamacpp") if b.partition("-")[0] not in args.skip]
            rounds: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
            for _ in range(max(1, args.rounds)):
                for backend in backends:
                    rounds[backend].append(run_throughput(path, backend, workload, Path(tmp) / "r.jsonl"))
            for backend, records in rounds.items():
                run = {"scenario": scenario, "backend": backend, "streams": streams}
                done = sorted((r for r in records if "error" not in r), key=lambda r: r["output_tok_s"])
                if len(done) < len(records):
                    run["error"] = next(r["error"] for r in records if "error" in r)
                else:
                    record = done[(len(done) - 1) // 2]  # the median round (the lower of two)
                    steps = record["output_tok_s"] / streams
                    read = step_bytes_read(sizes, spec, streams)
                    run.update(output_tok_s=record["output_tok_s"], elapsed_s=record["elapsed_s"],
                               decode_steps_per_s=round(steps, 2), bytes_read_per_step=read,
                               achieved_gb_s=round(read * steps / 1e9, 2),
                               fraction_of_copy_bw=round(read * steps / copy_bw, 3),
                               settings=record["settings"])  # fmt: skip
                    if len(records) > 1:
                        run["rounds_output_tok_s"] = [r["output_tok_s"] for r in records]
                runs.append(run)
            reference = next((r for r in runs if r["scenario"] == scenario and r["backend"] == "llamacpp"), None)
            for run in runs:
                if run["scenario"] == scenario and run["backend"] != "llamacpp" and "rounds_output_tok_s" in run \
                        and reference and "rounds_output_tok_s" in reference:  # fmt: skip
                    ratios = [a / b for a, b in zip(run["rounds_output_tok_s"], reference["rounds_output_tok_s"])]
                    run["ratio_to_llamacpp_by_round"] = [round(r, 3) for r in ratios]
                    run["ratio_to_llamacpp"] = round(statistics.median(ratios), 3)

    # The table.
    print()
    print(f"CPU {describe_cpu(cpu)}, {os.cpu_count()} cores; {path.name}: {spec['type']} (LM head "
          f"{spec['output_type']}), {gib(sizes['step_bytes'])} read per decode step; copy bandwidth "
          f"{copy_bw / 1e9:.1f} GB/s")  # fmt: skip
    if memory:
        if "error" in memory:
            print(f"memory: pagellm failed to load: {memory['error']}")
        else:
            formats = ", ".join(f"{k} {gib(v)}" for k, v in memory["weight_bytes_by_format"].items())
            rss = memory["rss_after"]
            print(f"memory: pagellm weights {gib(memory['weight_bytes'])} ({formats}) = "
                  f"{memory['ratio_to_tensor_bytes']:.3f}x the file's tensor bytes {gib(sizes['tensor_bytes'])} "
                  f"(target <= 1.1x: {'met' if memory['meets_1_1x'] else 'NOT met'}); process RSS after load "
                  f"{gib(rss.get('VmRSS', 0))} (anon {gib(rss.get('RssAnon', 0))}, file {gib(rss.get('RssFile', 0))}), "
                  f"grew {gib(memory.get('rss_growth_bytes', 0))} = {memory.get('rss_growth_ratio', 0):.3f}x in the load")  # fmt: skip
    header = ("scenario", "backend", "output tok/s", "steps/s", "GB/s", "of copy bw", "pagellm / llama.cpp")
    rows = []
    by_key = {(r["scenario"], r["backend"]): r for r in runs}
    for r in runs:
        if "error" in r:
            rows.append((r["scenario"], r["backend"], f"failed: {r['error']}", "", "", "", ""))
            continue
        other = by_key.get((r["scenario"], "llamacpp"))
        ratio = ""
        if "ratio_to_llamacpp" in r:
            ratio = f"{r['ratio_to_llamacpp']:.2f}x (rounds {min(r['ratio_to_llamacpp_by_round']):.2f}-{max(r['ratio_to_llamacpp_by_round']):.2f}x)"
        elif r["backend"].startswith("pagellm") and other and "error" not in other:
            ratio = f"{r['output_tok_s'] / other['output_tok_s']:.2f}x"
        kind, _, steps = r["backend"].partition("-ms")
        name = {"pagellm": "pagellm bf16 (as stored)", "pagellm-int8": "pagellm int8 activations (as stored)",
                "llamacpp": "llama.cpp (GGUF as stored)"}[kind] + (f", {steps} steps per engine step" if steps else "")
        rows.append((r["scenario"], name, f"{r['output_tok_s']:.1f}", f"{r['decode_steps_per_s']:.1f}",
                     f"{r['achieved_gb_s']:.1f}", f"{100 * r['fraction_of_copy_bw']:.0f}%", ratio))  # fmt: skip
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, tuple("-" * w for w in widths), *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())

    result = {
        "bench": "quant_1b", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": cpu, "cores": os.cpu_count(),
        "torch": torch.__version__, "model": {"path": str(path), **spec}, "llamacpp_load_check": llamacpp_check,
        **sizes, "copy_bandwidth_gb_s": round(copy_bw / 1e9, 2), "memory": memory, "runs": runs,
    }  # fmt: skip
    print(json.dumps(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in runs) and "error" not in memory else 1


if __name__ == "__main__":
    sys.exit(main())
