"""Events and streams (SPEC 5.10, issue 31's targets; docs/adr/0179).

- **stream vs data** (SQLite, WAL, ``synchronous=FULL``, the path form): one flow emitting
  `VALUES` values through `STEPS` steps (`VALUES // STEPS` a step), against the same flow
  keeping the same values in ``ctx.data`` (each step appends its values to a list there, so
  that, as in the stream, a reader joining late misses none: what a flow does without a
  stream), both less the same flow doing neither; CPU seconds per value (`_one_flow` says
  why CPU). Target: the stream's cost per value at most 1.2x data's.
- **stream vs data replaced**, reported: the whole flow's CPU against a flow whose steps
  each replace ``ctx.data``'s list with their own values (the same bytes written per step,
  but the data keeps only the last step's: not what a stream gives). Whole flows, as that
  list's own cost is within the noise of nothing (the flow's row is rewritten at every step
  anyway), where the stream's row is a page more per commit: docs/adr/0181.
- **readers** (PostgreSQL, one engine): `READERS` concurrent readers of one flow's stream
  while it emits `READ_VALUES` values through `READ_STEPS` steps; the values read from the
  database (counted at the store's reads, `Feeds.values_read`) per value emitted. Target: 1
  (each value read once, not once per reader); its note gives the reads per write.

The sizes are module constants (`tests/test_bench_builds.py` runs it tiny); ``BENCH_ROUNDS``
(default 5) rounds, the best kept.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio
import trio.testing

from ferry import flow
from ferry.projected import PostgresStore
from tests import pg
from tests.bench._harness import Row

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
VALUES = 10_000
STEPS = 100
REPEAT = 4  # flows measured one after the other, per figure of a round
READERS = 1_000
READ_VALUES = 1_000
READ_STEPS = 20
DURABLE = ("fsync=on", "synchronous_commit=on", "full_page_writes=on")


def _plan(name: str, steps: int, per_step: int, how: str) -> flow.Plan:
    """`steps` steps, each emitting (``how="stream"``) `per_step` values of about 20 bytes,
    or appending them to a list in ``ctx.data`` (``"kept"``), or putting them there in place
    of the last step's (``"replaced"``), or doing neither (``"none"``)."""
    plan = flow.Plan(name)
    for s in range(steps):

        async def step(ctx: flow.Context, s: int = s) -> None:
            values = [f"token {s:04d}-{i:06d}" for i in range(per_step)]
            if how == "stream":
                for v in values:
                    ctx.emit(v)
            elif how == "kept":
                kept = ctx.data.setdefault("values", [])
                assert isinstance(kept, list)
                kept += values
            elif how == "replaced":
                ctx.data["values"] = values

        plan.step(name=f"s{s}")(step)
    return plan


async def _one_flow(path: str, plan: flow.Plan) -> float:
    """CPU seconds (the process's, every thread: the store's too) from the start of a flow
    of `plan` to its end, on a fresh SQLite file (the mean of `REPEAT`). CPU, not wall time:
    on a machine shared with other work the wall time of the difference measured here is
    mostly noise, and fsync, the rest of a commit's cost, is paid once per step by all."""
    async with flow.open_engine(path, plans=[plan]) as engine:
        took = 0.0
        for _ in range(REPEAT):  # one after the other: a flow's cost, several times over
            began = time.process_time()
            fid = await engine.start(plan)
            snap = await engine.wait(fid)
            took += time.process_time() - began
            assert snap.state is flow.State.COMPLETED, snap
        return took / REPEAT


def stream_against_data(paths: Iterator[str]) -> Iterator[Row]:
    per_step = VALUES // STEPS
    hows = ("none", "kept", "replaced", "stream")
    plans = {how: _plan(f"bench-{how}", STEPS, per_step, how) for how in hows}
    best = dict.fromkeys(plans, float("inf"))
    for _ in range(ROUNDS):
        for how, plan in plans.items():  # alternating, in one process
            best[how] = min(best[how], trio.run(_one_flow, next(paths), plan))
    n = per_step * STEPS

    def per_value(how: str) -> float:
        return max(best[how] - best["none"], 1e-9) / n

    whole = (
        f"{n} values through {STEPS} steps; a whole flow's CPU: stream {best['stream']:.3f} s,"
        f" kept in data {best['kept']:.3f} s, replaced in data {best['replaced']:.3f} s,"
        f" neither {best['none']:.3f} s"
    )
    yield Row(
        "stream: cost per value vs the same values kept in ctx.data (SQLite)",
        per_value("stream"),
        per_value("kept"),
        1.2,
        "us/value",  # the table prints seconds as microseconds
        whole,
    )
    yield Row(  # whole flows: the replaced list's own cost is within the noise of nothing
        "stream: a whole flow's CPU vs ctx.data replaced each step (SQLite; reported)",
        best["stream"] / n,
        best["replaced"] / n,
        math.inf,
        "us/value",
        "the same bytes written per step, the data keeping only the last step's; the stream"
        f" less neither: {per_value('stream') * 1e6:.2f} us a value (ADR 0181)",
    )


async def _readers(dsn: str) -> tuple[int, int, int]:
    """`READERS` readers of one flow emitting `READ_VALUES` values: (values read from the
    database, reads, values emitted)."""
    per_step = READ_VALUES // READ_STEPS
    gates = [trio.Event() for _ in range(READ_STEPS)]
    plan = flow.Plan("bench-readers")
    for s in range(READ_STEPS):

        async def step(ctx: flow.Context, s: int = s) -> None:
            await gates[s].wait()
            for i in range(per_step):
                ctx.emit({"s": s, "i": i})

        plan.step(name=f"s{s}")(step)
    async with (
        PostgresStore(dsn, connections=4) as store,
        flow.open_engine(store, [plan], owner="bench") as engine,
    ):
        fid = await engine.start(plan)
        counts: list[int] = []

        async def read() -> None:
            n = 0
            async for _item in engine.stream(fid):
                n += 1
            counts.append(n)

        async with trio.open_nursery() as nursery:
            for _ in range(READERS):
                nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked(0.05)
            for gate in gates:
                gate.set()
                await trio.testing.wait_all_tasks_blocked(0.01)
        feeds: Any = engine._parts.feeds
        assert counts == [per_step * READ_STEPS] * READERS, counts[:3]
        return feeds.values_read, feeds.reads, per_step * READ_STEPS


def readers_row(dsn: str) -> Row:
    read, reads, emitted = trio.run(_readers, dsn)
    return Row(
        f"stream: values read from the database per value, {READERS} readers (PostgreSQL)",
        read / emitted,
        1.0,
        1.0,
        "reads/value",
        f"{emitted} values in {READ_STEPS} writes: {reads} reads of the store in all",
    )


def benchmarks() -> Iterator[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as name:
        tmp = Path(name)
        count = iter(range(1_000_000))
        yield from stream_against_data(str(tmp / f"s{next(count)}.db") for _ in iter(int, 1))
    bindir = pg.find_binaries()
    if bindir is None:
        print(f"PostgreSQL rows skipped: {pg.SKIP_REASON}")
        return
    server = pg.start(bindir, DURABLE)
    try:
        yield readers_row(server.fresh_schema_dsn("r"))
    finally:
        server.stop()
