"""Benchmark results name their CPU: model name and the ISA extensions present."""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

from pagellm.bench import machine
from pagellm.bench.machine import ISA_FLAGS, cpu_info, describe_cpu

XEON_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx_vnni

processor\t: 1
model name\t: some other name
flags\t\t: fpu
"""


def test_model_name_and_isa_flags_from_cpuinfo():
    info = cpu_info(XEON_CPUINFO)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    # In ISA_FLAGS order, only the listed ones (avx512bw is not), from the first CPU.
    assert info["isa_flags"] == [
        "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile"
    ]  # fmt: skip
    assert describe_cpu(info) == "Intel(R) Xeon(R) Platinum 8480+ (" + " ".join(ISA_FLAGS) + ")"


def test_without_a_model_name_the_platform_names_the_cpu(monkeypatch):
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    info = cpu_info("processor\t: 0\nFeatures\t: fp asimd\n")
    assert info == {"model": "arm", "isa_flags": []}
    assert describe_cpu(info) == "arm (no AVX2 / AVX-512 / AMX)"
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert cpu_info("")["model"] == "unknown"


def test_this_machine(monkeypatch, tmp_path):
    info = cpu_info()
    assert info["model"] and set(info["isa_flags"]) <= set(ISA_FLAGS)
    monkeypatch.setattr(machine, "CPUINFO", tmp_path / "missing")  # not Linux
    monkeypatch.setattr(platform, "processor", lambda: "x86_64")
    assert cpu_info() == {"model": "x86_64", "isa_flags": []}


def test_compare_table_names_the_cpu_and_the_agreement():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"
    spec = importlib.util.spec_from_file_location("compare", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    record = {
        "backend": "llamacpp", "dtype": "gguf", "output_tok_s": 100.0, "total_tok_s": 150.0,
        "achieved_gflop_s": 20.0, "matmul_ceiling_gflop_s": 100.0, "fraction_of_ceiling": 0.2,
        "settings": {"parallel": 4}, "agreement": {"fraction": 0.8125},
    }  # fmt: skip
    unchecked = {**record, "agreement": None}
    text = compare.render({"mixed": [record, unchecked]}, "x86_64 2 cores", cpu_info(XEON_CPUINFO))
    assert "CPU Intel(R) Xeon(R) Platinum 8480+ (avx2 avx512f" in text.splitlines()[0]
    assert "| agreement |" in text
    rows = [line for line in text.splitlines() if line.startswith("| llamacpp")]
    assert "| 0.81 |" in rows[0] and "| not checked |" in rows[1]
