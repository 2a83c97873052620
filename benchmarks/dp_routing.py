"""Data parallelism on the CPU: `pagellm serve --data-parallel-size 2` against one engine
with the same cores, and what prefix-affinity routing is worth against load-only routing.

    python benchmarks/dp_routing.py                  # the embedded SmolLM2-135M, default dtype
    python benchmarks/dp_routing.py --quick          # a smoke run: fewer requests (~2-3 minutes)
    python benchmarks/dp_routing.py --model PATH --kv-blocks 4096

1. Servers. Three configurations, each a fresh `pagellm serve --port 0` process, warmed up,
   measured on both workloads, then stopped (SIGINT; its replicas stop with it):
   - one engine: plain `pagellm serve`, OMP_NUM_THREADS unset, so torch takes its default
     (every core);
   - DP=2 affinity: `--data-parallel-size 2`: two replicas, each with OMP_NUM_THREADS =
     cores // 2 (the router sets it), behind a router that goes by prefix-cache affinity,
     then load;
   - DP=2 load: the same with `--data-parallel-routing load` (least loaded only).
   --kv-blocks N gives the one engine N KV blocks and each replica N // 2 (equal total
   capacity); by default every engine takes its own default budget (each replica as much as
   the one engine), which for a 135M model holds every prompt here, so nothing is evicted.
2. Workloads, the same request lists for every configuration, sent with
   pagellm.bench.serve_load.run_requests (streaming completions with token-id prompts,
   ignore_eos, exact output lengths; all at once, at most --max-concurrency in flight):
   - mixed: `pagellm bench serve --workload mixed` (random prompts, uniform lengths);
   - grouped prefix: G groups, each a random shared prefix of 256-512 tokens, several
     requests per group with distinct random suffixes, all requests shuffled. A group's
     prefix is computed once per KV cache that serves it: affinity routing keeps a group on
     one replica, load-only routing spreads it over both, so it computes it twice.
3. Per (configuration, workload): wall time, req/s, output tok/s, TTFT (client side,
   through the router for DP), and from /metrics read before and after (summed over the
   replicas): prefix-hit rate = delta prefix_cache_hits / delta prefix_cache_queries
   (tokens), prompt tokens computed, preemptions, achieved GFLOP/s of the engines' own
   estimate; for DP the requests each replica finished and the router's decisions by
   reason. The grouped workload's best hit rates are computed from the request list: one
   cache (each group's prefix computed once) and two caches that both see every group.

Prints the configuration, the CPU, tables and one JSON line; writes
benchmarks/results/dp_routing.json (the JSON line) and dp_routing.md (the tables).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.bench.machine import cpu_info, describe_cpu
from pagellm.bench.results import write_result_files
from pagellm.bench.serve_load import ServeBenchConfig, run_requests
from pagellm.bench.serve_metrics import summarize
from pagellm.workload.synthetic import WorkloadSpec, make_workload

READY_MARK = "pagellm is ready: model "
REPLICA_PID = re.compile(r"\[replica (\d+)\] replica up at \S+, pid (\d+)")
KV_CACHE = re.compile(r"KV cache: (\d+) blocks of (\d+) tokens")  # an engine's ready line
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 90.0
BLOCK_SIZE = 16  # the engine's default --block-size: the unit the prefix cache hits in
VOCAB = (100, 30000)  # ordinary token ids of the embedded model (as `bench serve`)

CONFIGS = {
    # name: (serve flags, replicas)
    "one engine": ([], 1),
    "DP=2 affinity": (["--data-parallel-size", "2"], 2),
    "DP=2 load": (["--data-parallel-size", "2", "--data-parallel-routing", "load"], 2),
}
METRICS = {
    # short name: Prometheus sample name (counters; summed over every label but `replica`)
    "prefix_hits": "pagellm:prefix_cache_hits_total",
    "prefix_queries": "pagellm:prefix_cache_queries_total",
    "prefill_tokens": "pagellm:prefill_tokens_total",
    "generation_tokens": "pagellm:generation_tokens_total",
    "requests_finished": "pagellm:request_success_total",
    "preemptions": "pagellm:num_preemptions_total",
    "estimated_flops": "pagellm:estimated_flops_total",
}
ROUTER_DECISIONS = "pagellm:router_requests_total"


# -- workloads (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int
    group: int | None = None  # grouped workload: which shared prefix
    prefix_len: int = 0


def mixed_requests(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[Request]:
    """`pagellm bench serve --workload mixed`'s request list."""
    spec = WorkloadSpec(kind="mixed", num_requests=num_requests, prompt_len=prompt_len, output_len=output_len,
                        seed=seed, vocab_low=VOCAB[0], vocab_high=VOCAB[1])  # fmt: skip
    return [Request(r.prompt_token_ids, r.output_len) for r in make_workload(spec)]


