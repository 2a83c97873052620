"""Entrypoints stage: HTTP: Ollama's API, so that Ollama's clients and the tools built on it
work against pagellm unchanged.

/api/chat and /api/generate are chat completions underneath (ChatServing prepares them: the
model's chat template, tools, output constraints); /api/generate with `raw` is a plain
completion of the prompt, and its `context` (the token ids an earlier answer returned)
continues that text. Both stream by default, as Ollama does: one JSON object per line
(NDJSON), the last with `done: true`, `done_reason` and Ollama's counts and durations in
nanoseconds (prompt_eval_* count the prompt tokens computed, not those the prefix cache
served). /api/embed pools; /api/tags, /api/ps and /api/show describe the served model (and
LoRA adapters), /api/version the server. A model is named as served, with or without
Ollama's ":latest" tag. Errors are Ollama's `{"error": "..."}` with the HTTP status.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pagellm.engine.async_requests import NewRequest, OutputStream
from pagellm.engine.input_processor import TokenizedPrompt
from pagellm.entrypoints.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
    OllamaShowRequest,
)
from pagellm.entrypoints.openai.errors import APIError, to_api_error
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.entrypoints.openai.sampling import common_sampling_fields, make_sampling_params, structured_outputs
from pagellm.entrypoints.openai.serving_chat import ChatServing, PreparedChat
from pagellm.entrypoints.openai.serving_common import ServingContext, collect_finals, new_request_id
from pagellm.entrypoints.openai.streaming import EventStreamResponse, cancel_on_disconnect
from pagellm.lora.request import LoRARequest
from pagellm.model.costs import ModelCosts
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.version import package_version

LATEST = ":latest"
NDJSON = "application/x-ndjson"


class NDJSONResponse(EventStreamResponse):
    """Ollama's stream: a JSON object per line; stops its generator when the client leaves."""

    media_type = NDJSON


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(start: float | None, end: float | None) -> int:
    return 0 if start is None or end is None else max(0, int((end - start) * 1e9))


def _counts(output: RequestOutput) -> dict[str, Any]:
    """Ollama's counts and durations (ns) of a finished request."""
    metrics = output.metrics
    generated = sum(len(c.token_ids) for c in output.outputs)
    if metrics is None:  # aborted before the engine saw it finish
        return {"prompt_eval_count": len(output.prompt_token_ids) - output.num_cached_tokens, "eval_count": generated}
    return {
        "total_duration": _ns(metrics.arrival_time, metrics.finished_time),
        "load_duration": 0,  # the model is loaded for the server's life
        "prompt_eval_count": metrics.num_prompt_tokens - metrics.num_cached_tokens,
        "prompt_eval_duration": _ns(metrics.first_scheduled_time, metrics.first_token_time),
        "eval_count": metrics.num_generation_tokens,
        "eval_duration": _ns(metrics.first_token_time, metrics.finished_time),
    }


def _done_reason(finish_reason: str | None) -> str:
    return {"length": "length", "abort": "stop"}.get(finish_reason or "stop", "stop")


