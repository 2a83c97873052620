"""Single-stream decode, pagellm against llama.cpp on the same GGUF file, in short interleaved
bursts: a pairing that holds on a machine whose speed drifts within a minute.

    python benchmarks/paired_decode.py MODEL.gguf [--pairs 12] [--prompt 16] [--tokens 48]

Each engine lives in its own process, loaded once and warmed up (pagellm also runs its first
steps' measurements there). Then they take turns, one request each (a prompt of --prompt
token ids, --tokens greedy output tokens, end of sequence ignored), A B A B ..., while the
other process waits idle; each burst is timed inside its process from the request to its
last token (prefill included), and again as a 1-token request, whose time (prefill and the
first token) taken off gives the decode alone. The figures are the medians of the pairs'
ratios: output tokens per second of the whole request, of the decode alone, and the speed
of the first token (llama.cpp's time over pagellm's); llama.cpp runs through llama-cpp-python's Llama
class with the threads pagellm uses (torch.get_num_threads()).

`bench throughput` (benchmarks/hybrid_decode.py) runs each engine for half a minute in
turn: on a shared machine whose bandwidth changes at that scale its rounds disagree by up
to 1.7x; bursts of a second or two pair the engines within the same conditions.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

from pagellm.bench.machine import cpu_info, describe_cpu


def _pagellm_worker(path: str, prompt: list[int], tokens: int, commands: Any, results: Any) -> None:
    import torch

    from pagellm import LLM, SamplingParams

    llm = LLM(model=path, dtype="bfloat16", max_model_len=len(prompt) + tokens + 16, enable_prefix_caching=False)
    request = {"prompt_token_ids": prompt}

    def burst(count: int) -> float:
        params = SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        output = llm.generate([request], params, use_tqdm=False)[0]
        assert len(output.outputs[0].token_ids) == count
        return time.perf_counter() - start

    for _ in range(3):  # warm-up: the kernels' and the step paths' first-step measurements
        burst(tokens)
    results.put(("ready", torch.get_num_threads()))
    while commands.get() == "go":
        results.put(("burst", (burst(1), burst(tokens))))


def _llamacpp_worker(path: str, prompt: list[int], tokens: int, threads: int, commands: Any, results: Any) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + tokens + 16,
                n_batch=512, verbose=False)  # fmt: skip

    def burst(count: int) -> float:
        llm.reset()
        start = time.perf_counter()
        made = 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            made += 1
            if made == count:
                break
        return time.perf_counter() - start

    for _ in range(3):
        burst(tokens)
    results.put(("ready", threads))
    while commands.get() == "go":
        results.put(("burst", (burst(1), burst(tokens))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file both engines load")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=48, help="output tokens per burst")
    parser.add_argument("--out", default=None, help="write the record as JSON here")
    args = parser.parse_args()
    prompt = [100 + (i * 37) % 1000 for i in range(args.prompt)]
    context = mp.get_context("spawn")
    queues = {name: (context.Queue(), context.Queue()) for name in ("pagellm", "llamacpp")}
    workers = {"pagellm": context.Process(target=_pagellm_worker, args=(args.model, prompt, args.tokens, *queues["pagellm"]))}
    workers["pagellm"].start()
    kind, threads = queues["pagellm"][1].get()
    assert kind == "ready"
    workers["llamacpp"] = context.Process(
        target=_llamacpp_worker, args=(args.model, prompt, args.tokens, threads, *queues["llamacpp"])
    )
    workers["llamacpp"].start()
    assert queues["llamacpp"][1].get()[0] == "ready"
    # Per burst: output tok/s of the whole request, and of its decode alone ((tokens - 1) over
    # the time beyond a 1-token request's: prefill and first token).
    rates: dict[str, list[float]] = {"pagellm": [], "llamacpp": []}
    decode: dict[str, list[float]] = {"pagellm": [], "llamacpp": []}
    first: dict[str, list[float]] = {"pagellm": [], "llamacpp": []}
    for index in range(args.pairs):
        order = ("pagellm", "llamacpp") if index % 2 == 0 else ("llamacpp", "pagellm")  # neither always first
        for name in order:
            commands, results = queues[name]
            commands.put("go")
            kind, (one, whole) = results.get()
            assert kind == "burst"
            rates[name].append(args.tokens / whole)
            decode[name].append((args.tokens - 1) / max(whole - one, 1e-9))
            first[name].append(one)
    for name, (commands, _) in queues.items():
        commands.put("stop")
        workers[name].join()
    ratios = [a / b for a, b in zip(rates["pagellm"], rates["llamacpp"], strict=True)]
    decode_ratios = [a / b for a, b in zip(decode["pagellm"], decode["llamacpp"], strict=True)]
    first_ratios = [b / a for a, b in zip(first["pagellm"], first["llamacpp"], strict=True)]
    record = {
        "cpu": describe_cpu(cpu_info()), "model": args.model, "threads": threads, "prompt_tokens": args.prompt,
        "output_tokens": args.tokens, "pagellm_tok_s": rates["pagellm"], "llamacpp_tok_s": rates["llamacpp"],
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "pagellm_median": statistics.median(rates["pagellm"]), "llamacpp_median": statistics.median(rates["llamacpp"]),
        "decode_tok_s": decode, "decode_ratio_median": statistics.median(decode_ratios),
        "first_token_s": first, "first_token_speed_ratio_median": statistics.median(first_ratios),
    }  # fmt: skip
    print(json.dumps(record, indent=1))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(record, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
