"""`await atomically` under trio: checkpoints, cancellation, retry, deadlines, precise wake-ups."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

import stm
from stm import TVar, atomically, atomically_nowait, atomically_sync, check, retry


async def test_commit_is_a_checkpoint() -> None:
    tv = TVar(0)
    with trio.testing.assert_checkpoints():
        await atomically(tv.set, 1)
    with trio.testing.assert_checkpoints():
        assert await atomically(tv.get) == 1


async def test_nowait_is_not_a_checkpoint() -> None:
    tv = TVar(0)
    with trio.testing.assert_no_checkpoints():
        atomically_nowait(tv.set, 1)
        with pytest.raises(trio.WouldBlock):
            atomically_nowait(lambda: check(tv.get() == 0))


async def test_cancelled_before_means_nothing_committed() -> None:
    tv = TVar(0)
    ran: list[int] = []

    def fn() -> None:
        ran.append(1)
        tv.set(1)

    with trio.CancelScope() as cs:
        cs.cancel()
        with pytest.raises(trio.Cancelled):
            await atomically(fn)
    assert tv.peek() == 0
    assert ran == []
    assert cs.cancelled_caught is False


async def test_committed_means_never_cancelled() -> None:
    tv = TVar(0)
    with trio.CancelScope() as cs:

        def fn() -> str:
            tv.set(1)
            cs.cancel()  # a cancel arriving while the transaction runs
            return "done"

        assert await atomically(fn) == "done"
        assert tv.peek() == 1
        await trio.lowlevel.checkpoint()  # the cancel lands at the next checkpoint
    assert cs.cancelled_caught


async def _blocked_until(tv: TVar[int], target: int, attempts: list[int]) -> int:
    def fn() -> int:
        attempts.append(1)
        check(tv.get() >= target)
        return tv.get()

    return await atomically(fn)


async def test_retry_blocks_until_a_write_and_wakes_precisely(delta) -> None:
    a, b, c = TVar(0), TVar(0), TVar(0)
    runs_a: list[int] = []
    runs_b: list[int] = []
    got: list[int] = []
    async with trio.open_nursery() as nursery:

        async def wait_a() -> None:
            got.append(await _blocked_until(a, 2, runs_a))

        nursery.start_soon(wait_a)
        nursery.start_soon(_blocked_until, b, 1, runs_b)
        await trio.testing.wait_all_tasks_blocked()
        assert (len(runs_a), len(runs_b)) == (1, 1)
        assert stm.statistics().waiters == 2

        atomically_nowait(c.set, 5)  # nobody waits on c
        atomically_nowait(a.get)  # read-only: wakes nobody
        await trio.testing.wait_all_tasks_blocked()
        assert (len(runs_a), len(runs_b)) == (1, 1)

        atomically_nowait(a.set, 1)  # wakes A only; A retries again
        await trio.testing.wait_all_tasks_blocked()
        assert (len(runs_a), len(runs_b)) == (2, 1)
        assert stm.statistics().waiters == 2

        atomically_nowait(a.set, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert (len(runs_a), len(runs_b)) == (3, 1)
        assert got == [2]
        assert stm.statistics().waiters == 1
        atomically_nowait(b.set, 1)
    assert len(runs_b) == 2
    d = delta()
    assert d["wakeups"] == 3
    assert d["retries"] == 3


async def test_one_commit_wakes_every_waiter_of_that_tvar(delta) -> None:
    tv = TVar(0)
    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(_blocked_until, tv, 1, [])
        await trio.testing.wait_all_tasks_blocked()
        assert stm.statistics().waiters == 20
        await atomically(tv.set, 1)
    assert delta()["wakeups"] == 20


async def test_waiter_on_many_tvars_is_removed_from_all(delta) -> None:
    tvs = [TVar(0) for _ in range(10)]

    def any_set() -> int:
        for i, tv in enumerate(tvs):
            if tv.get():
                return i
        retry()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(atomically, any_set)
        await trio.testing.wait_all_tasks_blocked()
        assert stm.statistics().waiters == 10
        atomically_nowait(tvs[3].set, 1)
        assert stm.statistics().waiters == 0  # unregistered by the commit itself
    assert all(tv._waiters == {} or tv._waiters is None for tv in tvs)


async def test_cancel_while_blocked_leaves_nothing_registered(autojump_clock) -> None:
    tv = TVar(0)
    with trio.move_on_after(1) as cs:
        await atomically(lambda: check(tv.get()))
    assert cs.cancelled_caught
    assert stm.statistics().waiters == 0
    assert tv._waiters is None  # not even an empty set is left


async def test_deadline_uses_trio_clock(autojump_clock, delta) -> None:
    tv = TVar(0)
    start = trio.current_time()
    deadline = start + 5

    def fn() -> str:
        if tv.get():
            return "set"
        retry(deadline=deadline)
        return "timeout"

    with trio.testing.assert_checkpoints():
        assert await atomically(fn) == "timeout"
    assert trio.current_time() == deadline
    assert stm.statistics().waiters == 0
    assert delta()["retries"] == 1


async def test_deadline_only_retry_with_nothing_read(autojump_clock) -> None:
    deadline = trio.current_time() + 3

    def fn() -> float:
        retry(deadline=deadline)
        return trio.current_time()

    assert await atomically(fn) == deadline


async def test_commit_before_deadline_wakes_early(autojump_clock) -> None:
    tv = TVar(0)
    deadline = trio.current_time() + 10

    def fn() -> str:
        if tv.get():
            return "set"
        check(trio.current_time() >= deadline, deadline=deadline)
        return "timeout"

    async with trio.open_nursery() as nursery:
        result = []

        async def waiter() -> None:
            result.append(await atomically(fn))

        nursery.start_soon(waiter)
        await trio.sleep(4)
        await atomically(tv.set, 1)
    assert result == ["set"]
    assert trio.current_time() == pytest.approx(deadline - 6)


async def test_change_between_attempt_and_registration_reruns_at_once(monkeypatch, delta) -> None:
    from stm import _atomically, _txn

    tv = TVar(0)
    real_register = _txn.register

    def racing_register(txn, waiter):  # a commit lands between the attempt and registration
        if tv.peek() == 0:
            atomically_nowait(tv.set, 1)
        return real_register(txn, waiter)

    monkeypatch.setattr(_atomically, "register", racing_register)
    with trio.testing.assert_checkpoints():

        def fn() -> int:
            check(tv.get())
            return tv.get()

        assert await atomically(fn) == 1
    d = delta()
    assert d["retries"] == 1 and d["wakeups"] == 1


async def test_wake_from_a_thread_racing_with_cancel_reschedules_once() -> None:
    tv = TVar(0)
    out: list[str] = []

    def check_then_set() -> None:
        check(tv.get())
        tv.set(2)

    async with trio.open_nursery() as nursery:
        cs = trio.CancelScope()

        async def waiter() -> None:
            with cs:
                await atomically(check_then_set)
                out.append("committed")  # pragma: no cover
            out.append("cancelled" if cs.cancelled_caught else "?")

        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        # Commit from another thread while the loop is stalled: the wake is queued with
        # run_sync_soon, then the cancel runs abort_fn, which must fail (the waiter was fired).
        t = threading.Thread(target=atomically_sync, args=(tv.set, 1))
        t.start()
        t.join()
        cs.cancel()
    assert out == ["cancelled"]
    assert tv.peek() == 1


async def test_commit_and_wake_are_ki_protected() -> None:
    from stm import _txn

    seen: list[bool] = []

    class Probe(_txn.Waiter):
        __slots__ = ()

        def wake(self) -> None:
            seen.append(trio.lowlevel.currently_ki_protected())

    tv = TVar(0)
    txn = _txn.Txn(0)
    txn.reads[tv] = tv._state
    assert _txn.register(txn, Probe())
    assert not trio.lowlevel.currently_ki_protected()
    atomically_nowait(tv.set, 1)
    assert seen == [True]


async def test_many_tasks_counter_exact() -> None:
    tv = TVar(0)

    async def bump(n: int) -> None:
        for _ in range(n):
            await atomically(tv.modify, lambda v: v + 1)

    async with trio.open_nursery() as nursery:
        for _ in range(50):
            nursery.start_soon(bump, 20)
    assert tv.peek() == 1000
