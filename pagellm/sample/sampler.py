"""Sampling stage: turn one step's logits into next tokens for every request at once.

Greedy rows take an argmax; the others are sampled after temperature, top-k, top-p and
min-p filtering, all as batched tensor operations. A request with a seed draws from its
own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, built by the model runner."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per row: the request's own, if seeded
    # Per row: token ids that may not be sampled yet (EOS/stop ids before min_tokens).
    banned_token_ids: list[list[int]]


class Sampler:
    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch  # [num_rows, vocab_size]
    ) -> list[int]:
        logits = logits.float()
        for row, banned in enumerate(batch.banned_token_ids):
            if banned:
                logits[row, banned] = float("-inf")
        greedy_rows = [i for i, p in enumerate(batch.params) if p.temperature == 0.0]
        if len(greedy_rows) == len(batch.params):
            return logits.argmax(dim=-1).tolist()
        tokens = logits.argmax(dim=-1)
        sample_rows = [i for i, p in enumerate(batch.params) if p.temperature > 0.0]
        index = torch.tensor(sample_rows, device=logits.device)
        probs = self._filtered_probs(logits[index], [batch.params[i] for i in sample_rows])
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each seeded row
        # draws its noise from its own generator.
        noise = torch.empty_like(probs).exponential_()
        for j, row in enumerate(sample_rows):
            generator = batch.generators[row]
            if generator is not None:
                noise[j].exponential_(generator=generator)
        tokens[index] = (probs / noise).argmax(dim=-1)
        return tokens.tolist()

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature.unsqueeze(1)
        vocab = logits.shape[1]
        top_k = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device
        )
        top_p = torch.tensor([p.top_p for p in params], device=device)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        if (top_k < vocab).any() or (top_p < 1.0).any():
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device).unsqueeze(0)
            drop = ranks >= top_k.unsqueeze(1)
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= top_p.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if (min_p > 0).any():
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs
