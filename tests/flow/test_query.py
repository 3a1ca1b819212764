"""Finding flows (`_query`): the filter's checks, the SQL on both stores, keyset pagination, and
the indexes that keep a page cheap."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import pytest

from ferry.flow._model import _machine as m
from ferry.flow._model._types import State
from ferry.flow._model._values import Flow, Shape
from ferry.flow._store import _batch, _op, _schema
from ferry.flow._store import _query as q
from ferry.projected import Store, Tx
from tests.stores.conftest import StoreFactory

ORDER = Shape("order", 1, ("reserve", "charge", "ship"), (True, True, False), (3, 3, 3))
ORDER2 = Shape("order", 2, ("reserve", "ship"), (True, False), (3, 3))
REFUND = Shape("refund", 1, ("pay",), (False,), (3,))
T0 = 1_700_000_000.0
NOW = T0 + 10_000


# ------------------------------------------------------------------------------- the filter


def test_filter_refuses_bad_values_by_name() -> None:
    with pytest.raises(TypeError, match=r"state must be a flow\.State"):
        q.FlowFilter(state="BLOCKED")
    with pytest.raises(ValueError, match="plan must not be empty"):
        q.FlowFilter(plan="")
    with pytest.raises(TypeError, match="plan must be a str"):
        q.FlowFilter(plan=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version must be >= 1"):
        q.FlowFilter(version=0)
    with pytest.raises(TypeError, match="version must be an int"):
        q.FlowFilter(version=True)
    with pytest.raises(ValueError, match="updated_after must be a finite time"):
        q.FlowFilter(updated_after=math.nan)
    with pytest.raises(TypeError, match="created_before must be seconds"):
        q.FlowFilter(created_before="yesterday")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="earlier than created_after"):
        q.FlowFilter(created_after=T0 + 1, created_before=T0)
    with pytest.raises(ValueError, match="NUL"):
        q.FlowFilter(id_prefix="a\x00")
    assert q.FlowFilter().is_empty()
    assert not q.FlowFilter(step="ship").is_empty()


def test_from_text_reads_an_operators_words() -> None:
    f = q.FlowFilter.from_text(
        now=NOW,
        state="blocked",
        plan=" order ",
        version="2",
        step="",
        updated_after="2h",
        created_before="2023-11-14T22:13:20",
        id_prefix="ord-",
    )
    assert f == q.FlowFilter(
        state=State.BLOCKED,
        plan="order",
        version=2,
        updated_after=NOW - 7200,
        created_before=T0,
        id_prefix="ord-",
    )
    assert q.FlowFilter.from_text(now=NOW, created_after="2023-11-15T00:13:20+02:00") == (
        q.FlowFilter(created_after=T0)
    )
    with pytest.raises(ValueError, match="no state 'stuck': give one of RUNNING"):
        q.FlowFilter.from_text(now=NOW, state="stuck")
    with pytest.raises(ValueError, match="version must be a whole number"):
        q.FlowFilter.from_text(now=NOW, version="v2")
    with pytest.raises(ValueError, match=r"updated_before: 'soon' is neither a time"):
        q.FlowFilter.from_text(now=NOW, updated_before="soon")


def test_the_end_of_a_prefix_range() -> None:
    assert q._after_prefix("ab") == "ac"
    assert q._after_prefix("a\U0010ffff") == "b"
    assert q._after_prefix("\U0010ffff") is None
    assert q._after_prefix("a\ud7ff") == "a\ue000"


def test_bad_cursors_and_limits_are_refused() -> None:
    f = q.FlowFilter()
    for bad in ("nonsense!", "W1td", q._cursor(_flow("x"), T0, by_id=True)):
        with pytest.raises(ValueError, match="not a cursor of this listing"):
            q.page_sql(f, "sqlite", after=bad)
    with pytest.raises(ValueError, match="limit must be between 1 and 1000"):
        q.page_sql(f, "sqlite", limit=0)
    with pytest.raises(TypeError, match="limit must be an int"):
        q.page_sql(f, "sqlite", limit=2.5)  # type: ignore[arg-type]


def _flow(fid: str) -> Flow:
    return m.start(ORDER, fid, "{}", T0).flow


# ----------------------------------------------------------------------------- on the stores


IDS = [
    "a-1",
    "a-2",
    "a%",
    "a_b",
    "ab",
    "b-1",
    "b-2",
    "<img src=x>",
    "é-1",
    "é\U0010ffff",
    "z",
    "a-3",
]


async def _fill(store: Store) -> dict[str, tuple[Shape, float, State]]:
    """One flow per id, started one second apart (two pairs at the same second), of the shapes
    in turn, in states set by SQL; what each one is."""
    await store.transact(_schema.create_schema)
    shapes = (ORDER, ORDER2, REFUND)
    states = list(State)
    made: dict[str, tuple[Shape, float, State]] = {}
    ops: list[_op.Op] = []
    for i, fid in enumerate(IDS):
        at = T0 + (i if i not in (3, 9) else i - 1)  # ties on created_at: broken by the id
        shape = shapes[i % 3]
        ops.append(_op.Create(m.start(shape, fid, "{}", at)))
        made[fid] = (shape, at, states[i % len(states)])

    def write(tx: Tx) -> None:
        _batch.write_batch(tx, ops)
        for fid, (_shape, at, state) in made.items():
            tx.execute(
                "UPDATE flow_flows SET state = ?, updated_at = ? WHERE flow_id = ?",
                (state.value, at + 100, fid),
            )

    await store.transact(write)
    return made


def _expected(made: dict[str, tuple[Shape, float, State]], keep: Any, by_id: bool) -> list[str]:
    ids = [fid for fid, v in made.items() if keep(fid, *v)]
    if by_id:
        return sorted(ids, key=lambda i: i.encode())
    return sorted(ids, key=lambda i: (made[i][1], i.encode()), reverse=True)


async def _all_pages(
    store: Store, f: q.FlowFilter, limit: int, made: dict[str, tuple[Shape, float, State]]
) -> list[str]:
    got: list[str] = []
    after = None
    for _ in range(len(IDS) + 2):
        page = await store.transact(partial(q.query_page, flt=f, limit=limit, after=after))
        assert len(page.flows) <= limit and len(page.created) == len(page.flows)
        assert list(page.created) == [made[fl.flow_id][1] for fl in page.flows]
        got += [fl.flow_id for fl in page.flows]
        after = page.next
        if after is None:
            return got
        assert len(page.flows) == limit
    raise AssertionError("pagination did not end")


CASES: list[tuple[q.FlowFilter, Any]] = [
    (q.FlowFilter(), lambda fid, sh, at, st: True),
    (q.FlowFilter(state=State.BLOCKED), lambda fid, sh, at, st: st is State.BLOCKED),
    (q.FlowFilter(plan="order"), lambda fid, sh, at, st: sh.name == "order"),
    (
        q.FlowFilter(plan="order", version=2, state=State.PARKED),
        lambda fid, sh, at, st: sh is ORDER2 and st is State.PARKED,
    ),
    (q.FlowFilter(version=1), lambda fid, sh, at, st: sh.version == 1),
    (q.FlowFilter(step="pay"), lambda fid, sh, at, st: sh is REFUND),
    (
        q.FlowFilter(created_after=T0 + 2, created_before=T0 + 8),
        lambda fid, sh, at, st: T0 + 2 <= at < T0 + 8,
    ),
    (q.FlowFilter(updated_after=T0 + 105), lambda fid, sh, at, st: at + 100 >= T0 + 105),
    (q.FlowFilter(id_prefix="a"), lambda fid, sh, at, st: fid.startswith("a")),
    (q.FlowFilter(id_prefix="a%"), lambda fid, sh, at, st: fid.startswith("a%")),
    (q.FlowFilter(id_prefix="a_"), lambda fid, sh, at, st: fid.startswith("a_")),
    (q.FlowFilter(id_prefix="é"), lambda fid, sh, at, st: fid.startswith("é")),
    (q.FlowFilter(id_prefix="<"), lambda fid, sh, at, st: fid.startswith("<")),
    (q.FlowFilter(id_prefix="nobody"), lambda fid, sh, at, st: False),
]


async def test_every_filter_pages_through_exactly_its_flows(make_store: StoreFactory) -> None:
    store = make_store()
    made = await _fill(store)
    for f, keep in CASES:
        want = _expected(made, keep, f.by_id)
        for limit in (1, 2, 5, 50):
            assert await _all_pages(store, f, limit, made) == want, (f, limit)
        assert await store.transact(partial(q.count, flt=f)) == len(want), f


async def test_a_flow_written_while_paging_keeps_its_place(make_store: StoreFactory) -> None:
    store = make_store()
    made = await _fill(store)
    first = await store.transact(partial(q.query_page, flt=q.FlowFilter(), limit=4))
    # Every flow is written again (as engines do); the next pages do not move.
    await store.transact(lambda tx: tx.execute("UPDATE flow_flows SET updated_at = ?", (NOW,)))
    rest = await _all_pages_from(store, first.next)
    assert [f.flow_id for f in first.flows] + rest == _expected(made, lambda *a: True, False)


async def _all_pages_from(store: Store, after: str | None) -> list[str]:
    got: list[str] = []
    while after is not None:
        page = await store.transact(partial(q.query_page, flt=q.FlowFilter(), limit=3, after=after))
        got += [f.flow_id for f in page.flows]
        after = page.next
    return got


async def test_pages_are_read_from_an_index_in_order(make_store: StoreFactory) -> None:
    """No sort and no scan of the table: each filter with an index is answered by a range over
    it, in the page's order (checked with the databases' own plans)."""
    store = make_store()
    await _fill(store)
    filters = [
        q.FlowFilter(),
        q.FlowFilter(state=State.BLOCKED),
        q.FlowFilter(plan="order", version=2),
        q.FlowFilter(id_prefix="a"),
        q.FlowFilter(created_after=T0),
    ]
    cursor = q._cursor(_flow("b-1"), T0 + 5, by_id=False)

    def plans(tx: Tx) -> list[str]:
        out = []
        for f in filters:
            after = q._cursor(_flow("b-1"), T0, by_id=True) if f.by_id else cursor
            sql, params = q.page_sql(f, tx.dialect, after=after)
            if tx.dialect == "postgres":
                # A tiny table is best read whole; forbid that, and sorting, to see whether
                # an index can answer in order.
                for what in ("seqscan", "bitmapscan", "sort"):
                    tx.execute(f"SET LOCAL enable_{what} = off")
                rows = tx.execute("EXPLAIN " + sql, params)
            else:
                rows = [(r[-1],) for r in tx.execute("EXPLAIN QUERY PLAN " + sql, params)]
            out.append(" | ".join(str(r[0]) for r in rows))
        return out

    for f, plan in zip(filters, await store.transact(plans), strict=True):
        assert "Index" in plan or "INDEX" in plan, (f, plan)
        assert "TEMP B-TREE" not in plan and "Sort" not in plan, (f, plan)
        assert "Seq Scan" not in plan and "SCAN flow_flows\b" not in plan, (f, plan)


async def test_an_existing_store_gains_the_indexes(make_store: StoreFactory) -> None:
    store = make_store()
    names = ("flow_flows_created", "flow_flows_state_created", "flow_flows_plan_created")

    def old_schema(tx: Tx) -> None:
        for st in _schema.ddl(tx.dialect):
            if not any(n + " " in st for n in names) and "flow_flows_id_c" not in st:
                tx.execute(st)

    def present(tx: Tx) -> list[bool]:
        if tx.dialect == "postgres":
            return [tx.execute("SELECT to_regclass(?) IS NOT NULL", (n,))[0][0] for n in names]
        sql = "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = ?"
        return [bool(tx.execute(sql, (n,))) for n in names]

    await store.transact(old_schema)
    assert await store.transact(present) == [False, False, False]
    await store.transact(_schema.create_schema)
    assert await store.transact(present) == [True, True, True]


async def test_the_overview_series_by_minute(make_store: StoreFactory) -> None:
    """The overview's chart: flows started, completed and failed in each minute of the last
    hour, on both stores (each minute a bucket of its own, the latest last)."""
    from ferry.flow._ops._dashboard._reads import page_overview

    store = make_store()
    await store.transact(_schema.create_schema)
    now = 1_800_000_030.0  # 30 s into a minute
    minute = 1_800_000_000.0
    made = {
        "a": (minute + 29.9, State.COMPLETED),  # this minute, at its latest
        "b": (minute - 0.1, State.FAILED),  # the minute before, at its latest
        "c": (minute - 59.0, State.RUNNING),  # the minute before, early
        "d": (minute - 59 * 60, State.COMPLETED),  # the first minute of the hour
        "e": (minute - 59 * 60 - 1, State.COMPLETED),  # before the hour: not shown
    }

    def fill(tx: Tx) -> None:
        _batch.write_batch(
            tx, [_op.Create(m.start(ORDER, fid, "{}", at)) for fid, (at, _) in made.items()]
        )
        for fid, (at, state) in made.items():
            tx.execute(
                "UPDATE flow_flows SET state = ?, updated_at = ? WHERE flow_id = ?",
                (state.value, at, fid),
            )

    await store.transact(fill)
    o = await store.transact(lambda tx: page_overview(tx, now=now))
    series = o.series
    assert series.start == minute - 59 * 60
    assert {i: n for i, n in enumerate(series.started) if n} == {59: 1, 58: 2, 0: 1}
    assert {i: n for i, n in enumerate(series.completed) if n} == {59: 1, 0: 1}
    assert {i: n for i, n in enumerate(series.failed) if n} == {58: 1}
