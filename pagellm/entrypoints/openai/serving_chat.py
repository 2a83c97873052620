"""Entrypoints stage: HTTP: POST /v1/chat/completions, streamed or not.

The messages become a prompt through the model's own chat template (with the assistant's
turn opened); the prompt text is then encoded without adding special tokens, since the
template writes any BOS itself. One engine request carries all n choices.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.engine.async_requests import NewRequest, OutputStream
from pagellm.engine.input_processor import TokenizedPrompt
from pagellm.entrypoints.harmony.chat import (
    answer_constraint,
    chunk_delta,
    harmony_prompt,
    harmony_sampling,
    reasoning_effort,
)
from pagellm.entrypoints.harmony.parse import FINAL, HarmonyParser, parse_harmony
from pagellm.entrypoints.openai.errors import APIError, to_api_error
from pagellm.entrypoints.openai.request_limits import check_chat
from pagellm.entrypoints.openai.logprobs import chat_logprobs
from pagellm.entrypoints.openai.prompt_cache_diagnostics import PromptRecord, responses_diagnostics
from pagellm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from pagellm.entrypoints.openai.reasoning import ReasoningSplit, StreamingReasoning
from pagellm.entrypoints.openai.sampling import (
    common_sampling_fields,
    make_sampling_params,
    structured_outputs,
)
from pagellm.entrypoints.openai.serving_common import (
    ServingContext,
    collect_finals,
    new_request_id,
    continuous_usage,
    usage_of,
    with_timings,
)
from pagellm.entrypoints.openai.streaming import (
    SSE_DONE,
    EventStreamResponse,
    cancel_on_disconnect,
    sse_event,
)
from pagellm.entrypoints.openai.tool_calls import (
    ToolMode,
    new_call_id,
    parse_tool_calls,
    prompt_messages,
    template_takes_tools,
    tool_call_deltas,
    tool_constraint,
    tool_mode,
)
from pagellm.errors import InvalidRequestError
from pagellm.lora.request import LoRARequest
from pagellm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs_params import KINDS as CONSTRAINT_KINDS
from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template sees them; text content parts are joined into one string."""
    result = []
    for message in messages:
        as_dict = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            as_dict["content"] = "\n".join(part.text for part in message.content)
        result.append(as_dict)
    return result


def chat_prompt_text(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    request: ChatCompletionRequest | None = None,
    tools: ToolMode = ToolMode("none"),
) -> str:
    dicts = message_dicts(messages)
    extra: dict[str, Any] = dict(request.chat_template_kwargs or {}) if request is not None else {}
    if tools.kind != "none" or _has_tool_turns(dicts):
        dicts, tool_extra = prompt_messages(dicts, request, tools, template_takes_tools(tokenizer))
        extra.update(tool_extra)
    for reserved in ("add_generation_prompt", "continue_final_message", "messages", "tokenize", "chat_template"):
        extra.pop(reserved, None)  # the server's own arguments (the request's fields say them)
    # A last message without text has nothing to continue: the model answers in a turn of
    # its own, as with no prefill (Anthropic's rule for an empty one).
    final = dicts[-1].get("content") if dicts else None
    continue_final = request is not None and request.continue_final_message and isinstance(final, str) and bool(final.strip())
    add_generation_prompt = not continue_final
    if request is not None and request.add_generation_prompt is not None:
        add_generation_prompt = request.add_generation_prompt
    text = tokenizer.apply_chat_template(
        dicts, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final, **extra
    )
    assert isinstance(text, str)
    return text


