"""Sim stage: the requests a simulation serves, and when they arrive.

Synthetic workloads reuse the benchmarks' generators: prompt and output lengths from
pagellm/workload/synthetic.py (fixed, uniform ranges, a ShareGPT-like long-tailed mix, a
shared prefix) and arrival times from pagellm/workload/arrivals.py (Poisson or gamma
gaps at a request rate, or everything at once). On top of that a share of the requests
can start with a common prefix (a system prompt), which prefix caching then reuses.

A trace is a JSONL file with one request per line:
    {"arrival_time": 0.42, "prompt_len": 183, "output_len": 95}
(arrival in seconds from the start). Each traced prompt gets its own token ids, so
requests share no prefix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pagellm.errors import ConfigError
from pagellm.workload.arrivals import arrival_times
from pagellm.workload.synthetic import WorkloadSpec, make_workload


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_token_ids: list[int]
    output_len: int  # exact: the simulated request ignores EOS and stops at max_tokens


@dataclass(frozen=True)
class SyntheticWorkload:
    spec: WorkloadSpec  # lengths (num_requests is replaced when duration_s is set)
    request_rate: float = math.inf  # requests per second; inf = all at time 0
    burstiness: float = 1.0  # gamma shape of the gaps: 1 = Poisson
    duration_s: float | None = None  # generate the arrivals of this many seconds
    shared_prefix_share: float = 0.0  # fraction of requests that start with the prefix

    def __post_init__(self) -> None:
        if not 0.0 <= self.shared_prefix_share <= 1.0:
            raise ConfigError(
                f"--shared-prefix-share must be in [0, 1], got {self.shared_prefix_share}"
            )
        if self.duration_s is not None:
            if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
                raise ConfigError(f"--duration must be a positive number of seconds, got {self.duration_s}")
            if math.isinf(self.request_rate):
                raise ConfigError("--duration needs a finite --request-rate")


def _arrivals_within(duration_s: float, rate: float, burstiness: float, seed: int) -> list[float]:
    # arrival_times draws a fixed-length list; ask for more until the duration is covered.
    count = max(16, int(rate * duration_s * 1.2) + 16)
    while True:
        times = arrival_times(count, rate, burstiness, seed)
        if times[-1] >= duration_s:
            return [t for t in times if t < duration_s]
        count *= 2


def make_synthetic_requests(
    workload: SyntheticWorkload, max_model_len: int | None = None
) -> list[SimRequest]:
    """The requests of a synthetic workload, deterministic for its seed."""
    spec = workload.spec
    if workload.duration_s is not None:
        times = _arrivals_within(
            workload.duration_s, workload.request_rate, workload.burstiness, spec.seed
        )
        if not times:
            raise ConfigError("no request arrives within --duration at this --request-rate")
        spec = dataclasses.replace(spec, num_requests=len(times))
    else:
        times = arrival_times(spec.num_requests, workload.request_rate, workload.burstiness, spec.seed)
    share = workload.shared_prefix_share
    if share and spec.kind == "shared-prefix":
        raise ConfigError(
            "--shared-prefix-share applies a prefix to a share of another workload's "
            "prompts; the shared-prefix workload already gives it to all of them"
        )
    prefix_len = spec.shared_prefix_len if share else 0
    # Leave room for the prefix when the lengths are clipped to max_model_len.
    limit = None if max_model_len is None else max_model_len - prefix_len
    if limit is not None and limit < 3:
        raise ConfigError(f"--shared-prefix-len {prefix_len} leaves no room within max_model_len {max_model_len}")
    bench_requests = make_workload(spec, max_model_len=limit)
    rng = random.Random(f"shared-prefix:{spec.seed}")
    prefix = [rng.randrange(spec.vocab_low, spec.vocab_high) for _ in range(prefix_len)]
    requests = []
    # A multi-turn workload may have fewer requests (conversations that outgrew max_model_len).
    for arrival, bench in zip(times[: len(bench_requests)], bench_requests, strict=True):
        prompt = bench.prompt_token_ids
        if prefix and rng.random() < share:
            prompt = prefix + prompt
        requests.append(SimRequest(arrival, prompt, bench.output_len))
    return requests


# Token ids of traced prompts: distinct per request, so no two requests share a block.
# They never reach a tokenizer or a model, only the prefix cache's block hashes.
_TRACE_TOKEN_BASE = 1_000_000


def read_trace(path: str | Path) -> list[SimRequest]:
    """Requests from a JSONL trace (see the module docstring), sorted by arrival."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read the trace {path}: {e.strerror}") from None
    requests = []
    next_token = _TRACE_TOKEN_BASE
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{where}: not JSON ({e})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        try:
            arrival = float(record["arrival_time"])
            prompt_len = record["prompt_len"]
            output_len = record["output_len"]
        except KeyError as e:
            raise ConfigError(
                f"{where}: missing {e.args[0]!r} (each line needs arrival_time, prompt_len, output_len)"
            ) from None
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: arrival_time must be a number") from None
        for name, value in (("prompt_len", prompt_len), ("output_len", output_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
        if not (arrival >= 0 and math.isfinite(arrival)):
            raise ConfigError(f"{where}: arrival_time must be a number >= 0, got {arrival}")
        requests.append(SimRequest(arrival, list(range(next_token, next_token + prompt_len)), output_len))
        next_token += prompt_len
    if not requests:
        raise ConfigError(f"the trace {path} holds no request")
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def write_trace(requests: list[SimRequest], path: str | Path) -> None:
    """Write requests as a JSONL trace (lengths only: token ids are not kept)."""
    with open(path, "w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps({
                "arrival_time": request.arrival_s,
                "prompt_len": len(request.prompt_token_ids),
                "output_len": request.output_len,
            }) + "\n")  # fmt: skip
