"""Entrypoints stage: HTTP: what /openapi.json says: error statuses, response media types, and
the bounds this server adds to the request models.

Every route documents the statuses the server can answer with, each with the
OpenAI-shaped error body. FastAPI would document 422 with its own validation body; the
server answers invalid bodies with a 400 in OpenAI's shape instead (errors.py), so the
schema says that. The request models (protocol.py) carry the ranges every server shares;
what depends on the served model and on the server's flags (token ids below the
vocabulary size, max_tokens within max_model_len, the request limits) is written into
the schema at start, so that a client or a fuzzer generating from it knows them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi

from pagellm.entrypoints.openai.limits_config import MAX_N, RequestLimits
from pagellm.entrypoints.anthropic.protocol import AnthropicError, CountTokensResponse, MessageResponse
from pagellm.entrypoints.openai.protocol_batch import BatchObject, FileObject
from pagellm.entrypoints.openai.protocol_responses import ResponseObject
from pagellm.entrypoints.openai.protocol_score import RerankResponse, ScoreResponse
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionResponse,
    MAX_LOGPROBS,
    CompletionResponse,
    EmbeddingResponse,
    ErrorResponse,
)
from pagellm.entrypoints.ollama.protocol import OllamaError


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


def _generated(model: type, description: str) -> dict[Any, Any]:
    # A JSON body, or with "stream": true a text/event-stream whose events' data are JSON
    # chunks and, last, "[DONE]" (OpenAPI before 3.2 describes each event with `schema`).
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string"}},
        "description": "data: one JSON chunk, an {\"error\": ...} object, or [DONE] last.",
    }
    return {200: {"model": model, "description": description, "content": {"text/event-stream": {"schema": event}}}}


AUTH = {401: _error("Missing or wrong API key (when the server has one).")}
ENGINE = {
    500: _error("The engine step computing the request failed (internal_error)."),
    503: _error("Too many requests waiting (overloaded), or the engine has stopped (engine_dead)."),
}
BODY = {
    400: _error("An invalid body or field; `param` names it."),
    413: _error("The request body is larger than --max-request-body-bytes."),
}
UNKNOWN_MODEL = {404: _error("The body names a model this server does not serve.")}
GENERATION = {**BODY, **AUTH, **UNKNOWN_MODEL, **ENGINE}
COMPLETION = {**_generated(CompletionResponse, "The completions (JSON, or a stream of them)."), **GENERATION}
CHAT = {**_generated(ChatCompletionResponse, "The chat completion (JSON), or a stream of chunks."), **GENERATION}
EMBEDDING = {200: {"model": EmbeddingResponse, "description": "One embedding per input, in input order."}, **GENERATION}
SCORE = {200: {"model": ScoreResponse, "description": "One score per pair, in pair order."}, **GENERATION}
RERANK = {200: {"model": RerankResponse, "description": "The documents, most relevant first."}, **GENERATION}
RESPONSES = {
    **_generated(ResponseObject, "The response (JSON), or with stream its events; background: queued at once."),
    **GENERATION,
    404: _error("The body names a model this server does not serve, or a previous_response_id it does not hold."),
}
RESPONSE_BY_ID = {
    200: {"model": ResponseObject, "description": "The stored response (deleted: the deletion)."},
    **AUTH,
    400: _error("Cancel of a response that is not a background one."),
    404: _error("No stored response has this id (never stored, deleted, or evicted)."),
}
def _anthropic_error(description: str) -> dict[str, Any]:
    return {"model": AnthropicError, "description": description}


_ANTHROPIC_ERRORS = {
    400: _anthropic_error("An invalid body or field (invalid_request_error)."),
    401: _anthropic_error("Missing or wrong API key: Authorization: Bearer, or x-api-key (authentication_error)."),
    404: _anthropic_error("The body names a model this server does not serve (not_found_error)."),
    413: _anthropic_error("The request body is larger than --max-request-body-bytes (request_too_large)."),
}
MESSAGES = {
    200: {"model": MessageResponse, "description": "The message (JSON), or with stream Anthropic's events.",
          "content": {"text/event-stream": {"schema": {
              "type": "object", "required": ["event", "data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
              "description": "event: the event's type; data: its JSON object.",
          }}}},
    **_ANTHROPIC_ERRORS,
    500: _anthropic_error("The engine step computing the request failed (api_error)."),
    529: _anthropic_error("Too many requests waiting, or the engine has stopped (overloaded_error)."),
}  # fmt: skip
COUNT_TOKENS = {200: {"model": CountTokensResponse, "description": "The prompt's tokens."}, **_ANTHROPIC_ERRORS}
_BATCH_OFF = {503: _error("The Files and Batch API are off (--batch-dir none, or the directory is another server's).")}
FILE_UPLOAD = {
    200: {"model": FileObject, "description": "The stored file."},
    400: _error("A purpose this server does not know, or a batch file that is not UTF-8; `param` names it."),
    413: _error("The file is larger than --max-batch-file-bytes."),
    **AUTH,
    **_BATCH_OFF,
}
FILES = {
    400: _error("A bad list parameter (limit, after)."),
    404: _error("No file has this id."),
    409: _error("Deleting the input of a batch that is still running."),
    **AUTH,
    **_BATCH_OFF,
}
FILE_CONTENT = {200: {"description": "The file's bytes.", "content": {"application/octet-stream": {}}}, **FILES}
BATCH = {
    400: _error("A bad list parameter (limit, after)."),
    404: _error("No batch has this id."),
    409: _error("Cancelling a batch that has already ended."),
    **AUTH,
    **_BATCH_OFF,
}
BATCH_CREATE = {
    200: {"model": BatchObject, "description": "The batch, validating: its lines run in the background."},
    400: _error("An invalid body, or an input file whose purpose is not batch; `param` names it."),
    404: _error("No file has the input_file_id."),
    **AUTH,
    **_BATCH_OFF,
}
TOKENS = {**BODY, **AUTH, **UNKNOWN_MODEL}
INPUT_TOKENS = {200: {"description": "The prompt's tokens: {object, input_tokens}."}, **BODY, **AUTH, **UNKNOWN_MODEL}
READ = {**AUTH}
def _ollama_error(description: str) -> dict[str, Any]:
    return {"model": OllamaError, "description": description}


OLLAMA_READ = {401: _ollama_error("Missing or wrong API key (when the server has one).")}
SLEEP = {**AUTH, 400: _error("A level other than 1 or 2, or sleep under tensor parallelism (`param`: level).")}
OLLAMA = {
    400: _ollama_error("An invalid body or field."), 413: _ollama_error("The body is larger than --max-request-body-bytes."),
    **OLLAMA_READ, 404: _ollama_error("No served model or adapter of that name."),
    500: _ollama_error("The engine step computing the request failed."),
    503: _ollama_error("Too many requests waiting, or the engine has stopped."),
}  # fmt: skip
OLLAMA_GENERATED = {
    200: {"description": "The answer (JSON), or with stream (the default) one JSON object per line, the last with done.",
          "content": {"application/json": {}, "application/x-ndjson": {"schema": {"type": "string"}}}},
    **OLLAMA,
}  # fmt: skip
MODEL_BY_ID = {**AUTH, 404: _error("No served model or loaded adapter has this name.")}
LORA_ADAPTER = {
    200: {"description": "The adapter loaded (or unloaded)."},
    **BODY,
    **AUTH,
    404: _error("unload: no adapter of that name is loaded."),
}
HEALTH = {503: _error("The engine has stopped (engine_dead), or has completed no step for --health-stall-seconds while requests are in flight (engine_stalled).")}
METRICS = {200: {"description": "Prometheus text format."}}


@dataclass(frozen=True)
class ServerBounds:
    """What the served model and the server's flags allow, for the published schema."""

    vocab_size: int
    max_model_len: int
    limits: RequestLimits
    max_logprobs: int = MAX_LOGPROBS  # the engine's --max-logprobs
    max_num_seqs: int = MAX_N  # completions of one request run side by side
    api_key: bool = False
    # The embeddings' `dimensions` this model takes (its size, and its Matryoshka sizes).
    embedding_dimensions: tuple[int, ...] = ()
    # Whether "" becomes any token (a tokenizer that adds BOS): if not, text is minLength 1.
    empty_text_has_tokens: bool = True
    thinking: bool = False  # --reasoning-parser: Ollama's `think` can be honoured
    max_sleep_level: int = 2  # 1 with LoRA adapters (level 2 would drop the weights they are on)


