"""The fleet at its edges with engines as separate processes on the suite's
PostgreSQL: the same owner name twice, a step that holds the loop for most of the lease, a
process stopped (SIGSTOP) past its lease while its steps wait, connections killed every 200 ms.

Each engine is ``python -m tests.fleet._edge_engine`` (see there): its one step records
``before`` and ``after`` in the side table ``edge_runs`` around a hold, so the table says which
bodies ran, where, and which went on after their hold. Leases are short (1 to 10 s) so that each
test takes seconds; each waits on what the database shows, never on a fixed guess of timing,
except where a hold must have passed.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from tests import pg

from ._flows import query
from ._processes import EdgeEngine as Engine
from ._processes import all_completed, spawning, until
from ._processes import edge_runs as runs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process tests: Linux signals")


@pytest.fixture
def dsn(pg_server: pg.PgServer) -> str:
    return pg_server.fresh_database_dsn("edges")


@pytest.fixture
def engines(tmp_path: Path, dsn: str) -> Iterator[Callable[..., Engine]]:
    with spawning(partial(Engine, tmp_path, dsn)) as spawn:
        yield spawn


def test_a_second_process_under_a_live_owner_name_is_refused(
    engines: Callable[..., Engine], dsn: str
) -> None:
    first = engines("x", "--lease", "30", "--hold", "60", "--start", "1")
    first.ready()
    until(lambda: len(runs(dsn)) == 1, "first run")
    copy = engines("x", "--lease", "30", "--hold", "60")  # a copy-pasted configuration
    line = copy.line()
    assert line.startswith("locked ") and "owner 'x'" in line, (line, copy.log())
    assert copy.proc.wait(timeout=30) == 3
    assert runs(dsn) == [("f0", "x", 1, "before")]  # nothing ran twice
    # Once the holder is gone (killed, reaped: its process id exists no more on this host), a
    # restart under the name takes over at once, not a lease (30 s) later: it opened, and took
    # the flow over as it opened, while the lease of the one killed still ran (by the database's
    # record of both, not by how long a process takes to start on this machine).
    (lease_until,) = query(dsn, "SELECT lease_until FROM flow_engines WHERE owner = 'x'")[0]
    first.kill()
    again = engines("x", "--lease", "30", "--hold", "0")
    again.ready()
    (started_at,) = query(dsn, "SELECT started_at FROM flow_engines WHERE owner = 'x'")[0]
    assert started_at < lease_until
    until(all_completed(dsn, 1), "completed flow")
    assert again.stop()["recovered"] == 1
    ran = [("f0", "x", 1, "before"), ("f0", "x", 2, "after"), ("f0", "x", 2, "before")]
    assert runs(dsn) == ran


def test_a_step_that_holds_the_loop_for_most_of_the_lease_loses_nothing(
    engines: Callable[..., Engine], dsn: str
) -> None:
    """Engine a's step keeps the trio loop busy for 0.9 s with a lease of 1 s: its heartbeat
    thread keeps the lease, so engine b takes nothing over and the step runs once. (A loop
    held for longer than the lease loses it: tests/fleet/test_frozen_loop.py, docs/adr/0112.
    This fails, 3 runs of 3, with the thread's bound on a silent loop set to one tick, a tenth
    of the lease: a thread that stops renewing as soon as the loop is silent.)"""
    b = engines("b", "--lease", "1", "--hold", "0")
    b.ready()  # b scans every third of a second from now on
    a = engines("a", "--lease", "1", "--hold", "0.9", "--busy", "--start", "1")
    a.ready()
    until(all_completed(dsn, 1), "completed flow")
    b_stats, a_stats = b.stop(), a.stop()
    assert b_stats["claimed"] == 0 and a_stats["lost"] == 0
    assert runs(dsn) == [("f0", "a", 1, "after"), ("f0", "a", 1, "before")]


def test_a_process_stopped_past_its_lease_wakes_with_its_steps_cancelled(
    engines: Callable[..., Engine], dsn: str
) -> None:
    """Engine a's five steps wait at an await (2 s) when a is stopped (SIGSTOP) for longer
    than its lease (1 s); b takes the flows over and completes them. When a is continued, its
    steps' holds are long over, and not one of them goes on: they are cancelled first."""
    a = engines("a", "--lease", "1", "--hold", "2", "--start", "5")
    a.ready()
    until(lambda: len(runs(dsn)) == 5, "five runs on a")
    a.proc.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    b = engines("b", "--lease", "1", "--hold", "0")
    b.ready()
    until(all_completed(dsn, 5), "five completed flows")
    time.sleep(max(0.0, stopped + 3.0 - time.monotonic()))  # a's holds are over by now
    a.proc.send_signal(signal.SIGCONT)
    # a's loop runs again: its steps' holds expired, so any of them that is to go on does so
    # at its first turn, before a notices that it lost its lease (and says so).
    until(lambda: "lost its lease" in a.log(), "lease lost by a")
    a_stats, b_stats = a.stop(), b.stop()
    after_on_a = [r for r in runs(dsn) if r[1] == "a" and r[3] == "after"]
    assert after_on_a == [], f"a's steps went on after its lease lapsed: {after_on_a}"
    assert a_stats["lost"] == 5 and b_stats["claimed"] == 5


def test_connections_killed_every_200_ms_lose_no_lease(
    engines: Callable[..., Engine], dsn: str
) -> None:
    """Engine a runs 20 flows whose steps wait 3 s while every connection to the database is
    killed every 200 ms: each renewal is retried at once on a fresh connection, so a never
    loses its lease (no step runs again) and says so for every retry."""
    a = engines("a", "--lease", "1", "--hold", "3", "--start", "20")
    a.ready()
    stop = threading.Event()

    def killer() -> None:
        while not stop.wait(0.2):
            query(
                dsn,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'"
                " AND application_name <> 'edge-side'",  # the side table's writes go on
            )

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        time.sleep(2.5)
    finally:
        stop.set()
        thread.join()
    until(all_completed(dsn, 20), "twenty completed flows")
    stats = a.stop()
    assert stats["lost"] == 0, (stats, a.log())
    assert sorted({r[2] for r in runs(dsn)}) == [1]  # every step ran once, as attempt 1
    # the retry of the engine's renewal task or of its lease-keeping thread (`_heartbeat`)
    assert re.search(r"renewing (its|the) lease", a.log())