def _sampling_fields(options: OllamaOptions, response_format: Any, model: str) -> dict[str, Any]:
    """Chat / completion request fields (vLLM's names) from Ollama's options and format."""
    fields: dict[str, Any] = {
        "model": model, "temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k,
        "min_p": options.min_p, "seed": options.seed, "stop": options.stop or None,
        "repetition_penalty": options.repeat_penalty, "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "max_tokens": options.num_predict if options.num_predict > 0 else None,
    }  # fmt: skip
    if response_format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(response_format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": response_format}}
    return {key: value for key, value in fields.items() if value is not None}


def _chat_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as chat messages: a call gets an id, and the tool result that
    follows it answers the latest call of that function."""
    converted: list[dict[str, Any]] = []
    call_ids: dict[str, str] = {}
    for index, message in enumerate(messages):
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            calls = []
            for number, call in enumerate(message.tool_calls):
                call_id = f"call_{index}_{number}"
                call_ids[call.function.name] = call_id
                arguments = json.dumps(call.function.arguments, ensure_ascii=False)
                calls.append({"id": call_id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}})
            turn = {"role": "assistant", "content": message.content or None, "tool_calls": calls}
        elif message.role == "tool":
            turn["tool_call_id"] = call_ids.get(message.tool_name or "", f"call_{index}")
        converted.append(turn)
    return converted


class OllamaServing:
    def __init__(self, context: ServingContext, chat: ChatServing) -> None:
        self.context = context
        self.chat = chat
        self.started = datetime.now(timezone.utc)

    # ------------------------------------------------------------------ models

    def resolve(self, name: str) -> tuple[str, LoRARequest | None]:
        """The served name (or adapter) an Ollama model name means: as served, with or
        without ':latest'; 404 in Ollama's words otherwise."""
        for candidate in (name, name.removesuffix(LATEST)):
            try:
                return candidate, self.context.check_model(candidate)
            except APIError:
                continue
        raise APIError(404, f"model '{name}' not found", param="model")

    def _names(self) -> list[str]:
        adapters = self.context.adapters.names() if self.context.adapters is not None else []
        return [self.context.served_model_name, *adapters]

    def _details(self) -> dict[str, Any]:
        engine = self.context.async_llm.engine
        config = engine.model_config
        formats = dict(engine.executor_report.weight_formats)
        largest = max(formats, key=formats.get) if formats else str(engine.config.dtype)
        quantization = largest.removesuffix(" as stored").upper().replace("BFLOAT16", "BF16").replace("FLOAT32", "F32")
        family = _family(config.architecture)
        return {
            "parent_model": "", "format": engine.config.source.format, "family": family,
            "families": [family], "parameter_size": _parameter_size(engine), "quantization_level": quantization,
        }  # fmt: skip

    def _entry(self, name: str) -> dict[str, Any]:
        weights = dict(self.context.async_llm.engine.executor_report.memory).get("weights", 0)
        digest = hashlib.sha256(name.encode()).hexdigest()
        return {
            "name": name + LATEST if ":" not in name else name, "model": name + LATEST if ":" not in name else name,
            "modified_at": self.started.isoformat(), "size": weights, "digest": digest, "details": self._details(),
        }  # fmt: skip

    def tags(self) -> Response:
        return JSONResponse({"models": [self._entry(name) for name in self._names()]})

    def ps(self) -> Response:
        """What is loaded: everything served, for the server's life (no expiry)."""
        models = []
        for name in self._names():
            entry = self._entry(name)
            entry.update(expires_at="0001-01-01T00:00:00Z", size_vram=0, context_length=self.context.max_model_len)
            models.append(entry)
        return JSONResponse({"models": models})

    def show(self, body: OllamaShowRequest) -> Response:
        name, _ = self.resolve(body.model)
        engine = self.context.async_llm.engine
        config = engine.model_config
        architecture = _family(config.architecture)
        info = {
            "general.architecture": architecture, "general.parameter_count": _parameter_count(engine),
            f"{architecture}.context_length": self.context.max_model_len,
            f"{architecture}.embedding_length": config.hidden_size, f"{architecture}.block_count": config.num_hidden_layers,
            f"{architecture}.attention.head_count": config.num_attention_heads,
            f"{architecture}.attention.head_count_kv": config.num_key_value_heads,
        }  # fmt: skip
        capabilities = ["completion"] if config.has_lm_head else []
        capabilities.append("embedding")
        if self.context.tokenizer.chat_template and "tools" in self.context.tokenizer.chat_template:
            capabilities.append("tools")
        return JSONResponse({
            "modelfile": f"FROM {name}\n", "parameters": "", "template": self.context.tokenizer.chat_template or "",
            "details": self._details(), "model_info": info, "capabilities": capabilities,
            "modified_at": self.started.isoformat(),
        })  # fmt: skip

    @staticmethod
    def version() -> Response:
        return JSONResponse({"version": package_version()})

    # -------------------------------------------------------------------- chat

    def _chat_request(self, body: OllamaChatRequest | OllamaGenerateRequest, messages: list[dict[str, Any]], name: str) -> ChatCompletionRequest:
        fields = _sampling_fields(body.options, body.format, name)
        fields["messages"] = messages
        tools = getattr(body, "tools", None)
        if tools:
            fields["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
        if body.think and self.context.reasoning is None:
            raise APIError(400, f"model '{body.model}' does not support thinking (start the server with --reasoning-parser)", param="think")
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise APIError(400, f"invalid request: {where}: {first['msg']}", param=where) from None

    async def chat_completion(self, body: OllamaChatRequest, raw: Request) -> Response:
        arrival_time = time.time()
        name, _ = self.resolve(body.model)
        if not body.messages:  # Ollama's way to load a model: nothing to answer
            return self._loaded(body, {"message": {"role": "assistant", "content": ""}})
        request = self._chat_request(body, _chat_messages(body.messages), name)
        request_id = new_request_id("ollama")
        prepared = await self.chat.prepare(request, request_id)
        stream = await self.context.add_requests([prepared.new_request(request_id, 0, arrival_time)], prepared.constraint_field)
        return await self._answer(body, raw, stream, request_id, lambda output, delta: self._chat_fields(prepared, output, delta))

    def _chat_fields(self, prepared: PreparedChat, output: RequestOutput, delta: bool) -> dict[str, Any]:
        completion = output.outputs[0]
        if delta:  # a stream's piece: text only (calls and thinking come whole at the end)
            text = completion.delta_text if prepared.job.tools.kind == "none" and prepared.job.reasoning is None else ""
            return {"message": {"role": "assistant", "content": text}}
        reasoning, content, calls = self.chat.content_and_calls(prepared.job, completion)
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if reasoning:
            message["thinking"] = reasoning
        if calls:
            message["tool_calls"] = [
                {"function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}} for call in calls
            ]
        return {"message": message}

    # ---------------------------------------------------------------- generate

    async def generate(self, body: OllamaGenerateRequest, raw: Request) -> Response:
        arrival_time = time.time()
        name, adapter = self.resolve(body.model)
        request_id = new_request_id("ollama")
        if not body.prompt and not body.context:  # Ollama's way to load a model: nothing to generate
            return self._loaded(body, {"response": ""})
        if body.raw:
            stream, new_text = await self._generate_raw(body, name, adapter, request_id, arrival_time)
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                {"role": "user", "content": body.prompt}
            ]
            request = self._chat_request(body, messages, name)
            prepared = await self.chat.prepare(request, request_id)
            if body.context:  # an earlier answer's token ids, continued by this turn
                self.context.check_token_ids(body.context, "context")
                prepared = _prefixed(prepared, body.context)
            stream = await self.context.add_requests([prepared.new_request(request_id, 0, arrival_time)], prepared.constraint_field)

            def new_text(output: RequestOutput, delta: bool) -> str:
                completion = output.outputs[0]
                if delta:
                    return completion.delta_text if prepared.job.reasoning is None else ""
                return self.chat.content_and_calls(prepared.job, completion)[1] or ""

        def fields(output: RequestOutput, delta: bool) -> dict[str, Any]:
            answer: dict[str, Any] = {"response": new_text(output, delta)}
            if not delta:
                answer["context"] = [*output.prompt_token_ids, *output.outputs[0].token_ids]
            return answer

        return await self._answer(body, raw, stream, request_id, fields)

    async def _generate_raw(
        self, body: OllamaGenerateRequest, name: str, adapter: LoRARequest | None, request_id: str, arrival_time: float
    ) -> tuple[OutputStream, Any]:
        fields = _sampling_fields(body.options, body.format, name)
        fields["prompt"] = body.prompt or " "
        try:
            request = CompletionRequest.model_validate(fields)
        except ValidationError as e:
            raise APIError(400, f"invalid request: {e.errors()[0]['msg']}", param="options") from None
        sampling = common_sampling_fields(request)
        sampling["structured_outputs"], constraint_field = structured_outputs(request)
        sampling["max_tokens"] = fields.get("max_tokens")  # None: up to the context
        params = make_sampling_params(sampling)
        ids = await self.context.async_llm.tokenize(body.prompt, add_special_tokens=not body.context) if body.prompt else []
        if body.context:
            self.context.check_token_ids(body.context, "context")
        prompt = TokenizedPrompt(body.prompt, [*(body.context or []), *ids])
        stream = await self.context.add_requests(
            [NewRequest(request_id, prompt, params, 0, arrival_time, lora_request=adapter)], constraint_field
        )

        def new_text(output: RequestOutput, delta: bool) -> str:
            completion = output.outputs[0]
            return completion.delta_text if delta else completion.text

        return stream, new_text

    def _loaded(self, body: OllamaChatRequest | OllamaGenerateRequest, fields: dict[str, Any]) -> Response:
        answer = {"model": body.model, "created_at": _now(), **fields, "done": True, "done_reason": "load"}
        if body.stream:
            return StreamingResponse(iter([json.dumps(answer) + "\n"]), media_type=NDJSON)
        return JSONResponse(answer)

    # ------------------------------------------------------------------ embed

    async def embed(self, body: OllamaEmbedRequest, raw: Request) -> Response:
        arrival_time = time.time()
        name, adapter = self.resolve(body.model)
        inputs = [body.input] if isinstance(body.input, str) else body.input
        if not inputs:
            return JSONResponse({"model": body.model, "embeddings": []})
        try:
            params = PoolingParams(normalize=True, dimensions=body.dimensions)
        except ValueError as e:
            raise APIError(400, str(e), param="dimensions") from None
        request_id = new_request_id("ollama-embed")
        engine_ids = [f"{request_id}-{i}" for i in range(len(inputs))]
        stream = await self.context.add_requests(
            [NewRequest(rid, text, params, 0, arrival_time, lora_request=adapter) for rid, text in zip(engine_ids, inputs)], ""
        )
        finals = await cancel_on_disconnect(raw, collect_finals(stream))
        outputs = [finals[rid] for rid in engine_ids]
        if any(output.embedding is None for output in outputs):
            raise APIError(503, "the request was aborted before its embeddings were computed")
        return JSONResponse({
            "model": body.model, "embeddings": [output.embedding for output in outputs],
            "total_duration": _ns(arrival_time, time.time()), "load_duration": 0,
            "prompt_eval_count": sum(len(output.prompt_token_ids) for output in outputs),
        })  # fmt: skip

    # ------------------------------------------------------------- answering

    async def _answer(
        self, body: OllamaChatRequest | OllamaGenerateRequest, raw: Request, stream: OutputStream, request_id: str, fields: Any
    ) -> Response:
        """The whole answer, or Ollama's stream of pieces ending with the done object."""
        if not body.stream:
            finals = await cancel_on_disconnect(raw, collect_finals(stream))
            return JSONResponse(self._done(body, finals[request_id], fields))
        return NDJSONResponse(self._pieces(body, stream, fields), on_close=stream.cancel)

    def _done(self, body: OllamaChatRequest | OllamaGenerateRequest, output: RequestOutput, fields: Any) -> dict[str, Any]:
        return {
            "model": body.model, "created_at": _now(), **fields(output, False), "done": True,
            "done_reason": _done_reason(output.outputs[0].finish_reason), **_counts(output),
        }  # fmt: skip

    async def _pieces(self, body: OllamaChatRequest | OllamaGenerateRequest, stream: OutputStream, fields: Any) -> AsyncIterator[str]:
        """Text as it comes, then the done object: with only what did not stream (text held
        back to be parsed for calls or thinking comes whole there)."""
        streamed = False
        try:
            async for output in stream:
                piece = fields(output, True)
                if piece.get("response") or piece.get("message", {}).get("content"):
                    streamed = True
                    yield json.dumps({"model": body.model, "created_at": _now(), **piece, "done": False}, ensure_ascii=False) + "\n"
                if output.finished:
                    last = self._done(body, output, fields)
                    if streamed and "message" in last:
                        last["message"]["content"] = ""
                    elif streamed:
                        last["response"] = ""
                    yield json.dumps(last, ensure_ascii=False) + "\n"
        except Exception as error:  # noqa: BLE001 - the status is sent: report in the stream
            yield json.dumps({"error": to_api_error(error).message}) + "\n"
        finally:
            stream.cancel()


def _prefixed(prepared: PreparedChat, context: list[int]) -> PreparedChat:
    return dataclasses.replace(prepared, prompt_ids=[*context, *prepared.prompt_ids])


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _family(architecture: str) -> str:
    """Ollama's family name: GGUF's architecture ("llama", "qwen2"), or an HF class's
    ("LlamaForCausalLM" -> "llama")."""
    for suffix in ("ForCausalLM", "ForConditionalGeneration", "ForSequenceClassification", "Model"):
        if architecture.endswith(suffix) and architecture != suffix:
            return architecture.removesuffix(suffix).lower()
    return architecture


def _parameter_count(engine: Any) -> int:
    config = engine.model_config
    costs = ModelCosts.from_config(config, dtype_bytes=2)
    embedding = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return int(costs.linear_flops_per_token / 2 + embedding)


def _parameter_size(engine: Any) -> str:
    count = _parameter_count(engine)
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(count)
