"""Lora stage: adapters resident beside the model, in a fixed pool of slots, applied per row.

Every adaptable linear layer gets, once, room for `max_loras` adapters of the largest rank
allowed: A [slots, ranks, in] with each rank's scaling folded in, B^T [slots, ranks, out],
and each slot's blocks (a fused layer's projections), zero where an adapter has fewer
ranks or leaves the layer alone. Loading an adapter copies it into a free slot (or the
least recently used one no row of the step needs); a step never allocates. The base
weights are never touched: a layer computes its base output as before and adds, for each
adapter present in the step, (x_rows scaling A^T) B^T to that adapter's rows, whatever the
base weight's type (bf16, quantized GGUF blocks): every adapter in one C call on the CPU
(csrc/lora.c), one shrink and one expand per adapter in torch elsewhere.

The worker's LoRAManager keeps the adapters read from disk in host memory (least recently
used first out, `max_cpu_loras`), and before each step makes the step's adapters resident
and tells the model which rows run under which slot (LoRAMapping).
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagellm.config.model import ModelConfig
from pagellm.kernels.build import load_kernels
from pagellm.lora.adapter import LayerAdapter, LoRAAdapter, LoRATarget, load_lora_adapter, lora_targets
from pagellm.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagellm.model.tensor_parallel import TPLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAMapping:
    """Which rows of a step's flat batch run under which slot: the runner puts each
    adapter's requests next to each other, so an adapter's rows are one range (rows of the
    base model are in none)."""

    slot_rows: tuple[tuple[int, int, int], ...]  # (slot, first row, end row)

    @functools.cached_property
    def ranges(self) -> torch.Tensor:  # [ranges, 3] int64, for the kernel
        return torch.tensor(self.slot_rows, dtype=torch.int64).view(-1, 3)


MAX_PIECES = 3  # csrc/lora.c: blocks per adapter and layer (q, k, v)


class LoRAKernel:
    """csrc/lora.c: every adapter's products of one layer in one call (CPU)."""

    def __init__(self, library: object, scratch: torch.Tensor, num_threads: int) -> None:
        self._run = library.lora_add
        self.scratch = scratch  # WORK_ROWS rows of (in + out) floats per thread
        self.num_threads = num_threads

    @classmethod
    def make(cls, targets: Iterable[LoRATarget]) -> LoRAKernel | None:
        library = load_kernels()
        if library is None:
            return None
        widest = max(t.in_features + t.out_features for t in targets)
        threads = torch.get_num_threads()
        return cls(library, torch.empty(threads * 8 * widest), threads)  # csrc/lora.c WORK_ROWS rows per thread

    def run(self, slots: LoRASlots, x: torch.Tensor, out: torch.Tensor, mapping: LoRAMapping) -> bool:
        """False where the kernel does not apply (the caller computes in torch)."""
        if x.dtype not in (torch.float32, torch.bfloat16) or out.dtype not in (torch.float32, torch.bfloat16):
            return False
        if x.stride(1) != 1 or out.stride(1) != 1 or x.device.type != "cpu" or slots.a.dtype not in (torch.float32, torch.bfloat16):
            return False
        ranges = mapping.ranges
        ranks, n = slots.b.shape[1], slots.b.shape[2]
        status = self._run(
            x.data_ptr(), x.stride(0), x.dtype is torch.float32, out.data_ptr(), out.stride(0), out.dtype is torch.float32,
            slots.a.data_ptr(), slots.b.data_ptr(), slots.a.dtype is torch.bfloat16, ranks, slots.a.shape[2], n,
            ranges.data_ptr(), ranges.shape[0],
            slots.pieces.data_ptr(), slots.num_pieces.data_ptr(), self.scratch.data_ptr(), self.num_threads,
        )  # fmt: skip
        return status == 0


