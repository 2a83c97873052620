"""Sim stage: the roofline step cost model (model shape x GPU datasheet).

Each kind of work in a step takes the longer of its compute time (FLOPs over the
achievable FLOP/s) and its memory time (bytes over the achievable bandwidth); the kinds
run one after the other, so their times add:

- weight matmuls: every computed token through every layer; the weights are read once
  per step, which is why a small decode batch is memory-bound and a large one is not;
- attention: (query, key) pairs; reads the cached KV of every request and writes the
  new tokens' KV;
- a hybrid's linear-attention layers: the recurrence per computed token; reads and
  writes each computed request's recurrent state (float32, fixed size);
- the LM head, only for rows that are sampled;
- host <-> device copies of swapped blocks over the host link;
- a fixed per-step overhead (CPU work the GPU waits for: scheduling, input preparation,
  sampling and output processing that is not overlapped);
- with tensor parallelism, the group's all-reduces and the logits gather
  (tensor_parallel_costs.py). The FLOPs and bytes are then one GPU's share (`costs` is
  tensor_parallel.rank_costs), since every GPU of the group works at once.

The efficiency factors are assumptions, not measurements: the fraction of datasheet
peak that real kernels reach (large BF16 GEMMs typically reach 60-80% of dense peak,
streaming kernels 80-90% of peak bandwidth). They are flags, so a measured value can
replace them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from pagellm.errors import ConfigError
from pagellm.sim.gpu_presets import GpuSpec
from pagellm.model.costs import ModelCosts
from pagellm.core.step_batch import StepBatch
from pagellm.sim.tensor_parallel_costs import TensorParallelComm


@dataclass(frozen=True)
class RooflineParams:
    compute_efficiency: float = 0.7
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.001

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ConfigError(f"{name} must be in (0, 1], got {value}")
        if not self.step_overhead_s >= 0.0:
            raise ConfigError(f"step_overhead_s must be >= 0, got {self.step_overhead_s}")


class StepTime(NamedTuple):
    """One step's predicted seconds, by kind of work."""

    linear_s: float
    attention_s: float
    lm_head_s: float
    swap_s: float
    overhead_s: float
    memory_bound: bool  # the weight matmuls were limited by bandwidth, not FLOPs
    comm_s: float = 0.0  # tensor-parallel all-reduces and logits gather
    recurrent_s: float = 0.0  # a hybrid's linear-attention recurrence and state traffic

    @property
    def total_s(self) -> float:
        return (
            self.linear_s + self.attention_s + self.lm_head_s + self.swap_s + self.overhead_s
            + self.comm_s + self.recurrent_s
        )  # fmt: skip


class RooflineCostModel:
    """StepCostModel from a model's shape and a GPU's peak FLOP/s and bandwidth.

    `costs` are one GPU's: the whole model's without tensor parallelism, its share with
    it (then `comm` prices the collectives).
    """

    def __init__(
        self,
        model_name: str,
        costs: ModelCosts,
        gpu: GpuSpec,
        params: RooflineParams = RooflineParams(),
        comm: TensorParallelComm | None = None,
    ) -> None:
        self.model_name = model_name
        self.costs = costs
        self.gpu = gpu
        self.params = params
        self.comm = comm
        self._flops = gpu.peak_flops * params.compute_efficiency
        self._bandwidth = gpu.memory_bandwidth * params.bandwidth_efficiency
        # Per-step constants, so that predict() is a handful of multiplications.
        self._head_memory_s = costs.lm_head_weight_bytes / self._bandwidth
        self._linear_s_per_token = costs.linear_flops_per_token / self._flops
        self._head_s_per_row = costs.lm_head_flops_per_row / self._flops
        self._attention_s_per_pair = costs.attention_flops_per_pair / self._flops
        self._kv_s_per_token = costs.kv_bytes_per_token / self._bandwidth
        self._swap_s_per_token = costs.kv_bytes_per_token / gpu.host_link_bandwidth
        self._recurrent_s_per_token = costs.recurrent_flops_per_token / self._flops
        self._state_s_per_request = 2.0 * costs.state_bytes_per_request / self._bandwidth  # read and written

    @property
    def name(self) -> str:
        name = f"roofline: {self.model_name} on {self.gpu.name}"
        if self.comm is not None:
            link = self.comm.link
            name += f", TP={link.tensor_parallel_size} over {link.interconnect.name}"
        return name

    def breakdown(self, batch: StepBatch) -> StepTime:
        num_tokens = batch.num_tokens
        linear_compute_s = num_tokens * self._linear_s_per_token
        # Every dense matrix once; of a mixture of experts, the experts its tokens use.
        linear_memory_s = self.costs.linear_bytes_read(num_tokens) / self._bandwidth
        linear_s = max(linear_compute_s, linear_memory_s) if num_tokens else 0.0
        # Per kind of layer (global, or a sliding window's), weighted by its share of them.
        windows = self.costs.layer_windows
        pairs = sum(share * batch.attention_pairs_within(window) for window, share in windows)
        # Reads of the cached context (prefix hits and earlier chunks too) and writes of
        # the new tokens' K and V.
        kv_tokens = sum(share * batch.context_read_within(window) for window, share in windows) + num_tokens
        attention_s = max(pairs * self._attention_s_per_pair, kv_tokens * self._kv_s_per_token)
        rows = batch.num_sampled_tokens
        head_s = max(rows * self._head_s_per_row, self._head_memory_s) if rows else 0.0
        return StepTime(
            linear_s,
            attention_s,
            head_s,
            batch.num_swapped_tokens * self._swap_s_per_token,
            self.params.step_overhead_s,
            linear_compute_s < linear_memory_s,
            self.comm.seconds(num_tokens, rows) if self.comm is not None else 0.0,
            max(num_tokens * self._recurrent_s_per_token, batch.num_reqs * self._state_s_per_request),
        )

    def predict(self, batch: StepBatch) -> float:
        return self.breakdown(batch).total_s

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "roofline",
            "model": self.model_name,
            "gpu": asdict(self.gpu),
            **asdict(self.params),
            **({"tensor_parallel": self.comm.link.describe()} if self.comm is not None else {}),
        }
