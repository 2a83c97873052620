"""Worker stage: what a step path is: the step's sequences in, the final hidden states out.

The runner holds the paths of its model in order (step_paths/__init__.py) and runs a
step on the first that applies. A path decides only whether it can compute a step and
computes it; the model family computes, whichever path calls into it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagellm.attention.linear_attention import LinearLayerState
from pagellm.worker.model_inputs import ModelInputs, ScheduledSequence, prepare_model_inputs


@dataclass
class StepInputs:
    """One forward's work: the sequences of the step and the KV cache they read and write."""

    sequences: list[ScheduledSequence]
    kv_caches: list[torch.Tensor]  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
    block_size: int
    device: torch.device | str
    has_adapters: bool = False  # rows under a LoRA adapter (its slots are mapped for this step)
    linear_states: tuple[LinearLayerState, ...] = ()  # a hybrid model's recurrent state, per linear layer
    snapshot_states: tuple[LinearLayerState, ...] = ()  # ... and its snapshots for prefix hits
    # What a path found about this step, by its name: a check two paths ask for (the
    # measured choice and the path itself) runs once.
    checks: dict[str, bool] = field(default_factory=dict)

    @functools.cached_property
    def model_inputs(self) -> ModelInputs:
        """The flat tensors of the step (built once, by the first path that asks)."""
        return prepare_model_inputs(
            self.sequences, self.block_size, self.device, self.linear_states, self.snapshot_states
        )

    @functools.cached_property
    def query_starts(self) -> list[int]:
        """Each sequence's first row in the flat batch, and the number of rows last."""
        starts = [0]
        for sequence in self.sequences:
            starts.append(starts[-1] + len(sequence.token_ids))
        return starts

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]


class StepPath(Protocol):
    """One way to run a forward pass over a step."""

    name: str

    def applies(self, step: StepInputs) -> bool:
        """Whether this path computes this step (exactly as the model defines it)."""
        ...

    def run(self, step: StepInputs) -> torch.Tensor:  # [num_tokens, hidden_size]: after the final norm
        ...


class EagerPath:
    """The model's own forward (PyTorch layers over the measured linear kernels): every step."""

    name = "eager"

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def applies(self, step: StepInputs) -> bool:
        return True

    def run(self, step: StepInputs) -> torch.Tensor:
        inputs = step.model_inputs
        return self._model(inputs.input_ids, inputs.positions, step.kv_caches, inputs.metadata)
