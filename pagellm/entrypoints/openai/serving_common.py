"""Entrypoints stage: HTTP: what every endpoint handler shares: the engine, the model, ids, usage."""

from __future__ import annotations

import contextvars
import functools
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.async_requests import NewRequest, OutputStream
from pagellm.entrypoints.harmony.chat import speaks_harmony
from pagellm.entrypoints.openai.limits_config import RequestLimits
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from pagellm.entrypoints.openai.reasoning import ReasoningFormat
from pagellm.errors import InvalidRequestError
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.structured_outputs_params import KINDS as CONSTRAINT_KINDS
from pagellm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.prompt_cache_diagnostics import DiagnosticsService
    from pagellm.entrypoints.openai.serving_lora import AdapterRegistry


# Set by the batch runner: the engine requests a handler adds in its context are background
# work (batch lines), which the scheduler serves only where interactive requests leave room.
BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("pagellm_background", default=False)


@dataclass(frozen=True)
class ServingContext:
    async_llm: AsyncLLM
    served_model_name: str
    limits: RequestLimits = RequestLimits()
    reasoning: ReasoningFormat | None = None  # --reasoning-parser
    # --structured-outputs-config {"enable_in_reasoning": true}: a constraint holds the think
    # block too, from the first output token (by default it holds the answer after it).
    structured_outputs_in_reasoning: bool = False
    data_parallel_rank: int | None = None  # this server is that replica of a data-parallel one
    adapters: AdapterRegistry | None = None  # LoRA adapters served by name (serving_lora.py)
    per_request_metrics: bool = False  # --enable-per-request-metrics: every answer carries `timings`
    diagnostics: DiagnosticsService | None = None  # prompt-cache diagnostics against earlier answers

    def wants_timings(self, body: object) -> bool:
        """Whether this answer carries `timings`: the server flag, or the request's own `timings: true`."""
        return self.per_request_metrics or bool(getattr(body, "timings", False))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.async_llm.engine.tokenizer

    @functools.cached_property
    def harmony(self) -> bool:
        """Whether the model speaks harmony (gpt-oss): its chats are rendered and parsed so."""
        return speaks_harmony(self.async_llm.engine.config.model_config.architecture, self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.async_llm.engine.config.scheduler_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.async_llm.engine.config.model_config.vocab_size

    async def add_requests(self, requests: list[NewRequest], constraint_field: str) -> OutputStream:
        """Queue the requests. An output constraint that does not compile (AsyncLLM
        compiles it on a worker thread first) is a 400 naming the request field it came from."""
        if BACKGROUND.get():
            requests = [replace(request, background=True) for request in requests]
        try:
            return await self.async_llm.add_requests(requests)
        except InvalidRequestError as e:
            if constraint_field and e.parameter in CONSTRAINT_KINDS:
                raise APIError(400, f"{constraint_field}: {e}", param=constraint_field) from None
            raise

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names, None for the served model (and for None: "whatever
        is served"); 404 for anything else."""
        if model is None or model == self.served_model_name:
            return None
        adapter = None if self.adapters is None else self.adapters.get(model)
        if adapter is not None:
            return adapter
        names = [self.served_model_name, *(self.adapters.names() if self.adapters is not None else [])]
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves " + ", ".join(f"`{n}`" for n in names) + ".",
            param="model",
            code="model_not_found",
        )

    def model_name(self, adapter: LoRARequest | None) -> str:
        """The `model` an answer reports: the adapter's name, or the served model's."""
        return self.served_model_name if adapter is None else adapter.lora_name

    def check_token_ids(self, token_ids: Iterable[int], param: str) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise APIError(
                    400,
                    f"token id {token_id} is out of range [0, {self.vocab_size}).",
                    param=param,
                )


def timings_of(output: RequestOutput) -> dict[str, float | int | None] | None:
    """A finished request's timings, as llama.cpp's server names them (cache_n, prompt_n,
    prompt_ms, predicted_n, predicted_ms and their per-token and per-second rates,
    draft_n, draft_n_accepted) and the rest of its life: queue_ms, ttft_ms, total_ms,
    cache_n_tier (of cache_n, from the prefix cache's disk tier), preemptions. Decode time
    runs from the first token to the last, so its per-token figure is the mean inter-token
    latency. None before the request finished."""
    metrics = output.metrics
    if metrics is None:
        return None

    def ms(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else round(1000 * (end - start), 3)

    prompt_n = metrics.num_prompt_tokens - metrics.num_cached_tokens
    prompt_ms = ms(metrics.first_scheduled_time, metrics.first_token_time)
    predicted_n = metrics.num_generation_tokens
    predicted_ms = ms(metrics.first_token_time, metrics.finished_time)
    gaps = max(predicted_n - 1, 0)  # tokens after the first, which prefill yields
    return {
        "cache_n": metrics.num_cached_tokens,
        "cache_n_tier": metrics.num_tier_cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_ms is not None and prompt_n else None,
        "prompt_per_second": round(1000 * prompt_n / prompt_ms, 3) if prompt_ms else None,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": round(predicted_ms / gaps, 3) if predicted_ms is not None and gaps else None,
        "predicted_per_second": round(1000 * gaps / predicted_ms, 3) if predicted_ms else None,
        "queue_ms": ms(metrics.arrival_time, metrics.first_scheduled_time),
        "ttft_ms": ms(metrics.arrival_time, metrics.first_token_time),
        "total_ms": ms(metrics.arrival_time, metrics.finished_time),
        "preemptions": metrics.num_preemptions,
        "draft_n": metrics.num_draft_tokens,
        "draft_n_accepted": metrics.num_accepted_tokens,
    }


def with_timings(answer: dict[str, Any], outputs: list[RequestOutput]) -> dict[str, Any]:
    """`answer` with its `timings`: one request's object, or a list in the requests' order."""
    timings = [timings_of(output) for output in outputs]
    answer["timings"] = timings[0] if len(timings) == 1 else timings
    return answer


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_of(outputs: Iterable[RequestOutput], prompt_only: bool = False) -> UsageInfo:
    """Token counts of the latest outputs: the prompt once per request, every completion
    (none when only the prompt is reported: echo with max_tokens 0)."""
    prompt_tokens = completion_tokens = cached_tokens = 0
    for output in outputs:
        prompt_tokens += len(output.prompt_token_ids)
        cached_tokens += output.num_cached_tokens
        if not prompt_only:
            completion_tokens += sum(len(c.token_ids) for c in output.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def continuous_usage(body: object, latest: Iterable[RequestOutput], prompt_only: bool = False) -> UsageInfo | None:
    """stream_options.continuous_usage_stats: the usage so far, for every chunk."""
    options = getattr(body, "stream_options", None)
    if options is None or not options.continuous_usage_stats:
        return None
    return usage_of(latest, prompt_only)


async def collect_finals(stream: OutputStream) -> dict[str, RequestOutput]:
    """The final output of every request in the stream, by request id."""
    finals: dict[str, RequestOutput] = {}
    try:
        async for output in stream:
            if output.finished:
                finals[output.request_id] = output
    finally:
        stream.cancel()  # a no-op when all finished; aborts the rest if cancelled
    return finals
