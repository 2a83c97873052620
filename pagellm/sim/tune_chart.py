"""Sim stage: `pagellm tune`'s chart: output throughput against latency per
configuration, the ones meeting the goal highlighted, the Pareto front drawn, the
recommendation marked. matplotlib is optional and imported only here."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def draw_tune_chart(record: dict[str, Any], path: str) -> str:
    """Write the PNG; returns a line saying where (or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart not written: matplotlib is not installed (pip install 'pagellm[report]')"
    metric = record["goal"]["latency_metric"]
    key = "{}_ms_{}".format(*metric.split("_"))
    swept = list(record["grid"])
    points = [p for p in record["points"] if p["results"] and p["results"].get(key) is not None]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for meets, color, label in ((True, "tab:green", "meets the goal"), (False, "tab:gray", "misses it")):
        chosen = [p for p in points if (not p["misses"]) == meets]
        ax.scatter([p["results"][key] for p in chosen], [p["results"]["output_tok_s"] for p in chosen],
                   c=color, label=label, s=28)  # fmt: skip
    for p in points:
        label = "/".join(str(p["knobs"][name]) for name in swept)
        ax.annotate(label, (p["results"][key], p["results"]["output_tok_s"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")  # fmt: skip
    front = _pareto_front([(p["results"][key], p["results"]["output_tok_s"]) for p in points])
    if len(front) > 1:
        ax.plot(*zip(*front), color="tab:blue", linewidth=1, label="Pareto front")
    recommended = record["recommended"]
    if recommended is not None:
        best = next((p for p in points if p["knobs"] == recommended["knobs"]), None)
        if best is not None:
            ax.scatter([best["results"][key]], [best["results"]["output_tok_s"]], marker="*",
                       s=220, c="tab:red", label="recommended", zorder=3)  # fmt: skip
    ax.set_xlabel(f"{metric.replace('_', ' ').upper()} (ms)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{record['target']['model']} on {record['target']['device']}: "
                 f"labels are {' / '.join(swept)}", fontsize=9)  # fmt: skip
    # From zero: small differences must look small.
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"chart: {path}"


def _pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both lower latency and higher throughput,
    ordered by latency."""
    front: list[tuple[float, float]] = []
    for latency, throughput in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or throughput > front[-1][1]:
            front.append((latency, throughput))
    return front
