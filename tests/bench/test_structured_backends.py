"""benchmarks/structured_backends.py: its pure helpers (percentiles, the batch plan, the
dependency closure, mask agreement, the verdict and tables) and its constraint corpus
(every sample output is an instance of its schema), without timing anything."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_backends.py"


@pytest.fixture(scope="module")
def sb():
    spec = importlib.util.spec_from_file_location("structured_backends", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["structured_backends"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["structured_backends"]


def test_percentile_interpolates_between_ranks(sb):
    assert sb.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert sb.percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert sb.percentile([5.0], 90) == 5.0
    with pytest.raises(ValueError):
        sb.percentile([], 50)


def test_summarize_ms_keeps_the_first_step(sb):
    summary = sb.summarize_ms([0.004, 0.001, 0.002, 0.003])
    assert summary["first"] == 4.0 and summary["max"] == 4.0
    assert summary["median"] == 2.5 and summary["mean"] == 2.5
    assert summary["p90"] == pytest.approx(3.7)


def test_mixed_rows_and_rotation(sb):
    assert sb.mixed_rows(["a", "b", "c"], 5) == ["a", "b", "c", "a", "b"]
    assert sb.mixed_rows(["a", "b"], 1) == ["a"]
    assert sb.rotate(("w", "x", "y"), 0) == ["w", "x", "y"]
    assert sb.rotate(("w", "x", "y"), 4) == ["x", "y", "w"]


def test_dependency_closure_follows_markers_and_skips_extras(sb):
    graph = {
        "top": ["Mid_Pkg>=1", "extra-only; extra == 'test'", "never; python_version < '3'", "leaf"],
        "mid-pkg": ["leaf", "deep"],
        "leaf": [],
        "deep": ["top"],  # a cycle back to the root adds nothing
        "extra-only": ["other"],
    }
    closure = sb.dependency_closure("top", lambda name: graph.get(name))
    assert closure == ["deep", "leaf", "mid-pkg"]
    assert sb.dependency_closure("missing", lambda name: None) == []


def test_mask_agreement_classifies_rows(sb):
    counts = {"identical": 0, "llg_subset": 0, "xgr_subset": 0, "other": 0}
    llg = torch.tensor([[0b0110], [0b0010], [0b0111], [0b0011]], dtype=torch.int32)
    xgr = torch.tensor([[0b0110], [0b0110], [0b0011], [0b0110]], dtype=torch.int32)
    assert sb.mask_agreement(llg, xgr, counts) is False
    assert counts == {"identical": 1, "llg_subset": 1, "xgr_subset": 1, "other": 1}
    assert sb.mask_agreement(llg[:1], xgr[:1], counts) is True


def test_every_sample_is_an_instance_of_its_schema(sb):
    jsonschema = pytest.importorskip("jsonschema")
    checker = jsonschema.FormatChecker()
    constraints = sb.constraints()
    assert len([c for c in constraints if c[1] == "json"]) >= 6
    assert {kind for _, kind, _, _ in constraints} == {"json", "regex", "grammar"}
    for name, kind, text, sample in constraints:
        if kind == "json":
            jsonschema.validate(json.loads(sample), json.loads(text), format_checker=checker)


def _record(sb, with_xgr: bool = True):
    ms = {"median": 1.0, "p90": 2.0, "mean": 1.2, "first": 3.0, "max": 3.0}
    fast = {**ms, "median": 0.5}
    step = {
        "batch_size": 32, "mixed": False, "schemas": ["flat"], "steps": 4, "mean_live_rows": 30.5,
        "rows_finished_eos": 2,
        "rows_stopped_disagreement": 0, "apply_results_identical": True, "apply_bytes": 12_000_000,
        "apply_gb_s": {"llg_apply": 24.0, **({"xgr_apply": 12.0, "xgr_mask_apply_masks": 24.0} if with_xgr else {})},
        "mask_agreement": {"identical": 0.5, "llg_subset": 0.5, "xgr_subset": 0.0, "other": 0.0} if with_xgr else None,
        "xgr_fill_for_total": "xgr_loop" if with_xgr else None,
        "ms": {"llg_loop": ms, "llg_executor": fast, "llg_apply": fast, "llg_total": ms,
               **({"xgr_loop": {**ms, "median": 0.25}, "xgr_batch": ms, "xgr_apply": ms, "xgr_mask_apply_masks": fast,
                   "xgr_total": {**ms, "median": 4.0}, "xgr_total_apply_masks": {**ms, "median": 0.75}}
                  if with_xgr else {})},
    }  # fmt: skip
    compile_row = {"name": "flat", "kind": "json", "chars": 10, "llg_accepts_sample": True, "llg_compile_ms": 1.0,
                   "llg_first_mask_ms": 0.1, "llg_ready_ms": 1.1, "xgr_over_llg_ready": None}  # fmt: skip
    if with_xgr:
        compile_row |= {"xgr_accepts_sample": True, "xgr_compile_ms": 4.0, "xgr_first_mask_ms": 0.1,
                        "xgr_ready_ms": 4.1, "xgr_over_llg_ready": 3.73}  # fmt: skip
    results = {
        "tokenizer_setup": {"llg_s": 0.2, **({"xgr_s": 0.3, "xgr_wrap_s": 0.1, "xgr_tokenizer_info_s": 0.2}
                                              if with_xgr else {})},
        "compile": [compile_row], "steps": [step], "xgr_fill": "xgr_batch" if with_xgr else None,
        "dependencies": [{"package": "llguidance", "installed": True, "version": "1", "requires": [], "own_mb": 8.0,
                          "closure": [], "closure_mb": 0.0, "adds_to_pagellm_core": [], "adds_mb": 0.0,
                          "import_s": 0.01},
                         {"package": "xgrammar", "installed": False}],
    }  # fmt: skip
    results["break_even"] = sb.break_even(results["compile"], results["steps"]) if with_xgr else []
    results["verdict"] = sb.verdict(results)
    config = {"xgrammar": "0.2" if with_xgr else None, "threads": 2, "cpu_count": 2, "load_average_before": [0.1]}
    record = {"config": config, "results": results, "notes": []}
    record["notes"] = sb.notes(record)
    return record


def test_verdict_and_tables(sb):
    record = _record(sb)
    verdict = record["results"]["verdict"]
    assert verdict[0].startswith("Tokenizer setup: llguidance")
    assert any("Compile alone: llguidance faster on 1 of 1" in line for line in verdict)
    assert any(line.startswith("Per-step fill (each engine's faster path)") and "0 of 1" in line and "0.5x" in line
               for line in verdict)  # fmt: skip
    assert any("fill + own apply" in line and "4.0x" in line for line in verdict)
    assert any("fill + apply_masks for both" in line and "0.75x" in line for line in verdict)
    # xgrammar costs 3 ms more to compile and saves (0.5 - 0.25) ms / 30.5 rows per token.
    (even,) = record["results"]["break_even"]
    assert even["tokens"] == round(3.0 / (0.25 / 30.5)) and even["schema"] == "flat"
    assert any(line.startswith("Break-even (B=32") for line in verdict)
    tables = sb.format_tables(record)
    assert "| flat | json | 10 |" in tables and "50% / 50% / 0% / 0%" in tables
    assert "[xgr_loop]" in tables and "Who wins:" in tables and "4.00 / 0.75" in tables
    assert "| 32 | flat | 12.00 | 24.00 | 12.00 | 24.00 |" in tables


def test_tables_without_xgrammar(sb):
    record = _record(sb, with_xgr=False)
    assert record["results"]["verdict"] == []
    assert any("xgrammar is not installed" in note for note in record["notes"])
    tables = sb.format_tables(record)
    assert "xgrammar TokenizerInfo" not in tables and "Who wins:" not in tables
    assert "| xgrammar | not installed |" in tables
    assert "| 32 | flat | 12.00 | 24.00 | - | - |" in tables
