"""Entrypoints stage: HTTP: request fields -> SamplingParams, under vLLM's parameter names.

Every field is passed through by name, so SamplingParams stays the one place that checks
value ranges. A field the engine's SamplingParams does not have (yet) is refused with a
400 naming it, unless its value is the neutral one that changes nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import SamplingFields
from pagellm.errors import InvalidRequestError
from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs_params import StructuredOutputsParams

# Values that ask for nothing: harmless to drop where SamplingParams lacks the field.
_NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": [],
    "stop_token_ids": [],
    "logit_bias": {},
    "include_stop_str_in_output": False,
    "ignore_eos": False,
    "min_tokens": 0,
    "skip_special_tokens": True,
    "n": 1,
}


def _supported_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(SamplingParams)}


def common_sampling_fields(request: SamplingFields) -> dict[str, Any]:
    """The sampling fields both endpoints share. SamplingParams takes a single stop string
    and logit_bias keys as strings; the engine checks token ids against the vocabulary
    when the request is added (SamplingParams.check_against_model)."""
    return {
        "n": request.n,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "seed": request.seed,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "ignore_eos": request.ignore_eos,
        "min_tokens": request.min_tokens,
        "logit_bias": request.logit_bias,
        "skip_special_tokens": request.skip_special_tokens,
    }


def structured_outputs(request: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The request's output constraint and the field it came from ("" when none)."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema.", param="response_format")
        given.append(("response_format", {"json": _schema(fmt.json_schema.schema_)}))
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if fields.get("json_object") is False:
            del fields["json_object"]
        given.append(("structured_outputs", fields))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            given.append((name, {key: value}))
    if not given:
        return None, ""
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"Give one output constraint, not several ({names}).", param=given[1][0])
    field, kwargs = given[0]
    try:
        return StructuredOutputsParams(**kwargs), field
    except InvalidRequestError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None


def _schema(schema: dict[str, Any] | bool) -> dict[str, Any]:
    # A boolean schema: true is any JSON value, false nothing (refused when compiled).
    return schema if isinstance(schema, dict) else ({} if schema else {"not": {}})


def make_sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams from vLLM-named fields; None means "the default"."""
    supported = _supported_fields()
    kwargs: dict[str, Any] = {}
    for name, value in fields.items():
        if value is None:
            continue
        if name in supported:
            kwargs[name] = value
        elif name in _NEUTRAL and value == _NEUTRAL[name]:
            continue
        else:
            raise APIError(400, f"'{name}' is not supported by this server yet.", param=name)
    return SamplingParams(**kwargs)
