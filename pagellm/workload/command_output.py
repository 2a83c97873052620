"""Workload stage: how the benchmark and simulation commands hand
back a result record.

People read a table on the terminal; scripts get the record as JSON, either on stdout
(--json, instead of the table, so stdout is one parseable document) or appended as one
JSON line to --result-file (so repeated runs accumulate in one JSONL file). A progress
bar goes to stderr only when stderr is a terminal, so pipes, logs and tests stay clean.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagellm.errors import PagellmError


def add_output_args(parser: argparse.ArgumentParser, default_result_file: str = "") -> None:
    """--json and --result-file, spelled and described alike on every command."""
    group = parser.add_argument_group("output")
    group.add_argument("--json", action="store_true",
                       help="print the full result as one JSON document on stdout instead of the table")
    where = repr(default_result_file) if default_result_file else "none"
    group.add_argument("--result-file", default=default_result_file, metavar="PATH",
                       help=f"append the full result as one JSON line to PATH ('' = do not write; "
                       f"default: {where})")  # fmt: skip


def emit_result(
    record: dict[str, Any],
    print_table: Callable[[dict[str, Any]], None],
    as_json: bool,
    result_file: str | None,
) -> None:
    """Print the table (or, with as_json, the record as JSON), then append the record to
    result_file when one is given."""
    if as_json:
        print(json.dumps(record))
    else:
        print_table(record)
    if result_file:
        append_json_line(result_file, record)


def append_json_line(path: str, record: dict[str, Any]) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        raise PagellmError(f"cannot write the result file {path}: {e.strerror}") from None


def print_note(message: str, as_json: bool) -> None:
    """A line for the reader beside the result (a chart written, say): on stdout with the
    table, on stderr with --json, where stdout must stay one JSON document."""
    print(message, file=sys.stderr if as_json else sys.stdout)


def progress_bar(total: int, desc: str, unit: str) -> Any:
    """A tqdm bar on stderr, or None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)