def install_openapi(app: FastAPI, bounds: ServerBounds) -> None:
    """Generate the schema once: without FastAPI's 422 entries, with the server's bounds."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            _add_bounds(schemas, bounds)
            _add_form_rules(schemas)
            for parameter in schema.get("paths", {}).get("/sleep", {}).get("post", {}).get("parameters", []):
                if parameter.get("name") == "level":
                    parameter["schema"]["maximum"] = bounds.max_sleep_level
            if bounds.api_key:
                _add_bearer_auth(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]



def add_route_per_method(target: FastAPI | APIRouter, path: str, endpoint: Callable[..., Any], methods: list[str], **options: Any) -> None:
    """One route serving all of `methods` (so that a 405 on the path names them all in
    `Allow`), out of the schema, then a schema-only route per method, never reached: FastAPI
    gives every method of one route the same operation id, which generated clients cannot
    tell apart; this way each method is its own operation (`<name><path>_<method>`)."""
    target.add_api_route(path, endpoint, methods=methods, include_in_schema=False, **options)
    for method in methods:
        target.add_api_route(path, endpoint, methods=[method], **options)


# ------------------------------------------------------------------ bounds


def _variants(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The non-null forms a property may take (anyOf members, or itself)."""
    forms = prop.get("anyOf", [prop])
    return [form for form in forms if form.get("type") != "null"]


