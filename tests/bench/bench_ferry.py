"""ferry figures (docs/guide.md, "What a ferry costs"), each against a baseline from the same run.

The baseline batcher is the one a careful trio user would write by hand: an unbounded memory
channel, one worker that drains up to 100 inputs per call, and one `trio.Event` per caller.
Every figure is per input and includes spawning the caller tasks, for the ferry and the baseline
alike, because "many concurrent callers" is what both serve.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing as trio_testing

import ferry
from tests.bench._harness import Row, paired

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def echo(xs: list[int]) -> list[int]:
    await trio.lowlevel.checkpoint()  # a real call waits at least once
    return xs


async def echo_key(key: int, xs: list[int]) -> list[int]:
    await trio.lowlevel.checkpoint()
    return xs


class _Slot:
    __slots__ = ("event", "result")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.result: Any = None


async def _baseline(n: int) -> float:
    send, recv = trio.open_memory_channel[tuple[int, _Slot]](math.inf)

    async def worker() -> None:
        while True:
            first = await recv.receive()
            batch = [first]
            while len(batch) < 100:
                try:
                    batch.append(recv.receive_nowait())
                except trio.WouldBlock:
                    break
            outs = await echo([x for x, _ in batch])
            for (_, slot), out in zip(batch, outs, strict=True):
                slot.result = out
                slot.event.set()

    async def caller(i: int) -> None:
        slot = _Slot()
        send.send_nowait((i, slot))
        await slot.event.wait()
        assert slot.result == i

    async with trio.open_nursery() as outer:
        outer.start_soon(worker)
        t0 = time.perf_counter()
        async with trio.open_nursery() as n_:
            for i in range(n):
                n_.start_soon(caller, i)
        took = time.perf_counter() - t0
        outer.cancel_scope.cancel()
    return took / n


async def _concurrent_callers(f: Callable[[int], Awaitable[int]], n: int) -> float:
    """Seconds per input for `n` callers spawned at once, each awaiting `f(i)`."""

    async def caller(i: int) -> None:
        assert await f(i) == i

    t0 = time.perf_counter()
    async with trio.open_nursery() as n_:
        for i in range(n):
            n_.start_soon(caller, i)
    return (time.perf_counter() - t0) / n


async def _plain(n: int) -> float:
    async with ferry.open_ferry(echo, max_batch_size=100, max_queueing=n) as f:
        return await _concurrent_callers(f, n)


async def _per_key(n: int) -> float:
    async with ferry.open_per_key_ferry(
        echo_key, key=lambda x: x % 1000, max_batch_size=100, max_queueing=n
    ) as f:
        return await _concurrent_callers(f, n)


async def io_call(key: int, xs: list[int]) -> list[int]:
    await trio.lowlevel.checkpoint()  # the least a real call does: wait once
    return xs


async def _direct(n: int) -> float:
    async with ferry.open_per_key_ferry(io_call, key=lambda x: x) as f:
        t0 = time.perf_counter()
        for i in range(n):
            await f(i)
        took = (time.perf_counter() - t0) / n
        assert f.statistics().direct_calls == n
        return took


async def _plain_await(n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        await io_call(i, [i])
    return (time.perf_counter() - t0) / n


async def _lock_round(n: int) -> float:
    lock = trio.Lock()
    t0 = time.perf_counter()
    for _ in range(n):
        async with lock:
            pass
    return (time.perf_counter() - t0) / n


def _direct_overhead(rounds: int, n: int = 20_000) -> tuple[float, float, float]:
    """(direct call, awaiting the call itself, a trio.Lock round): seconds each, best of
    `rounds`, the three interleaved so that they see the same machine."""
    direct, bare, lock = [], [], []
    for _ in range(rounds):
        bare.append(_run(_plain_await, n))
        direct.append(_run(_direct, n))
        lock.append(_run(_lock_round, n))
    return min(direct), min(bare), min(lock)


async def slow_call(key: int, xs: list[int]) -> list[int]:
    await trio.sleep(0.001)  # a typical database or service round trip
    return xs


async def _direct_slow(n: int, through_ferry: bool) -> float:
    async with ferry.open_per_key_ferry(slow_call, key=lambda x: x) as f:
        t0 = time.perf_counter()
        for i in range(n):
            if through_ferry:
                await f(i)
            else:
                await slow_call(i, [i])
        return (time.perf_counter() - t0) / n


async def _with_echo_peer(n: int, through_ferry: bool) -> float:
    """A call that is one round trip to a peer over a local socket pair: a tiny remote call."""
    a, b = trio.socket.socketpair()

    async def peer() -> None:
        while data := await b.recv(64):
            await b.send(data)

    async def remote(key: int, xs: list[int]) -> list[int]:
        await a.send(b"x")
        await a.recv(64)
        return xs

    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer)
        if through_ferry:
            async with ferry.open_per_key_ferry(remote, key=lambda x: x) as f:
                t0 = time.perf_counter()
                for i in range(n):
                    await f(i)
                took = (time.perf_counter() - t0) / n
        else:
            t0 = time.perf_counter()
            for i in range(n):
                await remote(i, [i])
            took = (time.perf_counter() - t0) / n
        nursery.cancel_scope.cancel()
    a.close()
    b.close()
    return took


async def _admission(waiting: int, extra: int = 10_000) -> float:
    """Seconds per admission of `extra` callers into a room already holding `waiting` inputs.

    The garbage collector runs as usual; it is reset with `gc.collect()` before the measured
    part, so both sizes start from the same point of its cycle.
    """
    async with ferry.open_ferry(
        echo, max_batch_delay=1e6, max_batch_size=10**9, max_queueing=10**9
    ) as f:
        async with trio.open_nursery() as n_:
            for i in range(waiting):
                n_.start_soon(f, i)
            await trio_testing.wait_all_tasks_blocked()
            gc.collect()
            t0 = time.perf_counter()
            for i in range(extra):
                n_.start_soon(f, i)
            await trio_testing.wait_all_tasks_blocked()
            took = (time.perf_counter() - t0) / extra
            n_.cancel_scope.cancel()
    return took


async def _admission_keys(waiting: int, extra: int = 10_000) -> float:
    """Seconds per admission of `extra` callers, each with a key of its own, into a per-key room
    already holding `waiting` callers, each with a key of its own (so `waiting` lanes)."""
    async with ferry.open_per_key_ferry(
        echo_key,
        key=lambda x: x,
        max_batch_delay=1e6,
        max_batch_size=10**9,
        max_queueing=10**9,
    ) as f:
        async with trio.open_nursery() as n_:
            for i in range(waiting):
                n_.start_soon(f, i)
            await trio_testing.wait_all_tasks_blocked()
            gc.collect()
            t0 = time.perf_counter()
            for i in range(waiting, waiting + extra):
                n_.start_soon(f, i)
            await trio_testing.wait_all_tasks_blocked()
            took = (time.perf_counter() - t0) / extra
            n_.cancel_scope.cancel()
    return took


def _rss_per_waiting(distinct: bool, n: int = 100_000) -> float:
    """KiB of RSS per waiting caller of a per-key ferry, each with a key of its own (`distinct`)
    or all on one key; measured in a fresh process, so that earlier rounds do not pad it."""
    code = (
        "import trio, tests.bench.bench_ferry as b; "
        f"print(trio.run(b._rss_waiting, {distinct!r}, {n}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=_ROOT
    )
    return float(out.stdout.split()[-1])


async def _rss_waiting(distinct: bool, n: int) -> float:
    async with ferry.open_per_key_ferry(
        echo_key,
        key=(lambda x: x) if distinct else (lambda x: 0),
        max_batch_delay=1e6,
        max_batch_size=10**9,
        max_queueing=10**9,
    ) as f:
        async with trio.open_nursery() as n_:
            n_.start_soon(f, -1)  # warm up
            await trio_testing.wait_all_tasks_blocked()
            gc.collect()
            before = _rss_kib()
            for i in range(n):
                n_.start_soon(f, i)
            await trio_testing.wait_all_tasks_blocked()
            gc.collect()
            per = (_rss_kib() - before) / n
            n_.cancel_scope.cancel()
    return per


def _run(fn: Any, *args: Any) -> float:
    gc.collect()
    result: float = trio.run(fn, *args)
    return result


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def _many_keys(total: int, chunk: int = 10_000) -> tuple[int, int, int]:
    async with ferry.open_per_key_ferry(echo_key, key=lambda x: x, max_queueing=chunk) as f:
        before = 0
        for start in range(0, total, chunk):
            async with trio.open_nursery() as n_:
                for i in range(start, start + chunk):
                    n_.start_soon(f, i)
            if start == chunk:  # after a warm-up chunk, so allocator pools are primed
                gc.collect()
                before = _rss_kib()
        gc.collect()
        return before, _rss_kib(), f.statistics().lanes


def benchmarks() -> list[Row]:
    run = functools.partial
    rows: list[Row] = []
    for n in (10_000, 100_000):
        rounds = ROUNDS if n <= 10_000 else max(1, ROUNDS - 1)
        s, b = paired(rounds, run(_run, _plain, n), run(_run, _baseline, n))
        rows.append(Row(f"ferry plain, {n:,} callers, batch 100", s, b, 1.0))
        s, b = paired(rounds, run(_run, _per_key, n), run(_run, _baseline, n))
        rows.append(Row(f"ferry per-key over 1k keys, {n:,} callers", s, b, 1.5))
    direct, bare, lock = _direct_overhead(ROUNDS + 2)
    rows.append(  # the figure's first form (the shell's); the target is the overhead row below
        Row(
            "direct call at idle vs awaiting call",
            direct,
            bare,
            1.5,
            note="call = 1 checkpoint (the target that counts: the overhead row below)",
        )
    )
    rows.append(
        Row(
            "direct call overhead (direct - bare) vs a Lock round",
            direct - bare,
            lock,
            2.0,
            note=f"{(direct - bare) * 1e6:.1f} us of overhead",
        )
    )
    s, b = paired(
        ROUNDS,
        run(_run, _with_echo_peer, 10_000, True),
        run(_run, _with_echo_peer, 10_000, False),
    )
    rows.append(Row("direct call at idle vs awaiting call", s, b, 1.5, note="call = socket echo"))
    s, b = paired(ROUNDS, run(_run, _direct_slow, 500, True), run(_run, _direct_slow, 500, False))
    rows.append(Row("direct call at idle vs awaiting call", s, b, 1.5, note="call = 1 ms sleep"))
    small = min(_run(_admission, 1_000) for _ in range(ROUNDS))
    large = min(_run(_admission, 100_000) for _ in range(max(1, ROUNDS - 1)))
    rows.append(Row("admission at 100k waiting vs 1k", large, small, 1.5))
    large, small = paired(
        max(1, ROUNDS - 1), run(_run, _admission_keys, 100_000), run(_run, _admission_keys, 1_000)
    )
    rows.append(Row("admission, 100k distinct keys waiting vs 1k", large, small, 1.5))
    distinct, shared = _rss_per_waiting(True), _rss_per_waiting(False)
    rows.append(
        Row(
            "RSS per waiting caller, own key vs one key",
            distinct,
            shared,
            1.5,
            unit="KiB",
            note=f"{distinct - shared:.2f} KiB per waiting key",
        )
    )
    before, after, lanes = trio.run(_many_keys, 1_000_000)
    rows.append(
        Row(
            "RSS after 1M distinct keys vs after 20k",
            after,
            before,
            1.1,
            unit="KiB",
            note=f"lanes={lanes} (must be 0)",
        )
    )
    return rows
