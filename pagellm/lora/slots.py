"""Lora stage: adapters resident beside the model, in a fixed pool of slots, applied per row.

Every adaptable linear layer gets, once, room for `max_loras` adapters of the largest rank
allowed: A [slots, ranks, in], B [slots, out, ranks] and the scaling of each rank, zero
where an adapter has fewer ranks or leaves the layer alone. Loading an adapter copies it
into a free slot (or the least recently used one no row of the step needs); a step never
allocates. The base weights are never touched: a layer computes its base output as before
and adds, for each adapter present in the step, ((x_rows A^T) * scaling) B^T to that
adapter's rows, one shrink and one expand per adapter (a segmented matmul), whatever the
base weight's type (bf16, quantized GGUF blocks).

The worker's LoRAManager keeps the adapters read from disk in host memory (least recently
used first out, `max_cpu_loras`), and before each step makes the step's adapters resident
and tells the model which rows run under which slot (LoRAMapping).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.config.model import ModelConfig
from pagellm.lora.adapter import LoRAAdapter, LoRATarget, load_lora_adapter, lora_targets
from pagellm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAMapping:
    """Which rows of a step's flat batch run under which slot: the runner puts each
    adapter's requests next to each other, so an adapter's rows are one range (rows of the
    base model are in none)."""

    slot_rows: tuple[tuple[int, int, int], ...]  # (slot, first row, end row)


class LoRASlots:
    """One linear layer's room for `num_slots` adapters (see the module comment). Kept in
    float32 whatever the model's dtype: the products are small beside the base layer's, and
    float32 matmuls of a few rows are both faster than bf16 ones on the CPU and closer to
    the reference."""

    def __init__(self, target: LoRATarget, num_slots: int, max_rank: int, device: torch.device) -> None:
        ranks = max_rank * len(target.shards)
        self.a = torch.zeros(num_slots, ranks, target.in_features, device=device)  # scaled: scaling * A
        self.b = torch.zeros(num_slots, ranks, target.out_features, device=device)  # B^T
        self.ranks = [0] * num_slots  # the ranks slot s uses (the rest are zero)
        self.mapping: LoRAMapping | None = None  # this step's rows per slot; None: no adapter in the step

    def load(self, slot: int, adapter_a: torch.Tensor | None, adapter_b: torch.Tensor | None, scaling: torch.Tensor | None) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot] = 0
        if adapter_a is None:
            return
        rank = adapter_a.shape[0]
        self.a[slot, :rank].copy_(adapter_a.float() * scaling.float()[:, None])
        self.b[slot, :rank].copy_(adapter_b.float().T)
        self.ranks[slot] = rank

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [rows, out] (the base output, added to in place) plus each adapter's product
        on its rows: ((x scaling A^T) B^T), one shrink and one expand per adapter."""
        if self.mapping is None:
            return out
        for slot, first, end in self.mapping.slot_rows:
            rank = self.ranks[slot]
            if rank == 0:
                continue
            shrunk = torch.mm(x[first:end].float(), self.a[slot, :rank].T)
            if out.dtype is torch.float32:
                out[first:end].addmm_(shrunk, self.b[slot, :rank])
            else:
                out[first:end] += torch.mm(shrunk, self.b[slot, :rank]).to(out.dtype)
        return out


class LoRAManager:
    """The worker's adapters: resident slots on the model's layers, and a host cache."""

    def __init__(
        self, model: nn.Module, config: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
    ) -> None:  # fmt: skip
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.device = next(model.parameters()).device
        self.layers: dict[str, LoRASlots] = {}
        for name, target in lora_targets(config).items():
            module = model.get_submodule(name)
            if (module.in_features, module.out_features) != (target.in_features, target.out_features):
                raise AssertionError(f"{name}: the model's shape differs from the LoRA layout")
            module.lora = self.layers[name] = LoRASlots(target, max_loras, max_lora_rank, self.device)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.free_slots = list(range(max_loras))
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter read from disk
        self.active = False  # the coming forward has rows under an adapter
        model.lora_manager = self
        self.num_loads = 0  # adapters copied into a slot
        self.num_evictions = 0  # adapters taken out of a slot for another

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read from disk if it is not (least recently used out)."""
        adapter = self.host.get(request.lora_int_id)
        if adapter is None or adapter.path != request.lora_path:
            adapter = load_lora_adapter(request.lora_path, request.lora_name, self.config, self.max_lora_rank)
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
                slot = self._take_slot(keep=set(requests))
                adapter = self.adapter(request)
                for name, layer in self.layers.items():
                    piece = adapter.layers.get(name)
                    layer.load(slot, *(None, None, None) if piece is None else (piece.a, piece.b, piece.scaling))
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
                layer.load(slot, None, None, None)
            self.free_slots.append(slot)
        self.host.pop(lora_id, None)