def _bound(prop: dict[str, Any], form_type: str, **keywords: Any) -> None:
    for form in _variants(prop):
        if form.get("type") == form_type:
            form.update(keywords)


def _add_ollama_bounds(schemas: dict[str, Any], bounds: ServerBounds) -> None:
    """Ollama's bodies: `context` ids below the vocabulary, num_predict within the context;
    `think` only where a reasoning parser can honour it."""
    _token_ids(schemas["OllamaGenerateRequest"]["properties"]["context"], bounds.vocab_size - 1)
    _bound(schemas["OllamaOptions"]["properties"]["num_predict"], "integer", maximum=bounds.max_model_len)
    if not bounds.thinking:
        for name in ("OllamaChatRequest", "OllamaGenerateRequest"):
            schemas[name]["properties"]["think"] = {"anyOf": [{"const": False}, {"type": "null"}], "title": "Think"}


def _add_form_rules(schemas: dict[str, Any]) -> None:
    """Rules across a form's fields: a file's expiry anchor needs its seconds."""
    for schema in schemas.values():
        if "expires_after[anchor]" in schema.get("properties", {}):
            schema["dependentRequired"] = {"expires_after[anchor]": ["expires_after[seconds]"]}


def _token_ids(prop: dict[str, Any], max_id: int) -> None:
    """An array of token ids (and arrays of them): every id at most max_id."""
    for form in _variants(prop):
        items = form.get("items", {})
        if items.get("type") == "array":
            items = items.get("items", {})
        if form.get("type") == "array" and items.get("type") == "integer":
            items["maximum"] = max_id


