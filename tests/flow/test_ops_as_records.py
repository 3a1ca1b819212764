"""A write is a record naming its transition and its arguments, run by the store: its `repr` says
what it does, who holds the flow after it is a rule the store applies (`HolderRule`), and a plan
version the request has not seen yet is answered `Unseen` (nothing written, in a batch with
others or all or nothing), never raised inside the transaction. On SQLite and PostgreSQL.

Without the records (closures built by the engine), the `repr` named a function object, and
``Unseen`` was an exception raised by the transition on the store's thread: the store answered
the op ``Refused`` and the trio side re-raised it; the result checks here then fail."""

from __future__ import annotations

from functools import partial

import pytest

from ferry.flow._model import _machine as m
from ferry.flow._model import _ops
from ferry.flow._model._types import State, park
from ferry.flow._model._values import EMPTY_MAILBOX, Flow, Message, Shape
from ferry.flow._store import _batch, _op, _schema, _store
from ferry.projected import Store
from tests.stores.conftest import StoreFactory

SHAPE = Shape("order", 1, ("reserve", "ship"), (True, False), (3, 3))
KNOWN = _ops.Known({("order", 1): SHAPE})
T0 = 1_700_000_000.0


async def _parked(store: Store, flow_id: str) -> Flow:
    """A flow of ``order`` v1, parked at its first step, in `store`."""
    await store.transact(_schema.create_schema)
    started = m.start(SHAPE, flow_id, "{}", T0)
    parked = m.step_done(started.flow, EMPTY_MAILBOX, SHAPE, park(), "{}", T0)
    (r,) = await store.transact(partial(_batch.write_batch, ops=[_op.Create(started)]))
    assert isinstance(r, _op.Created)
    op = _op.Change(flow_id, lambda _f, _b: parked, flow=started.flow)
    (r,) = await store.transact(partial(_batch.write_batch, ops=[op]))
    assert isinstance(r, _op.Changed) and r.transition.flow.state is State.PARKED
    return r.transition.flow


def test_an_op_says_what_it_does() -> None:
    wake = _ops.Wake(Message("m-1", '{"ok":1}'), 12.5, known=KNOWN)
    op = _op.Change("o-1", wake, message_id="m-1", holder=_ops.HolderRule("e-1"))
    assert repr(op) == (
        "Change('o-1', Wake(message=Message(message_id='m-1', payload='{\"ok\":1}'), now=12.5))"
    )
    flow = m.start(SHAPE, "o-2", "{}", T0).flow
    done = _op.Change("o-2", _ops.StepDone(SHAPE, None, "{}", 13.0), flow=flow)
    assert repr(done) == "Change('o-2', StepDone(outcome=None, data='{}', now=13.0), rev=1)"
    assert _ops.Cancel("why", 1.0, known=KNOWN) == _ops.Cancel("why", 1.0, known=KNOWN)


async def test_a_version_not_seen_yet_is_an_unseen_result(make_store: StoreFactory) -> None:
    store = make_store()
    parked = await _parked(store, "p-1")
    await _parked(store, "p-2")
    unknown = _ops.Known({}, complete=False)  # a fleet engine that has not seen order v1
    ops: list[_op.Op] = [
        _op.Change("p-1", _ops.Wake(Message("m-1", "1"), T0 + 1, known=unknown), message_id="m-1"),
        _op.Change("p-2", _ops.Cancel("enough", T0 + 1, known=KNOWN)),
    ]
    unseen, cancelled = await store.transact(partial(_batch.write_batch, ops=ops))
    assert unseen == _ops.Unseen("p-1", "order", 1)
    assert isinstance(cancelled, _op.Changed) and cancelled.transition.done
    row = await store.transact(partial(_store.load, flow_id="p-1"))
    assert row == parked  # nothing written for it
    mailbox = await store.transact(partial(_store.load_mailbox, flow_id="p-1"))
    assert mailbox.queued == () and mailbox.seen == frozenset()
    # All or nothing (a publish): the batch is undone, and says why.
    ops = [_op.Change("p-1", _ops.Cancel("x", T0 + 2, known=unknown))]
    with pytest.raises(_batch.Undone) as info:
        await store.transact(partial(_batch.write_all, ops=ops))
    assert info.value.results == [_ops.Unseen("p-1", "order", 1)]
    assert await store.transact(partial(_store.load, flow_id="p-1")) == parked


async def test_the_holder_rule_is_applied_by_the_store(make_store: StoreFactory) -> None:
    store = make_store()
    await _parked(store, "h-1")
    await _parked(store, "h-2")
    here = _ops.HolderRule("e-1")
    elsewhere = _ops.HolderRule("e-1", elsewhere={("order", 1): SHAPE})
    ops: list[_op.Op] = [
        _op.Change("h-1", _ops.Wake(Message("a", "1"), T0 + 1, known=KNOWN), holder=here),
        _op.Change("h-2", _ops.Wake(Message("b", "1"), T0 + 1, known=KNOWN), holder=elsewhere),
    ]
    mine, theirs = await store.transact(partial(_batch.write_batch, ops=ops))
    assert isinstance(mine, _op.Changed) and isinstance(theirs, _op.Changed)
    assert mine.transition.flow.state is State.RUNNING
    assert mine.transition.flow.owner == "e-1"
    assert theirs.transition.flow.owner is None  # left to an engine with the version
