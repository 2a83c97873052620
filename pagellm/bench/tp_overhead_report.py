"""Bench stage: the report of benchmarks/tp_overhead.py: TP=2 against TP=1 per batch size, the
markdown tables and the notes that say how to read them."""

from __future__ import annotations

from typing import Any

from pagellm.bench.tp_overhead_collectives import all_reduce_bus_gbps


def comparison_rows(rows: list[dict[str, Any]], collectives: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch size: TP=2 against TP=1, and how much of the driver's all-reduce time the
    same all-reduce alone accounts for (the rest is waiting for the other rank)."""
    out = []
    alone = {(tuple(c["shape"]), c["dtype"]): c["us_median"] for c in collectives if c["op"] == "all_reduce"}
    for batch_size in sorted({r["batch_size"] for r in rows}):
        by_tp = {r["tp"]: r for r in rows if r["batch_size"] == batch_size}
        if 1 not in by_tp or 2 not in by_tp:
            continue
        one, two = by_tp[1], by_tp[2]
        entry = {
            "batch_size": batch_size,
            "tp1_step_ms_median": one["step_ms"]["median"],
            "tp2_step_ms_median": two["step_ms"]["median"],
            "tp2_over_tp1": round(two["step_ms"]["median"] / one["step_ms"]["median"], 3),
            "tp2_minus_tp1_ms": round(two["step_ms"]["median"] - one["step_ms"]["median"], 3),
            "tp2_communication_ms_mean": two["communication_ms_mean"],
        }
        reduce = two["all_reduce"]
        tensors = reduce["tensors"]
        if tensors and reduce["us_per_call"]:
            main = max(tensors, key=lambda t: t["calls"])
            alone_us = alone.get((tuple(main["shape"]), main["dtype"]))
            if alone_us is not None:
                entry["all_reduce_us_per_call_in_step"] = reduce["us_per_call"]
                entry["all_reduce_bus_gb_s_in_step"] = round(
                    all_reduce_bus_gbps(main["bytes"], reduce["us_per_call"] / 1e6, 2), 3
                )
                entry["all_reduce_us_per_call_alone"] = alone_us
                entry["all_reduce_wait_ms_per_step_estimate"] = round(
                    (reduce["us_per_call"] - alone_us) * reduce["calls_per_step"] / 1e3, 3
                )
        out.append(entry)
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def markdown_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows),
    ]


def format_tables(record: dict[str, Any]) -> str:
    results = record["results"]
    lines: list[str] = []
    if results["steps"]:
        lines += ["Decode steps (ms per engine.step; engine = schedule/update/outputs around execute_model):", ""]
        lines += markdown_table(
            ["TP", "B", "threads/rank", "path", "median", "mean", "min", "tok/s", "execute mean", "engine mean"],
            [
                [r["tp"], r["batch_size"], r["threads_per_rank"], r["decode_path"], r["step_ms"]["median"],
                 r["step_ms"]["mean"], r["step_ms"]["min"], r["tokens_per_s"], r["execute_model_ms_mean"],
                 r["engine_ms_mean"]]
                for r in results["steps"]
            ],
        )  # fmt: skip
        lines += ["", "TP=2 driver per step: ms (calls, us per call); message = pickled StepMessage bytes:", ""]
        table = []
        for r in results["steps"]:
            if r["tp"] == 2:
                b, a, g = r["broadcast"], r["all_reduce"], r["gather_vocab"]
                main = max(a["tensors"], key=lambda t: t["calls"]) if a["tensors"] else None
                sizes = b["message_bytes"]
                table.append([
                    r["batch_size"], f"{b['ms_per_step_mean']} ({b['calls_per_step']:g}, {b['us_per_call']})",
                    f"{sizes['median']} ({sizes['min']}-{sizes['max']})",
                    f"{a['ms_per_step_mean']} ({a['calls_per_step']:g}, {a['us_per_call']})",
                    f"{main['shape']} {main['dtype']} ({main['bytes']} B)" if main else "-",
                    f"{g['ms_per_step_mean']} ({g['calls_per_step']:g}, {g['us_per_call']})",
                    f"{r['communication_share']:.1%}", r["driver_compute_ms_mean"],
                ])  # fmt: skip
        lines += markdown_table(
            ["B", "broadcast", "message bytes", "all_reduce", "all_reduce tensor", "gather_vocab", "comm share",
             "driver rest ms"],
            table,
        )  # fmt: skip
    if results["comparison"]:
        title = ("TP=2 against TP=1 (median steps; wait = the driver's all_reduce per call minus the same call "
                 "alone, x calls per step):")  # fmt: skip
        lines += ["", title, ""]
        lines += markdown_table(
            ["B", "TP=1 ms", "TP=2 ms", "TP=2 / TP=1", "difference ms", "TP=2 comm ms",
             "all_reduce us/call in step / alone", "bus GB/s in step", "wait ms/step (est.)"],
            [
                [c["batch_size"], c["tp1_step_ms_median"], c["tp2_step_ms_median"], c["tp2_over_tp1"],
                 f"{c['tp2_minus_tp1_ms']:+}", c["tp2_communication_ms_mean"],
                 f"{c.get('all_reduce_us_per_call_in_step', '-')} / {c.get('all_reduce_us_per_call_alone', '-')}",
                 c.get("all_reduce_bus_gb_s_in_step", "-"), c.get("all_reduce_wait_ms_per_step_estimate", "-")]
                for c in results["comparison"]
            ],
        )  # fmt: skip
    if results["collectives"]:
        lines += ["", "gloo collectives alone, 2 spawned processes, 1 thread each (loopback TCP):", ""]
        lines += markdown_table(
            ["op", "shape", "dtype", "bytes", "iters", "us median", "us mean", "us min", "bus GB/s"],
            [
                [c["op"], c["shape"], c["dtype"] or "-", c["bytes"], c["iters"], c["us_median"], c["us_mean"],
                 c["us_min"], c["bus_gb_s"]]
                for c in results["collectives"]
            ],
        )  # fmt: skip
    lines += ["", "Notes:", *(f"- {note}" for note in record["notes"])]
    return "\n".join(lines) + "\n"


def notes(record: dict[str, Any]) -> list[str]:
    config, results = record["config"], record["results"]
    cores = config["cpu_count"]
    out = [
        (f"TP=2 splits the same {config['threads']} threads ({cores} cores visible) between two processes: on the "
         "CPU it cannot be faster than TP=1 here; the figures measure its overhead."),
        ("A collective timed on the driver includes waiting for the other rank to reach it (load imbalance, "
         "scheduling noise); the collectives-alone table is the transfer itself."),
        "broadcast_from_driver returns on the driver once its send is done; the other rank unpickles after.",
    ]  # fmt: skip
    rows = results["steps"]
    if any(r["non_decode_steps"] for r in rows):
        out.append("WARNING: some timed steps were not pure decode steps of B rows (see non_decode_steps).")
    differing = [b for b in sorted({r["batch_size"] for r in rows})
                 if len({r["decode_path"] for r in rows if r["batch_size"] == b}) > 1]  # fmt: skip
    if differing:
        out.append(f"The driver's layer path differs between TP=1 and TP=2 at B={differing} (the one-call fused "
                   "decode layer runs only without tensor parallelism): that difference is in the step times too.")
    if "rank1_cpu_s_while_tp1_stepped" in results:
        out.append(f"TP=2's rank 1 used {results['rank1_cpu_s_while_tp1_stepped']} CPU seconds while TP=1 stepped "
                   "(idle, it should use ~0).")  # fmt: skip
    load = config["load_average_before"][0]
    if load > 0.5:
        out.append(f"The machine was busy before the run (1-minute load average {load} on {cores} cores): "
                   "expect noisy figures, rerun on an idle machine.")
    faster = [c["batch_size"] for c in results["comparison"] if c["tp2_over_tp1"] < 1]
    if faster:
        out.append(f"TP=2 beat TP=1 at B={faster}: a sign the cores were not free. A multi-threaded TP=1 waits at "
                   "every parallel region for its thread that another process holds; single-threaded ranks do not.")
    if config["load_format"] == "dummy":
        out.append("Weights are random (load_format dummy); every request runs to max_tokens (ignore_eos).")
    return out
