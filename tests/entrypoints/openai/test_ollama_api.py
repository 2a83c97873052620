"""Ollama's API through Ollama's own Python client (`ollama`): chat, generate, embed, list,
show and ps, streamed and not, against the offline API on the same tiny model."""

from __future__ import annotations

import math

import pytest
from serve_helpers import greedy_offline

ollama = pytest.importorskip("ollama")
GREEDY = {"temperature": 0, "num_predict": 8}
QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def client(server):
    return ollama.Client(host=server.base_url, headers=server.headers())


def test_models_are_listed_shown_and_loaded(client, model_name):
    listed = client.list().models
    assert [m.model for m in listed] == [model_name + ":latest"]
    assert listed[0].details.family == "llama" and listed[0].size > 0
    shown = client.show(model_name)
    assert shown.modelinfo["general.architecture"] == "llama" and "completion" in shown.capabilities
    assert shown.template  # the chat template the model uses
    assert [m.model for m in client.ps().models] == [model_name + ":latest"]
    assert client.show(model_name + ":latest").modelinfo == shown.modelinfo


def test_chat_equals_offline_chat_whole_and_streamed(client, model_name, offline_llm):
    expected = greedy_offline(offline_llm, "<user>Name a colour.\n<assistant>", 8)
    whole = client.chat(model=model_name, messages=QUESTION, options=GREEDY)
    assert whole.message.role == "assistant" and whole.message.content == expected.outputs[0].text
    assert whole.done and whole.done_reason in ("stop", "length") and whole.eval_count == len(expected.outputs[0].token_ids)
    assert whole.prompt_eval_count <= len(expected.prompt_token_ids) and whole.total_duration > 0
    pieces = list(client.chat(model=model_name + ":latest", messages=QUESTION, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in pieces) == expected.outputs[0].text
    assert pieces[-1].done and not any(p.done for p in pieces[:-1]) and pieces[-1].eval_count == whole.eval_count


def test_generate_templated_raw_and_continued(client, model_name, offline_llm):
    templated = client.generate(model=model_name, prompt="Name a colour.", options=GREEDY)
    expected = greedy_offline(offline_llm, "<user>Name a colour.\n<assistant>", 8)
    assert templated.response == expected.outputs[0].text
    assert list(templated.context) == [*expected.prompt_token_ids, *expected.outputs[0].token_ids]
    raw = client.generate(model=model_name, prompt="The sky is", raw=True, options=GREEDY)
    assert raw.response == greedy_offline(offline_llm, "The sky is", 8).outputs[0].text
    streamed = list(client.generate(model=model_name, prompt="The sky is", raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done
    # `context` continues an earlier answer: its token ids, then the new prompt's.
    more = client.generate(model=model_name, prompt=" and", raw=True, context=raw.context, options=GREEDY)
    continued = greedy_offline(offline_llm, [*raw.context, *offline_llm.get_tokenizer().encode(" and", add_special_tokens=False)], 8)
    assert more.response == continued.outputs[0].text


def test_embed_and_a_constrained_format(client, model_name, offline_llm):
    embedded = client.embed(model=model_name, input=["hello", "world"])
    assert len(embedded.embeddings) == 2
    assert all(math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-4) for vector in embedded.embeddings)
    reference = offline_llm.embed(["hello"], use_tqdm=False)[0].outputs.embedding
    assert embedded.embeddings[0] == pytest.approx(reference, abs=1e-5)
    answer = client.chat(model=model_name, messages=QUESTION, format={"type": "boolean"}, options={"temperature": 0, "num_predict": 6})
    from pagellm.structured_outputs_params import StructuredOutputsParams

    constrained = greedy_offline(offline_llm, "<user>Name a colour.\n<assistant>", 6, structured_outputs=StructuredOutputsParams(json={"type": "boolean"}))
    assert answer.message.content == constrained.outputs[0].text and answer.message.content.startswith(("true", "false"))


def test_errors_are_ollamas(client, model_name):
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="no-such-model", messages=QUESTION)
    assert missing.value.status_code == 404 and "not found" in missing.value.error
    with pytest.raises(ollama.ResponseError) as image:
        client.chat(model=model_name, messages=[{"role": "user", "content": "x", "images": ["aGk="]}])
    assert image.value.status_code == 400 and "images" in image.value.error
    with pytest.raises(ollama.ResponseError) as sampler:
        client.generate(model=model_name, prompt="x", options={"mirostat": 2})
    assert sampler.value.status_code == 400 and "mirostat" in sampler.value.error
