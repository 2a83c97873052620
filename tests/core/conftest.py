"""Fixtures of the core tests: every scheduler a test makes must be drained at the end."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Helpers (core_harness.py) are imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent))

from core_harness import assert_drained, make_scheduler  # noqa: E402

from pagellm.core import Scheduler  # noqa: E402


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
