"""One engine process for the fleet edge tests (tests/fleet/test_fleet_processes_that_lapse.py).

``python -m tests.fleet._edge_engine DSN --owner NAME --lease S --hold S [--busy] [--start N]``
opens a flow engine on PostgreSQL (logging WARNING and up to stderr), starts `--start` flows,
says ``ready`` and serves until SIGTERM; then it prints ``stats {...}`` (its statistics, JSON).
If another engine holds the owner name, it prints ``locked MESSAGE`` and exits with status 3.

The plan ``edge`` has one step, ``work``: it records ``before`` in the side table ``edge_runs``
(flow, owner, attempt, phase), then holds for `--hold` seconds, either at a cancellable await
(``trio.sleep``) or, with ``--busy``, in synchronous code that keeps the trio loop busy (a CPU
loop), then records ``after``. The side table is written in autocommit, on a connection of its
own, so it shows what ran whatever becomes of the flow.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from ferry import flow
from ferry.projected import PostgresStore

SIDE = "CREATE TABLE IF NOT EXISTS edge_runs (flow_id TEXT, owner TEXT, attempt INT, phase TEXT)"


def make_plan(side: Any, owner: str, hold: float, busy: bool) -> flow.Plan:
    plan = flow.Plan("edge")

    def record(ctx: flow.Context, phase: str) -> None:
        side.execute(
            "INSERT INTO edge_runs VALUES (%s, %s, %s, %s)",
            (ctx.flow_id, owner, ctx.attempt, phase),
        )

    @plan.step
    async def work(ctx: flow.Context) -> None:
        record(ctx, "before")
        if busy:
            end = time.monotonic() + hold
            while time.monotonic() < end:  # the trio loop is held: no task runs meanwhile
                pass
        else:
            await trio.sleep(hold)
        record(ctx, "after")

    return plan


async def serve(args: argparse.Namespace) -> None:
    import psycopg

    side = psycopg.connect(args.dsn, autocommit=True, application_name="edge-side")
    side.execute(SIDE)
    plan = make_plan(side, args.owner, args.hold, args.busy)
    async with PostgresStore(args.dsn) as store:
        try:
            async with flow.open_engine(
                store, [plan], owner=args.owner, lease=args.lease
            ) as engine:
                for i in range(args.start):
                    await engine.start(plan, flow_id=f"{args.prefix}{i}")
                print("ready", flush=True)
                with trio.open_signal_receiver(signal.SIGTERM) as signals:
                    async for _ in signals:
                        break
                stats = engine.statistics()
        except flow.StoreLocked as exc:
            print(f"locked {exc}", flush=True)
            sys.exit(3)
    side.close()
    report = {k: v for k, v in attrs.asdict(stats).items() if k != "wakes"}
    print("stats " + json.dumps(report), flush=True)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description="one engine process of the fleet edge tests")
    p.add_argument("dsn")
    p.add_argument("--owner", required=True)
    p.add_argument("--lease", type=float, required=True)
    p.add_argument("--hold", type=float, required=True)
    p.add_argument("--busy", action="store_true")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--prefix", default="f")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(serve, p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