def grouped_prefix_requests(
    num_groups: int, requests_per_group: int, prefix_len: tuple[int, int], suffix_len: tuple[int, int],
    output_len: tuple[int, int], seed: int,
) -> list[Request]:  # fmt: skip
    """num_groups random prefixes (lengths uniform in prefix_len), requests_per_group
    requests on each with their own random suffix; the whole list shuffled."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    requests = []
    for group in range(num_groups):
        prefix = tokens(rng.randint(*prefix_len))
        for _ in range(requests_per_group):
            requests.append(Request(prefix + tokens(rng.randint(*suffix_len)), rng.randint(*output_len), group, len(prefix)))
    rng.shuffle(requests)
    return requests


def best_hit_rate(requests: list[Request], num_caches: int, block_size: int = BLOCK_SIZE) -> float:
    """The prefix-hit rate (hit tokens / prompt tokens) if each group's prefix were computed
    once per cache that serves it and found by every later request there: `num_caches` = 1
    is one engine (or perfect affinity), 2 is two replicas that both see every group.
    Only full blocks are found; suffixes are random, so they never hit."""
    by_group = collections.Counter(r.group for r in requests if r.group is not None)
    prefix_blocks = {r.group: r.prefix_len // block_size for r in requests if r.group is not None}
    hits = sum(max(0, count - num_caches) * prefix_blocks[g] * block_size for g, count in by_group.items())
    total = sum(len(r.prompt_token_ids) for r in requests)
    return hits / total if total else 0.0


def warmup_requests(seed: int) -> list[Request]:
    """Short and long prompts, unrelated to the workloads (own seed), to touch every kernel
    path once on each replica before the clock starts."""
    rng = random.Random(seed)
    return [Request([rng.randrange(*VOCAB) for _ in range(n)], 16) for n in (32, 320, 48, 400)]


# -- /metrics (pure) -------------------------------------------------------------------------


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text -> (sample name, labels, value) for every sample."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def sum_by(samples: list[tuple[str, dict[str, str], float]], name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """Values of `name` summed over every label but `labels` ('' where a sample lacks one)."""
    totals: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for sample_name, sample_labels, value in samples:
        if sample_name == name:
            totals[tuple(sample_labels.get(label, "") for label in labels)] += value
    return dict(totals)


def counter_deltas(before: list, after: list) -> dict[str, Any]:
    """The counters' growth between two /metrics readings: totals, per replica, and the
    router's decisions (replica, reason)."""
    result: dict[str, Any] = {"total": {}, "by_replica": {}}
    for short, name in METRICS.items():
        old, new = sum_by(before, name, "replica"), sum_by(after, name, "replica")
        per_replica = {key[0]: new.get(key, 0.0) - old.get(key, 0.0) for key in new}
        result["total"][short] = sum(per_replica.values())
        if any(replica for replica in per_replica):  # DP: the replica label is there
            result["by_replica"][short] = dict(sorted(per_replica.items()))
    old, new = sum_by(before, ROUTER_DECISIONS, "replica", "reason"), sum_by(after, ROUTER_DECISIONS, "replica", "reason")
    decisions = {f"{replica}/{reason}": new[(replica, reason)] - old.get((replica, reason), 0.0) for replica, reason in new}
    result["router_decisions"] = {k: v for k, v in sorted(decisions.items()) if v}
    queries = result["total"]["prefix_queries"]
    result["prefix_hit_rate"] = result["total"]["prefix_hits"] / queries if queries else None
    return result


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator is not None and denominator else None


# -- servers ---------------------------------------------------------------------------------


