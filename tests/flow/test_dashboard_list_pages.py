"""The dashboard's flows list says how many flows match (bounded: "10,000+" past its cap, so a
count never reads a big store whole) and pages both ways: "previous" from any page reached by
"next" gives back exactly the page before, in the same order, by start time and by id.

Checked to fail before the list had a count and a previous page (no ``id="matches"``, no
``id="prev"``; a ``before`` cursor was ignored).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx
import pytest

from ferry.flow._model import _machine as m
from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader
from ferry.flow._store import _batch, _op, _query
from ferry.projected import PostgresStore
from tests import pg

from ._helpers import _InlineTx
from .test_dashboard import TOKEN, client_of, db, text_of  # noqa: F401 (db: a fixture)
from .test_inspect import ORDER, T0, populate


def ids_of(html: str) -> list[str]:
    return re.findall(r'<td class="id"><a [^>]*>([^<]*)</a>', html)


def link(html: str, element_id: str) -> str | None:
    found = re.search(rf'href="(/flows[^"]*)" id="{element_id}"', html)
    return None if found is None else found.group(1).replace("&amp;", "&")


@pytest.fixture
async def web(db: str) -> AsyncIterator[httpx.AsyncClient]:  # noqa: F811
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN, page_size=3)
    async with await client_of(dash) as client:
        yield client


async def test_the_list_counts_its_matches(web: httpx.AsyncClient) -> None:
    r = await web.get("/flows")
    assert text_of(r.text, "matches") == "9 flows match"
    r = await web.get("/flows", params={"state": "blocked"})
    assert text_of(r.text, "matches") == "2 flows match"
    r = await web.get("/flows", params={"plan": "refund"})
    assert text_of(r.text, "matches") == "1 flow matches"
    r = await web.get("/flows", params={"plan": "nothing"})
    assert text_of(r.text, "matches") == "0 flows match"


async def test_the_count_is_bounded(db: str) -> None:  # noqa: F811
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("BEGIN")
    creates = [_op.Create(m.start(ORDER, f"more-{i:05}", "{}", T0 + 7)) for i in range(2000)]
    _batch.write_batch(_InlineTx(conn), creates)
    conn.execute("COMMIT")
    conn.close()
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN, page_size=3)
    dash.count_cap = 1000
    async with await client_of(dash) as web:
        r = await web.get("/flows")
        assert text_of(r.text, "matches") == "1,000+ flows match"
        r = await web.get("/flows", params={"state": "blocked"})
        assert text_of(r.text, "matches") == "2 flows match"
    # the bounded count reads at most cap + 1 entries
    conn = sqlite3.connect(db)
    tx = _InlineTx(conn)
    assert _query.count_upto(tx, _query.FlowFilter(), 1000) == 1001
    assert _query.count_upto(tx, _query.FlowFilter(), 5000) == 2009
    conn.close()
    with pytest.raises(ValueError, match="cap must be a whole number"):
        _query.count_upto(tx, _query.FlowFilter(), -1)


@pytest.mark.parametrize(
    ("params", "size"), [({}, 2), ({}, 4), ({"id_prefix": "p"}, 1), ({"id_prefix": "b"}, 1)]
)
async def test_previous_pages_walk_back_what_next_walked(
    db: str,  # noqa: F811
    params: dict[str, str],
    size: int,
) -> None:
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN, page_size=size)
    async with await client_of(dash) as web:
        r = await web.get("/flows", params=params)
        pages = [ids_of(r.text)]
        assert link(r.text, "prev") is None and link(r.text, "first") is None
        while (nxt := link(r.text, "next")) is not None:
            r = await web.get(nxt)
            pages.append(ids_of(r.text))
        assert len(pages) >= 2 and all(pages)
        assert link(r.text, "first") is not None
        # now back, page by page, with "previous"
        back = [pages[-1]]
        while (prev := link(r.text, "prev")) is not None:
            r = await web.get(prev)
            back.append(ids_of(r.text))
            assert link(r.text, "next") is not None
        assert back[::-1] == pages
        assert link(r.text, "first") is None  # the first page again


async def test_a_previous_page_of_a_bad_cursor_is_refused(web: httpx.AsyncClient) -> None:
    r = await web.get("/flows", params={"before": "garbage"})
    assert r.status_code == 400 and "not a cursor of this listing" in r.text


async def test_on_postgres_the_count_and_the_previous_page(pg_server: pg.PgServer) -> None:
    """The same statements on PostgreSQL (a row value compared the other way, a bounded
    count in a subquery): each page back is the page that "next" gave, by time and by id."""
    async with PostgresStore(pg_server.fresh_schema_dsn(), connections=1) as store:
        await store.transact(populate)

        def walk(tx: Any, flt: _query.FlowFilter) -> tuple[list[list[str]], list[list[str]]]:
            pages: list[list[str]] = []
            page = _query.query_page(tx, flt, limit=2)
            pages.append([f.flow_id for f in page.flows])
            last = page
            while last.next is not None:
                last = _query.query_page(tx, flt, limit=2, after=last.next)
                pages.append([f.flow_id for f in last.flows])
            back = [pages[-1]]
            before: str | None = None
            if len(pages) > 1:
                before = _query.cursor_of(last.flows[0], last.created[0], flt.by_id)
            while before is not None:
                prev, before = _query.query_page_before(tx, flt, limit=2, before=before)
                back.append([f.flow_id for f in prev.flows])
            return pages, back[::-1]

        for flt, many in ((_query.FlowFilter(), 4), (_query.FlowFilter(id_prefix="p"), 1)):
            pages, back = await store.transact(partial(walk, flt=flt))
            assert pages == back and len(pages) == many
        n = await store.transact(lambda tx: _query.count_upto(tx, _query.FlowFilter(), 3))
        assert n == 4
        n = await store.transact(lambda tx: _query.count_upto(tx, _query.FlowFilter(), 100))
        assert n == 8
