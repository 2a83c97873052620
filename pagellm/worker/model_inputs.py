"""Worker stage: flatten one step's scheduled work into the model's input tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.linear_attention import LinearAttentionMetadata, LinearLayerState


@dataclass(frozen=True)
class ScheduledSequence:
    """One request's share of a step, as the runner sees it."""

    token_ids: list[int]  # tokens whose K/V is computed this step
    start_position: int  # tokens of this request already in the cache
    block_ids: list[list[int]]  # the request's block tables, one per KV cache group (each covers the step)
    needs_logits: bool  # whether the step's last token must produce a next token
    state_slot: int | None = None  # a hybrid model: the request's recurrent-state slot
    # ... and the snapshots of it to write: (tokens of this sequence before it, snapshot slot).
    state_saves: tuple[tuple[int, int], ...] = ()


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata  # of KV cache group 0; the others' in metadata.group_metadata
    logits_indices: torch.Tensor  # [num_sampled] rows of the flat batch that need logits


def prepare_model_inputs(
    sequences: list[ScheduledSequence],
    block_size: int,
    device: torch.device | str,
    linear_states: tuple[LinearLayerState, ...] = (),
    snapshot_states: tuple[LinearLayerState, ...] = (),
) -> ModelInputs:
    """The step's flat tensors; with `linear_states` (a hybrid model's recurrent state,
    per linear-attention layer) the metadata also says each request's slot."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    for seq in sequences:
        end = seq.start_position + len(seq.token_ids)
        input_ids.extend(seq.token_ids)
        positions.extend(range(seq.start_position, end))
        query_start_loc.append(len(input_ids))
        seq_lens.append(end)
        if seq.needs_logits:
            logits_indices.append(len(input_ids) - 1)

    def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    num_groups = len(sequences[0].block_ids)
    metadata = [
        AttentionMetadata(
            slot_mapping=as_tensor(_slots(sequences, group, block_size)),
            block_tables=as_tensor(_padded_tables(sequences, group, block_size)),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
        )
        for group in range(num_groups)
    ]
    metadata[0].group_metadata = tuple(metadata[1:])
    if linear_states:
        slots = [seq.state_slot for seq in sequences]
        assert all(slot is not None for slot in slots), "every request of a hybrid model holds a state slot"
        saves = [list(seq.state_saves) for seq in sequences]
        metadata[0].linear = LinearAttentionMetadata(slots, linear_states, saves, snapshot_states)  # type: ignore[arg-type]
    return ModelInputs(
        input_ids=as_tensor(input_ids),
        positions=as_tensor(positions),
        metadata=metadata[0],
        logits_indices=as_tensor(logits_indices),
    )


def _slots(sequences: list[ScheduledSequence], group: int, block_size: int) -> list[int]:
    """Where each token of the step writes its K/V in the group's blocks."""
    slots: list[int] = []
    for seq in sequences:
        table = seq.block_ids[group]
        end = seq.start_position + len(seq.token_ids)
        assert len(table) * block_size >= end, "block table too short for the step"
        for pos in range(seq.start_position, end):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots


def _padded_tables(sequences: list[ScheduledSequence], group: int, block_size: int) -> list[list[int]]:
    # Padding entries are never read: each request reads only ceil(seq_len/block) blocks.
    max_blocks = max(len(seq.block_ids[group]) for seq in sequences)
    return [seq.block_ids[group] + [0] * (max_blocks - len(seq.block_ids[group])) for seq in sequences]
