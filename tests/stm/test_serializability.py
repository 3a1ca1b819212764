"""Serializability, checked by an oracle over recorded list-append histories from many threads.

The oracle is shown to catch a planted bug: with commit-time validation switched off, a forced
write-skew schedule produces a dependency cycle, and the oracle finds it.
"""

from __future__ import annotations

import itertools
import random
import sys
import threading
from collections.abc import Iterator

import pytest

from stm import TVar, after_commit, atomically_sync

from ._oracle import Committed, anomalies, find_cycle

KEYS = 6


@pytest.fixture(autouse=True)
def busy_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


class Store:
    def __init__(self) -> None:
        self.tvars: dict[int, TVar[tuple[int, ...]]] = {k: TVar(()) for k in range(KEYS)}
        self.history: list[Committed] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def new_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def record(self, txn: Committed) -> None:
        with self._lock:
            self.history.append(txn)

    def run(self, ops: list[tuple[str, int]], pause: threading.Barrier | None = None) -> None:
        """One transaction: ('r', k) reads key k, ('a', k) appends a fresh element to it.

        With `pause`, the first attempt waits at the barrier after its reads and before its
        writes, so that two transactions are forced to overlap.
        """
        first = [True]

        def fn() -> None:
            txn_id = self.new_id()
            reads: dict[int, tuple[int, ...]] = {}
            appends: dict[int, int] = {}
            planned: list[tuple[int, tuple[int, ...]]] = []
            for op, key in ops:
                value = self.tvars[key].get()
                reads.setdefault(key, value)
                if op == "a" and key not in appends:
                    appends[key] = self.new_id()
                    planned.append((key, value))
            if pause is not None and first[0]:
                first[0] = False
                pause.wait(10)
            for key, value in planned:
                self.tvars[key].set((*value, appends[key]))
            after_commit(self.record, Committed(txn_id, reads, appends))

        atomically_sync(fn)

    def final(self) -> dict[int, tuple[int, ...]]:
        return {k: tv.peek() for k, tv in self.tvars.items()}


def _random_ops(rnd: random.Random) -> list[tuple[str, int]]:
    return [(rnd.choice("ra"), rnd.randrange(KEYS)) for _ in range(rnd.randint(1, 4))]


def test_random_list_append_histories_from_threads_are_serializable() -> None:
    store = Store()

    def client(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(150):
            store.run(_random_ops(rnd))

    threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.history) == 600
    assert anomalies(store.history, store.final()) == []


def _write_skew(store: Store) -> None:
    """T1 reads x and appends to y; T2 reads y and appends to x; both read before either writes."""
    barrier = threading.Barrier(2)
    t1 = threading.Thread(target=store.run, args=([("r", 0), ("a", 1)], barrier))
    t2 = threading.Thread(target=store.run, args=([("r", 1), ("a", 0)], barrier))
    t1.start()
    t2.start()
    t1.join()
    t2.join()


def test_forced_write_skew_is_serialized() -> None:
    store = Store()
    for _ in range(5):
        _write_skew(store)
    assert len(store.history) == 10
    assert anomalies(store.history, store.final()) == []


def test_oracle_catches_planted_bug_commit_without_validation(monkeypatch) -> None:
    from stm import _txn

    monkeypatch.setattr(_txn, "_UNSAFE_SKIP_VALIDATION", True)
    store = Store()
    _write_skew(store)
    found = anomalies(store.history, store.final())
    assert any(a.startswith("dependency cycle") for a in found), found


def test_oracle_catches_lost_append() -> None:
    history = [Committed(1, {0: ()}, {0: 10}), Committed(2, {0: ()}, {0: 20})]
    found = anomalies(history, {0: (20,)})
    assert found == ["lost append: T1 appended 10 to 0"]


def test_oracle_accepts_a_serial_history() -> None:
    history = [
        Committed(1, {0: ()}, {0: 10}),
        Committed(2, {0: (10,), 1: ()}, {1: 20}),
        Committed(3, {0: (10,), 1: (20,)}, {}),
    ]
    assert anomalies(history, {0: (10,), 1: (20,)}) == []


def test_find_cycle() -> None:
    assert find_cycle({1: {2}, 2: {3}, 3: set()}) is None
    assert find_cycle({1: {2}, 2: {3}, 3: {1}}) == [1, 2, 3, 1]
