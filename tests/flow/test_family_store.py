"""The store half of child flows (`_store._family`), against SQLite and PostgreSQL: a spawn's
rows written all or nothing, a child's end recorded in O(1) statements as the pure model says,
the reads the runtime makes (``ctx.children``, what to cancel, what to compensate), and the
spawn rows held in one order on PostgreSQL.

Each test fails without the piece it names: written before `_store/_family.py` existed, they
failed on its import; with ``FOR UPDATE`` left out of `lock_spawns`, the lock test fails; with
`record_end` reading the spawn's children, the statement count grows with the spawn.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import pytest
import trio

from ferry.flow._model import _family as fam
from ferry.flow._model import _family_spawn as spawn
from ferry.flow._model import _machine as m
from ferry.flow._model._children import OnFailure, parent_of
from ferry.flow._model._types import CONTINUE
from ferry.flow._model._values import COMPLETED, FAILED, PARKED, Flow, Mailbox, Shape, Transition
from ferry.flow._store import _batch, _kin, _op, _schema
from ferry.flow._store import _family as fs
from ferry.flow._store import _store as s
from ferry.projected import Store, Tx
from tests.stores.conftest import StoreFactory

PARENT = Shape("parent", 1, ("fan", "after"), (False, False), (1, 1))
CHILD = Shape("child", 1, ("work",), (True,), (1,))
T0 = 1_700_000_000.0


def shape_of(name: str, version: int) -> Shape:
    return {("parent", 1): PARENT, ("child", 1): CHILD}[(name, version)]


@pytest.fixture(autouse=True)
def _by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests drive the family's store functions by hand, one at a time, as the batch's
    own pass (`_kin.after`: a written end recorded for its parent, docs/adr/0148) calls them;
    that pass is off here, so that each function is seen on its own."""
    monkeypatch.setattr(_kin, "after", lambda *_args: None)


@pytest.fixture
async def store(make_store: StoreFactory) -> Store:
    st = make_store()
    await st.transact(_schema.create_schema)
    await st.transact(fs.create_tables)
    return st


async def load(store: Store, flow_id: str) -> Flow | None:
    return await store.transact(partial(s.load, flow_id=flow_id))


async def start_parent(store: Store, flow_id: str = "p") -> Flow:
    (r,) = await store.transact(
        partial(_batch.write_batch, ops=[_op.Create(m.start(PARENT, flow_id, "{}", T0))])
    )
    assert isinstance(r, _op.Created)
    return r.transition.flow


def spawn_move(
    parent: Flow,
    keys: Sequence[str],
    max_running: int | None = None,
    on_failure: OnFailure = "compensate",
) -> fam.Move:
    return fam.spawned(
        parent,
        PARENT,
        [(k, CHILD, f'{{"k":"{k}"}}') for k in keys],
        max_running=max_running,
        timeout=None,
        on_failure=on_failure,
        data=parent.data,
        now=T0 + 1,
    )


async def spawned(
    store: Store,
    keys: Sequence[str],
    max_running: int | None = None,
    on_failure: OnFailure = "compensate",
    parent_id: str = "p",
) -> fam.Move:
    parent = await start_parent(store, parent_id)
    move = spawn_move(parent, keys, max_running, on_failure)
    await store.transact(partial(fs.write_spawn, before=parent, move=move))
    return move


def ended(child: Flow, fail: bool) -> Transition:
    if fail:
        return m.step_failed(child, CHILD, "boom", T0 + 2)
    return m.step_done(child, Mailbox((), frozenset()), CHILD, CONTINUE, child.data, T0 + 2)


def end_child(tx: Tx, child: Flow, fail: bool = False) -> fs.End:
    """A child's last write: its spawn row held first, its own compare-and-set, its end."""
    t = ended(child, fail)
    parent, step_index, _key = parent_of(child.flow_id) or ("", 0, "")
    fs.lock_spawns(tx, [(parent, step_index)])

    def apply(_f: Flow, _b: Mailbox) -> Transition:
        return t

    _batch.write_all(tx, [_op.Change(child.flow_id, apply, flow=child)])
    return fs.record_end(tx, t.flow, fam.child_stack(child, t.flow, CHILD))


