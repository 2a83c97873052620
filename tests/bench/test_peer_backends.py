"""bench/peers.py: a peer engine's run in its own environment's child process. CI has no
peer installed, so fake runners (scripts of the same contract, run by this Python) stand in:
a result comes back as a BackendResult; a crash, an error exit, a missing or short result is
that backend's failure, named, and nothing else is disturbed."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from pagellm.bench.peers import PEERS, PeerSpec, peer_python, peer_settings, run_peer
from pagellm.errors import PagellmError
from pagellm.workload.synthetic import BenchRequest

REQUESTS = [BenchRequest([5, 6, 7], 3), BenchRequest([8, 9], 2)]
SPEC = PEERS["openvino"]


def _runner(tmp_path: Path, body: str) -> Path:
    """A fake runner: reads the job (IN.json), runs `body` with `job` and `out` (OUT path) bound."""
    path = tmp_path / "runner.py"
    path.write_text("import json, os, signal, sys\njob = json.load(open(sys.argv[1]))\nout = sys.argv[2]\n"
                    + textwrap.dedent(body))  # fmt: skip
    return path


def _run(tmp_path: Path, body: str, **kwargs):  # noqa: ANN003, ANN202
    return run_peer(SPEC, REQUESTS, tmp_path / "model.gguf", python=Path(sys.executable), runner=_runner(tmp_path, body), **kwargs)


def test_a_peers_outputs_and_times_come_back_with_its_settings(tmp_path):
    result = _run(tmp_path, """
        outputs = [[1] * length for _, length in job["requests"]]
        json.dump({"elapsed_runs_s": [0.5, 0.2, 0.3], "output_token_ids": outputs,
                   "settings": {"seen": job["settings"], "repeats": job["repeats"]}, "version": "9.9"}, open(out, "w"))
    """, repeats=3, settings={"max_num_seqs": 4})
    assert result.backend == "openvino" and result.elapsed_s == 0.3  # the median of the runs
    assert result.output_token_ids == [[1, 1, 1], [1, 1]] and result.output_tokens == 5 and result.prompt_tokens == 5
    assert result.settings["seen"] == {"max_num_seqs": 4} and result.settings["repeats"] == 3
    assert result.settings["version"] == "9.9"


@pytest.mark.parametrize(
    "body,message",
    [
        ("os.kill(os.getpid(), signal.SIGSEGV)\n", "openvino crashed: its process was killed by signal SIGSEGV"),
        ("print('model file not found: x.gguf', file=sys.stderr); sys.exit(3)\n",
         "openvino's process exited with status 3: model file not found: x.gguf"),
        ("pass\n", "openvino's process wrote no result"),
        ("json.dump({'elapsed_runs_s': [1.0], 'output_token_ids': [[1, 2, 3]]}, open(out, 'w'))\n",
         "openvino produced 3 tokens for 1 requests, 5 for 2 were asked for"),
    ],
    ids=["crash", "error-exit", "no-result", "short-result"],
)  # fmt: skip
def test_a_failing_peer_is_reported_by_name(tmp_path, body, message):
    with pytest.raises(PagellmError) as error:
        _run(tmp_path, body)
    assert message in str(error.value)


def test_a_peer_not_installed_is_named_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_PEER_ENVS", str(tmp_path / "envs"))
    with pytest.raises(PagellmError, match=r"openvino is not installed in .*envs/openvino \(pip install openvino-genai"):
        peer_python(SPEC, install=False)


def test_an_installed_peer_is_found_by_its_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_PEER_ENVS", str(tmp_path))
    spec = PeerSpec("fake", ("fake-package==1",), "fake_runner.py", takes_gguf=True)
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "pagellm-installed.json").write_text(json.dumps({"packages": ["fake-package==1"]}))
    assert peer_python(spec, install=False) == tmp_path / "fake" / "bin" / "python"
    # Other pins than the ones installed: not this environment.
    with pytest.raises(PagellmError, match="not installed"):
        peer_python(PeerSpec("fake", ("fake-package==2",), "fake_runner.py", takes_gguf=True), install=False)


def test_peer_settings_parse_numbers_and_booleans():
    assert peer_settings(["cache_size_gb=2", "dynamic_split_fuse=false", "scale=0.5", "name=x"]) == {
        "cache_size_gb": 2, "dynamic_split_fuse": False, "scale": 0.5, "name": "x",
    }  # fmt: skip
    with pytest.raises(PagellmError, match="expected KEY=VALUE"):
        peer_settings(["cache_size_gb"])
