"""Bench stage: the GPU check's sections on the whole engine: greedy equality with HF
transformers, offline throughput against HF generate over the same request list, and a
large decode step against its roofline."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pagellm.bench.gpu_checks.common import (
    DTYPES,
    CheckConfig,
    Context,
    SectionOutput,
    device_of,
    free_memory,
    measure_copy_bandwidth,
    sync_device,
)
from pagellm.bench.gpu_checks.hf_baseline import (
    BenchRequest,
    hf_done_requests,
    hf_generate_batch,
    hf_greedy_each,
    hf_random_model,
    hf_sweep,
    hf_time_list,
    load_hf_float32,
)
from pagellm.bench.synthetic_model import SHAPES

# --------------------------------------------------------------------------- 3. equality


def equality_prompts(cfg: CheckConfig, vocab_size: int) -> list[list[int]]:
    rng = random.Random(8)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    prompts = [tokens(n) for n in cfg.equality_prompt_lens]
    shared = tokens(cfg.equality_shared_prefix)
    prompts += [shared + tokens(n) for n in cfg.equality_suffix_lens]
    return prompts


def section_equality(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    from pagellm import LLM, SamplingParams
    from pagellm.bench.synthetic_model import write_synthetic_checkpoint

    device = device_of(cfg)
    folder = write_synthetic_checkpoint(Path(ctx["tmp"]) / "equality", shape=cfg.equality_shape, with_weights=True, seed=11)
    prompts = equality_prompts(cfg, cfg.equality_shape["vocab_size"])
    new_tokens = cfg.equality_max_tokens
    started = time.perf_counter()
    hf = load_hf_float32(folder, device)
    expected = hf_greedy_each(hf, prompts, new_tokens, device)
    out.figures["hf_seconds"] = round(time.perf_counter() - started, 2)
    del hf
    free_memory(device)

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
    free_memory(device)
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


def throughput_workload(cfg: CheckConfig, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            [rng.randrange(3, vocab_size) for _ in range(rng.randint(*cfg.prompt_len))],
            rng.randint(*cfg.output_len),
        )
        for _ in range(cfg.num_requests)
    ]


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
    runner = getattr(engine, "runner", None)  # a multi-process executor may hold none here
    backend = getattr(getattr(runner, "model", None), "backend", None)
    return {
        "attention_backend": getattr(backend, "name", None),
        "decode_cuda_graphs": getattr(runner, "decode_graphs", None) is not None,
        "num_gpu_blocks": engine.config.cache_config.num_gpu_blocks,
        "max_num_batched_tokens": engine.config.scheduler_config.max_num_batched_tokens,
    }


def throughput_folder(cfg: CheckConfig, ctx: Context) -> Path:
    from pagellm.bench.synthetic_model import write_synthetic_checkpoint

    if "throughput_folder" not in ctx:
        shape = SHAPES[cfg.throughput_shape]
        ctx["throughput_folder"] = write_synthetic_checkpoint(
            Path(ctx["tmp"]) / cfg.throughput_shape, shape=shape, with_weights=False
        )
    return ctx["throughput_folder"]


@dataclass(frozen=True)
class PagellmRun:
    elapsed_s: float
    output_tokens: int
    num_steps: int
    num_preemptions: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def time_pagellm(llm: Any, requests: list[BenchRequest], device: torch.device) -> PagellmRun:
    """pagellm's wall time for the requests, all added at once, from an empty prefix
    cache (a second run over the same prompts must not start from their cached blocks)."""
    from pagellm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    engine = llm.engine
    engine.scheduler.kv_cache_manager.reset_prefix_cache()
    before = engine.get_stats()
    steps_before = engine.num_steps
    sync_device(device)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
    sync_device(device)
    elapsed = time.perf_counter() - started
    after = engine.get_stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    asked = sum(r.output_len for r in requests)
    if produced != asked:
        raise RuntimeError(f"pagellm produced {produced} tokens, {asked} were asked for")
    return PagellmRun(
        elapsed_s=elapsed,
        output_tokens=produced,
        num_steps=engine.num_steps - steps_before,
        num_preemptions=(after.num_preemptions_recompute + after.num_preemptions_swap)
        - (before.num_preemptions_recompute + before.num_preemptions_swap),
    )


def section_throughput(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    """pagellm and HF `generate` over the same request list, output tok/s of each over
    the same useful output tokens (each request's own max_tokens).

    HF serves the list in static batches (hf_time_list) of the batch size a short sweep
    found fastest; tokens it generates past a request's own end are not counted. When
    its time budget ends the list early, the HF figures are over the requests it did
    (marked partial), and pagellm is timed on exactly those requests too, so that the
    ratio still compares the same work; nothing is extrapolated.
    """
    device = device_of(cfg)
    dtype = DTYPES[cfg.throughput_dtype]
    shape = SHAPES[cfg.throughput_shape]
    folder = throughput_folder(cfg, ctx)
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
        sweep = hf_sweep(hf, requests, cfg.hf_batch_sizes, cfg.hf_sweep_budget_s, device)
        out.figures["hf_sweep"] = sweep
        timed = [s for s in sweep if "output_tok_s" in s]
        if not timed:
            raise RuntimeError(f"no HF batch size could be timed: {sweep}")
        batch_size = max(timed, key=lambda s: s["output_tok_s"])["batch_size"]
        hf_run = hf_time_list(requests, batch_size, cfg.hf_budget_s, partial(hf_generate_batch, hf, device=device))
    finally:
        del hf
        free_memory(device)
    out.figures["hf_batch_size"] = batch_size
    out.figures["hf"] = hf_run.figures()
    out.figures["hf_output_tok_s"] = hf_run.output_tok_s
    out.figures["hf_partial"] = hf_run.partial
    if hf_run.num_requests_done == 0:
        raise RuntimeError(f"HF did not finish one batch of {batch_size}: {hf_run.stopped_by}")

    started = time.perf_counter()
    llm = make_throughput_engine(cfg, folder)
    ctx["llm"] = llm
    out.figures["pagellm_build_s"] = round(time.perf_counter() - started, 2)
    out.figures["pagellm_engine"] = engine_settings(llm)

    # Warm-up compiles the kernels for prefill and decode outside the timed run.
    time_pagellm(llm, [BenchRequest(r.prompt_token_ids, 8) for r in requests[:4]], device)
    full = time_pagellm(llm, requests, device)
    out.figures.update(
        pagellm_elapsed_s=round(full.elapsed_s, 3),
        pagellm_output_tok_s=full.output_tok_s,
        pagellm_steps=full.num_steps,
        pagellm_preemptions=full.num_preemptions,
    )
    same = full
    if hf_run.partial:
        same = time_pagellm(llm, hf_done_requests(requests, hf_run), device)
        out.figures["pagellm_on_hf_done"] = {
            "num_requests": hf_run.num_requests_done,
            "elapsed_s": round(same.elapsed_s, 3),
            "output_tokens": same.output_tokens,
            "output_tok_s": same.output_tok_s,
        }
    ratio = same.output_tok_s / hf_run.output_tok_s
    out.figures.update(ratio=ratio, ratio_num_requests=hf_run.num_requests_done, ratio_partial=hf_run.partial)

    out.row(
        f"pagellm output tok/s ({len(requests)} reqs)", f"{full.output_tok_s:,.0f} in {full.elapsed_s:.3g} s", "", None
    )
    if hf_run.partial:
        out.row(
            f"HF generate tok/s (batch {batch_size}) PARTIAL",
            f"{hf_run.output_tok_s:,.0f} on {hf_run.num_requests_done}/{len(requests)} reqs in {hf_run.elapsed_s:.3g} s"
            f" ({hf_run.stopped_by})",
            "", None,
        )  # fmt: skip
        out.row(
            f"  pagellm on those {hf_run.num_requests_done} reqs", f"{same.output_tok_s:,.0f} in {same.elapsed_s:.3g} s",
            "", None,
        )  # fmt: skip
        label = f"throughput pagellm / HF (PARTIAL: {hf_run.num_requests_done}/{len(requests)} reqs)"
    else:
        out.row(
            f"HF generate tok/s (batch {batch_size}, all {len(requests)} reqs)",
            f"{hf_run.output_tok_s:,.0f} in {hf_run.elapsed_s:.3g} s", "", None,
        )  # fmt: skip
        label = "throughput pagellm / HF (same requests)"
    out.row(label, f"{ratio:.2f}x", ">= 5x", ratio >= 5.0)


# --------------------------------------------------------------------------- 6. roofline


def section_roofline(cfg: CheckConfig, ctx: Context, out: SectionOutput) -> None:
    from pagellm import SamplingParams
    from pagellm.metrics.ceilings import measure_matmul_ceiling
    from pagellm.core.step_batch import StepBatch
    from pagellm.metrics.utilization import step_cost
    from pagellm.model.costs import ModelCosts

    device = device_of(cfg)
    dtype = DTYPES[cfg.throughput_dtype]
    if "copy_bw" not in ctx:
        ctx["copy_bw"] = measure_copy_bandwidth(cfg.copy_bytes, device)
    copy_bw = ctx["copy_bw"]
    matmul_flops = measure_matmul_ceiling(dtype, seconds=1.0, size=cfg.matmul_size, device=device) * 1e9
    out.figures.update(copy_bytes_per_s=copy_bw, matmul_flops_per_s=matmul_flops)
    out.row(f"matmul ceiling ({cfg.throughput_dtype}, {cfg.matmul_size}^2)", f"{matmul_flops / 1e12:,.1f} TFLOP/s", "", None)

    if "llm" not in ctx:
        ctx["llm"] = make_throughput_engine(cfg, throughput_folder(cfg, ctx))
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
            cost = step_cost(costs, StepBatch.from_lengths([1] * batch, seq_lens, batch))
            sync_device(device)
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
