"""Structured stage: one step's allowed-token masks, applied to the logits in one batched
operation before sampling.

Each constrained row's matcher writes its allowed tokens as a bitmask row (32 tokens per
int32, llguidance's layout); unconstrained rows stay all-ones, so a mask never touches
another request's logits.
The logits of disallowed tokens become -inf: greedy, temperature, top-k/top-p, penalties
and logprobs all then see the masked distribution.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pagellm.kernels.build import load_kernels

def fill_masks(matchers: Sequence[tuple[Any, int]], num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [num_rows, ceil(vocab / 32)]: all bits set, except the constrained rows'
    disallowed tokens (`matchers`: (llguidance.LLMatcher, row) pairs).

    One matcher after another: llguidance's parallel executor gained nothing over this
    loop on 2 cores and had slow outliers (benchmarks/results/structured_backends.md).
    """
    bitmask = torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    row_bytes = bitmask.shape[1] * 4
    base = bitmask.data_ptr()
    for matcher, row in matchers:
        matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
    return bitmask


_BITS = torch.arange(32, dtype=torch.int32)


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the disallowed logits of `rows` to -inf, in place (logits [num_rows, vocab]).

    A grammar's mask is mostly whole words of 32 disallowed tokens (0) or of 32 allowed
    ones (-1): those are written, or skipped, 32 at a time; only the few mixed words are
    unpacked bit by bit.
    """
    if not rows:
        return
    if _apply_native(logits, bitmask, rows):
        return
    device = logits.device
    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index)  # [len(rows), vocab]
    words = bitmask[list(rows)].to(device)  # [len(rows), ceil(vocab / 32)]
    vocab = sub.shape[1]
    whole = vocab // 32
    if whole:
        blocks = sub[:, : whole * 32].view(len(rows), whole, 32)
        head = words[:, :whole]
        blocks[head == 0] = float("-inf")
        mixed = (head != 0) & (head != -1)
        if bool(mixed.any()):
            picked = blocks[mixed]  # [k, 32]
            bits = (head[mixed].unsqueeze(-1) >> _BITS.to(device)) & 1
            blocks[mixed] = picked.masked_fill(bits == 0, float("-inf"))
    if vocab % 32:  # the last, partial word
        bits = (words[:, whole : whole + 1] >> _BITS.to(device)) & 1
        tail = sub[:, whole * 32 :]
        tail.masked_fill_(bits[:, : tail.shape[1]] == 0, float("-inf"))
    logits.index_copy_(0, index, sub)


_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _apply_native(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> bool:
    """The compiled kernel (kernels/csrc/token_masks.c) where it applies: CPU logits."""
    if logits.device.type != "cpu" or logits.dtype not in _NATIVE_DTYPES or logits.stride(1) != 1:
        return False
    library = load_kernels()
    if library is None:
        return False
    index = torch.tensor(rows, dtype=torch.int64)
    bitmask = bitmask.contiguous()
    library.apply_token_bitmask(
        logits.data_ptr(), _NATIVE_DTYPES[logits.dtype], logits.stride(0), logits.shape[1],
        bitmask.data_ptr(), bitmask.shape[1], index.data_ptr(), len(rows),
    )  # fmt: skip
    return True


class MaskTimer:
    """Seconds spent on masks (filling and applying): since the last `take` (the engine's
    per-step figure) and in all (`total_seconds`, for benchmarks)."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self.total_seconds = 0.0

    @contextlib.contextmanager
    def time(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self._seconds += elapsed
            self.total_seconds += elapsed

    def take(self) -> float:
        seconds, self._seconds = self._seconds, 0.0
        return seconds
