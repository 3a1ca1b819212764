"""`ferry.flow` on SQLite (WAL, ``synchronous=FULL``): group commit, parked flows, recovery.

- **3-step flows**: 1,000 flows started at once, each task ``start`` then ``wait``; seconds per
  flow from the first start to the last completion. Baseline: the same engine with every write
  in its own transaction (``group_commit=False`` of tests/switches.py, docs/adr/0022). Target: the
  engine's time at most 0.2x the baseline's (at least 5x the flows per second).
- **park and wake**: 1,000 flows whose first step parks; once all are parked, each is woken
  (``wake`` then ``wait``). Same baseline and target.
- **100k parked against 1k parked**, each size in a fresh child process (``tests.bench._flow``)
  that parks them through the engine (with a deadline, so each has a timer entry): trio tasks
  alive once everything is parked (target: the same count at both sizes: no task per parked
  flow) and RSS per parked flow (the growth of the process's RSS from 10k parked to 100k, per
  flow; aim: under 1 KB). Then one process opens an engine on each file and times one wake end
  to end (``wake``, then ``wait`` for the completion) on each alternately, while the others
  stay parked: the median at 100k against the median at 1k (target: at most 1.5x).
- **recovery**: a child starts 10,000 flows whose second step hangs, is SIGKILLed once all of
  them are in it, and a fresh engine opens the file: seconds until every flow's step runs
  again. Reported, with the time to start 10,000 fresh flows up to the same step for scale.

Round counts: ``BENCH_ROUNDS`` (default 3) for the first two rows, fewer for the big ones;
``BENCH_FLOW_PARKED`` (default 100000) and ``BENCH_FLOW_RECOVER`` (default 10000) set the sizes.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from ferry import flow
from tests import switches
from tests.bench._flow import parks, start_parks, until_parked
from tests.bench._harness import Row, paired

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
FLOWS = 1000
PARKED = int(os.environ.get("BENCH_FLOW_PARKED", "100000"))
RECOVER = int(os.environ.get("BENCH_FLOW_RECOVER", "10000"))
ROOT = Path(__file__).resolve().parents[2]

three = flow.Plan("three")


@three.step
async def one(ctx: flow.Context) -> None:
    ctx.data["one"] = True


@three.step
async def two(ctx: flow.Context) -> None:
    ctx.data["two"] = True


@three.step
async def three_(ctx: flow.Context) -> None:
    ctx.data["three"] = True


async def run_three_steps(engine: flow.Engine) -> float:
    """Seconds per flow of `FLOWS` concurrent flows of `three`, each started and waited for."""

    async def one(i: int) -> None:
        await engine.wait(await engine.start(three, flow_id=f"f{i}", data={"i": i}))

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(FLOWS):
            nursery.start_soon(one, i)
    took = (time.perf_counter() - t0) / FLOWS
    assert engine.statistics().completed == FLOWS
    return took


async def _three_steps(path: Path, group_commit: bool) -> float:
    async with switches.open_engine(path, plans=[three], group_commit=group_commit) as engine:
        return await run_three_steps(engine)


async def _park_and_wake(path: Path, group_commit: bool) -> float:
    async with switches.open_engine(path, plans=[parks], group_commit=group_commit) as engine:

        async def woken(fid: str) -> None:
            assert await engine.wake(fid, {"ok": True}) is flow.Delivery.RESUMED
            await engine.wait(fid)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(FLOWS):
                nursery.start_soon(start_parks, engine, f"f{i}")
        await until_parked(engine, FLOWS)
        async with trio.open_nursery() as nursery:
            for i in range(FLOWS):
                nursery.start_soon(woken, f"f{i}")
        took = (time.perf_counter() - t0) / FLOWS
        assert engine.statistics().completed == FLOWS
    return took


def _rounds(tmp: Path, fn: Callable[[Path, bool], Any]) -> tuple[float, float]:
    """Alternating rounds, each on a new file: (best with group commit, best without)."""
    counter = iter(range(1_000_000))

    def one(group_commit: bool) -> float:
        gc.collect()
        took: float = trio.run(fn, tmp / f"{fn.__name__}{next(counter)}.db", group_commit)
        return took

    return paired(ROUNDS, lambda: one(True), lambda: one(False))


def _child(*args: str) -> dict[str, Any]:
    """Run ``python -m tests.bench._flow ARGS`` and return the JSON object it prints last (the
    ``crash`` child ends by SIGKILLing itself)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench._flow", *args],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    if done.returncode != (-signal.SIGKILL if args[0] == "crash" else 0):
        raise RuntimeError(f"tests.bench._flow {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def _parked_rows(tmp: Path) -> list[Row]:
    small_db, large_db = str(tmp / "small.db"), str(tmp / "large.db")
    small = _child("parked", small_db, "1000")
    large = _child("parked", large_db, str(PARKED))
    wake = _child("wakes", small_db, large_db, "300")
    label = f"{PARKED // 1000}k" if PARKED >= 1000 else str(PARKED)
    return [
        Row(
            f"flow: trio tasks with {label} parked vs 1k parked",
            large["tasks"],
            small["tasks"],
            1.0,
            unit="tasks",
            note=f"parking {label} took {large['park_seconds']:.0f} s",
        ),
        Row(
            f"flow: RSS per parked flow at {label} parked (aim < 1 KB)",
            large["rss_per_flow"] if large["rss_per_flow"] is not None else math.nan,
            1024.0,
            1.0,
            unit="B",
            note=f"growth from 10k to {label} parked, per flow; baseline: the 1 KB aim",
        ),
        Row(
            f"flow: one wake, end to end, at {label} parked vs 1k parked",
            wake["large"],
            wake["small"],
            1.5,
            note="medians of 300, alternating; each wake one transaction",
        ),
    ]


def _recovery_row(tmp: Path) -> Row:
    rounds = max(1, min(ROUNDS, 2))
    recover, fresh = [], []
    for i in range(rounds):
        path = tmp / f"crash{i}.db"
        killed = _child("crash", str(path), str(RECOVER))
        fresh.append(killed["start_seconds"])
        recover.append(_child("recover", str(path), str(RECOVER))["recover_seconds"])
    label = f"{RECOVER:,}"
    return Row(
        f"flow: recovery after SIGKILL, {label} flows mid-run, until all run again",
        min(recover),
        min(fresh),
        math.inf,
        unit="s",
        note=f"report only; baseline: start {label} fresh flows up to the same step",
    )


def benchmarks() -> list[Row]:
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-flow-") as name:
        tmp = Path(name)
        s, b = _rounds(tmp, _three_steps)
        rows.append(
            Row(
                f"flow: {FLOWS:,} concurrent 3-step flows: group commit vs 1 tx/write",
                s,
                b,
                0.2,
                note=f"{1 / s:,.0f} vs {1 / b:,.0f} flows/s; SQLite WAL, synchronous=FULL",
            )
        )
        s, b = _rounds(tmp, _park_and_wake)
        rows.append(
            Row(
                f"flow: {FLOWS:,} flows park once and are woken: group commit vs 1 tx/write",
                s,
                b,
                0.2,
                note=f"{1 / s:,.0f} vs {1 / b:,.0f} flows/s, end to end",
            )
        )
        rows.extend(_parked_rows(tmp))
        rows.append(_recovery_row(tmp))
    return rows
