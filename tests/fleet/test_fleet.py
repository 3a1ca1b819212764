"""The fleet: three ledger service processes on one PostgreSQL, keys routed wrongly part of the
time (one key served by two processes at once), one process SIGKILLed mid-run and restarted,
clients retrying by the rules. The oracle: every acknowledged input is in the journal exactly
once with the answer its client got, no input twice, every key's seqs gap-free, stored answers
equal a replay of `decide`, and after `sweep()` every view equals the fold of its journal.

The same run with the fence switched off (the services' test-only ``--no-fencing``) must make
the oracle report violations: the check can fail.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from examples import ledger_domain as ledger
from ferry.projected import PostgresStore
from tests import pg

from ._fleet import Client, Service, Tally, accounts, drive, random_ops, stale_probe

ACCOUNTS = 50
OPS = 4000
CLIENTS = 120
WRONG = 0.25


@asynccontextmanager
async def fleet(
    dsn: str, workdir: Path, n: int = 3, extra: tuple[str, ...] = ()
) -> AsyncIterator[list[Service]]:
    """Start `n` services (in parallel); every one is stopped, or killed, on the way out."""
    services = [Service(i, dsn, workdir, extra) for i in range(n)]
    try:
        async with trio.open_nursery() as nursery:
            for s in services:
                nursery.start_soon(s.start)
        yield services
    finally:
        for s in services:
            s.stop()


async def audit(dsn: str, tally: Tally, *, fencing: bool) -> list[str]:
    """Sweep (the services are stopped), then the full ledger oracle."""
    async with PostgresStore(dsn, connections=1) as store:
        pw = ledger.make_write(store, fencing=fencing)
        for _ in range(3):  # one sweep finishes everything; the next confirms nothing is left
            if (await pw.sweep()).keys == 0:
                break
        return await ledger.verify(pw, acknowledged=tally.acknowledged, caught_up=True)


async def stale_probes(services: list[Service], tally: Tally, names: list[str]) -> list[Any]:
    """Three stale-view withdrawals (see `stale_probe`), each on its own account."""
    probe = Client(services, tally, random.Random(1), wrong=0.0)
    try:
        return [
            await stale_probe(probe, services[0], services[1], names[i], f"probe{i}")
            for i in range(3)
        ]
    finally:
        await probe.aclose()


async def test_fleet_with_wrong_routing_and_a_kill_keeps_the_ledger_exact(
    pg_server: pg.PgServer, tmp_path: Path
) -> None:
    dsn = pg_server.fresh_database_dsn("fleet")
    names = accounts(ACCOUNTS)
    ops = random_ops(OPS, names, random.Random(11), "op-")
    tally = Tally()
    with trio.fail_after(150):
        async with fleet(dsn, tmp_path) as services:
            probes = await stale_probes(services, tally, names)
            killed_at = await drive(
                services,
                ops,
                tally,
                clients=CLIENTS,
                wrong=WRONG,
                seed=3,
                kill=services[1],
                kill_after=OPS // 3,
            )
        problems = await audit(dsn, tally, fencing=True)
    print(f"killed at {killed_at}: {tally.outcomes} retries {tally.retries}")

    assert tally.bugs == []
    assert problems == []
    assert len(tally.acknowledged) == OPS + 3 * 3  # nothing lost, the probes included
    # The stale views were caught by the fence: their withdrawals were refused on fresh state.
    assert [p["ok"] for p in probes] == [False] * 3
    # The run did what it claims: one process died mid-run and came back, in-flight requests
    # saw their connection drop, and wrong routing made stale writers fail and retry.
    assert killed_at is not None and OPS // 3 <= killed_at < OPS
    assert services[1].starts == 2
    assert tally.retries.get("closed", 0) > 0
    assert tally.retries.get("failed", 0) > 0


async def test_without_fencing_wrong_routing_corrupts_the_ledger_and_the_oracle_says_so(
    pg_server: pg.PgServer, tmp_path: Path
) -> None:
    dsn = pg_server.fresh_database_dsn("unfenced")
    names = accounts(8)
    ops = random_ops(800, names, random.Random(12), "op-")
    tally = Tally()
    with trio.fail_after(120):
        async with fleet(dsn, tmp_path, extra=("--no-fencing",)) as services:
            probes = await stale_probes(services, tally, names)
            await drive(services, ops, tally, clients=40, wrong=0.6, seed=4)
        problems = await audit(dsn, tally, fencing=False)
    print(f"{len(problems)} problems, e.g. {problems[:3]}")

    assert tally.bugs == []
    # Each probe withdrew money that was already gone: only a stale view could allow it.
    assert [p["ok"] for p in probes] == [True] * 3
    text = "\n".join(problems)
    assert "seqs not" in text and "duplicates" in text  # two writers interleaved on one key
    assert "replay decides" in text  # decisions taken on stale state
    assert "balance -" in text  # money spent twice: a balance went negative
