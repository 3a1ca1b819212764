"""The ledger through a per-key ferry, on SQLite and PostgreSQL: three rows per store.

1. The ferry with default options against one transaction per input. Both sides run the same
   `ProjectedWrite` (examples/ledger_domain.py) on the same kind of store, fresh for every round,
   with the same 1,000 concurrent clients over 100 accounts taking inputs from one shared
   workload. Through the ferry, the inputs waiting for one account go in one batch (one journal
   transaction and one projection transaction for all of them); the baseline calls the
   `ProjectedWrite` directly with a batch of one per input (it serializes per key on its own
   lock, so it is just as correct). Seconds per input, the clients' task spawning included.
   Target: at most 0.2x (at least 5x the throughput).
2. Default options against ``direct_calls=False``, same load. Direct calls are for latency at low
   load; under load they must not cost batching (ADR 0031). Target: within 5%.
3. Latency at idle: one client, one input at a time, with default options against the first
   design (``max_in_flight_calls=math.inf``: every idle key's input goes as a direct call). Both
   make direct calls at idle; the bound must not slow them. The two ferries take turns input by
   input on one store, and the row compares medians (an fsync's jitter is larger than what is
   measured). Target: within 5%.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

import ferry
from examples import ledger_domain as ledger
from ferry.projected import PostgresStore, SqliteStore, Store
from tests import pg
from tests.bench._harness import Row, paired

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
CLIENTS = 1000
ACCOUNTS = 100
INPUTS = int(os.environ.get("BENCH_LEDGER_INPUTS", "5000"))


def workload(tag: str) -> list[ledger.Op]:
    rng = random.Random(7)
    names = [f"a{i}" for i in range(ACCOUNTS)]
    ops = []
    for i in range(INPUTS):
        source = rng.choice(names)
        roll = rng.random()
        if roll < 0.5:
            ops.append(ledger.deposit(f"{tag}-{i}", source, rng.randint(1, 100)))
        elif roll < 0.8:
            ops.append(ledger.withdraw(f"{tag}-{i}", source, rng.randint(1, 100)))
        else:
            dest = rng.choice([n for n in names if n != source])
            ops.append(ledger.transfer(f"{tag}-{i}", source, dest, rng.randint(1, 100)))
    return ops


async def _clients(ops: list[ledger.Op], send: Callable[[ledger.Op], Awaitable[Any]]) -> float:
    work = iter(ops)

    async def client() -> None:
        for op in work:
            await send(op)

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(CLIENTS):
            nursery.start_soon(client)
    return (time.perf_counter() - t0) / len(ops)


async def _warm(store: Store, connections: int = 4) -> None:
    """Open every connection of the store's pool before the clock starts (both sides alike)."""

    def hold(tx: Any) -> None:
        time.sleep(0.05)  # long enough that the others must open connections of their own

    async with trio.open_nursery() as nursery:
        for _ in range(connections):
            nursery.start_soon(store.transact, hold)


async def _round(
    make_store: Callable[[], Store], batched: bool, options: dict[str, Any] | None = None
) -> float:
    async with make_store() as store:  # type: ignore[attr-defined]
        pw = ledger.make_write(store)
        await pw.setup()
        await _warm(store)
        ops = workload("f" if batched else "u")
        if batched:
            async with ferry.open_per_key_ferry(pw, key=ledger.op_key, **(options or {})) as f:
                took = await _clients(ops, f)
        else:

            async def alone(op: ledger.Op) -> Any:
                return (await pw(op.account, [op]))[0]

            took = await _clients(ops, alone)
        assert await ledger.verify(pw) == []
        return took


async def _idle(make_store: Callable[[], Store], inputs: int = 400) -> tuple[float, float]:
    """Median seconds per input for one client sending inputs one after the other, through a
    ferry with default options and through one with ``max_in_flight_calls=math.inf``, alternately
    input by input on one store (so both see the same machine and the same database)."""
    async with make_store() as store:  # type: ignore[attr-defined]
        pw = ledger.make_write(store)
        await pw.setup()
        await _warm(store)
        ops = workload("i")[: 2 * inputs]
        unbounded: dict[str, Any] = {"max_in_flight_calls": math.inf}
        times: tuple[list[float], list[float]] = ([], [])
        async with (
            ferry.open_per_key_ferry(pw, key=ledger.op_key) as default,
            ferry.open_per_key_ferry(pw, key=ledger.op_key, **unbounded) as seed,
        ):
            for i, op in enumerate(ops):
                side = (0, 1, 1, 0)[i % 4]  # ABBA: neither always goes first
                t0 = time.perf_counter()
                await (default, seed)[side](op)
                times[side].append(time.perf_counter() - t0)
            assert default.statistics().direct_calls == len(times[0])
            assert seed.statistics().direct_calls == len(times[1])
        return statistics.median(times[0]), statistics.median(times[1])


def _rows(store: str, make_store: Callable[[], Store], note: str) -> list[Row]:
    def default() -> float:
        return trio.run(_round, make_store, True)

    value, baseline = paired(ROUNDS, default, lambda: trio.run(_round, make_store, False))
    rows = [
        Row(
            f"ledger, {store}: ferry (default options) vs 1 tx/input",
            value,
            baseline,
            0.2,
            note=note,
        )
    ]
    no_direct: dict[str, Any] = {"direct_calls": False}
    value, baseline = paired(ROUNDS, default, lambda: trio.run(_round, make_store, True, no_direct))
    rows.append(
        Row(f"ledger, {store}: default options vs direct_calls=False", value, baseline, 1.05)
    )
    idle = min(400, INPUTS // 2)
    value, baseline = trio.run(_idle, make_store, idle)
    rows.append(
        Row(
            f"ledger, {store}: idle latency, default vs unbounded direct calls",
            value,
            baseline,
            1.05,
            note=f"1 client, 1 input at a time; medians of {idle} each, alternating",
        )
    )
    return rows


def benchmarks() -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        counter = iter(range(1_000_000))

        def sqlite() -> Store:
            return SqliteStore(Path(tmp) / f"l{next(counter)}.db")

        load = f"{CLIENTS} clients, {ACCOUNTS} accounts, {INPUTS} inputs/round"
        rows += _rows("SQLite", sqlite, f"{load}, synchronous=FULL")
    server = pg.acquire()
    if server is None:
        name = "ledger, PostgreSQL: ferry (default options) vs 1 tx/input"
        rows.append(Row(name, math.nan, math.nan, 0.2, note="skipped: " + pg.SKIP_REASON[:60]))
        return rows
    try:

        def postgres() -> Store:
            return PostgresStore(server.fresh_schema_dsn("bench"))

        rows += _rows("PostgreSQL", postgres, f"{load}, 4 connections")
    finally:
        pg.release()
    return rows
