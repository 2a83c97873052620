"""Embeddings throughput on the embedded model (SmolLM2-135M-Instruct, last-token pooling,
L2-normalised): pagellm's LLM.embed against HF transformers' forward + the same pooling on
the same inputs, side by side in one run.

    python benchmarks/embeddings.py [--inputs 256] [--min-len 16] [--max-len 256] [--hf-batch 16]

The inputs are token ids drawn at random (seeded) with lengths spread evenly between
--min-len and --max-len, so that both sides read exactly the same tokens. pagellm runs its
default path (bf16 weights, the measured CPU kernels, the scheduler's token budget);
HF runs `model.model(ids, attention_mask)` in float32 and in bf16 on batches of --hf-batch
inputs of similar lengths (sorted, as sentence-transformers batches), right-padded, and
pools each input's last real position. pagellm runs without its prefix cache, which the
repeated runs would otherwise hit. Each
figure is input tokens per second, the median of --repeats timed runs after a warm-up.
Also reported: the smallest cosine similarity between pagellm's embeddings and HF
float32's (bf16 rounding moves them a little). Prints the CPU and a table; writes
benchmarks/results/embeddings.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pagellm import LLM
from pagellm.bench.backends import hf_model
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.model.checkpoint.default_model import default_model_path

RESULT = Path(__file__).resolve().parent / "results" / "embeddings.json"


def make_inputs(count: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [min_len + (max_len - min_len) * i // max(count - 1, 1) for i in range(count)]
    order = torch.randperm(count, generator=generator).tolist()  # lengths mixed in arrival order
    return [torch.randint(100, vocab, (lengths[i],), generator=generator).tolist() for i in order]


def timed(run, repeats: int) -> tuple[float, object]:  # noqa: ANN001
    run()  # warm-up (kernels measured, caches filled)
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


@torch.inference_mode()
def hf_embed(model, inputs: list[list[int]], batch: int) -> torch.Tensor:  # noqa: ANN001
    # Batches of similar lengths (as sentence-transformers forms them): little padding.
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    rows = []
    for first in range(0, len(order), batch):
        group = [inputs[i] for i in order[first : first + batch]]
        width = max(len(ids) for ids in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, tokens in enumerate(group):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = torch.tensor([len(tokens) - 1 for tokens in group])
        rows.append(torch.nn.functional.normalize(hidden[torch.arange(len(group)), last].float(), dim=-1))
    embedded = torch.cat(rows)
    result = torch.empty_like(embedded)
    result[torch.tensor(order)] = embedded
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()

    path = default_model_path()
    cpu = cpu_info()
    print(f"CPU {describe_cpu(cpu)}, {torch.get_num_threads()} threads; model {path.name}")
    # No prefix cache: every timed run computes every input (repeats would hit it).
    llm = LLM(str(path), enable_prefix_caching=False)
    inputs = make_inputs(args.inputs, args.min_len, args.max_len, llm.engine.model_config.vocab_size)
    num_tokens = sum(len(ids) for ids in inputs)
    rows = []
    seconds, outputs = timed(lambda: llm.embed(inputs, use_tqdm=False), args.repeats)
    ours = torch.tensor([o.outputs.embedding for o in outputs])
    rows.append({"backend": "pagellm (default: bf16, native kernels)", "seconds": seconds, "tokens_per_s": num_tokens / seconds})
    llm.shutdown()
    reference = None
    for dtype in (torch.float32, torch.bfloat16):
        model = hf_model(path, dtype)
        seconds, embedded = timed(lambda model=model: hf_embed(model, inputs, args.hf_batch), args.repeats)
        if dtype is torch.float32:
            reference = embedded
        name = f"HF transformers {str(dtype).removeprefix('torch.')} (sorted batches of {args.hf_batch})"
        rows.append({"backend": name, "seconds": seconds, "tokens_per_s": num_tokens / seconds})
        del model
    assert reference is not None
    cosine = float((ours * reference).sum(dim=-1).min())
    best_hf = max(row["tokens_per_s"] for row in rows[1:])
    ratio = rows[0]["tokens_per_s"] / best_hf
    print(f"{args.inputs} inputs of {args.min_len}-{args.max_len} tokens ({num_tokens} tokens), median of {args.repeats}")
    print(f"{'backend':50s} {'seconds':>8s} {'tokens/s':>10s}")
    for row in rows:
        print(f"{row['backend']:50s} {row['seconds']:8.2f} {row['tokens_per_s']:10.0f}")
    print(f"pagellm / best HF: {ratio:.2f}x; smallest cosine(pagellm, HF float32) {cosine:.5f}")
    record = {
        "bench": "embeddings", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": cpu,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "model": path.name,
        "inputs": args.inputs, "lengths": [args.min_len, args.max_len], "tokens": num_tokens,
        "hf_batch": args.hf_batch, "repeats": args.repeats, "runs": rows, "ratio_to_best_hf": ratio,
        "min_cosine_to_hf_float32": cosine,
    }  # fmt: skip
    print(json.dumps(record))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