async def family(store: Store, parent_id: str = "p") -> tuple[fam.Brood, list[fam.Kid]]:
    brood = await store.transact(partial(fs.load_brood, parent=parent_id, step_index=0))
    assert brood is not None
    kids = await store.transact(partial(fs.children, parent=parent_id, step_index=0))
    return brood, kids


# --------------------------------------------------------------------------------- the spawn


async def test_a_spawn_writes_its_row_every_childs_row_and_the_children_it_may_start(
    store: Store,
) -> None:
    move = await spawned(store, ["b", "a", "c", "e", "d"], max_running=2)
    brood, kids = await family(store)
    assert brood == move.brood
    assert brood.active == 2 and brood.next_kept == 2 and brood.phase == fam.WAITING
    assert kids == list(move.kids)  # in spawn order, kept ones too
    assert [k.status for k in kids] == [fam.ACTIVE] * 2 + [fam.KEPT] * 3
    for k in kids:
        row = await load(store, k.flow_id)
        assert (row is not None) == (k.status == fam.ACTIVE)
    parent = await load(store, "p")
    assert parent is not None and parent.state is PARKED and parent.step_index == 0
    assert await store.transact(partial(fs.latest_brood, parent="p")) == brood
    assert await store.transact(partial(fs.latest_brood, parent="q")) is None


async def test_a_spawn_rolled_back_leaves_nothing_written(store: Store) -> None:
    parent = await start_parent(store)
    move = spawn_move(parent, ["a", "b", "c"], max_running=2)

    def crashed(tx: Tx) -> None:
        fs.write_spawn(tx, parent, move)
        raise RuntimeError("the process died before the commit")

    with pytest.raises(RuntimeError):
        await store.transact(crashed)
    assert await store.transact(partial(fs.load_brood, parent="p", step_index=0)) is None
    assert await store.transact(partial(fs.children, parent="p", step_index=0)) == []
    assert await load(store, move.kids[0].flow_id) is None
    assert await load(store, "p") == parent


async def test_a_second_spawn_of_the_step_or_a_stale_parent_writes_nothing(store: Store) -> None:
    parent = await start_parent(store)
    move = spawn_move(parent, ["a", "b"])
    await store.transact(partial(fs.write_spawn, before=parent, move=move))
    with pytest.raises(fs.NotSpawned, match="written already"):
        await store.transact(partial(fs.write_spawn, before=parent, move=move))
    # A parent that moved on since its copy (a takeover ran the step): the spawn row written
    # first is rolled back with the refused compare-and-set.
    other = await start_parent(store, "q")
    moved = m.cancel(other, PARENT, "by an operator", T0 + 1)

    def apply(_f: Flow, _b: Mailbox) -> Transition:
        return moved

    await store.transact(partial(_batch.write_batch, ops=[_op.Change("q", apply, flow=other)]))
    with pytest.raises(fs.NotSpawned, match="is not at revision"):
        await store.transact(partial(fs.write_spawn, before=other, move=spawn_move(other, ["a"])))
    assert await store.transact(partial(fs.load_brood, parent="q", step_index=0)) is None
    assert await load(store, "q/0/a") is None


# ------------------------------------------------------------------------------ a child's end


