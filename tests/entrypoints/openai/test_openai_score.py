"""POST /v1/score and POST /v1/rerank against a real `pagellm serve`.

On the shared tiny causal model (no classification head) a score is the cosine similarity
of two embeddings; on a tiny cross-encoder (a sequence classifier with one label) it is
the sigmoid of the pair's logit. Either way the server's scores equal the offline API's
(LLM.score, itself tested against HF in tests/e2e/test_scoring.py); rerank orders the
documents by them; errors are 4xx bodies naming the field.
"""

from __future__ import annotations

import signal

import httpx2
import pytest
from hf_models import make_tiny_classifier_checkpoint
from serve_helpers import ENGINE_FLAGS, ServerProcess, engine_cli_flags, get_metrics

QUERY = "which engine keeps its KV cache in pages?"
DOCUMENTS = ["the weather is mild", "PagedAttention keeps keys and values in blocks", "a", "continuous batching"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, single_torch_thread):  # noqa: ANN001, ANN201
    from pagellm import LLM

    folder = make_tiny_classifier_checkpoint(tmp_path_factory.mktemp("reranker"), "qwen3", seed=5)
    flags = {**ENGINE_FLAGS, "max_model_len": 512}  # the tiny model's context
    process = ServerProcess(["--model", str(folder), *engine_cli_flags(**flags)])
    yield process, LLM(str(folder), **flags)
    assert process.stop(signal.SIGINT) == 0, process.log


def post(server: ServerProcess, path: str, body: dict, base: str | None = None) -> httpx2.Response:
    return httpx2.post((base or server.api_url) + path, json=body, headers=server.headers(), timeout=120)


def test_scores_equal_offline_by_embedding_similarity(server, model_name, offline_llm):
    response = post(server, "/score", {"model": model_name, "text_1": QUERY, "text_2": DOCUMENTS})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = offline_llm.score(QUERY, DOCUMENTS)
    assert body["object"] == "list" and body["model"] == model_name and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    for data, reference in zip(body["data"], expected, strict=True):
        assert data["object"] == "score"
        assert abs(data["score"] - reference.outputs.score) < 1e-5
    tokenizer = offline_llm.get_tokenizer()
    # Every text embedded once: the query and the documents.
    tokens = len(tokenizer.encode(QUERY)) + sum(len(tokenizer.encode(d)) for d in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    pairwise = post(server, "/score", {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:]}, base=server.base_url)
    assert pairwise.status_code == 200, pairwise.text  # vLLM's path without /v1
    for data, reference in zip(pairwise.json()["data"], offline_llm.score(DOCUMENTS[:2], DOCUMENTS[2:]), strict=True):
        assert abs(data["score"] - reference.outputs.score) < 1e-5


def test_rerank_orders_a_cross_encoders_scores(cross_encoder):
    server, offline = cross_encoder
    expected = [o.outputs.score for o in offline.score(QUERY, DOCUMENTS)]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    response = post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        assert abs(result["relevance_score"] - expected[result["index"]]) < 1e-5
        assert 0.0 < result["relevance_score"] < 1.0
    tokenizer = offline.get_tokenizer()
    assert body["usage"]["total_tokens"] == sum(len(tokenizer.encode_pair(QUERY, d)) for d in DOCUMENTS)
    for path in ("/rerank", "/v2/rerank"):  # the paths Jina's and Cohere's clients use
        top = post(server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False},
                   base=server.base_url)  # fmt: skip
        assert top.status_code == 200, top.text
        assert [r["index"] for r in top.json()["results"]] == order[:2]
        assert all("document" not in r for r in top.json()["results"])
    score = post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS[1]})
    assert abs(score.json()["data"][0]["score"] - expected[1]) < 1e-5


def test_a_cross_encoder_refuses_generation_and_counts_its_requests(cross_encoder):
    server, _ = cross_encoder
    chat = post(server, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
    assert "sequence classifier" in chat.json()["error"]["message"]
    before = get_metrics(server.base_url).get("pagellm:embedding_requests_total", 0.0)
    assert post(server, "/rerank", {"query": "q", "documents": ["x", "y", "z"]}).status_code == 200
    assert get_metrics(server.base_url)["pagellm:embedding_requests_total"] == before + 3


@pytest.mark.parametrize(
    "path,body,param,status",
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", 400),
        ("/score", {"text_1": "a", "text_2": []}, None, 400),
        ("/score", {"text_1": "", "text_2": "b"}, None, 400),
        ("/score", {"text_1": "a"}, None, 400),
        ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model", 404),
        ("/score", {"text_1": "a", "text_2": "x" * 20000}, "text_2", 400),  # beyond max_model_len
        ("/rerank", {"query": "q", "documents": []}, None, 400),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, None, 400),
        ("/rerank", {"query": "q", "documents": ["a"] * 10000}, "documents", 400),  # beyond the request limit
        ("/rerank", {"query": "q", "documents": [3]}, None, 400),
    ],
)
def test_bad_inputs_are_4xx_with_the_field(server, path, body, param, status):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param
