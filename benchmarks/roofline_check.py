"""Check the roofline presets against published vLLM measurements.

The main check (target: within 25%) replays a published vLLM run request for
request: Lambda's vLLM benchmark of meta-llama/Meta-Llama-3-8B-Instruct on one H100
80GB SXM, 10 ShareGPT prompts sent at once (request rate inf). The raw result files
list every request's input and output length, so the simulator serves exactly that
workload (Llama-3-8B preset on the H100-SXM preset, the run's engine settings:
max_model_len as in the file name, gpu_memory_utilization 0.95, max_num_seqs 1024, no
chunked prefill, as vLLM 0.6 ran by default) and its output throughput is compared with
the published one. The same is done for the A100 80GB run of the same benchmark, and a
single-stream decode rate on an A100 40GB from a second, independent source.

Sources (stored copies; figures transcribed below, not fetched at run time):
- github.com/LambdaLabsML/vllm-benchmark, results/prompt_10/1xH100-80GB-SXM/
  Meta-Llama-3-8B-Instruct_tp1_len2048.json and ..._len8192.json, and
  results/prompt_10/1xA100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json
  (benchmark_serving.py output, September 2024, vLLM 0.6.0).
- johnmusgrave.com/p/vllm-throughput-latency-sweep-on: Llama-3.1-8B-Instruct (the
  same shape as Llama-3-8B) on one A100 40GB, vLLM, 1024-token prompts, 128 outputs,
  one request at a time: "decode ... runs at about 75 tokens/sec".

The roofline's efficiency factors and overhead are its defaults, chosen as generic
assumptions before this check was run (RooflineParams); a sensitivity table shows how
the prediction moves with them.

    python benchmarks/roofline_check.py   # seconds; writes benchmarks/results/roofline_check.{md,json}
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.config.engine_args import EngineArgs
from pagellm.sim.gpu_presets import get_gpu_preset
from pagellm.sim.roofline import RooflineParams
from pagellm.sim.report import summarize_sim
from pagellm.sim.target import resolve_engine_config, roofline_target
from pagellm.sim.request_stream import SimRequest
from pagellm.sim.simulator import Simulator
from pagellm.core.step_batch import StepBatch

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.25

# The ShareGPT prompts of Lambda's 10-prompt runs (input_lens in the result files).
LAMBDA_INPUT_LENS = (13, 25, 27, 10, 329, 29, 399, 328, 4, 205)


@dataclass(frozen=True)
class PublishedRun:
    label: str
    source: str
    gpu: str
    max_model_len: int
    output_lens: tuple[int, ...]
    duration_s: float
    output_tok_s: float
    median_ttft_ms: float
    median_tpot_ms: float


_LAMBDA = "https://github.com/LambdaLabsML/vllm-benchmark/blob/main/results/prompt_10/"
PUBLISHED = (
    PublishedRun(
        "H100 80GB SXM, max_model_len 2048", _LAMBDA + "1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json",
        "H100-SXM", 2048, (120, 429, 233, 194, 101, 741, 9, 3, 6, 31),
        duration_s=5.3666, output_tok_s=347.89, median_ttft_ms=62.19, median_tpot_ms=7.558,
    ),
    PublishedRun(
        "H100 80GB SXM, max_model_len 8192", _LAMBDA + "1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len8192.json",
        "H100-SXM", 8192, (120, 414, 233, 194, 101, 741, 9, 3, 6, 31),
        duration_s=5.4596, output_tok_s=339.22, median_ttft_ms=62.10, median_tpot_ms=7.504,
    ),
    PublishedRun(
        "A100 80GB SXM, max_model_len 2048", _LAMBDA + "1xA100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json",
        "A100-80GB", 2048, (120, 507, 233, 194, 101, 741, 9, 3, 6, 31),
        duration_s=8.5854, output_tok_s=226.55, median_ttft_ms=126.73, median_tpot_ms=12.014,
    ),
)  # fmt: skip
SINGLE_STREAM = {
    "label": "A100 40GB, one request: 1024-token prompt, 128 outputs",
    "source": "johnmusgrave.com/p/vllm-throughput-latency-sweep-on (vLLM 0.23, Llama-3.1-8B-Instruct BF16)",
    "gpu": "A100-40GB", "prompt_len": 1024, "output_len": 128, "decode_tok_s": 75.0,
}  # fmt: skip


def replay(run: PublishedRun, params: RooflineParams) -> dict[str, Any]:
    target = roofline_target("Llama-3-8B", get_gpu_preset(run.gpu), params)
    args = EngineArgs(max_model_len=run.max_model_len, gpu_memory_utilization=0.95, max_num_seqs=1024,
                      enable_chunked_prefill=False)  # fmt: skip
    config = resolve_engine_config(target, args)
    requests, token = [], 1_000_000
    for prompt_len, output_len in zip(LAMBDA_INPUT_LENS, run.output_lens, strict=True):
        requests.append(SimRequest(0.0, list(range(token, token + prompt_len)), output_len))
        token += prompt_len
    result = Simulator(config.scheduler_config, config.cache_config, target.cost_model).run(requests)
    summary = summarize_sim(result)
    return {
        "output_tok_s": summary["output_tok_s"],
        "duration_s": summary["duration_s"],
        "median_ttft_ms": summary["ttft_ms_median"],
        "median_tpot_ms": summary["tpot_ms_median"],
    }


def single_stream_decode_tok_s(params: RooflineParams) -> float:
    """1 / the step time of one decode at the run's mean context (prompt + half the outputs)."""
    target = roofline_target("Llama-3-8B", get_gpu_preset(SINGLE_STREAM["gpu"]), params)
    context = SINGLE_STREAM["prompt_len"] + SINGLE_STREAM["output_len"] // 2
    return 1.0 / target.cost_model.predict(StepBatch((), (), (context,), num_sampled_tokens=1))


