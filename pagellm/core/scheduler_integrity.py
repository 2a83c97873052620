"""Core stage: the invariants that tie the scheduler's queues to its KV blocks.

Tests call them after every step (through Scheduler.check_integrity); a violation is a
bug, never a user error. The check is handed the scheduler's queues and its KV cache
manager, not the scheduler, so that this module sits below scheduler.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.request import Request, RequestStatus


def check_scheduler_integrity(
    *,
    kv: KVCacheManager,
    requests: Mapping[str, Request],  # every unfinished request, by id
    running: Sequence[Request],
    waiting: Iterable[Request],
    swapped: Iterable[Request],
    max_num_seqs: int,
) -> None:
    """Raise AssertionError if queues, request states and blocks disagree."""
    kv.check_integrity(running)
    queued = [(r, RequestStatus.RUNNING) for r in running]
    queued += [(r, RequestStatus.WAITING) for r in waiting]
    queued += [(r, RequestStatus.SWAPPED) for r in swapped]
    assert len(queued) == len(requests), "a request is lost or queued twice"
    assert len(running) <= max_num_seqs
    for request, status in queued:
        request_id = request.request_id
        assert requests.get(request_id) is request, f"{request} queued but unknown"
        assert request.status is status, f"{request} sits in the {status.name} queue"
        # Between steps a request always has at least its last token to compute.
        assert 0 <= request.num_computed_tokens < request.num_tokens, (
            f"{request} computed count out of range"
        )
        num_device_blocks = kv.num_device_blocks(request_id)
        is_swapped_out = kv.is_swapped_out(request_id)
        if status is RequestStatus.WAITING:
            assert request.num_computed_tokens == 0 and not kv.holds_blocks(request_id)
        elif status is RequestStatus.SWAPPED:
            assert is_swapped_out and not num_device_blocks, f"{request} not on host"
        else:
            assert not is_swapped_out and num_device_blocks >= (
                kv.num_blocks_for_tokens(request.num_computed_tokens)
            ), f"{request} runs without blocks for its computed tokens"
    for request_id in kv.request_ids_holding_blocks():
        assert request_id in requests, f"finished request {request_id} holds blocks"
