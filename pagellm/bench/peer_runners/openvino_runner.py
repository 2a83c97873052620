"""Bench stage: the OpenVINO GenAI side of a comparison, run by the peer's own Python (its
virtual environment, bench/peers.py), never imported by pagellm: it needs only the standard
library, numpy and openvino_genai.

    python openvino_runner.py IN.json OUT.json

IN: {"model": GGUF path, "requests": [[prompt ids, output length], ...], "repeats": N,
"settings": {"cache_size_gb": ..., "max_num_batched_tokens": ..., "max_num_seqs": ...,
"dynamic_split_fuse": ..., "threads": ...}}; settings left out keep OpenVINO's defaults.
OUT: {"elapsed_runs_s": [...], "output_token_ids": [[...], ...], "settings": {...},
"version": ..., "peak_rss": {"self_bytes": ..., "children_bytes": ...}}. Every request goes into OpenVINO's ContinuousBatchingPipeline at once
(greedy, end of sequence ignored), and the pipeline steps until all are done: the
engine schedules them itself, as pagellm's LLM.generate does.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def main() -> int:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    with open(sys.argv[1]) as source:
        job = json.load(source)
    wanted = job.get("settings", {})
    scheduler = ov_genai.SchedulerConfig()
    if "cache_size_gb" in wanted:
        scheduler.cache_size = int(wanted["cache_size_gb"])
    if "max_num_batched_tokens" in wanted:
        scheduler.max_num_batched_tokens = int(wanted["max_num_batched_tokens"])
    if "max_num_seqs" in wanted:
        scheduler.max_num_seqs = int(wanted["max_num_seqs"])
    if "dynamic_split_fuse" in wanted:
        scheduler.dynamic_split_fuse = bool(wanted["dynamic_split_fuse"])
    properties = {}
    if "threads" in wanted:
        properties["INFERENCE_NUM_THREADS"] = int(wanted["threads"])
    pipe = ov_genai.ContinuousBatchingPipeline(job["model"], scheduler, "CPU", properties)
    requests = job["requests"]

    def run(batch: list[list]) -> list[list[int]]:
        handles = []
        for index, (prompt, output_len) in enumerate(batch):
            config = ov_genai.GenerationConfig()
            config.max_new_tokens = int(output_len)
            config.min_new_tokens = int(output_len)
            config.ignore_eos = True
            config.do_sample = False
            ids = ov.Tensor(np.array([prompt], dtype=np.int64))
            handles.append(pipe.add_request(index, ids, config))
        while pipe.has_non_finished_requests():
            pipe.step()
        return [list(handle.read_all()[0].generated_ids) for handle in handles]

    run(requests[: min(4, len(requests))])  # warm-up
    runs, outputs = [], []
    for _ in range(int(job.get("repeats", 1))):
        start = time.perf_counter()
        outputs = run(requests)
        runs.append(time.perf_counter() - start)
    settings = {
        "cache_size_gb": scheduler.cache_size, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_num_seqs": scheduler.max_num_seqs, "dynamic_split_fuse": scheduler.dynamic_split_fuse,
        **({"threads": properties["INFERENCE_NUM_THREADS"]} if properties else {}),
    }  # fmt: skip
    with open(sys.argv[2], "w") as sink:
        json.dump({"elapsed_runs_s": runs, "output_token_ids": outputs, "settings": settings,
                   "version": ov_genai.__version__, "peak_rss": peak_rss()}, sink)  # fmt: skip
    return 0


def peak_rss() -> dict:
    """The peak resident memory of this process and of its largest reaped child (OpenVINO
    runs in this process; a child would be a compiler or the like), in bytes."""
    return {
        "self_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "children_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }


if __name__ == "__main__":
    raise SystemExit(main())
