"""A failing engine step ends only the requests it computed (tiny random model): they
finish with finish_reason "error" and the error, their blocks are freed, requests that
were not in the step produce exactly the tokens they would have, and the engine keeps
serving; several failures in a row stop it."""

import pytest
from engine_checks import assert_engine_drained

from pagellm import LLM, SamplingParams
from pagellm.errors import EngineFailedError
from pagellm.worker.fault_injection import ENV_VAR, FaultInjector

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [20, 21], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hf_models import make_tiny_hf_checkpoint

    folder = str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), seed=2))
    expected = {i: list(o.outputs[0].token_ids) for i, o in enumerate(LLM(folder, max_model_len=64).generate(PROMPTS, GREEDY, use_tqdm=False))}
    return folder, expected


def run(engine, requests: dict[str, list[int]]) -> dict[str, object]:
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def test_a_failing_step_ends_only_its_requests(tiny, monkeypatch):
    folder, expected = tiny
    monkeypatch.setenv(ENV_VAR, "steps=3")
    # Two requests run at a time: the third step (the first pair's second decode) fails,
    # the second pair waits meanwhile and is computed afterwards.
    llm = LLM(folder, max_model_len=64, max_num_seqs=2)
    finals = run(llm.engine, {f"r{i}": prompt for i, prompt in enumerate(PROMPTS)})
    for i in (0, 1):
        output = finals[f"r{i}"]
        assert output.outputs[0].finish_reason == "error"
        assert "InjectedFault" in output.error and "step 3" in output.error
        assert list(output.outputs[0].token_ids) == expected[i][:2]  # what it had before the step
    for i in (2, 3):
        assert finals[f"r{i}"].error is None
        assert list(finals[f"r{i}"].outputs[0].token_ids) == expected[i]
    # A new request after the failure is served as usual.
    again = run(llm.engine, {"later": PROMPTS[0]})
    assert list(again["later"].outputs[0].token_ids) == expected[0]
    assert_engine_drained(llm)


def test_a_failing_request_takes_its_step_and_all_its_completions(tiny, monkeypatch):
    folder, expected = tiny
    monkeypatch.setenv(ENV_VAR, "request=poison")
    llm = LLM(folder, max_model_len=64, max_num_seqs=8)
    engine = llm.engine
    engine.add_request("first", PROMPTS[0], GREEDY)
    engine.step()  # "first" is prefilled alone
    engine.add_request("poison", PROMPTS[1], SamplingParams(n=3, temperature=1.0, max_tokens=8))
    outputs = engine.step()  # "poison" joins the batch: the step fails, taking "first" with it
    assert {o.request_id for o in outputs} == {"first", "poison"}
    poisoned = next(o for o in outputs if o.request_id == "poison")
    assert [c.finish_reason for c in poisoned.outputs] == ["error"] * 3
    assert all(o.finished and o.error for o in outputs)
    finals = run(engine, {"next": PROMPTS[2]})
    assert list(finals["next"].outputs[0].token_ids) == expected[2]
    assert_engine_drained(llm)


def test_failures_outside_the_model_are_contained_too(tiny, monkeypatch):
    # A detokenizer (output processing) failure: the same containment.
    folder, expected = tiny
    llm = LLM(folder, max_model_len=64)
    engine = llm.engine
    process = engine.output_processor.process
    calls = {"n": 0}

    def failing_once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return process(*args, **kwargs)

    monkeypatch.setattr(engine.output_processor, "process", failing_once)
    finals = run(engine, {"a": PROMPTS[0]})
    assert finals["a"].outputs[0].finish_reason == "error" and "UnicodeDecodeError" in finals["a"].error
    finals = run(engine, {"b": PROMPTS[1]})
    assert list(finals["b"].outputs[0].token_ids) == expected[1]
    assert_engine_drained(llm)


def test_repeated_failures_stop_the_engine(tiny, monkeypatch):
    folder, _ = tiny
    monkeypatch.setenv(ENV_VAR, "rate=1.0")
    llm = LLM(folder, max_model_len=64)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
    assert all(o.error for o in engine.step())  # the first two fail their requests
    engine.add_request("r3", PROMPTS[3], GREEDY)
    assert all(o.error for o in engine.step())
    engine.add_request("r4", PROMPTS[0], GREEDY)
    with pytest.raises(EngineFailedError, match="3 engine step"):
        engine.step()


def test_fault_injection_settings(monkeypatch):
    from pagellm.errors import ConfigError

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert FaultInjector.from_env() is None  # off unless asked for
    monkeypatch.setenv(ENV_VAR, "rate=0.5,seed=3,steps=2:4,request=x")
    injector = FaultInjector.from_env()
    assert (injector.rate, injector.seed, injector.steps, injector.request) == (0.5, 3, {2, 4}, "x")
    monkeypatch.setenv(ENV_VAR, "often=1")
    with pytest.raises(ConfigError, match="unknown key 'often'"):
        FaultInjector.from_env()
