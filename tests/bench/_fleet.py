"""The engine process of the fleet benchmark (`bench_fleet.py`).

``python -m tests.bench._fleet DSN --owner NAME --plan three|park|hang ...`` opens an engine on
PostgreSQL and answers commands on stdin, one line each, with one line on stdout:

- ``start I J`` -- start flows ``f{I}`` .. ``f{J-1}`` of the plan (all at once, group commit
  shares their writes), answer ``started`` once every start is durable.
- ``wake I J`` -- wake those flows (``message_id`` = the flow id), answer ``woken``.
- ``quit`` -- close the engine (ending its lease), print its statistics, exit.

Plans: ``three`` (3 steps, each touching ``ctx.data``), ``park`` (one step that parks, then one
more), ``hang`` (its step never returns: flows stay running, for the recovery figure).
``--solo`` commits every write in its own transaction (the baseline).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import attrs
import trio

from ferry import flow
from ferry.projected import PostgresStore
from tests import switches


def plans() -> dict[str, flow.Plan]:
    three = flow.Plan("three")
    park = flow.Plan("park")
    hang = flow.Plan("hang")

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

    @hang.step
    async def forever(ctx: flow.Context) -> None:
        await trio.sleep_forever()

    return {"three": three, "park": park, "hang": hang}


async def serve(args: argparse.Namespace) -> None:
    plan = plans()[args.plan]
    dsn = f"{args.dsn} application_name={args.owner}"
    async with PostgresStore(dsn, connections=4) as store:
        async with switches.open_engine(
            store,
            plans=[plan],
            owner=args.owner,
            lease=args.lease,
            group_commit=not args.solo,
        ) as engine:
            print("ready", flush=True)
            while True:
                line = await trio.to_thread.run_sync(sys.stdin.readline)
                words = line.split()
                if not words or words[0] == "quit":
                    break
                lo, hi = int(words[1]), int(words[2])
                async with trio.open_nursery() as nursery:
                    for i in range(lo, hi):
                        if words[0] == "start":
                            nursery.start_soon(_start, engine, plan, f"f{i}")
                        else:
                            nursery.start_soon(_wake, engine, f"f{i}")
                print("started" if words[0] == "start" else "woken", flush=True)
            stats = engine.statistics()
    report = {k: v for k, v in attrs.asdict(stats).items() if k != "wakes"}
    print("stats " + json.dumps(report), flush=True)


async def _start(engine: flow.Engine, plan: flow.Plan, fid: str) -> None:
    await engine.start(plan, flow_id=fid, data={})


async def _wake(engine: flow.Engine, fid: str) -> None:
    await engine.wake(fid, True, message_id=fid)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description="an engine process of the fleet benchmark")
    p.add_argument("dsn")
    p.add_argument("--owner", required=True)
    p.add_argument("--plan", choices=["three", "park", "hang"], required=True)
    p.add_argument("--lease", type=float, default=30.0)
    p.add_argument("--solo", action="store_true")
    trio.run(serve, p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
