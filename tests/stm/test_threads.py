"""Threads: atomically_sync, cross-thread wake-ups both ways, starvation freedom, opacity."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import trio
import trio.testing

import stm
from stm import TVar, atomically, atomically_nowait, atomically_sync, check, retry


@pytest.fixture
def busy_switching() -> Iterator[None]:
    """Make the interpreter switch threads very often, so transactions really overlap."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


async def _await_for(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10.0
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await trio.sleep(0.001)


def _wait_nonzero(tv: TVar[int]) -> int:
    check(tv.get())
    return tv.get()


async def test_thread_commit_wakes_trio_task(delta) -> None:
    for via_trio_thread in (False, True):
        tv = TVar(0)
        async with trio.open_nursery() as nursery:
            out: list[int] = []

            async def waiter(tv: TVar[int] = tv, out: list[int] = out) -> None:
                out.append(await atomically(_wait_nonzero, tv))

            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert stm.statistics().waiters == 1
            if via_trio_thread:
                await trio.to_thread.run_sync(atomically_sync, tv.set, 7)
            else:
                t = threading.Thread(target=atomically_sync, args=(tv.set, 7))
                t.start()
                t.join()
        assert out == [7]
    assert delta()["wakeups"] == 2


async def test_trio_commit_wakes_blocked_thread(delta) -> None:
    tv = TVar(0)
    async with trio.open_nursery() as nursery:
        out: list[int] = []

        async def in_thread() -> None:
            out.append(await trio.to_thread.run_sync(atomically_sync, _wait_nonzero, tv))

        nursery.start_soon(in_thread)
        await _await_for(lambda: stm.statistics().waiters == 1)
        await atomically(tv.set, 3)
    assert out == [3]
    assert delta()["wakeups"] == 1


def test_thread_commit_wakes_blocked_thread() -> None:
    tv = TVar(0)
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(atomically_sync(_wait_nonzero, tv)))
    t.start()
    _wait_for(lambda: stm.statistics().waiters == 1)
    atomically_nowait(tv.set, 1)
    t.join(10)
    assert out == [1]


def test_sync_deadline_uses_monotonic_and_unregisters(delta) -> None:
    tv = TVar(0)
    deadline = time.monotonic() + 0.05

    def fn() -> str:
        if tv.get():
            return "set"  # pragma: no cover
        retry(deadline=deadline)
        return "timeout"

    assert atomically_sync(fn) == "timeout"
    assert time.monotonic() >= deadline
    assert stm.statistics().waiters == 0
    assert delta()["retries"] == 1


def test_sync_keyboard_interrupt_while_blocked_unregisters(monkeypatch) -> None:
    from stm import _txn

    class Gate:
        def acquire(self, timeout: float = -1) -> bool:
            assert stm.statistics().waiters == 1
            raise KeyboardInterrupt

    real_init = _txn.ThreadWaiter.__init__

    def init(self: _txn.ThreadWaiter) -> None:
        real_init(self)
        self.gate = Gate()  # type: ignore[assignment]

    monkeypatch.setattr(_txn.ThreadWaiter, "__init__", init)
    with pytest.raises(KeyboardInterrupt):
        atomically_sync(_wait_nonzero, TVar(0))
    assert stm.statistics().waiters == 0


def test_doomed_attempt_exception_is_not_propagated(delta) -> None:
    """An attempt whose reads went stale reruns instead of raising."""
    a = TVar(0)
    attempts: list[int] = []

    def fn() -> int:
        attempts.append(a.get())
        if len(attempts) == 1:
            t = threading.Thread(target=atomically_sync, args=(a.set, 1))
            t.start()
            t.join()
            raise ValueError("based on a stale read")
        return a.get()

    assert atomically_sync(fn) == 1
    assert attempts == [0, 1]
    assert delta()["conflicts"] == 1


def _transfer_in_the_middle(a: TVar[int], b: TVar[int]) -> None:
    def move() -> None:
        a.set(a.get() - 10)
        b.set(b.get() + 10)

    t = threading.Thread(target=atomically_sync, args=(move,))
    t.start()
    t.join()


@pytest.mark.parametrize("planted", [False, True])
def test_opacity_a_doomed_attempt_never_sees_a_broken_invariant(monkeypatch, planted) -> None:
    """Read a, let another thread move money a -> b, then read b: the sum must still be 100.

    With the snapshot check planted away (reads of newer versions accepted as they are), the
    same schedule shows the broken invariant: the test can fail.
    """
    from stm import _txn

    if planted:
        monkeypatch.setattr(_txn.Txn, "extend", lambda self, tv: tv._state)
    a, b = TVar(50), TVar(50)
    sums: list[int] = []
    moved: list[bool] = []

    def fn() -> None:
        x = a.get()
        if not moved:
            moved.append(True)
            _transfer_in_the_middle(a, b)
        sums.append(x + b.get())

    atomically_sync(fn)
    if planted:
        assert sums == [110]  # the torn read: 50 from before the transfer, 60 from after
    else:
        assert sums == [100]  # the first attempt was abandoned at the read of b


