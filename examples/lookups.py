"""Coalescing lookups: many tasks ask a slow remote service for one user each; a ferry sends
their ids in a few batched requests instead of one request per task.

    python examples/lookups.py [--callers 500] [--latency 0.01]

The fake service costs a fixed round trip plus a little per id, and serves at most 4 requests at
once (like a small connection pool), so one request per caller queues up behind the pool while
batched requests share each round trip.
"""

from __future__ import annotations

import argparse
import time

import trio

import ferry


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
    print(f"one request per caller: {callers} requests in {alone:.2f} s")

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
    assert len(names) == callers and names[7] == "user-7"
    print(
        f"through a ferry:        {service.requests} requests in {batched:.2f} s "
        f"(mean batch {stats.inputs_sent / stats.batches:.0f}, {alone / batched:.0f}x faster)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=500)
    parser.add_argument("--latency", type=float, default=0.01)
    args = parser.parse_args()
    trio.run(run, args.callers, args.latency)


if __name__ == "__main__":
    main()
