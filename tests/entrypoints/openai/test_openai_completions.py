"""POST /v1/completions through the official openai client against a real `pagellm serve`.

Greedy answers must equal the offline API's (pagellm.LLM) on the same model and settings.
"""

from __future__ import annotations

import json

import httpx2
import openai
import pytest
from serve_helpers import greedy_offline

PROMPT = "The capital of France is"


def test_models_lists_the_served_model(client, model_name, server):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    raw = httpx2.get(server.api_url + "/models", headers=server.headers()).json()
    assert raw["data"][0]["max_model_len"] == 16384
    # The SDK's models.retrieve: the same card; an unknown name is the API's 404.
    assert client.models.retrieve(model_name).model_dump() == models[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/no-such-model")


def test_greedy_completion_equals_offline(client, model_name, offline_llm):
    expected = greedy_offline(offline_llm, PROMPT, max_tokens=20)
    result = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=20, temperature=0
    )
    choice = result.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert result.object == "text_completion" and result.model == model_name
    num_prompt = len(expected.prompt_token_ids)
    num_completion = len(expected.outputs[0].token_ids)
    assert result.usage.prompt_tokens == num_prompt
    assert result.usage.completion_tokens == num_completion
    assert result.usage.total_tokens == num_prompt + num_completion


def test_streaming_completion_adds_up_to_offline(client, model_name, offline_llm):
    expected = greedy_offline(offline_llm, PROMPT, max_tokens=30, ignore_eos=True)
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    # The usage chunk comes last, with no choices.
    assert not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert len({c.id for c in chunks}) == 1


def test_stream_is_server_sent_events_ending_with_done(server, model_name):
    body = {"model": model_name, "prompt": "hi", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx2.stream(
        "POST", server.api_url + "/completions", json=body, headers=server.headers(), timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line[len("data: ") :]) for line in events[:-1]]
    assert payloads and all(p["object"] == "text_completion" for p in payloads)


def test_every_prompt_form(client, model_name, offline_llm):
    """A string, a list of strings, token ids and lists of token ids: one choice each."""
    token_prompt = [72, 101, 108, 108, 111]
    expected_text = greedy_offline(offline_llm, "abc", 8).outputs[0].text
    expected_ids = greedy_offline(offline_llm, token_prompt, 8).outputs[0].text

    single = client.completions.create(model=model_name, prompt=token_prompt, max_tokens=8, temperature=0)
    assert [c.text for c in single.choices] == [expected_ids]

    many = client.completions.create(
        model=model_name, prompt=["abc", "abc", "abc"], max_tokens=8, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [expected_text] * 3
    assert many.usage.prompt_tokens == 3 * 3

    mixed_ids = client.completions.create(
        model=model_name, prompt=[token_prompt, list(b"abc")], max_tokens=8, temperature=0
    )
    assert [c.text for c in mixed_ids.choices] == [expected_ids, expected_text]


def test_echo_puts_the_prompt_in_front(client, model_name, offline_llm):
    expected = greedy_offline(offline_llm, PROMPT, 6).outputs[0].text
    result = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert result.choices[0].text == PROMPT + expected
    streamed = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + expected


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, model_name, offline_llm):
    # The scoring idiom: the prompt back with its logprobs, no generated token.
    from pagellm import SamplingParams

    reference = offline_llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    result = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = result.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert result.usage.completion_tokens == 0 and result.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert choice.logprobs.token_logprobs[0] is None
    expected = [entry[token].logprob for token, entry in zip(reference.prompt_token_ids[1:], reference.prompt_logprobs[1:])]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    streamed = list(
        client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=0, echo=True, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT
    assert streamed[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0)


def test_the_prompt_alone_ends_at_length_even_when_the_hidden_token_is_eos(client, model_name, offline_llm):
    # The engine computes one token it does not report; when that token is EOS the
    # answer still ends at the length the request asked for, whole and streamed.
    eos = offline_llm.get_tokenizer().eos_token_id
    kwargs = {"model": model_name, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logit_bias": {str(eos): 100}}
    assert client.completions.create(**kwargs).choices[0].finish_reason == "length"
    streamed = client.completions.create(stream=True, **kwargs)
    assert [c.finish_reason for chunk in streamed for c in chunk.choices if c.finish_reason] == ["length"]
    with_eos = client.completions.create(**{**kwargs, "max_tokens": 1})
    assert with_eos.choices[0].finish_reason == "stop"  # the bias does make that token EOS


def test_continuous_usage_stats_put_usage_in_every_chunk(client, model_name):
    for create, kwargs in (
        (client.completions.create, {"prompt": PROMPT}),
        (client.chat.completions.create, {"messages": [{"role": "user", "content": PROMPT}]}),
    ):
        chunks = list(
            create(
                model=model_name, max_tokens=6, temperature=0, stream=True, **kwargs,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
        # Every chunk of tokens carries the usage so far (the chat's opening role chunk
        # comes before any output).
        with_tokens = [c for c in chunks[1:] if c.choices]
        counted = [c.usage.completion_tokens for c in with_tokens]
        assert len(counted) >= 2 and counted == sorted(counted) and counted[-1] == 6
        assert chunks[-1].usage.completion_tokens == 6


def test_stop_token_ids_and_ignore_eos_and_min_tokens(client, model_name, offline_llm):
    reference = greedy_offline(offline_llm, PROMPT, 12, ignore_eos=True).outputs[0]
    stop_id = reference.token_ids[4]
    first = reference.token_ids.index(stop_id)
    result = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "ignore_eos": True},
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert result.usage.completion_tokens == first + 1  # the stop token is generated
    assert choice.model_extra["stop_reason"] == stop_id

    full = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 12, "top_k": 5, "min_p": 0.0},
    )
    assert full.usage.completion_tokens == 12
    assert full.choices[0].text == reference.text


def test_same_seed_same_sample(client, model_name):
    def sample(seed: int) -> str:
        result = client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        )
        return result.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1  # and seeds matter


def test_n_completions(client, model_name):
    result = client.completions.create(
        model=model_name, prompt=["a", "b"], n=3, max_tokens=5, temperature=1.0, seed=1,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in result.choices) == list(range(6))
    assert result.usage.completion_tokens == 6 * 5
    assert result.usage.prompt_tokens == 2
    streamed = client.completions.create(
        model=model_name, prompt="a", n=2, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1] != ""  # greedy: both the same


def test_stop_string_ends_the_text(client, model_name, offline_llm):
    reference = greedy_offline(offline_llm, PROMPT, 20, ignore_eos=True).outputs[0].text
    stop = reference[6:8]
    result = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == reference[: reference.index(stop)]
    assert choice.model_extra["stop_reason"] == stop
    streamed = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=20, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_logprobs(client, model_name, offline_llm):
    reference = greedy_offline(offline_llm, PROMPT, 6, logprobs=2).outputs[0]
    result = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(reference.token_ids)
    expected = [p[t].logprob for t, p in zip(reference.token_ids, reference.logprobs)]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens) == result.choices[0].text
    echoed = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True
    )
    prompt_len = len(PROMPT)  # byte-level tokenizer: one token per byte
    assert echoed.choices[0].logprobs.token_logprobs[0] is None
    assert len(echoed.choices[0].logprobs.tokens) == prompt_len + 2


def test_usage_says_how_many_prompt_tokens_came_from_the_prefix_cache(client, model_name):
    # A prompt of 40+ tokens (2 full blocks of 16) of its own, so no earlier test cached it.
    prompt = [17 + (i * 7) % 200 for i in range(40)]
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    stream = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
