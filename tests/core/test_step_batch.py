"""StepBatch: what a step computes, read from a real SchedulerOutput."""

from __future__ import annotations

from pagellm.config import CacheConfig, SchedulerConfig
from pagellm.core import ModelRunnerOutput, Scheduler
from pagellm.request import Request, RequestStatus
from pagellm.sampling_params import SamplingParams
from pagellm.core.step_batch import StepBatch, batch_from_schedule


def make_scheduler(budget: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64),
        CacheConfig(block_size=4, num_gpu_blocks=64),
    )


def add(scheduler: Scheduler, request_id: str, prompt_len: int, max_tokens: int) -> None:
    base = 1000 * (len(scheduler.requests) + 1)
    scheduler.add_request(Request(
        request_id, list(range(base, base + prompt_len)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0,
    ))  # fmt: skip


def test_attention_pairs_by_hand():
    # A 4-token chunk over nothing: 1+2+3+4 = 10 pairs. A 3-token chunk over 5 cached
    # tokens: 6+7+8 = 21. Decodes over 7 and 2 cached tokens read 8 and 3 positions.
    batch = StepBatch((4, 3), (0, 5), (7, 2), num_sampled_tokens=3)
    assert batch.prefill_attention_pairs == 10 + 21
    assert batch.decode_attention_pairs == 8 + 3
    assert batch.num_tokens == 4 + 3 + 2
    assert batch.num_reqs == 4 and batch.num_prefills == 2 and batch.num_decodes == 2
    assert batch.decode_context_sum == 9 and batch.prefill_context_sum == 5


def test_chunks_decodes_and_samples_from_a_real_schedule():
    scheduler = make_scheduler(budget=10)
    add(scheduler, "a", 6, 3)
    add(scheduler, "b", 9, 2)
    sampled: list[str] = []
    first = scheduler.schedule()
    batch = batch_from_schedule(first, scheduler.requests, 4, sampled)
    # a's whole prompt (6) and 4 tokens of b's 9: b's chunk is partial, samples nothing.
    assert batch == StepBatch((6, 4), (0, 0), (), num_sampled_tokens=1)
    assert sampled == ["a"]
    scheduler.update_from_output(first, ModelRunnerOutput(["a", "b"], {"a": [7], "b": []}))
    sampled = []
    second = scheduler.schedule()
    batch = batch_from_schedule(second, scheduler.requests, 4, sampled)
    # a decodes over its 6 prompt tokens; b computes its last 5 over 4 cached ones.
    assert batch == StepBatch((5,), (4,), (6,), num_sampled_tokens=2)
    assert sorted(sampled) == ["a", "b"]
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)


def test_attention_within_a_window_counts_each_query_s_visible_keys():
    """Against a brute-force count: token i of a q-token chunk over c cached tokens sees
    min(c + i + 1, window) keys and reads min(c, window - 1) cached ones."""
    from pagellm.core.step_batch import StepBatch

    batch = StepBatch((5, 40, 3), (0, 7, 100), (0, 5, 63, 64, 500), num_sampled_tokens=6)
    for window in (None, 1, 4, 8, 64, 1000):
        cap = (lambda n: n) if window is None else (lambda n: min(n, window))
        chunks = zip(batch.prefill_num_tokens, batch.prefill_context_lens)
        pairs = sum(cap(c + i + 1) for q, c in chunks for i in range(q)) + sum(cap(c + 1) for c in batch.decode_context_lens)
        assert batch.attention_pairs_within(window) == pairs
        contexts = batch.prefill_context_lens + batch.decode_context_lens
        read = sum(c if window is None else min(c, window - 1) for c in contexts)
        assert batch.context_read_within(window) == read
    assert batch.attention_pairs_within(None) == batch.prefill_attention_pairs + batch.decode_attention_pairs