async def test_each_end_writes_what_the_pure_model_says(store: Store) -> None:
    """Three children, one at a time, "continue": the store's rows after each end are the
    model's (`_family.child_ended`), the next kept child starts, the last end is the last."""
    await spawned(store, ["a", "b", "c"], max_running=1, on_failure="continue")
    parent = await load(store, "p")
    assert parent is not None
    for i, fail in enumerate([False, True, False]):
        brood, kids = await family(store)
        rows = [await load(store, k.flow_id) for k in kids]
        child = rows[i]
        assert child is not None
        model = fam.child_ended(
            brood, kids, rows, parent, PARENT, i, child, ended(child, fail), shape_of, T0 + 2
        )
        end = await store.transact(partial(end_child, child=child, fail=fail))
        after, kids_after = await family(store)
        assert end.brood == after
        assert after == model.brood or model.parent is not None  # the last: `go_on` moves on
        assert end.kid == kids_after[i] == model.kids[0]
        assert end.kid.status == ("failed" if fail else "completed") and end.kid.ended == i + 1
        assert not end.stopped
        started = [t.flow.flow_id for t in model.children]
        assert ([] if end.start is None else [end.start.flow_id]) == started
        assert end.last == (model.parent is not None) == (i == 2)
        if end.start is not None:  # the runtime's start of the next kept child, same write
            t = m.start(CHILD, end.start.flow_id, end.start.data, T0 + 2)
            await store.transact(partial(_batch.write_all, ops=[_op.Create(t)]))
    assert (await family(store))[0].ended == 3


async def test_a_failure_with_compensate_stops_the_spawn_and_names_the_children_to_cancel(
    store: Store,
) -> None:
    await spawned(store, ["c", "a", "b", "d"], max_running=3)
    kid_b = await load(store, "p/0/b")
    assert kid_b is not None
    end = await store.transact(partial(end_child, child=kid_b, fail=True))
    assert end.stopped and end.start is None and not end.last
    assert end.brood.phase == fam.STOPPING and end.brood.then == "compensate"
    assert end.brood.reason == "child 'b' failed: boom"
    cancel = await store.transact(partial(fs.to_cancel, parent="p", step_index=0))
    assert [k.flow_id for k in cancel] == ["p/0/a", "p/0/c"]  # flow id order: the lock order
    for fid in ("p/0/a", "p/0/c"):
        row = await load(store, fid)
        assert row is not None
        end = await store.transact(partial(end_child, child=row, fail=True))
    assert end.last and end.brood.active == 0 and end.brood.next_kept == 3


async def test_an_end_rolled_back_leaves_the_counters_and_rows_as_they_were(store: Store) -> None:
    await spawned(store, ["a", "b"], max_running=1)
    before = await family(store)
    child = await load(store, "p/0/a")
    assert child is not None

    def crashed(tx: Tx) -> None:
        end_child(tx, child)
        raise RuntimeError("the process died before the commit")

    with pytest.raises(RuntimeError):
        await store.transact(crashed)
    assert await family(store) == before
    assert await load(store, "p/0/a") == child


async def test_an_end_that_is_no_active_childs_is_refused(store: Store) -> None:
    await spawned(store, ["a"])
    child = await load(store, "p/0/a")
    assert child is not None
    with pytest.raises(ValueError, match="must have ended"):
        await store.transact(partial(fs.record_end, child=child, stack=()))
    await store.transact(partial(end_child, child=child))
    done = await load(store, "p/0/a")
    assert done is not None and done.state is COMPLETED
    with pytest.raises(ValueError, match="'p/0/a' is not an active child"):
        await store.transact(partial(fs.record_end, child=done, stack=()))


def write_flows(tx: Tx, move: fam.Move, before: dict[str, Flow]) -> None:
    """A family write's flow rows (`Move.parent`, `Move.children`), each a compare-and-set on
    the row `before` it, and its family rows (`write_rows`), the spawn row held first."""
    fs.lock_spawns(tx, [(move.brood.parent, move.brood.step_index)])
    ops: list[_op.Op] = []
    for t in [*([] if move.parent is None else [move.parent]), *move.children]:

        def apply(_f: Flow, _b: Mailbox, t: Transition = t) -> Transition:
            return t

        ops.append(_op.Change(t.flow.flow_id, apply, flow=before[t.flow.flow_id]))
    _batch.write_all(tx, ops)
    fs.write_rows(tx, move)


