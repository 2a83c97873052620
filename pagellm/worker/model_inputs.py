"""Worker stage: flatten one step's scheduled work into the model's input tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.attention.backend import AttentionMetadata


@dataclass(frozen=True)
class ScheduledSequence:
    """One request's share of a step, as the runner sees it."""

    token_ids: list[int]  # tokens whose K/V is computed this step
    start_position: int  # tokens of this request already in the cache
    block_ids: list[int]  # the request's block table (covers start_position + len(token_ids))
    needs_logits: bool  # whether the step's last token must produce a next token


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] rows of the flat batch that need logits


def prepare_model_inputs(
    sequences: list[ScheduledSequence], block_size: int, device: torch.device | str
) -> ModelInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    max_blocks = max(len(s.block_ids) for s in sequences)
    block_rows: list[list[int]] = []
    for seq in sequences:
        end = seq.start_position + len(seq.token_ids)
        assert len(seq.block_ids) * block_size >= end, "block table too short for the step"
        input_ids.extend(seq.token_ids)
        for pos in range(seq.start_position, end):
            positions.append(pos)
            slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(len(input_ids))
        seq_lens.append(end)
        if seq.needs_logits:
            logits_indices.append(len(input_ids) - 1)
        # Padding entries are never read: each request reads only ceil(seq_len/block) blocks.
        block_rows.append(seq.block_ids + [0] * (max_blocks - len(seq.block_ids)))

    def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    metadata = AttentionMetadata(
        slot_mapping=as_tensor(slots),
        block_tables=as_tensor(block_rows),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )
    return ModelInputs(
        input_ids=as_tensor(input_ids),
        positions=as_tensor(positions),
        metadata=metadata,
        logits_indices=as_tensor(logits_indices),
    )
