"""GPU check (issue 8, item 5): correctness and speed of pagellm on one NVIDIA GPU.

One script, under 8 minutes on an H200 with no network access, run in sections:

1. gpu tests       `pytest -m gpu tests/` in a subprocess
2. kernel checks   Triton attention vs the PyTorch reference (float32/float64) at real
                   head shapes, mixed batches and a long-context split-K decode
3. equality        greedy float32 tokens of pagellm (chunked prefill, preemption, prefix
                   caching) vs HF transformers `generate`, on a random-weight checkpoint
4. throughput      pagellm vs HF `generate` on a Llama-3-8B-shaped model (random bf16
                   weights), same workload; HF measured on one batch per batch size
5. bandwidth       device copy bandwidth, and the Triton decode kernel's achieved
                   bandwidth reading the KV cache
6. roofline        a large decode step of the engine vs max(bytes / copy bandwidth,
                   FLOPs / measured bf16 matmul rate)

Each section is guarded (a failure is a FAILED row, the others still run) and timed; a
global deadline skips the sections whose budget no longer fits. The end is one table
(check | result | target | met) and a JSON file with every figure and the environment.

    benchmarks/gpu_check.sh                       # on the GPU machine
    python benchmarks/gpu_check.py --smoke        # the plumbing on CPU, tiny shapes
    python benchmarks/gpu_check.py --sections kernels,bandwidth --out /tmp/x.json

--smoke (or a machine without an NVIDIA driver) runs the Triton kernels under Triton's
interpreter on CPU tensors; its figures say nothing about speed. Results go to
benchmarks/results/gpu_check.json (smoke: the temp dir; --out overrides) and, when $OUT
is set, to $OUT/gpu_check.json too. The exit status is 0 when every section ran to its
end (whether or not it met its target), 1 when one failed or was skipped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Triton reads TRITON_INTERPRET when a kernel is defined, so it must be set before
# anything imports Triton (torch included, which may pull it in).
if "--smoke" in sys.argv or not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
for _path in (REPO_ROOT, REPO_ROOT / "tests"):  # pagellm, and tests/paged_steps.py
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from pagellm.bench.synthetic_model import SHAPES  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "gpu_check.json"
# A smoke run must not overwrite a GPU run's results.
DEFAULT_SMOKE_OUT = Path(tempfile.gettempdir()) / "gpu_check_smoke.json"
SECTION_NAMES = ("gpu_tests", "kernels", "equality", "throughput", "bandwidth", "roofline")
SECTION_TITLES = {
    "gpu_tests": "gpu tests",
    "kernels": "kernel checks",
    "equality": "greedy equality vs HF",
    "throughput": "throughput vs HF generate",
    "bandwidth": "decode kernel bandwidth",
    "roofline": "decode step vs roofline",
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class CheckConfig:
    """Every size the sections use; `gpu_config` and `smoke_config` fill it."""

    smoke: bool
    device: str
    deadline_s: float  # the whole run
    budgets_s: dict[str, float]  # a section is skipped when less than this remains
    # 1. gpu tests
    pytest_timeout_s: float
    # 2. kernel checks: name -> (num_heads, num_kv_heads, head_dim)
    kernel_shapes: dict[str, tuple[int, int, int]]
    block_size: int
    mixed_decode_contexts: tuple[int, ...]
    mixed_prefills: tuple[tuple[int, int], ...]  # (new tokens, cached tokens before them)
    long_decode: tuple[int, int]  # (requests, context tokens each)
    # 3. equality
    equality_shape: dict[str, Any]
    equality_prompt_lens: tuple[int, ...]
    equality_shared_prefix: int
    equality_suffix_lens: tuple[int, ...]
    equality_max_tokens: int
    equality_max_model_len: int
    equality_num_blocks: int  # small enough to force preemption
    # 4. throughput
    throughput_shape: str  # a SHAPES preset
    throughput_dtype: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    hf_batch_sizes: tuple[int, ...]  # tried largest first
    hf_budget_s: float
    max_model_len: int
    kv_cache_bytes: int
    max_num_batched_tokens: int
    # 5. bandwidth
    copy_bytes: int  # source tensor size
    decode_bench_heads: tuple[int, int, int]
    decode_bench: tuple[int, int]  # (requests, context tokens each)
    # 6. roofline
    roofline_batch: int
    roofline_context: int
    roofline_steps: int
    matmul_size: int


GiB = 1 << 30


def gpu_config(deadline_s: float = 455.0) -> CheckConfig:
    return CheckConfig(
        smoke=False,
        device="cuda",
        deadline_s=deadline_s,
        budgets_s={"gpu_tests": 95, "kernels": 40, "equality": 50, "throughput": 190, "bandwidth": 15, "roofline": 40},
        pytest_timeout_s=90,
        kernel_shapes={"llama-3-8b": (32, 8, 128), "smollm2": (9, 3, 64)},
        block_size=16,
        mixed_decode_contexts=(1, 17, 300, 1000, 2500, 4097),
        mixed_prefills=((100, 0), (257, 512), (600, 1200), (333, 37)),
        long_decode=(2, 16384),
        equality_shape=dict(
            vocab_size=2048,
            hidden_size=1024,
            intermediate_size=2048,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,  # head_dim 128, 4 query heads per KV head
            max_position_embeddings=1024,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
        equality_prompt_lens=(1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 65, 100, 127, 150, 199, 256, 300),
        equality_shared_prefix=80,
        equality_suffix_lens=(1, 5, 16, 20, 33, 48, 70),
        equality_max_tokens=32,
        equality_max_model_len=512,
        equality_num_blocks=40,  # 39 usable blocks of 16 for 24 requests of up to 332 tokens
        throughput_shape="llama-3-8b",
        throughput_dtype="bfloat16",
        num_requests=300,
        prompt_len=(64, 1024),
        output_len=(64, 512),
        hf_batch_sizes=(256, 128, 64, 16),
        hf_budget_s=110,
        max_model_len=2048,
        kv_cache_bytes=48 * GiB,
        max_num_batched_tokens=8192,
        copy_bytes=2 * GiB,
        decode_bench_heads=(32, 8, 128),
        decode_bench=(64, 4096),
        roofline_batch=256,
        roofline_context=512,
        roofline_steps=32,
        matmul_size=8192,
    )


def smoke_config(deadline_s: float = 600.0) -> CheckConfig:
    """Tiny shapes on CPU: every section's plumbing in a few minutes on 2 cores."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return CheckConfig(
        smoke=True,
        device="cpu" if interpreted or not torch.cuda.is_available() else "cuda",
        deadline_s=deadline_s,
        budgets_s={"gpu_tests": 60, "kernels": 20, "equality": 30, "throughput": 60, "bandwidth": 15, "roofline": 20},
        pytest_timeout_s=90,
        kernel_shapes={"tiny": (4, 2, 16)},
        block_size=16,
        mixed_decode_contexts=(1, 17, 40),
        mixed_prefills=((20, 0), (33, 30)),
        long_decode=(2, 600),
        equality_shape=SHAPES["tiny"],
        equality_prompt_lens=(1, 3, 16, 17, 40),
        equality_shared_prefix=20,
        equality_suffix_lens=(1, 5, 9),
        equality_max_tokens=16,
        equality_max_model_len=96,
        equality_num_blocks=8,  # 7 usable blocks of 16 for 8 requests of up to 56 tokens
        throughput_shape="tiny",
        throughput_dtype="float32",
        num_requests=12,
        prompt_len=(8, 40),
        output_len=(4, 16),
        hf_batch_sizes=(8, 4),
        hf_budget_s=20,
        max_model_len=128,
        kv_cache_bytes=64 << 20,
        max_num_batched_tokens=256,
        copy_bytes=64 << 20,
        decode_bench_heads=(4, 2, 16),
        decode_bench=(4, 256),
        roofline_batch=4,
        roofline_context=32,
        roofline_steps=6,
        matmul_size=512,
    )


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    check: str
    result: str
    target: str = ""
    met: bool | None = None  # None: informational


