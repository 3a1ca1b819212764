"""One engine process whose host clock is skewed or stepped, for tests/fleet/test_lease_clock.py.

``python -m tests.fleet._clock_engine DSN --owner NAME --lease S --gate PATH [--skew S]
[--step S] [--start N]`` opens a flow engine on PostgreSQL through the tests' wall-clock switch
(tests/switches.py) with a host clock that reads the real time plus `skew`, and from the first
SIGUSR1 on plus `skew + step` (an NTP step after it opened). The process's ``time.time`` is
that clock too, replaced before the package is imported, as a host's clock would be for every
part of it (its lease thread included). It starts `--start` flows, says ``ready`` and serves
until SIGTERM; then it prints ``stats {...}`` (its statistics, JSON).

The plan ``clocked`` has one step, ``s1``: its body records ``begin`` and ``end`` in the side
table ``clock_runs`` (flow, owner, attempt, phase, the database's ``clock_timestamp()``: one
clock for both processes) around a wait until the file `--gate` exists (the test says when the
bodies may end, rather than guessing how long a slow machine takes). The side table is written in
autocommit on a connection of its own, so it shows what ran whatever becomes of the flow.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ferry import flow

SIDE = (
    "CREATE TABLE IF NOT EXISTS clock_runs"
    " (flow_id TEXT, owner TEXT, attempt INT, phase TEXT, at DOUBLE PRECISION)"
)


class HostClock:
    """The real time (`real`, the original ``time.time``) plus a skew, plus a step once SIGUSR1
    came."""

    def __init__(self, real: Callable[[], float], skew: float, step: float) -> None:
        self.real = real
        self.skew = skew
        self.step = step
        self.stepped = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stepped = True

    def __call__(self) -> float:
        return self.real() + self.skew + (self.step if self.stepped else 0.0)


def make_plan(side: Any, owner: str, gate: Path) -> flow.Plan:
    import trio

    from ferry import flow

    plan = flow.Plan("clocked")

    def record(ctx: flow.Context, phase: str) -> None:
        side.execute(
            "INSERT INTO clock_runs VALUES (%s, %s, %s, %s,"
            " EXTRACT(EPOCH FROM clock_timestamp())::float8)",
            (ctx.flow_id, owner, ctx.attempt, phase),
        )

    @plan.step
    async def s1(ctx: flow.Context) -> None:
        record(ctx, "begin")
        while not gate.exists():  # noqa: ASYNC110, ASYNC240 (another process makes it)
            await trio.sleep(0.02)
        record(ctx, "end")

    return plan


async def serve(args: argparse.Namespace, clock: HostClock) -> None:
    import attrs
    import psycopg
    import trio

    from ferry.projected import PostgresStore
    from tests import switches

    side = psycopg.connect(args.dsn, autocommit=True, application_name="clock-side")
    side.execute(SIDE)
    plan = make_plan(side, args.owner, Path(args.gate))
    async with (
        PostgresStore(args.dsn) as store,
        switches.open_engine(
            store, [plan], owner=args.owner, lease=args.lease, wall_clock=clock
        ) as engine,
    ):
        for i in range(args.start):
            await engine.start(plan, flow_id=f"{args.owner}{i}")
        print("ready", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                break
        stats = engine.statistics()
    side.close()
    report = {k: v for k, v in attrs.asdict(stats).items() if k != "wakes"}
    print("stats " + json.dumps(report), flush=True)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description="one engine process with a skewed host clock")
    p.add_argument("dsn")
    p.add_argument("--owner", required=True)
    p.add_argument("--lease", type=float, required=True)
    p.add_argument("--gate", required=True)
    p.add_argument("--skew", type=float, default=0.0)
    p.add_argument("--step", type=float, default=0.0)
    p.add_argument("--start", type=int, default=0)
    args = p.parse_args(argv)
    clock = HostClock(time.time, args.skew, args.step)
    time.time = clock  # before the package is imported (and binds it anywhere)
    signal.signal(signal.SIGUSR1, clock.on_signal)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import trio

    trio.run(serve, args, clock)


if __name__ == "__main__":
    main(sys.argv[1:])
