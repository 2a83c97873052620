"""Entrypoints stage: data parallelism: which replica serves a request.

Prefix-cache affinity first: every replica's prefix cache holds the blocks of the prompts
it served recently, so a prompt whose leading blocks another prompt had is sent where
those blocks likely still are. The router keeps its own picture of that: for each chain
hash of a prompt's leading full blocks (the same chaining the KV cache uses: a block's
hash covers every token before it), the replicas it sent that block to, oldest forgotten
first. A prompt's candidates are the replicas holding its deepest known block.

Load second: among candidates (or all replicas when no block is known) the one with the
fewest requests in flight, then the lowest KV usage. A bound keeps one hot prefix from
piling onto one replica: a candidate is taken only while its load is within
`max(balance_abs, balance_rel x the least loaded replica's load)` of that least loaded
replica; past it the request goes by load, and that replica then holds the prefix too.

Pure Python (no torch), so it is tested in milliseconds.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# How many leading blocks of a prompt the router remembers (deeper blocks add little:
# prompts that share 32 blocks are as good as identical for routing).
MAX_TRACKED_BLOCKS = 32


@dataclass
class ReplicaLoad:
    """What the router knows of one replica's load."""

    in_flight: int = 0  # requests sent and not yet answered (counted by the router)
    kv_usage: float = 0.0  # the replica's last reported KV cache usage, 0..1
    alive: bool = True


@dataclass(frozen=True)
class RoutingDecision:
    replica: int
    reason: str  # "affinity" | "load" (no known prefix) | "balance" (affinity refused by the bound)
    matched_blocks: int  # leading blocks of the prompt the chosen replica is believed to hold


def block_chain_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_TRACKED_BLOCKS) -> list[bytes]:
    """One hash per full leading block, each covering every token up to its block's end."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(previous + b"|" + ",".join(map(str, block)).encode(), digest_size=16).digest()
        hashes.append(digest)
        previous = digest
    return hashes


class PrefixAffinityRouter:
    def __init__(
        self,
        num_replicas: int,
        block_size: int = 16,
        balance_abs: int = 4,
        balance_rel: float = 1.5,
        max_entries: int = 100_000,
        use_affinity: bool = True,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.block_size = block_size
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_entries = max_entries
        self.use_affinity = use_affinity  # False: by load alone (to measure what affinity is worth)
        # block chain hash -> replicas that were sent it (most recent last); LRU over hashes.
        self._holders: OrderedDict[bytes, list[int]] = OrderedDict()
        # Equal loads are broken in turn, so that one request at a time still spreads.
        self._turn = 0

    def choose(self, token_ids: Sequence[int]) -> RoutingDecision:
        """Pick a live replica for a prompt and remember that it now holds its blocks.
        Raises LookupError when no replica is alive."""
        alive = [i for i, load in enumerate(self.loads) if load.alive]
        if not alive:
            raise LookupError("no replica is alive")
        hashes = block_chain_hashes(token_ids, self.block_size) if self.use_affinity else []
        depth, candidates = 0, []
        for index, digest in enumerate(hashes):
            holders = [r for r in self._holders.get(digest, ()) if self.loads[r].alive]
            if not holders:
                break
            depth, candidates = index + 1, holders
        least = min(alive, key=self._load_key)
        if candidates:
            best = min(candidates, key=self._load_key)
            if self._within_bound(best, least):
                decision = RoutingDecision(best, "affinity", depth)
            else:
                decision = RoutingDecision(least, "balance", 0)
        else:
            decision = RoutingDecision(least, "load", 0)
        if decision.reason != "affinity":
            self._turn = decision.replica + 1
        self._remember(hashes, decision.replica)
        return decision

    def _load_key(self, replica: int) -> tuple[int, float, int]:
        load = self.loads[replica]
        # KV usage in 5% steps: a small difference in it should not beat taking turns.
        return (load.in_flight, round(load.kv_usage * 20), (replica - self._turn) % len(self.loads))

    def _within_bound(self, candidate: int, least: int) -> bool:
        floor = self.loads[least].in_flight
        limit = max(floor + self.balance_abs, floor * self.balance_rel)
        return self.loads[candidate].in_flight <= limit

    def _remember(self, hashes: list[bytes], replica: int) -> None:
        for digest in hashes:
            holders = self._holders.pop(digest, [])
            if replica in holders:
                holders.remove(replica)
            holders.append(replica)
            self._holders[digest] = holders
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    # ------------------------------------------------------------- load updates

    def started(self, replica: int) -> None:
        self.loads[replica].in_flight += 1

    def finished(self, replica: int) -> None:
        self.loads[replica].in_flight = max(0, self.loads[replica].in_flight - 1)

    def report_kv_usage(self, replica: int, usage: float) -> None:
        self.loads[replica].kv_usage = usage

    def mark_dead(self, replica: int) -> None:
        """Stop routing to a replica; what it was believed to hold is forgotten."""
        self.loads[replica].alive = False
        for digest in list(self._holders):
            holders = self._holders[digest]
            if replica in holders:
                holders.remove(replica)
                if not holders:
                    del self._holders[digest]

    @property
    def num_alive(self) -> int:
        return sum(load.alive for load in self.loads)
