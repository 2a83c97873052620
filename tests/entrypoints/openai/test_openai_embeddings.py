"""POST /v1/embeddings through the official openai client against a real `pagellm serve`.

Each embedding must equal the offline API's (LLM.embed) on the same model and settings,
in float JSON and in base64 (which the client asks for by default and decodes), for
text and token-id inputs; errors are 4xx bodies naming the field.
"""

from __future__ import annotations

import base64

import httpx2
import numpy as np
import pytest
from serve_helpers import get_metrics

TEXTS = ["The capital of France is", "a", "Paged attention keeps the KV cache in blocks of sixteen tokens."]


@pytest.fixture(scope="module")
def offline_embeddings(offline_llm):  # noqa: ANN001, ANN201
    return [np.array(o.outputs.embedding) for o in offline_llm.embed(TEXTS)]


def test_embeddings_equal_offline_in_float_and_base64(client, model_name, offline_embeddings, offline_llm):
    as_float = client.embeddings.create(model=model_name, input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model=model_name, input=TEXTS)  # the client's default, decoded by it
    for result in (as_float, as_base64):
        assert result.object == "list" and result.model == model_name
        assert [d.index for d in result.data] == [0, 1, 2]
        for data, expected in zip(result.data, offline_embeddings, strict=True):
            assert data.object == "embedding"
            np.testing.assert_allclose(np.array(data.embedding), expected, rtol=1e-5, atol=1e-6)
            assert abs(np.linalg.norm(data.embedding) - 1.0) < 1e-5  # L2-normalised by default
    num_tokens = sum(len(offline_llm.get_tokenizer().encode(text)) for text in TEXTS)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == num_tokens


def test_token_id_inputs_raw_base64_and_no_normalisation(server, model_name, offline_llm):
    ids = [[5, 17, 99, 3], [42]]
    body = {"model": model_name, "input": ids, "encoding_format": "base64", "normalize": False}
    response = httpx2.post(server.api_url + "/embeddings", json=body, headers=server.headers(), timeout=120)
    assert response.status_code == 200, response.text
    from pagellm import PoolingParams

    expected = offline_llm.embed(ids, PoolingParams(normalize=False))
    for data, reference in zip(response.json()["data"], expected, strict=True):
        vector = np.frombuffer(base64.b64decode(data["embedding"]), dtype="<f4")
        np.testing.assert_allclose(vector, reference.outputs.embedding, rtol=1e-5, atol=1e-5)
    one = httpx2.post(server.api_url + "/embeddings", json={"input": [5, 17, 99, 3]}, headers=server.headers(), timeout=120)
    assert len(one.json()["data"]) == 1 and one.json()["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize(
    "body,param,status",
    [
        ({"input": "hi", "dimensions": 8}, "dimensions", 400),  # not a Matryoshka model
        ({"input": ""}, None, 400),  # nothing to embed
        ({"input": []}, None, 400),
        ({"input": [1, 2, 10**9]}, "input", 400),  # beyond the vocabulary
        ({"input": "hi", "encoding_format": "int8"}, None, 400),
        ({"input": "hi", "model": "other"}, "model", 404),
        ({"input": [5] * 17000}, "input", 400),  # beyond max_model_len
    ],
)
def test_bad_inputs_are_4xx_with_the_field(server, body, param, status):
    response = httpx2.post(server.api_url + "/embeddings", json=body, headers=server.headers(), timeout=120)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param


def test_embeddings_are_counted_in_metrics(client, model_name, server):
    before = get_metrics(server.base_url).get("pagellm:embedding_requests_total", 0.0)
    client.embeddings.create(model=model_name, input=["one", "two"])
    after = get_metrics(server.base_url)["pagellm:embedding_requests_total"]
    assert after == before + 2
