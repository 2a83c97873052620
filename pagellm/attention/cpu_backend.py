"""Attention stage, CPU: decode rows through the C kernel that reads the paged cache
in place; prefill chunks through the reference path (PyTorch SDPA).

Decode attention is memory-bound: the reference path gathers every context into a
padded copy, then multiplies; the kernel reads each K/V row once where it lies.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend, write_kv_to_cache

_SUPPORTED_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class _NativePlan:
    """What every layer of one step passes to the kernel."""

    rows: torch.Tensor  # [num_decodes] int64 row of the flat batch
    reqs: torch.Tensor  # [num_decodes] int64 index into block_tables
    seq_lens: torch.Tensor  # [num_decodes] int64
    max_seq_len: int
    others: list[int]  # requests with more than one query token (prefill chunks)
    num_threads: int


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: ctypes.CDLL) -> None:
        self._kernels = kernels
        self._workspace = torch.empty(0, dtype=torch.float32)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if not _kernel_can_run(query, kv_cache):
            return super().forward(query, key, value, kv_cache, metadata, scale)
        write_kv_to_cache(key, value, kv_cache, metadata.slot_mapping)
        if metadata.backend_plan is None:
            metadata.backend_plan = _plan_step(metadata)
        plan: _NativePlan = metadata.backend_plan
        output = torch.empty(query.shape, dtype=query.dtype)
        if plan.rows.numel():
            self._decode(query, kv_cache, metadata, plan, scale, output)
        for r in plan.others:
            self._one_request(query, key, value, kv_cache, metadata, r, scale, output)
        return output

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: _NativePlan,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        num_heads, head_dim = query.shape[1:]
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        needed = plan.num_threads * plan.max_seq_len * num_heads
        if self._workspace.numel() < needed:
            self._workspace = torch.empty(needed, dtype=torch.float32)
        tables = metadata.block_tables
        self._kernels.paged_decode_attention(
            query.data_ptr(), query.stride(0),
            kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            tables.data_ptr(), tables.stride(0),
            plan.rows.data_ptr(), plan.reqs.data_ptr(), plan.seq_lens.data_ptr(), plan.rows.numel(),
            num_heads, num_kv_heads, head_dim, block_size,
            scale, _SUPPORTED_DTYPES[query.dtype], plan.num_threads, plan.max_seq_len,
            output.data_ptr(), output.stride(0), self._workspace.data_ptr(),
        )  # fmt: skip


def _kernel_can_run(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The kernel's layout assumptions; anything else takes the reference path."""
    return (
        query.device.type == "cpu"
        and query.dtype in _SUPPORTED_DTYPES
        and kv_cache.dtype == query.dtype
        and kv_cache.is_contiguous()
        and query.stride(2) == 1
        and query.stride(1) == query.shape[2]
    )


def _plan_step(metadata: AttentionMetadata) -> _NativePlan:
    starts, seq_lens = metadata.query_start_loc, metadata.seq_lens
    decodes = [r for r in range(metadata.num_reqs) if starts[r + 1] - starts[r] == 1]
    others = [r for r in range(metadata.num_reqs) if starts[r + 1] - starts[r] != 1]
    assert metadata.block_tables.dtype == torch.int64 and metadata.block_tables.is_contiguous()
    lengths = [seq_lens[r] for r in decodes]
    return _NativePlan(
        rows=torch.tensor([starts[r] for r in decodes], dtype=torch.int64),
        reqs=torch.tensor(decodes, dtype=torch.int64),
        seq_lens=torch.tensor(lengths, dtype=torch.int64),
        max_seq_len=max(lengths, default=0),
        others=others,
        num_threads=torch.get_num_threads(),
    )
