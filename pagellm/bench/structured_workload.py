"""Bench stage: the structured-output workload of `pagellm bench throughput --structured-output json-schema`.

Every request of the synthetic list asks for JSON that follows one of a few schemas
(bounded, so every output ends by itself). The constrained run produces each request's
own length; the same requests are then run unconstrained to exactly those lengths
(ignore_eos), so both runs do the same model work and their ratio is the cost of the
constraints (compile, masks). The time from arrival to first token is also measured for
a schema never seen before against one already compiled.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from pagellm.workload.synthetic import BenchRequest

STRUCTURED_CHOICES = ("none", "json-schema")

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 32},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 10}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            }
        },
        "properties": {
            "status": {"enum": ["new", "paid", "shipped", "returned"]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 4},
            "total": {"type": "number", "minimum": 0, "maximum": 100000},
        },
        "required": ["status", "items", "total"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "temperature": {"type": "number", "minimum": -90, "maximum": 60},
            "conditions": {"type": "array", "items": {"enum": ["sun", "rain", "snow", "wind", "fog"]}, "maxItems": 3},
        },
        "required": ["city", "temperature", "conditions"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 5},
            "draft": {"type": "boolean"},
        },
        "required": ["title", "tags", "draft"],
        "additionalProperties": False,
    },
]


def schema_for(index: int) -> dict[str, Any]:
    return SCHEMAS[index % len(SCHEMAS)]


def run_structured_pagellm(
    requests: list[BenchRequest], model: str | None, dtype: str, engine_args: dict[str, Any], repeats: int = 1
) -> dict[str, Any]:
    """Constrained run, its unconstrained twin at the same lengths, compile and TTFT figures."""
    from pagellm import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model, dtype=dtype, disable_log_stats=True, **engine_args)
    prompts = [r.prompt_token_ids for r in requests]

    def constrained(i: int, r: BenchRequest) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=r.output_len, structured_outputs=StructuredOutputsParams(json=schema_for(i))
        )

    start = time.perf_counter()
    llm.engine.grammars.ll_tokenizer()  # built in the background since the engine started
    tokenizer_wait_ms = round((time.perf_counter() - start) * 1e3, 3)
    compile_ms = []
    for schema in SCHEMAS:  # compile once, timed, before anything runs
        start = time.perf_counter()
        llm.engine.grammars.compile(StructuredOutputsParams(json=schema))
        compile_ms.append(round((time.perf_counter() - start) * 1e3, 3))
    warm = min(4, len(requests))
    llm.generate(prompts[:warm], [constrained(i, r) for i, r in enumerate(requests[:warm])], use_tqdm=False)

    def timed(params: list[SamplingParams]) -> tuple[float, list[Any]]:
        runs, outputs = [], []
        for _ in range(repeats):
            llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            runs.append(time.perf_counter() - start)
        return sorted(runs)[(len(runs) - 1) // 2], outputs

    masks_before = llm.engine.runner.mask_timer.total_seconds  # the warm-up's do not count
    constrained_s, outputs = timed([constrained(i, r) for i, r in enumerate(requests)])
    mask_s = (llm.engine.runner.mask_timer.total_seconds - masks_before) / repeats
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    valid = sum(_is_valid_json(o.outputs[0].text, schema_for(i)) for i, o in enumerate(outputs))
    twins = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    unconstrained_s, twin_outputs = timed(twins)
    assert [len(o.outputs[0].token_ids) for o in twin_outputs] == lengths
    tokens = sum(lengths)
    return {
        "constrained_s": round(constrained_s, 4),
        "unconstrained_s": round(unconstrained_s, 4),
        "output_tokens": tokens,
        "constrained_output_tok_s": round(tokens / constrained_s, 2),
        "unconstrained_output_tok_s": round(tokens / unconstrained_s, 2),
        "ratio": round(unconstrained_s / constrained_s, 3),
        "mask_s": round(mask_s, 4),
        "mask_share": round(mask_s / constrained_s, 4),
        "valid_outputs": valid,
        "num_requests": len(requests),
        "ended_by_schema": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
        "schema_compile_ms": compile_ms,
        "grammar_tokenizer_wait_ms": tokenizer_wait_ms,
        **first_token_latency(llm, prompts[0]),
    }


def first_token_latency(llm: Any, prompt: list[int], repeats: int = 5) -> dict[str, Any]:
    """Arrival to first token for one request alone: with a schema never seen (its
    compile in the way) and with the same schema again (cached)."""
    from pagellm import SamplingParams, StructuredOutputsParams

    fresh, cached = [], []
    for attempt in range(repeats):
        schema = copy.deepcopy(SCHEMAS[1])
        schema["properties"][f"note_{attempt}_{time.monotonic_ns()}"] = {"type": "string", "maxLength": 8}
        params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
        for bucket in (fresh, cached):
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            bucket.append((time.perf_counter() - start) * 1e3)
    return {
        "ttft_new_schema_ms": round(sorted(fresh)[len(fresh) // 2], 2),
        "ttft_cached_schema_ms": round(sorted(cached)[len(cached) // 2], 2),
    }


def _is_valid_json(text: str, schema: dict[str, Any]) -> bool:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True