class LoRASlots:
    """One linear layer's room for `num_slots` adapters (see the module comment). The
    weights are kept in float32, or in bf16 for a bf16 model (`dtype`): reading them is most
    of the products' cost, and the products themselves are computed in float32 either way
    (the C kernel; torch, where it does not run, multiplies in float32 too)."""

    def __init__(
        self, target: LoRATarget, num_slots: int, max_rank: int, device: torch.device, kernel: LoRAKernel | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        ranks = max_rank * len(target.shards)
        self.a = torch.zeros(num_slots, ranks, target.in_features, dtype=dtype, device=device)  # scaled: scaling * A
        self.b = torch.zeros(num_slots, ranks, target.out_features, dtype=dtype, device=device)  # B^T
        self.ranks = [0] * num_slots  # the ranks slot s uses (the rest are zero)
        # Per slot, its blocks (first rank, end rank, first column, end column) and their count.
        self.pieces = torch.zeros(num_slots, MAX_PIECES, 4, dtype=torch.int64)
        self.num_pieces = torch.zeros(num_slots, dtype=torch.int32)
        self.kernel = kernel  # the C kernel (CPU), or None: torch
        self.mapping: LoRAMapping | None = None  # this step's rows per slot; None: no adapter in the step

    def load(self, slot: int, adapter: LayerAdapter | None) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot] = 0
        self.num_pieces[slot] = 0
        if adapter is None:
            return
        rank = adapter.rank
        self.a[slot, :rank].copy_(adapter.a.float() * adapter.scaling.float()[:, None])  # rounded once, if bf16
        self.b[slot, :rank].copy_(adapter.b.float().T)
        self.ranks[slot] = rank
        self.pieces[slot, : len(adapter.pieces)] = torch.tensor(adapter.pieces, dtype=torch.int64)
        self.num_pieces[slot] = len(adapter.pieces)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [rows, out] (the base output, added to in place) plus each adapter's product
        on its rows: ((x scaling A^T) B^T), in one C call where it runs, else one shrink and
        one expand per adapter in torch."""
        if self.mapping is None:
            return out
        if self.kernel is not None and self.kernel.run(self, x, out, self.mapping):
            return out
        for slot, first, end in self.mapping.slot_rows:
            rank = self.ranks[slot]
            if rank == 0:
                continue
            shrunk = torch.mm(x[first:end].float(), self.a[slot, :rank].T.float())
            if out.dtype is torch.float32:
                out[first:end].addmm_(shrunk, self.b[slot, :rank].float())
            else:
                out[first:end] += torch.mm(shrunk, self.b[slot, :rank].float()).to(out.dtype)
        return out


class LoRAManager:
    """The worker's adapters: resident slots on the model's layers, and a host cache."""

    def __init__(
        self, model: nn.Module, config: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
        tp: TPLayout | None = None,
    ) -> None:  # fmt: skip
        """config: the whole model's; tp: this rank's share of it (the model holds that)."""
        self.config = config
        self.tp = tp
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        parameter = next(model.parameters())
        self.device = parameter.device
        # A bf16 model's slots in bf16 (half the bytes each step reads), float32 otherwise.
        slot_dtype = torch.bfloat16 if parameter.dtype is torch.bfloat16 else torch.float32
        targets = lora_targets(config if tp is None else tp.local_config(config))
        kernel = LoRAKernel.make(targets.values()) if self.device.type == "cpu" else None
        self.layers: dict[str, LoRASlots] = {}
        for name, target in targets.items():
            module = model.get_submodule(name)
            if (module.in_features, module.out_features) != (target.in_features, target.out_features):
                raise AssertionError(f"{name}: the model's shape differs from the LoRA layout")
            module.lora = self.layers[name] = LoRASlots(target, max_loras, max_lora_rank, self.device, kernel, slot_dtype)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.free_slots = list(range(max_loras))
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter read from disk
        self.active = False  # the coming forward has rows under an adapter
        self.num_loads = 0  # adapters copied into a slot
        self.num_evictions = 0  # adapters taken out of a slot for another

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read from disk if it is not (least recently used out)."""
        adapter = self.host.get(request.lora_int_id)
        if adapter is None or adapter.path != request.lora_path:
            adapter = load_lora_adapter(request.lora_path, request.lora_name, self.config, self.max_lora_rank, tp=self.tp)
            self.host[request.lora_int_id] = adapter
            while len(self.host) > self.max_cpu_loras:  # a resident one is read again if it leaves its slot
                self.host.popitem(last=False)
        self.host.move_to_end(request.lora_int_id)
        return adapter

    def activate(self, requests: dict[int, LoRARequest]) -> dict[int, int]:
        """Make these adapters (at most max_loras: the scheduler caps a step) resident;
        returns lora_int_id -> slot."""
        assert len(requests) <= len(self.free_slots) + len(self.slot_of), "more adapters in a step than slots"
        slots: dict[int, int] = {}
        for lora_id, request in requests.items():
            slot = self.slot_of.get(lora_id)
            if slot is None:
                adapter = self.adapter(request)  # read first: a folder gone since fails before any slot changes
                slot = self._take_slot(keep=set(requests))
                try:
                    for name, layer in self.layers.items():
                        layer.load(slot, adapter.layers.get(name))
                except BaseException:
                    for layer in self.layers.values():
                        layer.load(slot, None)
                    self.free_slots.append(slot)
                    raise
                self.slot_of[lora_id] = slot
                self.num_loads += 1
                logger.info("LoRA adapter %r (id %d) loaded into slot %d", request.lora_name, lora_id, slot)
            self.slot_of.move_to_end(lora_id)
            slots[lora_id] = slot
        return slots

    def _take_slot(self, keep: set[int]) -> int:
        if self.free_slots:
            return self.free_slots.pop(0)
        for lora_id in self.slot_of:  # least recently used first
            if lora_id not in keep:
                self.num_evictions += 1
                return self.slot_of.pop(lora_id)
        raise AssertionError("every slot holds an adapter of this step")

    def set_mapping(self, mapping: LoRAMapping | None) -> None:
        """The rows of the coming forward that run under each slot (None: none do)."""
        self.active = mapping is not None
        for layer in self.layers.values():
            layer.mapping = mapping

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (unloaded): its slot is free, its host copy dropped."""
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.load(slot, None)
            self.free_slots.append(slot)
        self.host.pop(lora_id, None)
