"""Structured outputs: one step's allowed-token masks, applied to the logits in one batched
operation before sampling.

Each constrained row's matcher writes its allowed tokens as a bitmask row (32 tokens per
int32, llguidance's layout) in parallel across rows (Rust threads, GIL released);
unconstrained rows stay all-ones, so a mask never touches another request's logits.
The logits of disallowed tokens become -inf: greedy, temperature, top-k/top-p, penalties
and logprobs all then see the masked distribution.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

_executor: Any = None


def _llg_executor() -> Any:
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


def fill_masks(matchers: Sequence[tuple[Any, int]], num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [num_rows, ceil(vocab / 32)]: all bits set, except the constrained rows'
    disallowed tokens (`matchers`: (llguidance.LLMatcher, row) pairs)."""
    bitmask = torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    if matchers:
        _llg_executor().unsafe_compute_mask_ptr(list(matchers), bitmask.data_ptr(), bitmask.shape[1] * 4, num_rows)
    return bitmask


_BITS = torch.arange(32, dtype=torch.int32)


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the disallowed logits of `rows` to -inf, in place (logits [num_rows, vocab])."""
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    bits = bitmask[rows].to(logits.device)  # [len(rows), words]
    allowed = ((bits.unsqueeze(-1) >> _BITS.to(logits.device)) & 1).flatten(1)[:, : logits.shape[1]]
    sub = logits.index_select(0, index).masked_fill_(allowed == 0, float("-inf"))
    logits.index_copy_(0, index, sub)


class MaskTimer:
    """Seconds spent on masks (filling and applying) since the last `take`."""

    def __init__(self) -> None:
        self._seconds = 0.0

    def time(self) -> _Timing:
        return _Timing(self)

    def take(self) -> float:
        seconds, self._seconds = self._seconds, 0.0
        return seconds


class _Timing:
    def __init__(self, owner: MaskTimer) -> None:
        self._owner = owner

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._owner._seconds += time.perf_counter() - self._start
