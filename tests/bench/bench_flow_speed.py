"""`ferry.flow`'s speed against the code of a baseline commit, measured in the same run (ADR 0100).

Every figure comes from a child process (`tests/bench/_speed.py`) that runs one workload on one
engine and reports. The same script runs on today's code and on the code of commit
`_baseline.COMMIT` (main before the speed work of ADR 0096-0100), extracted with
``git archive`` and put first on ``PYTHONPATH``; rounds alternate between the two so that
both see the same machine (docs/adr/0100). Without that commit in the checkout, today's
figures are printed alone, with '-' as their target.

- **Driven by ``wait()``** (1,000 flows, all started at once, each task ``start`` then ``wait``):
  3-step flows, and flows that park then are woken (``wake`` then ``wait``), ``ROUNDS`` runs of
  each code, seconds per flow from the first start to the last completion, medians compared.
  On PostgreSQL (one engine in this process, a fleet engine as in production; ``fsync`` and
  ``synchronous_commit`` on, as bench_fleet's server) the target is today's code at least 3x
  the baseline's throughput, and today's runs within 25% of each other (slowest over fastest);
  on SQLite (WAL, ``synchronous=FULL``) at least 2x. Beside each, the engine's CPU per flow
  (the child's CPU over the timed part, every thread), medians, today over the baseline: at
  most half on SQLite (the issue's "per-flow CPU halved"), reported on PostgreSQL. It moves far
  less than flows/s when other work shares the machine.
- **Spread arrival**: 1,000 3-step flows started at a steady rate of half today's capacity (the
  3-step figure above, on the same store), each awaited: p50 and p99 of the time from ``start``
  to ``wait`` returning (target: p99 at most 3x p50) and writing transactions per flow (the
  engine's ``write_batches`` over the flows; target: fewer than 2, where a transaction per
  boundary would be 4). The baseline code runs at the same rate, for comparison (in the note).

On PostgreSQL each run has a database of its own, so the note can also give every commit per
flow counted by ``pg_stat_database`` (the reads of ``wait`` included) beside the writing ones.
Each run also prints a line of detail as it ends: its flows/s, the CPU per flow of the engine
and of the database server, how many cores the machine had busy and how much of that was other
work, transactions per flow and, on PostgreSQL, WAL fsyncs per flow and their time
(`tests/bench/_usage.py`): what limited that run. These cover the child's whole life, its
start and the engine's open included (the schema's creation is a few dozen fsyncs).
``BENCH_ROUNDS`` (default 3) runs of each; ``BENCH_SPEED_FLOWS`` (default 1000) flows per run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import psycopg

from tests import pg
from tests.bench import _baseline, _usage
from tests.bench._harness import Row
from tests.bench.bench_fleet import DURABLE

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
FLOWS = int(os.environ.get("BENCH_SPEED_FLOWS", "1000"))
SCRIPT = Path(__file__).with_name("_speed.py")
ROOT = Path(__file__).resolve().parents[2]

# The targets: today's seconds per flow over the baseline's, at most; today's runs' spread.
TARGETS = {"SQLite": 0.5, "PostgreSQL": 1 / 3}
# The engine's CPU per flow, today's over the baseline's: halved on SQLite; reported on PostgreSQL.
CPU_TARGETS = {"SQLite": 0.5, "PostgreSQL": math.inf}
RUNS_WITHIN = 1.25
P99_OVER_P50 = 3.0
WRITING_TX_PER_FLOW = 2.0
WORKLOADS = {"three": "3-step", "park": "park+wake"}


@attrs.frozen
class Run:
    """One child's report (`_speed.py`), with what the run used (`_usage.Used`: its
    `processes` are the child's CPU seconds from its start to its end) and, on PostgreSQL,
    every commit the server counted in the run's database."""

    seconds: float
    flows: int
    cpu: float  # the child's CPU seconds over the timed part
    write_batches: int
    used: _usage.Used
    commits: int | None = None
    p50: float = math.nan
    p99: float = math.nan

    @property
    def per_flow(self) -> float:
        return self.seconds / self.flows

    @property
    def flows_per_s(self) -> float:
        return self.flows / self.seconds

    @property
    def cpu_per_flow(self) -> float:
        return self.cpu / self.flows

    @property
    def writing_per_flow(self) -> float:
        return self.write_batches / self.flows

    def detail(self) -> str:
        """One line: flows/s, CPU per flow, the machine, transactions and fsyncs per flow."""
        u, n = self.used, self.flows
        text = f"{self.flows_per_s:,.0f} flows/s; CPU/flow: engine {self.cpu / n * 1000:.2f} ms"
        if self.commits is not None:
            text += f", PostgreSQL {u.server / n * 1000:.2f} ms"
        text += (
            f"; cores busy {u.machine / u.wall:.1f} ({u.others / u.wall:.1f} other work);"
            f" {self.writing_per_flow:.3f} writing tx/flow"
        )
        if self.commits is not None:
            text += f", {self.commits / n:.2f} commits/flow"
        if u.fsyncs > 0:
            each = u.fsync_seconds / u.fsyncs
            text += f"; {u.fsyncs / n:.3f} WAL fsyncs/flow of {each * 1e3:.1f} ms"
        if not math.isnan(self.p50):
            text += f"; p50 {_ms(self.p50)}, p99 {_ms(self.p99)}"
        return text


