"""LoRA beyond the tiny Llama: a checkpoint with fused projections (Phi-3's qkv_proj and
gate_up_proj, targeted whole by peft), a quantized GGUF base kept as stored, and the
embedded SmolLM2 against HF + PEFT."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_models import write_gguf_from_hf
from hf_models import make_tiny_hf_checkpoint
from peft_adapters import make_peft_adapter, peft_model
from reference import hf_greedy

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.errors import InvalidRequestError

pytest.importorskip("peft")
PROMPTS = [list(range(5, 30)), [3, 4, 9, 200]]


def _greedy(llm, lora, prompts=PROMPTS, tokens=10):
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, lora_request=lora, use_tqdm=False)]


def test_phi3_fused_projections_equal_hf_peft(tmp_path):
    base = make_tiny_hf_checkpoint(tmp_path / "phi3", "phi3")
    adapter = make_peft_adapter(base, tmp_path / "adapter", 8, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], seed=4)
    reference = [hf_greedy(peft_model(base, adapter), p, 10) for p in PROMPTS]
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    assert _greedy(llm, LoRARequest("fused", 1, str(adapter))) == reference
    assert _greedy(llm, None) != reference
    # Two tensor-parallel ranks cannot cut a projection's adapter fused across q/k/v: the
    # request is refused when added, naming it, not failed inside a step.
    parallel = LLM(str(base), dtype="float32", enable_lora=True, tensor_parallel_size=2)
    try:
        with pytest.raises(InvalidRequestError, match="_proj: a fused projection.s adapter under tensor parallelism"):
            _greedy(parallel, LoRARequest("fused", 1, str(adapter)))
        assert len(_greedy(parallel, None)[0]) == 10
    finally:
        parallel.shutdown()


def test_a_quantized_gguf_base_keeps_its_blocks_under_adapters(tmp_path):
    # The base's Q8_0 / Q4_0 weights stay as stored (bf16 kernels); the adapter's products are
    # added to what they compute. Against the same file dequantized, in float32: the
    # adapter's effect is there, and the bf16 run is as close as bf16 allows.
    import gguf

    folder = make_tiny_hf_checkpoint(tmp_path / "hf", "llama")
    kinds = {"attn_q": gguf.GGMLQuantizationType.Q8_0, "attn_k": gguf.GGMLQuantizationType.Q8_0,
             "attn_v": gguf.GGMLQuantizationType.Q8_0, "attn_output": gguf.GGMLQuantizationType.Q8_0,
             "ffn_gate": gguf.GGMLQuantizationType.Q4_0, "ffn_up": gguf.GGMLQuantizationType.Q4_0,
             "ffn_down": gguf.GGMLQuantizationType.Q8_0}  # fmt: skip
    path = write_gguf_from_hf(folder, tmp_path / "q.gguf", json.loads((folder / "config.json").read_text()), quant_by_kind=kinds)
    adapter = make_peft_adapter(folder, tmp_path / "adapter", 8, ["q_proj", "v_proj", "down_proj"], seed=5)
    lora = LoRARequest("a", 1, str(adapter))
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=10)

    def logprobs(dtype, request):
        llm = LLM(str(path), dtype=dtype, enable_lora=True)
        out = llm.generate([PROMPTS[0]], params, lora_request=request, use_tqdm=False)[0].outputs[0]
        return llm, {t: lp.logprob for t, lp in out.logprobs[0].items()}

    packed, quantized = logprobs("bfloat16", lora)
    assert packed.engine.runner.model.layers[0].self_attn.qkv_proj.packed is not None  # kept as stored
    _, exact = logprobs("float32", lora)
    _, plain = logprobs("float32", None)
    top = lambda lps: set(sorted(lps, key=lps.get, reverse=True)[:5])  # noqa: E731
    assert len(top(quantized) & top(exact)) >= 4 > len(top(quantized) & top(plain))
    shared = set(quantized) & set(exact)
    assert max(abs(quantized[t] - exact[t]) for t in shared) < 0.35


@pytest.mark.slow
def test_smollm2_adapter_equals_hf_peft(smollm2_path, tmp_path):
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
    torch.manual_seed(7)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                                                    target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]))  # fmt: skip
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn_like(parameter) * 0.02)
    model.save_pretrained(tmp_path / "adapter")
    model.eval()
    prompts = [list(range(1000, 1020)), [504, 3102, 281]]
    reference = [hf_greedy(model, p, 12) for p in prompts]
    llm = LLM(str(smollm2_path), dtype="float32", enable_lora=True)
    ours = _greedy(llm, LoRARequest("smol", 1, str(tmp_path / "adapter")), prompts, 12)
    assert ours == reference
    assert _greedy(llm, None, prompts, 12) != reference
