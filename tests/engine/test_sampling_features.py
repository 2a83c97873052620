"""Sampling features through the whole engine on a tiny random model, checked against HF."""

import pytest
import torch
from engine_checks import assert_engine_drained
from hf_models import load_hf_reference, make_tiny_hf_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.errors import InvalidRequestError

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 10, 20, 30, 40, 50, 60, 70, 80, 90, 15, 25, 35]  # 21


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=11)


@pytest.fixture(scope="module")
def ref(folder):
    return load_hf_reference(folder)


def make_llm(folder, **kwargs):
    kwargs.setdefault("max_model_len", 128)
    return LLM(str(folder), **kwargs)


@torch.inference_mode()
def teacher_forced_logprobs(ref, prompt, tokens):
    """log p(token_i | prompt + tokens[:i]) from one HF forward over the whole sequence."""
    ids = torch.tensor([prompt + tokens])
    logprobs = ref(ids).logits[0].float().log_softmax(-1)
    positions = range(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return [float(logprobs[p, t]) for p, t in zip(positions, tokens)]


def test_greedy_with_penalties_and_logit_bias_matches_reference(folder, ref):
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    bias = {17: 3.0, 42: -2.0}
    params = SamplingParams(
        temperature=0,
        max_tokens=24,
        ignore_eos=True,
        repetition_penalty=1.4,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias=bias,
    )
    llm = make_llm(folder)
    ours = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids

    tokens: list[int] = []
    bias_processor = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    repetition = RepetitionPenaltyLogitsProcessor(1.4)
    with torch.inference_mode():
        for _ in range(24):
            seq = torch.tensor([PROMPT + tokens])
            logits = ref(seq).logits[:, -1].float()
            logits = repetition(seq, bias_processor(seq, logits))
            for token in set(tokens):
                logits[0, token] -= 0.3 * tokens.count(token) + 0.5
            tokens.append(int(logits.argmax()))
    assert ours == tokens
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert plain[0].outputs[0].token_ids != ours, "penalties changed nothing: test proves little"
    assert_engine_drained(llm)


def test_logprobs_and_prompt_logprobs_equal_reference(folder, ref):
    llm = make_llm(folder, max_num_batched_tokens=8)  # prompt logprobs across chunks
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    with torch.inference_mode():
        full = ref(torch.tensor([PROMPT + completion.token_ids])).logits[0].float().log_softmax(-1)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = full[len(PROMPT) - 1 + i]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == 1  # greedy
        top = row.topk(3)
        assert [t for t in entry if t != token or entry[t].rank <= 3][:3] == top.indices.tolist()
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)), abs=1e-5
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[position]
        token = PROMPT[position]
        assert entry[token].logprob == pytest.approx(float(full[position - 1, token]), abs=1e-4)
        assert len(entry) <= 3
    assert_engine_drained(llm)


@pytest.mark.parametrize("preemption", [None, "recompute", "swap"])
def test_parallel_sampling_shares_the_prompt_and_each_completion_is_exact(folder, ref, preemption):
    kwargs = {"enable_prefix_caching": False}
    if preemption:
        kwargs.update(num_gpu_blocks_override=8, preemption_mode=preemption, swap_space=0.01, max_model_len=64)
    llm = make_llm(folder, **kwargs)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=30, ignore_eos=True, logprobs=0)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    stats = llm.engine.get_stats()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 30 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    if preemption is None:
        # With prefix caching off, only forking can share: the prompt was computed once.
        assert stats.num_prefill_tokens == len(PROMPT)
    else:
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    # Every completion's tokens were computed over the right KV: the logprobs we report
    # equal HF's teacher-forced ones for that completion.
    for completion in out.outputs:
        reported = [e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)]
        assert reported == pytest.approx(teacher_forced_logprobs(ref, PROMPT, completion.token_ids), abs=1e-4)
    assert_engine_drained(llm)


def test_greedy_parallel_sampling_and_seeds_are_reproducible(folder):
    llm = make_llm(folder)
    greedy = llm.generate([PROMPT], SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    seeded = SamplingParams(n=2, temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded, use_tqdm=False)[0]
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate([[5, 6], PROMPT, [7] * 30], [other, seeded, other], use_tqdm=False)[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in mixed.outputs]
    assert_engine_drained(llm)


def test_abort_parallel_request_frees_every_completion(folder):
    llm = make_llm(folder)
    engine = llm.engine
    engine.add_request("many", PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.scheduler.num_running == 3
    [aborted] = engine.abort_request("many")
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 3
    assert_engine_drained(llm)


def test_stop_strings_and_tokens_through_the_engine(folder):
    llm = make_llm(folder)
    tokenizer = llm.get_tokenizer()
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate([PROMPT], base, use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[5:9]
    assert stop not in text[:8]
    cut = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    token = full.token_ids[3]
    by_token = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[token]), use_tqdm=False)[0].outputs[0]
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    assert by_token.stop_reason == token and by_token.finish_reason == "stop"
    assert tokenizer.decode(by_token.token_ids) == by_token.text
    assert_engine_drained(llm)


def test_min_tokens_holds_eos_back(folder):
    llm = make_llm(folder)
    eos = next(iter(llm.get_tokenizer().eos_token_ids))
    # A bias makes EOS the greedy choice at once; min_tokens forbids it for 5 tokens.
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, logit_bias={eos: 100})
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert_engine_drained(llm)


def test_streaming_deltas_add_up_to_the_final_output(folder):
    llm = make_llm(folder)
    engine = llm.engine
    engine.add_request("s", PROMPT, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=15, ignore_eos=True, logprobs=1))
    texts, tokens, logprobs = ["", ""], [[], []], [[], []]
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                texts[c.index] += c.delta_text
                tokens[c.index] += c.delta_token_ids
                logprobs[c.index] += c.delta_logprobs
            if out.finished:
                final = out
    for c in final.outputs:
        assert texts[c.index] == c.text and tokens[c.index] == c.token_ids and logprobs[c.index] == c.logprobs


def test_chat_uses_the_template(folder):
    llm = make_llm(folder)
    conversation = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    [out] = llm.chat(conversation, params, use_tqdm=False)
    assert bytes(out.prompt_token_ids).decode() == "<user>hi\n<assistant>"
    outs = llm.chat([conversation, conversation + [{"role": "assistant", "content": "yo"}]], params, use_tqdm=False)
    assert len(outs) == 2 and outs[0].outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs,parameter",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {3: 500}}, "logit_bias"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_invalid_parameters_name_themselves(kwargs, parameter):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.parameter == parameter and parameter in str(err.value)


def test_model_dependent_limits_and_a_bad_request_disturbs_no_one(folder):
    llm = make_llm(folder, max_logprobs=5)
    engine = llm.engine
    good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([PROMPT], good, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("good", PROMPT, good)
    engine.step()
    for bad, parameter in [
        (SamplingParams(logprobs=6), "logprobs"),
        (SamplingParams(prompt_logprobs=9), "prompt_logprobs"),
        (SamplingParams(logit_bias={999: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[4096]), "stop_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(None, PROMPT, bad)
        assert err.value.parameter == parameter
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["good"].outputs[0].token_ids == expected
    assert_engine_drained(llm)
