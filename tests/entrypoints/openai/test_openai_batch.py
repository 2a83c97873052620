"""The Files and Batch API on a live server, through the official openai client: upload,
create, poll, download; lines that fail alone; cancel; a restart in the middle of a batch;
the errors; `pagellm run-batch` offline. Every line's answer equals the same request sent
directly (greedy), so a batch line is exactly a request, run in the background."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx2
import openai
import pytest
from serve_helpers import API_KEY, ServerProcess, engine_drained, get_metrics, wait_until

FINAL = ("completed", "failed", "expired", "cancelled")


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat_body(model: str, i: int, max_tokens: int = 6) -> dict:
    # A shared system prompt: the lines hit each other's blocks in the prefix cache.
    messages = [{"role": "system", "content": "You answer in one word. " * 8}, {"role": "user", "content": f"Item {i}?"}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def upload(client: openai.OpenAI, lines: list[str]):  # noqa: ANN201
    return client.files.create(file=("input.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")


def wait_for(client: openai.OpenAI, batch_id: str, statuses=FINAL, timeout_s: float = 120):  # noqa: ANN001, ANN201
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b, timeout_s)


def results(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(text) for text in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def batch_server(tiny_model, tmp_path_factory):  # noqa: ANN001, ANN201
    directory = tmp_path_factory.mktemp("batches")
    process = ServerProcess(["--model", tiny_model, "--max-model-len", "512", "--max-num-seqs", "4",
                             "--batch-dir", str(directory), "--max-batch-file-bytes", "200000"], api_key=API_KEY)  # fmt: skip
    yield process
    assert process.stop(signal.SIGINT) == 0, process.log


@pytest.fixture
def bclient(batch_server):  # noqa: ANN001, ANN201
    with openai.OpenAI(base_url=batch_server.api_url, api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


def test_a_batch_runs_end_to_end_and_bad_lines_fail_alone(bclient, batch_server, model_name):
    lines = [line(f"ok-{i}", chat_body(model_name, i)) for i in range(6)]
    lines.insert(2, "this is not JSON")
    lines.insert(4, line("bad-body", {**chat_body(model_name, 9), "max_tokens": -1}))
    lines.append(line("wrong-url", chat_body(model_name, 1), url="/v1/completions"))
    lines.append(line("ok-0", chat_body(model_name, 0)))  # a duplicate custom_id
    file = upload(bclient, lines)
    assert file.purpose == "batch" and file.bytes > 0
    batch = bclient.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                                   metadata={"job": "nightly"},
                                   output_expires_after={"anchor": "created_at", "seconds": 7200})  # fmt: skip
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_for(bclient, batch.id)
    assert done.status == "completed"
    for result_id in (done.output_file_id, done.error_file_id):  # the results' lifetime as asked
        result_file = bclient.files.retrieve(result_id)
        assert result_file.expires_at == result_file.created_at + 7200
    assert bclient.files.retrieve(file.id).expires_at is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (10, 6, 4)
    outputs = results(bclient, done.output_file_id)
    assert [r["custom_id"] for r in outputs] == [f"ok-{i}" for i in range(6)]  # input order
    assert done.model == model_name
    assert done.usage.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in outputs)
    assert done.usage.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in outputs) > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    for i, record in enumerate(outputs):
        direct = bclient.chat.completions.create(**chat_body(model_name, i))
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200 and record["error"] is None
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert body["usage"]["completion_tokens"] == direct.usage.completion_tokens
    errors = {r["custom_id"]: r for r in results(bclient, done.error_file_id)}
    assert set(errors) == {None, "bad-body", "wrong-url", "ok-0"}
    assert errors[None]["error"]["code"] == "invalid_json" and errors[None]["response"] is None
    assert errors["bad-body"]["response"]["status_code"] == 400
    assert errors["bad-body"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert errors["wrong-url"]["error"]["code"] == "mismatched_url"
    assert errors["ok-0"]["error"]["code"] == "duplicate_custom_id"
    metrics = get_metrics(batch_server.base_url)
    assert metrics['pagellm:batch_requests_total{outcome="completed"}'] >= 6
    assert metrics['pagellm:batch_requests_total{outcome="failed"}'] >= 4
    assert wait_until(lambda: engine_drained(batch_server.base_url))
    # Listed, newest first; the input and both result files are listed too.
    assert bclient.batches.list(limit=1).data[0].id == batch.id
    assert {done.output_file_id, done.error_file_id, file.id} <= {f.id for f in bclient.files.list().data}


def test_score_and_rerank_batches(bclient, batch_server, model_name):
    query, documents = "paged attention", ["blocks of keys", "the weather", "continuous batching"]
    for endpoint, body in (("/v1/rerank", {"query": query, "documents": documents}),
                           ("/v1/score", {"text_1": query, "text_2": documents})):  # fmt: skip
        file = upload(bclient, [line("r0", {"model": model_name, **body}, url=endpoint)])
        done = wait_for(bclient, bclient.batches.create(input_file_id=file.id, endpoint=endpoint,  # type: ignore[arg-type]
                                                        completion_window="24h").id)  # fmt: skip
        assert done.status == "completed" and done.request_counts.completed == 1
        record = results(bclient, done.output_file_id)[0]
        direct = httpx2.post(batch_server.api_url + endpoint[3:], json=body, headers=batch_server.headers(), timeout=60)
        assert record["response"]["status_code"] == 200 and record["response"]["body"]["model"] == model_name
        for key in ("results", "data"):
            if key in direct.json():
                got = record["response"]["body"][key]
                assert [r.get("index") for r in got] == [r.get("index") for r in direct.json()[key]]
        assert done.usage.input_tokens > 0


def test_an_embeddings_batch(bclient, model_name):
    inputs = ["alpha", "beta gamma", [5, 6, 7]]
    file = upload(bclient, [line(f"e{i}", {"model": model_name, "input": x}, url="/v1/embeddings") for i, x in enumerate(inputs)])
    done = wait_for(bclient, bclient.batches.create(input_file_id=file.id, endpoint="/v1/embeddings",
                                                    completion_window="24h").id)  # fmt: skip
    assert done.status == "completed" and done.request_counts.completed == 3
    for i, record in enumerate(results(bclient, done.output_file_id)):
        direct = bclient.embeddings.create(model=model_name, input=inputs[i])
        assert record["response"]["body"]["data"][0]["embedding"] == pytest.approx(direct.data[0].embedding, abs=1e-6)


def test_cancel_stops_a_batch_and_frees_everything(bclient, batch_server, model_name):
    file = upload(bclient, [line(f"long-{i}", {**chat_body(model_name, i), "max_tokens": 400, "ignore_eos": True})
                            for i in range(40)])  # fmt: skip
    batch = bclient.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(bclient, batch.id, statuses=("in_progress",))
    cancelling = bclient.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(bclient, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts.completed < 40
    assert len(results(bclient, done.output_file_id)) == done.request_counts.completed
    assert wait_until(lambda: engine_drained(batch_server.base_url))  # no request, no block left
    assert bclient.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing


def test_the_files_and_batches_errors(bclient, batch_server):
    with pytest.raises(openai.NotFoundError):
        bclient.files.retrieve("file-doesnotexist")
    with pytest.raises(openai.NotFoundError):
        bclient.batches.retrieve("batch_doesnotexist")
    with pytest.raises(openai.NotFoundError):
        bclient.batches.create(input_file_id="file-doesnotexist", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as bad_purpose:
        bclient.files.create(file=("x.jsonl", b"{}\n"), purpose="nonsense")
    assert bad_purpose.value.body["param"] == "purpose"
    other = bclient.files.create(file=("x.jsonl", b"{}\n"), purpose="user_data")
    with pytest.raises(openai.BadRequestError) as not_batch:
        bclient.batches.create(input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert not_batch.value.body["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError):
        bclient.batches.create(input_file_id=other.id, endpoint="/v1/moderations", completion_window="24h")
    with pytest.raises(openai.APIStatusError) as too_large:
        bclient.files.create(file=("big.jsonl", b"x" * 300_000), purpose="batch")
    assert too_large.value.status_code == 413
    empty = upload(bclient, [])
    failed = wait_for(bclient, bclient.batches.create(input_file_id=empty.id, endpoint="/v1/completions",
                                                      completion_window="24h").id)  # fmt: skip
    assert failed.status == "failed" and failed.errors.data[0].code == "empty_file"
    with pytest.raises(openai.ConflictError):  # an ended batch cannot be cancelled
        bclient.batches.cancel(failed.id)
    # OpenAI's expires_after: an hour to 30 days after creation, both fields.
    expiring = bclient.files.create(file=("e.jsonl", b"{}\n"), purpose="batch",
                                    expires_after={"anchor": "created_at", "seconds": 3600})  # fmt: skip
    assert expiring.expires_at == expiring.created_at + 3600
    assert bclient.files.retrieve(expiring.id).expires_at == expiring.expires_at
    for seconds in (60, 40 * 24 * 3600):
        with pytest.raises(openai.BadRequestError):
            bclient.files.create(file=("e.jsonl", b"{}\n"), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": seconds})  # fmt: skip
    # Seconds alone take the only anchor there is; an anchor alone (no lifetime) is refused,
    # as the published schema says (dependentRequired).
    seconds_only = bclient.files.create(file=("e.jsonl", b"{}\n"), purpose="batch", extra_body={"expires_after[seconds]": "3600"})
    assert seconds_only.expires_at == seconds_only.created_at + 3600
    with pytest.raises(openai.BadRequestError) as half:
        bclient.files.create(file=("e.jsonl", b"{}\n"), purpose="batch", extra_body={"expires_after[anchor]": "created_at"})
    assert half.value.body["param"] == "expires_after"
    with pytest.raises(openai.BadRequestError):
        bclient.batches.create(input_file_id=expiring.id, endpoint="/v1/completions", completion_window="24h",
                               output_expires_after={"anchor": "created_at", "seconds": 10})  # fmt: skip
    deleted = bclient.files.delete(other.id)
    assert deleted.deleted and deleted.id == other.id
    with pytest.raises(openai.NotFoundError):
        bclient.files.content(other.id)
    # Without the key nothing is served.
    with openai.OpenAI(base_url=batch_server.api_url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.files.list()


def test_a_restart_in_the_middle_resumes_the_batch(tiny_model, model_name, tmp_path):
    flags = ["--model", tiny_model, "--max-model-len", "512", "--max-num-seqs", "2", "--batch-dir", str(tmp_path)]
    bodies = [{**chat_body(model_name, i), "max_tokens": 120, "ignore_eos": True} for i in range(24)]
    server = ServerProcess(flags)
    try:
        with openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0, timeout=60) as client:
            file = upload(client, [line(f"r{i}", body) for i, body in enumerate(bodies)])
            batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
            wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3, 120)
    finally:
        server.process.kill()  # no clean shutdown: a crash in the middle
        server.stop()
    server = ServerProcess(flags)
    try:
        with openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0, timeout=60) as client:
            resumed = client.batches.retrieve(batch.id)
            assert resumed.status == "in_progress" and 3 <= resumed.request_counts.completed < 24
            done = wait_for(client, batch.id, timeout_s=180)
            assert done.status == "completed" and done.request_counts.completed == 24
            assert done.usage.output_tokens == 24 * 120  # the lines done before the crash count too
            outputs = results(client, done.output_file_id)
            assert [r["custom_id"] for r in outputs] == [f"r{i}" for i in range(24)]  # each exactly once
            for i in (0, 23):
                direct = client.chat.completions.create(**chat_body(model_name, i, 120), extra_body={"ignore_eos": True})
                assert outputs[i]["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    finally:
        assert server.stop(signal.SIGINT) == 0, server.log


def test_run_batch_offline(tiny_model, model_name, tmp_path, offline_llm):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [line(f"c{i}", chat_body(model_name, i)) for i in range(3)]
    lines.append(line("e", {"model": model_name, "input": "abc"}, url="/v1/embeddings"))
    lines.append("{broken")
    source.write_text("\n".join(lines) + "\n")
    finished = subprocess.run(
        [sys.executable, "-m", "pagellm.entrypoints.cli", "run-batch", str(source), str(target), "--model", tiny_model,
         "--max-model-len", "512"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    assert "4 lines completed, 1 failed" in finished.stdout
    records = [json.loads(text) for text in target.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["c0", "c1", "c2", "e", None]
    assert records[4]["error"]["code"] == "invalid_json"
    from pagellm import SamplingParams

    for i in range(3):
        expected = offline_llm.chat(chat_body(model_name, i)["messages"], SamplingParams(temperature=0, max_tokens=6),
                                    use_tqdm=False)[0]  # fmt: skip
        assert records[i]["response"]["body"]["choices"][0]["message"]["content"] == expected.outputs[0].text
