"""Metrics stage: render an engine time series (JSONL, one point per second) as PNG charts.

The series comes from `metrics_series_file` (offline API, `pagellm serve`) or from the
benchmarks. matplotlib is an optional extra (`pip install pagellm[report]`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pagellm.errors import PagellmError

logger = logging.getLogger(__name__)

# (file name, title, y label, [(series key, legend label)])
CHARTS = [
    ("throughput.png", "Token throughput", "tokens/s",
     [("prompt_tps", "prompt"), ("generation_tps", "generation")]),
    ("prefill_decode.png", "Prefill / decode mix", "tokens computed/s",
     [("prefill_tps", "prefill"), ("decode_tps", "decode")]),
    ("kv_usage.png", "KV cache usage", "fraction of blocks", [("kv_usage", "KV usage")]),
    ("queues.png", "Requests", "requests",
     [("running", "running"), ("waiting", "waiting"), ("swapped", "swapped")]),
    ("latency.png", "Latency percentiles", "seconds",
     [("ttft_p50", "TTFT p50"), ("ttft_p90", "TTFT p90"), ("itl_p50", "ITL p50"), ("itl_p90", "ITL p90")]),
]  # fmt: skip


def read_series(path: str | Path) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise PagellmError(f"cannot read the metrics series {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise PagellmError(f"{path} is not a JSONL metrics series ({e})") from None


def render_report(series: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write one PNG per chart into out_dir; returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PagellmError(
            "charts need matplotlib: pip install 'pagellm[report]' (or pip install matplotlib)"
        ) from None
    if not series:
        raise PagellmError("the metrics series is empty: nothing to chart")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = series[0]["time"]
    times = [point["time"] - start for point in series]
    written = []
    for file_name, title, y_label, lines in CHARTS:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for key, label in lines:
            values = [point.get(key) for point in series]
            if any(v is not None for v in values):
                ax.plot(times, [float("nan") if v is None else v for v in values], label=label)
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
        fig.tight_layout()
        path = out / file_name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    logger.info("wrote %d charts to %s", len(written), out)
    return written
