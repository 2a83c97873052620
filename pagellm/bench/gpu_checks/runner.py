"""Bench stage: the GPU check's driver: runs the sections in order under a deadline, each
guarded and timed, then prints one table and writes the JSON results."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pagellm.bench.gpu_checks.common import (
    SECTION_NAMES,
    SECTION_TITLES,
    CheckConfig,
    Context,
    GiB,
    SectionOutput,
    device_of,
    free_memory,
    gpu_config,
    smoke_config,
)
from pagellm.bench.gpu_checks.engine_sections import (
    section_equality,
    section_roofline,
    section_throughput,
)
from pagellm.bench.gpu_checks.kernel_sections import (
    section_bandwidth,
    section_gpu_tests,
    section_kernels,
)
from pagellm.bench.gpu_checks.parallel_sections import section_tp, tp_skip_reason

# Inside the checkout being checked (main's repo_root), where the published results live.
RESULTS_FILE = Path("benchmarks") / "results" / "gpu_check.json"
# A smoke run must not overwrite a GPU run's results.
DEFAULT_SMOKE_OUT = Path(tempfile.gettempdir()) / "gpu_check_smoke.json"
DESCRIPTION = (
    "GPU check: correctness and speed of pagellm on one NVIDIA GPU, in sections "
    "(and tensor parallelism where there are 2+)."
)

# --------------------------------------------------------------------------- driver

SECTIONS: dict[str, Callable[[CheckConfig, Context, SectionOutput], None]] = {
    "gpu_tests": section_gpu_tests,
    "kernels": section_kernels,
    "equality": section_equality,
    "throughput": section_throughput,
    "bandwidth": section_bandwidth,
    "roofline": section_roofline,
    "tp": section_tp,
}
# Why a section cannot run on this machine (None: it can); asked before its time budget.
NOT_APPLICABLE: dict[str, Callable[[CheckConfig], str | None]] = {
    "tp": tp_skip_reason,
}


class SectionTimeout(Exception):
    """Raised (by SIGALRM) in a section that ran past its hard limit."""


class Terminated(Exception):
    """Raised (by SIGTERM, e.g. from `timeout`) so the table is still printed."""


def _on_alarm(signum: int, frame: object) -> None:
    raise SectionTimeout("ran past its time limit")


def _on_term(signum: int, frame: object) -> None:
    raise Terminated("terminated (SIGTERM)")


RESERVE_S = 10.0  # kept back from the deadline for the table and the JSON file


def run_section(name: str, cfg: CheckConfig, ctx: Context, remaining_s: float) -> SectionOutput:
    """One section, guarded and timed; skipped when this machine cannot run it, or when
    its budget no longer fits.

    The section may run to twice its budget, never past the deadline: a SIGALRM then
    ends it (Python handles the signal between bytecodes, so a section stuck inside one
    long C call overruns by that call).
    """
    out = SectionOutput(name)
    check = NOT_APPLICABLE.get(name)
    reason = check(cfg) if check is not None else None
    if reason is not None:
        out.status = "SKIPPED"
        out.applies = False
        out.error = reason
        out.row(SECTION_TITLES[name], f"SKIPPED: {reason}", "", None)
        return out
    budget = cfg.budgets_s[name]
    if remaining_s < budget:
        out.status = "SKIPPED"
        out.error = f"time: {remaining_s:.0f} s left, the section needs {budget:.0f} s"
        out.row(SECTION_TITLES[name], "SKIPPED: time", "", None)
        return out
    limit = max(1.0, min(2.0 * budget, remaining_s - RESERVE_S))
    alarm = ctx.get("use_alarm", False)
    started = time.perf_counter()
    try:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, limit)
        SECTIONS[name](cfg, ctx, out)
    except Exception as e:  # noqa: BLE001 - the next sections must still run
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.status = "FAILED"
        if isinstance(e, SectionTimeout):
            out.error = f"SectionTimeout: stopped after {limit:.0f} s (budget {budget:.0f} s)"
        else:
            out.error = f"{type(e).__name__}: {e}"
        if isinstance(e, Terminated):
            ctx["terminated"] = True
        # An engine stopped mid-step may be inconsistent: a later section builds its own.
        ctx.pop("llm", None)
        out.figures["traceback"] = traceback.format_exc()
        message = " ".join(out.error.split())
        out.row(SECTION_TITLES[name], f"FAILED: {message[:160]}", "", False)
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.wall_s = time.perf_counter() - started
        free_memory(device_of(cfg))
    return out


def environment(repo_root: Path) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    for module in ("triton", "transformers"):
        try:
            env[module] = __import__(module).__version__
        except ImportError:
            env[module] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GiB, 1), gpu_count=torch.cuda.device_count())
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_root, capture_output=True, text=True, check=False, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo_root, capture_output=True, text=True, check=False, timeout=10)
        env.update(git_commit=commit.stdout.strip(), git_dirty=bool(dirty.stdout.strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def format_table(sections: list[SectionOutput], title: str) -> str:
    header = ("check", "result", "target", "met")
    lines: list[tuple[str, str, str, str]] = []
    for section in sections:
        lines.append((f"[{SECTION_TITLES[section.name]}] {section.wall_s:.1f} s", "", "", ""))
        for row in section.rows:
            met = "" if row.met is None else ("yes" if row.met else "NO")
            lines.append((row.check, row.result, row.target, met))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]

    def render(cells: tuple[str, ...]) -> str:
        return " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([title, render(header), rule, *map(render, lines)])


def run_checks(
    cfg: CheckConfig, names: list[str], repo_root: Path, use_alarm: bool = False
) -> tuple[list[SectionOutput], Context]:
    """Run the named sections in order (the gpu tests are `repo_root`'s); `use_alarm`
    enforces the time limits with SIGALRM (main thread only)."""
    started = time.perf_counter()
    ctx: Context = {}
    sections = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ctx["tmp"] = tmp
        ctx["use_alarm"] = use_alarm
        ctx["repo_root"] = repo_root
        for name in names:
            remaining = cfg.deadline_s - (time.perf_counter() - started)
            if ctx.get("terminated"):
                remaining = 0.0
            print(f"== {SECTION_TITLES[name]} ({remaining:.0f} s left)", file=sys.stderr, flush=True)
            try:
                section = run_section(name, cfg, ctx, remaining)
            except (SectionTimeout, Terminated) as e:  # a signal in the guard's own bookkeeping
                section = SectionOutput(name, status="FAILED", error=f"{type(e).__name__}: {e}")
                section.row(SECTION_TITLES[name], f"FAILED: {section.error}", "", False)
                ctx["terminated"] = ctx.get("terminated") or isinstance(e, Terminated)
            print(f"   {section.status} in {section.wall_s:.1f} s" + (f": {section.error}" if section.error else ""), file=sys.stderr, flush=True)
            sections.append(section)
        ctx.pop("llm", None)  # the engine goes before its temporary folder
        free_memory(device_of(cfg))
    ctx["wall_s"] = time.perf_counter() - started
    return sections, ctx


def main(argv: list[str] | None = None, repo_root: Path | None = None) -> int:
    """The command line of benchmarks/gpu_check.py. `repo_root` is the checkout under test
    (its tests run, its git commit is recorded, its results/ gets the JSON); by default
    the current directory, where benchmarks/gpu_check.sh runs it."""
    repo_root = Path.cwd() if repo_root is None else repo_root
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter): plumbing only")
    parser.add_argument(
        "--out", type=Path, default=None,
        help=f"JSON results (default {RESULTS_FILE}; smoke: {DEFAULT_SMOKE_OUT})",
    )  # fmt: skip
    parser.add_argument("--sections", default=",".join(SECTION_NAMES), help=f"comma-separated subset of {','.join(SECTION_NAMES)}")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole run (default 540; smoke 600)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {','.join(SECTION_NAMES)}")
    smoke = args.smoke or not torch.cuda.is_available()
    if smoke and not args.smoke:
        print("no CUDA device: running the smoke configuration", file=sys.stderr)
    if smoke and not torch.cuda.is_available():
        # A driver without a CUDA build of torch: the kernels are not defined yet (they
        # are imported by the sections), so the interpreter can still be switched on.
        os.environ["TRITON_INTERPRET"] = "1"
    make = smoke_config if smoke else gpu_config
    cfg = make() if args.deadline is None else make(deadline_s=args.deadline)

    import logging

    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, _on_term)
    sections, ctx = run_checks(cfg, [n for n in SECTION_NAMES if n in names], repo_root, use_alarm=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    env = environment(repo_root)
    title = (
        f"pagellm GPU check on {env.get('gpu', 'CPU')} ({ctx['wall_s']:.0f} s)"
        if not smoke
        else f"pagellm GPU check, SMOKE mode on {cfg.device} ({ctx['wall_s']:.0f} s): tiny shapes, targets NOT meaningful"
    )
    table = format_table(sections, title)
    result = {
        "title": title,
        "smoke": smoke,
        "wall_s": ctx["wall_s"],
        "environment": env,
        "config": asdict(cfg),
        "sections": {s.name: asdict(s) for s in sections},
        "table": table.splitlines(),
    }
    text = json.dumps(result, indent=2, default=str)
    destinations = [args.out or (DEFAULT_SMOKE_OUT if smoke else repo_root / RESULTS_FILE)]
    if os.environ.get("OUT"):
        destinations.append(Path(os.environ["OUT"]) / "gpu_check.json")
    for path in destinations:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n", encoding="utf-8")
        except OSError as e:
            print(f"cannot write {path}: {e}", file=sys.stderr)
    print(table)
    print("results: " + ", ".join(str(p) for p in destinations))
    return 0 if all(s.status == "ok" or not s.applies for s in sections) else 1
