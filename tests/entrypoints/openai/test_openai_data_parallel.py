"""`pagellm serve --data-parallel-size 2`: two engine replicas behind one endpoint.

Every request is answered exactly once, with the outputs one engine gives; requests that
share a long prefix land on the replica that holds it (seen in the per-replica prefix-hit
metrics); the load bound spreads a flood of one prefix over both; a replica that dies is
routed around while the other keeps serving.
"""

import os
import re
import signal
import threading
import time

import httpx2 as httpx
import pytest
from hf_models import make_tiny_hf_checkpoint
from serve_helpers import ServerProcess

from pagellm import LLM, SamplingParams

PREFIX = "".join(chr(ord("a") + i % 26) for i in range(80))  # 80 byte tokens = 5 full blocks


def start(folder: str, *extra: str) -> ServerProcess:
    return ServerProcess(["--model", folder, "--served-model-name", "tiny", "--data-parallel-size", "2", "--max-model-len", "512", *extra])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), max_position_embeddings=512))


@pytest.fixture(scope="module")
def server(tiny):
    process = start(tiny)
    yield process
    process.process.terminate()
    assert process.process.wait(60) == 0


def complete(client: httpx.Client, prompt: str, max_tokens: int = 8) -> httpx.Response:
    return client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_every_request_answered_once_as_one_engine_would(server, tiny):
    prompts = [f"request {i}: " + "xyz" * i for i in range(12)]
    with LLM(tiny, max_model_len=512) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        before = metric(client.get("/metrics").text, "pagellm:request_success_total")
        answers: dict[int, httpx.Response] = {}

        def send(i: int) -> None:
            answers[i] = complete(client, prompts[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        texts = [answers[i].json()["choices"][0]["text"] for i in range(len(prompts))]
        assert texts == expected
        assert len({answers[i].json()["id"] for i in answers}) == len(prompts)
        after = client.get("/metrics").text
    assert metric(after, "pagellm:request_success_total") - before == len(prompts)
    # Both replicas served some of them (equal loads take turns).
    assert all(metric(after, "pagellm:request_success_total", replica=r) > 0 for r in ("0", "1"))


def test_a_shared_prefix_lands_on_the_replica_that_holds_it(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        before = client.get("/metrics").text
        for i in range(4):  # one after another: the first caches the prefix, the rest hit it
            assert complete(client, "shared " + PREFIX + f" question {i}").status_code == 200
        after = client.get("/metrics").text
    hits = [metric(after, "pagellm:prefix_cache_hits_total", replica=r) - metric(before, "pagellm:prefix_cache_hits_total", replica=r) for r in ("0", "1")]
    assert max(hits) >= 3 * 80 and min(hits) == 0, hits
    assert metric(after, "pagellm:router_requests_total", reason="affinity") - metric(before, "pagellm:router_requests_total", reason="affinity") == 3


def test_embeddings_and_scores_are_routed_and_equal_one_engines(server, tiny):
    inputs = ["shared " + PREFIX + f" item {i}" for i in range(3)]
    with LLM(tiny, max_model_len=512) as llm:
        expected = [o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False)]
        scores = [o.outputs.score for o in llm.score(inputs[0], inputs[1:], use_tqdm=False)]
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        before = client.get("/metrics").text
        for text, reference in zip(inputs, expected, strict=True):  # one by one: later ones hit the prefix
            response = client.post("/v1/embeddings", json={"model": "tiny", "input": text, "encoding_format": "float"})
            assert response.status_code == 200, response.text
            got = response.json()["data"][0]["embedding"]
            assert max(abs(a - b) for a, b in zip(got, reference, strict=True)) < 1e-5
        after = client.get("/metrics").text
        message = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert message.status_code == 200 and message.json()["type"] == "message"  # Anthropic's route too
        score = client.post("/v1/score", json={"text_1": inputs[0], "text_2": inputs[1:]})
        rerank = client.post("/rerank", json={"query": inputs[0], "documents": inputs[1:]})
        assert score.status_code == 200 and rerank.status_code == 200, (score.text, rerank.text)
        assert max(abs(d["score"] - s) for d, s in zip(score.json()["data"], scores, strict=True)) < 1e-5
        assert {r["index"]: r["relevance_score"] for r in rerank.json()["results"]}.keys() == {0, 1}
    assert metric(after, "pagellm:embedding_requests_total") - metric(before, "pagellm:embedding_requests_total") == 3
    hits = [metric(after, "pagellm:prefix_cache_hits_total", replica=r) - metric(before, "pagellm:prefix_cache_hits_total", replica=r) for r in ("0", "1")]
    assert max(hits) >= 2 * 80, hits  # routed by the input's tokens to the replica holding the prefix


def test_a_flood_of_one_prefix_is_spread_by_the_load_bound(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        before = client.get("/metrics").text
        codes: list[int] = []

        def send(i: int) -> None:
            # Long enough that the flood is in flight at once even when the threads start
            # slowly (a busy machine): 48 tokens once let 14 of 16 finish one by one on a replica.
            codes.append(complete(client, "flood " + PREFIX + str(i), max_tokens=160).status_code)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = client.get("/metrics").text
    assert codes == [200] * 16
    routed = [metric(after, "pagellm:router_requests_total", replica=r) - metric(before, "pagellm:router_requests_total", replica=r) for r in ("0", "1")]
    assert sum(routed) == 16 and min(routed) >= 4, routed
    assert metric(after, "pagellm:router_requests_total", reason="balance") > metric(before, "pagellm:router_requests_total", reason="balance")


def test_a_dead_replica_is_routed_around(tiny):
    server = start(tiny)
    try:
        pids = {int(i): int(pid) for i, pid in re.findall(r"\[replica (\d)\] replica up at \S+, pid (\d+)", server.log)}
        assert sorted(pids) == [0, 1], server.log
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            assert complete(client, "warm up").status_code == 200
            os.kill(pids[1], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while client.get("/health").json().get("replicas_alive") != 1:
                assert time.monotonic() < deadline, "the router did not notice the dead replica"
                time.sleep(0.1)
            for i in range(6):  # every one is served by the survivor
                response = complete(client, f"after the crash {i}")
                assert response.status_code == 200, response.text
            assert client.get("/health").status_code == 200
            os.kill(pids[0], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while client.get("/health").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            response = complete(client, "nobody home")
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        assert server.process.wait(timeout=30) == 1  # none left: exit non-zero
    finally:
        if server.process.poll() is None:
            server.process.kill()


def test_replicas_on_ray_with_an_api_key(tiny):
    pytest.importorskip("ray")
    server = ServerProcess(
        ["--model", tiny, "--served-model-name", "tiny", "--data-parallel-size", "2", "--max-model-len", "512",
         "--distributed-executor-backend", "ray"],
        api_key="dp-key",
    )  # fmt: skip
    try:
        urls = re.search(r"data parallel: 2 replicas at (\S+), (\S+)\)", server.log).groups()
        with httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": "Bearer dp-key"}) as client:
            assert all(complete(client, f"ray {i}").status_code == 200 for i in range(4))
            routed = client.get("/metrics").text
            assert all(metric(routed, "pagellm:router_requests_total", replica=r) > 0 for r in ("0", "1"))
            # The replicas listen on the node's address: they want the key as well.
            direct = httpx.post(urls[0] + "/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert direct.status_code == 401
        assert httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401
    finally:
        server.process.terminate()
        assert server.process.wait(60) == 0


def test_stored_responses_are_found_on_the_replica_that_made_them(server):
    """The Responses API keeps a response in one replica's memory: its id names the
    replica, and GET, DELETE, cancel and previous_response_id go there, whichever replica
    the load would pick."""
    import openai

    with openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0, timeout=60) as client:
        made = [client.responses.create(model="tiny", input=f"turn {i} " + "abc" * i, max_output_tokens=4,
                                        temperature=0) for i in range(6)]  # fmt: skip
        ranks = {re.fullmatch(r"resp_r(\d+)_[0-9a-f]+", r.id).group(1) for r in made}
        assert ranks == {"0", "1"}  # both replicas stored some
        for response in made:
            assert client.responses.retrieve(response.id).output_text == response.output_text
            follow_up = client.responses.create(model="tiny", input="and then?", previous_response_id=response.id,
                                                max_output_tokens=4, temperature=0)  # fmt: skip
            assert follow_up.id.split("_")[1] == response.id.split("_")[1]  # the same replica
        client.responses.delete(made[0].id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made[0].id)
        for missing in ("resp_r7_0123abcd", "resp_nothing", made[0].id):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(missing)
        with pytest.raises(openai.NotFoundError) as previous:
            client.responses.create(model="tiny", input="x", previous_response_id="resp_r9_00ff", max_output_tokens=2)
        assert previous.value.body["param"] == "previous_response_id"


def test_a_batch_runs_across_the_replicas(server):
    """The router runs the Batch API: its lines reach both replicas, as background work."""
    import json

    import openai

    with openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0, timeout=60) as client:
        lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "tiny", "prompt": f"line {i} " + "q" * i, "max_tokens": 4,
                                      "temperature": 0}}) for i in range(8)]  # fmt: skip
        file = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert batch.status == "completed" and batch.request_counts.completed == 8
        outputs = [json.loads(t) for t in client.files.content(batch.output_file_id).text.splitlines()]
        for i, record in enumerate(outputs):
            direct = client.completions.create(model="tiny", prompt=f"line {i} " + "q" * i, max_tokens=4, temperature=0)
            assert record["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
        metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert metric(metrics, "pagellm:batch_requests_total", outcome="completed") == 8
    # Both replicas answered lines (the router spreads them by load).
    assert all(metric(metrics, "pagellm:router_requests_total", replica=r) > 0 for r in ("0", "1"))


def test_sleep_and_wake_up_reach_every_replica(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        before = complete(client, "sleep well").json()["choices"][0]["text"]
        asleep = client.post("/sleep", params={"level": 1})
        assert asleep.status_code == 200 and asleep.json()["is_sleeping"]
        state = client.get("/is_sleeping").json()
        assert state["is_sleeping"] and set(state["replicas"]) == {"0", "1"}
        assert complete(client, "sleep well").json()["choices"][0]["text"] == before  # woken by the request
        client.post("/wake_up")
        assert not any(replica["is_sleeping"] for replica in client.get("/is_sleeping").json()["replicas"].values())
