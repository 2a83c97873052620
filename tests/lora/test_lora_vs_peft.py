"""LoRA adapters made by `peft` on a tiny Llama against HF + PEFT (unmerged PeftModel,
float32): greedy tokens equal for each adapter alone, and for one batch mixing the base
model and three adapters of different ranks and targets, under chunked prefill, recompute
preemption, prefix caching and fewer adapter slots than adapters."""

from __future__ import annotations

import pytest
from hf_models import make_tiny_hf_checkpoint
from peft_adapters import ATTENTION, MLP, make_peft_adapter, peft_model
from reference import hf_greedy

from pagellm import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
NEW_TOKENS = 12
PROMPTS = [list(range(5, 45)), [3, 4, 9], [99, 100, 101, 7, 8, 250, 17], list(range(60, 80))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_hf_checkpoint(root / "base", "llama")
    adapters = {
        "all-r8": make_peft_adapter(base, root / "all-r8", 8, ATTENTION + MLP, seed=1),
        "qv-r4": make_peft_adapter(base, root / "qv-r4", 4, ["q_proj", "v_proj"], seed=2, alpha=8),
        "o-down-r16-rslora": make_peft_adapter(base, root / "od-r16", 16, ["o_proj", "down_proj"], seed=3, use_rslora=True),
    }
    return base, adapters


@pytest.fixture(scope="module")
def references(checkpoint):
    """HF greedy tokens per (adapter or None, prompt)."""
    import transformers
    import torch

    base, adapters = checkpoint
    out = {}
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    out[None] = [hf_greedy(plain, p, NEW_TOKENS) for p in PROMPTS]
    for name, path in adapters.items():
        model = peft_model(base, path)
        out[name] = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    return out


def _requests(adapters):
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


def test_the_adapters_change_the_output(references):
    # Otherwise equality below would prove nothing.
    for name in ("all-r8", "qv-r4", "o-down-r16-rslora"):
        assert references[name] != references[None], name


def test_each_adapter_alone_equals_hf_peft(checkpoint, references):
    base, adapters = checkpoint
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for name, request in _requests(adapters).items():
        outs = llm.generate(PROMPTS, params, lora_request=request, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == references[name], name
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == references[None]


def test_a_mixed_batch_with_chunking_preemption_prefix_hits_and_two_slots(checkpoint, references):
    base, adapters = checkpoint
    llm = LLM(
        str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_num_batched_tokens=24,
        num_gpu_blocks_override=14, block_size=8, max_num_seqs=6, max_model_len=64,
    )  # fmt: skip
    requests = _requests(adapters)
    kinds = [None, *requests] * len(PROMPTS)
    prompts = [PROMPTS[i // 4] for i in range(len(kinds))]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=[None if k is None else requests[k] for k in kinds], use_tqdm=False)
    for kind, prompt, out in zip(kinds, prompts, outs):
        assert list(out.outputs[0].token_ids) == references[kind][PROMPTS.index(prompt)], (kind, prompt[:3])
    stats = llm.engine.get_stats()
    assert stats.num_preemptions_recompute > 0
    manager = llm.engine.runner.lora_manager
    assert manager.num_evictions > 0  # three adapters through two slots


def test_a_prefix_is_shared_within_an_adapter_never_across(checkpoint):
    base, adapters = checkpoint
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, block_size=8)
    requests = _requests(adapters)
    prompt = list(range(5, 46))  # five full blocks and one more token (the last is always computed)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def hits(lora):
        before = llm.engine.get_stats().num_prefix_hit_tokens
        llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
        return llm.engine.get_stats().num_prefix_hit_tokens - before

    assert hits(requests["all-r8"]) == 0
    assert hits(requests["qv-r4"]) == 0  # the same tokens under another adapter: computed again
    assert hits(None) == 0  # ... and under the base model
    assert hits(requests["all-r8"]) == 40
    assert hits(None) == 40


def test_bf16_on_the_cpu_kernels(checkpoint):
    # bf16 on the CPU: steps with adapter rows run the layers in torch over the measured
    # kernels (the native layer paths know nothing of adapters), the others as before. A
    # random model's next-token choices are near-ties that bf16 may flip, so the check is
    # on log-probabilities: bf16 under an adapter is close to float32 under it, and its
    # likeliest tokens are float32's under the adapter, not without it (the adapter applied).
    base, adapters = checkpoint
    request = _requests(adapters)["all-r8"]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)

    def logprobs(dtype, lora):
        llm = LLM(str(base), dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=16)
        out = llm.generate([PROMPTS[0], PROMPTS[1]], params, lora_request=[lora, None], use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in out]

    bf16_adapter, bf16_base = logprobs("bfloat16", request)
    f32_adapter, f32_base = logprobs("float32", request)
    f32_plain, _ = logprobs("float32", None)

    def distance(a, b):
        shared = set(a) & set(b)
        return max(abs(a[t] - b[t]) for t in shared) if shared else float("inf")

    def top(logprobs, k=5):
        return set(sorted(logprobs, key=logprobs.get, reverse=True)[:k])

    assert distance(bf16_adapter, f32_adapter) < 0.35
    assert len(top(bf16_adapter) & top(f32_adapter)) >= 4 > len(top(bf16_adapter) & top(f32_plain))
    assert distance(bf16_base, f32_base) < 0.35  # the base row of the same step


def test_a_gguf_lora_file_equals_the_peft_folder_it_came_from(checkpoint, references, tmp_path):
    # llama.cpp's format, written from the PEFT folder (q/k B rows permuted as a Llama's
    # base is): the same tokens as HF + PEFT, on the HF base and on its GGUF file.
    import json

    from gguf_models import write_gguf_from_hf, write_gguf_lora_from_peft

    base, adapters = checkpoint
    cfg = json.loads((base / "config.json").read_text())
    lora_file = write_gguf_lora_from_peft(adapters["all-r8"], tmp_path / "all-r8.gguf", cfg)
    base_file = write_gguf_from_hf(base, tmp_path / "base.gguf", cfg, quant_by_kind={})
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for model in (base, base_file):
        llm = LLM(str(model), dtype="float32", enable_lora=True, max_lora_rank=16)
        outs = llm.generate(PROMPTS, params, lora_request=LoRARequest("gguf", 1, str(lora_file)), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == references["all-r8"], model


def test_tensor_parallel_ranks_take_their_share_of_each_adapter(checkpoint, references):
    # Two ranks (processes): q/k/v and gate/up adapters' B cut to the rank's output rows,
    # o and down's A to its input columns; a mixed batch equals HF + PEFT.
    base, adapters = checkpoint
    llm = LLM(str(base), dtype="float32", tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        requests = _requests(adapters)
        kinds = [None, "all-r8", "o-down-r16-rslora", "qv-r4"]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
        outs = llm.generate(prompts, params, lora_request=[None if k is None else requests[k] for k in kinds], use_tqdm=False)
        for kind, prompt, out in zip(kinds, prompts, outs):
            assert list(out.outputs[0].token_ids) == references[kind][PROMPTS.index(prompt)], kind
    finally:
        llm.shutdown()
