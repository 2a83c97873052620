"""Request state, finish statuses and prefix-cache block hashes."""

from __future__ import annotations

from pagellm.request import BlockHash, FinishReason, Request, RequestStatus
from pagellm.sampling_params import SamplingParams


def test_status_helpers() -> None:
    assert not RequestStatus.WAITING.is_finished
    assert not RequestStatus.RUNNING.is_finished
    assert not RequestStatus.SWAPPED.is_finished
    assert RequestStatus.FINISHED_STOPPED.finish_reason is FinishReason.STOP
    assert RequestStatus.FINISHED_LENGTH.finish_reason is FinishReason.LENGTH
    assert RequestStatus.FINISHED_ABORTED.finish_reason is FinishReason.ABORT
    assert RequestStatus.RUNNING.finish_reason is None
    assert FinishReason.STOP == "stop" and str(FinishReason.LENGTH) == "length"


def test_request_counts_and_defaults() -> None:
    params = SamplingParams(max_tokens=5)
    request = Request("r", [1, 2, 3], params, eos_token_ids=[2], arrival_time=1.5)
    assert request.max_tokens == 5
    assert request.eos_token_ids == frozenset({2})
    assert request.status is RequestStatus.WAITING and not request.is_finished
    request.append_output_token_ids(9)
    request.append_output_token_ids([10, 11])
    assert request.num_prompt_tokens == 3
    assert request.num_output_tokens == 3
    assert request.num_tokens == 6
    assert request.all_token_ids == [1, 2, 3, 9, 10, 11]
    assert request.output_token_ids == [9, 10, 11]
    # An explicit limit wins over the sampling params; None stays for the scheduler.
    assert Request("s", [1], params, max_tokens=2).max_tokens == 2
    assert Request("t", [1], SamplingParams(max_tokens=None)).max_tokens is None


def test_block_hashes_cover_full_blocks_and_chain() -> None:
    request = Request("r", list(range(10)), SamplingParams())
    hashes = request.get_block_hashes(4)
    assert [h.token_ids for h in hashes] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert hashes[0].parent is None and hashes[1].parent is hashes[0]
    # Incremental: outputs that fill a block add its hash, earlier ones are kept.
    request.append_output_token_ids([10, 11])
    again = request.get_block_hashes(4)
    assert again[:2] == hashes[:2] and again[0] is hashes[0]
    assert [h.token_ids for h in again] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]


def test_same_tokens_under_different_parents_differ() -> None:
    a = Request("a", [1, 2, 3, 4, 9, 9, 9, 9], SamplingParams()).get_block_hashes(4)
    b = Request("b", [5, 6, 7, 8, 9, 9, 9, 9], SamplingParams()).get_block_hashes(4)
    assert a[1].token_ids == b[1].token_ids
    assert a[1] != b[1]
    same = Request("c", [1, 2, 3, 4, 9, 9, 9, 9], SamplingParams()).get_block_hashes(4)
    assert same[1] == a[1] and hash(same[1]) == hash(a[1]) and same[1] is not a[1]


def test_colliding_hash_values_never_compare_equal() -> None:
    """The 64-bit value only picks a bucket: keys compare their whole token chains."""
    root_a = BlockHash(None, (1, 2))
    root_b = BlockHash(None, (3, 4))
    root_b.value = root_a.value  # force a collision of the roots
    child_a = BlockHash(root_a, (5, 6))
    child_b = BlockHash(root_b, (5, 6))
    assert child_a.value == child_b.value  # same parent value, same tokens
    assert root_a != root_b
    assert child_a != child_b
    table = {child_a: "a"}
    assert child_b not in table
    assert table.get(BlockHash(BlockHash(None, (1, 2)), (5, 6))) == "a"


def test_long_chains_compare_without_recursion() -> None:
    tokens = list(range(20_000))
    a = Request("a", tokens, SamplingParams()).get_block_hashes(2)
    b = Request("b", tokens, SamplingParams()).get_block_hashes(2)
    assert len(a) == 10_000
    assert a[-1] == b[-1]  # walks 10k nodes iteratively
    c = Request("c", [-1] + tokens[1:], SamplingParams()).get_block_hashes(2)
    assert a[-1] != c[-1]


def test_adopting_a_cached_key_keeps_equality_and_shortens_the_walk() -> None:
    cached = Request("a", list(range(8)), SamplingParams()).get_block_hashes(4)
    request = Request("b", list(range(8)), SamplingParams())
    hashes = request.get_block_hashes(4)
    request.adopt_cached_block_hash(0, cached[0])
    assert hashes[0] is cached[0]
    assert hashes[1].parent is cached[0]
    assert hashes[1] == cached[1]
