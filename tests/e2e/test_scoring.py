"""Scores of text pairs (LLM.score) against an independent reference.

A cross-encoder (HF's *ForSequenceClassification with one label, Llama and Qwen3): each
pair is one prompt, the tokenizer's pair encoding, and the score the sigmoid of the head's
logit over its last token: equal to HF transformers' float32 logits of the same tokens
within 1e-5, under chunked prefill, prefix-cache hits (the query's blocks, shared by its
pairs) and a cache smaller than the pairs. Any other model: the cosine similarity of the
two texts' embeddings, equal to HF's last hidden states compared the same way.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_checks import assert_engine_drained
from hf_models import load_hf_reference, make_tiny_classifier_checkpoint, make_tiny_hf_checkpoint

from pagellm import LLM, PoolingParams, SamplingParams
from pagellm.errors import InvalidRequestError

# A query of 40 bytes: its first two blocks are shared by every pair that starts with it.
QUERY = "which engine keeps its KV cache in pages?"
DOCUMENTS = [
    "PagedAttention stores keys and values in fixed-size blocks.",
    "a",
    "The weather in Lisbon is mild in December, with some rain and long sunny afternoons.",
    "Continuous batching lets new requests join at every step.",
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def cross_encoder(request, tmp_path_factory):  # noqa: ANN001, ANN201
    import transformers

    folder = make_tiny_classifier_checkpoint(tmp_path_factory.mktemp(f"rerank-{request.param}"), request.param, seed=4)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, reference


@torch.inference_mode()
def reference_score(model: torch.nn.Module, token_ids: list[int]) -> float:
    """HF's head over the last token (one sequence, no padding), through a sigmoid."""
    logit = model(torch.tensor([token_ids])).logits[0, 0].double()
    return float(torch.sigmoid(logit))


def test_cross_encoder_scores_equal_hf_under_chunking_and_prefix_hits(cross_encoder):
    folder, model = cross_encoder
    llm = LLM(str(folder), dtype="float32", max_model_len=192, max_num_batched_tokens=16)
    config = llm.engine.model_config
    assert config.num_labels == 1 and not config.has_lm_head
    tokenizer = llm.get_tokenizer()
    outputs = llm.score(QUERY, DOCUMENTS)
    assert len(outputs) == len(DOCUMENTS)
    for output, document in zip(outputs, DOCUMENTS, strict=True):
        # The pair is one prompt: the byte tokenizer's pair template adds nothing between.
        assert output.prompt_token_ids == tokenizer.encode(QUERY) + tokenizer.encode(document)
        assert abs(output.outputs.score - reference_score(model, output.prompt_token_ids)) < 1e-5
    # Again: the query's full blocks come from the prefix cache, the scores do not change.
    hits = llm.engine.get_stats().num_prefix_hit_tokens
    again = llm.score(QUERY, DOCUMENTS[:1])
    assert abs(again[0].outputs.score - outputs[0].outputs.score) < 1e-6
    assert llm.engine.get_stats().num_prefix_hit_tokens - hits >= 32
    # Pairwise lists (N:N).
    pairwise = llm.score(DOCUMENTS[:2], DOCUMENTS[2:])
    for output in pairwise:
        assert abs(output.outputs.score - reference_score(model, output.prompt_token_ids)) < 1e-5
    assert_engine_drained(llm)


