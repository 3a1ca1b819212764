"""stm figures (docs/stm.md, Costs): each against a baseline timed in the same run, alternating."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import trio

import stm
from stm import TVar, atomically, atomically_nowait, atomically_sync, check
from tests.bench._harness import Row, paired, per_op

ROUNDS = 7


def _in_trio(fn: Callable[[], object]) -> Callable[[], float]:
    """A round that runs the async `fn` (which returns seconds/op) in a fresh trio.run."""

    def round_() -> float:
        result: float = trio.run(fn)  # type: ignore[arg-type]
        return result

    return round_


def _trio_lock_increment(n: int) -> Callable[[], float]:
    async def main() -> float:
        lock = trio.Lock()
        x = 0
        t0 = time.perf_counter()
        for _ in range(n):
            async with lock:
                x += 1
        return (time.perf_counter() - t0) / n

    return _in_trio(main)


def _atomically_increment(n: int) -> Callable[[], float]:
    async def main() -> float:
        tv = TVar(0)

        def increment() -> None:
            tv.set(tv.get() + 1)

        t0 = time.perf_counter()
        for _ in range(n):
            await atomically(increment)
        return (time.perf_counter() - t0) / n

    return _in_trio(main)


def _atomically_read10(n: int) -> Callable[[], float]:
    async def main() -> float:
        tvs = [TVar(i) for i in range(10)]
        a, b, c, d, e, f, g, h, i, j = tvs

        def read10() -> int:
            return (
                a.get() + b.get() + c.get() + d.get() + e.get()
                + f.get() + g.get() + h.get() + i.get() + j.get()
            )  # fmt: skip

        t0 = time.perf_counter()
        for _ in range(n):
            await atomically(read10)
        return (time.perf_counter() - t0) / n

    return _in_trio(main)


def _threading_lock_increment(n: int) -> Callable[[], float]:
    def round_() -> float:
        lock = threading.Lock()
        box = [0]

        def run() -> None:
            for _ in range(n):
                with lock:
                    box[0] += 1

        return per_op(n, run)

    return round_


def _stm_increment(runner: Callable[..., object], n: int) -> Callable[[], float]:
    def round_() -> float:
        tv = TVar(0)

        def increment() -> None:
            tv.set(tv.get() + 1)

        def run() -> None:
            for _ in range(n):
                runner(increment)

        return per_op(n, run)

    return round_


def _threads_increment(threads: int, n: int, reruns: list[float]) -> Callable[[], float]:
    """Seconds per increment when `threads` threads share the `n` increments of one TVar."""

    def round_() -> float:
        tv = TVar(0)

        def increment() -> None:
            tv.set(tv.get() + 1)

        def run() -> None:
            for _ in range(n // threads):
                atomically_sync(increment)

        before = stm.statistics()
        workers = [threading.Thread(target=run) for _ in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
        after = stm.statistics()
        commits = after.commits - before.commits
        if threads > 1:
            reruns.append((after.conflicts - before.conflicts) / commits)
        assert tv.peek() == n // threads * threads
        return elapsed / n

    return round_


def _event_pingpong(n: int) -> Callable[[], float]:
    async def main() -> float:
        events = [trio.Event() for _ in range(n + 1)]

        async def other() -> None:
            for k in range(1, n, 2):
                await events[k].wait()
                events[k + 1].set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.testing.wait_all_tasks_blocked()
            t0 = time.perf_counter()
            for k in range(0, n, 2):
                events[k + 1].set()
                await events[k + 2].wait()
            elapsed = time.perf_counter() - t0
        return elapsed / n

    return _in_trio(main)


def _stm_pingpong(n: int) -> Callable[[], float]:
    async def main() -> float:
        ball = TVar(0)

        def hit(parity: int) -> None:
            value = ball.get()
            check(value % 2 == parity)
            ball.set(value + 1)

        async def other() -> None:
            for _ in range(n // 2):
                await atomically(hit, 1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.testing.wait_all_tasks_blocked()
            t0 = time.perf_counter()
            for _ in range(n // 2):
                await atomically(hit, 0)
            elapsed = time.perf_counter() - t0
        return elapsed / n

    return _in_trio(main)


def _event_broadcast(k: int) -> Callable[[], float]:
    async def main() -> float:
        event = trio.Event()
        async with trio.open_nursery() as nursery:
            for _ in range(k):
                nursery.start_soon(event.wait)
            await trio.testing.wait_all_tasks_blocked()
            t0 = time.perf_counter()
            event.set()
        return (time.perf_counter() - t0) / k

    return _in_trio(main)


def _stm_broadcast(k: int) -> Callable[[], float]:
    async def main() -> float:
        flag = TVar(False)

        def wait_flag() -> None:
            check(flag.get())

        def set_flag() -> None:
            flag.set(True)

        async with trio.open_nursery() as nursery:
            for _ in range(k):
                nursery.start_soon(atomically, wait_flag)
            await trio.testing.wait_all_tasks_blocked()
            t0 = time.perf_counter()
            atomically_nowait(set_flag)
        return (time.perf_counter() - t0) / k

    return _in_trio(main)


def benchmarks() -> list[Row]:
    import trio.testing  # noqa: F401  (wait_all_tasks_blocked)

    rows: list[Row] = []
    n = 20_000
    lock_round = _trio_lock_increment(n)

    value, base = paired(ROUNDS, _atomically_increment(n), lock_round)
    rows.append(Row("stm: await atomically(increment)", value, base, 1.1, note="vs trio.Lock"))
    value, base = paired(ROUNDS, _atomically_read10(n), lock_round)
    rows.append(Row("stm: await atomically(read 10 TVars)", value, base, 1.5, note="vs trio.Lock"))

    m = 100_000
    thread_lock = _threading_lock_increment(m)
    value, base = paired(ROUNDS, _stm_increment(atomically_nowait, m), thread_lock)
    rows.append(
        Row("stm: atomically_nowait(increment)", value, base, 8.0, note="vs threading.Lock")
    )
    value, base = paired(ROUNDS, _stm_increment(atomically_sync, m), thread_lock)
    rows.append(Row("stm: atomically_sync(increment)", value, base, 8.0, note="vs threading.Lock"))

    reruns: list[float] = []
    value, base = paired(ROUNDS, _threads_increment(2, m, reruns), _threads_increment(1, m, []))
    rows.append(
        Row(
            "stm: 2 threads increment one TVar",
            value,
            base,
            3.0,
            unit="us/increment",
            note=f"vs 1 thread; reruns/commit {max(reruns):.3f} (target < 0.1)",
        )
    )

    k = 2_000
    value, base = paired(ROUNDS, _stm_broadcast(k), _event_broadcast(k))
    rows.append(
        Row(
            "stm: wake-up, one commit to tasks in retry",
            value,
            base,
            1.5,
            unit="us/task",
            note=f"vs Event.set to tasks in wait(); {k} tasks woken, rerun, done",
        )
    )
    p = 10_000
    value, base = paired(ROUNDS, _stm_pingpong(p), _event_pingpong(p))
    rows.append(
        Row(
            "stm: ping-pong, block in retry + wake",
            value,
            base,
            math.inf,  # reported: the target is the wake-up row above
            unit="us/handoff",
            note="vs Event ping-pong; includes re-blocking (an attempt that retries)",
        )
    )
    return rows
