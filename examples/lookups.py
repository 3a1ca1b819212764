"""Coalescing lookups: many tasks ask a slow remote service for one user each; a ferry sends
their ids in a few batched requests instead of one request per task.

    python examples/lookups.py [--callers 500] [--latency 0.01]

The fake service costs a fixed round trip plus a little per id, and serves at most 4 requests at
once (like a small connection pool), so one request per caller queues up behind the pool while
batched requests share each round trip.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import trio

if not __package__:  # run as a script: make `examples._cli` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ferry
from examples import _cli as cli


class FakeUserService:
    """A remote service: `fetch(ids)` takes `latency` seconds plus 20 us per id."""

    def __init__(self, latency: float, connections: int = 4) -> None:
        self.latency = latency
        self.pool = trio.CapacityLimiter(connections)
        self.requests = 0

    async def fetch(self, ids: list[int]) -> list[dict[str, object]]:
        async with self.pool:
            self.requests += 1
            await trio.sleep(self.latency + 20e-6 * len(ids))
            return [{"id": i, "name": f"user-{i}"} for i in ids]


async def run(callers: int, latency: float) -> None:
    # Without a ferry: every task makes its own request.
    service = FakeUserService(latency)
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(callers):
            nursery.start_soon(service.fetch, [i])
    alone = time.perf_counter() - start
    print(f"one request per caller: {cli.plural(callers, 'request')} in {alone:.2f} s")

    # With a ferry: the same tasks, coalesced.
    service = FakeUserService(latency)
    names: dict[int, object] = {}
    start = time.perf_counter()
    async with ferry.open_ferry(
        service.fetch, max_batch_size=200, max_batch_delay=0.002, max_in_flight_batches=4
    ) as lookup:

        async def caller(i: int) -> None:
            user = await lookup(i)
            names[i] = user["name"]

        async with trio.open_nursery() as nursery:
            for i in range(callers):
                nursery.start_soon(caller, i)
        stats = lookup.statistics()
    batched = time.perf_counter() - start
    assert names == {i: f"user-{i}" for i in range(callers)}
    print(
        f"through a ferry:        {cli.plural(service.requests, 'request')} in {batched:.2f} s "
        f"(mean batch {stats.inputs_sent / stats.batches:.0f}, {alone / batched:.0f}x faster)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser(__doc__)
    parser.add_argument(
        "--callers",
        metavar="N",
        type=cli.integer(1),
        default=500,
        help="concurrent tasks, each looking up one user",
    )
    parser.add_argument(
        "--latency",
        metavar="SECONDS",
        type=cli.number(0),
        default=0.01,
        help="round trip of one request to the fake service",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cli.run(run, args.callers, args.latency)


if __name__ == "__main__":
    with cli.ctrl_c("lookups.py"):
        main()
