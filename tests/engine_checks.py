"""The drained-engine check every engine test ends with: a leak is a failing test."""

from __future__ import annotations


def assert_engine_drained(llm) -> None:  # noqa: ANN001 - pagellm.LLM
    """No request left, every block free, integrity intact, runner and outputs empty."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    scheduler = engine.scheduler
    scheduler.check_integrity()
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert not manager.request_ids_holding_blocks()
    assert manager.state_slots.num_free == manager.state_slots.num_slots  # a hybrid model's state slots
    # The runner hears of the last finished requests in the next step's output.
    assert engine.step() == []
    assert not engine.runner.requests
    assert not engine.runner.pooling_partials  # embedding requests' partial sums
    assert not engine.output_processor.states
