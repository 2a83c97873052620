"""Worker stage: measure what the GPU holds besides the KV cache (its size follows)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagellm.config import SchedulerConfig
from pagellm.config.units import GiB
from pagellm.model.llama import LlamaForCausalLM
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.worker.kv_cache import allocate_kv_caches, distinct_tensors
from pagellm.worker.recurrent_state import allocate_linear_states
from pagellm.worker.model_inputs import ScheduledSequence, prepare_model_inputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory that is not KV cache, measured before the cache is allocated."""

    weights_bytes: int
    activation_bytes: int  # peak of the largest step, above the weights
    graph_bytes: int  # the largest captured decode batch's activations (the graphs' own pool)
    non_torch_bytes: int  # CUDA context, library workspaces: used, but not by torch's allocator

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.graph_bytes + self.non_torch_bytes

    def describe(self) -> str:
        return (
            f"weights {self.weights_bytes / GiB:.2f} GiB + activations {self.activation_bytes / GiB:.2f} GiB"
            f" + CUDA graphs {self.graph_bytes / GiB:.2f} GiB + outside torch {self.non_torch_bytes / GiB:.2f} GiB"
        )


@torch.inference_mode()
def profile_memory(
    model: LlamaForCausalLM,
    scheduler_config: SchedulerConfig,
    block_size: int,
    kv_cache_dtype: torch.dtype,  # of the throwaway cache the profiling steps write
    device: torch.device,
    graph_batch_size: int | None = None,
) -> MemoryProfile:
    """Run the largest step the scheduler allows (max_num_batched_tokens over up to
    max_num_seqs requests, all needing logits), and the largest decode batch that will be
    captured as a graph, on a throwaway cache; report the peaks above the weights."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    num_tokens = scheduler_config.max_num_batched_tokens
    num_seqs = min(scheduler_config.max_num_seqs, num_tokens)
    activations = _step_peak(model, _split(num_tokens, num_seqs), block_size, kv_cache_dtype, device) - weights
    graphs = 0
    if graph_batch_size:
        # Captured graphs keep their activations in a private pool, beside the cache
        # that serves eager steps, so a decode batch's peak is needed a second time.
        graphs = _step_peak(model, [1] * graph_batch_size, block_size, kv_cache_dtype, device) - weights
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    profile = MemoryProfile(weights, max(0, activations), max(0, graphs), non_torch)
    logger.info("memory besides the KV cache: %s", profile.describe())
    return profile


def _split(num_tokens: int, num_seqs: int) -> list[int]:
    return [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]


def _step_peak(
    model: LlamaForCausalLM,
    query_lens: list[int],
    block_size: int,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Peak bytes allocated during one forward + logits over these prompts, not counting
    the throwaway KV cache (and a hybrid's recurrent state) it writes."""
    blocks_needed = sum(-(-n // block_size) for n in query_lens)
    kv = allocate_kv_caches(model.config, blocks_needed + 1, block_size, kv_cache_dtype, device)
    sequences, next_block = [], 1
    num_groups = len(kv_cache_layout(model.config).groups)
    for n in query_lens:
        count = -(-n // block_size)
        # Every KV cache group writes the same blocks: only the memory is measured.
        table = list(range(next_block, next_block + count))
        sequences.append(ScheduledSequence([0] * n, 0, [table] * num_groups, True, len(sequences)))
        next_block += count
    linear_states = allocate_linear_states(model.config, len(query_lens), device)  # a hybrid's: one slot each
    torch.cuda.reset_peak_memory_stats(device)
    inputs = prepare_model_inputs(sequences, block_size, device, linear_states)
    hidden = model(inputs.input_ids, inputs.positions, kv, inputs.metadata)
    if model.config.has_lm_head:
        model.compute_logits(hidden[inputs.logits_indices])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    kv_bytes = sum(t.numel() * t.element_size() for t in distinct_tensors(kv))
    kv_bytes += sum(t.numel() * t.element_size() for state in linear_states for t in (state.conv, state.recurrent))
    del kv, hidden, inputs, linear_states
    torch.cuda.empty_cache()
    return peak - kv_bytes