class Stores:
    """A fresh store per run: an SQLite file in `tmp`, or a database of its own on `server`."""

    def __init__(self, tmp: Path, server: pg.PgServer | None) -> None:
        self.tmp = tmp
        self.server = server
        self.count = 0

    @property
    def label(self) -> str:
        return "SQLite" if self.server is None else "PostgreSQL"

    def run(self, code: Path, workload: str, *, who: str, rate: float | None = None) -> Run:
        """One run of `workload` in a child whose ``import ferry`` is the code under `code`;
        prints its `Run.detail` line."""
        self.count += 1
        if self.server is None:
            got = self._child(code, str(self.tmp / f"speed{self.count}.db"), workload, rate)
        else:
            name = f"speed{self.count}"
            with psycopg.connect(self.server.dsn, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            dsn = f"host=127.0.0.1 port={self.server.port} user=postgres dbname={name}"
            try:
                got = self._child(code, "postgresql:" + dsn, workload, rate)
                got = attrs.evolve(got, commits=self._commits(name))
            finally:
                with psycopg.connect(self.server.dsn, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE "{name}"')
        print(f"  {self.label} {workload} {who}: {got.detail()}", flush=True)
        return got

    def _child(self, code: Path, store: str, workload: str, rate: float | None) -> Run:
        command = [sys.executable, str(SCRIPT), store, workload, str(FLOWS)]
        if rate is not None:
            command += ["--rate", f"{rate:.3f}"]
        with contextlib.ExitStack() as stack:
            conn = None
            postmaster = None
            if self.server is not None:
                conn = stack.enter_context(psycopg.connect(self.server.dsn, autocommit=True))
                postmaster = _usage.postmaster_of(_one(conn, "SELECT pg_backend_pid()"))
            meter = _usage.Meter([], postmaster, conn)
            children = _children_cpu()
            meter.start()
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                check=False,
                cwd=self.tmp,  # not the checkout: its ferry must not shadow `code`'s
                env=_baseline.child_env(code),
            )
            used = attrs.evolve(meter.stop(), processes=_children_cpu() - children)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[1:])} failed:\n{done.stderr[-3000:]}")
        report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        imported = Path(report["ferry"]).resolve()
        if not imported.is_relative_to(code.resolve()):
            raise RuntimeError(f"the child imported ferry from {imported}, not from {code}")
        return Run(
            seconds=report["seconds"],
            flows=report["flows"],
            cpu=report["cpu"],
            write_batches=report["write_batches"],
            used=used,
            p50=report.get("p50", math.nan),
            p99=report.get("p99", math.nan),
        )

    def _commits(self, name: str) -> int:
        """Every commit in database `name` (its only user was the child, now gone): once its
        connections have ended, which is when they flush their counts."""
        assert self.server is not None
        with psycopg.connect(self.server.dsn, autocommit=True) as conn:
            deadline = time.monotonic() + 30
            while _one(conn, "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", name):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the connections to {name} did not end")
                time.sleep(0.02)
            return _one(conn, "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", name)


def _children_cpu() -> float:
    """CPU seconds of this process's children that ended (and were waited for)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _one(conn: psycopg.Connection, sql: str, *params: object) -> int:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0])


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _commit_note(runs: list[Run]) -> str:
    """Commits per flow in all, and writing ones (PostgreSQL's count, the engine's)."""
    if any(r.commits is None for r in runs):
        return ""
    every = statistics.median(r.commits / r.flows for r in runs if r.commits is not None)
    writing = statistics.median(r.writing_per_flow for r in runs)
    return f"; {every:.2f} commits/flow, {writing:.3f} writing"


def ratio_row(
    name: str, target: float, today: list[Run], before: list[Run], base: _baseline.Baseline
) -> Row:
    """Today's median seconds per flow against the baseline code's; without the baseline code,
    today's figure alone, with no target ('-' in the table) and the reason in the note."""
    now = statistics.median(r.per_flow for r in today)
    if base.code is None or not before:
        return Row(
            f"{name}: today, no baseline",
            now,
            math.nan,
            math.inf,
            unit="us/flow",
            note=f"{1 / now:,.0f} flows/s; baseline missing: {base.reason}" + _commit_note(today),
        )
    then = statistics.median(r.per_flow for r in before)
    old = _commit_note(before)
    return Row(
        f"{name}: today vs {base.commit}",
        now,
        then,
        target,
        unit="us/flow",
        note=f"{1 / now:,.0f} vs {1 / then:,.0f} flows/s, medians of {len(today)}"
        + _commit_note(today)
        + (f" (vs {old[2:]})" if old else ""),
    )


