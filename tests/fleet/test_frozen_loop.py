"""A fleet engine whose trio loop is blocked for longer than its lease loses its flows to an
engine that stands by (docs/adr/0112), with engines as separate processes on the suite's
PostgreSQL (`_edge_engine`, lease 1 s): a step that sleeps in the main thread, and a process
that prints to a pipe nobody reads. The twin that a block shorter than the lease costs nothing
is `test_a_step_that_holds_the_loop_for_most_of_the_lease_loses_nothing`, beside the other
fleet edge processes (same engine, same side table).

Before the heartbeat thread watched the loop, both held their ten flows for as long as the
loop was blocked (the thread renewed the lease all along): each test failed at its wait for
the takeover, after ten leases.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests import pg

from ._processes import EdgeEngine as Engine
from ._processes import all_completed, spawning, until
from ._processes import edge_runs as runs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process tests: Linux signals")

LEASE = 1.0
FLOWS = 10
# The other engine takes over within two leases of the block's start (the thread's last
# renewal comes at most a lease into it) and its next scan (a third of a lease), 2.3 leases in
# all; the rest is slack for a loaded machine (measured: 1.7 to 2.2 s).
TAKEOVER_WITHIN = 3.5 * LEASE


@pytest.fixture
def dsn(pg_server: pg.PgServer) -> str:
    return pg_server.fresh_database_dsn("frozen")


@pytest.fixture
def engines(tmp_path: Path, dsn: str) -> Iterator[Callable[..., Engine]]:
    with spawning(partial(Engine, tmp_path, dsn)) as spawn:
        yield spawn


def _blocked(dsn: str) -> Callable[[], bool]:
    return lambda: ("f0", "a", 1, "blocks") in runs(dsn)


def _taken_over(a: Engine, dsn: str) -> float:
    """Wait until a's first step blocks its loop, then until b completed all of a's flows
    (it takes them over); how long that took, in seconds."""
    until(_blocked(dsn), "blocked loop on a")
    blocked = time.monotonic()
    until(all_completed(dsn, FLOWS), "takeover by b", timeout=10 * LEASE)
    took = time.monotonic() - blocked
    print(f"\nb took a's {FLOWS} flows over {took:.2f} s after a's loop blocked (lease {LEASE} s)")
    assert took < TAKEOVER_WITHIN, f"takeover after {took:.2f} s: {a.log()}"
    return took


def _ran_nothing_after_thawing(a_stats: dict[str, Any], b_stats: dict[str, Any], dsn: str) -> None:
    on_a = [r for r in runs(dsn) if r[1] == "a"]
    assert [r for r in on_a if r[3] == "after"] == [], f"a's steps went on after thawing: {on_a}"
    assert sorted(r[0] for r in on_a if r[3] == "before") == [f"f{i}" for i in range(FLOWS)]
    assert a_stats["lost"] == FLOWS and b_stats["claimed"] == FLOWS, (a_stats, b_stats)


def test_a_loop_blocked_ten_leases_loses_its_flows_and_runs_none_of_them_when_it_thaws(
    engines: Callable[..., Engine], dsn: str, tmp_path: Path
) -> None:
    """Engine a runs ten flows whose steps wait at an await; then one of them sleeps in the
    main thread for ten leases (until the test lets it go, once b took over). Its lease thread
    stops renewing a lease after the loop went silent: b takes the ten flows over within about
    two leases and completes them; a, thawed, cancels every step it ran before any goes on."""
    thaw = tmp_path / "thaw"
    b = engines("b", "--lease", str(LEASE), "--hold", "0")
    b.ready()
    a = engines(
        "a", "--lease", str(LEASE), "--hold", "30", "--start", str(FLOWS),
        "--block", str(10 * LEASE), "--thaw", str(thaw),
    )  # fmt: skip
    a.ready()
    _taken_over(a, dsn)
    thaw.touch()
    until(lambda: "lost its lease" in a.log(), "lease lost by a")
    a_stats, b_stats = a.stop(), b.stop()
    assert "its trio loop has not run for" in a.log()
    _ran_nothing_after_thawing(a_stats, b_stats, dsn)


def test_a_process_whose_output_nobody_reads_loses_its_flows(
    engines: Callable[..., Engine], dsn: str
) -> None:
    """Engine a's stdout is a pipe nobody reads: one of its steps prints until the pipe is full
    and the main thread blocks in the write. b takes a's ten flows over; once the pipe is read
    at last, a runs none of them on."""
    b = engines("b", "--lease", str(LEASE), "--hold", "0")
    b.ready()
    a = engines(
        "a", "--lease", str(LEASE), "--hold", "30", "--start", str(FLOWS),
        "--block", "16", "--chatty",
    )  # fmt: skip
    a.ready()  # the last line the test reads until b took over
    _taken_over(a, dsn)
    out = a.proc.stdout
    assert out is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(out), daemon=True)
    reader.start()
    until(lambda: "lost its lease" in a.log(), "lease lost by a")
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=30) == 0, a.log()
    reader.join(timeout=30)
    a_stats = json.loads(next(line for line in lines if line.startswith("stats "))[6:])
    _ran_nothing_after_thawing(a_stats, b.stop(), dsn)
