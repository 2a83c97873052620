"""Entrypoints stage: HTTP: the Responses API: POST /v1/responses, GET and DELETE
/v1/responses/{id}, POST /v1/responses/{id}/cancel.

A response is a chat completion underneath: `instructions`, the conversation of
`previous_response_id` (kept in ResponseStore) and the input items become chat messages;
function tools, `tool_choice` and `text.format` become the chat request's tools and
response_format; ChatServing prepares it (template, sampling, constraints) and parses
the output into text and tool calls, which become `message` and `function_call` output
items. Streamed, it is OpenAI's event sequence (response.created, output items and their
text or argument deltas, response.completed or response.incomplete), each event with its
`sequence_number`. `background` answers at once with status "queued" and runs the
response as a task; GET polls it and cancel aborts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagellm.engine.async_requests import OutputStream
from pagellm.entrypoints.openai.errors import APIError, to_api_error
from pagellm.entrypoints.openai.prompt_cache_diagnostics import PromptRecord, responses_diagnostics
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ToolCall
from pagellm.entrypoints.openai.protocol_responses import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from pagellm.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagellm.entrypoints.openai.serving_chat import ChatServing, PreparedChat
from pagellm.entrypoints.openai.serving_common import ServingContext, collect_finals, timings_of
from pagellm.entrypoints.openai.streaming import EventStreamResponse, cancel_on_disconnect
from pagellm.outputs import RequestOutput

FINISHED = ("completed", "incomplete", "cancelled", "failed")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(
        404, f"{what} with id '{response_id}' not found.", param=param,
        code="previous_response_not_found" if param else "not_found",
    )  # fmt: skip


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages (a function call joins the assistant
    turn that made it; reasoning items are not shown to the model again)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, InputMessage):
            content = item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def listed_input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as OpenAI lists it back (GET /v1/responses/{id}/input_items):
    each item with an id, text as input_text parts (an assistant's as output_text)."""
    if isinstance(body.input, str):
        return [_input_message_item("user", [body.input])]
    items: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, InputMessage):
            texts = [item.content] if isinstance(item.content, str) else [part.text for part in item.content]
            items.append(_input_message_item(item.role, texts))
        elif isinstance(item, FunctionCallItem):
            items.append({
                "type": "function_call", "id": item.id or _new_id("fc"), "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments, "status": item.status or "completed",
            })  # fmt: skip
        elif isinstance(item, FunctionCallOutputItem):
            items.append({"type": "function_call_output", "id": _new_id("fco"), "call_id": item.call_id, "output": item.output, "status": "completed"})
    return items


