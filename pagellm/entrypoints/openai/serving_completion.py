"""Entrypoints stage: HTTP: POST /v1/completions, streamed or not.

Each prompt of the request becomes one engine request with all n completions; choice
index = prompt index * n + completion index, as in the OpenAI API. The prompts are added
as one group, so either all run or the request fails as a whole.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.engine.async_requests import NewRequest, OutputStream
from pagellm.entrypoints.openai.errors import APIError, to_api_error
from pagellm.entrypoints.openai.request_limits import check_completion
from pagellm.entrypoints.openai.logprobs import CompletionLogprobsBuilder
from pagellm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from pagellm.entrypoints.openai.sampling import (
    common_sampling_fields,
    make_sampling_params,
    structured_outputs,
)
from pagellm.entrypoints.openai.serving_common import (
    ServingContext,
    collect_finals,
    continuous_usage,
    new_request_id,
    usage_of,
    with_timings,
)
from pagellm.entrypoints.openai.streaming import (
    SSE_DONE,
    EventStreamResponse,
    cancel_on_disconnect,
    sse_event,
)
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    """One completions request as it runs: its engine requests and how to report them."""

    response_id: str
    model: str
    body: CompletionRequest
    prompts: list[str | list[int]]
    engine_ids: list[str]
    # echo with max_tokens 0 (scoring a text): the prompt (and its logprobs) only. The
    # engine computes one token, which is not reported.
    prompt_only: bool = False

    def prompt_index(self, engine_id: str) -> int:
        return int(engine_id.rsplit("-", 1)[1])

    def finish_of(self, completion: CompletionOutput) -> tuple[str | None, int | str | None]:
        """The finish and stop reasons to report. The prompt alone always ends at its
        length limit: the hidden token may be EOS or match a stop string, which says
        nothing about a prompt that asked for no tokens."""
        if self.prompt_only and completion.finish_reason in ("stop", "length"):
            return "length", None
        return completion.finish_reason, completion.stop_reason


def normalize_prompts(prompt: str | list) -> list[str | list[int]]:
    """The request's prompt field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


