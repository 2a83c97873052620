"""Sim stage: tensor parallelism in the cost model: one GPU's share of the model,
and the time its all-reduces take.

The split is the engine's (config/parallel.py), Megatron-LM's as vLLM lays it out:
q/k/v and gate/up are split by columns
(attention heads, MLP rows), o_proj and down_proj by rows, so each decoder layer ends its
attention and its MLP with an all-reduce of the [num_tokens, hidden_size] activations.
The embedding and the LM head are split by vocabulary: the embedding lookup ends with one
more all-reduce, and the logits of the sampled rows are gathered onto the first GPU.

KV heads are split like the query heads while there are at least as many as GPUs; with
fewer (Llama-3-70B's 8 at TP=16, or 2 at TP=4), each GPU holds one KV head, replicated
TP / num_kv_heads times, so each GPU's KV cache is 1 / num_kv_heads of the model's KV
rather than 1 / TP, and a KV block costs more memory per GPU than the split suggests.

Assumed, and not modelled: the all-reduces do not overlap with compute (each sits on the
critical path between two matmuls, as in vLLM); every GPU of the group finishes each
matmul at the same time (even split); TP stays inside one node (the interconnect presets
are intra-node links), so MAX_TENSOR_PARALLEL_SIZE is a node of 8 GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.config.model import ModelConfig
from pagellm.config import parallel
from pagellm.config.parallel import rank_model_config
from pagellm.errors import ConfigError
from pagellm.model.costs import ModelCosts
from pagellm.sim.interconnect_presets import InterconnectSpec

# One NVLink/NVSwitch domain of the usual 8-GPU server.
MAX_TENSOR_PARALLEL_SIZE = 8
# Fraction of the per-direction link bandwidth NCCL's ring all-reduce reaches on large
# messages: an assumption (large-message nccl-tests bus bandwidth on NVLink nodes is
# commonly reported at roughly 70-85% of the per-direction figure), replaced by
# --allreduce-efficiency with a measured value.
DEFAULT_ALLREDUCE_EFFICIENCY = 0.8


def tp_split_error(config: ModelConfig, tensor_parallel_size: int) -> str | None:
    """Why `config` cannot be split over `tensor_parallel_size` GPUs of one node (None:
    it can): the engine's rule (config/parallel.py), within one node."""
    if tensor_parallel_size > MAX_TENSOR_PARALLEL_SIZE:
        return (
            f"TP={tensor_parallel_size} spans more than one node of {MAX_TENSOR_PARALLEL_SIZE} GPUs; "
            "inter-node tensor parallelism is not modelled"
        )
    return parallel.tp_split_error(config, tensor_parallel_size)


def rank_costs(config: ModelConfig, dtype_bytes: float, tensor_parallel_size: int) -> ModelCosts:
    """FLOPs and bytes of one GPU of the group (TP=1: the whole model's)."""
    error = tp_split_error(config, tensor_parallel_size)
    if error is not None:
        raise ConfigError(error)
    return ModelCosts.from_config(rank_model_config(config, tensor_parallel_size), dtype_bytes)


def ring_all_reduce_seconds(
    num_bytes: float, num_ranks: int, bandwidth: float, latency_s: float
) -> float:
    """One ring all-reduce of `num_bytes` per GPU: each GPU sends (and receives)
    2 * (n - 1) / n of the buffer (reduce-scatter, then all-gather) over its
    per-direction `bandwidth` (bytes/s), plus the fixed `latency_s`. One GPU: nothing."""
    if num_ranks <= 1:
        return 0.0
    return 2.0 * (num_ranks - 1) / num_ranks * num_bytes / bandwidth + latency_s


def ring_gather_seconds(
    num_bytes: float, num_ranks: int, bandwidth: float, latency_s: float
) -> float:
    """Gathering `num_bytes` in all (each GPU holding 1/n of it): (n - 1) / n of the
    bytes cross each link once."""
    if num_ranks <= 1:
        return 0.0
    return (num_ranks - 1) / num_ranks * num_bytes / bandwidth + latency_s


@dataclass(frozen=True)
class TensorParallelLink:
    """A tensor-parallel group and the link its all-reduces run over."""

    tensor_parallel_size: int
    interconnect: InterconnectSpec
    allreduce_efficiency: float = DEFAULT_ALLREDUCE_EFFICIENCY
    allreduce_latency_s: float | None = None  # None: the interconnect preset's assumption

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}"
            )
        if not 0.0 < self.allreduce_efficiency <= 1.0:
            raise ConfigError(
                f"--allreduce-efficiency must be in (0, 1], got {self.allreduce_efficiency}"
            )
        if self.allreduce_latency_s is not None and not self.allreduce_latency_s >= 0.0:
            raise ConfigError(
                f"--allreduce-latency-us must be >= 0, got {self.allreduce_latency_s * 1e6}"
            )

    @property
    def latency_s(self) -> float:
        if self.allreduce_latency_s is not None:
            return self.allreduce_latency_s
        return self.interconnect.latency_us * 1e-6

    @property
    def bandwidth(self) -> float:
        """Achieved per-direction bytes/s per GPU, the ring formula's bandwidth."""
        return self.interconnect.unidirectional_bandwidth * self.allreduce_efficiency

    def describe(self) -> dict[str, Any]:
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "interconnect": self.interconnect.name,
            "interconnect_unidirectional_gbs": self.interconnect.unidirectional_gbs,
            "allreduce_efficiency": self.allreduce_efficiency,
            "allreduce_latency_us": round(self.latency_s * 1e6, 3),
        }


class TensorParallelComm:
    """Seconds a step spends in the group's collectives."""

    def __init__(self, config: ModelConfig, dtype_bytes: float, link: TensorParallelLink) -> None:
        self.link = link
        tp = link.tensor_parallel_size
        # Two per decoder layer (after o_proj, after down_proj) and one after the
        # vocab-parallel embedding lookup.
        self.num_all_reduces = 2 * config.num_hidden_layers + 1
        bandwidth, latency = link.bandwidth, link.latency_s
        bytes_per_token = config.hidden_size * dtype_bytes
        # Split into the bandwidth part (per token) and the latency part (per call), so
        # that seconds() is two multiplications.
        self._all_reduce_s_per_token = ring_all_reduce_seconds(bytes_per_token, tp, bandwidth, 0.0)
        self._all_reduce_latency_s = latency if tp > 1 else 0.0
        padded_vocab = -(-config.vocab_size // tp) * tp
        self._gather_s_per_row = ring_gather_seconds(padded_vocab * dtype_bytes, tp, bandwidth, 0.0)

    def all_reduce_seconds(self, num_tokens: int) -> float:
        """All the step's all-reduces of [num_tokens, hidden_size] activations."""
        if num_tokens == 0:
            return 0.0
        return self.num_all_reduces * (
            num_tokens * self._all_reduce_s_per_token + self._all_reduce_latency_s
        )

    def gather_seconds(self, num_sampled_rows: int) -> float:
        """The gather of the sampled rows' logits onto the first GPU."""
        if num_sampled_rows == 0:
            return 0.0
        return num_sampled_rows * self._gather_s_per_row + self._all_reduce_latency_s

    def seconds(self, num_tokens: int, num_sampled_rows: int) -> float:
        return self.all_reduce_seconds(num_tokens) + self.gather_seconds(num_sampled_rows)
