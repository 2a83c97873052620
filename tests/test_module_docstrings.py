"""Every module says which stage it is in its first line, and the stage is its folder's
name (docs/architecture.md, "Packages"): `pagellm/core/x.py` starts "Core stage: ..."."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "pagellm"


def stage_label(folder: str) -> str:
    return folder.replace("_", " ").capitalize() + " stage:"


def mislabelled(root: Path = PACKAGE_ROOT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if len(parts) < 2:  # pagellm/*.py: shared by every stage
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if not docstring.startswith(stage_label(parts[0])):
            found.append(f"{path.relative_to(root)}: {docstring.splitlines()[0] if docstring else '(no docstring)'}")
    return found


def test_every_module_names_its_stage():
    assert mislabelled() == []


def test_the_check_catches_a_wrong_label(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "good.py").write_text('"""Core stage: fine."""\n')
    (tmp_path / "core" / "bad.py").write_text('"""Scheduling stage: the old name."""\n')
    (tmp_path / "spec_decode").mkdir()
    (tmp_path / "spec_decode" / "none.py").write_text("x = 1\n")
    assert mislabelled(tmp_path) == ["core/bad.py: Scheduling stage: the old name.", "spec_decode/none.py: (no docstring)"]
