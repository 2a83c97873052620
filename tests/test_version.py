"""`pagellm --version` and `pagellm.__version__`: one version, pyproject.toml's."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import pagellm
from pagellm.entrypoints.cli import main
from pagellm.version import _pyproject_version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_version_is_pyprojects():
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert pagellm.__version__ == declared
    assert _pyproject_version(PYPROJECT) == declared  # the fallback when not installed
    assert _pyproject_version(PYPROJECT.parent / "no-such.toml") == "unknown"


def test_cli_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"pagellm {pagellm.__version__}\n"


def test_python_m_prints_the_version():
    result = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "--version"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0 and result.stdout == f"pagellm {pagellm.__version__}\n"