def _input_message_item(role: str, texts: list[str]) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    content = [{"type": kind, "text": text, **({"annotations": []} if kind == "output_text" else {})} for text in texts]
    return {"type": "message", "id": _new_id("msg"), "role": role, "status": "completed", "content": content}


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request the response runs as."""
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "priority": body.priority,
        "user": body.user, "parallel_tool_calls": body.parallel_tool_calls, "timings": body.timings,
        "structured_outputs": body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if body.structured_outputs else None,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
    }  # fmt: skip
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)} for tool in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
    text_format = body.text.format if body.text is not None else None
    if isinstance(text_format, TextFormatJsonSchema):
        schema = {"name": text_format.name, "schema": text_format.schema_, "strict": text_format.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(text_format, TextFormatJsonObject):
        fields["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"Invalid input: {first['msg']} (at {'.'.join(str(p) for p in first['loc'])})", param="input") from None


def _error_fields(error: BaseException) -> dict[str, Any]:
    body = to_api_error(error).body().error
    return {"code": body.code or body.type, "message": body.message}


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id or _new_id("msg"), "status": status, "role": "assistant", "content": content}


def _call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    return {
        "type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
        "name": call.function.name, "arguments": call.function.arguments if arguments is None else arguments,
        "status": status,
    }  # fmt: skip


class ResponsesServing:
    def __init__(self, context: ServingContext, chat: ChatServing) -> None:
        self.context = context
        self.chat = chat
        self.store = ResponseStore(context.limits.max_stored_responses)

    # ------------------------------------------------------------------ create

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        arrival_time = time.time()
        if body.background and not body.store:
            raise APIError(400, "background responses must be stored (store: true) to be polled.", param="background")
        if body.background and body.stream:
            raise APIError(400, "background and stream together are not supported: poll GET /v1/responses/{id}.", param="stream")
        conversation = self._conversation(body)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        rank = self.context.data_parallel_rank
        response_id = _new_id("resp" if rank is None else f"resp_r{rank}")
        self._check_limits(body)
        prepared = await self.chat.prepare(chat_request(body, system + conversation), response_id, check_limits=False)
        if body.max_output_tokens is None:  # no limit but the context (chat's default is 16)
            prepared = dataclasses.replace(prepared, params=dataclasses.replace(prepared.params, max_tokens=None))
        options = body.prompt_cache_options
        entry = StoredResponse(
            self._response_object(body, response_id, self.context.model_name(prepared.adapter)), conversation,
            input_items=listed_input_items(body), compare_with=options.compare_with if options else None,
        )  # fmt: skip
        stream = await self.context.add_requests(
            [prepared.new_request(response_id, body.priority, arrival_time)],
            prepared.constraint_field,
        )
        if body.background:
            entry.response.status = "queued"
            self.store.put(entry)
            entry.task = asyncio.create_task(self._run_background(entry, prepared, stream))
            return JSONResponse(self._dump(entry))
        if body.store:
            self.store.put(entry)
        if body.stream:
            return EventStreamResponse(self._events(entry, prepared, stream), on_close=stream.cancel)
        try:
            finals = await cancel_on_disconnect(raw, collect_finals(stream))
        except BaseException:
            self.store.delete(response_id)  # never answered: nothing to poll
            raise
        self._finish(entry, prepared, finals[response_id])
        return JSONResponse(self._dump(entry))

    def _check_limits(self, body: ResponsesRequest) -> None:
        """The server's request limits as this API counts: input items, and the text of each
        (a stored conversation it continues was checked when it came)."""
        limits = self.context.limits
        items = [body.input] if isinstance(body.input, str) else body.input
        if len(items) > limits.max_messages:
            raise APIError(400, f"input has {len(items)} items; at most {limits.max_messages}.", param="input")
        for index, item in enumerate(items):
            if isinstance(item, str):
                length = len(item)
            elif isinstance(item, InputMessage):
                length = len(item.content) if isinstance(item.content, str) else sum(len(p.text) for p in item.content)
            else:
                length = len(getattr(item, "output", "") or getattr(item, "arguments", "") or "")
            if length > limits.max_message_chars:
                raise APIError(
                    400, f"input[{index}] has {length} characters of content; at most {limits.max_message_chars}.",
                    param="input",
                )  # fmt: skip

    def _conversation(self, body: ResponsesRequest) -> list[dict[str, Any]]:
        """The conversation the request continues (previous_response_id's), then its input."""
        conversation: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            if previous.response.status not in FINISHED:
                raise APIError(400, f"Previous response '{body.previous_response_id}' is still running.", param="previous_response_id")
            conversation = list(previous.conversation)
        return conversation + input_messages(body)

    async def count_input_tokens(self, body: ResponsesRequest) -> Response:
        """POST /v1/responses/input_tokens: the prompt this request would run with, counted
        (instructions, the previous response's conversation, tools), as OpenAI answers it."""
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        self._check_limits(body)
        prepared = await self.chat.prepare(chat_request(body, system + self._conversation(body)), "count", check_limits=False)
        await self.chat.check_runnable(prepared)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prepared.prompt_ids)})

    def _response_object(self, body: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
        """The response as it starts; `model` is the name it answers under (a LoRA adapter's)."""
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice
        return ResponseObject(
            id=response_id, created_at=int(time.time()), status="in_progress", model=model,
            output=[], instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p,
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
            tool_choice=(choice or "auto") if isinstance(choice, str) or choice is None else choice.model_dump(),
            parallel_tool_calls=body.parallel_tool_calls,
            text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}},
            previous_response_id=body.previous_response_id, store=body.store, background=body.background,
            metadata=body.metadata or {}, user=body.user,
        )  # fmt: skip

    @staticmethod
    def _dump(entry: StoredResponse) -> dict[str, Any]:
        answer = entry.response.model_dump(mode="json")
        if entry.timings is not None:  # asked for, and finished
            answer["timings"] = entry.timings
        if entry.diagnostics is not None:
            answer["prompt_cache_diagnostics"] = entry.diagnostics
        return answer

    def _output(self, prepared: PreparedChat, output: RequestOutput) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The output items of a finished completion, and the assistant turn it adds to the conversation."""
        completion = output.outputs[0]
        reasoning, content, calls = self.chat.content_and_calls(prepared.job, completion)
        items = []
        if reasoning is not None:
            items.append({
                "type": "reasoning", "id": _new_id("rs"), "status": "completed", "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
            })  # fmt: skip
        if content or not calls:
            items.append(_message_item(content or ""))
        items += [_call_item(call) for call in calls]
        turn: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            turn["tool_calls"] = [call.model_dump() for call in calls]
        return items, turn

    def _finish(self, entry: StoredResponse, prepared: PreparedChat, output: RequestOutput) -> None:
        """Fill in a response from its finished engine output."""
        completion = output.outputs[0]
        response = entry.response
        if completion.finish_reason == "abort":
            response.status = "cancelled"
            return
        items, turn = self._output(prepared, output)
        response.output = items
        response.status = "incomplete" if completion.finish_reason == "length" else "completed"
        response.incomplete_details = {"reason": "max_output_tokens"} if response.status == "incomplete" else None
        num_input, num_output = len(output.prompt_token_ids), len(completion.token_ids)
        response.usage = ResponseUsage(
            input_tokens=num_input, output_tokens=num_output, total_tokens=num_input + num_output,
            input_tokens_details={"cached_tokens": output.num_cached_tokens}, output_tokens_details={"reasoning_tokens": 0},
        )  # fmt: skip
        if self.context.diagnostics is not None:  # this response's prompt, for later diagnostics
            response_object = entry.response
            record = PromptRecord.of(
                response_object.model, output.prompt_token_ids, response_object.instructions, response_object.tools,
                entry.conversation,
            )  # fmt: skip
            diagnosis = self.context.diagnostics.record(response_object.id, record, output.num_cached_tokens, entry.compare_with)
            entry.diagnostics = responses_diagnostics(diagnosis) if diagnosis is not None else None
        entry.conversation = [*entry.conversation, turn]
        if self.context.wants_timings(prepared.job.body):
            entry.timings = timings_of(output)

    async def _run_background(self, entry: StoredResponse, prepared: PreparedChat, stream: OutputStream) -> None:
        entry.response.status = "in_progress"
        try:
            finals = await collect_finals(stream)
            self._finish(entry, prepared, finals[entry.response.id])
        except asyncio.CancelledError:
            entry.response.status = "cancelled"
        except Exception as error:  # noqa: BLE001 - the response records its failure; GET shows it
            entry.response.status = "failed"
            entry.response.error = _error_fields(error)
        finally:
            stream.cancel()
            entry.task = None

    # --------------------------------------------------------------- streaming

    async def _events(self, entry: StoredResponse, prepared: PreparedChat, stream: OutputStream) -> AsyncIterator[str]:
        sequence = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal sequence
            payload = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        response_id = entry.response.id
        yield event("response.created", response=self._dump(entry))
        yield event("response.in_progress", response=self._dump(entry))
        # With tools the text may turn out to be calls, with a reasoning parser reasoning:
        # then the items are sent once the output is known.
        streams_text = prepared.job.tools.kind == "none" and prepared.job.reasoning is None and not prepared.job.harmony
        item_id = _new_id("msg")
        opened = False
        try:
            final: RequestOutput | None = None
            async for output in stream:
                final = output
                delta = output.outputs[0].delta_text
                if streams_text and (delta or output.finished) and not opened:
                    opened = True
                    yield event("response.output_item.added", output_index=0, item=_message_item("", "in_progress", item_id))
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part)
                if streams_text and delta:
                    yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0, delta=delta, logprobs=[])
            assert final is not None and final.finished
            self._finish(entry, prepared, final)
            for index, item in enumerate(entry.response.output):
                if item["type"] == "message":
                    if not streams_text:
                        item["id"] = item_id
                        yield event("response.output_item.added", output_index=index, item=_message_item("", "in_progress", item_id))
                        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                        yield event("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part)
                        text = item["content"][0]["text"]
                        if text:
                            yield event("response.output_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text, logprobs=[])
                    item["id"] = item_id
                    part = item["content"][0]
                    yield event("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=part["text"], logprobs=[])
                    yield event("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part)
                elif item["type"] == "reasoning":
                    yield event("response.output_item.added", output_index=index, item={**item, "content": [], "status": "in_progress"})
                else:
                    yield event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"})
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
            last = "response.incomplete" if entry.response.status == "incomplete" else "response.completed"
            yield event(last, response=self._dump(entry))
        except Exception as error:  # noqa: BLE001 - the status is sent: report in the stream
            entry.response.status = "failed"
            entry.response.error = _error_fields(error)
            yield event("error", **entry.response.error, param=to_api_error(error).param)
        finally:
            stream.cancel()
            if entry.response.status not in FINISHED:  # the client left: never finished
                self.store.delete(response_id)

    # --------------------------------------------------------------- by id

    def retrieve(self, response_id: str) -> Response:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return JSONResponse(self._dump(entry))

    def input_items(self, response_id: str, limit: int, order: str, after: str | None, before: str | None) -> Response:
        """A stored response's input items, a page of them as OpenAI's list does: `order`
        asc or desc (the default), `after` / `before` an item id the page starts after or
        ends before, at most `limit` items (the route bounds limit and order)."""
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        ids = [item["id"] for item in items]
        for name, cursor in (("after", after), ("before", before)):
            if cursor is not None and cursor not in ids:
                raise APIError(400, f"{name}: no input item {cursor!r} in response {response_id!r}.", param=name)
        start = ids.index(after) + 1 if after is not None else 0
        end = ids.index(before) if before is not None else len(items)
        page = items[start:end][:limit]
        return JSONResponse({
            "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end,
        })  # fmt: skip

    def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse(DeletedResponse(id=response_id).model_dump(mode="json"))

    async def cancel(self, response_id: str) -> Response:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        if not entry.response.background:
            raise APIError(400, "Only background responses can be cancelled.", param="response_id")
        task = entry.task
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return JSONResponse(self._dump(entry))
