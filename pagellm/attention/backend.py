"""Attention stage: the interface every attention implementation provides.

A backend writes the step's new K/V into the paged cache (by slot mapping) and computes
causal attention for a flattened batch in which each request reads its whole context
through its block table. The model knows nothing else about the cache layout.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.config import ATTENTION_BACKENDS
from pagellm.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flat batch and where its K/V lives.

    Requests appear in the flat batch in order; request r owns rows
    query_start_loc[r] : query_start_loc[r + 1]. Its new tokens are the last
    (query_start_loc[r + 1] - query_start_loc[r]) positions of a context of
    seq_lens[r] tokens, so the causal mask is offset by the tokens computed earlier.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int64
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs] context length including this step's tokens
    # What a backend derives from the rest once per step (every layer reuses it).
    backend_plan: Any = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


class AttentionBackend(ABC):
    """One attention implementation (reference torch, fast CPU, Triton...)."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store key/value in the cache, then attend over each request's context."""


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called `name`: "torch" is the reference implementation, "cpu" decodes
    through the compiled CPU kernel, "triton" runs the Triton kernels (GPU), "auto" picks
    the fastest one that works on `device`."""
    from pagellm.attention.torch_backend import TorchAttentionBackend

    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r} (available: {', '.join(map(repr, ATTENTION_BACKENDS))})")
    device_type = torch.device(device).type
    if name == "triton" or (name == "auto" and device_type == "cuda"):
        try:
            from pagellm.attention.triton_backend import TritonAttentionBackend
        except ImportError as e:
            if name == "triton":
                raise ConfigError("the 'triton' attention backend needs Triton: pip install 'pagellm[gpu]'") from e
            logger.warning("Triton is not installed (%s): attention takes the PyTorch path", e)
            return TorchAttentionBackend()
        return TritonAttentionBackend()
    if name == "torch" or device_type != "cpu":
        return TorchAttentionBackend()
    from pagellm.attention.cpu_backend import CpuAttentionBackend
    from pagellm.kernels.build import load_kernels

    kernels = load_kernels()
    if kernels is not None:
        return CpuAttentionBackend(kernels)
    if name == "cpu":
        raise ConfigError("the 'cpu' attention backend needs a C compiler (cc) to build its kernel")
    return TorchAttentionBackend()
