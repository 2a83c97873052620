"""KV cache bytes per token of a Gemma-4-shaped model with KV-shared layers, against the
same model with every layer keeping its own K/V: the layout's prediction and what the
allocator actually holds for a request.

    python benchmarks/gemma4_kv_bytes.py [--context 2048]

The model has Gemma 4 E4B's attention (42 layers, five sliding (window 512) to one
global, 2 KV heads of 256 in sliding layers and of 512 in global ones, the last 18 layers
reading earlier layers' K/V) at a small width (hidden 256, random weights: KV bytes do
not depend on the weights). For each variant one request of `--context` prompt tokens is
prefilled, and the blocks it holds in every KV cache group are counted from the KV cache
manager; bytes = blocks x the bytes of a block. Prints the configuration, a table and one
JSON line; writes benchmarks/results/gemma4_kv_bytes.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pagellm import LLM, SamplingParams
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.config.cache import DTYPE_BYTES, kv_bytes_per_block
from pagellm.config.kv_layout import kv_bytes_per_token, kv_cache_layout

LAYERS = 42
E4B_ATTENTION = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": LAYERS, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "global_head_dim": 512, "sliding_window": 512, "hidden_size_per_layer_input": 64,
    "vocab_size_per_layer_input": 512, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7,
    "max_position_embeddings": 8192, "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}  # fmt: skip


def measure(folder: Path, context: int, dtype: str) -> dict[str, object]:
    """Blocks and bytes one request of `context` tokens holds, and the layout's prediction."""
    llm = LLM(str(folder), load_format="dummy", dtype=dtype, max_model_len=context + 16, enable_prefix_caching=False)
    engine = llm.engine
    config = engine.config.model_config
    layout = kv_cache_layout(config)
    block_size = engine.config.cache_budget.block_size
    engine.add_request("r", [3 + i % 500 for i in range(context)], SamplingParams(max_tokens=2, ignore_eos=True))
    held: list[int] = []
    while engine.has_unfinished_requests():
        engine.step()
        manager = engine.scheduler.kv_cache_manager
        if manager.holds_blocks("r"):  # after the prefill (sliding groups freed what the window passed)
            held = [len([b for b in table if b]) for table in manager.get_block_tables("r")]
    element = DTYPE_BYTES[dtype]
    block_bytes = kv_bytes_per_block(config, block_size, dtype)
    global_per_token, sliding_per_token = kv_bytes_per_token(config, element)
    window = config.sliding_window or 0
    # The layout's own prediction: a global group's blocks cover the context, a sliding
    # group's the last window; each block spans every tensor of its group, padding included.
    layout_blocks = [-(-(context if group.window is None else min(context, group.window)) // block_size) for group in layout.groups]
    return {
        "kv_layers": len(config.kv_layers),
        "groups": layout.describe(),
        "blocks_held_per_group": held,
        "measured_bytes": sum(held) * block_bytes,
        "predicted_bytes_by_layout": sum(layout_blocks) * block_bytes,
        # Every global layer keeps the whole context; a sliding one its last window (in blocks).
        "predicted_bytes_without_padding": int(global_per_token * context + sliding_per_token * min(context, window)),
        "global_bytes_per_token": global_per_token,
        "sliding_bytes_per_token_of_window": sliding_per_token,
        "padding_share": round(layout.wasted_share, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    results: dict[str, object] = {"cpu": describe_cpu(cpu_info()), "context": args.context, "dtype": args.dtype, "model": "Gemma-4-E4B attention, hidden 256"}
    with tempfile.TemporaryDirectory() as root:
        for name, shared in (("shared", 18), ("unshared", 0)):
            folder = Path(root) / name
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps({**E4B_ATTENTION, "num_kv_shared_layers": shared}))
            from pagellm.bench.synthetic_model import write_byte_tokenizer

            write_byte_tokenizer(folder)
            results[name] = measure(folder, args.context, args.dtype)
    shared, unshared = results["shared"], results["unshared"]
    results["ratio_measured"] = round(shared["measured_bytes"] / unshared["measured_bytes"], 4)  # type: ignore[index,operator]
    results["ratio_predicted"] = round(
        shared["predicted_bytes_without_padding"] / unshared["predicted_bytes_without_padding"], 4  # type: ignore[index,operator]
    )
    print(f"{results['model']}, {args.context}-token context, KV {args.dtype}; CPU: {results['cpu']}")
    print(f"{'':10} {'KV layers':>9} {'measured MiB':>13} {'layout MiB':>11} {'needed MiB':>11} {'global B/token':>15}  groups")
    for name in ("shared", "unshared"):
        row = results[name]
        print(
            f"{name:10} {row['kv_layers']:>9} {row['measured_bytes'] / 2**20:>13.2f} "  # type: ignore[index,operator]
            f"{row['predicted_bytes_by_layout'] / 2**20:>11.2f} {row['predicted_bytes_without_padding'] / 2**20:>11.2f} {row['global_bytes_per_token']:>15g}  {row['groups']}"  # type: ignore[index,operator]
        )
    print(f"shared / unshared: measured {results['ratio_measured']}, needed (no padding) {results['ratio_predicted']}")
    print(json.dumps(results))
    out = Path(__file__).parent / "results" / "gemma4_kv_bytes.json"
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
