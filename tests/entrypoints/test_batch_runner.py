"""The batch runner (batch_runner.py) without a server: lines go through a fake route call,
so resuming from the results log, expiry and the files it writes are checked exactly."""

from __future__ import annotations

import asyncio
import json
import time

from pagellm.entrypoints.openai.batch_runner import BatchRunner
from pagellm.entrypoints.openai.batch_store import BatchStore, ResultsLog
from pagellm.entrypoints.openai.protocol_batch import FINAL_STATUSES, BatchCreateRequest


def lines(n: int) -> bytes:
    body = {"model": "m", "prompt": "x"}
    return "".join(json.dumps({"custom_id": f"c{i}", "url": "/v1/completions", "body": {**body, "n_": i}}) + "\n"
                   for i in range(n)).encode()  # fmt: skip


def run_until_final(store: BatchStore, runner: BatchRunner, batch_id: str) -> None:
    async def main() -> None:
        runner.start()
        deadline = time.monotonic() + 20
        while store.batch(batch_id).status not in FINAL_STATUSES:
            assert time.monotonic() < deadline, store.batch(batch_id)
            await asyncio.sleep(0.01)
        await runner.stop()

    asyncio.run(main())


def fake_call(calls: list[int]):  # noqa: ANN201
    async def call(path: str, body: dict) -> tuple[int, dict]:
        calls.append(body["n_"])
        await asyncio.sleep(0)
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        return 200, {"id": f"cmpl-{body['n_']}", "model": "m", "usage": usage}

    return call


def output_of(store: BatchStore, batch_id: str) -> list[dict]:
    batch = store.batch(batch_id)
    return [json.loads(text) for text in store.file_path(batch.output_file_id).read_text().splitlines()]


def test_a_resumed_batch_runs_only_the_lines_not_done(tmp_path):
    store = BatchStore(tmp_path)
    file = store.add_file(lines(6), "in.jsonl", "batch")
    calls: list[int] = []
    runner = BatchRunner(store, fake_call(calls), max_in_flight=2)
    batch = runner.create(BatchCreateRequest(input_file_id=file.id, endpoint="/v1/completions"))
    # As if a crashed server had run lines 2 and 5 (file line numbers) and validated the batch.
    stored = store.batch(batch.id)
    stored.status, stored.request_counts.total = "in_progress", 6
    store.save_batch(stored)
    log = ResultsLog(store.results_path(batch.id))
    for number in (2, 5):
        usage = {"prompt_tokens": 3, "completion_tokens": 2}
        record = {"id": f"cmpl-{number - 1}", "custom_id": f"c{number - 1}",
                  "response": {"status_code": 200, "body": {"id": "x", "model": "m", "usage": usage}}, "error": None}  # fmt: skip
        log.append(number, True, record)
    log.close()
    run_until_final(store, BatchRunner(store, fake_call(calls), max_in_flight=2), batch.id)
    done = store.batch(batch.id)
    assert sorted(calls) == [0, 2, 3, 5]  # lines 1, 3, 4, 6 of the file
    assert done.status == "completed" and done.request_counts.completed == 6
    assert [r["custom_id"] for r in output_of(store, batch.id)] == [f"c{i}" for i in range(6)]
    assert (done.usage.input_tokens, done.usage.output_tokens) == (18, 12)
    assert done.finalizing_at is not None and done.error_file_id is None


def test_lines_not_run_by_the_deadline_expire(tmp_path):
    store = BatchStore(tmp_path)
    file = store.add_file(lines(3), "in.jsonl", "batch")
    calls: list[int] = []
    runner = BatchRunner(store, fake_call(calls), max_in_flight=2)
    batch = runner.create(BatchCreateRequest(input_file_id=file.id, endpoint="/v1/completions", completion_window="1h"))
    stored = store.batch(batch.id)
    stored.expires_at = int(time.time()) - 1
    store.save_batch(stored)
    run_until_final(store, runner, batch.id)
    done = store.batch(batch.id)
    assert done.status == "expired" and done.expired_at is not None and not calls
    assert done.request_counts.failed == 3 and done.output_file_id is None
    errors = [json.loads(t) for t in store.file_path(done.error_file_id).read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"c{i}", "batch_expired") for i in range(3)]


def test_only_the_routers_token_marks_a_request_background():
    """On a data-parallel replica, the router's batch lines carry a secret token; a client
    that sends the header without it gets no background treatment (nor the queue-limit
    exemption that comes with it)."""
    from pagellm.entrypoints.openai.serving_batch import BACKGROUND_HEADER, BackgroundHeaderMiddleware
    from pagellm.entrypoints.openai.serving_common import BACKGROUND

    seen: list[bool] = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        seen.append(BACKGROUND.get())

    middleware = BackgroundHeaderMiddleware(app, token="s3cret")

    async def call(headers: list[tuple[bytes, bytes]]) -> None:
        await middleware({"type": "http", "headers": headers}, None, None)

    for headers in ([(BACKGROUND_HEADER.encode(), b"s3cret")], [(BACKGROUND_HEADER.encode(), b"guess")], []):
        asyncio.run(call(headers))
    assert seen == [True, False, False]
    assert BACKGROUND.get() is False  # reset after the request
