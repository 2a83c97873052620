"""Worker stage: the torch.distributed process groups of a tensor-parallel model.

Two groups over the same ranks: the device group carries the model's collectives
(NCCL between GPUs, gloo on the CPU) and a gloo group carries the driver's small
per-step control messages, so pickled objects never travel through GPU memory.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from pagellm.model.tensor_parallel import TPLayout

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer. A peer that dies closes its sockets and
# fails the wait at once; this bounds the case where a peer hangs without dying.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class DistributedTPGroup:
    """The collectives a tensor-parallel model calls, over torch.distributed.

    Built before the model (which keeps a reference) and connected once every rank has
    loaded its share, so a rank that fails to load never leaves the others waiting in a
    rendezvous.
    """

    def __init__(self, layout: TPLayout) -> None:
        self.layout = layout
        self.device_group: Any = None
        self.control_group: Any = None

    def connect(self, init_method: str, device: torch.device) -> None:
        """Join the process group of `layout.size` ranks at `init_method` (tcp://host:port)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=self.layout.rank,
            world_size=self.layout.size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self.device_group = dist.group.WORLD
        self.control_group = (
            dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" else self.device_group
        )
        logger.info("tensor-parallel rank %d of %d joined (%s)", self.layout.rank, self.layout.size, backend)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab_per_rank] -> [rows, vocab]
        parts = [torch.empty_like(logits) for _ in range(self.layout.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)[:, : self.layout.vocab_size]

    def min_over_ranks(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(tensor.item())

    def broadcast_from_driver(self, message: object = None) -> Any:
        """The driver (rank 0) sends `message`; every rank returns it."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
