"""The default CPU path on a quantized GGUF (weights kept as stored, bf16 through the
native kernels) against HF transformers in float32 on the same file, under every
scheduling regime of tests/default_path.py.

The GGUF is written from the default-path test model with Q4_0, Q4_1 and Q8_0 tensors;
transformers loads the file itself (it dequantizes every tensor), so the reference
computes with exactly the weights pagellm keeps quantized. pagellm's only difference is
bf16 arithmetic, judged with the same thresholds as the bf16 path (default_path.py), and
its schedule must be the float32 run's (--quantization none, float32: the exact path).
"""

import json

import gguf
import pytest
import torch
from gguf_models import write_gguf_from_hf

import default_path as dp

T = gguf.GGMLQuantizationType
TYPES = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
         "ffn_gate": T.Q4_1, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0, "output": T.Q8_0}  # fmt: skip
NUM_LAYERS = dp.DEFAULT_PATH_SHAPE["num_hidden_layers"]
SCENARIOS = {s.name: s for s in dp.standard_scenarios(256)}
# The regimes whose schedule depends on the cache's contents (the float32 reruns are what
# takes the time here; the other regimes' schedules are checked on the bf16 model).
SCHEDULE_CHECKED = ("recompute_preemption", "swap_preemption", "prefix_caching")


@pytest.fixture(scope="module", autouse=True)
def _needs_native_bf16():
    if not dp.native_bf16_kernels_available():
        pytest.skip("the quantized path needs the native CPU kernels (x86-64 with AVX2, and a C compiler)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("quantized_path")
    folder = dp.make_default_path_checkpoint(root / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    path = write_gguf_from_hf(folder, root / "model.gguf", cfg, quant_by_kind=TYPES)
    reference = transformers.AutoModelForCausalLM.from_pretrained(root, gguf_file=path.name, dtype=torch.float32)
    return str(path), reference.eval()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_quantized_path_agrees_with_hf_and_schedules_as_float32(model, name):
    path, reference = model
    run = dp.run_scenario(path, SCENARIOS[name], "bfloat16", quantization="auto")
    dp.check_native_paths(run)
    result = dp.teacher_forced(reference, run.completions)
    print(f"{name}: top-1 {result.agreed}/{result.positions} = {result.agreement:.2%}, widest gap {result.max_gap:.4f}")
    dp.check_against_reference(result, NUM_LAYERS, name)
    if name in SCHEDULE_CHECKED:
        dp.check_same_schedule(run, dp.run_scenario(path, SCENARIOS[name], "float32", quantization="none"))


def test_weights_are_held_as_stored(model):
    from pagellm import LLM

    llm = LLM(model[0], dtype="bfloat16", quantization="auto")
    layer = llm.engine.runner.model.layers[0]
    assert [t.name for t in layer.self_attn.qkv_proj.packed.types] == ["Q4_0", "Q4_1", "Q8_0"]
    assert {"fused", "layers"} <= set(llm.engine.runner.step_paths.names)
