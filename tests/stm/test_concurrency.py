"""Counters and bank transfers from trio tasks, OS threads, to_thread workers and two trio loops.

Totals must be exact, and no attempt (not even one about to be thrown away) may ever see the
money total broken: every audit attempt records what it saw, as a side effect inside `fn`.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator

import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

import stm
from stm import TVar, after_commit, atomically, atomically_nowait, atomically_sync, check, retry


@pytest.fixture(autouse=True)
def busy_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


class Bank:
    def __init__(self, accounts: int, each: int) -> None:
        self.accounts = [TVar(each) for _ in range(accounts)]
        self.total = accounts * each
        self.seen: list[int] = []  # every audit attempt's sum, doomed attempts included
        self.transfers = 0  # bumped by after_commit: once per committed transfer
        self._count_lock = threading.Lock()

    def _count(self) -> None:
        with self._count_lock:
            self.transfers += 1

    def transfer(self, i: int, j: int, amount: int) -> int:
        src, dst = self.accounts[i], self.accounts[j]
        moved = min(amount, src.get())
        src.set(src.get() - moved)
        dst.set(dst.get() + moved)
        after_commit(self._count)
        return moved

    def withdraw_blocking(self, i: int, amount: int, into: int) -> None:
        src = self.accounts[i]
        check(src.get() >= amount)
        src.set(src.get() - amount)
        self.accounts[into].modify(lambda v: v + amount)
        after_commit(self._count)

    def audit(self) -> int:
        total = sum(a.get() for a in self.accounts)
        self.seen.append(total)
        return total

    def check_final(self) -> None:
        assert sum(a.peek() for a in self.accounts) == self.total
        assert all(a.peek() >= 0 for a in self.accounts)
        assert set(self.seen) <= {self.total}, "an attempt saw a broken invariant"


def _thread_worker(bank: Bank, seed: int, n: int) -> None:
    rnd = random.Random(seed)
    for _ in range(n):
        i, j = rnd.sample(range(len(bank.accounts)), 2)
        if rnd.random() < 0.2:
            assert atomically_sync(bank.audit) == bank.total
        elif rnd.random() < 0.5:
            atomically_nowait(bank.transfer, i, j, rnd.randrange(1, 30))
        else:
            atomically_sync(bank.transfer, i, j, rnd.randrange(1, 30))


async def _trio_worker(bank: Bank, seed: int, n: int) -> None:
    rnd = random.Random(seed)
    for _ in range(n):
        i, j = rnd.sample(range(len(bank.accounts)), 2)
        if rnd.random() < 0.2:
            assert await atomically(bank.audit) == bank.total
        else:
            await atomically(bank.transfer, i, j, rnd.randrange(1, 30))


def test_counter_exact_from_threads_tasks_and_workers() -> None:
    counter = TVar(0)
    per = 300

    def bump_many() -> None:
        for _ in range(per):
            atomically_sync(counter.modify, lambda v: v + 1)

    async def trio_side() -> None:
        async def bump_task() -> None:
            for _ in range(per):
                await atomically(counter.modify, lambda v: v + 1)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(bump_task)
            for _ in range(2):
                nursery.start_soon(trio.to_thread.run_sync, bump_many)

    threads = [threading.Thread(target=bump_many) for _ in range(3)]
    threads.append(threading.Thread(target=trio.run, args=(trio_side,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.peek() == per * (3 + 4 + 2)


def test_bank_from_threads_and_two_trio_loops() -> None:
    bank = Bank(accounts=8, each=100)

    async def loop(seed: int) -> None:
        async with trio.open_nursery() as nursery:
            for k in range(6):
                nursery.start_soon(_trio_worker, bank, seed * 100 + k, 60)
            nursery.start_soon(trio.to_thread.run_sync, _thread_worker, bank, seed + 7, 60)

    threads = [threading.Thread(target=_thread_worker, args=(bank, s, 150)) for s in range(3)]
    threads += [threading.Thread(target=trio.run, args=(loop, s)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bank.check_final()
    assert len(bank.seen) > 0
    committed_transfers = 3 * 150 + 2 * (6 * 60 + 60)
    assert bank.transfers <= committed_transfers  # audits are not transfers
    assert bank.transfers > committed_transfers // 2


def test_ping_pong_between_two_trio_loops(delta) -> None:
    """Each loop blocks in retry until the other loop's commit wakes it (run_sync_soon)."""
    ball = TVar(0)
    rounds = 100

    async def player(parity: int) -> None:
        def hit() -> bool:
            value = ball.get()
            if value >= 2 * rounds:
                return False
            check(value % 2 == parity)
            ball.set(value + 1)
            return True

        while await atomically(hit):
            pass

    threads = [threading.Thread(target=trio.run, args=(player, p)) for p in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ball.peek() == 2 * rounds
    assert delta()["commits"] == 2 * rounds


def test_blocking_withdraws_from_threads_are_woken_by_trio_deposits() -> None:
    bank = Bank(accounts=3, each=0)
    atomically_nowait(bank.accounts[2].set, 1000)
    bank.total = 1000

    def withdrawer() -> None:
        for _ in range(20):
            atomically_sync(bank.withdraw_blocking, 0, 5, 1)

    async def depositor() -> None:
        for _ in range(4 * 20):
            await atomically(bank.transfer, 2, 0, 5)
            await trio.lowlevel.checkpoint()

    threads = [threading.Thread(target=withdrawer) for _ in range(4)]
    for t in threads:
        t.start()
    trio.run(depositor)
    for t in threads:
        t.join()
    bank.check_final()
    assert bank.accounts[1].peek() == 400
    assert stm.statistics().waiters == 0


@given(
    accounts=st.integers(2, 5),
    tasks=st.integers(1, 8),
    ops=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(1, 40), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    patience=st.integers(0, 5),
)
def test_bank_under_trio_schedules(accounts, tasks, ops, patience) -> None:
    """Blocking withdraws with deadlines and transfers from many tasks, under MockClock.

    trio's scheduler randomness is driven by hypothesis, so schedules replay and shrink. Every
    blocking withdraw either completes or times out exactly at its deadline; money is conserved;
    no waiter is left.
    """
    bank = Bank(accounts=accounts, each=20)
    outcomes: list[str] = []

    def withdraw_until(i: int, j: int, amount: int, deadline: float) -> str:
        src = bank.accounts[i]
        if src.get() >= amount:
            src.set(src.get() - amount)
            bank.accounts[j].modify(lambda v: v + amount)
            return "done"
        retry(deadline=deadline)
        return "timeout"

    async def worker(k: int) -> None:
        for n, (i, j, amount, blocking) in enumerate(ops):
            i, j = i % accounts, (j + k) % accounts
            if n % tasks != k:
                continue
            if blocking:
                deadline = trio.current_time() + patience
                outcome = await atomically(withdraw_until, i, j, amount, deadline)
                if outcome == "timeout":
                    assert trio.current_time() == deadline
                outcomes.append(outcome)
            else:
                await atomically(bank.transfer, i, j, amount)
            assert await atomically(bank.audit) == bank.total

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for k in range(tasks):
                nursery.start_soon(worker, k)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    bank.check_final()
    assert len(outcomes) == sum(1 for op in ops if op[3])
    assert stm.statistics().waiters == 0
