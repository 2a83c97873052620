"""A batch beside interactive traffic: does the Batch API fill idle capacity without slowing
interactive requests down?

    python benchmarks/batch_priority.py              # the embedded SmolLM2-135M
    python benchmarks/batch_priority.py --quick      # a smoke run (fewer lines, shorter load)

One `pagellm serve` process (the default model, --batch-dir in a temporary folder), then:

1. Interactive alone: a steady open-loop load of streaming chat requests (Poisson arrivals
   at --rate per second for --duration seconds, the same seeded schedule in both phases;
   a short user question each, --interactive-tokens output tokens, ignore_eos). Client-side
   TTFT and inter-token latency per request.
2. The same load while a batch runs: a batch of --lines chat lines sharing one system prompt
   (--line-tokens output tokens each) is created first; once it is in progress the
   interactive load starts again. The batch's progress (request_counts, output tokens of the
   finished lines) is read when the load starts and when it ends: the batch's throughput
   while sharing. Then the batch is left to finish (or cancelled with --no-finish) and its
   throughput alone is read the same way.

Reports p50/p90 TTFT and p50 ITL of both phases and their ratios (the target: interactive p50
TTFT within 1.2x of the load alone), the batch's lines/s and output tok/s while sharing and
alone, the prefix-cache hit rate over the batch, and the CPU. Writes
benchmarks/results/batch_priority.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx2

from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.results import write_result_files
from pagellm.bench.serve_load import ServeBenchConfig, run_requests
from pagellm.bench.serve_metrics import summarize

READY_MARK = "pagellm is ready: model "
KEYS = ("completed", "failed", "ttft_ms_median", "ttft_ms_p90", "itl_ms_median", "output_tok_s")
RESULTS = Path(__file__).parent / "results" / "batch_priority.json"
SYSTEM = (
    "You are a careful assistant for a product catalogue. Answer with the product's category, "
    "one short sentence of description and a price range in euros. Keep answers short. "
)


def start_server(flags: list[str]) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", "0", *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if READY_MARK in line and not url:
                url.append(line.split(" at ", 1)[1].split("/v1", 1)[0])
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(600) or not url:
        process.kill()
        raise SystemExit("the server did not start")
    return process, url[0]


def metric(base_url: str, name: str) -> float:
    text = httpx2.get(base_url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def batch_state(base_url: str, batch_id: str) -> dict[str, Any]:
    return httpx2.get(f"{base_url}/v1/batches/{batch_id}", timeout=30).json()


def output_tokens_so_far(base_url: str) -> float:
    return metric(base_url, "pagellm:generation_tokens_total")


def interactive_load(base_url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    count = max(1, int(args.rate * args.duration))
    prompts = [f"Question {i}: what is a {rng.choice(['lamp', 'chair', 'kettle', 'desk', 'phone'])} for?" for i in range(count)]
    config = ServeBenchConfig(base_url=base_url, endpoint="chat", model=model, request_rate=args.rate, seed=args.seed)
    outputs = [args.interactive_tokens] * count
    run = asyncio.run(run_requests(config, prompts, outputs, [0] * count))
    return summarize(run.records, run.duration_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--line-tokens", type=int, default=16)
    parser.add_argument("--rate", type=float, default=1.0, help="interactive requests per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of interactive load per phase")
    parser.add_argument("--interactive-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--background-token-budget", type=int, default=None, help="the serve flag (default: its default)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-finish", action="store_true", help="cancel the batch after the shared phase")
    args = parser.parse_args()
    if args.quick:
        args.lines, args.duration = 200, 20.0
    batch_dir = tempfile.mkdtemp(prefix="pagellm-bench-batches-")
    flags = ["--batch-dir", batch_dir, "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "bench"]
    if args.model:
        flags += ["--model", args.model]
    if args.background_token_budget is not None:
        flags += ["--background-token-budget", str(args.background_token_budget)]
    process, base_url = start_server(flags)
    try:
        interactive_load(base_url, "bench", argparse.Namespace(**{**vars(args), "duration": 5.0}))  # warm up
        alone = interactive_load(base_url, "bench", args)

        rng = random.Random(args.seed + 1)
        products = ["lamp", "chair", "kettle", "desk", "phone", "bike", "tent", "oven", "sofa", "drill"]
        lines = [
            json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
                "model": "bench", "max_tokens": args.line_tokens, "ignore_eos": True, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Item {i}: a {rng.choice(products)} of size {rng.randint(1, 99)}."}],
            }})  # fmt: skip
            for i in range(args.lines)
        ]
        content = ("\n".join(lines) + "\n").encode()
        file = httpx2.post(base_url + "/v1/files", files={"file": ("batch.jsonl", content)}, data={"purpose": "batch"}, timeout=60).json()
        hits0, queries0 = metric(base_url, "pagellm:prefix_cache_hits_total"), metric(base_url, "pagellm:prefix_cache_queries_total")
        batch = httpx2.post(base_url + "/v1/batches", json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                                                            "completion_window": "24h"}, timeout=60).json()  # fmt: skip
        while batch_state(base_url, batch["id"])["request_counts"]["completed"] < 1:
            time.sleep(0.2)
        start_state, start_tokens, start_time = batch_state(base_url, batch["id"]), output_tokens_so_far(base_url), time.perf_counter()
        shared = interactive_load(base_url, "bench", args)
        shared_time = time.perf_counter() - start_time
        end_state = batch_state(base_url, batch["id"])
        lines_shared = end_state["request_counts"]["completed"] - start_state["request_counts"]["completed"]
        interactive_tokens = shared["completed"] * args.interactive_tokens
        batch_tokens_shared = output_tokens_so_far(base_url) - start_tokens - interactive_tokens
        result: dict[str, Any] = {
            "cpu": describe_cpu(cpu_info()),
            "config": {k: v for k, v in vars(args).items() if k != "quick"},
            "interactive_alone": {k: alone.get(k) for k in KEYS},
            "interactive_with_batch": {k: shared.get(k) for k in KEYS},
            "batch_while_sharing": {"seconds": round(shared_time, 1), "lines": lines_shared,
                                    "lines_per_s": round(lines_shared / shared_time, 2),
                                    "output_tok_per_s": round(batch_tokens_shared / shared_time, 1)},
        }  # fmt: skip
        for key in ("ttft_ms_median", "ttft_ms_p90", "itl_ms_median"):
            if alone.get(key) and shared.get(key):
                result[f"{key}_ratio"] = round(shared[key] / alone[key], 3)
        if args.no_finish:
            httpx2.post(f"{base_url}/v1/batches/{batch['id']}/cancel", timeout=60)
        else:
            rest_start, rest_state, rest_tokens = time.perf_counter(), batch_state(base_url, batch["id"]), output_tokens_so_far(base_url)
            while (state := batch_state(base_url, batch["id"]))["status"] not in ("completed", "failed", "cancelled", "expired"):
                time.sleep(0.5)
            rest_time = time.perf_counter() - rest_start
            rest_lines = state["request_counts"]["completed"] - rest_state["request_counts"]["completed"]
            result["batch_alone"] = {"seconds": round(rest_time, 1), "lines": rest_lines,
                                     "lines_per_s": round(rest_lines / rest_time, 2),
                                     "output_tok_per_s": round((output_tokens_so_far(base_url) - rest_tokens) / rest_time, 1)}  # fmt: skip
            result["batch_final"] = {"status": state["status"], **state["request_counts"]}
            hits, queries = metric(base_url, "pagellm:prefix_cache_hits_total") - hits0, metric(base_url, "pagellm:prefix_cache_queries_total") - queries0
            result["prefix_hit_rate_during_batch"] = round(hits / queries, 3) if queries else None
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(120)
    rows = ["| phase | TTFT p50 ms | TTFT p90 ms | ITL p50 ms |", "|---|---|---|---|"]
    for name, key in (("interactive alone", "interactive_alone"), ("interactive + batch", "interactive_with_batch")):
        r = result[key]
        rows.append(f"| {name} | {r['ttft_ms_median']} | {r['ttft_ms_p90']} | {r['itl_ms_median']} |")
    markdown = "\n".join([f"CPU: {result['cpu']}", "", *rows, "", "```json", json.dumps(result, indent=1), "```", ""])
    write_result_files(RESULTS, result, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
