"""How close pagellm's default (bf16) path is to float32: teacher-forced log-probabilities
against HF transformers in float32 on the same weights, beside HF's own bf16.

For each held-out prompt pagellm generates greedily (its decode path: the log-probability
of every emitted token), then reads prompt + completion again as a prompt with
prompt_logprobs (its prefill path). HF float32 and HF bf16 read the same token sequence
once each. At every position the log-probability of the token that stands there is
compared with HF float32's: the mean |delta| of each path, and HF bf16's on the same
positions. The issue's target: pagellm's mean at most half of HF bf16's.

    python benchmarks/precision.py                     # the embedded SmolLM2
    python benchmarks/precision.py --model path.gguf --tokens 48
    PAGELLM_LINEAR_KERNEL=onednn python benchmarks/precision.py   # one forced linear path
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from pagellm import LLM, SamplingParams
from pagellm.bench.backends import hf_model
from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.model.checkpoint.default_model import default_model_path

# Held out: none of these is a prompt any test or benchmark tunes on.
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a paperclip.",
    "def quicksort(values):",
    "The history of the printing press began",
    "Translate 'good morning' into Spanish and German.",
    "How many legs does a spider have, and why?",
    "Once upon a time, in a village by the sea,",
    "Give me a recipe for pancakes.",
    "What is 17 multiplied by 23?",
    "Describe the water cycle for a ten-year-old.",
]


def hf_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """log p(token_i | tokens before it) for i >= 1, float64 [len - 1]."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].double()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(token_ids[1:]).unsqueeze(1)).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens generated per prompt")
    parser.add_argument("--output", default="benchmarks/results/precision.json")
    parser.add_argument("--int8-activations", action="store_true", help="pagellm's int8-activation kernels")
    parser.add_argument("--kv-cache-dtype", default="auto", help="pagellm's KV cache element type")
    args = parser.parse_args()
    model_path = Path(args.model) if args.model else default_model_path()

    llm = LLM(
        str(model_path), dtype="bfloat16", disable_log_stats=True,
        int8_activations=args.int8_activations, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True) for p in PROMPTS]
    generated = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=args.tokens, logprobs=0, ignore_eos=True),
        use_tqdm=False,
    )
    sequences = [p + list(g.outputs[0].token_ids) for p, g in zip(prompts, generated)]
    reread = llm.generate(
        [{"prompt_token_ids": s} for s in sequences],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    del llm
    hf32 = hf_model(model_path, torch.float32)
    hf16 = hf_model(model_path, torch.bfloat16)

    decode, prefill, hf_bf16_decode, hf_bf16_all = [], [], [], []
    for prompt, sequence, gen, again in zip(prompts, sequences, generated, reread):
        reference = hf_logprobs(hf32, sequence)
        bf16 = hf_logprobs(hf16, sequence)
        start = len(prompt) - 1  # index of the first generated token's log-prob in `reference`
        for i, (token, logprob) in enumerate(zip(gen.outputs[0].token_ids, gen.outputs[0].logprobs)):
            decode.append(abs(logprob[token].logprob - float(reference[start + i])))
            hf_bf16_decode.append(abs(float(bf16[start + i]) - float(reference[start + i])))
        for i, entry in enumerate(again.prompt_logprobs[1:]):
            token = sequence[i + 1]
            prefill.append(abs(entry[token].logprob - float(reference[i])))
            hf_bf16_all.append(abs(float(bf16[i]) - float(reference[i])))

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    result = {
        "benchmark": "precision",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_info(),
        "model": model_path.name,
        "linear_kernel": os.environ.get("PAGELLM_LINEAR_KERNEL", "auto"),
        "int8_activations": args.int8_activations,
        "kv_cache_dtype": args.kv_cache_dtype,
        "prompts": len(PROMPTS),
        "decode_positions": len(decode),
        "prefill_positions": len(prefill),
        "pagellm_decode_mean_abs_dlogprob": mean(decode),
        "hf_bf16_decode_mean_abs_dlogprob": mean(hf_bf16_decode),
        "pagellm_prefill_mean_abs_dlogprob": mean(prefill),
        "hf_bf16_prefill_mean_abs_dlogprob": mean(hf_bf16_all),
    }
    result["decode_ratio"] = result["pagellm_decode_mean_abs_dlogprob"] / result["hf_bf16_decode_mean_abs_dlogprob"]
    result["prefill_ratio"] = result["pagellm_prefill_mean_abs_dlogprob"] / result["hf_bf16_prefill_mean_abs_dlogprob"]
    print(f"precision against HF float32, {model_path.name}, {describe_cpu(result['cpu'])}, "
          f"linear kernel {result['linear_kernel']}")
    print("| path | positions | pagellm bf16 mean abs dlogprob | HF bf16 | ratio |")
    print("|---|---:|---:|---:|---:|")
    print(f"| decode (generated tokens) | {len(decode)} | {result['pagellm_decode_mean_abs_dlogprob']:.4f} | "
          f"{result['hf_bf16_decode_mean_abs_dlogprob']:.4f} | {result['decode_ratio']:.2f} |")
    print(f"| prefill (prompt_logprobs) | {len(prefill)} | {result['pagellm_prefill_mean_abs_dlogprob']:.4f} | "
          f"{result['hf_bf16_prefill_mean_abs_dlogprob']:.4f} | {result['prefill_ratio']:.2f} |")
    print(json.dumps(result))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("a", encoding="utf-8") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
