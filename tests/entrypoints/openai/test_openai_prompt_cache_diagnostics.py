"""Prompt-cache diagnostics through the official clients: a hit, a miss by a changed
system prompt, a comparison that is not found (Responses and Messages), and a miss by
eviction (chat, on a server whose KV cache holds little). The miss by a LoRA adapter is in
test_openai_lora.py, by the disk tier in test_openai_kv_tier.py."""

from __future__ import annotations

import random

import openai
import pytest
from serve_helpers import API_KEY, ServerProcess, engine_cli_flags

anthropic = pytest.importorskip("anthropic")
rng = random.Random(8)
LONG = " ".join(f"w{rng.randrange(1000)}" for _ in range(40))  # ~200 tokens: whole blocks to share


@pytest.fixture(scope="module")
def small(tiny_model):
    # 24 usable blocks of 16 tokens: a few other prompts evict one's blocks.
    server = ServerProcess(["--model", tiny_model, *engine_cli_flags(max_model_len=384, num_gpu_blocks_override=25)], api_key=API_KEY)
    yield server
    assert server.stop() == 0, server.log


@pytest.fixture
def client(small):
    with openai.OpenAI(base_url=small.api_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def test_responses_hit_system_change_and_not_found(client, model_name):
    first = client.responses.create(model=model_name, instructions="Be terse.", input=LONG, max_output_tokens=2)
    same = client.responses.create(
        model=model_name, instructions="Be terse.", input=LONG + " and more", max_output_tokens=2,
        extra_body={"prompt_cache_options": {"comparison_response_id": first.id}},
    )  # fmt: skip
    hit = same.prompt_cache_diagnostics  # the SDK's own type
    assert hit.type == "cache_hit"
    assert hit.model_extra["cached_tokens"] == same.usage.input_tokens_details.cached_tokens > 0
    changed = client.responses.create(
        model=model_name, instructions="Be verbose.", input=LONG, max_output_tokens=2,
        extra_body={"prompt_cache_options": {"comparison_response_id": first.id}},
    )  # fmt: skip
    miss = changed.prompt_cache_diagnostics
    assert miss.type == "cache_miss" and miss.reason == "input_changed" and miss.model_extra["detail"] == "system_changed"
    assert miss.cache_missed_tokens == miss.comparison_reusable_tokens == 0  # the instructions come first: nothing shared
    assert miss.model_extra["first_divergent_token"] is not None and miss.model_extra["first_divergent_token"] < 40
    unknown = client.responses.create(
        model=model_name, input="x", max_output_tokens=1, extra_body={"prompt_cache_options": {"comparison_response_id": "resp_nosuch"}}
    )
    assert unknown.prompt_cache_diagnostics.type == "comparison_response_not_found"
    plain = client.responses.create(model=model_name, input="x", max_output_tokens=1)
    assert plain.prompt_cache_diagnostics is None  # only when asked


def test_messages_hit_system_change_and_not_found(small, model_name):
    with anthropic.Anthropic(base_url=small.base_url, api_key=API_KEY, max_retries=0, timeout=120) as claude:
        turn = [{"role": "user", "content": LONG}]
        first = claude.messages.create(model=model_name, system="Be terse.", max_tokens=2, messages=turn)
        more = turn + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
        again = claude.messages.create(
            model=model_name, system="Be terse.", max_tokens=2, messages=more, extra_body={"diagnostics": {"previous_message_id": first.id}}
        )
        assert again.diagnostics.cache_miss_reason is None  # the SDK's own type: the prefix was reused
        assert again.diagnostics.model_extra["cached_tokens"] == again.usage.cache_read_input_tokens > 0
        other = claude.messages.create(
            model=model_name, system="Be verbose.", max_tokens=2, messages=turn, extra_body={"diagnostics": {"previous_message_id": first.id}}
        )
        assert other.diagnostics.cache_miss_reason.type == "system_changed"
        lost = claude.messages.create(model=model_name, max_tokens=1, messages=turn, extra_body={"diagnostics": {"previous_message_id": "msg_nosuch"}})
        assert lost.diagnostics.cache_miss_reason.type == "previous_message_not_found"
        opted_in = claude.messages.create(model=model_name, max_tokens=1, messages=turn, extra_body={"diagnostics": {"previous_message_id": None}})
        assert opted_in.diagnostics.cache_miss_reason is None


def test_a_chat_prompt_evicted_by_other_traffic(client, model_name):
    messages = [{"role": "user", "content": LONG}]
    first = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    for _ in range(4):  # other long prompts take the cache's blocks
        other = " ".join(f"x{rng.randrange(1000)}" for _ in range(40))
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": other}], max_tokens=2)
    back = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=2, extra_body={"prompt_cache_options": {"comparison_id": first.id}}
    )
    diagnosis = back.model_extra["prompt_cache_diagnostics"]
    assert diagnosis["type"] == "cache_miss" and diagnosis["reason"] == "evicted"
    assert 0 < diagnosis["cache_missed_tokens"] <= diagnosis["comparison_reusable_tokens"]
    assert diagnosis["first_divergent_token"] is None  # the same prompt: nothing changed on the request's side
    assert diagnosis["cached_tokens"] == back.usage.prompt_tokens_details.cached_tokens
