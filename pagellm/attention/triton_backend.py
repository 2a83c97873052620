"""Attention stage: GPU: the backend that runs the Triton paged-attention kernels.

Once per step (every layer reuses it) the backend turns the step's layout into a plan:
the decode requests (one query token) go to one launch whose tiles hold one token and
all query heads of a KV head, split over the context (flash-decoding) when there are too
few of them to fill the GPU; prefill chunks go to a second launch whose tiles hold
several tokens. A CUDA-graph decode batch gets a plan built once over static buffers
(`decode_graph_plan`) whose contents the runner rewrites before each replay.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.attention.kv_cache_dtype import copyable
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.attention.triton_kernels import (
    LOG2E,
    merge_splits_kernel,
    paged_attention_kernel,
    store_kv_kernel,
)

_MIN_DOT = 16  # tl.dot needs every dimension >= 16
# fp8 cache formats for store_kv_kernel: mantissa bits, exponent bias, and the float32
# bits of the largest finite value (448, 57344), where stores saturate.
_FP8_FORMATS = {torch.float8_e4m3fn: (3, 7, 0x43E00000), torch.float8_e5m2: (2, 15, 0x47600000)}
# Under TRITON_INTERPRET=1 the kernels run in NumPy on CPU tensors (the CPU tests).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class TritonTuning:
    """Tile sizes and the flash-decoding heuristic."""

    prefill_block_m: int = 64  # (token, head) rows per prefill tile
    block_n: int = 64  # keys per inner iteration
    # Split decode contexts while fewer than this many programs would run unsplit
    # (a few per streaming multiprocessor keeps them all busy).
    min_decode_programs: int = 264
    min_keys_per_split: int = 256
    max_splits: int = 32
    num_splits: int | None = None  # force a split count (tests)


@dataclass(frozen=True)
class _Launch:
    """One kernel launch over a list of query tiles."""

    tile_req: torch.Tensor  # [num_tiles] int32
    tile_start: torch.Tensor  # [num_tiles] int32
    block_q: int
    block_m: int
    num_splits: int
    # Flash-decoding only: the tokens to merge and the partial results' buffers.
    merge_rows: torch.Tensor | None = None  # [num_rows] int32
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class TritonPlan:
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    launches: list[_Launch]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, tuning: TritonTuning | None = None) -> None:
        self.tuning = tuning or TritonTuning()

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if not kv_cache.is_contiguous():
            # A narrower layer's columns of a wider cache tensor (Gemma 4: worker/kv_cache.py):
            # the kernels index the cache as contiguous; the torch path reads any view.
            return TorchAttentionBackend().forward(query, key, value, kv_cache, metadata, scale, sliding_window, softcap, sinks)
        store_kv(key, value, kv_cache, metadata.slot_mapping)
        if metadata.backend_plan is None:
            num_heads, head_dim = query.shape[1:]
            metadata.backend_plan = self.plan(metadata, num_heads, key.shape[1], head_dim, query.device)
        plan: TritonPlan = metadata.backend_plan
        output = torch.empty_like(query)
        for launch in plan.launches:
            _run_launch(
                query, kv_cache, metadata.block_tables, plan, launch, scale, output, self.tuning, sliding_window, softcap,
                sinks,
            )
        return output

    # ---------------------------------------------------------------- planning

    def plan(
        self,
        metadata: AttentionMetadata,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
    ) -> TritonPlan:
        starts, seq_lens = metadata.query_start_loc, metadata.seq_lens
        group = num_heads // num_kv_heads
        decodes = [r for r in range(metadata.num_reqs) if starts[r + 1] - starts[r] == 1]
        prefills = [r for r in range(metadata.num_reqs) if starts[r + 1] - starts[r] > 1]

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        launches = []
        if decodes:
            max_len = max(seq_lens[r] for r in decodes)
            splits = self._decode_splits(len(decodes), num_kv_heads, max_len)
            launches.append(
                self._decode_launch(
                    ints(decodes), torch.zeros(len(decodes), dtype=torch.int32, device=device),
                    ints([starts[r] for r in decodes]), (num_heads, head_dim), group, splits,
                    starts[-1], device,
                )
            )  # fmt: skip
        if prefills:
            block_m = max(_MIN_DOT, self.tuning.prefill_block_m, _next_power_of_2(group))
            block_q = block_m // group
            tile_req, tile_start = [], []
            for r in prefills:
                for first in range(0, starts[r + 1] - starts[r], block_q):
                    tile_req.append(r)
                    tile_start.append(first)
            launches.append(_Launch(ints(tile_req), ints(tile_start), block_q, block_m, 1))
        return TritonPlan(ints(seq_lens), ints(starts), launches)

    def decode_graph_plan(
        self,
        seq_lens: torch.Tensor,  # [batch] int32, static: rewritten before each replay
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
    ) -> TritonPlan:
        """The plan of a decode-only batch of fixed size (one token per request), built
        over static buffers so a captured CUDA graph can replay it. The split count is
        fixed at capture from the longest context a request may have."""
        batch, device = seq_lens.shape[0], seq_lens.device
        rows = torch.arange(batch, dtype=torch.int32, device=device)
        splits = self._decode_splits(batch, num_kv_heads, max_seq_len)
        launch = self._decode_launch(
            rows, torch.zeros_like(rows), rows, (num_heads, head_dim), num_heads // num_kv_heads,
            splits, batch, device,
        )  # fmt: skip
        query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
        return TritonPlan(seq_lens, query_start_loc, [launch])

    def _decode_splits(self, num_decodes: int, num_kv_heads: int, max_seq_len: int) -> int:
        tuning = self.tuning
        if tuning.num_splits is not None:
            return tuning.num_splits
        programs = num_decodes * num_kv_heads
        if programs >= tuning.min_decode_programs:
            return 1
        wanted = -(-tuning.min_decode_programs // programs)
        by_length = max(1, max_seq_len // tuning.min_keys_per_split)
        splits = min(wanted, by_length, tuning.max_splits)
        # A power of two: the merge kernel reduces over tl.arange(0, splits).
        return 1 << (splits.bit_length() - 1)

    def _decode_launch(
        self,
        tile_req: torch.Tensor,
        tile_start: torch.Tensor,
        rows: torch.Tensor,
        head_shape: tuple[int, int],  # (num_heads, head_dim)
        group: int,
        num_splits: int,
        num_tokens: int,
        device: torch.device,
    ) -> _Launch:
        block_m = max(_MIN_DOT, _next_power_of_2(group))
        if num_splits == 1:
            return _Launch(tile_req, tile_start, 1, block_m, 1)
        num_heads, head_dim = head_shape
        stats_shape = (num_tokens, num_heads, num_splits)
        workspace = (
            torch.empty(*stats_shape, head_dim, dtype=torch.float32, device=device),
            torch.empty(stats_shape, dtype=torch.float32, device=device),
            torch.empty(stats_shape, dtype=torch.float32, device=device),
        )
        return _Launch(tile_req, tile_start, 1, block_m, num_splits, rows, workspace)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; < 0 skips the row
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1
    # fp8: the kernel writes the rounded bytes into a uint8 view of the cache.
    mant, bias, max_bits = _FP8_FORMATS.get(kv_cache.dtype, (0, 0, 0))
    store_kv_kernel[(num_tokens,)](
        key, value, copyable(kv_cache[0]), copyable(kv_cache[1]), slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HEADS=_next_power_of_2(num_kv_heads), BLOCK_D=_next_power_of_2(head_dim),
        FP8_MANT=mant, FP8_BIAS=bias, FP8_MAX_BITS=max_bits,
    )  # fmt: skip


def _run_launch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    plan: TritonPlan,
    launch: _Launch,
    scale: float,
    output: torch.Tensor,
    tuning: TritonTuning,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    num_heads, head_dim = query.shape[1:]
    # The kernels work in base 2: the sink logits too (a dummy pointer without them).
    sinks_log2 = output if sinks is None else (sinks.to(torch.float32) * LOG2E).contiguous()
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert query.stride(2) == 1
    block_d = max(_MIN_DOT, _next_power_of_2(head_dim))
    if launch.workspace is not None:
        partial_out, partial_max, partial_sum = launch.workspace
    else:
        partial_out = partial_max = partial_sum = output  # unused when NUM_SPLITS == 1
    grid = (launch.tile_req.shape[0], num_kv_heads, launch.num_splits)
    paged_attention_kernel[grid](
        query, kv_cache[0], kv_cache[1], block_tables, plan.seq_lens, plan.query_start_loc,
        launch.tile_req, launch.tile_start, output, partial_out, partial_max, partial_sum, sinks_log2,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        block_tables.stride(0), scale * LOG2E, sliding_window or 0,
        scale / softcap if softcap else 0.0, softcap * LOG2E if softcap else 0.0,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, BLOCK_Q=launch.block_q,
        BLOCK_M=launch.block_m, BLOCK_N=max(_MIN_DOT, tuning.block_n), BLOCK_D=block_d,
        NUM_SPLITS=launch.num_splits, IEEE_FP32=query.dtype == torch.float32,
        DOT_IN_FP32=_INTERPRETED, SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None,
    )  # fmt: skip
    if launch.workspace is not None:
        assert launch.merge_rows is not None
        merge_splits_kernel[(launch.merge_rows.shape[0], num_heads)](
            partial_out, partial_max, partial_sum, output, launch.merge_rows, sinks_log2,
            output.stride(0), output.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=launch.num_splits, BLOCK_D=block_d,
            HAS_SINKS=sinks is not None,
        )  # fmt: skip
