"""Bench stage: the soak test, hours (or minutes) of mixed, hostile traffic against a real
`pagellm serve`.

    python benchmarks/soak.py [--duration 600] [--model PATH] [--seed 0] [--out-dir DIR]

Starts the server itself (a small KV cache, so that preemption happens throughout, and a
small admission queue, so that bursts are refused), then runs --concurrency clients for
--duration seconds. Each client draws its next request from a seeded mix: streaming and
not, completions and chat, n > 1, logprobs, stop strings, clients that cancel mid-stream,
slow readers, bursts past --max-num-queued-requests, malformed and oversized bodies,
prompts over max_model_len. Every second it samples the server's RSS, open file
descriptors and threads (from /proc) and /metrics (KV usage, running, waiting).

At the end it checks, and exits 1 if any check fails:
- every request that was not cancelled or refused completed with the length and finish
  reason it asked for (ignore_eos: exactly max_tokens tokens per completion);
- every refusal had its documented status (400, 413, 503; no other 5xx);
- once the load stops: running = waiting = 0 and every KV block is free;
- RSS after warm-up grew by less than 5%; file descriptors and threads came back to
  their level before the load.
It prints a table and writes soak.json (and soak.png: RSS, KV usage, requests over time;
soak.log, the server's output, when a check failed).

With --fault-rate R (tests only) the server makes that share of its steps fail
(PAGELLM_FAULT_INJECTION): a request in a failing step must end with a 500 or a stream
error event, and the requests the clients saw fail must be exactly the ones the server
ended for their steps (pagellm:request_failures_total; a client that cancelled sees
none), with everything else served as usual and the server still serving at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2

from pagellm.bench.machine import cpu_info
from pagellm.bench.server_process import ServerProcess
from pagellm.workload.latency import percentile

# Relative to where the command runs, the repository root; benchmarks/soak.py passes its
# own folder's results/, so a run from elsewhere writes where the docs say.
RESULTS_DIR = Path("benchmarks") / "results"
BODY_LIMIT = 64 * 1024
FAULTS_ON = False  # --fault-rate > 0: 500 internal_error is how a failed step's request ends


# ----------------------------------------------------------------------- server


class Server(ServerProcess):
    def __init__(self, args: argparse.Namespace) -> None:
        serve_args = [
            "--max-model-len", str(args.max_model_len), "--num-gpu-blocks-override", str(args.num_blocks),
            "--max-num-queued-requests", str(args.max_queued), "--max-request-body-bytes", str(BODY_LIMIT),
            "--max-num-seqs", str(args.max_num_seqs), "--disable-log-stats",
        ]  # fmt: skip
        if args.model:
            serve_args += ["--model", args.model]
        env = {}
        if args.fault_rate > 0:  # tests only: steps fail on purpose (worker/fault_injection.py)
            env["PAGELLM_FAULT_INJECTION"] = f"rate={args.fault_rate},seed={args.seed}"
        super().__init__(serve_args, env)

    def proc(self) -> dict[str, float]:
        """RSS (MiB), open file descriptors and threads of the server process."""
        pid = self.process.pid
        values: dict[str, float] = {}
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    values["rss_mib"] = int(line.split()[1]) / 1024
                elif line.startswith("Threads:"):
                    values["threads"] = int(line.split()[1])
        values["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        return values


def metric_values(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key.split("{", 1)[0]] = values.get(key.split("{", 1)[0], 0.0) + float(value)
    return values


# --------------------------------------------------------------------- requests


@dataclass
class Outcome:
    kind: str
    status: int | None = None
    ok: bool = True  # matched what this kind of request must get
    problem: str = ""
    failed: bool = False  # ended by a failing engine step (500 / stream error event)
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)


PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "List ten prime numbers and explain why each is prime.",
    "Summarize the history of the bicycle in a paragraph.",
    "Translate 'good morning, how are you' into French and Spanish.",
]


class Mix:
    """The seeded request mix: each call picks a kind and builds its request."""

    KINDS = [
        ("completion", 16), ("completion_stream", 16), ("chat", 12), ("chat_stream", 12), ("n_logprobs", 8),
        ("stop_strings", 6), ("cancel_stream", 8), ("slow_reader", 4), ("burst", 3), ("malformed", 3),
        ("oversized", 2), ("too_long", 3),
    ]  # fmt: skip

    def __init__(self, seed: int, max_model_len: int) -> None:
        self.random = random.Random(seed)
        self.max_model_len = max_model_len

    def pick(self) -> str:
        kinds, weights = zip(*self.KINDS, strict=True)
        return self.random.choices(kinds, weights)[0]

    def prompt(self) -> str:
        return self.random.choice(PROMPTS) + " " + " ".join(str(self.random.randrange(1000)) for _ in range(self.random.randrange(5, 60)))

    def max_tokens(self) -> int:
        return self.random.randrange(4, 48)


async def run_one(client: httpx2.AsyncClient, mix: Mix, kind: str, base: str) -> list[Outcome]:
    r = mix.random
    if kind == "burst":  # past the admission queue: some 503s are expected
        bodies = [{"prompt": mix.prompt(), "max_tokens": 8, "ignore_eos": True} for _ in range(24)]
        results = await asyncio.gather(*(plain(client, base, "/v1/completions", b, "burst") for b in bodies))
        return list(results)
    if kind == "malformed":
        response = await client.post(base + "/v1/completions", content=b'{"prompt": "x", "max_tokens":', headers={"Content-Type": "application/json"})
        return [check_refusal("malformed", response.status_code, {400})]
    if kind == "oversized":
        response = await client.post(base + "/v1/completions", json={"prompt": "x" * (BODY_LIMIT + 10), "max_tokens": 2})
        return [check_refusal("oversized", response.status_code, {413})]
    if kind == "too_long":
        body = {"prompt": "hello " * (mix.max_model_len + 50), "max_tokens": 4}
        response = await client.post(base + "/v1/completions", json=body)
        return [check_refusal("too_long", response.status_code, {400})]
    max_tokens = mix.max_tokens()
    if kind in ("completion", "n_logprobs", "stop_strings"):
        body: dict[str, Any] = {"prompt": mix.prompt(), "max_tokens": max_tokens, "ignore_eos": True, "temperature": r.choice([0.0, 0.8])}
        if kind == "n_logprobs":
            body.update(n=r.choice([2, 3]), logprobs=2)
        if kind == "stop_strings":
            body.update(stop=[" the", "\n"], ignore_eos=False)
        return [await plain(client, base, "/v1/completions", body, kind)]
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": mix.prompt()}], "max_tokens": max_tokens, "ignore_eos": True}
        return [await plain(client, base, "/v1/chat/completions", body, kind)]
    chat = kind == "chat_stream" or (kind != "completion_stream" and r.random() < 0.5)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    body.update({"messages": [{"role": "user", "content": mix.prompt()}]} if chat else {"prompt": mix.prompt()})
    stop_after = r.randrange(1, 6) if kind == "cancel_stream" else None
    delay = 0.2 if kind == "slow_reader" else 0.0
    return [await streamed(client, base, path, body, kind, stop_after, delay)]


def check_refusal(kind: str, status: int, allowed: set[int]) -> Outcome:
    ok = status in allowed | {503}  # the queue may be full whatever the body
    return Outcome(kind, status, ok, "" if ok else f"status {status}, expected {sorted(allowed)}")


async def plain(client: httpx2.AsyncClient, base: str, path: str, body: dict[str, Any], kind: str) -> Outcome:
    response = await client.post(base + path, json=body)
    if response.status_code != 200:  # 503: refused while the queue is full (bursts fill it)
        if FAULTS_ON and response.status_code == 500 and '"internal_error"' in response.text:
            return Outcome(kind, 500, True, failed=True)
        ok = response.status_code == 503
        return Outcome(kind, response.status_code, ok, "" if ok else f"status {response.status_code}: {response.text[:200]}")
    data = response.json()
    n = body.get("n", 1)
    choices = data["choices"]
    problem = ""
    if len(choices) != n:
        problem = f"{len(choices)} choices for n={n}"
    elif body.get("ignore_eos") and data["usage"]["completion_tokens"] != n * body["max_tokens"]:
        problem = f"{data['usage']['completion_tokens']} tokens, expected {n * body['max_tokens']}"
    elif any(c["finish_reason"] not in ("stop", "length") for c in choices):
        problem = f"finish reasons {[c['finish_reason'] for c in choices]}"
    elif body.get("ignore_eos") and any(c["finish_reason"] != "length" for c in choices):
        problem = "ignore_eos request ended before max_tokens"
    return Outcome(kind, 200, not problem, problem)


async def streamed(
    client: httpx2.AsyncClient, base: str, path: str, body: dict[str, Any], kind: str, stop_after: int | None, delay: float
) -> Outcome:
    start = time.perf_counter()
    outcome = Outcome(kind)
    last = None
    tokens = 0
    finish = None
    async with client.stream("POST", base + path, json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            outcome.ok = response.status_code == 503
            outcome.problem = "" if outcome.ok else f"status {response.status_code}"
            return outcome
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                if FAULTS_ON and chunk["error"].get("code") == "internal_error":
                    outcome.failed = True
                    return outcome
                outcome.ok, outcome.problem = False, f"stream error {chunk['error']}"
                return outcome
            for choice in chunk.get("choices", []):
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    if last is None:
                        outcome.ttft = now - start
                    else:
                        outcome.itl.append(now - last)
                    last = now
                    tokens += 1
                finish = choice.get("finish_reason") or finish
            if stop_after is not None and tokens >= stop_after:
                return outcome  # the client goes away: the server must abort and free
            if delay:
                await asyncio.sleep(delay)
    if finish != "length":
        outcome.ok, outcome.problem = False, f"finish_reason {finish!r}, expected 'length'"
    return outcome


# ------------------------------------------------------------------------ driver


async def drive(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    base = server.url
    outcomes: list[Outcome] = []
    samples: list[dict[str, float]] = []
    baseline = server.proc()  # before any connection
    deadline = time.monotonic() + args.duration
    started = time.monotonic()
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(300.0)) as client:

        async def sample_forever() -> None:
            while True:
                point = {"t": time.monotonic() - started, **server.proc()}
                try:
                    values = metric_values((await client.get(base + "/metrics")).text)
                    point["kv_usage"] = values.get("pagellm:kv_cache_usage_perc", 0.0)
                    point["running"] = values.get("pagellm:num_requests_running", 0.0)
                    point["waiting"] = values.get("pagellm:num_requests_waiting", 0.0)
                except httpx2.HTTPError:
                    pass
                samples.append(point)
                await asyncio.sleep(1.0)

        async def worker(index: int) -> None:
            mix = Mix(args.seed * 1000 + index, args.max_model_len)
            while time.monotonic() < deadline:
                kind = mix.pick()
                try:
                    outcomes.extend(await run_one(client, mix, kind, base))
                except httpx2.HTTPError as e:
                    outcomes.append(Outcome(kind, None, False, f"{type(e).__name__}: {e}"))

        sampler = asyncio.create_task(sample_forever())
        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        # Drained: the aborted streams' requests must be gone too.
        for _ in range(60):
            values = metric_values((await client.get(base + "/metrics")).text)
            if values.get("pagellm:num_requests_running", 1) == 0 and values.get("pagellm:num_requests_waiting", 1) == 0:
                break
            await asyncio.sleep(0.5)
        # Still serving once the load is over (a probe may itself draw a failing step).
        still_serving = False
        for _ in range(3):
            probe = await plain(client, base, "/v1/completions", {"prompt": "still there?", "max_tokens": 4}, "probe")
            outcomes.append(probe)
            if probe.status == 200:
                still_serving = True
                break
        final_text = (await client.get(base + "/metrics")).text
        final_metrics = metric_values(final_text)
        sampler.cancel()
    # The client's pooled connections are closed now: the server's sockets with them.
    await asyncio.sleep(2.0)
    after = server.proc()
    return {"outcomes": outcomes, "samples": samples, "baseline": baseline, "after": after, "metrics": final_metrics,
            "still_serving": still_serving}  # fmt: skip


def percentile_of(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..1) of unsorted values (None of nothing), as every report computes it."""
    return percentile(sorted(values), q * 100) if values else None