def test_many_pairs_through_a_small_cache(cross_encoder):
    """More pairs than the cache holds at once, several prefilling in each step: every
    score equals HF's and every block comes back. (A scoring request is preempted as an
    embedding request is: tests/e2e/test_embeddings.py covers that path; a classifier
    cannot generate, so nothing here grows to force it.) A classifier refuses to generate."""
    folder, model = cross_encoder
    llm = LLM(
        str(folder), dtype="float32", max_model_len=128, num_gpu_blocks_override=10, enable_prefix_caching=False,
        max_num_batched_tokens=48,
    )  # fmt: skip
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    pairs = [tokenizer.encode_pair(QUERY, document) for document in DOCUMENTS] * 2
    for i, ids in enumerate(pairs):
        engine.add_request(f"pair-{i}", ids, PoolingParams(task="classify"))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    for i, ids in enumerate(pairs):
        logits = finished[f"pair-{i}"].embedding
        assert len(logits) == 1
        assert abs(float(torch.sigmoid(torch.tensor(logits[0], dtype=torch.float64))) - reference_score(model, ids)) < 1e-5
    with pytest.raises(InvalidRequestError, match="sequence classifier") as error:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert error.value.parameter == "model"
    assert_engine_drained(llm)


def test_a_model_without_a_head_scores_by_embedding_similarity(tmp_path):
    folder = make_tiny_hf_checkpoint(tmp_path / "bi", "llama", seed=8)
    model = load_hf_reference(folder)
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    tokenizer = llm.get_tokenizer()
    outputs = llm.score(QUERY, DOCUMENTS)
    with torch.inference_mode():
        def embed(text: str) -> torch.Tensor:
            hidden = model.model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1].double()
            return torch.nn.functional.normalize(hidden, dim=0)

        query = embed(QUERY)
        for output, document in zip(outputs, DOCUMENTS, strict=True):
            assert abs(output.outputs.score - float(query @ embed(document))) < 1e-5
            assert output.prompt_token_ids == tokenizer.encode(QUERY) + tokenizer.encode(document)
    with pytest.raises(InvalidRequestError, match="no classification head") as error:
        llm.embed([[5, 6]], PoolingParams(task="classify"))
    assert error.value.parameter == "model"
    assert_engine_drained(llm)


def test_pairing_rules_and_bad_inputs(cross_encoder, tmp_path):
    folder, _ = cross_encoder
    llm = LLM(str(folder), dtype="float32", max_model_len=32)
    one = llm.score(["a b"], ["c", "d"])  # a list of one: against each
    assert len(one) == 2
    for text_1, text_2, field, message in [
        ("a", [], "text_2", "at least one"),
        ("", "b", "text_1", "empty"),
        (["a", "b"], ["c", "d", "e"], "text_2", "same length"),
        ("a", [3], "text_2", "list of texts"),
    ]:
        with pytest.raises(InvalidRequestError, match=message) as error:
            llm.score(text_1, text_2)
        assert error.value.parameter == field
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.score("q", "x" * 40)  # the pair is longer than the context
    with pytest.raises(InvalidRequestError, match="do not apply"):
        PoolingParams(task="classify", normalize=True)
    with pytest.raises(InvalidRequestError, match="task must be one of"):
        PoolingParams(task="rank")
    assert_engine_drained(llm)
    # A classifier of several labels has logits, not one score.
    many = make_tiny_classifier_checkpoint(tmp_path / "three", "llama", seed=2, num_labels=3)
    assert len(json.loads((many / "config.json").read_text())["id2label"]) == 3
    llm3 = LLM(str(many), dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="3 labels"):
        llm3.score("a", "b")
    logits = llm3.embed([[5, 6, 7]], PoolingParams(task="classify"))[0].outputs.embedding
    assert len(logits) == 3


def test_tensor_parallel_ranks_score_as_one(tmp_path):
    """The head is replicated on every rank (its input, the final hidden state, is whole
    after the last all-reduce): two ranks give the one-process scores."""
    import transformers

    folder = make_tiny_classifier_checkpoint(tmp_path / "tp", "llama", seed=6)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    # Shut down at the end (with): rank 0's process group lives in this test process.
    with LLM(str(folder), dtype="float32", max_model_len=128, tensor_parallel_size=2) as llm:
        for output in llm.score(QUERY, DOCUMENTS):
            assert abs(output.outputs.score - reference_score(model, output.prompt_token_ids)) < 1e-5
        assert_engine_drained(llm)