class CompletionServing:
    def __init__(self, context: ServingContext) -> None:
        self.context = context

    def _sampling_params(self, body: CompletionRequest) -> tuple[SamplingParams, str]:
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "'best_of' other than n is not supported.", param="best_of")
        fields = common_sampling_fields(body)
        fields["structured_outputs"], constraint_field = structured_outputs(body)
        fields["max_tokens"] = body.max_tokens
        if body.max_tokens == 0:
            if not body.echo:
                raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone).", param="max_tokens")
            fields["max_tokens"] = 1
        fields["logprobs"] = body.logprobs
        if body.echo and body.logprobs is not None:
            fields["prompt_logprobs"] = body.logprobs
        return make_sampling_params(fields), constraint_field

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        arrival_time = time.time()  # queueing in the server counts toward latency
        context = self.context
        adapter = context.check_model(body.model)
        prompts = normalize_prompts(body.prompt)
        check_completion(context.limits, body, prompts)
        params, constraint_field = self._sampling_params(body)
        response_id = new_request_id("cmpl")
        engine_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        job = _Job(response_id, context.model_name(adapter), body, prompts, engine_ids, prompt_only=body.max_tokens == 0)
        stream = await context.add_requests(
            [
                NewRequest(rid, prompt, params, body.priority, arrival_time, lora_request=adapter)
                for rid, prompt in zip(engine_ids, prompts)
            ],
            constraint_field,
        )
        if body.stream:
            return EventStreamResponse(self._stream(job, stream), on_close=stream.cancel)
        finals = await cancel_on_disconnect(raw, collect_finals(stream))
        answer = self._response(job, finals).model_dump(mode="json")
        if context.wants_timings(body):
            answer = with_timings(answer, [finals[rid] for rid in engine_ids])
        return JSONResponse(answer)

    # -------------------------------------------------------------- whole answer

    def _prompt_text(self, job: _Job, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.context.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)

    def _response(self, job: _Job, finals: dict[str, RequestOutput]) -> CompletionResponse:
        body = job.body
        choices = []
        for prompt_index, engine_id in enumerate(job.engine_ids):
            output = finals[engine_id]
            prefix = self._prompt_text(job, output) if body.echo else ""
            for completion in output.outputs:
                generated_ids = [] if job.prompt_only else completion.token_ids
                logprobs = None
                if body.logprobs is not None:
                    builder = CompletionLogprobsBuilder(self.context.tokenizer, body.logprobs)
                    token_ids, positions = [], []
                    if body.echo:
                        token_ids += output.prompt_token_ids
                        positions += output.prompt_logprobs or [None] * len(token_ids)
                    token_ids += generated_ids
                    positions += (completion.logprobs or [None] * len(generated_ids))[: len(generated_ids)]
                    logprobs = builder.build(token_ids, positions)
                finish_reason, stop_reason = job.finish_of(completion)
                choices.append(
                    CompletionChoice(
                        index=prompt_index * body.n + completion.index,
                        text=prefix + ("" if job.prompt_only else completion.text),
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=stop_reason,
                    )
                )
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(
            id=job.response_id, model=job.model, choices=choices, usage=usage_of(finals.values(), job.prompt_only)
        )

    # ----------------------------------------------------------------- streaming

    async def _stream(self, job: _Job, stream: OutputStream) -> AsyncIterator[str]:
        body = job.body
        builders: dict[int, CompletionLogprobsBuilder] = {}
        latest: dict[str, RequestOutput] = {}
        try:
            async for output in stream:
                prompt_index = job.prompt_index(output.request_id)
                choices = []
                if output.request_id not in latest and body.echo:
                    choices += self._echo_choices(job, prompt_index, output, builders)
                latest[output.request_id] = output
                for completion in output.outputs:
                    # Only what this step added: the engine's delta fields.
                    new_token_ids = [] if job.prompt_only else completion.delta_token_ids
                    delta_text = "" if job.prompt_only else completion.delta_text
                    if not (delta_text or new_token_ids or completion.finished):
                        continue
                    index = prompt_index * body.n + completion.index
                    logprobs = None
                    if body.logprobs is not None:
                        builder = builders.setdefault(
                            index, CompletionLogprobsBuilder(self.context.tokenizer, body.logprobs)
                        )
                        positions = (completion.delta_logprobs or [None] * len(new_token_ids))[: len(new_token_ids)]
                        logprobs = builder.build(new_token_ids, positions)
                    finish_reason, stop_reason = job.finish_of(completion)
                    choices.append(
                        CompletionChoice(
                            index=index,
                            text=delta_text,
                            logprobs=logprobs,
                            finish_reason=finish_reason,
                            stop_reason=stop_reason,
                        )
                    )
                if choices:
                    # A request's last chunk carries its timings, when asked for.
                    timed = [output] if output.finished and self.context.wants_timings(body) else []
                    yield self._chunk(job, choices, continuous_usage(body, latest.values(), job.prompt_only), timed)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield self._chunk(job, [], usage_of(latest.values(), job.prompt_only))
        except Exception as e:  # noqa: BLE001 - the status is sent: report in the stream
            yield sse_event(to_api_error(e).body().model_dump_json())
        finally:
            stream.cancel()
        yield SSE_DONE

    def _echo_choices(
        self,
        job: _Job,
        prompt_index: int,
        output: RequestOutput,
        builders: dict[int, CompletionLogprobsBuilder],
    ) -> list[CompletionChoice]:
        body = job.body
        text = self._prompt_text(job, output)
        choices = []
        for completion_index in range(body.n):
            index = prompt_index * body.n + completion_index
            logprobs = None
            if body.logprobs is not None:
                builder = CompletionLogprobsBuilder(self.context.tokenizer, body.logprobs)
                builders[index] = builder
                positions = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
                logprobs = builder.build(output.prompt_token_ids, positions)
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs))
        return choices

    @staticmethod
    def _chunk(
        job: _Job, choices: list[CompletionChoice], usage: UsageInfo | None = None, timed: list[RequestOutput] | None = None
    ) -> str:
        chunk = CompletionResponse(
            id=job.response_id, model=job.model, choices=choices, usage=usage
        )
        if timed:
            return sse_event(json.dumps(with_timings(chunk.model_dump(mode="json"), timed), ensure_ascii=False))
        return sse_event(chunk.model_dump_json())
