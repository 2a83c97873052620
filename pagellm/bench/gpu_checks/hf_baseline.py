"""Bench stage: the GPU check's baseline, HF transformers: float32 greedy references for the
equality section, and static-batch `generate` timed on the throughput section's request
list (random-weight models built on the device)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pagellm.bench.gpu_checks.common import free_memory, sync_device

# --------------------------------------------------------------------------- float32 references


def load_hf_float32(folder: Path, device: torch.device) -> Any:
    import transformers

    # Recent transformers load in the checkpoint's dtype (float32 here); older ones in
    # float32 by default. Either way the cast below is exact.
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model = model.to(device=device, dtype=torch.float32).eval()
    generate_to_length(model)
    return model


def generate_to_length(model: Any) -> None:
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
    generate_to_length(model)
    return model



# --------------------------------------------------------------------------- static batches


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def static_batches(requests: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """The whole request list cut into HF static batches of `batch_size` (the last one
    may be smaller); every request lands in exactly one batch.

    Requests are sorted by prompt length first (less left padding: the best a static
    batcher can do without knowing output lengths, which it cannot know in advance).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ordered = sorted(requests, key=lambda r: len(r.prompt_token_ids))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


@dataclass(frozen=True)
class BatchTokens:
    """What one static batch costs and what of it is worth anything."""

    num_requests: int
    max_new_tokens: int  # HF runs the whole batch to its longest requested output
    output_tokens: int  # useful: each request's own output_len, nothing past it
    generated_tokens: int  # rows x max_new_tokens, the tokens past a request's end included
    padded_prompt_tokens: int  # rows x the longest prompt (left padding included)

    @classmethod
    def of(cls, batch: list[BenchRequest]) -> BatchTokens:
        max_new_tokens = max(r.output_len for r in batch)
        return cls(
            num_requests=len(batch),
            max_new_tokens=max_new_tokens,
            output_tokens=sum(r.output_len for r in batch),
            generated_tokens=len(batch) * max_new_tokens,
            padded_prompt_tokens=len(batch) * max(len(r.prompt_token_ids) for r in batch),
        )


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
    sync_device(device)
    started = time.perf_counter()
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    sync_device(device)
    elapsed = time.perf_counter() - started
    if generated.shape[1] - width != new_tokens:
        raise RuntimeError(f"HF generated {generated.shape[1] - width} tokens, {new_tokens} were asked for")
    return elapsed


# --------------------------------------------------------------------------- the request list


@dataclass
class HfListRun:
    """HF over the whole request list in static batches of one size, or as much of it as
    the time budget allowed (`partial`: then every figure is over the requests done)."""

    batch_size: int
    num_requests: int  # in the list
    num_batches: int
    num_requests_done: int = 0
    num_batches_done: int = 0
    elapsed_s: float = 0.0  # sum of the batches' generate times
    output_tokens: int = 0  # useful tokens of the requests done
    generated_tokens: int = 0  # what HF generated for them (tokens past a request's end too)
    padded_prompt_tokens: int = 0
    partial: bool = False
    stopped_by: str | None = None  # why the run ended before the list did
    batch_seconds: list[float] | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def figures(self) -> dict[str, Any]:
        figures = asdict(self)
        figures["output_tok_s"] = self.output_tok_s
        return figures


def hf_time_list(
    requests: list[BenchRequest],
    batch_size: int,
    budget_s: float,
    run_batch: Callable[[list[BenchRequest]], float],
) -> HfListRun:
    """Time `run_batch` (seconds of one static batch) over every batch of the list.

    A batch is started only while the time spent plus the last batch's time fits the
    budget (decode steps dominate and every batch runs to about the same longest output,
    so batches take about as long): the run then ends `partial`, its figures over the
    requests it did; nothing is extrapolated. An out-of-memory batch ends it the same way.
    The first batch always runs.
    """
    batches = static_batches(requests, batch_size)
    run = HfListRun(batch_size=batch_size, num_requests=len(requests), num_batches=len(batches), batch_seconds=[])
    for batch in batches:
        if run.batch_seconds and run.elapsed_s + run.batch_seconds[-1] > budget_s:
            run.stopped_by = f"HF time budget ({budget_s:.0f} s)"
            break
        try:
            seconds = run_batch(batch)
        except torch.cuda.OutOfMemoryError as e:
            run.stopped_by = f"out of memory at batch {run.num_batches_done + 1}: {str(e)[:80]}"
            break
        tokens = BatchTokens.of(batch)
        run.batch_seconds.append(round(seconds, 3))
        run.elapsed_s += seconds
        run.num_batches_done += 1
        run.num_requests_done += tokens.num_requests
        run.output_tokens += tokens.output_tokens
        run.generated_tokens += tokens.generated_tokens
        run.padded_prompt_tokens += tokens.padded_prompt_tokens
    run.partial = run.num_requests_done < run.num_requests
    return run


def hf_done_requests(requests: list[BenchRequest], run: HfListRun) -> list[BenchRequest]:
    """The requests a (partial) run did: its first batches of the same partition."""
    return [r for batch in static_batches(requests, run.batch_size)[: run.num_batches_done] for r in batch]


def hf_sweep(
    model: Any, requests: list[BenchRequest], batch_sizes: tuple[int, ...], budget_s: float, device: torch.device
) -> list[dict[str, Any]]:
    """HF useful output tokens/s per batch size, each timed on one batch: only to choose
    the batch size the whole list then runs at (hf_time_list), never the headline.

    The batch of consecutive requests (by prompt length) around the median stands for the
    workload. Sizes are tried largest first; once one is slower than a larger one the
    smaller ones are not tried (fewer rows share each read of the weights).
    """
    ordered = sorted(requests, key=lambda r: len(r.prompt_token_ids))
    hf_generate_batch(model, [BenchRequest(ordered[0].prompt_token_ids, 4)] * 2, device)  # warm-up
    sweep: list[dict[str, Any]] = []
    started = time.perf_counter()
    last_elapsed = 0.0
    best_tok_s = 0.0
    declining = False
    for batch_size in batch_sizes:
        spent = time.perf_counter() - started
        # Smaller batches take about as many decode steps, so about as long.
        if spent + last_elapsed > budget_s:
            sweep.append({"batch_size": batch_size, "skipped": "HF sweep time budget"})
            continue
        if declining:
            sweep.append({"batch_size": batch_size, "skipped": "a larger batch size was faster"})
            continue
        first = max(0, (len(ordered) - batch_size) // 2)
        batch = ordered[first : first + batch_size]
        try:
            elapsed = hf_generate_batch(model, batch, device)
        except torch.cuda.OutOfMemoryError as e:
            sweep.append({"batch_size": batch_size, "skipped": f"out of memory: {str(e)[:80]}"})
            elapsed = None
        if elapsed is None:  # out of the except block, whose traceback held the activations
            free_memory(device)
            continue
        last_elapsed = elapsed
        tokens = BatchTokens.of(batch)
        tok_s = tokens.output_tokens / elapsed
        declining = tok_s < best_tok_s
        best_tok_s = max(best_tok_s, tok_s)
        sweep.append(
            {
                "batch_size": batch_size,
                "num_requests": len(batch),
                "elapsed_s": round(elapsed, 3),
                "output_tokens": tokens.output_tokens,
                "generated_tokens": tokens.generated_tokens,
                "output_tok_s": tok_s,
            }
        )
    return sweep
