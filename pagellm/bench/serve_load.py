"""Bench stage: the load generator of `pagellm bench serve`: one streaming request
(the arrival schedule is pagellm/workload/arrivals.py), and the runner that sends a whole workload to one server.

One asyncio task per request, sent at its arrival time (Poisson or gamma gaps), with at
most --max-concurrency in flight (a semaphore). A request never raises: its failure
(connection, HTTP status, error event in the stream, timeout) is recorded with its error.
What each time means is in serve_metrics.py. httpx2 is imported only when requests run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagellm.bench.serve_metrics import RequestRecord
from pagellm.errors import ConfigError, PagellmError
from pagellm.workload.arrivals import arrival_times

logger = logging.getLogger(__name__)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PROMPT_FORMATS = ("ids", "text")
API_KEY_ENV = "OPENAI_API_KEY"
MAX_ERROR_TEXT = 300  # characters of a server's error body kept per failed request


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str  # scheme://host:port, without /v1
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(
                f"--endpoint must be one of {tuple(ENDPOINTS)}, got {self.endpoint!r}"
            )
        if not (self.request_rate > 0):
            raise ConfigError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ConfigError(f"--burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if not (self.request_timeout_s > 0):
            raise ConfigError(f"--request-timeout must be > 0, got {self.request_timeout_s}")

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class ServeBenchRun:
    records: list[RequestRecord]
    duration_s: float  # benchmark start to the last request's end


# ---------------------------------------------------------------- requests


def normalize_base_url(url: str) -> str:
    """`http://host:8000/v1/` -> `http://host:8000` (the endpoint paths add /v1)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--base-url must start with http:// or https://, got {url!r}")
    return url.removesuffix("/v1")


