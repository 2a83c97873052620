"""Worker stage: a hybrid model's recurrent state, one row (slot) per running request in
every linear-attention layer, and the snapshots of it kept for prefix hits (the slots are
the scheduler's: core/state_slots.py, core/state_snapshots.py)."""

from __future__ import annotations

import torch

from pagellm.attention.linear_attention import LinearLayerState
from pagellm.config.model import ModelConfig
from pagellm.core.scheduler_output import SchedulerOutput


def allocate_linear_states(config: ModelConfig, num_slots: int, device: torch.device | str) -> tuple[LinearLayerState, ...]:
    """Zeroed float32 states of `num_slots` slots for each linear-attention layer of
    `config` (one rank's heads under tensor parallelism); () for a model without any."""
    spec = config.linear_attention
    if spec is None or num_slots == 0:
        return ()
    return tuple(
        LinearLayerState(
            conv=torch.zeros(num_slots, spec.conv_dim, spec.conv_kernel_size - 1, device=device),
            recurrent=torch.zeros(num_slots, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim, device=device),
        )
        for _ in spec.layers
    )


def reset_slots(states: tuple[LinearLayerState, ...], slots: list[int]) -> None:
    """The state of requests that start from their first token: zeros."""
    if not states or not slots:
        return
    index = torch.tensor(slots, device=states[0].conv.device)
    for state in states:
        state.conv.index_fill_(0, index, 0.0)
        state.recurrent.index_fill_(0, index, 0.0)


def copy_slots(
    states: tuple[LinearLayerState, ...],
    pairs: list[tuple[int, int]],
    target: tuple[LinearLayerState, ...] | None = None,
) -> None:
    """(source, target) slot copies within `states` (a forked completion starts from its
    parent's state), or from `states` into `target` (a snapshot into a request's slot, a
    state to or from the host slots of swapped-out requests: either may be on the host)."""
    if not states or not pairs:
        return
    source_index = torch.tensor([src for src, _ in pairs], device=states[0].conv.device)
    into_states = target or states
    target_index = torch.tensor([dst for _, dst in pairs], device=into_states[0].conv.device)
    for source, into in zip(states, into_states, strict=True):
        into.conv.index_copy_(0, target_index, source.conv.index_select(0, source_index).to(into.conv.device))
        into.recurrent.index_copy_(0, target_index, source.recurrent.index_select(0, source_index).to(into.recurrent.device))


def fill_state_slots(
    states: tuple[LinearLayerState, ...],
    snapshots: tuple[LinearLayerState, ...],
    host: tuple[LinearLayerState, ...],
    scheduler_output: SchedulerOutput,
) -> None:
    """A step's state copies, before its forward pass, in the one order that keeps a slot
    freed and reused in the step right: swap-outs first (their slots may be the step's to
    reuse), then forks' copies (a parent that finished may have left its slot to a new
    request), then what fills the step's new slots: swap-ins, snapshots, zeros for the
    requests that start at their first token."""
    if not states:
        return
    swaps = scheduler_output.state_swaps
    copy_slots(states, swaps.out, target=host)
    copy_slots(states, scheduler_output.state_copies)
    copy_slots(host, swaps.into, target=states)
    copy_slots(snapshots, scheduler_output.state_restores, target=states)
    reset_slots(
        states,
        [new.state_slot for new in scheduler_output.scheduled_new_reqs
         if new.num_computed_tokens == 0 and new.state_slot is not None],
    )  # fmt: skip


def state_rows(states: tuple[LinearLayerState, ...], slots: list[int]) -> torch.Tensor:
    """The states of `slots` as bytes on the host, one row per slot: layer by layer, the
    conv state then the recurrent state (the prefix-cache tier's snapshot payload)."""
    index = torch.tensor(slots, device=states[0].conv.device)
    parts = [
        part.index_select(0, index).reshape(len(slots), -1)
        for state in states
        for part in (state.conv, state.recurrent)
    ]
    return torch.cat(parts, dim=1).cpu().view(torch.uint8)


def load_state_rows(states: tuple[LinearLayerState, ...], slots: list[int], rows: torch.Tensor) -> None:
    """Write `rows` (state_rows' layout, bytes on the host) into the states of `slots`."""
    values = rows.view(torch.float32)
    index = torch.tensor(slots, device=states[0].conv.device)
    offset = 0
    for state in states:
        for part in (state.conv, state.recurrent):
            width = part[0].numel()
            piece = values[:, offset : offset + width].reshape(len(slots), *part.shape[1:])
            part.index_copy_(0, index, piece.to(part.device))
            offset += width