class Server:
    """`python -m pagellm.entrypoints.cli serve --port 0 ARGS`; its URL is read from its log
    (the router's ready line, for DP: the replicas' lines say "replica up at")."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", "0", *args]
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log_tail: collections.deque[str] = collections.deque(maxlen=300)
        self.replica_pids: dict[int, int] = {}
        self.kv_caches: list[tuple[int, int]] = []  # (blocks, block size) of each engine
        self.base_url = ""
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        if not self._ready.wait(START_TIMEOUT_S) or not self.base_url:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(list(self.log_tail)[-40:]))

    def _read_log(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log_tail.append(line)
            if match := REPLICA_PID.search(line):
                self.replica_pids[int(match[1])] = int(match[2])
            if (READY_MARK in line or "replica up at" in line) and (match := KV_CACHE.search(line)):
                self.kv_caches.append((int(match[1]), int(match[2])))
            if READY_MARK in line and not self.base_url:
                self.base_url = line.split(" at ", 1)[1].split("/v1", 1)[0]  # "... at http://HOST:PORT/v1 ..."
                self._ready.set()
        self._ready.set()  # the process ended: stop waiting

    def stop(self) -> int | None:
        """SIGINT, then SIGKILL after STOP_TIMEOUT_S; replicas still running after their
        router ended (it was killed) are killed by their pid."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        for pid in self.replica_pids.values():
            try:
                os.kill(pid, 0)
            except OSError:
                continue
            print(f"  replica pid {pid} outlived its router: killing it", flush=True)
            os.kill(pid, signal.SIGKILL)
        self._reader.join(5)
        return code


def get_samples(base_url: str) -> list[tuple[str, dict[str, str], float]]:
    import httpx2

    response = httpx2.get(base_url + "/metrics", timeout=60, trust_env=False)
    response.raise_for_status()
    return parse_samples(response.text)


def send(base_url: str, requests: list[Request], args: argparse.Namespace, max_concurrency: int | None = None) -> dict[str, Any]:
    extra = {} if args.temperature is None else {"temperature": args.temperature}
    config = ServeBenchConfig(base_url=base_url, max_concurrency=max_concurrency or args.max_concurrency,
                              request_timeout_s=1800.0, seed=args.seed, extra_body=extra)  # fmt: skip
    run = asyncio.run(run_requests(config, [r.prompt_token_ids for r in requests], [r.output_len for r in requests],
                                   [len(r.prompt_token_ids) for r in requests]))  # fmt: skip
    return summarize(run.records, run.duration_s)


