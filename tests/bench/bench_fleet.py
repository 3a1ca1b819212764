"""`ferry.flow` on a fleet: engine processes on one PostgreSQL (ADR 0075).

- **throughput**: 1,000 flows per round, shared out among 1, 2 or 3 engine processes (each
  starts its share at once and runs them); seconds per flow from the first start to the last
  completion, best of ``BENCH_ROUNDS`` rounds. Two workloads: the 3-step flow, and park then
  wake (each flow's first step parks; once all are parked, each is woken through another
  engine than the one that started it, and runs its second step). Beside each, the baseline of
  the first engine: the same engines committing every write in its own transaction
  (``group_commit=False``, tests/switches.py). Rows: group commit against that baseline at the
  same number of
  engines (target: at most 1x, i.e. not slower), and 2 or 3 engines against 1 (how throughput
  scales; reported, with a loose target: on this 2-core machine the database and every engine
  share two cores, so more processes add contention rather than capacity). Their note says
  what limits the figure: the CPU per flow of the engines and of PostgreSQL over all rounds,
  how many of the machine's cores were busy and with how much other work, and the WAL fsyncs
  per flow, their time and how much of the time one was under way (`tests/bench/_usage.py`).
- **recovery after a SIGKILL**, for a lease of 1, 2 and 4 s: engine A runs 300 flows whose step
  never returns, engine B serves the same store; A is SIGKILLed and the clock runs until B has
  taken over every one of A's flows (its step running again, attempt 2). The median of
  ``BENCH_ROUNDS`` rounds against the lease (expected between 2/3 and 4/3 of the lease, plus
  the takeover itself: A's lease had up to a lease left, and B scans every third of it).

The processes are `tests/bench/_fleet.py`; the database is a throwaway PostgreSQL of its own
(tests/pg.py) with durable commits (``fsync``, ``synchronous_commit`` and ``full_page_writes``
on, unlike the tests' server), as SQLite's ``synchronous=FULL`` in the SQLite figures (ADR
0057). Progress is read from the database every 20 ms.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import psycopg

from ferry.flow._store import _schema
from tests import pg
from tests.bench import _usage
from tests.bench._harness import Row

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
FLOWS = 1000
HANGING = 300
ROOT = Path(__file__).resolve().parents[2]


class Engine:
    """One engine process (`tests.bench._fleet`)."""

    def __init__(self, dsn: str, owner: str, plan: str, *, lease: float, solo: bool) -> None:
        command = [sys.executable, "-m", "tests.bench._fleet", dsn, "--owner", owner]
        command += ["--plan", plan, "--lease", str(lease)] + (["--solo"] if solo else [])
        self.owner = owner
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == f"{word}\n", f"{self.owner}: {line!r}"

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.close()

    def quit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.close()

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _count(conn: psycopg.Connection, sql: str, params: Sequence[object] = ()) -> int:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0])


def _until(conn: psycopg.Connection, sql: str, params: Sequence[object], n: int) -> None:
    deadline = time.monotonic() + 300
    while _count(conn, sql, params) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"stuck waiting for {n}: {sql}")
        time.sleep(0.02)


def _prepare(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        _schema.create_schema(_Tx(conn))


class _Tx:
    dialect = "postgres"

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    @property
    def connection(self) -> psycopg.Connection:
        return self.conn

    def execute(self, sql: str, params: Sequence[object] = ()) -> list[tuple[object, ...]]:
        cur = self.conn.execute(sql.replace("?", "%s"), params)
        return cur.fetchall() if cur.description is not None else []

    def executemany(self, sql: str, rows: Sequence[Sequence[object]]) -> None:
        raise NotImplementedError


@attrs.frozen
class Throughput:
    """`per_flow`: the best seconds per flow over the rounds; `cpu`: what all the rounds used."""

    per_flow: float
    used: _usage.Used


def throughput(server: pg.PgServer, plan: str, engines: int, *, solo: bool) -> Throughput:
    """Best seconds per flow over the rounds, for `engines` processes, and the CPU they, the
    server and the machine used over all rounds."""
    dsn = server.fresh_schema_dsn("fleetbench")
    _prepare(dsn)
    procs = [Engine(dsn, f"e{i}", plan, lease=30.0, solo=solo) for i in range(engines)]
    best = float("inf")
    try:
        for p in procs:
            p.expect("ready")
        with psycopg.connect(dsn, autocommit=True) as conn:
            postmaster = _usage.postmaster_of(_count(conn, "SELECT pg_backend_pid()"))
            meter = _usage.Meter([p.proc.pid for p in procs], postmaster, conn)
            meter.start()
            for r in range(ROUNDS):
                base = r * FLOWS
                share = [
                    (base + FLOWS * i // engines, base + FLOWS * (i + 1) // engines)
                    for i in range(engines)
                ]
                t0 = time.perf_counter()
                for p, (lo, hi) in zip(procs, share, strict=True):
                    p.send(f"start {lo} {hi}")
                for p in procs:
                    p.expect("started")
                if plan == "park":
                    parked = "SELECT count(*) FROM flow_flows WHERE state = 'PARKED'"
                    _until(conn, parked, (), FLOWS)
                    for i, p in enumerate(procs):  # each wakes flows another engine started
                        lo, hi = share[(i + 1) % engines]
                        p.send(f"wake {lo} {hi}")
                    for p in procs:
                        p.expect("woken")
                done = "SELECT count(*) FROM flow_flows WHERE state = 'COMPLETED'"
                _until(conn, done, (), base + FLOWS)
                best = min(best, (time.perf_counter() - t0) / FLOWS)
            used = meter.stop()
    finally:
        for p in procs:
            p.quit()
    return Throughput(best, used)


def recovery(server: pg.PgServer, lease: float) -> list[float]:
    """Seconds from a SIGKILL to every orphaned flow running again, one per round."""
    times = []
    for _ in range(ROUNDS):
        dsn = server.fresh_schema_dsn("fleetkill")
        _prepare(dsn)
        a = Engine(dsn, "a", "hang", lease=lease, solo=False)
        b = Engine(dsn, "b", "hang", lease=lease, solo=False)
        try:
            a.expect("ready")
            b.expect("ready")
            with psycopg.connect(dsn, autocommit=True) as conn:
                a.send(f"start 0 {HANGING}")
                a.expect("started")
                mine = "SELECT count(*) FROM flow_flows WHERE owner = %s AND state = 'RUNNING'"
                _until(conn, mine, ("a",), HANGING)
                time.sleep(lease / 2)  # somewhere in the middle of a's renewals
                a.kill()
                t0 = time.perf_counter()
                again = mine + " AND attempt >= 2"
                _until(conn, again, ("b",), HANGING)
                times.append(time.perf_counter() - t0)
        finally:
            a.quit()
            b.quit()
    return times


DURABLE = ("fsync=on", "synchronous_commit=on", "full_page_writes=on")


def benchmarks() -> Iterator[Row]:
    bindir = pg.find_binaries()
    if bindir is None:
        print(f"skipped: {pg.SKIP_REASON}")
        return
    # Commits as durable as SQLite's synchronous=FULL; the WAL fsyncs timed for the notes.
    server = pg.start(bindir, DURABLE + _usage.TIMING)
    try:
        for plan, label in (("three", "3-step"), ("park", "park+wake")):
            runs = {k: throughput(server, plan, k, solo=False) for k in (1, 2, 3)}
            grouped = {k: run.per_flow for k, run in runs.items()}
            solo = {k: throughput(server, plan, k, solo=True).per_flow for k in (1, 2, 3)}
            for k in (1, 2, 3):
                yield Row(
                    f"fleet {label} flows, {k} engine{'s' if k > 1 else ''}: group commit"
                    " vs a transaction per write",
                    grouped[k],
                    solo[k],
                    target=1.0,
                    unit="us/flow",
                    note=f"{1 / grouped[k]:.0f} vs {1 / solo[k]:.0f} flows/s",
                )
            for k in (2, 3):
                yield Row(
                    f"fleet {label} flows: {k} engines vs 1 (scaling)",
                    grouped[k],
                    grouped[1],
                    target=1.5,
                    unit="us/flow",
                    note=f"{1 / grouped[k]:.0f} vs {1 / grouped[1]:.0f} flows/s;"
                    f" {k} engines' {runs[k].used.note(ROUNDS * FLOWS)};"
                    f" 1 engine's {runs[1].used.note(ROUNDS * FLOWS)}",
                )
        for lease in (1.0, 2.0, 4.0):
            times = recovery(server, lease)
            yield Row(
                f"fleet: SIGKILL to {HANGING} orphans running again, lease {lease:g} s",
                statistics.median(times),
                lease,
                target=1.5,
                unit="s",
                note="rounds " + ", ".join(f"{t:.2f}" for t in times) + " s",
            )
    finally:
        server.stop()
