"""The engine and the offline API on a tiny random model: requests, aborts, errors, sizing."""

import pytest
import torch
from engine_checks import assert_engine_drained
from hf_models import make_tiny_hf_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.errors import ConfigError, InvalidRequestError
from pagellm.config.cache import kv_bytes_per_block


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=5))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, max_model_len=128, num_gpu_blocks_override=40)


def test_outputs_in_input_order_with_mixed_prompt_kinds(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 1, 5)]
    prompts = ["hello", [5, 6, 7], {"prompt_token_ids": [9] * 20}, {"prompt": "abc"}]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 9, 1, 5]
    assert outputs[0].prompt == "hello" and outputs[0].prompt_token_ids == list(b"hello")
    assert outputs[1].prompt is None and outputs[1].prompt_token_ids == [5, 6, 7]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    # The text is the detokenized token ids.
    tokenizer = llm.get_tokenizer()
    assert outputs[1].outputs[0].text == tokenizer.decode(outputs[1].outputs[0].token_ids)
    assert_engine_drained(llm)


def test_abort_mid_run_frees_blocks_and_spares_the_others(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    keep = engine.add_request("keep", [3, 4, 5, 6], params)
    doomed = engine.add_request("doomed", list(range(10, 50)), params)
    for _ in range(3):
        engine.step()
    aborted = engine.abort_request(doomed)
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert "doomed" not in engine.scheduler.requests
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == [keep]
    alone = llm.generate([[3, 4, 5, 6]], params, use_tqdm=False)[0]
    assert finished[keep].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_engine_drained(llm)


def test_invalid_requests_are_refused_without_leaks(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="max_model_len") as err:
        engine.add_request(None, [5] * 200, SamplingParams(max_tokens=4))
    assert err.value.parameter == "prompt"
    with pytest.raises(InvalidRequestError, match="context length is 128.*at most 28"):
        engine.add_request(None, [5] * 100, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request(None, [5, 999], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(None, "", SamplingParams())
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    engine.add_request("dup", [5], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [6], SamplingParams())
    engine.abort_request("dup")
    assert_engine_drained(llm)


def test_bad_prompt_in_a_batch_leaves_nothing_queued(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], [5] * 500], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_engine_drained(llm)


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[7, 8, 9]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([[1, 2], [7, 8, 9], [4] * 30], [other, seeded, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert_engine_drained(llm)


def test_kv_cache_memory_bytes_sets_the_block_count(folder):
    llm = LLM(folder, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    config = llm.engine.model_config
    per_block = kv_bytes_per_block(config, 16, "float32")
    assert llm.engine.config.cache_config.num_gpu_blocks == (1 << 20) // per_block + 1


def test_cache_too_small_for_max_model_len_names_the_largest_that_fits(folder):
    with pytest.raises(ConfigError, match="largest max_model_len that fits is 64"):
        LLM(folder, max_model_len=128, num_gpu_blocks_override=5)


def test_unknown_engine_argument(folder):
    with pytest.raises(ConfigError, match="max_num_seq\\b.*known"):
        LLM(folder, max_num_seq=4)


def test_bfloat16_runs(folder):
    llm = LLM(folder, max_model_len=64, dtype="bfloat16")
    assert llm.engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_background_requests_yield_to_an_interactive_one(llm):
    """Batch lines (background) fill the cache; an interactive request that arrives gets its
    first token after as many steps as on an idle engine, and every line still ends with
    the tokens it gets alone (preempted and recomputed on the way)."""
    engine = llm.engine
    line_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    chat_params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def steps_to_first_token(request_id: str) -> int:
        steps = 0
        while True:
            steps += 1
            if any(o.request_id == request_id and o.outputs[0].token_ids for o in engine.step()):
                return steps

    def drain() -> dict[str, list[int]]:
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        return tokens

    engine.add_request("idle-chat", [250 - j for j in range(30)], chat_params)
    idle_steps = steps_to_first_token("idle-chat")
    drain()
    prompts = {f"line{i}": [(7 * i + j) % 256 for j in range(30)] for i in range(24)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, line_params, background=True)
    for _ in range(4):
        engine.step()
    assert engine.scheduler.num_waiting > 0  # the batch fills the cache: lines wait
    engine.add_request("chat", [(5 * j + 1) % 256 for j in range(30)], chat_params)
    assert steps_to_first_token("chat") <= idle_steps
    tokens = drain()
    assert set(tokens) == {"chat", *prompts}
    alone = llm.generate(list(prompts.values()), line_params, use_tqdm=False)
    assert [tokens[r] for r in prompts] == [o.outputs[0].token_ids for o in alone]
    assert_engine_drained(llm)
