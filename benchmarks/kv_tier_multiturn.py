"""Multi-turn conversations with and without the prefix cache's disk tier, on the embedded
SmolLM2 (the default dtype on the CPU kernels).

    python benchmarks/kv_tier_multiturn.py [--conversations 16] [--turns 4] [--turn-tokens 300]

Conversations are served turn by turn, interleaved (turn 1 of each, then turn 2 of
each, ...), one request at a time, each turn = the history (every earlier turn and its
answer) + `--turn-tokens` new random tokens, answered with `--answer-tokens` greedy
tokens. The KV cache (`--kv-cache-mib`) is far smaller than all histories together, so
by the time a conversation returns other traffic has evicted it. Runs, on one machine
in one process:
  - no tier: prefix caching alone;
  - tier: --kv-offload-path in a fresh temporary directory;
  - restart: a new engine over the tier directory the previous run left, and a cold
    engine without it, each serving one returning turn of every conversation.
Reports TTFT (time from adding a turn to its first token) of returning turns, p50 and
p99, prompt tokens computed, the tier's hits and bytes, and the disk it wrote to.
Prints the CPU and one JSON line; writes benchmarks/results/kv_tier_multiturn.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from pagellm import LLM, SamplingParams
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.workload.latency import percentile

MiB = 1 << 20


def serve_turn(llm: LLM, prompt: list[int], answer_tokens: int) -> tuple[float, list[int]]:
    """Run one turn alone: seconds to its first token, and its answer."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    started = time.perf_counter()
    request_id = engine.add_request(None, prompt, params)
    ttft = None
    answer: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            if ttft is None and output.outputs[0].token_ids:
                ttft = time.perf_counter() - started
            answer = list(output.outputs[0].token_ids)
    assert ttft is not None
    return ttft, answer


def run_conversations(llm: LLM, args: argparse.Namespace, rng: random.Random) -> dict[str, object]:
    histories: list[list[int]] = [[] for _ in range(args.conversations)]
    returning: list[float] = []
    prefill_before = llm.engine.get_stats().num_prefill_tokens
    started = time.perf_counter()
    for turn in range(args.turns):
        for conversation in range(args.conversations):
            prompt = histories[conversation] + [rng.randrange(1000, 40000) for _ in range(args.turn_tokens)]
            ttft, answer = serve_turn(llm, prompt, args.answer_tokens)
            histories[conversation] = prompt + answer
            if turn:
                returning.append(ttft)
    stats = llm.engine.get_stats()
    return {
        "returning_ttft_p50_s": statistics.median(returning),
        "returning_ttft_p99_s": percentile(sorted(returning), 99),
        "prompt_tokens_computed": stats.num_prefill_tokens - prefill_before,
        "wall_s": time.perf_counter() - started,
        "tier_hit_blocks": stats.num_tier_hit_blocks,
        "tier_miss_blocks": stats.num_tier_miss_blocks,
        "tier_skipped_blocks": stats.num_tier_skipped_blocks,
        "tier_written_blocks": stats.num_tier_written_blocks,
        "tier_dropped_writes": stats.num_tier_dropped_writes,
        "tier_bytes_read": stats.num_tier_bytes_read,
        "tier_read_GBps": stats.num_tier_bytes_read / stats.tier_load_seconds / 1e9 if stats.tier_load_seconds else None,
        "histories": histories,
    }


def first_returning_turns(llm: LLM, histories: list[list[int]], args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    ttfts = []
    for history in histories:
        ttft, _ = serve_turn(llm, history + [rng.randrange(1000, 40000) for _ in range(args.turn_tokens)], args.answer_tokens)
        ttfts.append(ttft)
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_first_s": ttfts[0], "hit_blocks": llm.engine.get_stats().num_tier_hit_blocks}


def disk_of(path: Path) -> str:
    try:
        source = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True, check=True)
        return " ".join(source.stdout.split()[2:])
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=300)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/kv_tier_multiturn.json")
    args = parser.parse_args()
    longest = (args.turns + 1) * (args.turn_tokens + args.answer_tokens)  # the restart adds a turn
    engine_args = dict(kv_cache_memory_bytes=args.kv_cache_mib * MiB, max_model_len=longest + 16, disable_log_stats=True)
    results: dict[str, object] = {"cpu": cpu_info(), "settings": vars(args)}
    print(describe_cpu(results["cpu"]))  # type: ignore[arg-type]

    llm = LLM(**engine_args)
    plain = run_conversations(llm, args, random.Random(1))
    llm.shutdown()
    with tempfile.TemporaryDirectory(prefix="pagellm-tier-", dir=".") as tier_dir:
        results["disk"] = disk_of(Path(tier_dir))
        llm = LLM(**engine_args, kv_offload_path=tier_dir)
        tiered = run_conversations(llm, args, random.Random(1))
        llm.shutdown()
        histories = tiered.pop("histories")
        plain.pop("histories")
        warm = LLM(**engine_args, kv_offload_path=tier_dir)
        results["restart_warm"] = first_returning_turns(warm, histories, args, random.Random(2))  # type: ignore[arg-type]
        warm.shutdown()
    cold = LLM(**engine_args)
    results["restart_cold"] = first_returning_turns(cold, histories, args, random.Random(2))  # type: ignore[arg-type]
    cold.shutdown()
    results["no_tier"], results["tier"] = plain, tiered
    results["returning_ttft_p50_ratio"] = tiered["returning_ttft_p50_s"] / plain["returning_ttft_p50_s"]  # type: ignore[operator]
    results["restart_ttft_p50_ratio"] = results["restart_warm"]["ttft_p50_s"] / results["restart_cold"]["ttft_p50_s"]  # type: ignore[index]
    print(json.dumps(results))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
