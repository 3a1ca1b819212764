"""One engine process of the schedules' fleet test (tests/fleet/test_fleet_schedules.py).

``python -m tests.fleet._schedule_engine DSN --owner NAME --clock PATH`` opens a flow engine on
PostgreSQL that declares the every-minute schedule ``every`` (overlap ``allow``) of the plan
``tick`` (one step that does nothing), through the tests' switches (tests/switches.py): its
host's wall clock is the number in the file `--clock` (the test steps it a minute at a time,
for every engine of the fleet at once), and it wakes every 0.05 s (``scan_interval``). It says
``ready`` and serves until SIGTERM; then it prints ``stats {...}`` (started ticks, JSON).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ferry import flow


class FileClock:
    """The wall-clock seconds written in a file, read again when the file changed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: int | None = None
        self.value = 0.0

    def __call__(self) -> float:
        changed = os.stat(self.path).st_mtime_ns
        if changed != self.seen:
            with open(self.path) as f:
                text = f.read().strip()
            if text:  # (a write in progress: the last value)
                self.value = float(text)
                self.seen = changed
        return self.value


def make_plan() -> flow.Plan:
    from ferry import flow

    plan = flow.Plan("tick")

    @plan.step
    async def run(ctx: flow.Context) -> None:
        pass

    return plan


async def serve(args: argparse.Namespace) -> None:
    import trio

    from ferry import flow
    from ferry.projected import PostgresStore
    from tests import switches

    plan = make_plan()
    every = flow.Schedule("every", plan, cron="* * * * *", overlap="allow")
    started: dict[str, Any] = {"started": 0}

    class Count(flow.Observer):
        def schedule_ticked(self, tick: flow.ScheduleTick) -> None:
            started["started"] += tick.started

    async with (
        PostgresStore(args.dsn) as store,
        switches.open_engine(
            store,
            [plan],
            owner=args.owner,
            schedules=[every],
            observers=[Count()],
            wall_clock=FileClock(args.clock),
            scan_interval=0.05,
            retain=None,
        ),
    ):
        print("ready", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                break
    print("stats " + json.dumps(started), flush=True)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description="one engine process of the schedules' fleet test")
    p.add_argument("dsn")
    p.add_argument("--owner", required=True)
    p.add_argument("--clock", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import trio

    trio.run(serve, args)


if __name__ == "__main__":
    main(sys.argv[1:])
