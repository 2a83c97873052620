"""KV blocks a long request holds on a Gemma-3-shaped model (sliding layers freed as the
window passes) against the same model with every layer global, from the engine's own
block counts; and the decode step time of each on this CPU.

    python benchmarks/sliding_window_kv.py [--prompt 8192] [--window 1024] [--layers 62] [--pattern 6]

Two tiny random Gemma 3 checkpoints (hidden 64, 4 heads of 16, Gemma-3-27B's layer
pattern by default: 62 layers, five of every six sliding over 1024 positions): one as
Gemma 3 has it, one whose `layer_types` make every layer global. One request of `prompt`
tokens then 64 generated tokens runs through the real engine (chunked prefill of 2048
tokens, float32); after every step the script reads the blocks the request holds
(KVCacheManager.num_blocks_held, over all KV cache groups), the pool's free blocks and
the blocks the windows freed. Blocks are compared in layer-blocks (a block of a group of
n layers counts n), since the two models group their layers differently. Prints the CPU,
the figures and one JSON line; writes benchmarks/results/sliding_window_kv.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from pagellm import LLM, SamplingParams
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.synthetic_model import widen_weights, write_byte_tokenizer
from pagellm.config.kv_layout import kv_cache_layout
from pagellm.model.loader import load_model_config, resolve_model_source

RESULT = Path(__file__).resolve().parent / "results" / "sliding_window_kv.json"
NEW_TOKENS = 64


def write_checkpoint(folder: Path, layers: int, pattern: int, window: int, sliding: bool) -> Path:
    import transformers

    kinds = ["sliding_attention" if sliding and (i + 1) % pattern else "full_attention" for i in range(layers)]
    config = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=window, layer_types=kinds,
        max_position_embeddings=32768, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32)
    widen_weights(model)
    with torch.no_grad():  # Gemma's norms scale by (1 + w): keep them near 1
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.2, 0.2)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder


def run(folder: Path, prompt: list[int]) -> dict:
    layout = kv_cache_layout(load_model_config(resolve_model_source(str(folder))))
    llm = LLM(str(folder), dtype="float32", max_model_len=len(prompt) + NEW_TOKENS, max_num_batched_tokens=2048)
    engine = llm.engine
    manager = engine.scheduler.kv_cache_manager
    request_id = engine.add_request(None, prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    held: list[int] = []
    decode_s: list[float] = []
    while engine.has_unfinished_requests():
        computed = engine.scheduler.requests[request_id].num_computed_tokens if request_id in engine.scheduler.requests else 0
        start = time.perf_counter()
        engine.step()
        if computed >= len(prompt):
            decode_s.append(time.perf_counter() - start)
        if manager.holds_blocks(request_id):
            held.append(manager.num_blocks_held(request_id))
    per_block = layout.layers_per_block
    return {
        "kv_cache_groups": layout.describe(),
        "layers_per_block": per_block,
        "global_groups": sum(group.window is None for group in layout.groups),
        "max_blocks_held": max(held),
        "max_layer_blocks_held": max(held) * per_block,
        "window_freed_blocks": manager.stats.num_window_freed_blocks,
        "decode_step_ms_median": round(sorted(decode_s)[len(decode_s) // 2] * 1e3, 2),
    }


def len_groups(result: dict) -> int:
    """Groups of a layout from its description, e.g. '5 groups of 13 layers: ...'."""
    return int(result["kv_cache_groups"].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=62)
    parser.add_argument("--pattern", type=int, default=6)
    args = parser.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(3, 256) for _ in range(args.prompt)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sliding in (("sliding", True), ("all_global", False)):
            folder = write_checkpoint(Path(tmp) / name, args.layers, args.pattern, args.window, sliding)
            results[name] = run(folder, prompt)
    num_global = sum(1 for i in range(args.layers) if (i + 1) % args.pattern == 0)
    length = args.prompt + NEW_TOKENS
    # The global layers' share of a full cache plus the window's (a window spans at most
    # window / 16 + 1 blocks); then the same with the layout's padding (a kind's last group
    # of layers_per_block tensors may hold fewer layers, its unused tensors still reserved).
    window_share = (args.window + 16) / length
    ideal = num_global / args.layers + (args.layers - num_global) / args.layers * window_share
    sliding = results["sliding"]
    padded_global = sliding["global_groups"] * sliding["layers_per_block"] / args.layers
    padded_sliding = (len_groups(sliding) - sliding["global_groups"]) * sliding["layers_per_block"] / args.layers
    expected = padded_global + padded_sliding * window_share
    ratio = results["sliding"]["max_layer_blocks_held"] / results["all_global"]["max_layer_blocks_held"]
    record = {
        "cpu": describe_cpu(cpu_info()),
        "threads": torch.get_num_threads(),
        "layers": args.layers,
        "global_layers": num_global,
        "window": args.window,
        "request_tokens": length,
        **{f"{name}_{key}": value for name, result in results.items() for key, value in result.items()},
        "held_ratio": round(ratio, 4),
        "expected_ratio_with_padding": round(expected, 4),
        "expected_ratio_without_padding": round(ideal, 4),
        "decode_speedup": round(
            results["all_global"]["decode_step_ms_median"] / results["sliding"]["decode_step_ms_median"], 2
        ),
    }
    print(f"CPU: {record['cpu']}, {record['threads']} threads")
    print(f"{args.layers} layers ({num_global} global), window {args.window}, one request of {length} tokens")
    for name, result in results.items():
        print(f"  {name:10s} {result['kv_cache_groups']}: at most {result['max_layer_blocks_held']} layer-blocks held, "
              f"{result['window_freed_blocks']} blocks freed by windows, decode step {result['decode_step_ms_median']} ms")  # fmt: skip
    print(f"held between steps: {ratio:.3f} of the all-global model's (expected {expected:.3f} with the layout's "
          f"padding, {ideal:.3f} without); decode steps {record['decode_speedup']}x faster")
    print(json.dumps(record))
    RESULT.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