def torch_default_threads(env: dict[str, str]) -> int | None:
    """torch.get_num_threads() of a fresh process with this environment (as the one engine)."""
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                          env=env, capture_output=True, text=True, check=False)  # fmt: skip
    return int(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip().isdigit() else None


def run_config(name: str, args: argparse.Namespace, workloads: dict[str, list[Request]], env: dict[str, str]) -> dict:
    flags, num_replicas = CONFIGS[name]
    serve_args = [*flags, *(["--model", args.model] if args.model else []), *(["--dtype", args.dtype] if args.dtype else [])]
    if args.kv_blocks:
        serve_args += ["--num-gpu-blocks-override", str(args.kv_blocks // num_replicas)]
    print(f"\n== {name}: pagellm serve --port 0 {' '.join(serve_args)}", flush=True)
    started = time.perf_counter()
    try:
        server = Server(serve_args, env)
    except RuntimeError as e:
        print(f"  failed: {e}", flush=True)
        return {"config": name, "serve_args": serve_args, "error": str(e).splitlines()[0]}
    record: dict[str, Any] = {"config": name, "serve_args": serve_args, "replicas": num_replicas,
                              "start_s": round(time.perf_counter() - started, 1), "workloads": {}}  # fmt: skip
    record["kv_blocks_per_engine"] = [blocks for blocks, _ in server.kv_caches]
    if any(size != BLOCK_SIZE for _, size in server.kv_caches):
        print(f"  note: block size {server.kv_caches} is not {BLOCK_SIZE}: the best hit rates assume {BLOCK_SIZE}")
    print(f"  up at {server.base_url} in {record['start_s']} s; KV blocks per engine {record['kv_blocks_per_engine']}",
          flush=True)  # fmt: skip
    try:
        warm = warmup_requests(args.seed + 99)
        send(server.base_url, warm, args, len(warm))  # all at once: they spread over the replicas
        send(server.base_url, warm, args, len(warm))  # the same again: prefix-cache hits warmed too
        for workload, requests in workloads.items():
            before = get_samples(server.base_url)
            summary = send(server.base_url, requests, args)
            deltas = counter_deltas(before, get_samples(server.base_url))
            wall = summary["duration_s"]
            flops = deltas["total"]["estimated_flops"]
            result = {**summary, **deltas, "achieved_gflop_s": round(flops / wall / 1e9, 1) if wall else None}
            record["workloads"][workload] = result
            hit = result["prefix_hit_rate"]
            print(f"  {workload}: {summary['completed']}/{summary['num_requests']} ok in {wall:.1f} s, "
                  f"{summary['output_tok_s']} output tok/s, prefix hits {'-' if hit is None else f'{hit:.1%}'}"
                  + (f", errors {summary['errors']}" if summary["errors"] else ""), flush=True)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others
        record["error"] = f"{type(e).__name__}: {e}"
        print(f"  failed: {record['error']}\n" + "".join(list(server.log_tail)[-30:]), flush=True)
    finally:
        record["exit_code"] = server.stop()
    return record


# -- report ----------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def render_tables(records: list[dict], workloads: dict[str, list[Request]]) -> tuple[list[str], dict[str, Any]]:
    """Markdown tables (one per workload) and the ratios."""
    lines: list[str] = []
    ratios: dict[str, Any] = {}
    for workload, requests in workloads.items():
        lines += [f"### {workload}", "",
                  ("| config | ok | wall s | req/s | output tok/s | TTFT mean / p50 / p99 ms | prefix hits | "
                   "prompt tok computed | GFLOP/s | requests per replica | router decisions |"),
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
        by_config: dict[str, dict] = {}
        for record in records:
            w = record.get("workloads", {}).get(workload)
            if w is None:
                lines.append(f"| {record['config']} | failed: {record.get('error', 'not run')} | | | | | | | | | |")
                continue
            by_config[record["config"]] = w
            per_replica = w["by_replica"].get("requests_finished", {})
            replicas = ", ".join(f"{k}: {int(v)}" for k, v in per_replica.items()) or "-"
            decisions = ", ".join(f"{k} {int(v)}" for k, v in w["router_decisions"].items()) or "-"
            ttft = f"{fmt(w['ttft_ms_mean'], '.0f')} / {fmt(w['ttft_ms_median'], '.0f')} / {fmt(w['ttft_ms_p99'], '.0f')}"
            hit = w["prefix_hit_rate"]
            lines.append(
                f"| {record['config']} | {w['completed']}/{w['num_requests']} | {w['duration_s']:.1f} | "
                f"{fmt(w['requests_per_s'], '.2f')} | {fmt(w['output_tok_s'])} | {ttft} | "
                f"{'-' if hit is None else f'{hit:.1%}'} | {int(w['total']['prefill_tokens'])} | "
                f"{fmt(w['achieved_gflop_s'])} | {replicas} | {decisions} |"
            )
        one, aff, load = (by_config.get(name) for name in CONFIGS)

        def get(w: dict | None, key: str) -> float | None:
            return None if w is None else w.get(key)

        ratios[workload] = {
            "output_tok_s_dp_affinity_over_one": ratio(get(aff, "output_tok_s"), get(one, "output_tok_s")),
            "output_tok_s_dp_affinity_over_dp_load": ratio(get(aff, "output_tok_s"), get(load, "output_tok_s")),
            "req_s_dp_affinity_over_one": ratio(get(aff, "requests_per_s"), get(one, "requests_per_s")),
            "hit_rate_dp_affinity_over_one": ratio(get(aff, "prefix_hit_rate"), get(one, "prefix_hit_rate")),
            "hit_rate_dp_affinity_over_dp_load": ratio(get(aff, "prefix_hit_rate"), get(load, "prefix_hit_rate")),
        }
        r = ratios[workload]
        lines += ["", (f"DP=2 affinity / one engine: output tok/s {fmt(r['output_tok_s_dp_affinity_over_one'], '.2f', 'x')}, "
                       f"req/s {fmt(r['req_s_dp_affinity_over_one'], '.2f', 'x')}, prefix-hit rate "
                       f"{fmt(r['hit_rate_dp_affinity_over_one'], '.2f', 'x')}. DP=2 affinity / DP=2 load: output tok/s "
                       f"{fmt(r['output_tok_s_dp_affinity_over_dp_load'], '.2f', 'x')}, prefix-hit rate "
                       f"{fmt(r['hit_rate_dp_affinity_over_dp_load'], '.2f', 'x')}.")]  # fmt: skip
        if any(req.group is not None for req in requests):
            best_one, best_two = best_hit_rate(requests, 1), best_hit_rate(requests, 2)
            prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
            ratios[workload].update(best_hit_rate_one_cache=round(best_one, 4), best_hit_rate_two_caches=round(best_two, 4),
                                    prompt_share=round(prompt_tokens / (prompt_tokens + sum(r.output_len for r in requests)), 3))  # fmt: skip
            lines.append(f"Best prefix-hit rates of this request list: {best_one:.1%} with one cache (each group's "
                         f"prefix computed once: one engine, or DP with perfect affinity), {best_two:.1%} with two "
                         "caches that each see every group (what load-only routing gets when each group reaches "
                         "both replicas).")  # fmt: skip
        lines.append("")
    return lines, ratios


def notes(records: list[dict], ratios: dict[str, Any], cores: int, threads: dict[str, Any]) -> list[str]:
    out = [(f"- Threads: the one engine runs torch's default, {threads['one_engine']} threads on {cores} cores; "
            f"each DP replica gets OMP_NUM_THREADS = {threads['per_replica']} (cores // 2). The DP router is a third "
            "process on the same cores: it relays every streamed chunk and, with affinity routing, hashes every "
            "prompt's leading blocks."),
           ("- DP=2 on one CPU splits the cores, it does not add any: each replica runs the whole model with half "
            "the threads. It gains only where one engine leaves cores idle (Python scheduling and sampling between "
            "steps, threads that do not scale on small batches) and loses to two copies of the weights in the "
            "caches, two schedulers and the router's hop (TTFT includes it). On a GPU box or a many-socket CPU it "
            "is one replica per device or socket that counts, not this ratio.")]  # fmt: skip
    for workload, r in ratios.items():
        speed = r["output_tok_s_dp_affinity_over_one"]
        if speed is not None:
            out.append(f"- {workload}: DP=2 affinity ran at {speed:.2f}x the one engine's output tok/s "
                       f"({'faster' if speed > 1.02 else 'slower' if speed < 0.98 else 'about the same'}).")  # fmt: skip
        by = {rec["config"]: rec.get("workloads", {}).get(workload, {}) for rec in records}
        if "best_hit_rate_one_cache" not in r:
            aff_speed, load_speed = by.get("DP=2 affinity", {}).get("output_tok_s"), by.get("DP=2 load", {}).get("output_tok_s")
            if aff_speed and load_speed:
                out.append(f"- {workload}: no two prompts share a prefix, so affinity and load-only routing both go by "
                           f"load; their difference here ({aff_speed / load_speed:.2f}x output tok/s) is this run's "
                           "noise.")  # fmt: skip
        else:
            aff, load, one = (by.get(name, {}).get("prefix_hit_rate") for name in ("DP=2 affinity", "DP=2 load", "one engine"))
            if one is not None:
                out.append(f"- {workload}: the one engine found {one:.1%} of {r['best_hit_rate_one_cache']:.1%} possible "
                           "with one cache; where the cache holds every prompt (no --kv-blocks), the shortfall is "
                           "requests of a group sent together, before their prefix's blocks were computed and "
                           "cached. It is the mark affinity routing aims at.")  # fmt: skip
            if aff is not None and load is not None:
                out.append(
                    f"- {workload}: affinity routing found {aff:.1%} of prompt tokens in a replica's prefix cache, "
                    f"load-only routing {load:.1%} (one engine {fmt(one and 100 * one, '.1f', '%')}; best "
                    f"{r['best_hit_rate_one_cache']:.1%} with one cache, {r['best_hit_rate_two_caches']:.1%} when "
                    "every group reaches both caches). That difference is prefill work not redone; whether it shows in "
                    f"tok/s depends on how much of the work is prefill (here prompts are {r['prompt_share']:.0%} of "
                    "the tokens)."
                    " With an unbounded cache load-only routing loses one prefix computation per group and replica; "
                    "with a cache too small for every group on every replica (--kv-blocks) it loses more."
                )  # fmt: skip
    for record in records:
        for workload, w in record.get("workloads", {}).items():
            if w["failed"]:
                out.append(f"- {record['config']}, {workload}: {w['failed']} of {w['num_requests']} requests failed "
                           f"(their tokens are not counted): {w['errors']}")  # fmt: skip
    out.append("- Requests are streamed completions with token-id prompts and ignore_eos, identical for every "
               "configuration; TTFT is measured by the client (through the router for DP). Hit rates are token-level: "
               "delta prefix_cache_hits / delta prefix_cache_queries, summed over replicas.")  # fmt: skip
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default=None, help="passed to every server (default: the engine's default)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--quick", action="store_true", help="fewer and shorter requests: a smoke run of ~2-3 minutes")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight (default 16; quick 8)")
    parser.add_argument("--mixed-requests", type=int, default=None, help="mixed workload size (default 64; quick 32)")
    parser.add_argument("--groups", type=int, default=None, help="prefix groups (default 8; quick 6)")
    parser.add_argument("--requests-per-group", type=int, default=None, help="default 8; quick 6")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="total KV blocks: the one engine gets N, each replica N // 2 (default: each engine its "
                        "own default budget)")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sent with every request (default 0: greedy, so every configuration generates about "
                        "the same text; a negative value sends none, and the server's default applies)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/dp_routing.json",
                        help="the JSON line goes here, the tables beside it (.md)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.temperature < 0:
        args.temperature = None
    quick = args.quick
    args.max_concurrency = args.max_concurrency or (8 if quick else 16)
    args.mixed_requests = args.mixed_requests or (32 if quick else 64)
    args.groups = args.groups or (6 if quick else 8)
    args.requests_per_group = args.requests_per_group or (6 if quick else 8)
    args.mixed_output_len = (16, 128) if quick else (16, 256)
    args.prefix_len = (256, 384) if quick else (256, 512)
    args.grouped_output_len = (16, 48) if quick else (16, 64)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cores = os.cpu_count() or 1
    cpu = cpu_info()
    grouped = grouped_prefix_requests(args.groups, args.requests_per_group, args.prefix_len, (16, 64),
                                      args.grouped_output_len, args.seed + 1)  # fmt: skip
    workloads = {"mixed": mixed_requests(args.mixed_requests, (16, 256), args.mixed_output_len, args.seed),
                 "grouped prefix": grouped}  # fmt: skip
    # The one engine must take torch's default threads; the DP router sets its replicas' own.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PAGELLM_API_KEY")}
    threads = {"one_engine": torch_default_threads(env), "per_replica": max(1, cores // 2)}
    config = {
        "model": args.model or "embedded SmolLM2-135M-Instruct", "dtype": args.dtype or "engine default",
        "max_concurrency": args.max_concurrency, "request_rate": "inf", "temperature": args.temperature, "kv_blocks": args.kv_blocks, "quick": args.quick,
        "seed": args.seed,
        "workloads": {
            "mixed": {"num_requests": args.mixed_requests, "prompt_len": [16, 256],
                      "output_len": list(args.mixed_output_len)},
            "grouped prefix": {"groups": args.groups, "requests_per_group": args.requests_per_group,
                               "prefix_len": list(args.prefix_len), "suffix_len": [16, 64],
                               "output_len": list(args.grouped_output_len)},
        },
    }  # fmt: skip
    print(f"CPU {describe_cpu(cpu)}, {cores} cores; one engine: {threads['one_engine']} torch threads, "
          f"DP=2: {threads['per_replica']} per replica")  # fmt: skip
    for name, requests in workloads.items():
        print(f"{name}: {len(requests)} requests, {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
              f"{sum(r.output_len for r in requests)} output tokens; {json.dumps(config['workloads'][name])}")  # fmt: skip
    print(f"max concurrency {args.max_concurrency}, all sent at once; temperature {args.temperature}; KV blocks: "
          f"{args.kv_blocks or 'each engine its default'}", flush=True)  # fmt: skip

    records = [run_config(name, args, workloads, env) for name in args.configs]

    table, ratios = render_tables(records, workloads)
    note_lines = notes(records, ratios, cores, threads)
    header = (f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {cores} cores, CPU {describe_cpu(cpu)}; "
              f"{config['model']}, dtype {config['dtype']}; max concurrency {args.max_concurrency}"
              f"{' (--quick)' if args.quick else ''}.")  # fmt: skip
    text = "\n".join([header, "", *table, "Notes:", "", *note_lines]) + "\n"
    print("\n" + text)
    result = {"bench": "dp_routing", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": cpu, "cores": cores,
              "threads": threads, "config": config, "runs": records, "ratios": ratios}  # fmt: skip
    out = Path(args.out)
    write_result_files(out, result, text)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
