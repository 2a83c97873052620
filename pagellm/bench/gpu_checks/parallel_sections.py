"""Bench stage: the GPU check's section on tensor parallelism: greedy tokens at TP > 1
against TP = 1, and decode steps timed at each TP size the machine's GPUs allow."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from pagellm.bench.gpu_checks.common import (
    CheckConfig,
    Context,
    SectionOutput,
    device_of,
    free_memory,
)
from pagellm.bench.gpu_checks.engine_sections import engine_settings, throughput_folder

T = TypeVar("T")
TP_SIZES = (1, 2, 4, 8)


def tp_sizes(num_gpus: int) -> tuple[int, ...]:
    """The TP sizes timed on a machine with num_gpus visible GPUs."""
    return tuple(tp for tp in TP_SIZES if tp <= num_gpus)


def tp_skip_reason(cfg: CheckConfig) -> str | None:
    """Why this machine cannot run the section (None: it can)."""
    if cfg.device != "cuda":
        return f"tensor parallelism runs on CUDA GPUs (this run is on {cfg.device})"
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        return f"fewer than 2 CUDA GPUs visible ({num_gpus})"
    return None


def with_llm(make: Callable[[], Any], use: Callable[[Any], T], device: torch.device) -> T:
    """Build an engine, use it, and free it (workers included) before the next is built:
    two 8B engines never share a GPU."""
    llm = make()
    try:
        return use(llm)
    finally:
        try:
            if hasattr(llm, "shutdown"):
                llm.shutdown()  # worker processes and their NCCL group
        finally:
            del llm
            free_memory(device)


def time_decode_steps(engine: Any, batch: int, context: int, num_steps: int, max_num_batched_tokens: int) -> list[float]:
    """Seconds of each engine step in which all `batch` requests decode one token (each
    step returns after the sampled tokens reached the host). The first two such steps
    are dropped: they may still warm caches."""
    from pagellm import SamplingParams

    rng = random.Random(7)
    vocab = engine.model_config.vocab_size
    prefill_steps = -(-batch * context // max_num_batched_tokens)
    max_tokens = num_steps + 8 + 2 * prefill_steps  # the timed steps come after every prefill
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request_ids = [
        engine.add_request(f"tp-decode-{batch}-{i}", [rng.randrange(3, vocab) for _ in range(context)], params)
        for i in range(batch)
    ]
    seconds: list[float] = []
    try:
        for _ in range(10 * max_tokens):
            if len(seconds) >= num_steps + 2 or not engine.has_unfinished_requests():
                break
            running = engine.scheduler.running
            all_decoding = len(running) == batch and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
            if not all_decoding:
                engine.step()  # prefill still in progress
                continue
            started = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - started)
    finally:
        engine.abort_request(request_ids)
    return seconds[2:]


def section_tp(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    """For TP in (1, 2, 4, 8) up to the number of GPUs: greedy float32 tokens of a small
    random-weight checkpoint (the equality section's shape) must equal TP = 1's, then
    decode steps of the throughput model (random weights, load_format="dummy") are timed
    at each decode batch size. A TP size whose turn would overrun the budget is skipped
    (and says so); engines are freed before the next one is built."""
    from pagellm import LLM, SamplingParams
    from pagellm.bench.synthetic_model import write_synthetic_checkpoint

    device = device_of(cfg)
    num_gpus = torch.cuda.device_count()
    sizes = tp_sizes(num_gpus)
    # The throughput section's engine (weights and a large KV cache on GPU 0) goes first.
    ctx.pop("llm", None)
    free_memory(device)
    equality_folder = write_synthetic_checkpoint(
        Path(ctx["tmp"]) / "tp_equality", shape=cfg.equality_shape, with_weights=True, seed=12
    )
    timing_folder = throughput_folder(cfg, ctx)
    rng = random.Random(9)
    vocab = cfg.equality_shape["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in cfg.tp_prompt_lens]
    params = SamplingParams(temperature=0.0, max_tokens=cfg.tp_max_tokens, ignore_eos=True)
    max_batch = max(cfg.tp_decode_batches)
    max_num_batched_tokens = max(max_batch * cfg.tp_decode_context, 256)
    out.figures.update(
        num_gpus=num_gpus,
        tp_sizes=list(sizes),
        equality_shape=cfg.equality_shape,
        timing_model=cfg.throughput_shape,
        timing_dtype=cfg.throughput_dtype,
        prompt_lens=list(cfg.tp_prompt_lens),
        # TF32 matmuls would make float32 equality a matter of luck: say whether they were on.
        tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
    )

    def greedy(llm: Any) -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def decode_figures(llm: Any) -> dict[str, Any]:
        figures: dict[str, Any] = {"engine": engine_settings(llm)}
        for batch in cfg.tp_decode_batches:
            seconds = time_decode_steps(llm.engine, batch, cfg.tp_decode_context, cfg.tp_decode_steps, max_num_batched_tokens)
            if not seconds:
                raise RuntimeError(f"no decode step of batch {batch} was timed")
            step_s = statistics.median(seconds)
            figures[f"batch_{batch}"] = {
                "num_steps_timed": len(seconds),
                "step_seconds_median": step_s,
                "time_per_output_token_ms": step_s * 1e3,
                "output_tok_s": batch / step_s,
            }
        return figures

    reference: list[list[int]] | None = None
    results: dict[int, dict[str, Any]] = {}
    out.figures["results"] = results
    started = time.perf_counter()
    last_s = 0.0
    for tp in sizes:
        spent = time.perf_counter() - started
        if results and spent + last_s > cfg.budgets_s["tp"]:
            reason = f"time: {spent:.0f} s of the {cfg.budgets_s['tp']:.0f} s budget spent, the last TP size took {last_s:.0f} s"
            results[tp] = {"skipped": reason}
            out.row(f"TP={tp}", "SKIPPED: time", "", None)
            continue
        turn_started = time.perf_counter()
        common: dict[str, Any] = {
            "tensor_parallel_size": tp,
            "device": cfg.device,
            "kv_cache_memory_bytes": cfg.tp_kv_cache_bytes,
            "disable_log_stats": True,
        }
        tokens = with_llm(
            partial(LLM, str(equality_folder), dtype="float32", max_model_len=cfg.equality_max_model_len, **common),
            greedy,
            device,
        )
        figures = with_llm(
            partial(
                LLM,
                str(timing_folder),
                load_format="dummy",
                dtype=cfg.throughput_dtype,
                max_num_seqs=max_batch,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=cfg.tp_decode_context + 2 * cfg.tp_decode_steps + 64,
                **common,
            ),
            decode_figures,
            device,
        )
        last_s = time.perf_counter() - turn_started
        figures["seconds"] = round(last_s, 1)
        results[tp] = figures
        if reference is None:
            reference = tokens
        else:
            num_equal = sum(a == e for a, e in zip(tokens, reference, strict=True))
            first_diffs = {
                i: next((j for j, (a, e) in enumerate(zip(tokens[i], reference[i], strict=False)) if a != e), None)
                for i in range(len(prompts))
                if tokens[i] != reference[i]
            }
            figures.update(num_equal=num_equal, first_difference_at=first_diffs)
            out.row(
                f"TP={tp} greedy tokens equal TP=1 (float32, {cfg.tp_max_tokens} new)",
                f"{num_equal}/{len(prompts)} prompts", "all", num_equal == len(prompts),
            )  # fmt: skip
        for batch in cfg.tp_decode_batches:
            timed = figures[f"batch_{batch}"]
            speedup = ""
            base = results[sizes[0]].get(f"batch_{batch}")
            if tp != sizes[0] and base:
                timed["speedup_vs_tp1"] = timed["output_tok_s"] / base["output_tok_s"]
                speedup = f", {timed['speedup_vs_tp1']:.2f}x TP=1"
            out.row(
                f"TP={tp} decode, batch {batch} ({cfg.throughput_shape}, ~{cfg.tp_decode_context} ctx)",
                f"{timed['output_tok_s']:,.0f} tok/s, {timed['time_per_output_token_ms']:.2f} ms/token{speedup}",
                "", None,
            )  # fmt: skip
