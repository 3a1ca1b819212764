"""The scenario checker of test_scenarios.py catches planted bugs in the shell."""

from __future__ import annotations

import math
import sys
from typing import Any

import attrs
import pytest
from hypothesis import find, settings

import ferry._lanes as lanes_module
from ferry._room import Room
from tests.ferry.test_scenarios import Options, Sub, check, options, run_scenario, submissions

#: Per-key, zero delay, direct calls, one worker: the ferry of the direct-call planted bugs.
DIRECT_ONE_WORKER = Options(
    max_batch_size=2,
    max_batch_weight=math.inf,
    max_batch_delay=0.0,
    max_in_flight_batches=1,
    max_queueing=4,
    max_queued_weight=math.inf,
    direct_calls=True,
    ranked=False,
)


def release_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: a direct call releases its key as it is admitted instead of after the call
    (two calls in flight for one key). The release at the end of a direct call (the one in
    `Shell.submit`) is then skipped; a worker's release of its batch is left as it is."""
    real_admit, real_release = Room.admit, Room.release

    def admit_and_release(
        room: Room[Any, Any], key: Any, entry: Any, weight: float, rank: Any, now: float
    ) -> Any:
        admission = real_admit(room, key, entry, weight, rank, now)
        if admission is lanes_module.Admission.CLAIMED:
            real_release(room, key, 0.0, False)
        return admission

    def release_unless_direct(room: Room[Any, Any], key: Any, now: float, failed: bool) -> None:
        if sys._getframe(1).f_code.co_name != "submit":
            real_release(room, key, now, failed)

    monkeypatch.setattr(Room, "admit", admit_and_release)
    monkeypatch.setattr(Room, "release", release_unless_direct)


def test_checker_catches_a_key_released_before_its_direct_call_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release_early(monkeypatch)
    opts = DIRECT_ONE_WORKER
    subs = [
        Sub(i, at=i / 2, key=0, rank=0, weight=1, behaviour="ok", cancel_after=None) for i in (0, 1)
    ]
    with pytest.raises(AssertionError, match="two calls in flight"):
        check(opts, subs, run_scenario(opts, subs, close_at=10.0))


def test_hypothesis_finds_the_planted_bug_from_random_scenarios(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release_early(monkeypatch)

    def broken(case: tuple[Options, list[Sub]]) -> bool:
        opts, subs = case
        try:
            check(opts, subs, run_scenario(opts, subs, close_at=30.0))
        except AssertionError:
            return True
        return False

    from hypothesis import strategies as st

    found = find(
        st.tuples(options, submissions()),
        broken,
        settings=settings(max_examples=500, database=None, deadline=None, derandomize=True),
    )
    assert found is not None


def test_checker_catches_inputs_that_close_loses_count_of(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planted bug: close drains the room but forgets to count what it drained."""
    real_drain = lanes_module.drain

    def drain_uncounted(state: Any) -> Any:
        new, drained = real_drain(state)
        return lanes_module._evolve(new, {"drained": state.drained}), drained

    monkeypatch.setattr(lanes_module, "drain", drain_uncounted)
    opts = Options(
        max_batch_size=2,
        max_batch_weight=math.inf,
        max_batch_delay=5.0,
        max_in_flight_batches=1,
        max_queueing=4,
        max_queued_weight=math.inf,
        direct_calls=False,
        ranked=False,
    )
    subs = [Sub(0, at=0.0, key=0, rank=0, weight=1, behaviour="ok", cancel_after=None)]
    with pytest.raises(AssertionError, match="admitted inputs not conserved"):
        check(opts, subs, run_scenario(opts, subs, close_at=1.0))  # closes while 0 waits


def test_checker_catches_direct_calls_beyond_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: admission claims idle keys however many calls are in flight."""
    real_admit = lanes_module.admit

    def admit_unbounded(state: Any, *args: Any, **kw: Any) -> Any:
        limits = state.limits
        free = lanes_module._evolve(state, {"limits": attrs.evolve(limits, max_in_flight=math.inf)})
        new, admission, item = real_admit(free, *args, **kw)
        return lanes_module._evolve(new, {"limits": limits}), admission, item

    monkeypatch.setattr(lanes_module, "admit", admit_unbounded)
    opts = DIRECT_ONE_WORKER
    subs = [
        Sub(i, at=0.0, key=i, rank=0, weight=1, behaviour="ok", cancel_after=None) for i in range(3)
    ]
    with pytest.raises(AssertionError, match="calls in flight, above 1"):
        check(opts, subs, run_scenario(opts, subs, close_at=10.0))
