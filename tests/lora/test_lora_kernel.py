"""The C kernel of the adapters' products (csrc/lora.c), in every kernel build the host runs,
against the same products in torch (LoRASlots with no kernel): float32 and bf16 rows, float32
and bf16 slots, several adapters in one step, block-diagonal fused layers, an adapter that
leaves the layer alone, and more rows than one work item."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels.build import load_kernels
from pagellm.lora.adapter import LayerAdapter, LoRATarget
from pagellm.lora.slots import LoRAKernel, LoRAMapping, LoRASlots

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="the native kernels need x86-64 with AVX2 and a C compiler")
TARGET = LoRATarget(96, (64, 32, 32))  # a qkv-like fused layer


def _adapter(seed: int, ranks: tuple[int, int, int]) -> LayerAdapter:
    generator = torch.Generator().manual_seed(seed)
    total = sum(ranks)
    a = torch.randn(total, TARGET.in_features, generator=generator)
    b = torch.zeros(TARGET.out_features, total)
    pieces, col, row = [], 0, 0
    for rank, width in zip(ranks, TARGET.shards):
        if rank:
            b[row : row + width, col : col + rank] = torch.randn(width, rank, generator=generator)
            pieces.append((col, col + rank, row, row + width))
        col += rank
        row += width
    return LayerAdapter(a, b, torch.full((total,), 0.5), pieces)


@pytest.mark.parametrize("slot_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_torch(dtype, slot_dtype, kernel_isa):
    kernel = LoRAKernel.make([TARGET])
    with_kernel, in_torch = (LoRASlots(TARGET, 3, 16, torch.device("cpu"), k, slot_dtype) for k in (kernel, None))
    for slots in (with_kernel, in_torch):
        slots.load(0, _adapter(1, (8, 0, 8)))  # q and v only
        slots.load(2, _adapter(2, (16, 16, 16)))
        slots.load(1, None)  # a slot whose adapter leaves this layer alone
    # Rows 0-2 base, 3-13 slot 2 (more than one work item), 14-15 slot 1, 16 slot 0.
    mapping = LoRAMapping(((2, 3, 14), (1, 14, 16), (0, 16, 17)))
    x = torch.randn(17, TARGET.in_features).to(dtype)
    base = torch.randn(17, TARGET.out_features).to(dtype)
    results = []
    for slots in (with_kernel, in_torch):
        slots.mapping = mapping
        results.append(slots.add_to(x, base.clone()))
    ours, reference = results
    assert kernel.run(with_kernel, x, base.clone(), mapping)  # the C kernel ran, not the torch fallback
    assert torch.equal(ours[:3], base[:3]) and torch.equal(ours[14:16], base[14:16])
    assert not torch.equal(ours[3:14], base[3:14]) and not torch.equal(ours[16:], base[16:])
    tolerance = 1e-5 if dtype is torch.float32 else 2e-2  # bf16: the sum rounded once, by each
    torch.testing.assert_close(ours.float(), reference.float(), rtol=tolerance, atol=tolerance * 10)
