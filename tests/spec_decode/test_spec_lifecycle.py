"""Speculative decoding through a request's life (tiny random model, float32): rejected
positions give back the block they opened, stops and max_tokens inside an accepted run,
n > 1, aborts between verifications; every run ends with a drained engine.

Proposals come from a table (what plain greedy produced, or deliberately wrong tokens)
so that acceptance and rejection happen where each test needs them."""

import pytest
from engine_checks import assert_engine_drained

import pagellm.spec_decode.speculator as speculator_module
from pagellm import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hf_models import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5))


@pytest.fixture
def proposals(monkeypatch):
    """tokens so far (as a tuple) -> what to propose; nothing for other prefixes."""
    table: dict[tuple[int, ...], list[int]] = {}
    monkeypatch.setattr(speculator_module, "best_num_tokens", lambda acceptance, ratio, k: k)
    monkeypatch.setattr(speculator_module, "propose_ngram", lambda ids, k, lo, hi: table.get(tuple(ids), [])[:k])
    return table


def greedy_tokens(llm: LLM, prompts: list[list[int]], **params: object) -> list[list[int]]:
    sampling = SamplingParams(temperature=0.0, **{"max_tokens": 12, "ignore_eos": True, **params})
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sampling, use_tqdm=False)]


def propose_plain_continuations(table, prompts, plain, every=1):  # noqa: ANN001, ANN201
    """Propose plain greedy's next tokens after each `every`-th output position."""
    for prompt, tokens in zip(prompts, plain, strict=True):
        for i in range(1, len(tokens), every):
            table[tuple(prompt + tokens[:i])] = tokens[i:]


def test_rejected_positions_give_back_the_block_they_opened(tiny, proposals):
    plain_llm = LLM(tiny, max_model_len=128, block_size=16)
    prompt = list(range(30, 44))  # 14 tokens: the first output is position 14
    [plain] = greedy_tokens(plain_llm, [prompt])
    llm = LLM(tiny, max_model_len=128, block_size=16, speculative_config=SPEC)
    engine, kv = llm.engine, llm.engine.scheduler.kv_cache_manager
    # After the first token: three wrong drafts, verified at positions 15-17 (block 2).
    proposals[tuple(prompt + plain[:1])] = [(t + 1) % 256 for t in plain[1:4]]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    engine.step()  # prefill: the first token
    assert kv.num_device_blocks("r") == 1
    free_before = kv.num_free_blocks
    engine.step()  # the verification rejects every draft: one token, position 15
    assert engine.scheduler.requests["r"].num_tokens == 16
    assert kv.num_device_blocks("r") == 1 and kv.num_free_blocks == free_before
    # Right drafts across the boundary keep their block.
    proposals[tuple(prompt + plain[:2])] = plain[2:5]
    engine.step()
    assert engine.scheduler.requests["r"].num_tokens == 20 and kv.num_device_blocks("r") == 2
    # The runner's copy of the table dropped the freed block too.
    assert engine.runner.requests["r"].block_ids == kv.get_block_tables("r")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert list(outputs[-1].outputs[0].token_ids) == plain
    assert engine.speculator.stats.num_accepted == 3 and engine.speculator.stats.num_verifications == 2
    assert_engine_drained(llm)


def test_stops_and_max_tokens_inside_an_accepted_run(tiny, proposals):
    plain_llm = LLM(tiny, max_model_len=128)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44]]
    plain = greedy_tokens(plain_llm, prompts)
    propose_plain_continuations(proposals, prompts, plain)
    llm = LLM(tiny, max_model_len=128, speculative_config=SPEC)
    # A stop token in the middle of the proposals: the output ends there, as without.
    stop = [tokens[5] for tokens in plain]
    for prompt, tokens, stop_id in zip(prompts, plain, stop, strict=True):
        expected = greedy_tokens(plain_llm, [prompt], stop_token_ids=[stop_id], ignore_eos=False)
        assert greedy_tokens(llm, [prompt], stop_token_ids=[stop_id], ignore_eos=False) == expected
        assert len(expected[0]) <= 6
    # max_tokens: never exceeded, the same tokens.
    for max_tokens in (2, 3, 5, 7):
        got = greedy_tokens(llm, prompts, max_tokens=max_tokens)
        assert got == [tokens[:max_tokens] for tokens in plain]
    assert greedy_tokens(llm, prompts) == plain
    assert llm.engine.speculator.stats.num_accepted > 0
    assert_engine_drained(llm)


def test_parallel_sampling_and_aborts(tiny, proposals):
    plain_llm = LLM(tiny, max_model_len=128)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    plain = greedy_tokens(plain_llm, prompts)
    propose_plain_continuations(proposals, prompts, plain)
    llm = LLM(tiny, max_model_len=128, speculative_config=SPEC)
    # n > 1 (greedy: every completion is plain greedy's), and sampled with a seed.
    out = llm.generate([prompts[0]], SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(c.token_ids) for c in out[0].outputs] == [plain[0]] * 3
    seeded = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompts[1]], seeded, use_tqdm=False)[0]
    again = llm.generate([prompts[1]], seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.token_ids) == 12 for c in first.outputs)
    # Abort one request after it verified a proposal; the other is undisturbed.
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", prompts[0], params)
    engine.add_request("b", prompts[1], params)
    verified = engine.speculator.stats.num_verifications
    engine.step()
    engine.step()
    assert engine.speculator.stats.num_verifications >= verified + 2
    engine.abort_request("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert list(outputs[-1].outputs[0].token_ids) == plain[1]
    assert_engine_drained(llm)
