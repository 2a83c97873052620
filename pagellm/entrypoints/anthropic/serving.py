"""Entrypoints stage: HTTP: POST /v1/messages and /v1/messages/count_tokens.

A message is a chat completion underneath: `system` becomes the system turn; each message's
text blocks its content, an assistant's `tool_use` blocks its tool calls and a user's
`tool_result` blocks tool turns; tools, `tool_choice` (auto, any = required, tool = named,
none), `stop_sequences`, `max_tokens` and the sampling fields become the chat request's.
ChatServing prepares it and parses the output into text and tool calls, which become `text`
and `tool_use` content blocks. Streamed, it is Anthropic's event sequence: message_start,
per block content_block_start / content_block_delta / content_block_stop, message_delta
(stop_reason, usage) and message_stop; an error after the start is an `error` event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagellm.engine.async_requests import OutputStream
from pagellm.entrypoints.anthropic.errors import anthropic_error_body
from pagellm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    TextBlock,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from pagellm.entrypoints.openai.errors import APIError, to_api_error
from pagellm.entrypoints.openai.prompt_cache_diagnostics import PromptRecord, messages_diagnostics
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.serving_chat import ChatServing, PreparedChat
from pagellm.entrypoints.openai.serving_common import ServingContext, collect_finals, timings_of, with_timings
from pagellm.entrypoints.openai.streaming import EventStreamResponse, cancel_on_disconnect
from pagellm.entrypoints.openai.tool_calls import salvage_json_object
from pagellm.outputs import CompletionOutput, RequestOutput


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        messages.append({"role": "system", "content": _text(body.system)})
    for message in body.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts = [block.text for block in message.content if isinstance(block, TextBlock)]
        if message.role == "assistant":
            calls = [
                {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}
                for block in message.content
                if isinstance(block, ToolUseBlock)
            ]
            turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if calls:
                turn["tool_calls"] = calls
            elif turn["content"] is None:
                turn["content"] = ""  # only thinking blocks: an empty turn
            messages.append(turn)
            continue
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                result = _text(block.content)
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": f"Error: {result}" if block.is_error else result})
        if texts:
            messages.append({"role": "user", "content": "\n".join(texts)})
    return messages


def _structured_outputs(body: MessagesRequest) -> dict[str, Any] | None:
    """The output constraint: Anthropic's output_config.format (or its beta name,
    output_format), or vLLM's structured_outputs; one of them at most."""
    config = body.output_config
    formats = [f for f in (config.format if config else None, body.output_format) if f is not None]
    given = len(formats) + (body.structured_outputs is not None)
    if given > 1:
        raise APIError(
            400, "give one output constraint: output_config.format, output_format or structured_outputs.",
            param="output_config",
        )  # fmt: skip
    if formats:
        return {"json": formats[0].json_schema}
    return body.structured_outputs.model_dump(by_alias=True, exclude_none=True) if body.structured_outputs else None


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    final = body.messages[-1] if body.messages else None
    if final is not None and final.role == "assistant":
        # A prefill: the model continues the assistant's text ("The capital of France is"
        # is answered " Paris."), its answer holding only what it adds. An empty one
        # leaves the turn to the model, as an absent one does.
        content = final.content
        prefill = content if isinstance(content, str) else _text([b for b in content if isinstance(b, TextBlock)])
        if prefill != prefill.rstrip():
            raise APIError(400, "final assistant content cannot end with trailing whitespace", param="messages")
        fields["continue_final_message"] = bool(prefill)
        if not prefill and fields["messages"][-1] == {"role": "assistant", "content": ""}:
            fields["messages"].pop()
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens, stop=body.stop_sequences or None, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, user=body.metadata.user_id if body.metadata else None,
            structured_outputs=_structured_outputs(body), timings=body.timings,
        )  # fmt: skip
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if isinstance(choice, ToolChoiceTool):
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"messages: {first['msg']} (at {'.'.join(str(p) for p in first['loc'])})", param="messages") from None


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input_object(arguments: str) -> dict[str, Any]:
    """A call's input; of a call cut short by max_tokens, what its arguments say so far."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return salvage_json_object(arguments) or {}
    return value if isinstance(value, dict) else {}


def _stop(completion: CompletionOutput, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished completion: cut by max_tokens says so
    first, even inside a call (whose input then holds what it says so far)."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


class MessagesServing:
    def __init__(self, context: ServingContext, chat: ChatServing) -> None:
        self.context = context
        self.chat = chat

    def _check_limits(self, body: CountTokensRequest) -> None:
        """The server's request limits on this body (request_limits.py's, as Anthropic counts:
        messages as sent, a message's text blocks together, stop sequences)."""
        limits = self.context.limits
        if len(body.messages) > limits.max_messages:
            raise APIError(400, f"{len(body.messages)} messages; at most {limits.max_messages}.", param="messages")
        for index, message in enumerate(body.messages):
            blocks = [message.content] if isinstance(message.content, str) else [
                b.text for b in message.content if isinstance(b, TextBlock)
            ]  # fmt: skip
            length = sum(len(text) for text in blocks)
            if length > limits.max_message_chars:
                raise APIError(
                    400, f"messages[{index}] has {length} characters of content; at most {limits.max_message_chars}.",
                    param="messages",
                )  # fmt: skip
        stops = getattr(body, "stop_sequences", None) or []
        if len(stops) > limits.max_stop_strings or any(len(s) > limits.max_stop_string_length for s in stops):
            raise APIError(
                400, f"stop_sequences: at most {limits.max_stop_strings} of at most {limits.max_stop_string_length} "
                "characters each.", param="stop_sequences",
            )  # fmt: skip

    async def count_tokens(self, body: CountTokensRequest) -> Response:
        self._check_limits(body)
        prepared = await self.chat.prepare(chat_request(body), "count", check_limits=False)
        return JSONResponse(CountTokensResponse(input_tokens=len(prepared.prompt_ids)).model_dump())

    async def create(self, body: MessagesRequest, raw: Request) -> Response:
        arrival_time = time.time()
        message_id = f"msg_{uuid.uuid4().hex}"
        self._check_limits(body)
        prepared = await self.chat.prepare(chat_request(body), message_id, check_limits=False)
        stream = await self.context.add_requests(
            [prepared.new_request(message_id, 0, arrival_time)], prepared.constraint_field
        )
        if body.stream:
            return EventStreamResponse(self._events(body, message_id, prepared, stream), on_close=stream.cancel)
        finals = await cancel_on_disconnect(raw, collect_finals(stream))
        answer = self._message(message_id, prepared, finals[message_id]).model_dump(mode="json")
        if self.context.wants_timings(body):
            answer = with_timings(answer, [finals[message_id]])
        answer.update(self._diagnostics(body, message_id, prepared, finals[message_id]))
        return JSONResponse(answer)

    def _blocks(self, prepared: PreparedChat, completion: CompletionOutput) -> tuple[list[dict[str, Any]], str, str | None]:
        reasoning, content, calls = self.chat.content_and_calls(prepared.job, completion)
        blocks: list[dict[str, Any]] = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
        blocks += [{"type": "text", "text": content}] if content else []
        blocks += [
            {"type": "tool_use", "id": _tool_use_id(call.id), "name": call.function.name, "input": _input_object(call.function.arguments)}
            for call in calls
        ]
        return blocks, *_stop(completion, bool(calls))

    def _usage(self, output: RequestOutput) -> Usage:
        cached = output.num_cached_tokens
        return Usage(
            input_tokens=len(output.prompt_token_ids) - cached, output_tokens=len(output.outputs[0].token_ids),
            cache_read_input_tokens=cached,
        )  # fmt: skip

    def _message(self, message_id: str, prepared: PreparedChat, output: RequestOutput) -> MessageResponse:
        blocks, stop_reason, stop_sequence = self._blocks(prepared, output.outputs[0])
        return MessageResponse(
            id=message_id, model=self.context.model_name(prepared.adapter), content=blocks, stop_reason=stop_reason,
            stop_sequence=stop_sequence, usage=self._usage(output),
        )  # fmt: skip

    def _diagnostics(self, body: MessagesRequest, message_id: str, prepared: PreparedChat, output: RequestOutput) -> dict[str, Any]:
        """Remember this message's prompt; {"diagnostics": ...} against the message its
        `diagnostics.previous_message_id` names, when it names one."""
        service = self.context.diagnostics
        if service is None:
            return {}
        record = PromptRecord.of(
            self.context.model_name(prepared.adapter), output.prompt_token_ids,
            None if body.system is None else _text(body.system),
            [tool.model_dump(mode="json", exclude_none=True) for tool in body.tools or []],
            [message.model_dump(mode="json", exclude_none=True) for message in body.messages],
        )  # fmt: skip
        previous = body.diagnostics.previous_message_id if body.diagnostics else None
        diagnosis = service.record(message_id, record, output.num_cached_tokens, previous)
        return {"diagnostics": messages_diagnostics(diagnosis, previous)} if body.diagnostics is not None else {}

    async def _events(
        self, body: MessagesRequest, message_id: str, prepared: PreparedChat, stream: OutputStream
    ) -> AsyncIterator[str]:
        def event(kind: str, **fields: Any) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

        def start(output: RequestOutput) -> str:
            # Sent with the first output, when the prompt's cached tokens are known: the
            # usage splits them from the computed ones as the whole answer's does.
            usage = self._usage(output).model_dump()
            message = {
                "id": message_id, "type": "message", "role": "assistant", "model": self.context.model_name(prepared.adapter),
                "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0},
            }  # fmt: skip
            return event("message_start", message=message)

        # With tools the text may turn out to be calls, with a reasoning parser thinking:
        # then the blocks are sent once the output is known.
        streams_text = prepared.job.tools.kind == "none" and prepared.job.reasoning is None and not prepared.job.harmony
        try:
            opened = False
            final: RequestOutput | None = None
            async for output in stream:
                if final is None:
                    yield start(output)
                final = output
                delta = output.outputs[0].delta_text
                if streams_text and delta:
                    if not opened:
                        opened = True
                        yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                        yield event("ping")
                    yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})
            assert final is not None and final.finished
            blocks, stop_reason, stop_sequence = self._blocks(prepared, final.outputs[0])
            index = 0
            if opened:
                yield event("content_block_stop", index=0)
                index = 1
                blocks = [b for b in blocks if b["type"] != "text"]
            for block in blocks:
                if block["type"] == "text":
                    yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
                elif block["type"] == "thinking":
                    yield event("content_block_start", index=index, content_block={"type": "thinking", "thinking": "", "signature": ""})
                    yield event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": block["thinking"]})
                    yield event("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""})
                else:
                    yield event("content_block_start", index=index, content_block={**block, "input": {}})
                    yield event("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
                yield event("content_block_stop", index=index)
                index += 1
            usage = self._usage(final)  # the whole usage, as the API's current message_delta has it
            extra = {"timings": timings_of(final)} if self.context.wants_timings(prepared.job.body) else {}
            extra.update(self._diagnostics(body, message_id, prepared, final))
            yield event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence}, usage=usage.model_dump(), **extra)
            yield event("message_stop")
        except Exception as error:  # noqa: BLE001 - the status is sent: report in the stream
            api = to_api_error(error)
            yield event("error", error=anthropic_error_body(api.status, api.message).error.model_dump())
        finally:
            stream.cancel()
