"""Bench stage: `pagellm bench serve` output: the readable table and the optional PNG charts.

Charts (matplotlib is optional: `pip install 'pagellm[report]'`):
- latency_cdf.png: cumulative distributions of TTFT, TPOT, ITL and end-to-end latency;
- latency_hist.png: histograms of the same;
- timeline.png: one line per request: waiting for a concurrency slot, waiting for the
  first token, then streaming; failed requests in red.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagellm.bench.serve_metrics import RequestRecord
from pagellm.workload.latency import LATENCY_METRICS

logger = logging.getLogger(__name__)

METRIC_LABELS = {
    "ttft": "TTFT (time to first token)",
    "tpot": "TPOT (time per output token)",
    "itl": "ITL (inter-token latency)",
    "e2el": "E2EL (end-to-end latency)",
}


def matplotlib_missing() -> str | None:
    """None when charts can be drawn, else why not (with the fix)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            "matplotlib is not installed (pip install 'pagellm[report]' or pip install matplotlib)"
        )
    return None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(result: dict[str, Any]) -> None:
    """The result as aligned lines on stdout (--json prints the full record instead)."""
    rate = result["request_rate"]
    prompts = f"{result['prompt_format']} prompts"
    tokens = f"{result['total_input_tokens']} / {result['total_output_tokens']}"
    rows: list[tuple[str, Any]] = [
        ("endpoint", f"{result['base_url']} {result['endpoint']} ({prompts})"),
        ("model", result["model"] or "-"),
        ("load", (f"rate {rate} req/s, burstiness {result['burstiness']}, "
                  f"max concurrency {result['max_concurrency'] or 'unlimited'}")),
        ("workload", f"{result['workload']['kind']}, {result['num_requests']} requests"),
        ("successful requests", result["completed"]),
        ("failed requests", result["failed"]),
        ("duration", f"{result['duration_s']:.2f} s"),
        ("requests/s", result["requests_per_s"]),
        ("output tok/s", result["output_tok_s"]),
        ("total tok/s", result["total_tok_s"]),
        ("input / output tokens", tokens),
    ]  # fmt: skip
    if result["output_len_mismatches"]:
        rows.append(("output length mismatches", result["output_len_mismatches"]))
    if result["goodput_req_s"] is not None:
        slos = ", ".join(f"{k} <= {v:g} s" for k, v in result["slos_s"].items())
        good = f"{result['good_requests']} requests meet {slos}"
        rows.append(("goodput", f"{result['goodput_req_s']} req/s ({good})"))
    width = max(len(key) for key, _ in rows + [("E2EL (ms)", "")])
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"{'(ms)':<{width}}  {'mean':>10} {'median':>10} {'p90':>10} {'p99':>10}")
    for metric in LATENCY_METRICS:
        stats = [_ms(result[f"{metric}_ms_{s}"]) for s in ("mean", "median", "p90", "p99")]
        print(f"{metric.upper():<{width}}  " + " ".join(f"{s:>10}" for s in stats))
    for message, count in result["errors"].items():
        print(f"error x{count}: {message}")


def write_plots(
    records: Sequence[RequestRecord], result: dict[str, Any], out_dir: str | Path
) -> list[Path]:
    """Write the charts into out_dir; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.success]
    values_ms = {
        "ttft": [r.ttft_s * 1000 for r in done if r.ttft_s is not None],
        "tpot": [t * 1000 for r in done if (t := r.tpot_s) is not None],
        "itl": [gap * 1000 for r in done for gap in r.itls_s],
        "e2el": [r.e2el_s * 1000 for r in done],
    }
    title = (f"{result['endpoint']} at {result['request_rate']} req/s, "
             f"max concurrency {result['max_concurrency'] or 'unlimited'}")  # fmt: skip
    written = []
    for name, kind in (("latency_cdf.png", "cdf"), ("latency_hist.png", "hist")):
        fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
        for ax, metric in zip(axes.flat, LATENCY_METRICS):
            values = sorted(values_ms[metric])
            if values and kind == "cdf":
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
                ax.set_ylabel("fraction of samples")
            elif values:
                ax.hist(values, bins=min(50, max(5, len(values) // 4)))
                ax.set_ylabel("samples")
            else:
                ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(METRIC_LABELS[metric], fontsize=10)
            ax.set_xlabel("ms")
            ax.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        written.append(_save(fig, out / name, plt))

    fig, ax = plt.subplots(figsize=(10, max(3.0, min(12.0, 0.08 * len(records) + 2))))
    for r in records:
        y = r.index
        ax.hlines(y, r.scheduled_s, r.sent_s, color="0.75", linewidth=2)
        if not r.success:
            ax.hlines(y, r.sent_s, r.end_s, color="tab:red", linewidth=2)
            continue
        first = r.sent_s + (r.ttft_s or 0.0)
        ax.hlines(y, r.sent_s, first, color="tab:orange", linewidth=2)
        ax.hlines(y, first, r.end_s, color="tab:blue", linewidth=2)
    ax.plot([], [], color="0.75", label="waiting for a slot")
    ax.plot([], [], color="tab:orange", label="to first token")
    ax.plot([], [], color="tab:blue", label="streaming")
    ax.plot([], [], color="tab:red", label="failed")
    ax.set_xlabel("seconds from start")
    ax.set_ylabel("request")
    ax.set_title("Requests over time: " + title, fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(_save(fig, out / "timeline.png", plt))
    logger.info("wrote %d charts to %s", len(written), out)
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
