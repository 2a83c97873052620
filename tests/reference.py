"""The independent reference: greedy decoding with HF transformers, written out plainly."""

from __future__ import annotations

import inspect

import torch


def _cache_argument(model) -> str:
    """transformers renamed `past_key_values` to `cache`; support both."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """Greedy tokens from an HF model; stops after an EOS id (kept) when eos_ids is given."""
    past = None
    cache_arg = _cache_argument(model)
    inputs = torch.tensor([prompt_ids])
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=inputs, use_cache=True, **{cache_arg: past})
        past = getattr(out, cache_arg)
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if token in eos_ids:
            break
        inputs = torch.tensor([[token]])
    return tokens


def pagellm_greedy(llm, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = False):
    """Greedy token ids from a pagellm LLM for prompts given as token ids, in order."""
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=not stop_at_eos)
    outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]
