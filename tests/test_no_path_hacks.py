"""No file reaches into another folder by changing the import path at run time.

What tests import from benchmarks is package code (pagellm/bench/), what benchmarks borrow
from tests is too, and tests share helpers through tests/ (and tests/core/), which
pyproject.toml's pytest `pythonpath` puts on the path. A module that edits `sys.path`
(insert, append, extend, remove, assigning to it or a slice of it) would bring the
cross-folder reaches back; this test finds such code with `ast`, so comments and strings
that name sys.path do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("pagellm", "benchmarks", "tests")


def is_sys_path(node: ast.AST) -> bool:
    """`sys.path`, or a subscript of it (`sys.path[:0]`)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def path_edits(source: str) -> list[int]:
    """Line numbers where `source` changes sys.path."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            if node.func.attr in {"insert", "append", "extend", "remove"}:
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(target) for target in targets):
                lines.append(node.lineno)
    return sorted(lines)


def python_files() -> list[Path]:
    return sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py"))


def test_the_search_sees_every_kind_of_edit():
    source = (
        "import sys\n"
        "sys.path.insert(0, 'a')\n"
        "sys.path.append('b')\n"
        "sys.path.extend(['c'])\n"
        "sys.path.remove('d')\n"
        "sys.path[:0] = ['e']\n"
        "sys.path += ['f']\n"
        "sys.path = ['g']\n"
        "# sys.path.insert(0, 'h') in a comment\n"
        "print('sys.path.append(i) in a string', sys.path.index('j'))\n"
    )
    assert path_edits(source) == [2, 3, 4, 5, 6, 7, 8]
    assert len(python_files()) > 100


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_edits_sys_path(folder: str):
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in python_files()
        if path.relative_to(ROOT).parts[0] == folder
        for line in path_edits(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "these lines change sys.path; import from the package (pagellm/bench/ for what tests and "
        "benchmarks share) or from a helper module in tests/ instead:\n" + "\n".join(found)
    )
