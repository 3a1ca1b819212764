"""The dashboard over a million flows in SQLite: server time of the flows page, measured at the
ASGI app (httpx's ASGI transport, in process: no socket, no browser).

The store is built with plain SQL in one transaction (executemany), not through an engine; the
indexes are made after the rows, by `create_schema`, as an engine opening the file would. The
flows are spread over states (1% BLOCKED) and two plans, one started every 10 ms.

Rows: the first page; a page filtered by state (BLOCKED) and by plan, version and state; the
20th page of the BLOCKED filter (keyset: as cheap as the first); an id prefix; and, reported
only, the overview (it counts every flow). Each figure is the median of `REQUESTS` requests (3
for the overview) after one warm-up, against a target of 100 ms.
"""

from __future__ import annotations

import math
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader
from ferry.flow._store import _schema, _sql
from tests.bench._harness import Row
from tests.flow._helpers import _InlineTx

FLOWS = int(os.environ.get("BENCH_DASHBOARD_FLOWS", "1000000"))
REQUESTS = 15
TARGET_MS = 100.0
T0 = 1_700_000_000.0
STATES = ["COMPLETED"] * 80 + ["FAILED"] * 8 + ["PARKED"] * 6 + ["RUNNING"] * 5 + ["BLOCKED"]


def build(path: str, n: int) -> float:
    """A store of `n` flows; seconds it took."""
    t = time.perf_counter()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("BEGIN")
    tx = _InlineTx(conn)
    tx.execute(_schema.ddl("sqlite")[0])  # the flows table; its indexes come after
    cols = ", ".join((*_sql.FIELDS, "start_data"))
    marks = ", ".join("?" * (len(_sql.FIELDS) + 1))

    def rows() -> Any:
        for i in range(n):
            state = STATES[i % len(STATES)]
            at = T0 + i * 0.01
            plan, version = ("order", 1) if i % 3 else ("refund", 2)
            done = state in ("COMPLETED", "FAILED")
            row = {
                "flow_id": f"flow-{i:08d}",
                "plan": plan,
                "version": version,
                "created_at": at,
                "state": state,
                "step_index": 0 if done else 1,
                "step": None if done else "charge",
                "attempt": 1,
                "data": '{"sku":"A1","amount":30}',
                "revision": 3,
                "updated_at": at + 5,
                "error": "declined" if state == "FAILED" else None,
                "park_deadline": at + 3600 if state == "PARKED" else None,
                "on_timeout": "compensate" if state == "PARKED" else None,
                "wake": None,
                "timed_out": 0,
                "stack": "",
                "blocked": "refund down" if state == "BLOCKED" else None,
                "blocked_from": "COMPENSATING" if state == "BLOCKED" else None,
                "fan_in": None,
                "owner": None,
                "lease_until": None,
                "trace": None,
                "parent": None,
                "deadline": None,
            }
            yield (*(row.get(f) for f in _sql.FIELDS), '{"sku":"A1","amount":30}')

    conn.executemany(f"INSERT INTO flow_flows ({cols}) VALUES ({marks})", rows())
    _schema.create_schema(tx)
    conn.execute("COMMIT")
    conn.execute("ANALYZE")
    conn.close()
    return time.perf_counter() - t


async def _measure(path: str) -> dict[str, tuple[float, int]]:
    """Median milliseconds and status of each page."""
    dash = Dashboard(reader=Reader(path=path), store=path, where="bench", token="x" * 32)
    app: Any = dash.app()
    out: dict[str, tuple[float, int]] = {}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
    ) as web:
        deep = "/flows?state=BLOCKED"
        for _ in range(19):
            r = await web.get(deep)
            if 'id="next"' not in r.text:
                break  # a small store: its last page
            nxt = r.text.split('id="next"')[0].rsplit('href="', 1)[1].split('"')[0]
            deep = nxt.replace("&amp;", "&")
        pages = {
            "first page": "/flows",
            "state=BLOCKED": "/flows?state=BLOCKED",
            "plan=order version=1 state=PARKED": "/flows?plan=order&version=1&state=PARKED",
            "20th page of state=BLOCKED": deep,
            "id prefix flow-0004": "/flows?id_prefix=flow-0004",
            "overview": "/",
        }
        for name, url in pages.items():
            times = []
            status = 0
            # the overview counts every flow: fewer requests
            for i in range((3 if name == "overview" else REQUESTS) + 1):
                t = time.perf_counter()
                r = await web.get(url)
                if i:  # the first one warms the cache
                    times.append(time.perf_counter() - t)
                status = r.status_code
            out[name] = (1000 * statistics.median(times), status)
    return out


def benchmarks() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as name:
        path = str(Path(name) / "flows.db")
        took = build(path, FLOWS)
        got = trio.run(_measure, path)
    label = f"{FLOWS:,}"
    rows = []
    for what, (ms, status) in got.items():
        report_only = what == "overview"
        rows.append(
            Row(
                f"dashboard: {what}, {label} flows (SQLite)",
                ms if status == 200 else math.nan,
                TARGET_MS,
                math.inf if report_only else 1.0,
                unit="ms",
                note=(
                    "report only, median of 3: counts every flow by state, the unfinished by plan"
                    if report_only
                    else f"median of {REQUESTS} at the ASGI app; baseline: the 100 ms aim"
                )
                + (f"; built in {took:.0f} s" if what == "first page" else ""),
            )
        )
    return rows
