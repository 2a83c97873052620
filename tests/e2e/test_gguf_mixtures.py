"""GGUF files as users download them: a tiny Llama quantized by llama.cpp's own quantizer to
each common mixture (tests/data/gguf_mixtures/, made by its regenerate.py: Q4_K_M, Q5_K_M,
Q3_K_M, Q2_K, IQ4_XS, IQ3_M, with llama.cpp's fallbacks for the MLP's 352-wide rows: Q5_0,
Q4_0, IQ4_NL). Each loads with every quantized tensor held as stored, and its teacher-forced
log-probabilities agree with transformers in float32 on the same file (which dequantizes
every tensor with the gguf package) within the bf16 path's bounds (tests/default_path.py);
with --int8-activations as well, on the builds that have its kernels for them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest
import torch

import default_path as dp
from pagellm.bench.llamacpp_quantize import MIXTURES

FOLDER = Path(__file__).resolve().parents[1] / "data" / "gguf_mixtures"
FLOAT_TYPES = {"F32", "F16", "BF16"}


@pytest.fixture(scope="module", autouse=True)
def _needs_native_bf16():
    if not dp.native_bf16_kernels_available():
        pytest.skip("weights stay as stored only on the native CPU kernels (x86-64 with AVX2, and a C compiler)")


def _file_bytes_by_type(path: Path) -> dict[str, int]:
    totals: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        name = gguf.GGMLQuantizationType(tensor.tensor_type).name
        totals[name] = totals.get(name, 0) + int(tensor.n_bytes)
    return totals


@pytest.mark.parametrize("mixture", MIXTURES)
def test_mixture_is_held_as_stored_and_agrees_with_its_dequantization(mixture, caplog):
    import transformers

    from pagellm import LLM

    path = FOLDER / f"{mixture}.gguf"
    in_file = _file_bytes_by_type(path)
    quantized = {t: n for t, n in in_file.items() if t not in FLOAT_TYPES}
    assert len(quantized) >= 2, in_file  # a mixture, not one type

    checked: list[bool] = []

    def held_as_stored(llm: LLM) -> None:
        assert not [r.message for r in caplog.records if "dequantized" in r.message]
        resident = llm.engine.runner.model.weight_bytes_by_format()
        # Every quantized type of the file held as stored, in its bytes (Q4_0 rows gain a
        # zero group where their group count is odd: 352 / 32 = 11).
        for weight_type, file_bytes in quantized.items():
            held = resident.get(f"{weight_type} as stored", 0)
            assert file_bytes <= held <= 1.1 * file_bytes, (weight_type, held, file_bytes, resident)
        assert set(resident) - {f"{t} as stored" for t in quantized} <= {"bfloat16", "float32"}  # norms, tables
        assert sum(resident.values()) <= 1.05 * sum(in_file.values()), (resident, in_file)
        checked.append(True)

    reference = transformers.AutoModelForCausalLM.from_pretrained(str(FOLDER), gguf_file=path.name, dtype=torch.float32)
    scenario = {s.name: s for s in dp.standard_scenarios(reference.config.vocab_size)}["plain"]
    with caplog.at_level(logging.INFO, logger="pagellm"):
        run = dp.run_scenario(str(path), scenario, "bfloat16", inspect=held_as_stored, quantization="auto")
    assert checked
    dp.check_native_paths(run)
    result = dp.teacher_forced(reference.eval(), run.completions)
    print(f"{mixture}: top-1 {result.agreed}/{result.positions} = {result.agreement:.2%}, widest gap {result.max_gap:.4f}")
    dp.check_against_reference(result, reference.config.num_hidden_layers, mixture)


def test_the_files_are_llamacpp_mixtures():
    """What the files hold is llama.cpp's choice per tensor: K-quants or i-quants where rows
    split into 256-wide super-blocks, its fallbacks for the 352-wide ffn_down rows."""
    fallbacks = {"Q4_K_M": {"Q5_0", "Q8_0"}, "Q5_K_M": {"Q5_1", "Q8_0"}, "Q3_K_M": {"Q5_0"}, "Q2_K": {"Q4_0"},
                 "IQ4_XS": {"IQ4_NL"}, "IQ3_M": {"IQ4_NL"}}  # fmt: skip
    for mixture in MIXTURES:
        reader = gguf.GGUFReader(str(FOLDER / f"{mixture}.gguf"))
        down = {gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors if "ffn_down" in t.name}
        assert down and down <= fallbacks[mixture], (mixture, down)


@pytest.mark.parametrize("mixture", ["Q2_K", "IQ3_M"])  # Q2_K, Q3_K, Q4_0 (repacked), IQ3_S, Q4_K, Q6_K
def test_mixture_with_int8_activations_agrees_with_its_dequantization(mixture, monkeypatch):
    """--int8-activations on llama.cpp's own files (its K-quant and IQ3_S blocks as written,
    not our test writer's): every layer with a part of a type this build's int8 kernels read
    is offered the kernel, which is forced on every step; the teacher-forced log-probabilities
    stay within the bf16 path's bounds of transformers' float32 run on the same file (an
    IQ3_S offset one unit off fails them). On builds without AVX-512 VNNI these types have no
    int8 kernel: skipped there (the kernel tests cover what they stream)."""
    import transformers

    from pagellm.kernels.build import load_kernels
    from pagellm.kernels.linear_bindings import LinearImpl
    from pagellm.kernels.weights import WeightType

    library = load_kernels()
    path = FOLDER / f"{mixture}.gguf"
    file_types = {WeightType[name] for name in _file_bytes_by_type(path) if name not in FLOAT_TYPES}
    int8_types = {t for t in file_types if library is not None and library.quant_int8_supported(int(t))}
    if not int8_types & {WeightType.Q2_K, WeightType.Q3_K, WeightType.IQ4_XS, WeightType.IQ3_S}:
        pytest.skip(f"this build has no int8-activation kernel for {mixture}'s main type (AVX-512 VNNI only)")
    offered: list[str] = []

    def int8_offered(llm) -> None:
        for group in llm.engine.runner.model.linear_groups:
            types = set(group.module.packed.types) if group.module.packed is not None else set()
            readable = {t for t in types if library.quant_int8_supported(int(t))}  # as held: Q4_0 may be repacked
            assert (LinearImpl.STREAMING_INT8 in group.shape.candidates) == bool(readable), group.label
            if readable:
                offered.append(group.label)

    monkeypatch.setenv("PAGELLM_LINEAR_KERNEL", "streaming-int8")
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(FOLDER), gguf_file=path.name, dtype=torch.float32)
    scenario = {s.name: s for s in dp.standard_scenarios(reference.config.vocab_size)}["plain"]
    run = dp.run_scenario(str(path), scenario, "bfloat16", inspect=int8_offered, quantization="auto", int8_activations=True)
    assert offered
    result = dp.teacher_forced(reference.eval(), run.completions)
    print(f"{mixture} int8: top-1 {result.agreed}/{result.positions} = {result.agreement:.2%}, widest gap {result.max_gap:.4f}")
    dp.check_against_reference(result, reference.config.num_hidden_layers, f"{mixture} int8")
