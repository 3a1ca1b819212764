"""Child processes of tests/bench/bench_flow.py, each printing one JSON object as its last line.

    python -m tests.bench._flow parked  DB N   # park N flows; tasks, RSS per flow
    python -m tests.bench._flow wakes   SMALL LARGE K   # K wakes on each, alternately
    python -m tests.bench._flow crash   DB N   # start N flows into a hanging step, then SIGKILL
    python -m tests.bench._flow recover DB N   # open DB after the crash: until all N run again

Each size runs in a fresh process so that its RSS is its own.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import statistics
import sys
import time
from typing import Any

import trio
import trio.testing

from ferry import flow

CHUNK = 10_000  # flows started at once while parking or crashing


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trio_tasks() -> int:
    """Every task of this trio run, found by walking the task tree from the root."""
    root = trio.lowlevel.current_root_task()
    assert root is not None
    stack = [root]
    count = 0
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


def report(**figures: Any) -> None:
    print(json.dumps(figures), flush=True)


# ------------------------------------------------------------------------------------- parked

parks = flow.Plan("parks")


@parks.step
async def wait_for_it(ctx: flow.Context) -> flow.Outcome:
    return flow.park(timeout=86400)  # a deadline: each parked flow has its timer entry


@parks.step
async def after(ctx: flow.Context) -> None:
    ctx.data["woken"] = ctx.wake


async def parked(path: str, n: int) -> None:
    """Park `n` flows through the engine, `CHUNK` at a time. RSS per flow is the growth from the
    end of the first chunk (allocator pools and caches warm) to the end, over the flows parked
    in between (None if there is only one chunk)."""
    async with flow.open_engine(path, plans=[parks]) as engine:
        before = 0
        t0 = time.perf_counter()
        for start in range(0, n, CHUNK):
            async with trio.open_nursery() as nursery:
                for i in range(start, min(n, start + CHUNK)):
                    nursery.start_soon(start_parks, engine, f"f{i}")
            await until_parked(engine, min(n, start + CHUNK))
            if start == 0:
                await trio.testing.wait_all_tasks_blocked()
                gc.collect()
                before = rss_bytes()
        park_seconds = time.perf_counter() - t0
        await trio.testing.wait_all_tasks_blocked()  # the runners that parked flows have ended
        tasks = trio_tasks()
        gc.collect()
        rss_per_flow = (rss_bytes() - before) / (n - CHUNK) if n > CHUNK else None
        report(tasks=tasks, rss_per_flow=rss_per_flow, park_seconds=park_seconds)


async def wakes(small: str, large: str, k: int) -> None:
    """One wake end to end (`wake`, then `wait` for the completion), alternately on an engine
    with few parked flows and one with many (both files made by `parked`): medians of `k`."""
    took: dict[str, list[float]] = {small: [], large: []}
    async with (
        flow.open_engine(small, plans=[parks]) as a,
        flow.open_engine(large, plans=[parks]) as b,
    ):
        for i in range(k):
            for path, engine in ((small, a), (large, b)):
                t = time.perf_counter()
                assert await engine.wake(f"f{i}", {"ok": True}) is flow.Delivery.RESUMED
                await engine.wait(f"f{i}")
                took[path].append(time.perf_counter() - t)
    report(small=statistics.median(took[small]), large=statistics.median(took[large]))


async def until_parked(engine: flow.Engine, n: int) -> None:
    """Until the engine counts `n` parked flows (a benchmark's poll: every millisecond)."""
    while engine.statistics().parked < n:  # noqa: ASYNC110 - a counter, not an event
        await trio.sleep(0.001)


async def start_parks(engine: flow.Engine, fid: str) -> None:
    await engine.start(parks, flow_id=fid)


# ------------------------------------------------------------------------------ crash, recover


class Entered:
    """Counts the flows that entered the hanging step; `all_in` is set at `target`."""

    def __init__(self, target: int) -> None:
        self.count = 0
        self.target = target
        self.all_in = trio.Event()


def hanging_plan(entered: Entered) -> flow.Plan:
    plan = flow.Plan("hangs")

    @plan.step
    async def first(ctx: flow.Context) -> None:
        ctx.data["first"] = True

    @plan.step
    async def second(ctx: flow.Context) -> None:
        entered.count += 1
        if entered.count >= entered.target:
            entered.all_in.set()
        await trio.sleep_forever()

    return plan


async def crash(path: str, n: int) -> None:
    entered = Entered(n)
    plan = hanging_plan(entered)
    async with flow.open_engine(path, plans=[plan]) as engine:
        t0 = time.perf_counter()
        for start in range(0, n, CHUNK):
            async with trio.open_nursery() as nursery:
                for i in range(start, min(n, start + CHUNK)):
                    nursery.start_soon(partial_start, engine, plan, f"f{i}")
        await entered.all_in.wait()
        report(start_seconds=time.perf_counter() - t0)
        os.kill(os.getpid(), signal.SIGKILL)


async def partial_start(engine: flow.Engine, plan: flow.Plan, fid: str) -> None:
    await engine.start(plan, flow_id=fid)


async def recover(path: str, n: int) -> None:
    entered = Entered(n)
    plan = hanging_plan(entered)
    t0 = time.perf_counter()
    async with flow.open_engine(path, plans=[plan]) as engine:
        await entered.all_in.wait()
        took = time.perf_counter() - t0
        assert engine.statistics().recovered == n
    report(recover_seconds=took)


def main(argv: list[str]) -> None:
    if argv[0] == "wakes":
        trio.run(wakes, argv[1], argv[2], int(argv[3]))
        return
    mode, path, n = argv[0], argv[1], int(argv[2])
    trio.run({"parked": parked, "crash": crash, "recover": recover}[mode], path, n)


if __name__ == "__main__":
    main(sys.argv[1:])
