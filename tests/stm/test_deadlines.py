"""Retry deadlines: once a deadline has passed, `retry(deadline=d)` returns and `check(c,
deadline=d)` raises `trio.TooSlowError`; no runner reruns a transaction in a loop.

Each transaction body counts its attempts and fails the test if it runs more than `SPIN` times:
before this behaviour a passed deadline made the runner rerun `fn` without end (about 24,000
times a second under `atomically`), so these tests failed on the guard instead of hanging.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from functools import partial

import pytest
import trio
import trio.testing

import stm
from stm import TVar, atomically, atomically_nowait, atomically_sync, check, or_else, retry

SPIN = 20


def _count(runs: list[float], now: float) -> None:
    runs.append(now)
    assert len(runs) <= SPIN, "the transaction reran in a loop after its deadline passed"


# --- atomically (trio clock) -------------------------------------------------------------------


async def test_retry_returns_once_its_deadline_has_passed(autojump_clock) -> None:
    tv = TVar(0)
    t0 = trio.current_time()
    runs: list[float] = []

    def fn() -> str:
        _count(runs, trio.current_time())
        if tv.get():
            return "set"  # pragma: no cover
        retry(deadline=t0 + 5)
        return "timeout"

    with trio.testing.assert_checkpoints():
        assert await atomically(fn) == "timeout"
    assert runs == [t0, t0 + 5]  # parked until the deadline, then one rerun that carried on


async def test_a_deadline_already_passed_returns_at_once_and_is_a_checkpoint(
    autojump_clock,
) -> None:
    runs: list[float] = []
    t0 = trio.current_time()

    def fn() -> str:
        _count(runs, trio.current_time())
        retry(deadline=t0 - 1)
        return "late"

    with trio.testing.assert_checkpoints():
        assert await atomically(fn) == "late"
    assert runs == [t0]


async def test_check_raises_too_slow_and_nothing_commits(autojump_clock, delta) -> None:
    tv, written = TVar(0), TVar(0)
    t0 = trio.current_time()
    runs: list[float] = []

    def fn() -> None:
        _count(runs, trio.current_time())
        written.set(1)
        check(tv.get(), deadline=t0 + 3)

    with pytest.raises(trio.TooSlowError, match="deadline"):
        await atomically(fn)
    assert runs == [t0, t0 + 3]
    assert written.peek() == 0
    assert delta()["commits"] == 0


def test_too_slow_says_how_long_ago_the_deadline_passed_not_the_clock_value() -> None:
    """The message gives seconds relative to now, not the runner's raw clock value (which means
    nothing to a reader: trio's clock starts at an arbitrary point)."""
    deadline = time.monotonic() - 2.5

    def fn() -> None:
        check(False, deadline=deadline)

    with pytest.raises(trio.TooSlowError) as info:
        atomically_sync(fn)
    text = str(info.value)
    assert text.startswith("stm.check: the condition was still false at its deadline, which")
    assert re.search(r"passed 2\.5\d\d s ago$", text), text
    assert str(int(deadline)) not in text


async def test_a_deadline_passing_between_attempt_and_park_does_not_spin(autojump_clock) -> None:
    """The deadline is ahead when `retry` runs and behind when the task parks."""
    t0 = trio.current_time()
    runs: list[float] = []

    def fn() -> str:
        _count(runs, trio.current_time())
        try:
            retry(deadline=t0 + 1)
        finally:
            if len(runs) == 1:
                autojump_clock.jump(2)
        return "late"

    assert await atomically(fn) == "late"
    assert runs == [t0, t0 + 2]


async def test_or_else_waits_on_the_union_until_the_earliest_deadline(autojump_clock) -> None:
    """All alternatives retry: woken by a write to any TVar they read, or at the earliest
    deadline, when that alternative's `retry` returns and it carries on."""
    a, b = TVar(0), TVar(0)
    t0 = trio.current_time()
    runs: list[float] = []

    def first() -> str:
        if a.get():
            return "a"  # pragma: no cover
        retry(deadline=t0 + 10)
        return "a timed out"  # pragma: no cover

    def second() -> str:
        if b.get():
            return "b"
        retry(deadline=t0 + 5)
        return "b timed out"

    def fn() -> str:
        _count(runs, trio.current_time())
        return or_else(first, second)

    async with trio.open_nursery() as nursery:
        out = []

        async def waiter() -> None:
            out.append(await atomically(fn))

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert stm.statistics().waiters == 2
        await atomically(b.set, 1)
    assert out == ["b"]
    await atomically(b.set, 0)
    runs.clear()
    assert await atomically(fn) == "b timed out"  # nobody writes: 5, not 10, ends the wait
    assert runs == [t0, t0 + 5]


