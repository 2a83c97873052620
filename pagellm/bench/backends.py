"""Bench stage: run one request list on pagellm, HF transformers or llama.cpp, timed.

Each backend returns the wall time of the measured run (after a warm-up), the useful
output tokens it produced (the requested lengths; work a backend wastes, such as HF's
static batches running on for finished requests, does not count) and the token ids of
each request's output (what bench/agreement.py checks against a reference).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagellm.workload.synthetic import BenchRequest
from pagellm.errors import PagellmError

logger = logging.getLogger(__name__)


@dataclass
class BackendResult:
    backend: str
    elapsed_s: float
    output_tokens: int
    prompt_tokens: int
    settings: dict[str, Any] = field(default_factory=dict)
    sweep: list[dict[str, Any]] = field(default_factory=list)  # e.g. HF batch sizes tried
    # The generated ids of each request (in the order of the request list), exactly the
    # asked-for number of them.
    output_token_ids: list[list[int]] = field(default_factory=list)
    # The peak resident memory of the process(es) that ran the backend, where known.
    peak_rss_bytes: int | None = None


def median_run(runs: list[float]) -> float:
    """The median of the measured runs' wall times (the lower middle of an even count)."""
    ordered = sorted(runs)
    return ordered[(len(ordered) - 1) // 2]


def run_pagellm(
    requests: list[BenchRequest],
    model: str | None,
    dtype: str,
    engine_args: dict[str, Any],
    repeats: int = 1,
    show_progress: bool = False,
) -> BackendResult:
    """show_progress: the measured runs show LLM.generate's bar (requests done / total),
    which it draws only when stderr is a terminal."""
    from pagellm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, disable_log_stats=True, **engine_args)

    def params(r: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)

    warm = requests[: min(4, len(requests))]
    llm.generate([r.prompt_token_ids for r in warm], [params(r) for r in warm], use_tqdm=False)
    runs = []
    for _ in range(repeats):
        llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(
            [r.prompt_token_ids for r in requests], [params(r) for r in requests], use_tqdm=show_progress
        )
        runs.append(time.perf_counter() - start)
        output_token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        produced = sum(len(ids) for ids in output_token_ids)
        expected = sum(r.output_len for r in requests)
        if produced != expected:
            raise PagellmError(f"pagellm produced {produced} tokens, {expected} were asked for")
    stats = llm.engine.get_stats()
    return BackendResult(
        "pagellm",
        median_run(runs),
        produced,
        sum(len(r.prompt_token_ids) for r in requests),
        settings={"dtype": dtype, **engine_args, "preemptions": stats.num_preemptions_recompute,
                  "prefix_hit_tokens": stats.num_prefix_hit_tokens,
                  "elapsed_runs_s": [round(r, 4) for r in runs]},
        output_token_ids=output_token_ids,
    )  # fmt: skip


def hf_model(model_path: Path, dtype: torch.dtype) -> Any:
    import transformers

    if model_path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path.parent, gguf_file=model_path.name, dtype=dtype
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()
    # ignore_eos: generate must run to max_new_tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def _hf_static_batches(model: Any, requests: list[BenchRequest], batch_size: int) -> tuple[float, list[list[int]]]:
    """HF `generate` over the list in arrival order, batch_size at a time, left padding;
    each batch runs until its longest request is done (static batching). Returns the wall
    time and each request's output ids (cut to its length)."""
    token_ids: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n :] = 1
        new = max(r.output_len for r in batch)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        token_ids += [out[row, width : width + r.output_len].tolist() for row, r in enumerate(batch)]
    return time.perf_counter() - start, token_ids


def run_hf(requests: list[BenchRequest], model_path: Path, dtype: str, batch_sizes: list[int]) -> BackendResult:
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = hf_model(model_path, torch_dtype)
    _hf_static_batches(model, requests[:2], 2)  # warm-up
    useful = sum(r.output_len for r in requests)
    sweep = []
    token_ids_by_batch = {}
    for batch_size in batch_sizes:
        elapsed, token_ids_by_batch[batch_size] = _hf_static_batches(model, requests, batch_size)
        sweep.append({"batch_size": batch_size, "elapsed_s": round(elapsed, 2), "output_tok_s": round(useful / elapsed, 1)})
        logger.info("HF %s batch %d: %.1f useful tok/s", dtype, batch_size, useful / elapsed)
    best = max(sweep, key=lambda s: s["output_tok_s"])
    return BackendResult(
        "hf", best["elapsed_s"], useful, sum(len(r.prompt_token_ids) for r in requests),
        settings={"dtype": dtype, "batch_size": best["batch_size"]}, sweep=sweep,
        output_token_ids=token_ids_by_batch[best["batch_size"]],
    )  # fmt: skip
