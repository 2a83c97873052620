"""Worker stage: decode-only steps replayed from CUDA graphs captured at fixed batch sizes.

A decode step of a large model launches hundreds of small kernels; from Python the
launches, not the GPU, set the pace at small batch. A CUDA graph records the whole
forward once over static input buffers and replays it with one launch. A step of n
decodes runs the graph of the smallest captured size >= n: the runner writes the step's
inputs into the buffers, pads the rest (slot -1: nothing is written; context of one
token in the null block 0) and keeps the first n rows of the output.

Capturing is injected (`Capture`), so the padding and static-buffer logic is tested on
CPU with `rerun_capture`, which replays by running the same forward again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.worker.model_inputs import ScheduledSequence
from pagellm.worker.step_paths.base import StepInputs

logger = logging.getLogger(__name__)

# Sizes up to this are captured when the user sets no limit (vLLM's default too).
DEFAULT_MAX_CAPTURE_BATCH_SIZE = 512


def capture_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: fine steps at small batch, where padding costs most."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    chosen = [s for s in sizes if s < max_batch_size]
    return chosen + [max_batch_size]


@dataclass
class CapturedGraph:
    replay: Callable[[], None]
    output: torch.Tensor  # static: each replay overwrites it


class Capture(Protocol):
    def __call__(self, forward: Callable[[], torch.Tensor], pool: Any) -> CapturedGraph: ...


def cuda_graph_capture(forward: Callable[[], torch.Tensor], pool: Any) -> CapturedGraph:
    forward()  # warm up: Triton compiles, cuBLAS picks its kernels, outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return CapturedGraph(graph.replay, output)


def rerun_capture(forward: Callable[[], torch.Tensor], pool: Any) -> CapturedGraph:
    """Stand-in without CUDA: a replay runs the forward again over the same buffers."""
    output = forward()

    def replay() -> None:
        output.copy_(forward())

    return CapturedGraph(replay, output)


class DecodeGraphs:
    """Graphs of the model's forward for decode batches of the captured sizes."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: Capture = cuda_graph_capture,
    ) -> None:
        from pagellm.attention.triton_backend import TritonAttentionBackend

        backend = model.backend
        if not isinstance(backend, TritonAttentionBackend):
            raise TypeError("decode graphs need the Triton attention backend (its plans read static buffers)")
        config = model.config
        group = kv_cache_layout(config).groups[0]  # the one group's head shape (Gemma 4's global heads may differ from head_dim)
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        largest = self.sizes[-1]
        self._input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self._positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self._slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self._block_tables = torch.zeros(largest, self.max_blocks, dtype=torch.int64, device=device)
        self._seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self._graphs: dict[int, CapturedGraph] = {}
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        # Largest first: the shared memory pool is sized by it, the smaller ones fit inside.
        for size in reversed(self.sizes):
            plan = backend.decode_graph_plan(
                self._seq_lens[:size],
                config.num_attention_heads,
                group.num_kv_heads,
                group.head_dim,
                max_model_len,
            )
            metadata = AttentionMetadata(
                slot_mapping=self._slot_mapping[:size],
                block_tables=self._block_tables[:size],
                query_start_loc=list(range(size + 1)),
                seq_lens=[1] * size,
                backend_plan=plan,
            )
            self._graphs[size] = capture(self._forward(model, kv_caches, size, metadata), pool)

    def _forward(
        self, model: torch.nn.Module, kv_caches: list[torch.Tensor], size: int, metadata: AttentionMetadata
    ) -> Callable[[], torch.Tensor]:
        input_ids, positions = self._input_ids[:size], self._positions[:size]
        return lambda: model(input_ids, positions, kv_caches, metadata)

    def can_run(self, sequences: list[ScheduledSequence]) -> bool:
        return (
            0 < len(sequences) <= self.sizes[-1]
            and all(len(s.token_ids) == 1 and s.needs_logits for s in sequences)
            and all(len(s.block_ids) == 1 and len(s.block_ids[0]) <= self.max_blocks for s in sequences)
        )

    def run(self, sequences: list[ScheduledSequence]) -> torch.Tensor:  # [n, hidden_size]
        """The hidden states of a decode step of n <= the largest size requests."""
        n = len(sequences)
        size = next(s for s in self.sizes if s >= n)
        block_size = self.block_size
        width = max(len(seq.block_ids[0]) for seq in sequences)
        input_ids = [0] * size
        positions = [0] * size
        slots = [-1] * size
        seq_lens = [1] * size
        tables = []
        for i, seq in enumerate(sequences):
            position = seq.start_position
            input_ids[i] = seq.token_ids[0]
            positions[i] = position
            slots[i] = seq.block_ids[0][position // block_size] * block_size + position % block_size
            seq_lens[i] = position + 1
            tables.append(seq.block_ids[0] + [0] * (width - len(seq.block_ids[0])))
        # Padding rows are rewritten too (a previous, larger step may have left real ones
        # there): one token of context in the null block 0, and a slot of -1 so their K/V
        # is never stored. Table entries past a row's context are never read.
        self._input_ids[:size].copy_(torch.tensor(input_ids), non_blocking=True)
        self._positions[:size].copy_(torch.tensor(positions), non_blocking=True)
        self._slot_mapping[:size].copy_(torch.tensor(slots), non_blocking=True)
        self._seq_lens[:size].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self._block_tables[:n, :width].copy_(torch.tensor(tables, dtype=torch.int64), non_blocking=True)
        self._block_tables[n:size, 0] = 0
        graph = self._graphs[size]
        graph.replay()
        return graph.output[:n]


class DecodeGraphsPath:
    """Decode-only steps that fit a captured size, without adapter rows: replayed."""

    name = "cuda graphs"

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs = graphs

    def applies(self, step: StepInputs) -> bool:
        return not step.has_adapters and self.graphs.can_run(step.sequences)

    def run(self, step: StepInputs) -> torch.Tensor:
        return self.graphs.run(step.sequences)