async def test_or_else_check_past_its_deadline_raises_and_skips_later_alternatives(
    autojump_clock,
) -> None:
    tv = TVar(0)
    t0 = trio.current_time()
    seconds: list[float] = []

    def second() -> str:
        _count(seconds, trio.current_time())
        check(tv.get())
        return "second"  # pragma: no cover

    def first() -> str:
        check(False, deadline=t0 + 2)
        return "first"  # pragma: no cover

    def fn() -> str:
        return or_else(first, second)

    with pytest.raises(trio.TooSlowError):
        await atomically(fn)
    assert seconds == [t0]  # the rerun at the deadline raised in `first`: `second` did not run
    assert trio.current_time() == t0 + 2


# --- atomically_sync (time.monotonic) ----------------------------------------------------------


def test_sync_retry_past_its_deadline_returns() -> None:
    runs: list[float] = []
    deadline = time.monotonic() - 1

    def fn() -> str:
        _count(runs, time.monotonic())
        retry(deadline=deadline)
        return "late"

    assert atomically_sync(fn) == "late"
    assert len(runs) == 1


def test_sync_deadline_passing_between_attempt_and_wait_does_not_spin() -> None:
    runs: list[float] = []
    deadline = time.monotonic() + 0.002

    def fn() -> str:
        _count(runs, time.monotonic())
        try:
            retry(deadline=deadline)
        finally:
            while time.monotonic() < deadline:  # no sleep: spin on the clock for 2 ms
                pass
        return "late"

    assert atomically_sync(fn) == "late"
    assert len(runs) == 2


def test_sync_check_past_its_deadline_raises_too_slow() -> None:
    tv = TVar(0)
    deadline = time.monotonic() - 1
    runs: list[float] = []

    def fn() -> None:
        _count(runs, time.monotonic())
        tv.set(1)
        check(False, deadline=deadline)

    with pytest.raises(trio.TooSlowError):
        atomically_sync(fn)
    assert tv.peek() == 0 and len(runs) == 1


# --- atomically_nowait (the clock of the thread it runs in) ------------------------------------


def test_nowait_outside_trio_uses_monotonic() -> None:
    now = time.monotonic()
    assert atomically_nowait(lambda: retry(deadline=now - 1)) is None
    with pytest.raises(trio.WouldBlock):
        atomically_nowait(lambda: retry(deadline=now + 60))
    with pytest.raises(trio.TooSlowError):
        atomically_nowait(lambda: check(False, deadline=now - 1))


async def test_nowait_in_trio_uses_the_trio_clock(autojump_clock) -> None:
    # Put trio's clock far from time.monotonic(), so that the two clocks disagree both ways.
    autojump_clock.jump(time.monotonic() + 1e6)
    now = trio.current_time()
    assert atomically_nowait(lambda: retry(deadline=now - 1)) is None  # monotonic: far ahead
    with pytest.raises(trio.WouldBlock):
        atomically_nowait(lambda: retry(deadline=now + 1))
    early = time.monotonic() + 1
    assert atomically_nowait(lambda: retry(deadline=early)) is None  # trio: long past


# --- structures --------------------------------------------------------------------------------


def _blocking_ops() -> list[tuple[str, Callable[..., object]]]:
    full: stm.TBQueue[int] = stm.TBQueue(1)
    atomically_nowait(full.put, 1)
    return [
        ("TQueue.get", stm.TQueue[int]().get),
        ("TQueue.peek", stm.TQueue[int]().peek),
        ("TBQueue.get", stm.TBQueue[int](1).get),
        ("TBQueue.peek", stm.TBQueue[int](1).peek),
        ("TBQueue.put", partial(full.put, 2)),
        ("TMVar.take", stm.TMVar[int]().take),
        ("TMVar.read", stm.TMVar[int]().read),
        ("TMVar.put", partial(stm.TMVar(1).put, 2)),
        ("TSemaphore.acquire", partial(stm.TSemaphore(1).acquire, 2)),
    ]


@pytest.mark.parametrize("index", range(len(_blocking_ops())))
async def test_structure_waits_until_its_deadline_then_raises(autojump_clock, index) -> None:
    name, op = _blocking_ops()[index]
    t0 = trio.current_time()
    runs: list[float] = []

    def fn() -> object:
        _count(runs, trio.current_time())
        return op(deadline=t0 + 4)

    with pytest.raises(trio.TooSlowError):
        await atomically(fn)
    assert runs == [t0, t0 + 4], name


def test_structure_deadline_times_out_a_thread() -> None:
    q: stm.TQueue[int] = stm.TQueue()
    runs: list[float] = []

    def get() -> int:
        _count(runs, time.monotonic())
        return q.get(deadline=time.monotonic() - 1)

    with pytest.raises(trio.TooSlowError):
        atomically_sync(get)
    atomically_sync(q.put, 7)
    assert atomically_sync(partial(q.get, deadline=time.monotonic() - 1)) == 7
