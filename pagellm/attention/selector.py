"""Attention stage: which backend runs (the interface is backend.py, the backends sit
beside this module; this is the one place that knows them all).

Triton and the compiled CPU kernel are imported only when chosen: Triton may not be
installed, and the CPU kernel is compiled on first use.
"""

from __future__ import annotations

import logging

import torch

from pagellm.attention.backend import AttentionBackend
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.config.engine_args import ATTENTION_BACKENDS
from pagellm.errors import ConfigError

logger = logging.getLogger(__name__)


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called `name`: "torch" is the reference implementation, "cpu" decodes
    through the compiled CPU kernel, "triton" runs the Triton kernels (GPU), "auto" picks
    the fastest one that works on `device`."""
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
