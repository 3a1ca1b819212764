"""The benchmarks' own fixtures still build against today's schema (a store whose columns moved
once broke `make bench` without any test noticing)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tests.bench import bench_dashboard


def test_the_dashboard_bench_builds_its_store(tmp_path: Path) -> None:
    path = str(tmp_path / "bench.db")
    bench_dashboard.build(path, 1000)
    conn = sqlite3.connect(path)
    try:
        states = dict(conn.execute("SELECT state, COUNT(*) FROM flow_flows GROUP BY state"))
    finally:
        conn.close()
    assert sum(states.values()) == 1000 and set(states) >= {"COMPLETED", "BLOCKED"}
