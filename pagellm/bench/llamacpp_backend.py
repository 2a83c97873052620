"""Bench stage: llama.cpp (llama-cpp-python) on the same GGUF, several sequences per batch.

Uses the low-level `llama_cpp` API the way llama.cpp's own server batches: up to
`parallel` sequences live in one context; every llama_decode call carries one new token
for each decoding sequence plus prompt tokens of newly admitted ones; a finished
sequence's KV is dropped and the next request takes its slot (continuous batching).
Greedy, ignore-EOS, exact output lengths, as for the other backends.

`decode_all` (the batching and slot bookkeeping) touches llama.cpp only through the
module object it is given, so tests drive it with a stand-in (tests/bench/
test_llamacpp_batching.py): llama-cpp-python need not be installed for that.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagellm.bench.backends import BackendResult, median_run
from pagellm.workload.synthetic import BenchRequest
from pagellm.errors import PagellmError

logger = logging.getLogger(__name__)


@dataclass
class _Slot:
    index: int  # of the request in the list
    request: BenchRequest
    seq_id: int
    position: int = 0  # tokens of this sequence in the KV cache
    pending: list[int] | None = None  # tokens to feed (prompt, then the last sampled one)
    token_ids: list[int] = field(default_factory=list)  # sampled so far


def _seq_rm(llama_cpp: Any, ctx: Any, seq_id: int) -> None:
    """Drop a sequence's KV (the function's name changed across llama.cpp versions)."""
    if hasattr(llama_cpp, "llama_memory_seq_rm") and hasattr(llama_cpp, "llama_get_memory"):
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq_id, -1, -1)
    elif hasattr(llama_cpp, "llama_kv_self_seq_rm"):
        llama_cpp.llama_kv_self_seq_rm(ctx, seq_id, -1, -1)
    else:
        llama_cpp.llama_kv_cache_seq_rm(ctx, seq_id, -1, -1)


def run_llamacpp(
    requests: list[BenchRequest],
    model_path: Path,
    parallel: int,
    n_batch: int = 512,
    repeats: int = 1,
    llama_cpp: Any = None,
) -> BackendResult:
    """`llama_cpp`: the low-level API module (default: import llama-cpp-python's)."""
    if llama_cpp is None:
        try:
            import llama_cpp
        except ImportError:
            raise PagellmError(
                "the llama.cpp backend needs llama-cpp-python: pip install llama-cpp-python"
            ) from None
    threads = os.cpu_count() or 1
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    # The high-level Llama class cannot set n_seq_max, so the context is built here.
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise PagellmError(f"llama.cpp could not load {model_path}")
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = parallel * longest
    params.n_batch = params.n_ubatch = n_batch
    params.n_seq_max = parallel
    params.n_threads = params.n_threads_batch = threads
    if hasattr(params, "kv_unified"):
        params.kv_unified = True  # one cache shared by all sequences, like pagellm's pool
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise PagellmError("llama.cpp could not create a context")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(n_batch, 0, parallel)
    try:
        decode_all(llama_cpp, ctx, batch, requests[: min(2, len(requests))], parallel, n_batch, n_vocab)
        for seq in range(parallel):
            _seq_rm(llama_cpp, ctx, seq)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            output_token_ids = decode_all(llama_cpp, ctx, batch, requests, parallel, n_batch, n_vocab)
            runs.append(time.perf_counter() - start)
            for seq in range(parallel):
                _seq_rm(llama_cpp, ctx, seq)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    produced = sum(len(ids) for ids in output_token_ids)
    expected = sum(r.output_len for r in requests)
    if produced != expected:
        raise PagellmError(f"llama.cpp produced {produced} tokens, {expected} were asked for")
    return BackendResult(
        "llamacpp", median_run(runs), produced, sum(len(r.prompt_token_ids) for r in requests),
        settings={"parallel": parallel, "n_batch": n_batch, "threads": threads,
                  "elapsed_runs_s": [round(r, 4) for r in runs],
                  "weights": "GGUF as stored (Q4_1/Q8_0 kernels)",
                  "version": getattr(llama_cpp, "__version__", "?")},
        output_token_ids=output_token_ids,
    )  # fmt: skip


def run_llamacpp_isolated(
    requests: list[BenchRequest],
    model_path: Path,
    parallel: int,
    n_batch: int = 512,
    repeats: int = 1,
    target: Callable[..., BackendResult] | None = None,
) -> BackendResult:
    """run_llamacpp (or `target`, tests) in a child process of its own: a crash inside
    llama.cpp (a segfault in a kernel it picked for this CPU) ends only that process and
    is reported as this backend's failure, with the signal, so the other backends of a
    comparison still print their figures. The child is spawned, not forked: torch's
    OpenMP pool in this process must not be inherited by a library with threads of its own."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_run_in_child, args=(sender, target or run_llamacpp, requests, model_path, parallel, n_batch, repeats)
    )
    process.start()
    sender.close()
    try:
        outcome = receiver.recv()
    except EOFError:  # the child died before sending anything
        outcome = None
    process.join()
    if outcome is None:
        code = process.exitcode
        if code is not None and code < 0:
            raise PagellmError(f"llama.cpp crashed: its process was killed by signal {signal.Signals(-code).name}")
        raise PagellmError(f"llama.cpp's process exited with status {code} before returning a result")
    kind, value = outcome
    if kind == "error":
        raise PagellmError(value)
    return value


def _run_in_child(sender: Any, target: Callable[..., BackendResult], *args: Any) -> None:
    try:
        sender.send(("result", target(*args)))
    except Exception as error:  # reported in the parent as this backend's failure
        sender.send(("error", f"{type(error).__name__}: {error}" if not isinstance(error, PagellmError) else str(error)))
    finally:
        sender.close()


def decode_all(
    llama_cpp: Any, ctx: Any, batch: Any, requests: list[BenchRequest], parallel: int, n_batch: int, n_vocab: int
) -> list[list[int]]:
    """Greedy-decode every request to its output_len with up to `parallel` sequences in
    the context; returns each request's output ids (in the order of `requests`).

    Sequence ids 0..parallel-1 are slots: a request takes a free one, and its KV is
    dropped when it finishes, before the next request takes the slot. Each llama_decode
    call carries at most n_batch tokens: the decoding sequences' last tokens first (they
    are one each), then prompt chunks.
    """
    queue = list(enumerate(requests))
    free_seqs = list(range(parallel - 1, -1, -1))
    active: list[_Slot] = []
    output_token_ids: list[list[int]] = [[] for _ in requests]
    while queue or active:
        while queue and free_seqs:
            index, request = queue.pop(0)
            active.append(_Slot(index, request, free_seqs.pop(), pending=list(request.prompt_token_ids)))
        # One decode call: every decoding slot's token, then prompt chunks while room lasts.
        entries: list[tuple[_Slot, int, bool]] = []  # (slot, token, wants logits)
        for slot in sorted(active, key=lambda s: len(s.pending or ())):
            room = n_batch - len(entries)
            if room <= 0:
                break
            take = (slot.pending or [])[:room]
            for k, token in enumerate(take):
                last = k == len(take) - 1 and len(take) == len(slot.pending or [])
                entries.append((slot, token, last))
        batch.n_tokens = len(entries)
        for i, (slot, token, wants) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = slot.position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot.seq_id
            batch.logits[i] = wants
            slot.position += 1
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise PagellmError("llama_decode failed (KV cache full?)")
        finished = []
        consumed: dict[int, int] = {}
        for i, (slot, _, wants) in enumerate(entries):
            consumed[id(slot)] = consumed.get(id(slot), 0) + 1
            if not wants:
                continue
            logits = np.ctypeslib.as_array(
                ctypes.cast(llama_cpp.llama_get_logits_ith(ctx, i), ctypes.POINTER(ctypes.c_float)),
                shape=(n_vocab,),
            )
            token = int(logits.argmax())
            slot.token_ids.append(token)
            slot.pending = [token]
            if len(slot.token_ids) >= slot.request.output_len:
                finished.append(slot)
        for slot in active:
            n = consumed.get(id(slot), 0)
            if n and slot.pending is not None and len(slot.pending) > 1:
                slot.pending = slot.pending[n:]
        for slot in finished:
            active.remove(slot)
            _seq_rm(llama_cpp, ctx, slot.seq_id)
            free_seqs.append(slot.seq_id)
            output_token_ids[slot.index] = slot.token_ids
    return output_token_ids
