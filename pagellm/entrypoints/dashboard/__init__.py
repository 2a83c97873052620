"""Entrypoints stage: the live dashboard page (static files shipped in the package)."""

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
