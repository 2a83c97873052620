"""The simulator runs without torch: every pagellm.sim module imports with torch blocked,
and a whole simulation runs (only `pagellm calibrate` needs the engine, at run time)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

CODE = textwrap.dedent(
    """
    import sys
    sys.modules["torch"] = None  # `import torch` now raises
    import importlib, pkgutil
    import pagellm.sim
    for module in pkgutil.iter_modules(pagellm.sim.__path__, "pagellm.sim."):
        importlib.import_module(module.name)
    from pagellm.entrypoints.cli import main
    assert main(["simulate", "--num-requests", "20", "--request-rate", "10"]) == 0
    print("ok")
    """
)


def test_sim_imports_and_runs_without_torch():
    result = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
