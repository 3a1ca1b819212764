"""A flow's release time: `Flow.released_at` (when its owner let it go; None while held) is
stored in the flows table's ``lease_until`` column, which kept its name (docs/adr/0136), so a
store made before the rename opens and reads its release times, on SQLite and PostgreSQL.

Each test fails if the field and the column stop meeting: a field read from another column
(or a column renamed without an upgrade step) answers ``no such column`` on the store's
existing tables; a field not written to it reads back None.
"""

from __future__ import annotations

from functools import partial

from ferry.flow._model import _holders
from ferry.flow._model import _machine as m
from ferry.flow._model._types import CONTINUE
from ferry.flow._model._values import Flow, Mailbox, Shape, Transition
from ferry.flow._store import _batch, _op, _schema
from ferry.flow._store import _store as s
from ferry.projected import Store, Tx
from tests.stores.conftest import StoreFactory

SHAPE = Shape("order", 1, ("reserve", "charge"), (True, False), (3, 3))
T0 = 1_700_000_000.0

#: The flows table as every store made so far holds it (before the field was renamed).
_FLOWS_BEFORE = """CREATE TABLE flow_flows (
    flow_id TEXT PRIMARY KEY, plan TEXT NOT NULL, version BIGINT NOT NULL,
    state TEXT NOT NULL, step_index BIGINT NOT NULL, step TEXT, attempt BIGINT NOT NULL,
    data TEXT NOT NULL, revision BIGINT NOT NULL, updated_at DOUBLE PRECISION NOT NULL,
    error TEXT, park_deadline DOUBLE PRECISION, on_timeout TEXT, wake TEXT,
    timed_out INTEGER NOT NULL, stack TEXT NOT NULL, blocked TEXT, blocked_from TEXT,
    owner TEXT, lease_until DOUBLE PRECISION, start_data TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, trace TEXT)"""


async def _load(store: Store, flow_id: str) -> Flow | None:
    return await store.transact(partial(s.load, flow_id=flow_id))


def _column(tx: Tx, flow_id: str) -> object:
    return tx.execute("SELECT lease_until FROM flow_flows WHERE flow_id = ?", (flow_id,))[0][0]


def _held_step(flow: Flow, box: Mailbox) -> Transition:
    t = m.step_done(flow, box, SHAPE, CONTINUE, flow.data, T0 + 1)
    return _holders.assign_holder(t, flow, "e1", keep_runner=False)


async def test_a_release_time_is_written_to_and_read_from_the_lease_until_column(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    await store.transact(_schema.create_schema)
    (made,) = await store.transact(
        partial(_batch.write_batch, ops=[_op.Create(m.start(SHAPE, "f", "{}", T0))])
    )
    assert isinstance(made, _op.Created)
    (r,) = await store.transact(
        partial(_batch.write_batch, ops=[_op.Change("f", _held_step, flow=made.transition.flow)])
    )
    assert isinstance(r, _op.Changed)
    held = r.transition.flow
    assert (held.owner, held.released_at) == ("e1", None)
    assert await store.transact(partial(_column, flow_id="f")) is None
    let_go = partial(s.release, owner="e1", flows=[("f", held.revision)], at=T0 + 5)
    assert await store.transact(let_go) == 1
    assert await store.transact(partial(_column, flow_id="f")) == T0 + 5
    loaded = await _load(store, "f")
    assert loaded is not None and loaded.released_at == T0 + 5
    # a write that holds it again clears the column (the machine sets released_at None)
    (again,) = await store.transact(
        partial(_batch.write_batch, ops=[_op.Change("f", _held_step, flow=loaded)])
    )
    assert isinstance(again, _op.Changed) and again.transition.flow.released_at is None
    assert await store.transact(partial(_column, flow_id="f")) is None


async def test_a_store_made_before_the_rename_opens_and_reads_its_release_times(
    make_store: StoreFactory,
) -> None:
    store = make_store()

    def made_before(tx: Tx) -> None:
        tx.execute(_FLOWS_BEFORE)
        tx.execute(
            "INSERT INTO flow_flows (flow_id, plan, version, state, step_index, step, attempt,"
            " data, revision, updated_at, timed_out, stack, owner, lease_until, start_data,"
            " created_at) VALUES ('old', 'order', 1, 'RUNNING', 0, 'reserve', 1, '{}', 2, ?, 0,"
            " '', 'gone', ?, '{}', ?)",
            (T0, T0 + 7, T0),
        )

    await store.transact(made_before)
    await store.transact(_schema.create_schema)  # what an engine does at open
    old = await _load(store, "old")
    assert old is not None
    assert (old.owner, old.released_at, old.revision) == ("gone", T0 + 7, 2)
    # it is nobody's: an engine takes it over, and the write clears the column

    def take(flow: Flow, _box: Mailbox) -> Transition:
        return _holders.take_over(flow, "e2", T0 + 8)

    (r,) = await store.transact(
        partial(_batch.write_batch, ops=[_op.Change("old", take, flow=old)])
    )
    assert isinstance(r, _op.Changed)
    assert (r.transition.flow.owner, r.transition.flow.released_at) == ("e2", None)
    assert await store.transact(partial(_column, flow_id="old")) is None
    assert await _load(store, "old") == r.transition.flow
