"""The child process of `bench_flow_speed.py`: one workload on one engine, a JSON report last.

    python tests/bench/_speed.py STORE WORKLOAD N [--rate R]

STORE is an SQLite file path, or ``postgresql:`` followed by a libpq DSN (one engine in this
process, a fleet engine as in production: its lease, its scans, `wait` as a fleet engine waits).
WORKLOAD:

- ``three``: N flows of three steps, all started at once, each task ``start`` then ``wait``;
- ``park``: N flows whose first step parks; once the engine counts all N parked, each task
  ``wake`` then ``wait`` (the second step, then the completion);
- ``spread``: N three-step flows started at a steady R flows per second, each awaited; the
  latency of each from its ``start`` to its ``wait`` returning.

It prints one JSON object: the seconds from the first start to the last completion, the CPU
seconds this process used meanwhile (every thread), the engine's ``writes`` and
``write_batches`` (store transactions that carried its writes), the latency percentiles for
``spread``, and the file ``ferry`` was imported from.

This file is run as a script, never as ``-m``, and imports nothing of ``tests``: the benchmark
runs it once against today's code and once against the code of the baseline commit, extracted
to a directory and put first on ``PYTHONPATH`` (docs/adr/0100). So it uses the public API only,
as it was at that commit: `flow.open_engine`, `Engine.start/wake/wait/statistics`, `flow.Plan`,
`flow.park`, and `ferry.projected.PostgresStore`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

import ferry
from ferry import flow

PG = "postgresql:"


def plans() -> dict[str, flow.Plan]:
    three = flow.Plan("three")
    park = flow.Plan("park")

    async def step(ctx: flow.Context) -> None:
        ctx.data[ctx.step] = True

    for name in ("one", "two", "three"):
        three.step(name=name)(step)

    @park.step
    async def wait_for_it(ctx: flow.Context) -> flow.Outcome:
        return flow.park(timeout=3600)

    @park.step
    async def then(ctx: flow.Context) -> None:
        ctx.data["woken"] = ctx.wake

    return {"three": three, "park": park}


@asynccontextmanager
async def engine_on(store: str, plan: flow.Plan) -> AsyncIterator[flow.Engine]:
    if not store.startswith(PG):
        async with flow.open_engine(store, plans=[plan]) as engine:
            yield engine
        return
    from ferry.projected import PostgresStore

    async with (
        PostgresStore(store.removeprefix(PG), connections=4) as pg,
        flow.open_engine(pg, plans=[plan], owner="speed") as engine,
    ):
        yield engine


async def lockstep(engine: flow.Engine, plan: flow.Plan, n: int) -> dict[str, Any]:
    """`three`: every flow started at once, each awaited by its own task."""

    async def one(i: int) -> None:
        await engine.wait(await engine.start(plan, flow_id=f"f{i}", data={"i": i}))

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return {"seconds": time.perf_counter() - t0}


async def park_and_wake(engine: flow.Engine, plan: flow.Plan, n: int) -> dict[str, Any]:
    """`park`: start all, until all are parked (a 1 ms poll of the engine's counter, no
    database read), then each woken and awaited by its own task."""

    async def started(i: int) -> None:
        await engine.start(plan, flow_id=f"f{i}", data={"i": i})

    async def woken(i: int) -> None:
        assert await engine.wake(f"f{i}", {"ok": True}) is flow.Delivery.RESUMED
        await engine.wait(f"f{i}")

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(started, i)
    while engine.statistics().parked < n:  # noqa: ASYNC110 - a counter in memory, not an event
        await trio.sleep(0.001)
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(woken, i)
    return {"seconds": time.perf_counter() - t0}


async def spread(engine: flow.Engine, plan: flow.Plan, n: int, rate: float) -> dict[str, Any]:
    """`spread`: flow i starts at ``i / rate`` seconds; each one's latency from just before its
    `start` to its `wait` returning."""
    latencies: list[float] = []

    async def one(i: int) -> None:
        t = time.perf_counter()
        await engine.wait(await engine.start(plan, flow_id=f"f{i}", data={"i": i}))
        latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    origin = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            await trio.sleep_until(origin + i / rate)
            nursery.start_soon(one, i)
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "seconds": time.perf_counter() - t0,
        "p50": statistics.median(latencies),
        "p99": cuts[98],
        "max": max(latencies),
    }


async def run(args: argparse.Namespace) -> None:
    plan = plans()["park" if args.workload == "park" else "three"]
    async with engine_on(args.store, plan) as engine:
        cpu = time.process_time()
        if args.workload == "three":
            report = await lockstep(engine, plan, args.n)
        elif args.workload == "park":
            report = await park_and_wake(engine, plan, args.n)
        else:
            report = await spread(engine, plan, args.n, args.rate)
        cpu = time.process_time() - cpu
        stats = engine.statistics()
        assert stats.completed == args.n, stats
    report.update(
        cpu=cpu,
        flows=args.n,
        writes=stats.writes,
        write_batches=stats.write_batches,
        ferry=ferry.__file__,
    )
    print(json.dumps(report), flush=True)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description="one workload of the flow speed benchmark")
    p.add_argument("store", help="an SQLite file path, or postgresql:DSN")
    p.add_argument("workload", choices=["three", "park", "spread"])
    p.add_argument("n", type=int)
    p.add_argument("--rate", type=float, default=100.0, help="flows per second (spread)")
    trio.run(run, p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