def error(predicted: float, published: float) -> float:
    return (predicted - published) / published


def main() -> int:
    defaults = RooflineParams()
    rows = []
    for run in PUBLISHED:
        predicted = replay(run, defaults)
        rows.append({
            "run": run.label, "source": run.source,
            "published": {"output_tok_s": run.output_tok_s, "duration_s": run.duration_s,
                          "median_ttft_ms": run.median_ttft_ms, "median_tpot_ms": run.median_tpot_ms},
            "predicted": predicted,
            "output_tok_s_error": round(error(predicted["output_tok_s"], run.output_tok_s), 4),
        })  # fmt: skip
    single = single_stream_decode_tok_s(defaults)
    single_row = {**SINGLE_STREAM, "predicted_decode_tok_s": round(single, 2),
                  "error": round(error(single, SINGLE_STREAM["decode_tok_s"]), 4)}  # fmt: skip
    sensitivity = []
    for overhead_ms in (0.0, 1.0, 2.0):
        for bandwidth in (0.7, 0.8, 0.9):
            params = RooflineParams(defaults.compute_efficiency, bandwidth, overhead_ms / 1e3)
            tok_s = replay(PUBLISHED[0], params)["output_tok_s"]
            sensitivity.append({"step_overhead_ms": overhead_ms, "bandwidth_efficiency": bandwidth,
                                "output_tok_s": tok_s, "error": round(error(tok_s, PUBLISHED[0].output_tok_s), 4)})  # fmt: skip
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "roofline_params": {"compute_efficiency": defaults.compute_efficiency,
                            "bandwidth_efficiency": defaults.bandwidth_efficiency,
                            "step_overhead_ms": defaults.step_overhead_s * 1e3},
        "target": TARGET, "replays": rows, "single_stream": single_row, "sensitivity_h100_2048": sensitivity,
    }  # fmt: skip
    print(json.dumps(record))
    lines = [
        f"Roofline presets (Llama-3-8B, defaults: compute efficiency {defaults.compute_efficiency}, "
        f"bandwidth efficiency {defaults.bandwidth_efficiency}, step overhead {defaults.step_overhead_s * 1e3:g} ms) "
        "against published vLLM runs; target: output throughput within 25%.",
        "",
        "| published run | output tok/s published / predicted (error) | duration s | median TTFT ms | median TPOT ms |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        p, q = row["published"], row["predicted"]
        lines.append(
            f"| {row['run']} ([result file]({row['source']})) "
            f"| {p['output_tok_s']:.1f} / {q['output_tok_s']:.1f} ({100 * row['output_tok_s_error']:+.1f}%) "
            f"| {p['duration_s']:.2f} / {q['duration_s']:.2f} | {p['median_ttft_ms']:.1f} / {q['median_ttft_ms']:.1f} "
            f"| {p['median_tpot_ms']:.2f} / {q['median_tpot_ms']:.2f} |"
        )
    lines += [
        "",
        f"Single stream, {SINGLE_STREAM['label']} ({SINGLE_STREAM['source']}): published about "
        f"{SINGLE_STREAM['decode_tok_s']:.0f} tok/s decode, predicted {single:.1f} ({100 * single_row['error']:+.1f}%).",
        "",
        "Sensitivity of the H100 2048 replay (output tok/s, error):",
        "",
        "| step overhead ms | bandwidth eff. 0.7 | 0.8 | 0.9 |",
        "|---|---|---|---|",
    ]
    for overhead_ms in (0.0, 1.0, 2.0):
        cells = [f"{s['output_tok_s']:.0f} ({100 * s['error']:+.0f}%)" for s in sensitivity if s["step_overhead_ms"] == overhead_ms]
        lines.append(f"| {overhead_ms:g} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "roofline_check.md").write_text(table, encoding="utf-8")
    (RESULTS / "roofline_check.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
