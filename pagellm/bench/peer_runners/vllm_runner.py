"""Bench stage: the vLLM (CPU build) side of a comparison, run by the peer's own Python (its
virtual environment, bench/peers.py), never imported by pagellm: it needs only the standard
library and vllm.

    python vllm_runner.py IN.json OUT.json

IN: {"model": HF folder, "requests": [[prompt ids, output length], ...], "repeats": N,
"settings": {"dtype": ..., "max_num_batched_tokens": ..., "max_num_seqs": ...,
"max_model_len": ..., "enforce_eager": ..., "kv_cache_dtype": ..., "kv_cache_space_gb": ..., "threads_bind": ...,
"reserved_cpus": ..., "threads": ..., "preload_iomp": ...}}; settings left out keep vLLM's
defaults, but for RUNNER_DEFAULTS below. kv_cache_space_gb, threads_bind, reserved_cpus and
threads are the environment variables VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_NUM_OF_RESERVED_CPU and OMP_NUM_THREADS, which vLLM reads as it starts: they are
set before it is imported.
OUT: {"elapsed_runs_s": [...], "output_token_ids": [[...], ...], "settings": {...},
"version": ..., "peak_rss": {...}}. Every request goes into one LLM.generate call (greedy,
end of sequence ignored, prompts as token ids): vLLM schedules them itself, as pagellm's
LLM.generate does.

vLLM runs its engine in child processes (an engine core and a worker); their peak resident
memory is read from /proc before the engine shuts down, and the engine is shut down
explicitly so that no child outlives the run.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

# setting -> the environment variable vLLM reads it from.
ENVIRONMENT_SETTINGS = {
    "kv_cache_space_gb": "VLLM_CPU_KVCACHE_SPACE",
    "threads_bind": "VLLM_CPU_OMP_THREADS_BIND",
    "reserved_cpus": "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "threads": "OMP_NUM_THREADS",
}
# Where vLLM's own defaults do not fit a comparison on a small machine. Its KV cache
# default is gpu_memory_utilization (0.92) of all RAM, which it refuses to start with when
# anything else holds memory: pagellm's CPU default budget (4 GiB) instead. Its thread
# binding keeps one core for the API frontend, half the cores of a 2-core machine, which
# an offline run (no frontend) leaves idle: every core computes, as pagellm's do.
# And vLLM's CPU guide has Intel's OpenMP (a dependency of the CPU wheel) preloaded; its
# worker warns when it is not.
RUNNER_DEFAULTS = {"kv_cache_space_gb": 4, "reserved_cpus": 0, "preload_iomp": True}
ENGINE_SETTINGS = ("dtype", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "enforce_eager", "kv_cache_dtype")
RUNNER_SETTINGS = ("preload_iomp",)


def main() -> int:
    with open(sys.argv[1]) as source:
        job = json.load(source)
    wanted = {**RUNNER_DEFAULTS, **job.get("settings", {})}
    known = [*ENVIRONMENT_SETTINGS, *ENGINE_SETTINGS, *RUNNER_SETTINGS]
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        print(f"unknown vllm settings {unknown}; known: {sorted(known)}", file=sys.stderr)
        return 2
    for key, variable in ENVIRONMENT_SETTINGS.items():
        if key in wanted:
            os.environ[variable] = str(wanted[key])
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if wanted["preload_iomp"] and os.path.exists(iomp) and "libiomp" not in os.environ.get("LD_PRELOAD", ""):
        # vLLM's engine processes are spawned (new interpreters): they load it at start.
        os.environ["LD_PRELOAD"] = ":".join(filter(None, [os.environ.get("LD_PRELOAD"), iomp]))
    # The CPU wheel knows its device; set anyway so that a stray GPU build would not pick CUDA.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], disable_log_stats=True, **{k: wanted[k] for k in ENGINE_SETTINGS if k in wanted})
    requests = job["requests"]

    def run(batch: list[list]) -> list[list[int]]:
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in prompt]) for prompt, _ in batch]
        params = [
            SamplingParams(temperature=0.0, max_tokens=int(n), min_tokens=int(n), ignore_eos=True) for _, n in batch
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    run(requests[: min(4, len(requests))])  # warm-up
    runs, outputs = [], []
    for _ in range(int(job.get("repeats", 1))):
        llm.reset_prefix_cache()  # every run computes its prompts, as pagellm's runs do
        start = time.perf_counter()
        outputs = run(requests)
        runs.append(time.perf_counter() - start)
    settings = effective_settings(llm)
    tree_peak = process_tree_peak_rss()
    llm.llm_engine.engine_core.shutdown()  # the engine's processes end (and are reaped) here
    with open(sys.argv[2], "w") as sink:
        json.dump({"elapsed_runs_s": runs, "output_token_ids": outputs, "settings": settings,
                   "version": vllm.__version__, "peak_rss": peak_rss(tree_peak)}, sink)  # fmt: skip
    return 0


def effective_settings(llm: object) -> dict:
    """What vLLM resolved its settings to (defaults included)."""
    config = llm.llm_engine.vllm_config  # type: ignore[attr-defined]
    cache, scheduler = config.cache_config, config.scheduler_config
    kv_bytes = cache.kv_cache_memory_bytes
    return {
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "max_model_len": config.model_config.max_model_len,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_num_seqs": scheduler.max_num_seqs,
        "enforce_eager": config.model_config.enforce_eager,
        "kv_cache_dtype": str(cache.cache_dtype),
        "compilation_mode": getattr(config.compilation_config.mode, "name", str(config.compilation_config.mode)),
        "block_size": cache.block_size,
        "num_kv_blocks": cache.num_gpu_blocks,
        "kv_cache_space_gb": round(kv_bytes / 2**30, 3) if kv_bytes else None,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "threads": os.environ.get("OMP_NUM_THREADS"),
    }


def process_tree_peak_rss() -> dict:
    """VmHWM (peak resident set) of this process and of each live descendant, in bytes."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    # The name (field 2) may hold spaces; the parent id follows its ')'.
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = [os.getpid()], [os.getpid()]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    peaks = {}
    for pid in tree:
        try:
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        peaks[pid] = int(line.split()[1]) * 1024
        except OSError:
            continue
    return peaks


def peak_rss(tree_peaks: dict) -> dict:
    """This process's peak RSS, its reaped children's (getrusage: the largest one's), and
    the sum of the peaks over the process tree (an upper bound of the tree's peak: shared
    pages count once per process, and the peaks need not coincide)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {
        "self_bytes": own,
        "children_bytes": children,
        "tree_sum_bytes": sum(tree_peaks.values()) if tree_peaks else own + children,
        "tree_processes": len(tree_peaks),
    }


if __name__ == "__main__":
    raise SystemExit(main())
