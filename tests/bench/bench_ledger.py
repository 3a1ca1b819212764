"""The ledger through a per-key ferry vs one transaction per input, on SQLite and PostgreSQL.

Both sides run the same `ProjectedWrite` (examples/ledger_domain.py) on the same kind of store,
fresh for every round, with the same 1,000 concurrent clients over 100 accounts taking inputs
from one shared workload. Through the ferry, the inputs waiting for one account go in one batch
(one journal transaction and one projection transaction for all of them); the baseline calls the
`ProjectedWrite` directly with a batch of one per input (it serializes per key on its own lock,
so it is just as correct). Figures are seconds per input, including the clients' task spawning.

The ferry runs with ``direct_calls=False``: under this load a key often goes idle for an instant
between batches, and with direct calls on, the first input to arrive then goes alone (and direct
calls are not bounded by ``max_in_flight_batches``), which roughly halves the mean batch size.
The fast path is for latency at low load; a write path under heavy load batches better without.

Target: the ferry at most 0.2x the baseline's time per input (at least 5x the throughput).
"""

from __future__ import annotations

import math
import os
import random
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


async def _round(make_store: Callable[[], Store], batched: bool) -> float:
    async with make_store() as store:  # type: ignore[attr-defined]
        pw = ledger.make_write(store)
        await pw.setup()
        await _warm(store)
        ops = workload("f" if batched else "u")
        if batched:
            async with ferry.open_per_key_ferry(pw, key=ledger.op_key, direct_calls=False) as f:
                took = await _clients(ops, f)
        else:

            async def alone(op: ledger.Op) -> Any:
                return (await pw(op.account, [op]))[0]

            took = await _clients(ops, alone)
        assert await ledger.verify(pw) == []
        return took


def _row(name: str, make_store: Callable[[], Store], note: str) -> Row:
    value, baseline = paired(
        ROUNDS,
        lambda: trio.run(_round, make_store, True),
        lambda: trio.run(_round, make_store, False),
    )
    return Row(name, value, baseline, 0.2, note=note)


def benchmarks() -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        counter = iter(range(1_000_000))

        def sqlite() -> Store:
            return SqliteStore(Path(tmp) / f"l{next(counter)}.db")

        rows.append(
            _row(
                f"ledger, SQLite, {CLIENTS} clients / {ACCOUNTS} accounts: ferry vs 1 tx/input",
                sqlite,
                f"{INPUTS} inputs/round, synchronous=FULL, direct_calls off",
            )
        )
    name = f"ledger, PostgreSQL, {CLIENTS} clients / {ACCOUNTS} accounts: ferry vs 1 tx/input"
    server = pg.acquire()
    if server is None:
        rows.append(Row(name, math.nan, math.nan, 0.2, note="skipped: " + pg.SKIP_REASON[:60]))
        return rows
    try:

        def postgres() -> Store:
            return PostgresStore(server.fresh_schema_dsn("bench"))

        rows.append(_row(name, postgres, f"{INPUTS} inputs/round, 4 connections, direct_calls off"))
    finally:
        pg.release()
    return rows
