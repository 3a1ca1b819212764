"""The benchmarks' own fixtures still build against today's schema and code (a store whose
columns moved, and a runner that lost a helper a bench's copy of it used, each broke
`make bench` without any test noticing)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import trio

from tests import pg
from tests.bench import bench_dashboard, bench_metrics


def test_the_dashboard_bench_builds_its_store(tmp_path: Path) -> None:
    path = str(tmp_path / "bench.db")
    bench_dashboard.build(path, 1000)
    conn = sqlite3.connect(path)
    try:
        states = dict(conn.execute("SELECT state, COUNT(*) FROM flow_flows GROUP BY state"))
    finally:
        conn.close()
    assert sum(states.values()) == 1000 and set(states) >= {"COMPLETED", "BLOCKED"}


def test_the_metrics_bench_runs_its_engine_without_the_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench_metrics' baseline is the runner's attempt with the observer hook taken out (a copy
    of `Runner._attempt`): it must still run flows to their end after the runner changes (it
    raised AttributeError on a helper the runner had lost, and `make bench` stopped there)."""
    monkeypatch.setattr(bench_metrics, "FLOWS", 20)
    with bench_metrics._without_the_hook():
        took = trio.run(bench_metrics._run, tmp_path / "m.db", False)
    assert took > 0
    assert trio.run(bench_metrics._run, tmp_path / "n.db", True) > 0


def test_the_children_bench_runs_its_rows_at_a_tiny_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench_flow_children's rows (fan-out against independent flows, fan-in of many against
    few) run end to end on SQLite at a tiny size, each figure a positive time."""
    from tests.bench import bench_flow_children as bench

    for name, value in [("ROUNDS", 1), ("FANIN_ROUNDS", 1), ("PARENTS", 3), ("CHILDREN", 4)]:
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "FAN_IN", 20)
    monkeypatch.setattr(bench, "FEW", 2)
    count = iter(range(100))
    rows = list(bench._rows("sqlite", lambda: str(tmp_path / f"r{next(count)}.db"), True))
    assert [r.target for r in rows] == [1.25, 2.0]
    assert all(r.value > 0 and r.baseline > 0 for r in rows), rows
    assert "children/s" in rows[0].note


def test_the_schedules_bench_runs_its_rows_at_a_tiny_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench_flow_schedules' SQLite rows (a burst due on one minute through the engine, the
    store's half alone, a few due among many, the idle engine's CPU) run end to end at a tiny
    size: every tick's flow runs, each figure is a time."""
    from tests.bench import bench_flow_schedules as bench

    for name, value in [("ROUNDS", 1), ("BURST", 30), ("SMALL", 5), ("QUIET", 0.02), ("D", 0.02)]:
        monkeypatch.setattr(bench, name, value)
    count = iter(range(100))
    rows = list(bench._sqlite_rows(lambda: str(tmp_path / f"r{next(count)}.db")))
    assert [r.target for r in rows] == [1.5, float("inf"), 1.5, 1.5]
    assert all(r.value > 0 and r.baseline > 0 for r in rows[:3]), rows
    assert rows[3].value >= 0 and rows[3].baseline >= 0, rows
    assert "all 30 running" in rows[0].note


def test_the_flow_control_bench_runs_its_rows_at_a_tiny_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench_flow_control's SQLite rows (an end that admits at two queue depths, limits that
    never bind, concurrency binding) run end to end at a tiny size: each figure positive, the
    binding limit's peak exactly its limit."""
    from tests.bench import bench_flow_control as bench

    for name, value in [("ROUNDS", 1), ("DEEP", 300), ("SHALLOW", 100), ("ENDS", 20)]:
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "FLOWS", 40)
    monkeypatch.setattr(bench, "BINDING", 4)
    count = iter(range(100))

    def fresh() -> str:
        return str(tmp_path / f"r{next(count)}.db")

    rows = [bench._depth_row("sqlite", fresh), *bench._engine_rows("sqlite", fresh, True)]
    assert [r.target for r in rows[:2]] == [1.5, 1.25]
    assert all(r.value > 0 and r.baseline > 0 for r in rows), rows
    assert (rows[3].value, rows[3].baseline) == (4.0, 4.0), rows[3]


def test_the_streams_bench_runs_its_rows_at_a_tiny_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_server: pg.PgServer
) -> None:
    """bench_flow_streams' rows (a stream against the same values kept in ctx.data, and
    against ctx.data replaced each step, on SQLite; many
    readers of one stream on PostgreSQL) run end to end at a tiny size: positive CPU times,
    and each value read once from the database."""
    from tests.bench import bench_flow_streams as bench

    for name, value in [("ROUNDS", 1), ("REPEAT", 1), ("VALUES", 40), ("STEPS", 4)]:
        monkeypatch.setattr(bench, name, value)
    for name, value in [("READERS", 20), ("READ_VALUES", 20), ("READ_STEPS", 4)]:
        monkeypatch.setattr(bench, name, value)
    count = iter(range(100))
    kept, replaced = bench.stream_against_data(
        str(tmp_path / f"s{next(count)}.db") for _ in range(4)
    )
    assert kept.target == 1.2 and kept.value > 0 and kept.baseline > 0, kept
    assert replaced.value > 0 and replaced.baseline > 0, replaced
    readers = bench.readers_row(pg_server.fresh_schema_dsn())
    assert readers.value == 1.0, readers
