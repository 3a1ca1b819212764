"""Events and streams read by `flow.connect` from another process (SPEC 5.10, docs/adr/0177):
the service is a child process (`tests/flow/_served.py`, whose ``order`` plan emits a value and
sets ``status`` in each step); this test is the client's process, on SQLite (told by the file
changing and its ``data_version``); and on PostgreSQL (told by the notifications), with the
engine in the test's process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from ferry import flow
from ferry.projected import PostgresStore
from tests import pg

from . import _served


async def follow_an_order(client: flow.Client) -> None:
    await client.start("order", flow_id="e1")
    with trio.fail_after(30):
        assert await client.get_event("e1", "status") == "awaiting payment"
        with pytest.raises(trio.TooSlowError):
            await client.get_event("e1", "paid", timeout=0.05)
        got: list[tuple[int, Any]] = []
        async with trio.open_nursery() as nursery:

            async def follow() -> None:
                async for item in client.stream("e1"):
                    got.append(item)

            nursery.start_soon(follow)
            assert await client.wake("e1", {"paid": 30}) is flow.Delivery.RESUMED
        # the stream ended once the flow completed, with every value once
        assert got == [(1, {"step": "pay"}), (2, {"step": "ship", "paid": {"paid": 30}})]
    assert (await client.wait("e1", timeout=30)).state is flow.State.COMPLETED
    assert [v async for v in client.stream("e1", after=1)] == got[1:]
    assert await client.get_events("e1") == {"status": "shipped"}
    with pytest.raises(LookupError, match="without setting event 'never'"):
        await client.get_event("e1", "never")
    with pytest.raises(flow.UnknownFlow):
        await client.get_events("nobody")


def test_a_client_in_another_process_follows_a_flows_events_and_stream(tmp_path: Path) -> None:
    path = str(tmp_path / "app.db")

    async def make() -> None:
        async with flow.open_engine(path, plans=[_served.order, _served.stuck]):
            pass

    trio.run(make)
    child = _served.start(path, "svc")
    try:

        async def main() -> None:
            async with flow.connect(path) as client:
                await follow_an_order(client)

        trio.run(main)
    finally:
        _served.stop(child)


async def test_on_postgres_a_client_follows_a_flows_events_and_stream(
    pg_server: pg.PgServer,
) -> None:
    """The client's side is the same whoever serves the store: here an engine of this process
    (the SQLite test above has the other process), the client told by notifications only."""
    dsn = pg_server.fresh_schema_dsn()
    async with (
        PostgresStore(dsn, connections=2) as served,
        flow.open_engine(served, [_served.order], owner="svc"),
        PostgresStore(dsn, connections=1) as store,
        flow.connect(store) as client,
    ):
        await follow_an_order(client)
