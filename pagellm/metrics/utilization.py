"""Metrics stage: what bounds the engine, step by step.

From the work of one step (tokens computed, context each token attends to, context
each request reads) and the model's shape, estimate the FLOPs done and the bytes moved
(weights once per step, KV read and written), and divide by the step time: model FLOPs
utilization (MFU) and memory bandwidth utilization (MBU) against the device's ceilings.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.step_batch import StepBatch
from pagellm.model.costs import ModelCosts


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float


def step_cost(model: ModelCosts, batch: StepBatch) -> StepCost:
    """FLOPs of the matmuls, attention and a hybrid's recurrence; bytes of weights (once)
    plus KV read and written, and each computed request's recurrent state read and written."""
    flops = (
        (model.linear_flops_per_token + model.recurrent_flops_per_token) * batch.num_tokens
        + model.attention_flops_per_pair * batch.attention_pairs
        + model.lm_head_flops_per_row * batch.num_sampled_tokens
    )
    moved = (
        model.step_weight_bytes_for(batch.num_tokens)
        + model.kv_bytes_per_token * (batch.context_tokens + batch.num_tokens)
        + 2 * model.state_bytes_per_request * batch.num_reqs
    )
    return StepCost(flops, moved)


@dataclass(frozen=True)
class Ceilings:
    """The device's peaks, and where they came from."""

    flops_per_s: float
    bytes_per_s: float
    source: str  # "measured" or the name of a preset


@dataclass(frozen=True)
class Utilization:
    mfu: float  # achieved FLOP/s over the peak
    mbu: float  # achieved bytes/s over the peak

    @property
    def bound(self) -> str:
        return "memory" if self.mbu >= self.mfu else "compute"

    def describe(self) -> str:
        """The stats line's summary, e.g. 'bound: memory 82% / compute 31%'."""
        first, second = ("memory", "compute") if self.bound == "memory" else ("compute", "memory")
        value = {"memory": self.mbu, "compute": self.mfu}
        return f"bound: {first} {100 * value[first]:.0f}% / {second} {100 * value[second]:.0f}%"

    def hint(self, num_running: int, num_waiting: int, max_num_seqs: int) -> str | None:
        """A short suggestion when one resource is near saturation or clearly idle."""
        if self.mbu >= 0.6 and self.mfu < 0.3:
            if num_waiting == 0 and num_running < max_num_seqs:
                return "memory-bound at small batch: more concurrent requests would raise throughput almost for free"
            return "memory-bound decode: raise max_num_seqs (if KV allows) to amortize weight reads"
        if self.mfu >= 0.6:
            return "compute-bound: the batch is large enough; more concurrency will mostly add latency"
        return None


def utilization(cost: StepCost, seconds: float, ceilings: Ceilings) -> Utilization:
    if seconds <= 0:
        return Utilization(0.0, 0.0)
    return Utilization(cost.flops / seconds / ceilings.flops_per_s, cost.bytes / seconds / ceilings.bytes_per_s)
