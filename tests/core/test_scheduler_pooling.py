"""Embedding (pooling) requests in the scheduler: prompt-only requests that finish, with no
output token, in the step that computes their last prompt position; pure Python."""

from __future__ import annotations

import pytest
from core_harness import make_request, make_scheduler

from pagellm.core import ModelRunnerOutput
from pagellm.pooling_params import PoolingParams
from pagellm.request import Request, RequestStatus
from pagellm.sampling_params import SamplingParams


def pooling_request(request_id: str, prompt: list[int], pooling_type: str = "last") -> Request:
    return Request(request_id, prompt, SamplingParams(), pooling_params=PoolingParams(pooling_type=pooling_type, normalize=True))


def run_step(scheduler, pooled_ids=(), sampled=7):  # noqa: ANN001, ANN201
    """One step: partial chunks get nothing, finished prompts a token or an embedding."""
    out = scheduler.schedule()
    sampled_ids, pooled = {}, {}
    for request_id, count in out.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        done = request.num_computed_tokens + count == request.num_tokens
        if done and request.is_pooling and request_id in pooled_ids:
            pooled[request_id] = [0.5, 0.5]
        sampled_ids[request_id] = [sampled] if done and not request.is_pooling else []
    result = ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled_ids, pooled=pooled)
    return out, scheduler.update_from_output(out, result)


def test_an_embedding_request_finishes_when_its_prompt_is_computed_and_frees_its_blocks():
    scheduler = make_scheduler(max_num_batched_tokens=8)  # chunks of 8: three steps for 20 tokens
    prompt = list(range(100, 120))
    scheduler.add_request(pooling_request("e", prompt))
    scheduler.add_request(make_request("g", 6, max_tokens=3))
    progress_of_e = []
    for _ in range(6):
        _, progress = run_step(scheduler, pooled_ids={"e"})
        progress_of_e += [p for p in progress if p.req_id == "e"]
        if "e" not in scheduler.requests:
            break
    assert len(progress_of_e) == 1
    assert progress_of_e[0].new_token_ids == [] and str(progress_of_e[0].finish_reason) == "stop"
    scheduler.check_integrity()
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    # Its full blocks went to the prefix cache: the same prompt again hits 16 of 20 tokens.
    again = pooling_request("e2", prompt)
    assert manager.get_computed_blocks(again).num_computed_tokens == 16


def test_mean_pooling_computes_every_position_despite_a_cached_prefix():
    scheduler = make_scheduler()
    prompt = list(range(200, 213))
    scheduler.add_request(pooling_request("first", prompt))
    run_step(scheduler, pooled_ids={"first"})
    scheduler.add_request(pooling_request("mean", prompt, "mean"))
    scheduler.add_request(pooling_request("last", prompt, "last"))
    out, _ = run_step(scheduler, pooled_ids={"mean", "last"})
    assert out.num_scheduled_tokens == {"mean": 13, "last": 1}  # last: 12 of 13 tokens cached
    assert not scheduler.has_unfinished_requests()


def test_a_runner_that_returns_no_embedding_is_an_error():
    scheduler = make_scheduler()
    scheduler.add_request(pooling_request("e", [1, 2, 3]))
    with pytest.raises(RuntimeError, match="no embedding"):
        run_step(scheduler, pooled_ids=())


def test_an_embedding_may_fill_the_context_and_no_more():
    from pagellm.errors import InvalidRequestError

    scheduler = make_scheduler(max_model_len=16, block_size=4)
    scheduler.add_request(pooling_request("full", list(range(16))))
    run_step(scheduler, pooled_ids={"full"})
    assert not scheduler.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="maximum context length") as error:
        scheduler.add_request(pooling_request("long", list(range(17))))
    assert error.value.parameter == "input"
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