async def stored(store: Store) -> tuple[Flow, fam.Brood, list[fam.Kid], list[Flow | None]]:
    parent = await load(store, "p")
    assert parent is not None
    brood, kids = await family(store)
    return parent, brood, kids, [await load(store, k.flow_id) for k in kids]


async def test_a_stop_after_an_end_is_the_pure_models_on_the_stored_rows(store: Store) -> None:
    """The runtime's recipe for the rare ends (ADR 0145): `record_end`, then the rest of
    `_family.child_ended` on the rows read back (`stop`, then `maybe_on`): the same writes as
    the model's, and the stored family keeps `check_family`'s rules."""
    await spawned(store, ["c", "a", "b", "d"], max_running=3)
    parent, brood, kids, rows = await stored(store)
    child = rows[2]
    assert child is not None
    model = fam.child_ended(
        brood, kids, rows, parent, PARENT, 2, child, ended(child, True), shape_of, T0 + 2
    )
    end = await store.transact(partial(end_child, child=child, fail=True))
    assert end.stopped and end.brood.reason is not None
    parent, _b, kids, rows = await stored(store)
    b, changed, cancels = spawn.stop(
        end.brood, kids, rows, "compensate", end.brood.reason, shape_of, T0 + 2
    )
    move = spawn.maybe_on(b, kids, rows, parent, PARENT, shape_of, T0 + 2, changed, cancels)
    assert move.parent == model.parent and move.brood == model.brood
    assert move.kids == tuple(k for k in model.kids if k.index != 2)
    assert move.children == model.children and len(move.children) == 2  # "c" and "a" cancelled
    before = {r.flow_id: r for r in [parent, *rows] if r is not None}
    await store.transact(partial(write_flows, move=move, before=before))
    parent, brood, kids, rows = await stored(store)
    fam.check_family(parent, brood, kids, rows)
    assert brood.phase == fam.UNDONE and parent.state is FAILED


async def test_the_last_end_then_go_on_is_the_pure_models_on_the_stored_rows(
    store: Store,
) -> None:
    await spawned(store, ["a", "b"])
    for i in (0, 1):
        parent, brood, kids, rows = await stored(store)
        child = rows[i]
        assert child is not None
        model = fam.child_ended(
            brood, kids, rows, parent, PARENT, i, child, ended(child, False), shape_of, T0 + 2
        )
        end = await store.transact(partial(end_child, child=child))
    assert end.last and model.parent is not None
    parent, _b, kids, rows = await stored(store)
    move = fam.go_on(end.brood, kids, rows, parent, PARENT, shape_of, T0 + 2)
    assert move.parent == model.parent and move.brood == model.brood
    await store.transact(partial(write_flows, move=move, before={"p": parent}))
    parent, brood, kids, rows = await stored(store)
    fam.check_family(parent, brood, kids, rows)
    assert brood.phase == fam.OVER and parent.step == "after"
    assert set(fam.results(brood, kids)) == {"a", "b"}


class Counting:
    """A `Tx` that counts the statements run through it (executemany counts once) and the
    rows they return (a read of the brothers is one statement, but not one row)."""

    def __init__(self, tx: Tx) -> None:
        self.tx = tx
        self.statements = 0
        self.rows = 0

    @property
    def dialect(self) -> str:
        return self.tx.dialect

    @property
    def connection(self) -> Any:
        return self.tx.connection

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.statements += 1
        rows = self.tx.execute(sql, params)
        self.rows += len(rows)
        return rows

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self.statements += 1
        self.tx.executemany(sql, rows)


async def cost_of_an_end(
    store: Store, n: int, max_running: int | None, pid: str
) -> tuple[int, int]:
    await spawned(store, [f"k{i}" for i in range(n)], max_running=max_running, parent_id=pid)
    child = await load(store, f"{pid}/0/k0")
    assert child is not None
    t = ended(child, fail=False)

    def counted(tx: Tx) -> tuple[int, int]:
        c = Counting(tx)
        end = fs.record_end(c, t.flow, fam.child_stack(child, t.flow, CHILD))
        assert (end.start is not None) == (max_running is not None)
        return c.statements, c.rows

    return await store.transact(counted)


async def test_a_childs_end_runs_as_many_statements_for_10_children_as_for_10000(
    store: Store,
) -> None:
    for max_running in (1, None):  # with the next kept child started, and without
        small = await cost_of_an_end(store, 10, max_running, f"small{max_running}")
        big = await cost_of_an_end(store, 10_000, max_running, f"big{max_running}")
        assert small == big
        assert small[0] <= 4 and small[1] <= 3  # statements; rows: the spawn, the two children


# -------------------------------------------------------------------------------------- reads


async def test_completed_children_are_compensated_the_last_ended_first(store: Store) -> None:
    await spawned(store, ["a", "b", "c", "d"])
    for key, fail in [("c", False), ("a", True), ("d", False), ("b", False)]:
        row = await load(store, f"p/0/{key}")
        assert row is not None
        await store.transact(partial(end_child, child=row, fail=fail))
    undo = await store.transact(partial(fs.to_compensate, parent="p", step_index=0))
    assert [k.key for k in undo] == ["b", "d", "c"]
    assert all(k.stack == (0,) for k in undo)
    first = await store.transact(partial(fs.next_to_compensate, parent="p", step_index=0))
    assert first == undo[0]
    # The parent's compensation marks "b" undone (`write_rows`): "d" is next.
    brood, _kids = await family(store)
    moved = fam.Move(None, brood, (attrs.evolve(undo[0], status="failed", undone=True),))
    await store.transact(partial(fs.write_rows, move=moved))
    nxt = await store.transact(partial(fs.next_to_compensate, parent="p", step_index=0))
    assert nxt is not None and nxt.key == "d"
    kids_now = await store.transact(partial(fs.children, parent="p", step_index=0))
    assert [k.key for k in kids_now] == ["a", "b", "c", "d"]
    results = fam.results(brood, kids_now)
    assert list(results) == ["a", "b", "c", "d"]
    assert results["a"].state is FAILED and results["c"].state is COMPLETED


# -------------------------------------------------------------------------------------- locks


class Recording(Counting):
    def __init__(self, tx: Tx) -> None:
        super().__init__(tx)
        self.params: list[Sequence[Any]] = []

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.params.append(params)
        return super().execute(sql, params)


async def test_spawn_rows_are_locked_in_parent_then_step_order(store: Store) -> None:
    for pid in ("p", "p/0/a", "q"):
        await spawned(store, ["x"], parent_id=pid)

    def locked(tx: Tx) -> list[Sequence[Any]]:
        rec = Recording(tx)
        got = fs.lock_spawns(rec, [("q", 0), ("p/0/a", 0), ("p", 0), ("q", 0), ("none", 1)])
        assert sorted(got) == [("p", 0), ("p/0/a", 0), ("q", 0)]
        return rec.params

    order = await store.transact(locked)
    assert [tuple(p) for p in order] == [("none", 1), ("p", 0), ("p/0/a", 0), ("q", 0)]


async def test_a_held_spawn_row_makes_another_writer_wait(make_store: StoreFactory) -> None:
    a, b = make_store(), make_store()
    if a.dialect != "postgres":
        pytest.skip("SQLite has one writer: its transactions do not overlap")
    await a.transact(_schema.create_schema)
    await a.transact(fs.create_tables)
    await spawned(a, ["a"])
    held, release = threading.Event(), threading.Event()

    def hold(tx: Tx) -> None:
        fs.lock_spawns(tx, [("p", 0)])
        held.set()
        assert release.wait(30)

    def try_lock(tx: Tx) -> None:
        tx.execute("SET LOCAL lock_timeout = '200ms'")
        fs.lock_spawns(tx, [("p", 0)])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.transact, hold)
        await trio.to_thread.run_sync(held.wait)
        try:
            with pytest.raises(Exception, match="lock timeout"):
                await b.transact(try_lock)
        finally:
            release.set()
