"""Sample stage: per-request token counts for repetition/presence/frequency penalties.

Counts are kept incrementally in one [rows, vocab] tensor: a request with penalties gets
a row when it is added (filled once from its prompt and any outputs it already has) and
each sampled token adds one to its row, so nothing is recounted from scratch per step.
Only requests that use penalties take a row.
"""

from __future__ import annotations

import torch

from pagellm.sampling_params import SamplingParams


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = []
        self.output_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)

    def add(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        row = self._take_row()
        self._rows[req_id] = row
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        if prompt_token_ids:
            self.prompt_mask[row, torch.tensor(prompt_token_ids, device=self.device)] = True
        if output_token_ids:
            ids = torch.tensor(output_token_ids, device=self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def remove(self, req_id: str) -> None:
        row = self._rows.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)

    def has(self, req_id: str) -> bool:
        return req_id in self._rows

    def record(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Count sampled tokens (one per listed request that has a row)."""
        rows, tokens = [], []
        for req_id, token in zip(req_ids, token_ids, strict=True):
            row = self._rows.get(req_id)
            if row is not None:
                rows.append(row)
                tokens.append(token)
        if rows:
            index = (torch.tensor(rows, device=self.device), torch.tensor(tokens, device=self.device))
            self.output_counts.index_put_(
                index, torch.ones(len(rows), dtype=torch.int32, device=self.device), accumulate=True
            )

    def rows_of(self, req_ids: list[str]) -> torch.Tensor:
        return torch.tensor([self._rows[r] for r in req_ids], device=self.device)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.output_counts.shape[0]
            new = max(8, old * 2)
            self.output_counts = _grow(self.output_counts, new)
            self.prompt_mask = _grow(self.prompt_mask, new)
            self._free_rows.extend(range(new - 1, old - 1, -1))
        return self._free_rows.pop()


def _grow(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    grown = torch.zeros((rows, tensor.shape[1]), dtype=tensor.dtype, device=tensor.device)
    grown[: tensor.shape[0]] = tensor
    return grown


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab] (modified in place)
    output_counts: torch.Tensor,  # [num_rows, vocab] int
    prompt_mask: torch.Tensor,  # [num_rows, vocab] bool
    params: list[SamplingParams],
) -> None:
    """Repetition (prompt and output tokens, HF's rule), then presence and frequency
    (output tokens, OpenAI's rule: logit -= frequency * count + presence * (count > 0))."""
    device = logits.device
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    appeared = output_counts > 0
    seen = appeared | prompt_mask
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency * output_counts.to(logits.dtype) + presence * appeared.to(logits.dtype)
