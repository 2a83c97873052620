"""Bench stage: did the timed backend compute the right thing? The leading greedy tokens
of a few requests against a reference, reported beside the throughput, so that a fast
but wrong engine cannot win a table.

The reference is HF transformers in float32, one request at a time (no padding):
independent of pagellm's own code, and the same weights every backend loads (a GGUF is
dequantized as pagellm dequantizes it). Greedy decoding makes every backend's output a
function of the prompt, so the first divergence is where two backends' numbers part: a
bf16 or quantized backend may drift late on a near tie, a wrong one parts at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagellm.workload.synthetic import BenchRequest

logger = logging.getLogger(__name__)

DEFAULT_CHECK_REQUESTS = 4
DEFAULT_CHECK_TOKENS = 16
REFERENCE = "hf float32 greedy"


def matching_prefix_len(output: Sequence[int], reference: Sequence[int]) -> int:
    """How many leading tokens the two lists share."""
    n = 0
    for a, b in zip(output, reference):
        if a != b:
            break
        n += 1
    return n


def leading_agreement(
    outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]], num_tokens: int
) -> dict[str, Any]:
    """Agreement of each output's first `num_tokens` tokens with its reference.

    `fraction` is the matching leading tokens over the tokens compared (a request
    compares min(num_tokens, len(reference)) tokens; after the first mismatch nothing
    more counts, since the contexts differ from there on).
    """
    if len(outputs) != len(references):
        raise ValueError(f"{len(outputs)} outputs against {len(references)} references")
    compared = [min(num_tokens, len(ref)) for ref in references]
    matched = [
        matching_prefix_len(list(out)[:n], list(ref)[:n]) for out, ref, n in zip(outputs, references, compared)
    ]
    total = sum(compared)
    return {
        "reference": REFERENCE,
        "num_requests": len(references),
        "num_tokens": num_tokens,
        "matched_tokens": matched,
        "compared_tokens": compared,
        "fraction": round(sum(matched) / total, 4) if total else None,
    }


def hf_reference_tokens(model_path: Path, requests: Sequence[BenchRequest], num_tokens: int) -> list[list[int]]:
    """HF transformers' float32 greedy continuation (ignoring EOS) of each request, at
    most num_tokens tokens and never more than the request asks for."""
    import torch

    from pagellm.bench.backends import hf_model

    model = hf_model(model_path, torch.float32)
    references = []
    with torch.inference_mode():
        for request in requests:
            new = min(num_tokens, request.output_len)
            if new <= 0:
                references.append([])
                continue
            ids = torch.tensor([request.prompt_token_ids], dtype=torch.long)
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False,
            )  # fmt: skip
            references.append(out[0, ids.shape[1] :].tolist())
    return references


def check_agreement(
    model_path: Path,
    requests: Sequence[BenchRequest],
    output_token_ids: Sequence[Sequence[int]],
    num_requests: int = DEFAULT_CHECK_REQUESTS,
    num_tokens: int = DEFAULT_CHECK_TOKENS,
) -> dict[str, Any] | None:
    """The agreement record of the first `num_requests` requests (None when switched off
    with 0); {"reference": ..., "error": ...} when the reference cannot be computed."""
    if num_requests <= 0 or num_tokens <= 0:
        return None
    sample = list(requests[:num_requests])
    if len(output_token_ids) < len(sample):
        raise ValueError(f"the backend returned the tokens of {len(output_token_ids)} requests, not {len(sample)}")
    try:
        references = hf_reference_tokens(model_path, sample, num_tokens)
    except (ImportError, OSError, ValueError) as e:
        logger.warning("no reference for the agreement check (%s): the result is unchecked", e)
        return {"reference": REFERENCE, "error": str(e).splitlines()[0] if str(e) else type(e).__name__}
    return leading_agreement(output_token_ids[: len(sample)], references, num_tokens)


def describe_agreement(agreement: dict[str, Any] | None) -> str:
    """The table cell: `1.00 (16 leading tokens x 4 requests vs hf float32 greedy)`."""
    if agreement is None:
        return "not checked"
    if agreement.get("fraction") is None:
        return f"not checked ({agreement.get('error', 'nothing to compare')})"
    return (
        f"{agreement['fraction']:.2f} ({agreement['num_tokens']} leading tokens x "
        f"{agreement['num_requests']} requests vs {agreement['reference']})"
    )
