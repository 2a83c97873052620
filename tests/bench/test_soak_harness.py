"""The soak harness, 45 seconds of it (benchmarks/soak.py; the README reports a full run):
mixed and hostile traffic against a real server with a small KV cache, then every check
it makes must pass (right lengths and statuses, no 5xx but 503, drained, every block
free, flat RSS, descriptors and threads back to baseline, exit 0)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_soak_passes_every_check(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--duration", "45", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["passed"] and report["leaked_blocks"] == 0 and report["unexpected_5xx"] == 0
    # Traffic flowed both ways (how much depends on the machine's speed and load: a busy
    # 2-core machine completed 9 requests in a minute, a quiet one over 100).
    assert report["by_status"].get("200", 0) >= 5 and report["by_status"].get("413", 0) > 0
    assert report["preemptions"] > 0  # the small cache preempted throughout
    assert (tmp_path / "soak.png").stat().st_size > 0