def summarize(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    outcomes: list[Outcome] = run["outcomes"]
    samples = run["samples"]
    by_kind = Counter(o.kind for o in outcomes)
    statuses = Counter(str(o.status) for o in outcomes)
    problems = [f"{o.kind}: {o.problem}" for o in outcomes if not o.ok]
    unexpected_5xx = sum(
        1 for o in outcomes if o.status is not None and o.status >= 500 and o.status != 503 and not o.failed
    )
    client_failed = sum(o.failed for o in outcomes)
    server_failed = int(run["metrics"].get("pagellm:request_failures_total", 0))
    cancelled = sum(1 for o in outcomes if o.kind == "cancel_stream")
    warm = [s for s in samples if s["t"] >= min(60.0, args.duration * 0.2)]
    rss_start = warm[0]["rss_mib"] if warm else run["baseline"]["rss_mib"]
    rss_end = run["after"]["rss_mib"]
    metrics = run["metrics"]
    checks = {
        "every request as asked (or refused as documented)": not problems,
        "no 5xx but 503": unexpected_5xx == 0,
        "drained: running = waiting = 0": metrics.get("pagellm:num_requests_running") == 0 and metrics.get("pagellm:num_requests_waiting") == 0,
        "every KV block free": metrics.get("pagellm:num_free_blocks") == metrics.get("pagellm:num_usable_blocks"),
        "RSS growth after warm-up < 5%": (rss_end - rss_start) / rss_start < 0.05,
        "file descriptors back to baseline": run["after"]["fds"] <= run["baseline"]["fds"] + 2,
        "threads back to baseline": run["after"]["threads"] <= run["baseline"]["threads"] + 2,
    }  # fmt: skip
    if args.fault_rate > 0:
        # No collateral loss: every failure a client saw is a request the server ended for
        # its step (a client that had gone away sees none of its own).
        checks["failures are only the failed steps' requests"] = client_failed <= server_failed <= client_failed + cancelled
        checks["still serving after the faults"] = run["still_serving"]
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    itls = [gap for o in outcomes for gap in o.itl]
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "duration_s": args.duration,
        "settings": {"concurrency": args.concurrency, "num_blocks": args.num_blocks, "max_model_len": args.max_model_len,
                     "max_num_queued_requests": args.max_queued, "max_num_seqs": args.max_num_seqs, "seed": args.seed,
                     "model": args.model or "SmolLM2-135M-Instruct (embedded)"},  # fmt: skip
        "requests": len(outcomes),
        "by_kind": dict(by_kind),
        "by_status": dict(statuses),
        "cancelled_by_client": by_kind.get("cancel_stream", 0),
        "unexpected_5xx": unexpected_5xx,
        "fault_rate": args.fault_rate,
        "failed_requests_seen_by_clients": client_failed,
        "requests_ended_by_failed_steps": server_failed,
        "failed_steps": int(run["metrics"].get("pagellm:failed_steps_total", 0)),
        "problems": problems[:20],
        "num_problems": len(problems),
        "leaked_blocks": int(metrics.get("pagellm:num_usable_blocks", 0) - metrics.get("pagellm:num_free_blocks", 0)),
        "preemptions": metrics.get("pagellm:num_preemptions_total"),
        "rss_mib": {"baseline": run["baseline"]["rss_mib"], "after_warm_up": rss_start, "end": rss_end,
                    "growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2)},  # fmt: skip
        "fds": {"baseline": run["baseline"]["fds"], "end": run["after"]["fds"]},
        "threads": {"baseline": run["baseline"]["threads"], "end": run["after"]["threads"]},
        "ttft_s": {"p50": percentile_of(ttfts, 0.5), "p99": percentile_of(ttfts, 0.99)},
        "itl_s": {"p50": percentile_of(itls, 0.5), "p99": percentile_of(itls, 0.99)},
        "checks": checks,
        "passed": all(checks.values()),
    }


def plot(samples: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    figure, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].plot(t, [s["rss_mib"] for s in samples])
    axes[0].set_ylabel("server RSS (MiB)")
    axes[1].plot(t, [100 * s.get("kv_usage", 0.0) for s in samples])
    axes[1].set_ylabel("KV usage (%)")
    axes[2].plot(t, [s.get("running", 0.0) for s in samples], label="running")
    axes[2].plot(t, [s.get("waiting", 0.0) for s in samples], label="waiting")
    axes[2].set_ylabel("requests")
    axes[2].set_xlabel("seconds")
    axes[2].legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str] | None = None, results_dir: Path = RESULTS_DIR) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--num-blocks", type=int, default=48, help="KV blocks (small: preemption throughout)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-queued", type=int, default=8, help="--max-num-queued-requests of the server")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--out-dir", default=str(results_dir))
    parser.add_argument("--fault-rate", type=float, default=0.0, help="share of steps made to fail (tests only)")
    parser.add_argument("--name", default="soak", help="result files' name (NAME.json, NAME.png)")
    args = parser.parse_args(argv)
    global FAULTS_ON
    FAULTS_ON = args.fault_rate > 0
    server = Server(args)
    try:
        run = asyncio.run(drive(server, args))
    finally:
        status = server.stop()
    result = summarize(run, args)
    result["cpu"] = cpu_info()
    result["server_exit_status"] = status
    result["checks"]["server exits 0 on SIGINT"] = status == 0
    result["passed"] = all(result["checks"].values())
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    plot(run["samples"], out / f"{args.name}.png")
    if not result["passed"]:  # the server's side of what went wrong
        (out / f"{args.name}.log").write_text("".join(server.log), encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k not in ("problems",)}))
    width = max(len(name) for name in result["checks"])
    print(f"\n{result['requests']} requests in {args.duration:.0f} s; by status {result['by_status']}; by kind {result['by_kind']}")
    print(f"RSS {result['rss_mib']}; fds {result['fds']}; threads {result['threads']}; TTFT {result['ttft_s']}; ITL {result['itl_s']}")
    for name, passed in result["checks"].items():
        print(f"{name:<{width}}  {'ok' if passed else 'FAILED'}")
    for problem in result["problems"]:
        print("  problem:", problem)
    return 0 if result["passed"] else 1
