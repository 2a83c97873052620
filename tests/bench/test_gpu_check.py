"""benchmarks/gpu_check.py (sections in pagellm/bench/gpu_checks/): its cheapest section (the kernel
checks) on tiny shapes, the section guard, the table, the synthetic checkpoints it builds, HF's static
batches over the throughput request list and their useful-token accounting, and the tensor-parallel
section's skip on a machine without 2 GPUs.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), as the script's --smoke mode does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install 'pagellm[gpu]')")

from pagellm.bench.gpu_checks import (  # noqa: E402
    common,
    hf_baseline,
    kernel_sections,
    parallel_sections,
    runner,
)
from pagellm.bench.synthetic_model import SHAPES, write_synthetic_checkpoint  # noqa: E402
from pagellm.model.loader import ModelSource, load_model_config, load_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def gpu_check():
    """The script's sections and driver (pagellm/bench/gpu_checks/), as one namespace."""
    return SimpleNamespace(
        smoke_config=common.smoke_config, SectionOutput=common.SectionOutput,
        section_kernels=kernel_sections.section_kernels, runner=runner,
        run_section=runner.run_section, format_table=runner.format_table,
        hf=hf_baseline, tp_sizes=parallel_sections.tp_sizes,
    )  # fmt: skip


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


def _requests(hf, lens):
    """BenchRequests of (prompt length, output length); prompt tokens name their request."""
    return [hf.BenchRequest([i] * prompt_len, output_len) for i, (prompt_len, output_len) in enumerate(lens)]


def test_static_batches_cover_the_list_once_sorted_by_prompt_length(gpu_check):
    hf = gpu_check.hf
    requests = _requests(hf, [(9, 4), (2, 8), (5, 1), (7, 3), (1, 6), (3, 2), (8, 5)])
    batches = hf.static_batches(requests, 3)
    assert [len(b) for b in batches] == [3, 3, 1]
    flat = [r for b in batches for r in b]
    assert sorted(r.prompt_token_ids[0] for r in flat) == list(range(len(requests)))
    assert [len(r.prompt_token_ids) for r in flat] == [1, 2, 3, 5, 7, 8, 9]
    # HF runs each batch to its longest output; only each request's own output is useful.
    tokens = hf.BatchTokens.of(batches[0])  # prompts 1, 2, 3 with outputs 6, 8, 2
    assert (tokens.max_new_tokens, tokens.output_tokens, tokens.generated_tokens) == (8, 16, 24)
    assert tokens.padded_prompt_tokens == 9
    with pytest.raises(ValueError):
        hf.static_batches(requests, 0)


def test_hf_time_list_times_the_whole_list_and_counts_useful_tokens(gpu_check):
    hf = gpu_check.hf
    requests = _requests(hf, [(4, 10), (1, 2), (6, 7), (2, 5), (3, 1)])
    seen = []

    def run_batch(batch):
        seen.append(batch)
        return 2.0

    run = hf.hf_time_list(requests, 2, budget_s=100.0, run_batch=run_batch)
    assert seen == hf.static_batches(requests, 2) and len(seen) == 3
    assert not run.partial and run.stopped_by is None
    assert (run.num_requests_done, run.num_batches_done, run.elapsed_s) == (5, 3, 6.0)
    assert run.output_tokens == sum(r.output_len for r in requests) == 25
    # batches by prompt length: outputs (2, 5) -> 2 x 5, (1, 10) -> 2 x 10, (7) -> 1 x 7
    assert run.generated_tokens == 10 + 20 + 7
    assert run.output_tok_s == pytest.approx(25 / 6.0)
    assert hf.hf_done_requests(requests, run) == [r for b in seen for r in b]


def test_hf_time_list_stops_at_its_budget_and_reports_the_requests_done(gpu_check):
    hf = gpu_check.hf
    requests = _requests(hf, [(n, n) for n in range(1, 8)])
    run = hf.hf_time_list(requests, 2, budget_s=7.0, run_batch=lambda batch: 3.0)
    # 3 s spent + 3 s expected fits 7 s; 6 + 3 does not: two of four batches ran.
    assert run.partial and "time budget" in run.stopped_by
    assert (run.num_batches, run.num_batches_done, run.num_requests_done, run.num_requests) == (4, 2, 4, 7)
    assert run.output_tokens == 1 + 2 + 3 + 4 and run.elapsed_s == 6.0
    assert run.output_tok_s == pytest.approx(10 / 6.0)
    assert [len(r.prompt_token_ids) for r in hf.hf_done_requests(requests, run)] == [1, 2, 3, 4]
    figures = run.figures()
    assert figures["partial"] and figures["output_tok_s"] == run.output_tok_s
    # However small the budget, the first batch runs.
    assert hf.hf_time_list(requests, 3, budget_s=0.0, run_batch=lambda batch: 3.0).num_requests_done == 3


def test_hf_time_list_ends_partial_on_out_of_memory(gpu_check):
    hf = gpu_check.hf
    requests = _requests(hf, [(n, 4) for n in range(1, 6)])

    def run_batch(batch):
        if len(batch[-1].prompt_token_ids) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return 1.0

    run = hf.hf_time_list(requests, 2, budget_s=100.0, run_batch=run_batch)
    assert run.partial and run.stopped_by.startswith("out of memory at batch 2")
    assert (run.num_requests_done, run.output_tokens) == (2, 8)


def test_tp_section_says_why_it_cannot_run_on_this_machine(gpu_check):
    assert gpu_check.tp_sizes(1) == (1,) and gpu_check.tp_sizes(2) == (1, 2)
    assert gpu_check.tp_sizes(5) == (1, 2, 4) and gpu_check.tp_sizes(16) == (1, 2, 4, 8)
    cfg = gpu_check.smoke_config()
    # Before the time budget: with no time left the reason is still the machine's.
    out = gpu_check.run_section("tp", cfg, {}, remaining_s=0.0)
    assert out.status == "SKIPPED" and not out.applies
    assert "GPU" in out.error and out.rows[0].result == f"SKIPPED: {out.error}"
