"""The installed package's version: one source, pyproject.toml's `version`.

Read from the package metadata that installing writes from pyproject.toml; a source
tree run without installing reads pyproject.toml itself.
"""

from __future__ import annotations

import functools
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@functools.cache
def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagellm")
    except PackageNotFoundError:
        return _pyproject_version(_PYPROJECT)


def _pyproject_version(path: Path) -> str:
    import tomllib

    try:
        with open(path, "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
