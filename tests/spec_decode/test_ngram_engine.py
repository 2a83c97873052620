"""N-gram speculative decoding in the engine (float32): greedy tokens identical to
decoding without speculation, for single requests and mixed batches, under chunked
prefill, preemption and prefix caching; the engine drains with no block left."""

import pytest
from engine_checks import assert_engine_drained

from pagellm import LLM, SamplingParams
from pagellm.errors import ConfigError

PASSAGE = (
    "def compute_total(items):\n    total = 0\n    for item in items:\n"
    "        total += item.price * item.quantity\n    return total\n"
)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def prompts(llm):
    tokenizer = llm.get_tokenizer()
    asks = ["Repeat this code exactly:\n" + PASSAGE, "Rename total to result:\n" + PASSAGE, "What is 2+2?"]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": a}], tokenize=True) for a in asks]
    return chats + [tokenizer.encode("one two three one two three one two")]


def greedy(llm, batch, max_tokens=32):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(smollm2_path):
    llm = LLM(str(smollm2_path), max_model_len=512)
    batch = prompts(llm)
    return batch, [greedy(llm, [p])[0] for p in batch], greedy(llm, batch)


def test_single_requests_and_a_batch_with_prefix_hits(smollm2_path, reference):
    batch, alone, together = reference
    llm = LLM(str(smollm2_path), max_model_len=512, speculative_config=SPEC)
    assert [greedy(llm, [p])[0] for p in batch] == alone
    assert greedy(llm, batch) == together  # the prompts are cached now: prefix hits
    stats = llm.engine.speculator.stats
    assert stats.num_accepted > 0 and stats.num_proposed >= stats.num_accepted
    assert llm.engine.get_stats().num_prefix_hit_tokens > 0
    assert_engine_drained(llm)
    # The same counts on /metrics.
    from prometheus_client import generate_latest

    text = generate_latest(llm.engine.metrics.prom.registry).decode()

    def value(name):
        return float(next(line for line in text.splitlines() if line.startswith(name + "{")).rsplit(" ", 1)[1])

    assert value("pagellm:spec_decode_num_draft_tokens_total") == stats.num_proposed
    assert value("pagellm:spec_decode_num_accepted_tokens_total") == stats.num_accepted
    assert value("pagellm:spec_decode_num_drafts_total") == stats.num_verifications
    assert value("pagellm:spec_decode_num_emitted_tokens_total") == stats.num_accepted + stats.num_verifications


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_batched_tokens": 16, "max_model_len": 512},  # chunked prefill beside verification
        {"num_gpu_blocks_override": 14, "max_num_batched_tokens": 64, "max_model_len": 208},  # preemption
    ],
)
def test_a_batch_under_chunking_and_preemption(smollm2_path, reference, engine_args):
    batch, _, together = reference
    llm = LLM(str(smollm2_path), speculative_config=SPEC, **engine_args)
    assert greedy(llm, batch) == together
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.get_stats().num_preemptions_recompute > 0
    assert llm.engine.speculator.stats.num_accepted > 0
    assert_engine_drained(llm)


def test_bad_speculative_configs_are_refused():
    with pytest.raises(ConfigError, match="method"):
        LLM(speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="num_speculative_tokens must be at least 1"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(speculative_config="{nope")
    with pytest.raises(ConfigError, match="unknown key"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3})


def test_tensor_parallel_ranks_follow_the_verified_tokens(tmp_path):
    from hf_models import make_tiny_hf_checkpoint

    folder = str(make_tiny_hf_checkpoint(tmp_path, seed=8))
    batch = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9, 9, 9], list(range(20, 40)) * 2]
    expected = greedy(LLM(folder, max_model_len=256), batch)
    with LLM(folder, max_model_len=256, tensor_parallel_size=2, speculative_config=SPEC) as llm:
        assert greedy(llm, batch) == expected
        assert llm.engine.speculator.stats.num_proposed > 0
        assert_engine_drained(llm)


def test_stop_strings_inside_accepted_runs_and_constrained_requests(smollm2_path, reference):
    import re

    from pagellm.structured_outputs_params import StructuredOutputsParams

    batch, alone, _ = reference
    plain = LLM(str(smollm2_path), max_model_len=512)
    llm = LLM(str(smollm2_path), max_model_len=512, speculative_config=SPEC)
    # A stop string from the middle of the quoted code: the output ends there, as without.
    free = plain.generate([batch[0]], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2 :][:8]
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=[stop])
    expected = plain.generate([batch[0]], params, use_tqdm=False)[0].outputs[0]
    got = llm.generate([batch[0]], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason) == (expected.text, expected.finish_reason)
    assert expected.finish_reason == "stop" and len(expected.text) < len(free.text)
    assert llm.engine.speculator.stats.num_accepted > 0
    # A constrained request in the same batch as speculating ones: it does not speculate,
    # and follows its constraint.
    constrained = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[a-z]+( [a-z]+){0,5}")
    )
    outputs = llm.generate(batch[:2], [constrained, SamplingParams(temperature=0.0, max_tokens=24)], use_tqdm=False)
    assert re.fullmatch("[a-z]+( [a-z]+){0,5}", outputs[0].outputs[0].text)
    assert list(outputs[1].outputs[0].token_ids) == alone[1][:24]
    assert_engine_drained(llm)
