"""One clock for leases (docs/adr/0110): two engine processes share a fleet on the suite's
PostgreSQL, one of them with a host clock that is ahead, or stepped after it opened, through the
tests' wall-clock switch (tests/fleet/_clock_engine.py).

Engine ``a`` (a correct clock) starts ten flows whose one step ``s1`` waits for a gate file;
engine ``b`` opens beside it with a skewed clock and scans for orphans. The gate opens once b
has renewed its lease twice (each renewal is followed by a check, and b scans as often), so b had
its chances to take over. The oracle reads the side table, where every body records when it began
and ended by the database's clock: no two bodies of one step overlap, b took over nothing and ran
no body, and every flow completed.

Before the one clock, b compared a's leases (written by a's clock) with its own: with a clock
10 s ahead, a's 2 s lease looked lapsed, b took all ten flows over at open and ran ``s1`` beside
a (ten overlapping bodies of ten, in 4 of 4 runs). The stepped test failed then on the durable
times (the engine read the wall clock once, at open); its steps after open happened to take
nothing over (an engine's clock did not follow them, and its lease thread's renewal never
shortens a lease).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests import pg

from ._flows import query
from ._processes import EngineProcess, spawning, until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process tests: Linux signals")

LEASE = "2"
FLOWS = 10


class Engine(EngineProcess):
    """One engine process of `_clock_engine`."""

    def __init__(self, workdir: Path, dsn: str, owner: str, *options: str) -> None:
        gate = str(workdir / "gate")
        args = [dsn, "--owner", owner, "--lease", LEASE, "--gate", gate, *options]
        super().__init__(workdir, owner, "tests.fleet._clock_engine", args)


@pytest.fixture
def dsn(pg_server: pg.PgServer) -> str:
    return pg_server.fresh_database_dsn("clock")


@pytest.fixture
def engines(tmp_path: Path, dsn: str) -> Iterator[Callable[..., Engine]]:
    with spawning(partial(Engine, tmp_path, dsn)) as spawn:
        yield spawn


Runs = list[tuple[str, str, int, str, float]]


def runs(dsn: str) -> Runs:
    return [tuple(r) for r in query(dsn, "SELECT * FROM clock_runs ORDER BY at")]


def overlapping(ran: Runs) -> int:
    """How many pairs of bodies of one step were running at the same time (by the database's
    clock): a body is from its ``begin`` to its ``end`` (to the end of the test if it has
    none)."""
    spans: dict[tuple[str, str, int], list[float]] = {}
    for fid, owner, attempt, phase, at in ran:
        span = spans.setdefault((fid, owner, attempt), [at, float("inf")])
        if phase == "end":
            span[1] = at
    pairs = 0
    keys = sorted(spans)
    for i, k in enumerate(keys):
        for j in keys[i + 1 :]:
            if j[0] == k[0] and spans[k][0] < spans[j][1] and spans[j][0] < spans[k][1]:
                pairs += 1
    return pairs


def renewals_seen(dsn: str, owner: str, n: int) -> Callable[[], bool]:
    """A check that holds once `owner`'s lease row changed `n` times since the first call."""
    seen: list[float] = []

    def check() -> bool:
        rows = query(dsn, "SELECT lease_until FROM flow_engines WHERE owner = %s", (owner,))
        if rows and (not seen or rows[0][0] != seen[-1]):
            seen.append(rows[0][0])
        return len(seen) > n

    return check


def completed(dsn: str) -> Callable[[], bool]:
    return lambda: (
        query(dsn, "SELECT COUNT(*) FROM flow_flows WHERE state = 'COMPLETED'") == [(FLOWS,)]
    )


def run_fleet(
    engines: Callable[..., Engine], dsn: str, tmp_path: Path, a: list[str], b: list[str]
) -> tuple[Runs, dict[str, Any], dict[str, Any]]:
    """a starts the flows and runs their bodies up to the gate; b opens beside it (both with
    the given options; SIGUSR1, the clock step, goes to both once both are ready); the gate
    opens after b renewed twice. The side table and both engines' statistics."""
    first = engines("a", "--start", str(FLOWS), *a)
    first.ready()
    until(lambda: len(runs(dsn)) >= FLOWS, "ten bodies begun on a")
    second = engines("b", *b)
    second.ready()
    first.proc.send_signal(signal.SIGUSR1)
    second.proc.send_signal(signal.SIGUSR1)
    until(renewals_seen(dsn, "b", 2), "two renewals of b")
    (tmp_path / "gate").touch()
    until(completed(dsn), "ten completed flows")
    b_stats, a_stats = second.stop(), first.stop()
    return runs(dsn), a_stats, b_stats


def check(ran: Runs, a_stats: dict[str, Any], b_stats: dict[str, Any]) -> None:
    assert overlapping(ran) == 0, f"{overlapping(ran)} overlapping bodies of s1: {ran}"
    assert {owner for _f, owner, _a, _p, _at in ran} == {"a"}, ran
    assert b_stats["claimed"] == 0 and b_stats["recovered"] == 0, b_stats
    assert a_stats["lost"] == 0, a_stats


def test_an_engine_whose_clock_is_ahead_takes_over_nothing_from_a_live_one(
    engines: Callable[..., Engine], dsn: str, tmp_path: Path
) -> None:
    """b's host clock is 10 s ahead (five leases) from before it opened."""
    check(*run_fleet(engines, dsn, tmp_path, [], ["--skew", "10"]))


def test_a_clock_stepped_after_open_takes_over_nothing_and_timestamps_follow_it(
    engines: Callable[..., Engine], dsn: str, tmp_path: Path
) -> None:
    """Both host clocks are stepped once both engines are open, while a's bodies run: a's 30 s
    back, b's 10 s ahead. Nobody takes anything over, and the durable times a writes from
    then on (the flows' last write, their history) follow a's stepped clock: they are 30 s
    behind the database's."""
    ran, a_stats, b_stats = run_fleet(engines, dsn, tmp_path, ["--step", "-30"], ["--step", "10"])
    check(ran, a_stats, b_stats)
    ((behind,),) = query(
        dsn,
        "SELECT MIN(EXTRACT(EPOCH FROM clock_timestamp())::float8 - updated_at) FROM flow_flows",
    )
    assert behind > 25, f"the flows' last writes are {behind:.1f} s behind, not about 30 s"
