from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import stm


@pytest.fixture(autouse=True)
def _no_waiter_left_behind() -> Iterator[None]:
    """Every stm test must leave no waiter registered on any TVar."""
    yield
    assert stm.statistics().waiters == 0


@pytest.fixture
def delta() -> Callable[[], dict[str, int]]:
    """Counters gained since the fixture was set up (statistics are process-wide)."""
    before = stm.statistics()

    def since() -> dict[str, int]:
        now = stm.statistics()
        return {
            name: getattr(now, name) - getattr(before, name)
            for name in (
                "commits",
                "read_only_commits",
                "conflicts",
                "retries",
                "wakeups",
                "irrevocable_runs",
            )
        }

    return since