def cpu_row(
    name: str, target: float, today: list[Run], before: list[Run], base: _baseline.Baseline
) -> Row:
    """The engine's CPU per flow (the child's, every thread, over the timed part), medians: a
    steadier figure than flows/s on a machine shared with other work."""
    now = statistics.median(r.cpu_per_flow for r in today)
    if base.code is None or not before:
        return Row(
            f"{name}: engine CPU/flow today, no baseline",
            now,
            math.nan,
            math.inf,
            unit="us/flow",
            note=f"baseline missing: {base.reason}",
        )
    return Row(
        f"{name}: engine CPU/flow today vs {base.commit}",
        now,
        statistics.median(r.cpu_per_flow for r in before),
        target,
        unit="us/flow",
        note="every thread of the engine's process, medians"
        + ("; reported" if math.isinf(target) else ""),
    )


def _speed_rows(stores: Stores, base: _baseline.Baseline) -> Iterator[Row]:
    """The driven-by-`wait` rows of one store, then its spread-arrival rows."""
    label, commit = stores.label, base.commit
    capacity = math.nan
    for workload, what in WORKLOADS.items():
        today: list[Run] = []
        before: list[Run] = []
        for r in range(ROUNDS):  # ABBA: neither code always runs right after the other
            if base.code is not None and r % 2 == 0:
                before.append(stores.run(base.code, workload, who=commit))
            today.append(stores.run(ROOT, workload, who="today"))
            if base.code is not None and r % 2 == 1:
                before.append(stores.run(base.code, workload, who=commit))
        if workload == "three":
            capacity = 1 / statistics.median(r.per_flow for r in today)
        name = f"flow speed {label}: {FLOWS:,} {what} flows, wait()"
        yield ratio_row(name, TARGETS[label], today, before, base)
        yield cpu_row(name, CPU_TARGETS[label], today, before, base)
        if label == "PostgreSQL":
            runs = sorted(r.flows_per_s for r in today)
            olds = sorted(r.flows_per_s for r in before)
            yield Row(
                f"{name}: today's {ROUNDS} runs, slowest vs fastest",
                max(r.per_flow for r in today),
                min(r.per_flow for r in today),
                RUNS_WITHIN,
                unit="us/flow",
                note="runs "
                + ", ".join(f"{f:,.0f}" for f in runs)
                + " flows/s"
                + ("; baseline's " + ", ".join(f"{f:,.0f}" for f in olds) if olds else ""),
            )
    yield from _spread_rows(stores, base, capacity)


def _spread_rows(stores: Stores, base: _baseline.Baseline, capacity: float) -> Iterator[Row]:
    rate = capacity / 2
    label = stores.label
    before = None
    if base.code is not None:
        before = stores.run(base.code, "spread", who=base.commit, rate=rate)
    today = stores.run(ROOT, "spread", who="today", rate=rate)
    name = f"flow speed {label}: 3-step flows arriving at {rate:,.0f}/s"
    old = (
        f"; {base.commit}: p50 {_ms(before.p50)}, p99 {_ms(before.p99)},"
        f" {before.writing_per_flow:.2f} writing tx/flow"
        if before is not None
        else f"; baseline missing: {base.reason}"
    )
    yield Row(
        f"{name} (half capacity): p99 vs p50",
        today.p99,
        today.p50,
        P99_OVER_P50,
        unit="s",
        note=f"p50 {_ms(today.p50)}, p99 {_ms(today.p99)}" + old,
    )
    yield Row(
        f"{name}: writing tx per flow (< 2)",
        today.writing_per_flow,
        WRITING_TX_PER_FLOW,
        1.0,
        unit="tx/flow",
        note="baseline column: the target; engine's write_batches / flows"
        + _commit_note([today])
        + old,
    )


def benchmarks() -> Iterator[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-speed-") as name:
        tmp = Path(name)
        (tmp / "baseline").mkdir()
        base = _baseline.extract(tmp / "baseline")
        if base.code is None:
            print(f"baseline missing ({base.reason}): today's figures only", flush=True)
        yield from _speed_rows(Stores(tmp, None), base)
        bindir = pg.find_binaries()
        if bindir is None:
            print(f"PostgreSQL rows skipped: {pg.SKIP_REASON}")
            return
        server = pg.start(bindir, DURABLE + _usage.TIMING)
        try:
            yield from _speed_rows(Stores(tmp, server), base)
        finally:
            server.stop()
