"""One engine process for the fleet edge tests (tests/fleet/test_fleet_processes_that_lapse.py).

``python -m tests.fleet._edge_engine DSN --owner NAME --lease S --hold S [--busy] [--start N]``
opens a flow engine on PostgreSQL (logging WARNING and up to stderr), starts `--start` flows,
says ``ready`` and serves until SIGTERM; then it prints ``stats {...}`` (its statistics, JSON).
If another engine holds the owner name, it prints ``locked MESSAGE`` and exits with status 3.

With ``--block S`` (and ``--start``), once every started flow's step has recorded ``before`` and
the engine said ``ready``, the step of the first flow blocks the trio loop: it records
``blocks`` and sleeps in the main thread (`time.sleep`) until the file ``--thaw`` exists, at most
`S` seconds; with ``--chatty`` it prints to stdout instead, until it has printed `S` MB (a
process whose output nobody reads blocks in that write once the pipe is full). Then it awaits
a checkpoint and records ``after``.

The plan ``edge`` has one step, ``work``: it records ``before`` in the side table ``edge_runs``
(flow, owner, attempt, phase), then holds for `--hold` seconds, either at a cancellable await
(``trio.sleep``) or, with ``--busy``, in synchronous code that keeps the trio loop busy (a CPU
loop, then a checkpoint), then records ``after``. The side table is written in autocommit, on a
connection of its own, so it shows what ran whatever becomes of the flow.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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


@attrs.define
class Block:
    """What the first flow's step does to the trio loop (``--block``), and the events it waits
    for: every started flow's step began, the engine said ``ready``."""

    seconds: float = 0.0
    thaw: str | None = None
    chatty: bool = False
    flows: int = 0
    began: set[str] = attrs.field(factory=set)
    all_began: trio.Event = attrs.field(factory=trio.Event)
    ready: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self, ctx: flow.Context, prefix: str) -> bool:
        """For the step of `ctx`'s flow: block the loop if it is the first flow's; True if it
        did. A checkpoint after the block."""
        self.began.add(ctx.flow_id)
        if len(self.began) >= self.flows:
            self.all_began.set()
        if not self.seconds or ctx.flow_id != f"{prefix}0" or ctx.attempt != 1:
            return False
        await self.all_began.wait()
        await self.ready.wait()
        return True

    def block(self) -> None:
        """Hold the trio loop: sleep, or print, in the main thread."""
        end = time.monotonic() + self.seconds
        if self.chatty:
            line = "x" * 1023
            for _ in range(int(self.seconds * 1024)):
                print(line)  # blocks in the write once the pipe is full
            return
        while time.monotonic() < end and not (self.thaw and os.path.exists(self.thaw)):
            time.sleep(0.01)


def make_plan(
    side: Any, owner: str, hold: float, busy: bool, block: Block | None = None, prefix: str = "f"
) -> flow.Plan:
    plan = flow.Plan("edge")

    def record(ctx: flow.Context, phase: str) -> None:
        side.execute(
            "INSERT INTO edge_runs VALUES (%s, %s, %s, %s)",
            (ctx.flow_id, owner, ctx.attempt, phase),
        )

    @plan.step
    async def work(ctx: flow.Context) -> None:
        record(ctx, "before")
        if block is not None and await block(ctx, prefix):
            record(ctx, "blocks")
            block.block()
            # Synchronous code that was running when the lease lapsed runs to its next await
            # (docs/adr/0073): here that comes right after the block.
            await trio.lowlevel.checkpoint()
        elif busy:
            end = time.monotonic() + hold
            while time.monotonic() < end:  # the trio loop is held: no task runs meanwhile
                pass
            await trio.lowlevel.checkpoint()  # cancelled here if its lease lapsed meanwhile
        else:
            await trio.sleep(hold)
        record(ctx, "after")

    return plan


async def serve(args: argparse.Namespace) -> None:
    import psycopg

    side = psycopg.connect(args.dsn, autocommit=True, application_name="edge-side")
    side.execute(SIDE)
    block = Block(args.block, args.thaw, args.chatty, args.start)
    plan = make_plan(side, args.owner, args.hold, args.busy, block, args.prefix)
    async with PostgresStore(args.dsn) as store:
        try:
            async with flow.open_engine(
                store, [plan], owner=args.owner, lease=args.lease
            ) as engine:
                for i in range(args.start):
                    await engine.start(plan, flow_id=f"{args.prefix}{i}")
                print("ready", flush=True)
                block.ready.set()
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
    p.add_argument("--block", type=float, default=0.0)
    p.add_argument("--thaw")
    p.add_argument("--chatty", action="store_true")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(serve, p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
