"""Fixtures of the core tests: every scheduler a test makes must be drained at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from core_harness import assert_drained, make_scheduler  # pyproject.toml puts tests/core on the path

from pagellm.core import Scheduler


@pytest.fixture
def new_scheduler() -> Iterator[Callable[..., Scheduler]]:
    """Factory of schedulers that are checked for leaks when the test ends.

    A test that leaves a request or a referenced block behind fails here, even if all
    its own assertions passed.
    """
    made: list[Scheduler] = []

    def factory(**kwargs: object) -> Scheduler:
        scheduler = make_scheduler(**kwargs)
        made.append(scheduler)
        return scheduler

    yield factory
    for scheduler in made:
        assert_drained(scheduler)