def _add_bounds(schemas: dict[str, Any], bounds: ServerBounds) -> None:
    limits = bounds.limits
    max_id = bounds.vocab_size - 1
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["n"]["maximum"] = min(limits.max_n, bounds.max_num_seqs)
        _bound(props["stop"], "string", maxLength=limits.max_stop_string_length)
        _bound(props["stop"], "array", maxItems=limits.max_stop_strings)
        for form in _variants(props["stop"]):
            form.get("items", {})["maxLength"] = limits.max_stop_string_length
        _token_ids(props["stop_token_ids"], max_id)
        _bound(props["stop_token_ids"], "array", maxItems=limits.max_stop_strings)
        _bound(
            props["logit_bias"], "object",
            maxProperties=limits.max_logit_bias_entries,
            propertyNames={"pattern": token_id_key_pattern(max_id)},
        )  # fmt: skip
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                _bound(props[field], "integer", maximum=bounds.max_model_len)
        for field in ("logprobs", "top_logprobs"):
            if field in props:
                _bound(props[field], "integer", maximum=min(MAX_LOGPROBS, bounds.max_logprobs))
    # A chat request's top_logprobs needs logprobs: true (two fields together).
    schemas["ChatCompletionRequest"]["if"] = {
        "required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}},
    }  # fmt: skip
    schemas["ChatCompletionRequest"]["then"] = {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
    # continue_final_message continues the last message; add_generation_prompt would open a new one.
    for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
        schemas[name]["not"] = {
            "required": ["add_generation_prompt", "continue_final_message"],
            "properties": {"add_generation_prompt": {"const": True}, "continue_final_message": {"const": True}},
        }
    completion = schemas["CompletionRequest"]["properties"]
    embedding = schemas["EmbeddingRequest"]["properties"]
    if not bounds.empty_text_has_tokens:  # "" would be a prompt (or input) of no tokens: refused
        for prop in (completion["prompt"], embedding["input"]):
            _bound(prop, "string", minLength=1)
            for form in _variants(prop):
                if form.get("type") == "array" and form.get("items", {}).get("type") == "string":
                    form["items"]["minLength"] = 1
    # A text prompt or input has the character limit of a message (request_limits.py).
    for prop in (completion["prompt"], embedding["input"]):
        _bound(prop, "string", maxLength=limits.max_message_chars)
        for form in _variants(prop):
            if form.get("type") == "array" and form.get("items", {}).get("type") == "string":
                form["items"]["maxLength"] = limits.max_message_chars
    _token_ids(completion["prompt"], max_id)
    for form in _variants(completion["prompt"]):
        if form.get("type") == "array":
            # One prompt of token ids fits in the context; a list of prompts, in the limit.
            one_prompt = form["items"].get("type") == "integer"
            form["maxItems"] = bounds.max_model_len if one_prompt else limits.max_prompts_per_request
    for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
        schemas[name]["properties"]["messages"]["maxItems"] = limits.max_messages
    _bound(schemas["ChatMessage"]["properties"]["content"], "string", maxLength=limits.max_message_chars)
    _token_ids(schemas["DetokenizeRequest"]["properties"]["tokens"], max_id)
    for name in ("MessagesRequest", "CountTokensRequest"):  # the Messages API's own limits (anthropic/serving.py)
        props = schemas[name]["properties"]
        props["messages"]["maxItems"] = limits.max_messages
        if "stop_sequences" in props:
            _bound(props["stop_sequences"], "array", maxItems=limits.max_stop_strings)
            for form in _variants(props["stop_sequences"]):
                form.get("items", {})["maxLength"] = limits.max_stop_string_length
        if "max_tokens" in props:
            _bound(props["max_tokens"], "integer", maximum=bounds.max_model_len)
    _bound(schemas["TextBlock"]["properties"]["text"], "string", maxLength=limits.max_message_chars)
    responses = schemas["ResponsesRequest"]["properties"]
    _bound(responses["input"], "array", maxItems=limits.max_messages)
    _bound(responses["input"], "string", maxLength=limits.max_message_chars)
    _bound(schemas["InputMessage"]["properties"]["content"], "string", maxLength=limits.max_message_chars)
    _bound(schemas["InputTextPart"]["properties"]["text"], "string", maxLength=limits.max_message_chars)
    for name, field in (("FunctionCallItem", "arguments"), ("FunctionCallOutputItem", "output")):
        _bound(schemas[name]["properties"][field], "string", maxLength=limits.max_message_chars)
    # Scores: at most max_prompts_per_request pairs (documents).
    score, rerank = schemas["ScoreRequest"]["properties"], schemas["RerankRequest"]["properties"]
    for prop in (score["text_1"], score["text_2"], rerank["documents"]):
        _bound(prop, "array", maxItems=limits.max_prompts_per_request)
    if bounds.embedding_dimensions:
        for prop in (embedding["dimensions"], schemas["OllamaEmbedRequest"]["properties"]["dimensions"]):
            _bound(prop, "integer", enum=list(bounds.embedding_dimensions))
    _add_ollama_bounds(schemas, bounds)
    _token_ids(embedding["input"], max_id)
    for form in _variants(embedding["input"]):
        if form.get("type") == "array":
            one_input = form["items"].get("type") == "integer"
            form["maxItems"] = bounds.max_model_len if one_input else limits.max_prompts_per_request


def token_id_key_pattern(max_id: int) -> str:
    """A regular expression matching the decimal numbers 0..max_id (no sign, no leading
    zero): the logit_bias keys this model has."""
    digits = str(max_id)
    shorter = ["0"] if len(digits) > 1 else []
    shorter += [f"[1-9][0-9]{{{n - 1}}}" if n > 1 else "[1-9]" for n in range(1, len(digits))]
    # Numbers with as many digits as max_id: equal to it up to position i, then smaller.
    same_length = []
    for i, digit in enumerate(digits):
        low = "1" if i == 0 else "0"
        if int(digit) > int(low):
            top = str(int(digit) - 1)
            rest = len(digits) - i - 1
            choice = low if low == top else f"[{low}-{top}]"
            same_length.append(digits[:i] + choice + (f"[0-9]{{{rest}}}" if rest else ""))
    same_length.append(digits)
    if len(digits) == 1:
        same_length = [f"[0-{digits}]"]
    return "^(" + "|".join(shorter + same_length) + ")$"


def _add_bearer_auth(schema: dict[str, Any]) -> None:
    from pagellm.entrypoints.openai.auth import OPEN_PATHS

    schema.setdefault("components", {})["securitySchemes"] = {
        "apiKey": {"type": "http", "scheme": "bearer", "description": "The server's --api-key."}
    }
    for path, operations in schema.get("paths", {}).items():
        if path not in OPEN_PATHS:
            for operation in operations.values():
                operation["security"] = [{"apiKey": []}]
