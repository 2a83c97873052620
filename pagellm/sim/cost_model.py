"""Sim stage: the interface every step cost model implements.

A cost model maps one step's batch (StepBatch) to the seconds the engine would spend
on it: the forward pass plus everything around it that the step loop waits for
(scheduling, input preparation, sampling, output processing).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pagellm.core.step_batch import StepBatch


@runtime_checkable
class StepCostModel(Protocol):
    """Predicts the duration of one engine step."""

    @property
    def name(self) -> str:
        """A short label for reports ("roofline: Llama-3-8B on H100-SXM")."""
        ...

    def predict(self, batch: StepBatch) -> float:
        """Seconds one step with this batch takes; > 0 for any non-empty batch."""
        ...

    def describe(self) -> dict[str, Any]:
        """The model's parameters, JSON-ready, for the result record."""
        ...
