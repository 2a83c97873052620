"""Multi-step decoding (--num-scheduler-steps N) through the whole engine: greedy tokens
equal HF transformers float32 under batching, chunked prefill, both preemptions, prefix
caching and the families' own layers (experts, sliding windows); sampled requests (seeds,
penalties, logprobs, n > 1), stops inside a run, max_tokens and min_tokens give what N
single steps give."""

from __future__ import annotations

import pytest
from engine_checks import assert_engine_drained
from hf_models import load_hf_reference, make_tiny_hf_checkpoint
from reference import hf_greedy, pagellm_greedy
from test_engine_vs_hf import PROMPTS
from test_families_vs_hf import FAMILIES
from test_families_vs_hf import PROMPTS as FAMILY_PROMPTS

from pagellm import LLM, SamplingParams
from pagellm.errors import ConfigError
from pagellm.worker.model_runner import ModelRunner

NEW_TOKENS = 13  # not a multiple of the step counts: the last run of each is capped


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-multi-step"), "llama", seed=5)
    ref = load_hf_reference(folder)
    return str(folder), [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture
def runs(monkeypatch):
    """The number of positions each multi-step run gave its requests."""
    counts: list[int] = []
    original = ModelRunner._run_decode_steps

    def counting(self, req_ids, steps):
        counts.extend(steps.values())
        return original(self, req_ids, steps)

    monkeypatch.setattr(ModelRunner, "_run_decode_steps", counting)
    return counts


@pytest.mark.parametrize(
    "engine_args",
    [
        {"num_scheduler_steps": 4},
        {"num_scheduler_steps": 8, "max_num_batched_tokens": 16},
        {"num_scheduler_steps": 3, "max_num_seqs": 1},
    ],
    ids=["batched-4", "chunked-16-steps-8", "one-at-a-time-3"],
)
def test_greedy_tokens_equal_hf(tiny_model, runs, engine_args):
    folder, expected = tiny_model
    llm = LLM(folder, max_model_len=128, **engine_args)
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert runs and max(runs) == engine_args["num_scheduler_steps"]
    assert_engine_drained(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_caching(tiny_model, runs, mode):
    folder, expected = tiny_model
    llm = LLM(folder, max_model_len=128, num_scheduler_steps=4, num_gpu_blocks_override=12, preemption_mode=mode,
              swap_space=0.01)  # fmt: skip
    assert pagellm_greedy(llm, PROMPTS, NEW_TOKENS) == expected
    assert pagellm_greedy(llm, PROMPTS[-3:], NEW_TOKENS) == expected[-3:]
    stats = llm.engine.get_stats()
    assert (stats.num_preemptions_recompute if mode == "recompute" else stats.num_preemptions_swap) > 0
    assert runs
    assert_engine_drained(llm)


@pytest.mark.parametrize("name", ["qwen3_moe", "mistral_sliding", "gemma3"])
def test_families_equal_hf(tmp_path, runs, name):
    arch, overrides = FAMILIES[name]
    folder = make_tiny_hf_checkpoint(tmp_path, arch, seed=5, **overrides)
    ref = load_hf_reference(folder)
    expected = [hf_greedy(ref, p, 24) for p in FAMILY_PROMPTS]
    llm = LLM(str(folder), max_model_len=160, num_scheduler_steps=5)
    assert pagellm_greedy(llm, FAMILY_PROMPTS, 24) == expected
    assert runs
    assert_engine_drained(llm)


def _outputs(llm: LLM, params: list[SamplingParams]):
    prompts = [PROMPTS[i] for i in (2, 6, 9, 14)]
    return llm.generate(prompts, params, use_tqdm=False)


def test_sampled_requests_equal_single_steps(tiny_model, runs):
    folder, _ = tiny_model
    params = [
        SamplingParams(temperature=0.9, seed=11, max_tokens=17, logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=12, max_tokens=15, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.2),  # fmt: skip
        SamplingParams(temperature=0.0, max_tokens=11, min_tokens=9, logprobs=1),
        SamplingParams(temperature=1.0, seed=13, n=2, max_tokens=10),
    ]
    single = _outputs(LLM(folder, max_model_len=128), params)
    multi_llm = LLM(folder, max_model_len=128, num_scheduler_steps=4)
    multi = _outputs(multi_llm, params)
    assert runs
    for one, many in zip(single, multi, strict=True):
        assert [c.token_ids for c in many.outputs] == [c.token_ids for c in one.outputs]
        assert [c.finish_reason for c in many.outputs] == [c.finish_reason for c in one.outputs]
        for a, b in zip(one.outputs, many.outputs, strict=True):
            if a.logprobs is not None:
                assert len(b.logprobs) == len(a.logprobs)
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)
    assert_engine_drained(multi_llm)


def test_a_stop_inside_a_run(tiny_model, runs):
    folder, expected = tiny_model
    # A stop token id that greedy decoding reaches in the middle of a 4-position run.
    target = expected[5]
    stop_at = target[5]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[stop_at])
    llm = LLM(folder, max_model_len=128, num_scheduler_steps=4)
    (out,) = llm.generate([PROMPTS[5]], params, use_tqdm=False)
    first = target.index(stop_at)
    assert out.outputs[0].token_ids == target[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    assert runs
    assert_engine_drained(llm)


def test_bad_settings_are_named(tiny_model):
    folder, _ = tiny_model
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        LLM(folder, num_scheduler_steps=0)
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        LLM(folder, num_scheduler_steps=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        LLM(folder, num_scheduler_steps=4, tensor_parallel_size=2)