def harmony_chat_prompt(body: ChatCompletionRequest, tools: ToolMode = ToolMode("none")) -> tuple[str, bool]:
    """A harmony model's prompt for a chat request (entrypoints/harmony/render.py), and
    whether it continues the final (assistant) message rather than opening a turn."""
    dicts = message_dicts(body.messages)
    final = dicts[-1] if dicts else {}
    continue_final = (
        body.continue_final_message and final.get("role") == "assistant" and bool(str(final.get("content") or "").strip())
    )  # fmt: skip
    offered = [tool.model_dump(exclude_none=True) for tool in body.tools or []] if tools.kind != "none" else None
    response_format = None
    if body.response_format is not None and getattr(body.response_format, "json_schema", None) is not None:
        schema = body.response_format.json_schema
        response_format = {"name": schema.name, "description": schema.description, "schema": schema.schema_}
    effort = reasoning_effort(body.reasoning_effort, body.chat_template_kwargs)
    add_generation_prompt = body.add_generation_prompt is not False
    return harmony_prompt(dicts, offered, effort, response_format, continue_final, add_generation_prompt), continue_final


def _finish_reason(completion: CompletionOutput, calls: list[ToolCall]) -> str | None:
    """"tool_calls" when the model ended with calls; "length" stays (calls cut short)."""
    if calls and completion.finish_reason == "stop":
        return "tool_calls"
    return completion.finish_reason


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


@dataclass(frozen=True)
class _Job:
    response_id: str
    model: str
    body: ChatCompletionRequest
    num_top_logprobs: int | None  # None: no logprobs asked for
    tools: ToolMode = ToolMode("none")
    reasoning: ReasoningSplit | None = None  # how the output splits (--reasoning-parser)
    # A harmony model (gpt-oss): its output's channels are parsed; the channel the prompt left
    # open (a continued final answer), if any.
    harmony: bool = False
    harmony_open_channel: str | None = None


@dataclass(frozen=True)
class PreparedChat:
    """A checked chat request, ready for the engine."""

    job: _Job
    prompt_ids: list[int]
    params: SamplingParams
    constraint_field: str
    adapter: LoRARequest | None = None  # the LoRA adapter `model` names

    def new_request(self, request_id: str, priority: int, arrival_time: float) -> NewRequest:
        prompt = TokenizedPrompt(None, self.prompt_ids)
        return NewRequest(request_id, prompt, self.params, priority, arrival_time, lora_request=self.adapter)


class ChatServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    def _sampling_params(self, body: ChatCompletionRequest, tools: ToolMode) -> tuple[SamplingParams, str]:
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(
                400, "top_logprobs needs logprobs set to true.", param="top_logprobs"
            )
        for name in ("max_tokens", "max_completion_tokens"):
            # Both may be given (max_completion_tokens wins): neither may exceed the context.
            value = getattr(body, name)
            if value is not None and value > self.context.max_model_len:
                raise APIError(
                    400, f"{name}={value} is more than max_model_len={self.context.max_model_len}.", param=name
                )
        fields = common_sampling_fields(body)
        constraint, constraint_field = structured_outputs(body)
        tool_calls_constraint = tool_constraint(body, tools)
        if constraint is not None and tool_calls_constraint is not None:
            raise APIError(
                400, f"tool_choice {tools.kind!r} constrains the output already; drop {constraint_field}.",
                param=constraint_field,
            )  # fmt: skip
        if tool_calls_constraint is not None:
            constraint, constraint_field = tool_calls_constraint, "tools"
        fields["structured_outputs"] = constraint
        fields["max_tokens"] = (
            body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        )
        fields["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
        return make_sampling_params(fields), constraint_field

    async def prepare(self, body: ChatCompletionRequest, response_id: str, check_limits: bool = True) -> PreparedChat:
        """Everything but running it: the checks, the sampling parameters, the prompt.
        Other APIs that are chat underneath (Responses, Anthropic's Messages) call this too;
        one that checks the request limits on its own body passes check_limits=False."""
        context = self.context
        adapter = context.check_model(body.model)
        if check_limits:
            check_chat(context.limits, body)
        tools = tool_mode(body)
        params, constraint_field = self._sampling_params(body, tools)
        if context.harmony:
            return await self._prepare_harmony(body, response_id, tools, params, constraint_field, adapter)
        prompt = chat_prompt_text(context.tokenizer, body.messages, body, tools)
        split = ReasoningSplit.for_prompt(context.reasoning, prompt) if context.reasoning is not None else None
        constraint = params.structured_outputs
        if split is not None and constraint is not None:
            if not context.structured_outputs_in_reasoning:
                # The constraint (a response format, or the tool calls) holds the answer;
                # the think block before it is the model's own.
                params = replace(params, structured_outputs=replace(constraint, after_think=split.think_block()))
            elif tools.kind in ("named", "required"):
                split = None  # constrained to the calls from the first token: nothing to split
        job = _Job(
            response_id,
            context.model_name(adapter),
            body,
            (body.top_logprobs or 0) if body.logprobs else None,
            tools,
            split,
        )
        prompt_ids = await context.async_llm.tokenize(prompt, add_special_tokens=False)
        return PreparedChat(job, prompt_ids, params, constraint_field, adapter)

    async def _prepare_harmony(
        self, body: ChatCompletionRequest, response_id: str, tools: ToolMode, params: SamplingParams,
        constraint_field: str, adapter: LoRARequest | None,
    ) -> PreparedChat:  # fmt: skip
        """A harmony model's request: the conversation rendered in harmony, the output kept
        with its special tokens for the parser (entrypoints/harmony/)."""
        context = self.context
        prompt, continue_final = harmony_chat_prompt(body, tools)
        constraint = params.structured_outputs
        if constraint is not None and not context.structured_outputs_in_reasoning:
            offered = tuple(tool.function.name for tool in body.tools or [])
            params = replace(params, structured_outputs=answer_constraint(constraint, tools.kind, tools.name, offered))
        job = _Job(
            response_id, context.model_name(adapter), body, (body.top_logprobs or 0) if body.logprobs else None, tools,
            harmony=True, harmony_open_channel=FINAL if continue_final else None,
        )  # fmt: skip
        prompt_ids = await context.async_llm.tokenize(prompt, add_special_tokens=False)
        return PreparedChat(job, prompt_ids, harmony_sampling(params, context.tokenizer), constraint_field, adapter)

    async def count_input_tokens(self, body: ChatCompletionRequest) -> Response:
        """POST /v1/chat/completions/input_tokens: the prompt this request would run with
        (template, tools, a continued final message), counted without running it."""
        prepared = await self.prepare(body, "count")
        await self.check_runnable(prepared)
        return JSONResponse({"object": "chat.completion.input_tokens", "input_tokens": len(prepared.prompt_ids)})

    async def check_runnable(self, prepared: PreparedChat) -> None:
        """What running a prepared request would refuse besides its length (counting its
        tokens refuses it too): parameters the model cannot take, n beyond the running
        seats, a constraint that does not compile."""
        engine = self.context.async_llm.engine
        params = prepared.params
        try:
            params.check_against_model(self.context.vocab_size, engine.max_logprobs)
            if params.n > engine.config.scheduler_config.max_num_seqs:
                raise InvalidRequestError(f"n={params.n} is more than max_num_seqs ({engine.config.scheduler_config.max_num_seqs})", "n")
            if params.structured_outputs is not None:
                await asyncio.to_thread(engine.grammars.compile, params.structured_outputs)
        except InvalidRequestError as e:
            field = prepared.constraint_field if e.parameter in CONSTRAINT_KINDS and prepared.constraint_field else e.parameter
            raise APIError(400, str(e), param=field) from None

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival_time = time.time()  # queueing in the server counts toward latency
        context = self.context
        response_id = new_request_id("chatcmpl")
        prepared = await self.prepare(body, response_id)
        job = prepared.job
        stream = await context.add_requests(
            [prepared.new_request(response_id, body.priority, arrival_time)],
            prepared.constraint_field,
        )
        if body.stream:
            return EventStreamResponse(self._stream(job, stream), on_close=stream.cancel)
        finals = await cancel_on_disconnect(raw, collect_finals(stream))
        answer = self._response(job, finals[response_id]).model_dump(mode="json")
        if context.wants_timings(body):
            answer = with_timings(answer, [finals[response_id]])
        answer.update(self._diagnostics(job, finals[response_id]))
        return JSONResponse(answer)

    def _logprobs(
        self, job: _Job, token_ids: list[int], positions: list[PositionLogprobs] | None
    ) -> ChatLogprobs | None:
        if job.num_top_logprobs is None:
            return None
        entries = chat_logprobs(
            self.context.tokenizer, token_ids, positions or [], job.num_top_logprobs
        )
        return ChatLogprobs(content=entries)

    def _response(self, job: _Job, output: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for completion in sorted(output.outputs, key=lambda c: c.index):
            reasoning, content, calls = self.content_and_calls(job, completion)
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=ChatResponseMessage(content=content, tool_calls=calls or None, reasoning_content=reasoning),
                    logprobs=self._logprobs(job, completion.token_ids, completion.logprobs),
                    finish_reason=_finish_reason(completion, calls),
                    stop_reason=completion.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=job.response_id, model=job.model, choices=choices, usage=usage_of([output])
        )

    async def _stream(self, job: _Job, stream: OutputStream) -> AsyncIterator[str]:
        body = job.body
        latest: RequestOutput | None = None
        try:
            # The assistant's role opens every choice before any content.
            opening = [ChatChunkChoice(index=i, delta=self._opening_delta(job)) for i in range(body.n)]
            yield self._chunk(job, opening)
            split = job.reasoning
            splitters = {i: split.streaming() for i in range(body.n)} if split is not None else {}
            parsers = {i: HarmonyParser(job.harmony_open_channel) for i in range(body.n)} if job.harmony else {}
            call_ids: dict[int, dict[int, str]] = {i: {} for i in range(body.n)}
            async for output in stream:
                latest = output
                choices = [
                    choice
                    for completion in output.outputs
                    if (
                        choice := self._harmony_delta(job, completion, parsers[completion.index], call_ids[completion.index])
                        if job.harmony
                        else self._delta_choice(job, completion, splitters.get(completion.index))
                    )
                ]
                if choices:
                    # The last chunk carries the timings and diagnostics, when asked for.
                    extra: dict[str, Any] = {}
                    if output.finished:
                        extra = self._diagnostics(job, output)
                        if self.context.wants_timings(body):
                            extra = with_timings(extra, [output])
                    yield self._chunk(job, choices, continuous_usage(body, [output]), extra)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield self._chunk(job, [], usage_of([latest] if latest else []))
        except Exception as e:  # noqa: BLE001 - the status is sent: report in the stream
            yield sse_event(to_api_error(e).body().model_dump_json())
        finally:
            stream.cancel()
        yield SSE_DONE

    def content_and_calls(
        self, job: _Job, completion: CompletionOutput
    ) -> tuple[str | None, str | None, list[ToolCall]]:
        """A finished completion's reasoning (with --reasoning-parser), content and tool
        calls, parsed from the text after the reasoning. A forced call ("required", named)
        cut short by max_tokens is a call with its arguments as far as they got, never
        text; with "auto", what was cut is the text it is."""
        if job.harmony:
            parsed = parse_harmony(completion.text, job.harmony_open_channel)
            calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls]
            return parsed.reasoning, parsed.content, calls if job.tools.kind != "none" else []
        reasoning, text = None, completion.text
        if job.reasoning is not None:
            reasoning, text = job.reasoning.split(completion.text)
        if job.tools.kind == "none" or completion.finish_reason not in ("stop", "length"):
            return reasoning, text, []
        if completion.finish_reason == "length" and job.tools.kind == "auto":
            return reasoning, text, []
        return reasoning, *parse_tool_calls(text or "", job.tools, job.body)

    def _delta_choice(
        self, job: _Job, completion: CompletionOutput, splitter: StreamingReasoning | None = None
    ) -> ChatChunkChoice | None:
        """The chunk choice for what this step added to a completion (None: nothing).

        With tools, a named function's arguments stream as they come (the call's id and
        name first); other tool modes hold the text back and send it, or the calls it
        holds, when the completion finishes. With --reasoning-parser (`splitter`) the text
        streams as `reasoning_content`, then `content`."""
        text = completion.delta_text
        if not (text or completion.delta_token_ids or completion.finished):
            return None
        reasoning = ""
        if splitter is not None:  # the reasoning streams as it comes, whatever follows it
            reasoning, text = splitter.feed(text)
            if completion.finished:
                more_reasoning, more_text = splitter.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        finish_reason = completion.finish_reason
        if job.tools.kind == "named":
            delta: dict[str, Any] = {}
            if text:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            if completion.finished and completion.finish_reason == "stop":
                finish_reason = "tool_calls"
        elif job.tools.kind != "none":
            delta = {}
            if completion.finished:
                _, content, calls = self.content_and_calls(job, completion)
                if calls:
                    delta, finish_reason = {"tool_calls": tool_call_deltas(calls)}, _finish_reason(completion, calls)
                elif content:
                    delta = {"content": content}
        else:
            delta = {"content": text} if text or not (reasoning or completion.finished) else {}
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        return ChatChunkChoice(
            index=completion.index,
            delta=delta,
            logprobs=self._logprobs(job, completion.delta_token_ids, completion.delta_logprobs),
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason,
        )

    def _harmony_delta(
        self, job: _Job, completion: CompletionOutput, parser: HarmonyParser, call_ids: dict[int, str]
    ) -> ChatChunkChoice | None:
        """A harmony model's chunk: the analysis channel as `reasoning_content`, the answer as
        `content`, calls to functions as `tool_calls` (each opening with its id and name), as
        the parser finds them."""
        if not (completion.delta_text or completion.delta_token_ids or completion.finished):
            return None
        delta = chunk_delta(parser, completion.delta_text, completion.finished, job.tools.kind != "none", call_ids)
        finish_reason = completion.finish_reason
        if completion.finished and finish_reason == "stop" and call_ids:
            finish_reason = "tool_calls"
        if not delta and not completion.finished:
            return None
        return ChatChunkChoice(
            index=completion.index, delta=delta, finish_reason=finish_reason, stop_reason=completion.stop_reason,
            logprobs=self._logprobs(job, completion.delta_token_ids, completion.delta_logprobs),
        )  # fmt: skip

    @staticmethod
    def _opening_delta(job: _Job) -> dict[str, Any]:
        """The assistant's role opens every choice; a named function's call opens too (a
        harmony model's calls open as its parser finds them)."""
        if job.tools.kind != "named" or job.harmony:
            return {"role": "assistant", "content": ""}
        call = {"index": 0, "id": new_call_id(), "type": "function", "function": {"name": job.tools.name, "arguments": ""}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    @staticmethod
    def _chunk(
        job: _Job, choices: list[ChatChunkChoice], usage: UsageInfo | None = None, extra: dict[str, Any] | None = None
    ) -> str:
        chunk = ChatCompletionChunk(
            id=job.response_id, model=job.model, choices=choices, usage=usage
        )
        if extra:
            return sse_event(json.dumps({**chunk.model_dump(mode="json"), **extra}, ensure_ascii=False))
        return sse_event(chunk.model_dump_json())

    def _diagnostics(self, job: _Job, output: RequestOutput) -> dict[str, Any]:
        """Remember this completion's prompt; {"prompt_cache_diagnostics": ...} against the
        one its prompt_cache_options names, when it names one."""
        service = self.context.diagnostics
        if service is None or not output.finished:
            return {}
        body = job.body
        system = [m.content for m in body.messages if m.role in ("system", "developer")]
        turns = [m.model_dump(mode="json", exclude_none=True) for m in body.messages if m.role not in ("system", "developer")]
        tools = [t.model_dump(mode="json", exclude_none=True) for t in body.tools or []]
        record = PromptRecord.of(job.model, output.prompt_token_ids, system, tools, turns)
        options = body.prompt_cache_options
        diagnosis = service.record(job.response_id, record, output.num_cached_tokens, options.compare_with if options else None)
        return {"prompt_cache_diagnostics": responses_diagnostics(diagnosis)} if diagnosis is not None else {}