def test_snapshot_extends_when_unrelated_tvars_change(delta) -> None:
    a, b, c = TVar(0), TVar(0), TVar(0)

    def fn() -> int:
        x = a.get()
        t = threading.Thread(target=atomically_sync, args=(b.set, 5))
        t.start()
        t.join()
        return x + b.get() + c.get()  # b is newer than the snapshot, but a is unchanged

    assert atomically_sync(fn) == 5
    assert delta()["conflicts"] == 0


def test_read_only_transactions_never_rerun_each_other(delta, busy_switching) -> None:
    tvs = [TVar(i) for i in range(20)]

    def read_all() -> int:
        return sum(tv.get() for tv in tvs)

    def reader() -> None:
        for _ in range(300):
            assert atomically_sync(read_all) == 190

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = delta()
    assert d["conflicts"] == 0
    assert d["commits"] == 0


def test_no_starvation_reader_of_100_tvars_vs_two_writers(delta, busy_switching) -> None:
    """A slow transaction reads 100 TVars and writes their sum while two threads keep writing
    the first one: every optimistic attempt fails validation, so it must go irrevocable."""
    from stm import _txn

    tvs = [TVar(0) for _ in range(100)]
    hot = tvs[0]
    out = TVar(-1)
    stop = threading.Event()
    attempts: list[int] = []

    def writer() -> None:
        while not stop.is_set():
            atomically_sync(hot.modify, lambda v: v + 1)

    def slow_sum() -> int:
        attempts.append(1)
        total = 0
        for tv in tvs:
            total += tv.get()
            time.sleep(0)  # let the writers in between any two reads
        out.set(total)
        return total

    writers = [threading.Thread(target=writer) for _ in range(2)]
    for t in writers:
        t.start()
    try:
        _wait_for(lambda: hot.peek() > 10)
        result: list[int] = []
        reader = threading.Thread(target=lambda: result.append(atomically_sync(slow_sum)))
        reader.start()
        reader.join(30)
        assert not reader.is_alive(), "the reader starved"
    finally:
        stop.set()
        for t in writers:
            t.join()
    assert result and result[0] >= 10 and out.peek() == result[0]
    assert len(attempts) <= _txn.MAX_CONFLICTS + 1
    assert delta()["irrevocable_runs"] >= 1


# --- atomically_sync refuses a trio thread -------------------------------------------------------


async def test_sync_in_a_trio_task_raises_and_runs_nothing() -> None:
    tv = TVar(0)
    ran: list[int] = []

    def fn() -> None:
        ran.append(1)
        tv.set(1)

    with pytest.raises(RuntimeError, match="trio loop") as info:
        atomically_sync(fn)
    assert not isinstance(info.value, stm.NestedTransactionError)
    assert ran == [] and tv.peek() == 0
    # ...also where it would not have blocked at all, and from a callback of the loop.
    with pytest.raises(RuntimeError, match="atomically_nowait"):
        atomically_sync(tv.peek)
    errors: list[BaseException] = []

    def callback() -> None:
        try:
            atomically_sync(tv.set, 2)
        except RuntimeError as exc:
            errors.append(exc)

    trio.lowlevel.current_trio_token().run_sync_soon(callback)
    await trio.testing.wait_all_tasks_blocked()
    assert len(errors) == 1 and tv.peek() == 0
    # A worker thread of the same loop is not the loop's thread: it may block.
    await trio.to_thread.run_sync(atomically_sync, tv.set, 3)
    assert tv.peek() == 3


async def test_the_fast_trio_thread_probe_agrees_with_trio() -> None:
    """`_in_trio_run` reads a private trio thread-local: check it against the public answer."""
    from stm._atomically import _in_trio_run

    def both() -> tuple[bool, bool]:
        return _in_trio_run(), trio.lowlevel.in_trio_run()

    assert both() == (True, True)
    assert await trio.to_thread.run_sync(both) == (False, False)
    out: list[tuple[bool, bool]] = []
    t = threading.Thread(target=lambda: out.append(both()))
    t.start()
    t.join(10)
    assert out == [(False, False)]


def test_the_fast_trio_thread_probe_outside_trio() -> None:
    from stm._atomically import _in_trio_run

    assert _in_trio_run() is False is trio.lowlevel.in_trio_run()
