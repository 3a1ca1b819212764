"""A small bank on stm: transfers from many trio tasks and from a plain thread, at once.

- `transfer` moves money if the source has it, in one transaction.
- `withdraw` blocks (stm.retry) until the account holds enough, or gives up at a deadline.
- an auditor checks, in every transaction it runs, that no money was created or lost.

Run it: python examples/bank.py [--seed N]
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import trio

if not __package__:  # run as a script: make `stm` and `examples` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stm
from examples import _cli as cli
from stm import TVar

ACCOUNTS = 10
OPENING = 100
TOTAL = ACCOUNTS * OPENING


class Bank:
    def __init__(self) -> None:
        self.accounts = [TVar(OPENING) for _ in range(ACCOUNTS)]
        self.vault = TVar(0)  # where withdrawn cash goes, so the total stays checkable

    def transfer(self, src: int, dst: int, amount: int) -> bool:
        """Transaction body: move `amount` if `src` has it; say whether it did."""
        have = self.accounts[src].get()
        if have < amount:
            return False
        self.accounts[src].set(have - amount)
        self.accounts[dst].modify(lambda v: v + amount)
        return True

    def withdraw(self, account: int, amount: int, deadline: float) -> bool:
        """Transaction body: take `amount` out, waiting for funds until `deadline` (trio time)."""
        have = self.accounts[account].get()
        if have >= amount:
            self.accounts[account].set(have - amount)
            self.vault.modify(lambda v: v + amount)
            return True
        stm.retry(deadline=deadline)  # sleep until this account changes, or the deadline...
        return False  # ...which has passed: retry returned

    def audit(self) -> int:
        total = sum(a.get() for a in self.accounts) + self.vault.get()
        assert total == TOTAL, f"money appeared or vanished: {total}"
        return total


async def customer(bank: Bank, seed: int, transfers: int) -> int:
    rnd = random.Random(seed)
    done = 0
    for _ in range(transfers):
        src, dst = rnd.sample(range(ACCOUNTS), 2)
        if await stm.atomically(bank.transfer, src, dst, rnd.randint(1, 40)):
            done += 1
        await stm.atomically(bank.audit)
    return done


def clerk_thread(bank: Bank, transfers: int, done: list[int]) -> None:
    """A plain OS thread using the same TVars through atomically_sync."""
    rnd = random.Random(42)
    count = 0
    for _ in range(transfers):
        src, dst = rnd.sample(range(ACCOUNTS), 2)
        if stm.atomically_sync(bank.transfer, src, dst, rnd.randint(1, 40)):
            count += 1
        stm.atomically_sync(bank.audit)
    done.append(count)


async def run(seed: int) -> None:
    bank = Bank()
    results: list[int] = []
    thread_done: list[int] = []
    withdrawals: list[bool] = []

    async def run_customer(n: int) -> None:
        results.append(await customer(bank, seed * 1000 + n, 200))

    async def big_withdrawal(amount: int, patience: float) -> None:
        deadline = trio.current_time() + patience
        withdrawals.append(await stm.atomically(bank.withdraw, 0, amount, deadline))

    clerk = threading.Thread(target=clerk_thread, args=(bank, 2000, thread_done))
    clerk.start()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(big_withdrawal, 150, 2.0)  # waits until account 0 holds 150
        nursery.start_soon(big_withdrawal, TOTAL + 1, 0.2)  # can never succeed: times out
        for n in range(20):
            nursery.start_soon(run_customer, n)
        # Make sure account 0 eventually holds enough, even if the random traffic never does.
        await trio.sleep(0.05)
        for src in range(1, ACCOUNTS):
            await stm.atomically(bank.transfer, src, 0, 20)
    await trio.to_thread.run_sync(clerk.join)

    total = await stm.atomically(bank.audit)
    stats = stm.statistics()
    print(f"transfers committed: {sum(results)} by 20 trio tasks, {thread_done[0]} by a thread")
    print(f"big withdrawal: {'done' if withdrawals.count(True) == 1 else 'missing'}")
    print(f"impossible withdrawal: {'timed out' if withdrawals.count(False) == 1 else 'wrong'}")
    print(f"money in the bank: {total} (expected {TOTAL})")
    print(
        f"stm: {stats.commits} commits, {stats.conflicts} conflict reruns, "
        f"{stats.retries} retries, {stats.wakeups} wake-ups, {stats.waiters} waiters left"
    )
    assert total == TOTAL and sorted(withdrawals) == [False, True] and stats.waiters == 0


def build_parser() -> cli.ArgumentParser:
    parser = cli.parser(__doc__)
    cli.add_seed(parser, 0, "seed of the random traffic")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cli.run(run, args.seed)


if __name__ == "__main__":
    with cli.ctrl_c("bank.py"):
        main()
