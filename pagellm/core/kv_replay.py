"""Core stage: rebuild the block map from a KV event log (see kv_events.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagellm.core.block_pool import NULL_BLOCK_ID


@dataclass
class BlockMap:
    """Who holds each block: device blocks -> request ids, cached blocks, host blocks."""

    device: dict[int, list[str]] = field(default_factory=dict)  # only blocks in use
    cached: set[int] = field(default_factory=set)
    host: dict[int, str] = field(default_factory=dict)
    step: int = 0

    def normalized(self) -> dict[str, Any]:
        return {
            "device": {b: sorted(r) for b, r in sorted(self.device.items()) if r},
            "cached": sorted(self.cached),
            "host": dict(sorted(self.host.items())),
        }


def read_events(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def replay(events: Iterable[dict[str, Any]], until_step: int | None = None) -> BlockMap:
    """The block map after every event of steps <= until_step (all events if None)."""
    state = BlockMap()

    def hold(block: int, request_id: str) -> None:
        state.device.setdefault(block, []).append(request_id)

    def release(block: int, request_id: str) -> None:
        holders = state.device[block]
        holders.remove(request_id)
        if not holders:
            del state.device[block]

    for e in events:
        if until_step is not None and e["step"] > until_step:
            break
        state.step = e["step"]
        kind, blocks, rid = e["event"], e.get("block_ids", []), e.get("request_id")
        if kind in ("allocate", "cache_hit", "fork"):
            for b in blocks:
                hold(b, rid)
        elif kind == "free":
            for b in blocks:
                release(b, rid)
        elif kind == "cache":
            state.cached.update(blocks)
        elif kind == "evict":
            state.cached.difference_update(blocks)
        elif kind == "copy_on_write":
            shared, private = blocks
            release(shared, rid)
            hold(private, rid)
        elif kind == "swap_out":
            for hb in e["host_block_ids"]:
                state.host[hb] = rid
        elif kind == "swap_in":
            for hb in e["host_block_ids"]:
                state.host.pop(hb, None)
            for b in blocks:
                hold(b, rid)
        # "preempt" is informational: its block changes come as free / swap_out events.
    if until_step is not None:
        state.step = until_step
    return state


def block_map_of(manager: Any) -> BlockMap:
    """The live block map of a KVCacheManager, in the shape `replay` rebuilds."""
    state = BlockMap()
    for request_id in manager.request_ids_holding_blocks():
        for block in manager.get_host_block_ids(request_id):
            state.host[block] = request_id
        for table in manager.get_block_tables(request_id):
            for block in table:
                if block != NULL_BLOCK_ID:  # a block a sliding window already freed
                    state.device.setdefault(block, []).append(request_id)
    state.cached = {block.block_id for block in manager.device_pool.cached_blocks.values()}
    return state
