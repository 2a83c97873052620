"""The prefix cache's disk tier through the whole engine, against HF transformers.

A conversation is served, evicted from a small KV cache by other traffic, and served
again: its history comes back from the tier (counted) and only the new turn is computed,
with HF's greedy tokens. Then restarts: the same directory is found again; one written
by another model, block size or dtype is ignored; truncated, flipped and missing entries
are skipped (and the tokens still equal HF's); a writer killed mid-write leaves no entry
that validates.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
from engine_checks import assert_engine_drained
from hf_models import load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy

from pagellm import LLM, SamplingParams
from pagellm.worker.kv_tier_store import (
    ENTRY_HEADER,
    ENTRY_MAGIC,
    ENTRY_SUFFIX,
    TEMP_PREFIX,
    TierEntryError,
    TierIdentity,
    TierStore,
)

NEW_TOKENS = 8
rng = random.Random(11)
HISTORY = [rng.randrange(3, 256) for _ in range(70)]  # 4 full blocks of 16 looked up
OTHERS = [[rng.randrange(3, 256) for _ in range(70)] for _ in range(3)]
TURN = [rng.randrange(3, 256) for _ in range(9)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # noqa: ANN201
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tier-model"), "llama", seed=3)
    ref = load_hf_reference(folder)
    first = hf_greedy(ref, HISTORY, NEW_TOKENS)
    second_prompt = HISTORY + first + TURN
    return str(folder), first, second_prompt, hf_greedy(ref, second_prompt, NEW_TOKENS)


def make_llm(folder: str, tier: Path, **overrides: object) -> LLM:
    args: dict[str, object] = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=13, kv_offload_path=str(tier))
    args.update(overrides)
    return LLM(folder, **args)


def greedy(llm: LLM, prompt: list[int]):  # noqa: ANN201 - RequestOutput
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def tier_stats(llm: LLM) -> dict[str, float]:
    stats = llm.engine.get_stats()
    return {name: value for name, value in vars(stats).items() if "tier" in name}


def serve_and_evict(llm: LLM, first: list[int]) -> None:
    assert greedy(llm, HISTORY).outputs[0].token_ids == first
    for other in OTHERS:  # 12 usable blocks: each takes 5, so the history's are reused
        greedy(llm, other)


def test_a_returning_conversation_loads_its_history_from_the_tier(tiny, tmp_path, caplog) -> None:
    folder, first, second_prompt, second = tiny
    caplog.set_level(logging.DEBUG, logger="pagellm.core.scheduler")
    llm = make_llm(folder, tmp_path / "tier")
    serve_and_evict(llm, first)
    manager = llm.engine.scheduler.kv_cache_manager
    hashes = [h for h in manager.device_pool.cached_blocks if h[1].token_ids == tuple(HISTORY[:16])]
    assert not hashes, "the other traffic evicted the history from the KV cache"
    prefill_before = llm.engine.get_stats().num_prefill_tokens
    output = greedy(llm, second_prompt)
    assert output.outputs[0].token_ids == second
    # 70 + 8 tokens of history: 4 full blocks written (the fifth was not full when it left).
    assert output.num_cached_tokens == 64
    assert llm.engine.get_stats().num_prefill_tokens - prefill_before == len(second_prompt) - 64
    # The request's log line says where its prompt came from.
    line = f"{len(second_prompt)} prompt tokens (0 from the KV cache, 64 from its tier, {len(second_prompt) - 64} computed)"
    assert line in caplog.text
    stats = tier_stats(llm)
    assert stats["num_tier_hit_blocks"] == 4 and stats["num_tier_failed_loads"] == 0
    assert stats["num_tier_written_blocks"] >= 4 * (1 + len(OTHERS))
    assert_engine_drained(llm)
    llm.shutdown()


def test_without_prefix_caching_the_tier_is_off(tiny, tmp_path) -> None:
    folder, first, _, _ = tiny
    llm = make_llm(folder, tmp_path / "tier", enable_prefix_caching=False)
    serve_and_evict(llm, first)
    assert llm.engine.scheduler.kv_cache_manager.tier is None and llm.engine.runner.kv_tier is None
    assert not (tmp_path / "tier").exists()
    llm.shutdown()


def written_tier(folder: str, tier: Path, first: list[int]) -> Path:
    llm = make_llm(folder, tier)
    serve_and_evict(llm, first)
    llm.shutdown()  # the queued writes reach the disk
    [store] = [p for p in tier.iterdir() if p.is_dir()]
    return store


def test_a_restart_finds_the_tier_and_ignores_foreign_ones(tiny, tmp_path, caplog) -> None:
    folder, first, second_prompt, second = tiny
    tier = tmp_path / "tier"
    written_tier(folder, tier, first)
    caplog.set_level(logging.INFO, logger="pagellm.worker.kv_tier_store")
    for foreign in (dict(block_size=8, num_gpu_blocks_override=17), dict(dtype="bfloat16"), dict(kv_cache_dtype="fp8_e4m3")):
        llm = make_llm(folder, tier, **foreign)
        greedy(llm, second_prompt)
        assert tier_stats(llm)["num_tier_hit_blocks"] == 0, foreign
        llm.shutdown()
    assert "written by another model or format" in caplog.text
    other_model = make_tiny_hf_checkpoint(tmp_path / "other", "llama", seed=4)
    llm = make_llm(str(other_model), tier)
    greedy(llm, second_prompt)
    assert tier_stats(llm)["num_tier_hit_blocks"] == 0, "another model's weights"
    llm.shutdown()

    llm = make_llm(folder, tier)
    output = greedy(llm, second_prompt)
    assert output.outputs[0].token_ids == second
    assert output.num_cached_tokens == 64 and tier_stats(llm)["num_tier_hit_blocks"] == 4
    llm.shutdown()


def entry_paths(store: Path, prompt: list[int]) -> list[Path]:
    """The history's entries in block order (digests as the engine computes them)."""
    from pagellm.core.kv_tier import block_digest
    from pagellm.request import Request

    request = Request("probe", prompt, SamplingParams(max_tokens=1))
    return [store / (block_digest(h).hex() + ENTRY_SUFFIX) for h in request.get_block_hashes(16)[:4]]


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing"])
def test_a_damaged_entry_is_skipped_and_the_tokens_stay_right(tiny, tmp_path, damage) -> None:
    folder, first, second_prompt, second = tiny
    tier = tmp_path / "tier"
    store = written_tier(folder, tier, first)
    paths = entry_paths(store, HISTORY)
    assert all(path.exists() for path in paths)
    target = paths[2]
    if damage == "truncated":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "flipped":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x40
        target.write_bytes(bytes(data))
    llm = make_llm(folder, tier)
    if damage == "missing":
        target.unlink()  # after the start-up scan listed it
    output = greedy(llm, second_prompt)
    assert output.outputs[0].token_ids == second
    assert output.num_cached_tokens == 32, "the two blocks before the damaged one load"
    stats = tier_stats(llm)
    assert stats["num_tier_failed_loads"] == (0 if damage == "truncated" else 1)
    assert_engine_drained(llm)
    llm.shutdown()
    # The damaged entry was removed, the block computed again and written anew, whole.
    data = target.read_bytes()
    magic, _, length, crc = ENTRY_HEADER.unpack_from(data)
    assert magic == ENTRY_MAGIC and length == len(data) - ENTRY_HEADER.size and zlib.crc32(data[ENTRY_HEADER.size :]) == crc


