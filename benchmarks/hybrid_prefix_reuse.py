"""Multi-turn conversations on a hybrid model (Qwen3.5-shaped, random weights): prefix reuse
through recurrent-state snapshots against prefix caching off, and the snapshot interval's
trade-off.

    python benchmarks/hybrid_prefix_reuse.py [--conversations 4] [--turns 8] [--turn-tokens 300]

A random-weight checkpoint of Qwen3.5's layout (three Gated DeltaNet layers to one gated
attention layer; `--hidden`, `--layers`) is written with transformers into a temporary
folder. Conversations are served turn by turn, interleaved (turn 1 of each, then turn 2 of
each, ...), one request at a time: a turn is the history (every earlier turn and its answer)
plus `--turn-tokens` new random tokens, answered with `--answer-tokens` greedy tokens. Each
engine setting runs the same conversations in one process:
  - prefix caching off;
  - prefix caching with snapshots every 1, 2, 4 and 8 blocks (`--intervals`), snapshot
    slots fixed by the seats (`--max-num-seqs`), so a shorter interval keeps more
    snapshots per conversation and fewer conversations;
  - the default interval with the disk tier (`--kv-offload-path` in a temporary folder),
    the engine shut down and started again before every round of turns: each returning
    turn finds its history only on disk (blocks and snapshot), as after a restart.
Reports, per setting, the time to first token (adding a turn to its first token) of turn 2
and of the last turn (medians over conversations), the prompt tokens computed, and the
snapshots' memory; the TTFT ratios against prefix caching off. Prints the CPU and one JSON
line; writes benchmarks/results/hybrid_prefix_reuse.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagellm import LLM, SamplingParams
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.synthetic_model import write_byte_tokenizer


def write_checkpoint(folder: Path, hidden: int, layers: int, vocab: int) -> Path:
    """A random Qwen3.5-shaped checkpoint (its 0.8B model's proportions, scaled to `hidden`)."""
    import transformers

    heads = max(2, hidden // 128)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=128,
        linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=128, linear_value_head_dim=128,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    return folder


def serve_turn(llm: LLM, prompt: list[int], answer_tokens: int) -> tuple[float, list[int], int]:
    """One turn alone: seconds to its first token, its answer, prompt tokens it reused."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    started = time.perf_counter()
    request_id = engine.add_request(None, prompt, params)
    ttft, answer, cached = None, [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            if ttft is None and output.outputs[0].token_ids:
                ttft = time.perf_counter() - started
            answer, cached = list(output.outputs[0].token_ids), output.num_cached_tokens or 0
    assert ttft is not None
    return ttft, answer, cached


def run(folder: Path, args: argparse.Namespace, restart: bool = False, **engine_args: object) -> dict[str, object]:
    """The conversations on one engine (or, `restart`, on a new one for every round of turns)."""

    def start() -> LLM:
        return LLM(str(folder), max_model_len=args.turns * (args.turn_tokens + args.answer_tokens) + 64,
                   max_num_seqs=args.max_num_seqs, **engine_args)  # fmt: skip

    llm = start()
    rng = random.Random(1)
    histories: list[list[int]] = [[] for _ in range(args.conversations)]
    ttfts: list[list[float]] = [[] for _ in range(args.turns)]
    computed = reused = loaded_states = 0
    for turn in range(args.turns):
        if restart and turn:
            loaded_states += llm.engine.get_stats().num_tier_loaded_states
            llm.shutdown()
            llm = start()
        for conversation, history in enumerate(histories):
            prompt = history + [rng.randrange(3, 250) for _ in range(args.turn_tokens)]
            ttft, answer, cached = serve_turn(llm, prompt, args.answer_tokens)
            ttfts[turn].append(ttft)
            computed += len(prompt) - cached
            reused += cached
            histories[conversation] = prompt + answer
    manager = llm.engine.scheduler.kv_cache_manager
    state_bytes = llm.engine.config.model_config.state_bytes_per_request()
    loaded_states += llm.engine.get_stats().num_tier_loaded_states
    llm.shutdown()
    return {
        "turn_ttft_p50_s": [statistics.median(t) for t in ttfts],
        "prompt_tokens_computed": computed,
        "prompt_tokens_reused": reused,
        "snapshots_saved": manager.snapshots.num_saved,
        "snapshots_restored": manager.snapshots.num_restored,
        "snapshot_bytes": manager.snapshots.num_slots * state_bytes,
        "state_bytes_per_request": state_bytes,
        "snapshots_loaded_from_disk": loaded_states,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=300)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="seats: also the snapshot slots")
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--no-restart", action="store_true", help="skip the disk-tier setting restarted every turn")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "hybrid_prefix_reuse.json")
    args = parser.parse_args()
    print(describe_cpu(cpu_info()))
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint(Path(tmp), args.hidden, args.layers, 256)
        results: dict[str, object] = {"cpu": cpu_info(), "args": {k: str(v) for k, v in vars(args).items()}}
        off = run(folder, args, enable_prefix_caching=False)
        results["prefix_caching_off"] = off
        for interval in args.intervals:
            on = run(folder, args, state_snapshot_interval=interval)
            on["ttft_ratio_by_turn"] = [a / b for a, b in zip(on["turn_ttft_p50_s"], off["turn_ttft_p50_s"], strict=True)]  # type: ignore[arg-type]
            results[f"snapshots_every_{interval}"] = on
        if not args.no_restart:
            with tempfile.TemporaryDirectory() as tier:
                restarted = run(folder, args, restart=True, kv_offload_path=tier)
            restarted["ttft_ratio_by_turn"] = [a / b for a, b in zip(restarted["turn_ttft_p50_s"], off["turn_ttft_p50_s"], strict=True)]  # type: ignore[arg-type]
            results["disk_tier_restarted_every_turn"] = restarted
    print(f"{'setting':<32}{'turn 2 TTFT':>12}{'last TTFT':>11}{'ratio t2':>10}{'ratio last':>11}{'computed':>10}{'snap MiB':>10}")
    for name, row in results.items():
        if not isinstance(row, dict) or "turn_ttft_p50_s" not in row:
            continue
        ttft = row["turn_ttft_p50_s"]
        ratio = row.get("ttft_ratio_by_turn") or [1.0] * len(ttft)
        print(f"{name:<32}{ttft[1]:>12.3f}{ttft[-1]:>11.3f}{ratio[1]:>10.2f}{ratio[-1]:>11.2f}"
              f"{row['prompt_tokens_computed']:>10}{row['snapshot_bytes'] / 2**20:>10.1f}")  # fmt: skip
    print(json.dumps(results))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
