"""The single-TVar transaction `stm._txn.update` (ADR 0033): the ferry's room commits with it.

Same guarantees as any transaction on one TVar: atomic, serializable with every other commit
(threads included), precise wake-ups, bounded reruns. The thread test is shown to fail when
validation is skipped.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import trio
import trio.testing

import stm
from stm import TVar, _txn


@pytest.fixture
def busy_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _add(n: int, *, ring: bool = False) -> Callable[[int, None], tuple[int, int, bool]]:
    def fn(old: int, _: None) -> tuple[int, int, bool]:
        return old + n, old, ring

    return fn


def test_installs_the_new_value_returns_the_result_and_rings_in_the_same_commit(
    delta: Callable[[], dict[str, int]],
) -> None:
    tv, bell = TVar(1), TVar(0)
    clock = _txn._clock
    assert _txn.update(tv, bell, _add(2), None) == 1
    assert (tv.peek(), bell.peek()) == (3, 0)
    assert _txn.update(tv, bell, _add(2, ring=True), None) == 3
    assert (tv.peek(), bell.peek()) == (5, 1)
    assert tv._state[0] == bell._state[0] == _txn._clock == clock + 2
    assert delta()["commits"] == 2


def test_returning_the_old_value_without_a_ring_is_read_only(
    delta: Callable[[], dict[str, int]],
) -> None:
    tv, bell = TVar([1]), TVar(0)
    clock, state = _txn._clock, tv._state
    assert _txn.update(tv, bell, lambda old, _: (old, len(old), False), None) == 1
    assert tv._state is state and _txn._clock == clock
    assert delta() == {
        "commits": 0,
        "read_only_commits": 1,
        "conflicts": 0,
        "retries": 0,
        "wakeups": 0,
        "irrevocable_runs": 0,
    }
    _txn.update(tv, bell, lambda old, _: (old, None, True), None)  # a ring alone is a write
    assert bell.peek() == 1 and tv._state is not state and tv.peek() is state[1]


def test_an_exception_from_fn_propagates_and_nothing_is_written() -> None:
    tv, bell = TVar(1), TVar(0)
    state, clock = tv._state, _txn._clock

    def boom(old: int, _: None) -> tuple[int, None, bool]:
        raise KeyError(old)

    with pytest.raises(KeyError):
        _txn.update(tv, bell, boom, None)
    assert tv._state is state and bell.peek() == 0 and _txn._clock == clock
    assert not _txn._lock.locked()


def test_a_commit_between_read_and_install_reruns_fn_on_the_new_value(
    delta: Callable[[], dict[str, int]],
) -> None:
    tv, bell = TVar(0), TVar(0)
    seen: list[int] = []

    def fn(old: int, _: None) -> tuple[int, None, bool]:
        seen.append(old)
        if len(seen) == 1:
            stm.atomically_nowait(tv.set, 100)  # another commit lands meanwhile
        return old + 1, None, False

    _txn.update(tv, bell, fn, None)
    assert seen == [0, 100] and tv.peek() == 101
    assert delta()["conflicts"] == 1


def test_after_max_conflicts_fn_runs_holding_the_lock_and_cannot_lose(
    delta: Callable[[], dict[str, int]],
) -> None:
    tv, bell = TVar(0), TVar(0)
    calls: list[bool] = []

    def fn(old: int, _: None) -> tuple[int, int, bool]:
        locked = _txn._lock.locked()
        calls.append(locked)
        if not locked:
            stm.atomically_nowait(tv.modify, lambda v: v + 1000)  # always beaten
        return old + 1, old, False

    result = _txn.update(tv, bell, fn, None)
    assert calls == [False] * _txn.MAX_CONFLICTS + [True]
    assert result == 1000 * _txn.MAX_CONFLICTS and tv.peek() == result + 1
    d = delta()
    assert d["conflicts"] == _txn.MAX_CONFLICTS and d["irrevocable_runs"] == 1


def test_the_irrevocable_run_releases_the_lock_when_fn_raises() -> None:
    tv, bell = TVar(0), TVar(0)

    def fn(old: int, _: None) -> tuple[int, None, bool]:
        if _txn._lock.locked():
            raise ValueError("in the irrevocable run")
        stm.atomically_nowait(tv.modify, lambda v: v + 1)
        return old, None, True

    with pytest.raises(ValueError):
        _txn.update(tv, bell, fn, None)
    assert not _txn._lock.locked() and bell.peek() == 0


class _Counted:
    """`_txn.update(tv, bell, _slow_increment, None)`, counting the calls that returned."""

    def __init__(self, tv: TVar[int]) -> None:
        self.tv, self.bell = tv, TVar(0)
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        _txn.update(self.tv, self.bell, _slow_increment, None)
        with self.lock:
            self.calls += 1


def _slow_increment(old: int, _: None) -> tuple[int, None, bool]:
    total = old
    for _i in range(20):  # a window for another thread to commit in
        total += 0
    return total + 1, None, False


def _in_threads(update: Callable[[], None], until: Callable[[], bool], threads: int) -> None:
    """Each thread calls `update` in rounds of 1000, all starting together, until `until()`
    holds after a round (at most 50 rounds): overlaps are likely in one round, certain in 50."""
    barrier = threading.Barrier(threads)
    stop = [False]

    def run() -> None:
        for _ in range(50):
            for _ in range(1000):
                update()
            if barrier.wait() == 0:
                stop[0] = until()
            barrier.wait()
            if stop[0]:
                return

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()


def test_threads_updating_one_tvar_lose_no_increment(
    busy_switching: None, delta: Callable[[], dict[str, int]]
) -> None:
    """`update` from two threads and `atomically_sync` from a third, on one TVar: they run
    until some commit lost its validation and reran, and no increment is lost."""
    tv = TVar(0)
    update = _Counted(tv)

    def increment() -> None:
        tv.set(tv.get() + 1)

    other = threading.Thread(target=lambda: [stm.atomically_sync(increment) for _ in range(2000)])
    other.start()
    _in_threads(update, lambda: delta()["conflicts"] > 0, threads=2)
    other.join()
    assert delta()["conflicts"] > 0
    assert tv.peek() == update.calls + 2000


def test_the_thread_test_fails_when_update_skips_validation(
    busy_switching: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_txn, "_UNSAFE_SKIP_VALIDATION", True)
    tv = TVar(0)
    update = _Counted(tv)
    _in_threads(update, lambda: tv.peek() < update.calls, threads=3)
    assert tv.peek() < update.calls  # increments were lost


async def test_a_commit_wakes_the_tasks_blocked_on_the_tvar_or_on_a_bell_it_rings() -> None:
    tv, bell = TVar(0), TVar(0)
    woke: list[str] = []

    async def wait_value() -> None:
        await stm.atomically(lambda: stm.check(tv.get() >= 1))
        woke.append("value")

    async def wait_bell() -> None:
        await stm.atomically(lambda: stm.check(bell.get() >= 1))
        woke.append("bell")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_value)
        nursery.start_soon(wait_bell)
        await trio.testing.wait_all_tasks_blocked()
        _txn.update(tv, bell, lambda old, _: (old, None, False), None)  # read-only: wakes nobody
        await trio.testing.wait_all_tasks_blocked()
        assert woke == []
        _txn.update(tv, bell, _add(1), None)  # a write without a ring: the value's waiter only
        await trio.testing.wait_all_tasks_blocked()
        assert woke == ["value"]
        _txn.update(tv, bell, lambda old, _: (old, None, True), None)
    assert woke == ["value", "bell"]
