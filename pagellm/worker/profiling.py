"""Worker stage: measure the peak device memory of the largest step (GPU sizing)."""

from __future__ import annotations

import logging

import torch

from pagellm.config import SchedulerConfig
from pagellm.model.llama import LlamaForCausalLM
from pagellm.worker.kv_cache import allocate_kv_caches
from pagellm.worker.model_inputs import ScheduledSequence, prepare_model_inputs

logger = logging.getLogger(__name__)


@torch.inference_mode()
def profile_peak_memory(
    model: LlamaForCausalLM,
    scheduler_config: SchedulerConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Bytes in use at the peak of a forward over the largest batch the scheduler allows.

    The batch has max_num_batched_tokens tokens spread over up to max_num_seqs requests,
    all of which need logits, so the peak includes the largest logits tensor.
    """
    num_tokens = scheduler_config.max_num_batched_tokens
    num_seqs = min(scheduler_config.max_num_seqs, num_tokens)
    per_seq = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
    blocks_needed = sum(-(-n // block_size) for n in per_seq)
    kv = allocate_kv_caches(model.config, blocks_needed + 1, block_size, dtype, device)
    sequences, next_block = [], 1
    for n in per_seq:
        count = -(-n // block_size)
        sequences.append(
            ScheduledSequence([0] * n, 0, list(range(next_block, next_block + count)), True)
        )
        next_block += count
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    inputs = prepare_model_inputs(sequences, block_size, device)
    hidden = model(inputs.input_ids, inputs.positions, kv, inputs.metadata)
    model.compute_logits(hidden[inputs.logits_indices])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    kv_bytes = sum(t.numel() * t.element_size() for t in kv)
    del kv, hidden
    torch.cuda.empty_cache()
    # The profiling KV cache is not part of the steady state; the real one replaces it.
    used = peak - kv_bytes
    logger.info("profiled peak memory: %.2f GiB (weights + activations)", used / (1 << 30))
    return used