WRITER = textwrap.dedent(
    """
    import sys
    from pagellm.worker.kv_tier_store import TierIdentity, TierStore
    identity = TierIdentity("m", "w", "float32", "float32", 16, 2, 2, 512, 4)
    store = TierStore(sys.argv[1], identity)
    payload = memoryview(bytes(range(256)) * (identity.payload_bytes // 256))
    print("ready", flush=True)
    index = 0
    while True:
        store.write(index.to_bytes(16, "little"), payload)
        index += 1
    """
)


def test_a_writer_killed_mid_write_leaves_no_entry_that_validates(tmp_path) -> None:
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # let it write a few hundred entries, then kill it in the middle of one
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    identity = TierIdentity("m", "w", "float32", "float32", 16, 2, 2, 512, 4)
    folder = tmp_path / identity.key
    assert any(path.name.endswith(ENTRY_SUFFIX) for path in folder.iterdir())
    store = TierStore(tmp_path, identity)
    assert not any(path.name.startswith(TEMP_PREFIX) for path in folder.iterdir()), "the torn write is removed"
    expected = bytes(range(256)) * (identity.payload_bytes // 256)
    for digest, _ in store.entries:
        data = store.read(digest)  # raises TierEntryError if anything listed does not validate
        assert bytes(data[-identity.payload_bytes :]) == expected
    with pytest.raises(TierEntryError):
        store.read(b"\xff" * 16)


def test_the_host_memory_cache_serves_loads_before_the_disk(tiny, tmp_path) -> None:
    folder, first, second_prompt, second = tiny
    llm = make_llm(folder, tmp_path / "tier", kv_offload_host_bytes=1 << 20)
    serve_and_evict(llm, first)
    transfer = llm.engine.runner.kv_tier
    transfer.flush()
    [store] = [p for p in (tmp_path / "tier").iterdir() if p.is_dir()]
    for path in store.glob("*" + ENTRY_SUFFIX):
        path.unlink()  # only host memory holds the blocks now
    output = greedy(llm, second_prompt)
    assert output.outputs[0].token_ids == second and output.num_cached_tokens == 64
    assert transfer.num_host_hits == 4 and tier_stats(llm)["num_tier_failed_loads"] == 0
    assert transfer.host.num_bytes <= 1 << 20
    llm.shutdown()


def test_the_host_memory_cache_keeps_its_bound() -> None:
    import torch

    from pagellm.worker.kv_tier_transfer import HostBlockCache

    cache = HostBlockCache(capacity_bytes=250)
    for index in range(5):
        cache.put(bytes([index]), torch.zeros(100, dtype=torch.uint8))
    assert cache.num_bytes == 200 and cache.get(b"\x00") is None and cache.get(b"\x04") is not None
    cache.get(b"\x03")  # now the most recent
    cache.put(b"\x05", torch.zeros(100, dtype=torch.uint8))
    assert cache.get(b"\x04") is None and cache.get(b"\x03") is not None
    cache.put(b"big", torch.zeros(300, dtype=torch.uint8))  # larger than the whole cache: not kept
    assert cache.get(b"big") is None and cache.num_bytes == 200
    cache.drop(b"\x03")
    assert cache.num_bytes == 100


def test_a_load_waits_for_the_write_of_its_entry(tmp_path) -> None:
    """The scheduler counts an entry whose write is queued as held, so the loader waits for
    that write before reading: held up here until the test lets the write go, the load
    still finds the entry (without the wait it would read a file not written yet)."""
    import threading

    import torch

    from pagellm.worker.kv_tier_transfer import KVTierTransfer

    identity = TierIdentity("m", "w", "float32", "float32", 16, 1, 2, 8, 4)
    release, loader_there = threading.Event(), threading.Event()

    class HeldStore(TierStore):
        def write(self, digest: bytes, payload: memoryview, state: bool = False) -> int:
            assert release.wait(60)
            return super().write(digest, payload, state)

        def read_into(self, digest: bytes, out: memoryview, state: bool = False) -> None:
            loader_there.set()  # (a loader that did not wait reads before the write)
            super().read_into(digest, out, state)

    cache = torch.randn(2, 4, 16, 2, 8)  # [K/V, blocks, block_size, heads, dim]
    transfer = KVTierTransfer(HeldStore(tmp_path, identity), [cache])
    flush = transfer.flush

    def waiting_flush(timeout: float = 60.0) -> None:
        loader_there.set()
        flush(timeout)

    transfer.flush = waiting_flush
    try:
        transfer.offload([(b"a" * 16, 1)], [])
        loading = transfer.start_loads([(b"a" * 16, 3)])
        assert loading is not None and loader_there.wait(60)  # reading, or waiting for the write
        release.set()
        report = transfer.report(loading)
        assert report.failed_loads == [] and report.num_loaded == 1
        assert torch.equal(cache[:, 3], cache[:, 1])
    finally:
        release.set()
        transfer.close()