def request_body(
    config: ServeBenchConfig, prompt: list[int] | str, output_len: int
) -> dict[str, Any]:
    """The streaming request for one prompt: exactly output_len tokens (ignore_eos)."""
    body: dict[str, Any] = {}
    if config.model is not None:
        body["model"] = config.model
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(
        max_tokens=output_len,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    body.update(config.extra_body)
    return body


def carries_tokens(chunk: dict[str, Any], endpoint: str) -> bool:
    """Whether a stream chunk carries generated tokens.

    Not counted: the usage-only final chunk, chat's opening role-only chunk, and a closing
    chunk with empty text that only reports finish_reason. An empty-text chunk before the
    end is counted: pagellm sends one for a token that ends inside a UTF-8 character.
    """
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text is None:
                text = delta.get("reasoning_content")
            if "role" in delta and not text:
                continue
        else:
            text = choice.get("text")
        if text is None:
            continue
        if text or choice.get("finish_reason") is None:
            return True
    return False


def error_message(text: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), FastAPI's
    {"detail": ...}, or the text itself; cut to MAX_ERROR_TEXT characters."""
    text = text.strip()
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("detail"))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            text = str(error)
    return text[:MAX_ERROR_TEXT]


def error_text(status_code: int, body: bytes) -> str:
    """`HTTP 401: <the server's message>` from an error response."""
    return f"HTTP {status_code}: {error_message(body.decode('utf-8', errors='replace'))}"


def describe_exception(e: BaseException) -> str:
    """`ReadError: <message> (<its cause, when that says more>)`."""
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" ({cause})"
    return text[:MAX_ERROR_TEXT]


async def send_request(
    client: Any,  # httpx2.AsyncClient
    config: ServeBenchConfig,
    record: RequestRecord,
    body: dict[str, Any],
    bench_start: float,
) -> None:
    """Send one streaming request and fill `record`; never raises (but on cancellation)."""
    # Encoded before the clock starts: a long id list takes a while to serialize.
    content = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **config.headers()}
    sent = time.perf_counter()
    record.sent_s = sent - bench_start
    usage: dict[str, Any] | None = None
    error: str | None = None
    try:
        async with asyncio.timeout(config.request_timeout_s):
            async with client.stream(
                "POST", config.url, content=content, headers=headers
            ) as response:
                if response.status_code != 200:
                    error = error_text(response.status_code, await response.aread())
                else:
                    async for line in sse_lines(response.aiter_text()):
                        now = time.perf_counter()
                        if not line.startswith("data:"):
                            continue  # blank separators, comments, event names
                        data = line[len("data:") :].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if not isinstance(chunk, dict):
                            continue
                        if chunk.get("error"):
                            error = "error in stream: " + error_message(data)
                            break
                        if isinstance(chunk.get("usage"), dict):
                            usage = chunk["usage"]
                        if carries_tokens(chunk, config.endpoint):
                            record.chunk_times_s.append(now - sent)
    except TimeoutError:
        error = f"timed out after {config.request_timeout_s:g} s"
    except json.JSONDecodeError as e:
        error = f"malformed stream chunk: {e}"
    except Exception as e:  # noqa: BLE001 - any failure of one request is counted, not raised
        error = describe_exception(e)
    record.end_s = time.perf_counter() - bench_start
    if error is None and not record.chunk_times_s and record.expected_output_len > 0:
        error = "the stream ended without any generated token"
    record.error = error
    record.success = error is None
    if record.chunk_times_s:
        record.ttft_s = record.chunk_times_s[0]
    completion_tokens = usage.get("completion_tokens") if usage else None
    if isinstance(completion_tokens, int):
        record.output_tokens = completion_tokens
        record.output_tokens_from_usage = True
    else:
        record.output_tokens = len(record.chunk_times_s)
    prompt_tokens = usage.get("prompt_tokens") if usage else None
    record.prompt_tokens = prompt_tokens if isinstance(prompt_tokens, int) else record.prompt_len


async def run_requests(
    config: ServeBenchConfig,
    prompts: Sequence[list[int] | str],
    output_lens: Sequence[int],
    prompt_lens: Sequence[int],
    show_progress: bool = False,
) -> ServeBenchRun:
    """Send every prompt at its arrival time (one task each, at most max_concurrency in
    flight) and wait for all; returns the filled records."""
    import httpx2
    from tqdm import tqdm

    schedule = arrival_times(len(prompts), config.request_rate, config.burstiness, config.seed)
    limit = config.max_concurrency
    semaphore = asyncio.Semaphore(limit) if limit else None
    records = [
        RequestRecord(index=i, prompt_len=prompt_lens[i], expected_output_len=output_lens[i],
                      scheduled_s=schedule[i])
        for i in range(len(prompts))
    ]  # fmt: skip
    progress = tqdm(total=len(prompts), desc="requests", disable=not show_progress, file=sys.stderr)

    async def one(record: RequestRecord, bench_start: float) -> None:
        body = request_body(config, prompts[record.index], record.expected_output_len)
        if semaphore is None:
            await send_request(client, config, record, body, bench_start)
        else:
            async with semaphore:
                await send_request(client, config, record, body, bench_start)
        progress.update(1)

    # trust_env=False: no proxy from the environment; requests go to the URL given.
    async with httpx2.AsyncClient(
        timeout=httpx2.Timeout(config.request_timeout_s),
        limits=httpx2.Limits(max_connections=limit, max_keepalive_connections=limit),
        trust_env=False,
    ) as client:
        bench_start = time.perf_counter()
        tasks = []
        for record in records:
            delay = bench_start + record.scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(record, bench_start)))
        await asyncio.gather(*tasks)
        duration = max((r.end_s for r in records), default=0.0)
    progress.close()
    return ServeBenchRun(records=records, duration_s=duration)


async def fetch_model_name(config: ServeBenchConfig) -> str | None:
    """The first model the server lists at /v1/models, or None when it cannot say."""
    import httpx2

    try:
        async with httpx2.AsyncClient(timeout=10.0, trust_env=False) as client:
            response = await client.get(config.base_url + "/v1/models", headers=config.headers())
            response.raise_for_status()
            models = response.json().get("data") or []
            return str(models[0]["id"]) if models else None
    except Exception as e:  # noqa: BLE001 - the benchmark itself will report the failures
        logger.warning(
            "could not list the models at %s/v1/models (%s: %s); requests go without a model name",
            config.base_url, type(e).__name__, e,
        )  # fmt: skip
        return None


async def detokenize_prompts(
    config: ServeBenchConfig, prompts: Sequence[list[int]]
) -> list[str]:
    """Text prompts made by the server's own /detokenize (pagellm, vLLM, llama.cpp)."""
    import httpx2

    texts = []
    async with httpx2.AsyncClient(timeout=60.0, trust_env=False) as client:
        for ids in prompts:
            body: dict[str, Any] = {"tokens": ids}
            if config.model is not None:
                body["model"] = config.model
            try:
                response = await client.post(
                    config.base_url + "/detokenize", json=body, headers=config.headers()
                )
                if response.status_code != 200:
                    raise PagellmError(error_text(response.status_code, response.content))
                payload = response.json()
                text = payload.get("prompt", payload.get("content"))
                if not isinstance(text, str):
                    raise PagellmError(f"unexpected answer {str(payload)[:200]}")
            except (PagellmError, httpx2.HTTPError, ValueError) as e:
                raise PagellmError(
                    f"text prompts (--prompt-format text, --endpoint chat) are made with the "
                    f"server's /detokenize, which failed at {config.base_url}/detokenize: {e}"
                ) from None
            texts.append(text)
    return texts


async def sse_lines(text: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of an event stream, split only where SSE splits them (\n, \r\n, \r):
    generic line readers also split at U+2028, U+0085 and the like, which may sit inside
    a JSON string of an event."""
    pending = ""
    async for chunk in text:
        pending += chunk
        *lines, pending = pending.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for line in lines:
            yield line
    if pending:
        yield pending
