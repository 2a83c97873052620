"""POST /v1/chat/completions through the official openai client against a real server.

The reference is the offline API on the prompt the model's chat template makes.
"""

from __future__ import annotations

import pytest
from serve_helpers import greedy_offline

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def chat_prompt_ids(llm, messages) -> list[int]:  # noqa: ANN001
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_greedy_chat_equals_offline(client, model_name, offline_llm):
    prompt_ids = chat_prompt_ids(offline_llm, MESSAGES)
    expected = greedy_offline(offline_llm, prompt_ids, 16)
    result = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=16, temperature=0
    )
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert result.object == "chat.completion"
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert result.usage.total_tokens == len(prompt_ids) + len(expected.outputs[0].token_ids)


def test_streaming_chat_adds_up_to_offline(client, model_name, offline_llm):
    expected = greedy_offline(offline_llm, chat_prompt_ids(offline_llm, MESSAGES), 24, ignore_eos=True)
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_completion_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.outputs[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 24
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_text_content_parts_equal_a_string(client, model_name):
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    as_text = [{"role": "user", "content": "Name a colour."}]
    answers = [
        client.chat.completions.create(
            model=model_name, messages=m, max_tokens=8, temperature=0
        ).choices[0].message.content
        for m in (as_parts, as_text)
    ]
    assert answers[0] == answers[1]


def test_max_completion_tokens_wins_over_max_tokens(client, model_name):
    result = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=20,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.usage.completion_tokens == 3
    assert result.choices[0].finish_reason == "length"


def test_chat_n_choices(client, model_name):
    result = client.chat.completions.create(
        model=model_name, messages=MESSAGES, n=3, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.message.content for c in result.choices}) == 1  # greedy
    assert result.usage.completion_tokens == 12
    streamed = client.chat.completions.create(
        model=model_name, messages=MESSAGES, n=2, max_tokens=4, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] == result.choices[0].message.content


def test_chat_logprobs(client, model_name, offline_llm):
    reference = greedy_offline(offline_llm, chat_prompt_ids(offline_llm, MESSAGES), 5, logprobs=3)
    output = reference.outputs[0]
    result = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3,
    )
    entries = result.choices[0].logprobs.content
    assert len(entries) == len(output.token_ids)
    expected = [p[t].logprob for t, p in zip(output.token_ids, output.logprobs)]
    assert [e.logprob for e in entries] == pytest.approx(expected, abs=1e-4)
    assert all(len(e.top_logprobs) == 3 for e in entries)
    # Greedy: the chosen token is the most likely one.
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6) for e in entries)
    streamed = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=1, stream=True,
    )
    streamed_entries = [e for c in streamed if c.choices and c.choices[0].logprobs
                        for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed_entries] == pytest.approx(expected, abs=1e-4)


def test_continue_final_message_continues_an_assistant_prefill(client, model_name, offline_llm, server):
    """vLLM's continue_final_message: the last assistant turn is left open (the reference:
    the offline API on the prompt written out by hand), and /tokenize says the same prompt."""
    import httpx2

    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My colour is"}]
    extra = {"continue_final_message": True}
    result = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0, extra_body=extra)
    expected = greedy_offline(offline_llm, "<user>Name a colour.\n<assistant>My colour is", 8)
    assert result.choices[0].message.content == expected.outputs[0].text
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    tokens = httpx2.post(
        server.base_url + "/tokenize", json={"messages": messages, **extra}, headers=server.headers(), timeout=60
    ).json()["tokens"]
    assert tokens == expected.prompt_token_ids
    # Without it, the prefill is a closed turn and a new one opens (OpenAI's behaviour).
    closed = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0)
    reference = greedy_offline(offline_llm, "<user>Name a colour.\n<assistant>My colour is\n<assistant>", 8)
    assert closed.choices[0].message.content == reference.outputs[0].text
    import openai

    with pytest.raises(openai.BadRequestError, match="at most one"):
        client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=2, extra_body={**extra, "add_generation_prompt": True}
        )
