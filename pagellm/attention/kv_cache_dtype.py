"""Attention stage: the KV cache's element type, the model's dtype or an 8-bit float.

`--kv-cache-dtype fp8_e4m3 | fp8_e5m2` stores K and V as torch.float8_e4m3fn /
torch.float8_e5m2: one byte per element, so the same memory holds twice the blocks of a
bf16 cache. The scale is one per tensor and 1.0 (vLLM's default without calibration):
values are stored as they are, saturated to the format's largest finite value (448 for
e4m3, 57344 for e5m2) and rounded to nearest even. 1.0 suffices because K and V stay far
inside e4m3's range: over all 30 layers of the embedded SmolLM2-135M (float32, 6 prompts,
64 greedy tokens each) max |K| (after rotary) was 19.9 (layer 11) and max |V| 12.2 (layer
24), 22x below 448; a value above it would be clipped rather than become NaN or inf.
Readers widen the stored values exactly to their compute type (every fp8 value is a bf16
and a float16 value).

Every writer of the cache rounds the same way: torch here (`to_cache_dtype`), the C
kernels (csrc/fp8.h) and the Triton store kernel (integer rounding, identical bits).
"""

from __future__ import annotations

import torch

# config/'s dtype names (the model's, and the cache's fp8 ones) as torch dtypes.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# The element-type codes of the C kernels (csrc/fp8.h ELEM_*).
ELEMENT_TYPES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float8_e4m3fn: 2,
    torch.float8_e5m2: 3,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved dtype name (EngineConfig.dtype, .kv_cache_dtype)."""
    return TORCH_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the cache stores it: fp8 saturated to the format's range (torch's own cast
    turns e5m2 overflow into inf) and rounded to nearest even; other types plainly cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded as the cache would store it, back in x's dtype (what a reader of the
    cache sees)."""
    if not is_fp8(cache_dtype):
        return x
    return to_cache_dtype(x, cache_dtype).to(x.dtype)


def copyable(cache: torch.Tensor) -> torch.Tensor:
    """A view of the cache that index_copy_ accepts: PyTorch has no fp8 index_copy_ on
    CPU, so 8-bit caches are copied as their bytes (copies move whole values)."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
