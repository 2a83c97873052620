"""The core and config/ are pure Python: importing them with torch blocked must work
(docs/architecture.md).

Two checks, so that a failure says where torch comes from:
- the core modules themselves, loaded under a bare `pagellm` package (its __init__ not run);
- `import pagellm.core` as users do it, which also runs pagellm/__init__.py: that file
  must keep its heavy imports (LLM, engine) lazy, or every core import drags torch in.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

BLOCK_TORCH = 'import sys; sys.modules["torch"] = None  # `import torch` now raises\n'

IMPORT_CORE = textwrap.dedent(
    """
    import importlib, pkgutil
    import pagellm.config, pagellm.request, pagellm.core
    for package in (pagellm.core, pagellm.config):
        for module in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            importlib.import_module(module.name)
    heavy = sorted(m for m in ("numpy", "triton", "transformers") if m in sys.modules)
    assert not heavy, f"core pulled in {heavy}"
    print("ok")
    """
)

# A stand-in for the package so that pagellm/__init__.py is not executed.
BARE_PACKAGE = textwrap.dedent(
    """
    import types
    package = types.ModuleType("pagellm")
    package.__path__ = ["pagellm"]
    sys.modules["pagellm"] = package
    """
)


def run_python(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_core_modules_import_no_torch() -> None:
    result = run_python(BLOCK_TORCH + BARE_PACKAGE + IMPORT_CORE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_import_pagellm_core_with_torch_blocked() -> None:
    result = run_python(BLOCK_TORCH + IMPORT_CORE)
    assert result.returncode == 0, (
        "`import pagellm.core` needs torch. If the traceback goes through "
        "pagellm/__init__.py, make its imports lazy (module __getattr__).\n" + result.stderr
    )
    assert result.stdout.strip() == "ok"
