"""Sample stage: turn one step's logits into next tokens for every request at once.

Order, per row: logit_bias, then tokens held back before min_tokens, then penalties,
then greedy argmax or temperature / top-k / top-p / min-p sampling. Each step is a
handful of batched tensor operations; Python loops touch only the rows that use a rare
feature (logit_bias, min_tokens, seeds). A request with a seed draws from its own
generator, so its tokens do not depend on what else is in the batch.

Logprobs are those of the model's raw distribution (log_softmax of the logits before any
processing), as vLLM and the OpenAI API report them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.core.scheduler_output import TokenLogprobs
from pagellm.sample.argmax import row_argmax
from pagellm.sample.penalties import apply_penalties
from pagellm.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, built by the model runner."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per row: the request's own, if seeded
    # Per row: token ids that may not be sampled yet (EOS/stop ids before min_tokens).
    banned_token_ids: list[list[int]]
    # Rows with penalties, and their [len(penalty_rows), vocab] token statistics.
    penalty_rows: list[int] = field(default_factory=list)
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None


def held_back_ids(params: SamplingParams, eos_token_ids: frozenset[int]) -> list[int]:
    """Tokens that may not be sampled before min_tokens: stop ids, and EOS unless ignored
    (a row's banned_token_ids while its request has fewer than min_tokens outputs)."""
    held_back = set(params.stop_token_ids)
    if not params.ignore_eos:
        held_back |= eos_token_ids
    return sorted(held_back)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row, when the request asked for them


class Sampler:
    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch  # logits: [num_rows, vocab]
    ) -> SamplerOutput:
        # The sampler owns `logits` and edits it in place (a float32 input is not copied).
        logits = logits.float()
        num_rows = logits.shape[0]
        wants_logprobs = [p.logprobs is not None for p in batch.params]
        raw_logprobs = logits.log_softmax(dim=-1) if any(wants_logprobs) else None
        self.process(logits, batch)

        tokens = row_argmax(logits)
        sample_rows = [i for i, p in enumerate(batch.params) if p.temperature > 0.0]
        if sample_rows:
            index = torch.tensor(sample_rows, device=logits.device)
            probs = _filtered_probs(logits[index], [batch.params[i] for i in sample_rows])
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each seeded
            # row draws its noise from its own generator.
            noise = torch.empty_like(probs).exponential_()
            for j, row in enumerate(sample_rows):
                generator = batch.generators[row]
                if generator is not None:
                    noise[j].exponential_(generator=generator)
            tokens[index] = row_argmax(probs / noise)

        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, tokens, batch.params)
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    def process(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        """logit_bias, held-back tokens and penalties, in place on float32 logits."""
        self._apply_logit_bias(logits, batch.params)
        for row, banned in enumerate(batch.banned_token_ids):
            if banned:
                logits[row, banned] = float("-inf")
        if batch.penalty_rows:
            assert batch.output_counts is not None and batch.prompt_mask is not None
            index = torch.tensor(batch.penalty_rows, device=logits.device)
            penalized = logits[index]
            apply_penalties(
                penalized,
                batch.output_counts,
                batch.prompt_mask,
                [batch.params[i] for i in batch.penalty_rows],
            )
            logits[index] = penalized

    def target_probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [num_rows, vocab]
        """The distribution each row's token is drawn from: after every processing step,
        temperature and the top-k/top-p/min-p filters; greedy rows a point mass on the
        argmax. (What speculative verification accepts proposals against.)"""
        logits = logits.float()
        self.process(logits, batch)
        probs = torch.zeros_like(logits)
        greedy = [i for i, p in enumerate(batch.params) if p.temperature == 0.0]
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            probs[index] = probs[index].scatter_(1, row_argmax(logits[index]).unsqueeze(1), 1.0)
        sampled = [i for i, p in enumerate(batch.params) if p.temperature > 0.0]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            probs[index] = _filtered_probs(logits[index], [batch.params[i] for i in sampled])
        return probs

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for row, p in enumerate(params):
            if p.logit_bias:
                rows.extend([row] * len(p.logit_bias))
                cols.extend(p.logit_bias.keys())
                values.extend(p.logit_bias.values())
        if rows:
            device = logits.device
            logits.index_put_(
                (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                torch.tensor(values, device=device, dtype=logits.dtype),
                accumulate=True,
            )


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature.unsqueeze(1)
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if (top_k < vocab).any() or (top_p < 1.0).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p, the first token always (a
        # top_p that float32 rounds to 0 would otherwise drop every token).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= (mass_before >= top_p.unsqueeze(1)) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if (min_p > 0).any():
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def gather_logprobs(
    logprobs: torch.Tensor,  # [num_rows, vocab]
    tokens: torch.Tensor,  # [num_rows]
    params: list[SamplingParams],
) -> list[TokenLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    index = torch.tensor(rows, device=logprobs.device)
    selected = logprobs[index]
    chosen = tokens[index]
    chosen_logprobs = selected.gather(1, chosen.unsqueeze(1))  # [rows, 1]
    # Rank 1 = most likely; ties share the better rank.
    chosen_ranks = (selected > chosen_logprobs).sum(dim=1) + 1
    max_k = max(params[i].logprobs or 0 for i in rows)
    top_values, top_ids = selected.topk(max_k, dim=1) if max_k else (None, None)
    result: list[TokenLogprobs | None] = [None] * len(params)
    for j, row in enumerate(rows):
        k = params[row].logprobs or 0
        ids = [int(chosen[j])]
        values = [float(chosen_logprobs[j, 0])]
        ranks = [int(chosen_ranks[j])]
        if k:
            assert top_ids is not None and top_values is not None
            ids += top_ids[j, :k].tolist()
            values += top_values[j, :k].tolist()
            ranks += list(range(1, k + 1))
        result[row] = TokenLogprobs(ids, values, ranks)
    return result