@dataclass
class SectionOutput:
    """What a section reports; filled as it goes, so a failure keeps what came before."""

    name: str
    status: str = "ok"  # ok | FAILED | SKIPPED
    wall_s: float = 0.0
    rows: list[Row] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def row(self, check: str, result: str, target: str = "", met: bool | None = None) -> None:
        self.rows.append(Row(check, result, target, met))


Context = dict[str, Any]  # state handed from one section to the next (engine, ceilings)


def _device(cfg: CheckConfig) -> torch.device:
    return torch.device(cfg.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def median_seconds(fn: Callable[[], object], device: torch.device, calls: int = 10, rounds: int = 5) -> float:
    """Median over `rounds` of the mean time of `calls` back-to-back calls of fn.

    On CUDA the calls are queued between two events: the GPU never waits for Python to
    launch the next one, so launch overhead does not count against a kernel that runs
    longer than its launch.
    """
    fn()  # warm-up (and compilation)
    _sync(device)
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - begin) / calls)
    return statistics.median(times)


def _gb_per_s(bytes_per_s: float) -> str:
    gb = bytes_per_s / 1e9
    return f"{gb:,.0f} GB/s" if gb >= 100 else f"{gb:.3g} GB/s"


def measure_copy_bandwidth(num_bytes: int, device: torch.device) -> float:
    """Bytes/s of dst.copy_(src) for a bf16 tensor of num_bytes (read + write counted)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, calls=5, rounds=7)
    return 2.0 * num_bytes / seconds


# --------------------------------------------------------------------------- 1. gpu tests


def section_gpu_tests(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/"]
    out.figures["command"] = " ".join(command[1:])
    try:
        proc = subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=cfg.pytest_timeout_s
        )
    except subprocess.TimeoutExpired:
        out.row("pytest -m gpu", f"timed out after {cfg.pytest_timeout_s:.0f} s", "all pass", False)
        return
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    out.figures["output_tail"] = tail[-30:]
    counts = {kind: 0 for kind in ("passed", "failed", "errors", "skipped", "deselected")}
    summary = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed|skipped|deselected|error)", line)), "")
    for number, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary):
        counts["errors" if kind.startswith("error") else kind] = int(number)
    out.figures.update(counts, returncode=proc.returncode)
    bad = counts["failed"] + counts["errors"]
    result = f"{counts['passed']} passed, {bad} failed, {counts['skipped']} skipped"
    # rc 5: nothing collected; with no GPU every gpu test is skipped, which is not a pass.
    out.row("pytest -m gpu", result, "all pass, >0 ran", bad == 0 and counts["passed"] > 0 and proc.returncode == 0)


# --------------------------------------------------------------------------- 2. kernel checks


def kernel_steps(cfg: CheckConfig) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query_lens, context_lens) of the steps the kernels are checked on."""
    mixed_q = [1] * len(cfg.mixed_decode_contexts) + [q for q, _ in cfg.mixed_prefills]
    mixed_ctx = list(cfg.mixed_decode_contexts) + [q + cached for q, cached in cfg.mixed_prefills]
    requests, context = cfg.long_decode
    # Lengths a little apart so the split boundaries differ between requests.
    long_ctx = [context - 97 * i for i in range(requests)]
    return {"mixed": (mixed_q, mixed_ctx), f"decode {requests}x{context}": ([1] * requests, long_ctx)}


def check_kernel_step(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    context_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> dict[str, Any]:
    """Run one random step through the Triton backend and the reference; the figures."""
    from paged_steps import random_step

    from pagellm.attention.backend import AttentionMetadata
    from pagellm.attention.torch_backend import TorchAttentionBackend
    from pagellm.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(seed)
    q, k, v, cache, metadata = random_step(
        gen, num_heads, num_kv_heads, head_dim, block_size, query_lens, context_lens, dtype
    )
    slots, tables = metadata.slot_mapping.to(device), metadata.block_tables.to(device)

    def fresh_metadata() -> AttentionMetadata:
        return AttentionMetadata(slots, tables, metadata.query_start_loc, metadata.seq_lens)

    q, k, v, cache = (x.to(device) for x in (q, k, v, cache))
    scale = head_dim**-0.5
    backend = TritonAttentionBackend()
    kernel_metadata = fresh_metadata()
    plan = backend.plan(kernel_metadata, num_heads, num_kv_heads, head_dim, device)
    kernel_metadata.backend_plan = plan
    kernel_cache = cache.clone()
    actual = backend.forward(q, k, v, kernel_cache, kernel_metadata, scale)
    # The reference sees the same (rounded) inputs, computed in a wider type.
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    reference_cache = cache.to(wide)
    expected = TorchAttentionBackend().forward(
        q.to(wide), k.to(wide), v.to(wide), reference_cache, fresh_metadata(), scale
    )
    error = float((actual.to(wide) - expected).norm() / expected.norm())
    return {
        "rel_error": error,
        "has_nan": bool(torch.isnan(actual).any()),
        "cache_equal": bool(torch.equal(kernel_cache.to(wide), reference_cache)),
        "num_splits": max(launch.num_splits for launch in plan.launches),
        "num_tokens": int(q.shape[0]),
        "reference_dtype": str(wide).removeprefix("torch."),
    }


def section_kernels(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    device = _device(cfg)
    tolerances = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
    for shape_name, (heads, kv_heads, head_dim) in cfg.kernel_shapes.items():
        for step_index, (step_name, (query_lens, context_lens)) in enumerate(kernel_steps(cfg).items()):
            for dtype, tolerance in tolerances.items():
                dtype_name = str(dtype).removeprefix("torch.")
                label = f"{shape_name} {step_name} {dtype_name}"
                figures = check_kernel_step(
                    heads, kv_heads, head_dim, cfg.block_size, query_lens, context_lens, dtype,
                    device, seed=1000 * step_index + heads,
                )  # fmt: skip
                out.figures[label] = figures
                met = figures["rel_error"] < tolerance and not figures["has_nan"] and figures["cache_equal"]
                notes = "" if figures["cache_equal"] else ", cache differs"
                notes += ", NaN" if figures["has_nan"] else ""
                out.row(f"attn {label}", f"rel err {figures['rel_error']:.2e}{notes}", f"< {tolerance:g}", met)
                if step_name.startswith("decode") and dtype == torch.bfloat16:
                    splits = figures["num_splits"]
                    out.row(f"attn {shape_name} {step_name} split-K", f"num_splits={splits}", "> 1", splits > 1)
                _free_memory(device)


# --------------------------------------------------------------------------- 3. equality


def equality_prompts(cfg: CheckConfig, vocab_size: int) -> list[list[int]]:
    rng = random.Random(8)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    prompts = [tokens(n) for n in cfg.equality_prompt_lens]
    shared = tokens(cfg.equality_shared_prefix)
    prompts += [shared + tokens(n) for n in cfg.equality_suffix_lens]
    return prompts


def load_hf_float32(folder: Path, device: torch.device) -> Any:
    import transformers

    # Recent transformers load in the checkpoint's dtype (float32 here); older ones in
    # float32 by default. Either way the cast below is exact.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model = model.to(device=device, dtype=torch.float32).eval()
    _generate_to_length(model)
    return model


def _generate_to_length(model: Any) -> None:
    """HF generate runs to max_new_tokens (pagellm's ignore_eos) and pads with id 0."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0


@torch.inference_mode()
def hf_greedy_each(model: Any, prompts: list[list[int]], max_new_tokens: int, device: torch.device) -> list[list[int]]:
    """HF greedy tokens, one prompt at a time (no padding anywhere)."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        generated = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def section_equality(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    from pagellm import LLM, SamplingParams
    from pagellm.bench.synthetic_model import write_synthetic_checkpoint

    device = _device(cfg)
    folder = write_synthetic_checkpoint(Path(ctx["tmp"]) / "equality", shape=cfg.equality_shape, with_weights=True, seed=11)
    prompts = equality_prompts(cfg, cfg.equality_shape["vocab_size"])
    new_tokens = cfg.equality_max_tokens
    started = time.perf_counter()
    hf = load_hf_float32(folder, device)
    expected = hf_greedy_each(hf, prompts, new_tokens, device)
    out.figures["hf_seconds"] = round(time.perf_counter() - started, 2)
    del hf
    _free_memory(device)

    started = time.perf_counter()
    llm = LLM(
        str(folder),
        dtype="float32",
        device=cfg.device,
        max_model_len=cfg.equality_max_model_len,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=cfg.equality_num_blocks,
        enable_prefix_caching=True,
        disable_log_stats=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    out.figures["pagellm_seconds"] = round(time.perf_counter() - started, 2)
    actual = [list(o.outputs[0].token_ids) for o in outputs]
    out.figures["pagellm_engine"] = engine_settings(llm)
    # TF32 matmuls would make float32 equality a matter of luck: say whether they were on.
    out.figures["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
    stats = llm.engine.get_stats()
    preemptions = stats.num_preemptions_recompute + stats.num_preemptions_swap
    hits_in_batch = stats.num_prefix_hit_tokens
    # The shared-prefix prompts once more: now their prefix blocks are cached for sure.
    shared = list(range(len(cfg.equality_prompt_lens), len(prompts)))
    again = llm.generate([{"prompt_token_ids": prompts[i]} for i in shared], params, use_tqdm=False)
    again_equal = sum(list(o.outputs[0].token_ids) == expected[i] for o, i in zip(again, shared, strict=True))
    hits_again = llm.engine.get_stats().num_prefix_hit_tokens - hits_in_batch
    num_equal = sum(a == e for a, e in zip(actual, expected, strict=True))
    # Where each differing sequence first departs from HF (a near-tie shows up late).
    first_diffs = {
        i: next((j for j, (a, e) in enumerate(zip(actual[i], expected[i], strict=False)) if a != e), min(len(actual[i]), len(expected[i])))
        for i in range(len(prompts))
        if actual[i] != expected[i]
    }
    out.figures.update(
        num_sequences=len(prompts),
        num_equal=num_equal,
        first_difference_at=first_diffs,
        prompt_lens=[len(p) for p in prompts],
        preemptions=preemptions,
        prefix_hit_tokens=hits_in_batch,
        second_pass_sequences=len(shared),
        second_pass_equal=again_equal,
        second_pass_prefix_hit_tokens=hits_again,
        shape=cfg.equality_shape,
    )
    del llm
    _free_memory(device)
    out.row(
        f"greedy tokens equal (float32, {new_tokens} new)", f"{num_equal}/{len(prompts)} sequences", "all",
        num_equal == len(prompts),
    )  # fmt: skip
    out.row("  preemptions in that run", str(preemptions), "> 0", preemptions > 0)
    out.row("  prefix-cache hit tokens in that run", str(hits_in_batch), "", None)
    out.row(
        "  shared-prefix prompts again, from the cache", f"{again_equal}/{len(shared)} equal, {hits_again} hit tokens",
        "all, > 0 hits", again_equal == len(shared) and hits_again > 0,
    )  # fmt: skip


# --------------------------------------------------------------------------- 4. throughput


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def throughput_workload(cfg: CheckConfig, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            [rng.randrange(3, vocab_size) for _ in range(rng.randint(*cfg.prompt_len))],
            rng.randint(*cfg.output_len),
        )
        for _ in range(cfg.num_requests)
    ]


def hf_random_model(shape: dict[str, Any], dtype: torch.dtype, device: torch.device) -> Any:
    """An HF Llama of `shape` with random weights, built directly on the device in dtype
    (no float32 copy, no checkpoint: 16 GB of 8B weights never touch the disk)."""
    import transformers

    from pagellm.bench.synthetic_model import llama_config

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(llama_config(shape))
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    model.eval()
    _generate_to_length(model)
    return model


@torch.inference_mode()
def hf_generate_batch(model: Any, batch: list[BenchRequest], device: torch.device) -> float:
    """One static HF batch, left-padded, run to its longest requested output; seconds."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - n :] = 1
    new_tokens = max(r.output_len for r in batch)
    ids, mask = ids.to(device), mask.to(device)
    _sync(device)
    started = time.perf_counter()
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    _sync(device)
    elapsed = time.perf_counter() - started
    if generated.shape[1] - width != new_tokens:
        raise RuntimeError(f"HF generated {generated.shape[1] - width} tokens, {new_tokens} were asked for")
    return elapsed


def hf_sweep(
    model: Any, requests: list[BenchRequest], batch_sizes: tuple[int, ...], budget_s: float, device: torch.device
) -> list[dict[str, Any]]:
    """HF useful output tokens/s per batch size, each timed on one batch.

    Requests are sorted by prompt length (less padding: the best a static batcher can
    do without knowing output lengths); the batch of consecutive requests around the
    median length stands for the workload. Only requested tokens count as output.
    """
    ordered = sorted(requests, key=lambda r: len(r.prompt_token_ids))
    hf_generate_batch(model, [BenchRequest(ordered[0].prompt_token_ids, 4)] * 2, device)  # warm-up
    sweep: list[dict[str, Any]] = []
    started = time.perf_counter()
    last_elapsed = 0.0
    for batch_size in batch_sizes:
        spent = time.perf_counter() - started
        # Smaller batches take about as many decode steps, so about as long.
        if spent + last_elapsed > budget_s:
            sweep.append({"batch_size": batch_size, "skipped": "HF time budget"})
            continue
        first = max(0, (len(ordered) - batch_size) // 2)
        batch = ordered[first : first + batch_size]
        try:
            elapsed = hf_generate_batch(model, batch, device)
        except torch.cuda.OutOfMemoryError as e:
            sweep.append({"batch_size": batch_size, "skipped": f"out of memory: {str(e)[:80]}"})
            elapsed = None
        if elapsed is None:  # out of the except block, whose traceback held the activations
            _free_memory(device)
            continue
        last_elapsed = elapsed
        useful = sum(r.output_len for r in batch)
        sweep.append(
            {
                "batch_size": batch_size,
                "num_requests": len(batch),
                "elapsed_s": round(elapsed, 3),
                "output_tokens": useful,
                "generated_tokens": len(batch) * max(r.output_len for r in batch),
                "output_tok_s": useful / elapsed,
            }
        )
    return sweep


def make_throughput_engine(cfg: CheckConfig, folder: Path) -> Any:
    from pagellm import LLM

    return LLM(
        str(folder),
        load_format="dummy",
        dtype=cfg.throughput_dtype,
        device=cfg.device,
        max_num_seqs=256,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        kv_cache_memory_bytes=cfg.kv_cache_bytes,
        disable_log_stats=True,
    )


def engine_settings(llm: Any) -> dict[str, Any]:
    """What kind of engine ran: attention backend, CUDA graphs, cache size."""
    engine = llm.engine
    runner = engine.runner
    backend = getattr(getattr(runner, "model", None), "backend", None)
    return {
        "attention_backend": getattr(backend, "name", None),
        "decode_cuda_graphs": getattr(runner, "decode_graphs", None) is not None,
        "num_gpu_blocks": engine.config.cache_config.num_gpu_blocks,
        "max_num_batched_tokens": engine.config.scheduler_config.max_num_batched_tokens,
    }


def _throughput_folder(cfg: CheckConfig, ctx: Context) -> Path:
    from pagellm.bench.synthetic_model import write_synthetic_checkpoint

    if "throughput_folder" not in ctx:
        shape = SHAPES[cfg.throughput_shape]
        ctx["throughput_folder"] = write_synthetic_checkpoint(
            Path(ctx["tmp"]) / cfg.throughput_shape, shape=shape, with_weights=False
        )
    return ctx["throughput_folder"]


def section_throughput(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    from pagellm import SamplingParams

    device = _device(cfg)
    dtype = _DTYPES[cfg.throughput_dtype]
    shape = SHAPES[cfg.throughput_shape]
    folder = _throughput_folder(cfg, ctx)
    requests = throughput_workload(cfg, shape["vocab_size"])
    useful = sum(r.output_len for r in requests)
    out.figures.update(
        model=cfg.throughput_shape,
        dtype=cfg.throughput_dtype,
        num_requests=len(requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        output_tokens=useful,
    )

    # HF first, then freed, so that the two never hold GPU memory at the same time.
    started = time.perf_counter()
    hf = hf_random_model(shape, dtype, device)
    out.figures["hf_build_s"] = round(time.perf_counter() - started, 2)
    try:
        sweep = hf_sweep(hf, requests, cfg.hf_batch_sizes, cfg.hf_budget_s, device)
    finally:
        del hf
        _free_memory(device)
    out.figures["hf_sweep"] = sweep
    timed = [s for s in sweep if "output_tok_s" in s]
    if not timed:
        raise RuntimeError(f"no HF batch size could be timed: {sweep}")
    best = max(timed, key=lambda s: s["output_tok_s"])
    out.figures["hf_best_batch_size"] = best["batch_size"]
    out.figures["hf_output_tok_s"] = best["output_tok_s"]

    started = time.perf_counter()
    llm = make_throughput_engine(cfg, folder)
    ctx["llm"] = llm
    out.figures["pagellm_build_s"] = round(time.perf_counter() - started, 2)
    out.figures["pagellm_engine"] = engine_settings(llm)

    def params(r: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)

    # Warm-up compiles the kernels for prefill and decode outside the timed run.
    warm = [BenchRequest(r.prompt_token_ids, 8) for r in requests[:4]]
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in warm], [params(r) for r in warm], use_tqdm=False)
    llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
    before = llm.engine.get_stats()
    steps_before = llm.engine.num_steps
    _sync(device)
    started = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in requests], [params(r) for r in requests], use_tqdm=False
    )
    _sync(device)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    after = llm.engine.get_stats()
    if produced != useful:
        raise RuntimeError(f"pagellm produced {produced} tokens, {useful} were asked for")
    pagellm_tok_s = produced / elapsed
    ratio = pagellm_tok_s / best["output_tok_s"]
    out.figures.update(
        pagellm_elapsed_s=round(elapsed, 3),
        pagellm_output_tok_s=pagellm_tok_s,
        pagellm_steps=llm.engine.num_steps - steps_before,
        pagellm_preemptions=(after.num_preemptions_recompute + after.num_preemptions_swap)
        - (before.num_preemptions_recompute + before.num_preemptions_swap),
        ratio=ratio,
    )
    out.row(
        f"pagellm output tok/s ({len(requests)} reqs)", f"{pagellm_tok_s:,.0f} in {elapsed:.3g} s", "", None
    )
    out.row(
        f"HF generate tok/s (batch {best['batch_size']}, 1 batch timed)", f"{best['output_tok_s']:,.0f}", "", None
    )
    out.row("throughput pagellm / HF", f"{ratio:.2f}x", ">= 5x", ratio >= 5.0)


# --------------------------------------------------------------------------- 5. bandwidth


def decode_batch(
    num_requests: int,
    context: int,
    heads: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """A decode-only step built on the device: every request one new token at the end of
    `context` tokens whose blocks are scattered over the cache."""
    from pagellm.attention.backend import AttentionMetadata

    num_heads, num_kv_heads, head_dim = heads
    blocks_per_request = -(-context // block_size)
    num_blocks = num_requests * blocks_per_request + 1  # block 0 is the null block
    cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device).normal_()
    tables = (torch.randperm(num_blocks - 1, device=device) + 1).view(num_requests, blocks_per_request)
    last = context - 1
    slots = tables[:, last // block_size] * block_size + last % block_size
    metadata = AttentionMetadata(
        slot_mapping=slots.to(torch.int64),
        block_tables=tables.to(torch.int64),
        query_start_loc=list(range(num_requests + 1)),
        seq_lens=[context] * num_requests,
    )
    q = torch.randn(num_requests, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_requests, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(num_requests, num_kv_heads, head_dim, device=device).to(dtype)
    return q, k, v, cache, metadata


def time_decode_attention(
    num_requests: int, context: int, heads: tuple[int, int, int], block_size: int, device: torch.device
) -> tuple[float, int]:
    """Seconds of one bf16 decode-attention forward (store + kernels, planned once as the
    engine does per step) over a random batch; and the plan's split count."""
    from pagellm.attention.triton_backend import TritonAttentionBackend

    num_heads, num_kv_heads, head_dim = heads
    q, k, v, cache, metadata = decode_batch(num_requests, context, heads, block_size, torch.bfloat16, device)
    backend = TritonAttentionBackend()
    metadata.backend_plan = backend.plan(metadata, num_heads, num_kv_heads, head_dim, device)
    scale = head_dim**-0.5
    seconds = median_seconds(lambda: backend.forward(q, k, v, cache, metadata, scale), device)
    return seconds, max(launch.num_splits for launch in metadata.backend_plan.launches)


def section_bandwidth(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    device = _device(cfg)
    copy_bw = measure_copy_bandwidth(cfg.copy_bytes, device)
    ctx["copy_bw"] = copy_bw
    out.figures["copy_bytes"] = cfg.copy_bytes
    out.figures["copy_bytes_per_s"] = copy_bw
    out.row(f"copy bandwidth ({cfg.copy_bytes / GiB:g} GiB bf16)", _gb_per_s(copy_bw), "", None)
    _free_memory(device)

    num_requests, context = cfg.decode_bench
    num_heads, num_kv_heads, head_dim = cfg.decode_bench_heads
    seconds, num_splits = time_decode_attention(num_requests, context, cfg.decode_bench_heads, cfg.block_size, device)
    _free_memory(device)
    kv_bytes = num_requests * context * 2 * num_kv_heads * head_dim * 2
    achieved = kv_bytes / seconds
    fraction = achieved / copy_bw
    out.figures.update(
        decode_requests=num_requests,
        decode_context=context,
        decode_heads=cfg.decode_bench_heads,
        decode_num_splits=num_splits,
        decode_seconds=seconds,
        decode_kv_bytes=kv_bytes,
        decode_bytes_per_s=achieved,
        fraction_of_copy=fraction,
    )
    out.row(
        f"decode attention {num_requests}x{context} ({num_heads}/{num_kv_heads}x{head_dim}) bf16",
        f"{seconds * 1e3:.3f} ms, {_gb_per_s(achieved)}",
        "",
        None,
    )
    out.row("  decode attention / copy bandwidth", f"{fraction:.0%}", ">= 70%", fraction >= 0.70)


# --------------------------------------------------------------------------- 6. roofline


def section_roofline(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    from pagellm import SamplingParams
    from pagellm.metrics.ceilings import measure_matmul_ceiling
    from pagellm.metrics.utilization import StepWork, step_cost
    from pagellm.model.costs import ModelCosts

    device = _device(cfg)
    dtype = _DTYPES[cfg.throughput_dtype]
    if "copy_bw" not in ctx:
        ctx["copy_bw"] = measure_copy_bandwidth(cfg.copy_bytes, device)
    copy_bw = ctx["copy_bw"]
    matmul_flops = measure_matmul_ceiling(dtype, seconds=1.0, size=cfg.matmul_size, device=device) * 1e9
    out.figures.update(copy_bytes_per_s=copy_bw, matmul_flops_per_s=matmul_flops)
    out.row(f"matmul ceiling ({cfg.throughput_dtype}, {cfg.matmul_size}^2)", f"{matmul_flops / 1e12:,.1f} TFLOP/s", "", None)

    if "llm" not in ctx:
        ctx["llm"] = make_throughput_engine(cfg, _throughput_folder(cfg, ctx))
    engine = ctx["llm"].engine
    leftover = list(engine.output_processor.states)
    if leftover:  # an earlier section stopped mid-run
        engine.abort_request(leftover)
    costs = ModelCosts.from_config(engine.model_config, dtype_bytes=dtype.itemsize)
    rng = random.Random(6)
    vocab = engine.model_config.vocab_size
    batch, context = cfg.roofline_batch, cfg.roofline_context
    # Enough output that the timed decode steps come after every prefill.
    prefill_steps = -(-batch * context // cfg.max_num_batched_tokens)
    max_tokens = cfg.roofline_steps + 8 + 2 * prefill_steps
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request_ids = [
        engine.add_request(f"roofline-{i}", [rng.randrange(3, vocab) for _ in range(context)], params)
        for i in range(batch)
    ]
    samples: list[dict[str, float]] = []
    try:
        for _ in range(10 * max_tokens):
            if len(samples) >= cfg.roofline_steps + 2 or not engine.has_unfinished_requests():
                break
            running = engine.scheduler.running
            all_decoding = len(running) == batch and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
            if not all_decoding:
                engine.step()  # prefill (or a straggler) still in progress
                continue
            seq_lens = [r.num_tokens for r in running]
            cost = step_cost(costs, StepWork.from_batch([1] * batch, seq_lens, batch))
            _sync(device)
            started = time.perf_counter()
            engine.step()  # returns after the sampled tokens reached the host
            seconds = time.perf_counter() - started
            samples.append({"seconds": seconds, "bytes": cost.bytes, "flops": cost.flops, "mean_context": sum(seq_lens) / batch})
    finally:
        engine.abort_request(request_ids)
    samples = samples[2:]  # the first pure-decode steps may still warm caches
    if not samples:
        raise RuntimeError("no decode step of the full batch was timed")
    for s in samples:
        s["memory_s"] = s["bytes"] / copy_bw
        s["compute_s"] = s["flops"] / matmul_flops
        s["roofline_s"] = max(s["memory_s"], s["compute_s"])
        s["ratio"] = s["seconds"] / s["roofline_s"]
    step_s = statistics.median(s["seconds"] for s in samples)
    ratio = statistics.median(s["ratio"] for s in samples)
    middle = samples[len(samples) // 2]
    bound = "memory" if middle["memory_s"] >= middle["compute_s"] else "compute"
    out.figures.update(
        batch=batch,
        context=context,
        num_steps_timed=len(samples),
        step_seconds_median=step_s,
        roofline_seconds=middle["roofline_s"],
        memory_seconds=middle["memory_s"],
        compute_seconds=middle["compute_s"],
        bound=bound,
        ratio_median=ratio,
        samples=samples,
    )
    out.row(
        f"decode step {batch} reqs x ~{context} ctx",
        f"{step_s * 1e3:.2f} ms (roofline {middle['roofline_s'] * 1e3:.2f} ms, {bound})",
        "",
        None,
    )
    out.row("  measured / roofline", f"{ratio:.2f}", "<= 1.5", ratio <= 1.5)


# --------------------------------------------------------------------------- driver

SECTIONS: dict[str, Callable[[CheckConfig, Context, SectionOutput], None]] = {
    "gpu_tests": section_gpu_tests,
    "kernels": section_kernels,
    "equality": section_equality,
    "throughput": section_throughput,
    "bandwidth": section_bandwidth,
    "roofline": section_roofline,
}


class SectionTimeout(Exception):
    """Raised (by SIGALRM) in a section that ran past its hard limit."""


class Terminated(Exception):
    """Raised (by SIGTERM, e.g. from `timeout`) so the table is still printed."""


def _on_alarm(signum: int, frame: object) -> None:
    raise SectionTimeout("ran past its time limit")


def _on_term(signum: int, frame: object) -> None:
    raise Terminated("terminated (SIGTERM)")


RESERVE_S = 10.0  # kept back from the deadline for the table and the JSON file


def run_section(name: str, cfg: CheckConfig, ctx: Context, remaining_s: float) -> SectionOutput:
    """One section, guarded and timed; skipped when its budget no longer fits.

    The section may run to twice its budget, never past the deadline: a SIGALRM then
    ends it (Python handles the signal between bytecodes, so a section stuck inside one
    long C call overruns by that call).
    """
    out = SectionOutput(name)
    budget = cfg.budgets_s[name]
    if remaining_s < budget:
        out.status = "SKIPPED"
        out.error = f"time: {remaining_s:.0f} s left, the section needs {budget:.0f} s"
        out.row(SECTION_TITLES[name], "SKIPPED: time", "", None)
        return out
    limit = max(1.0, min(2.0 * budget, remaining_s - RESERVE_S))
    alarm = ctx.get("use_alarm", False)
    started = time.perf_counter()
    try:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, limit)
        SECTIONS[name](cfg, ctx, out)
    except Exception as e:  # noqa: BLE001 - the next sections must still run
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.status = "FAILED"
        if isinstance(e, SectionTimeout):
            out.error = f"SectionTimeout: stopped after {limit:.0f} s (budget {budget:.0f} s)"
        else:
            out.error = f"{type(e).__name__}: {e}"
        if isinstance(e, Terminated):
            ctx["terminated"] = True
        # An engine stopped mid-step may be inconsistent: a later section builds its own.
        ctx.pop("llm", None)
        out.figures["traceback"] = traceback.format_exc()
        message = " ".join(out.error.split())
        out.row(SECTION_TITLES[name], f"FAILED: {message[:160]}", "", False)
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.wall_s = time.perf_counter() - started
        _free_memory(_device(cfg))
    return out


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    for module in ("triton", "transformers"):
        try:
            env[module] = __import__(module).__version__
        except ImportError:
            env[module] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GiB, 1), gpu_count=torch.cuda.device_count())
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=10)
        env.update(git_commit=commit.stdout.strip(), git_dirty=bool(dirty.stdout.strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def format_table(sections: list[SectionOutput], title: str) -> str:
    header = ("check", "result", "target", "met")
    lines: list[tuple[str, str, str, str]] = []
    for section in sections:
        lines.append((f"[{SECTION_TITLES[section.name]}] {section.wall_s:.1f} s", "", "", ""))
        for row in section.rows:
            met = "" if row.met is None else ("yes" if row.met else "NO")
            lines.append((row.check, row.result, row.target, met))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]

    def render(cells: tuple[str, ...]) -> str:
        return " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([title, render(header), rule, *map(render, lines)])


def run_checks(cfg: CheckConfig, names: list[str], use_alarm: bool = False) -> tuple[list[SectionOutput], Context]:
    """Run the named sections in order; `use_alarm` enforces the time limits with
    SIGALRM (main thread only)."""
    started = time.perf_counter()
    ctx: Context = {}
    sections = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ctx["tmp"] = tmp
        ctx["use_alarm"] = use_alarm
        for name in names:
            remaining = cfg.deadline_s - (time.perf_counter() - started)
            if ctx.get("terminated"):
                remaining = 0.0
            print(f"== {SECTION_TITLES[name]} ({remaining:.0f} s left)", file=sys.stderr, flush=True)
            try:
                section = run_section(name, cfg, ctx, remaining)
            except (SectionTimeout, Terminated) as e:  # a signal in the guard's own bookkeeping
                section = SectionOutput(name, status="FAILED", error=f"{type(e).__name__}: {e}")
                section.row(SECTION_TITLES[name], f"FAILED: {section.error}", "", False)
                ctx["terminated"] = ctx.get("terminated") or isinstance(e, Terminated)
            print(f"   {section.status} in {section.wall_s:.1f} s" + (f": {section.error}" if section.error else ""), file=sys.stderr, flush=True)
            sections.append(section)
        ctx.pop("llm", None)  # the engine goes before its temporary folder
        _free_memory(_device(cfg))
    ctx["wall_s"] = time.perf_counter() - started
    return sections, ctx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter): plumbing only")
    parser.add_argument(
        "--out", type=Path, default=None,
        help=f"JSON results (default {DEFAULT_OUT.relative_to(REPO_ROOT)}; smoke: {DEFAULT_SMOKE_OUT})",
    )  # fmt: skip
    parser.add_argument("--sections", default=",".join(SECTION_NAMES), help=f"comma-separated subset of {','.join(SECTION_NAMES)}")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole run (default 455; smoke 600)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {','.join(SECTION_NAMES)}")
    smoke = args.smoke or not torch.cuda.is_available()
    if smoke and not args.smoke:
        print("no CUDA device: running the smoke configuration", file=sys.stderr)
    if smoke and not torch.cuda.is_available():
        # A driver without a CUDA build of torch: the kernels are not defined yet (they
        # are imported by the sections), so the interpreter can still be switched on.
        os.environ["TRITON_INTERPRET"] = "1"
    make = smoke_config if smoke else gpu_config
    cfg = make() if args.deadline is None else make(deadline_s=args.deadline)

    import logging

    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, _on_term)
    sections, ctx = run_checks(cfg, [n for n in SECTION_NAMES if n in names], use_alarm=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    env = environment()
    title = (
        f"pagellm GPU check on {env.get('gpu', 'CPU')} ({ctx['wall_s']:.0f} s)"
        if not smoke
        else f"pagellm GPU check, SMOKE mode on {cfg.device} ({ctx['wall_s']:.0f} s): tiny shapes, targets NOT meaningful"
    )
    table = format_table(sections, title)
    result = {
        "title": title,
        "smoke": smoke,
        "wall_s": ctx["wall_s"],
        "environment": env,
        "config": asdict(cfg),
        "sections": {s.name: asdict(s) for s in sections},
        "table": table.splitlines(),
    }
    text = json.dumps(result, indent=2, default=str)
    destinations = [args.out or (DEFAULT_SMOKE_OUT if smoke else DEFAULT_OUT)]
    if os.environ.get("OUT"):
        destinations.append(Path(os.environ["OUT"]) / "gpu_check.json")
    for path in destinations:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n", encoding="utf-8")
        except OSError as e:
            print(f"cannot write {path}: {e}", file=sys.stderr)
    print(table)
    print("results: " + ", ".join(str(p) for p in destinations))
    return 0 if all(s.status == "ok" for s in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
