"""Bench stage: how a benchmark script leaves its result: one JSON line printed and written
to its result file, and the readable tables beside it (.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result_files(out: Path, record: dict[str, Any], markdown: str) -> None:
    line = json.dumps(record)
    print(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(line + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown, encoding="utf-8")
