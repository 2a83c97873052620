"""benchmarks/gpu_check.py (sections in benchmarks/gpu_checks/): its cheapest section (the kernel checks) on tiny shapes, the
section guard, the table, and the synthetic checkpoints it builds.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), as the script's --smoke mode does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'pagellm[gpu]')")

from pagellm.bench.synthetic_model import SHAPES, write_synthetic_checkpoint  # noqa: E402
from pagellm.model.loader import ModelSource, load_model_config, load_tokenizer  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def gpu_check():
    """The script's sections and driver (benchmarks/gpu_checks/), as one namespace."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from gpu_checks import common, kernel_sections, runner

        yield SimpleNamespace(
            smoke_config=common.smoke_config, SectionOutput=common.SectionOutput,
            section_kernels=kernel_sections.section_kernels, runner=runner,
            run_section=runner.run_section, format_table=runner.format_table,
        )  # fmt: skip
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_kernel_section_passes_on_tiny_shapes(gpu_check):
    cfg = gpu_check.smoke_config()
    out = gpu_check.SectionOutput("kernels")
    gpu_check.section_kernels(cfg, {}, out)
    # Both steps in both dtypes, plus the split-K row of the long decode.
    assert len(out.rows) == 5
    assert all(row.met for row in out.rows), out.rows
    long_decode = next(v for k, v in out.figures.items() if k.startswith("tiny decode") and k.endswith("bfloat16"))
    assert long_decode["num_splits"] > 1 and long_decode["cache_equal"]


def test_a_failing_section_is_reported_and_the_run_goes_on(gpu_check, monkeypatch):
    cfg = gpu_check.smoke_config()

    def broken(cfg, ctx, out):
        out.row("first figure", "42")
        raise ValueError("kernel exploded")

    monkeypatch.setitem(gpu_check.runner.SECTIONS, "kernels", broken)
    failed = gpu_check.run_section("kernels", cfg, {}, remaining_s=1000.0)
    assert failed.status == "FAILED" and "kernel exploded" in failed.error
    assert [r.result for r in failed.rows] == ["42", "FAILED: ValueError: kernel exploded"]
    skipped = gpu_check.run_section("throughput", cfg, {}, remaining_s=1.0)
    assert skipped.status == "SKIPPED" and skipped.rows[0].result == "SKIPPED: time"
    table = gpu_check.format_table([failed, skipped], "title")
    lines = table.splitlines()
    assert lines[0] == "title" and lines[1].split(" | ")[0].strip() == "check"
    assert any("SKIPPED: time" in line for line in lines) and any(line.endswith("NO") for line in lines)


def test_synthetic_checkpoint_without_weights_loads_as_the_preset(tmp_path):
    folder = write_synthetic_checkpoint(tmp_path, shape=SHAPES["llama-3-8b"], with_weights=False)
    assert not list(folder.glob("*.safetensors"))
    source = ModelSource("hf", folder, "synthetic")
    config = load_model_config(source)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (4096, 32, 128256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.rope_theta == 500000.0 and not config.tie_word_embeddings
    tokenizer = load_tokenizer(source, config)
    # One token per byte; ids past the byte range decode to nothing.
    assert tokenizer.encode("Hi", add_special_tokens=False) == [72, 105]
    assert tokenizer.decode([72, 105, 100000]) == "Hi"
