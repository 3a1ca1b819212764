"""The flow store's contract: one suite, run against SQLite and PostgreSQL (`make_store`)."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import pytest
import trio

from ferry.flow._model import _holders
from ferry.flow._model import _machine as m
from ferry.flow._model._checks import park
from ferry.flow._model._types import CONTINUE, Delivery, State
from ferry.flow._model._values import (
    EMPTY_MAILBOX,
    Flow,
    Mailbox,
    Message,
    Shape,
    Taken,
    Transition,
)
from ferry.flow._store import _batch, _op, _schema, _sql
from ferry.flow._store import _store as s
from ferry.projected import PostgresStore, Store, Tx
from tests import pg, switches
from tests.stores.conftest import StoreFactory

SHAPE = Shape("order", 1, ("reserve", "charge", "ship"), (True, True, False), (3, 3, 3))
T0 = 1_700_000_000.0


async def setup(store: Store) -> None:
    await store.transact(_schema.create_schema)


async def write(store: Store, *ops: _op.Op) -> list[_op.Result]:
    return await store.transact(partial(_batch.write_batch, ops=ops))


async def load(store: Store, flow_id: str) -> Flow | None:
    return await store.transact(partial(s.load, flow_id=flow_id))


async def history_kinds(store: Store, flow_id: str) -> list[tuple[int, str]]:
    events = await store.transact(partial(s.load_history, flow_id=flow_id))
    assert events is not None
    return [(e.revision, e.kind) for e in events]


async def started(store: Store, flow_id: str = "f1", data: str = '{"a":1}') -> Flow:
    (r,) = await write(store, _op.Create(m.start(SHAPE, flow_id, data, T0)))
    assert isinstance(r, _op.Created)
    return r.transition.flow


def step(flow: Flow, outcome: Any = CONTINUE, data: str | None = None) -> _op.Change:
    """A runner's write: the transition computed from its copy, compare-and-set on it."""

    def apply(f: Flow, box: Mailbox) -> Transition:
        return m.step_done(f, box, SHAPE, outcome, f.data if data is None else data, T0 + 1)

    head = isinstance(outcome, type(park()))
    return _op.Change(flow.flow_id, apply, flow=flow, first_queued=head)


def wake(flow_id: str, message_id: str, payload: str = "1") -> _op.Change:
    def apply(f: Flow, box: Mailbox) -> Transition:
        return m.wake(f, box, Message(message_id, payload), SHAPE, T0 + 2)

    return _op.Change(flow_id, apply, message_id=message_id)


def changed(r: _op.Result) -> Transition:
    assert isinstance(r, _op.Changed), r
    return r.transition


@pytest.fixture
async def store(make_store: StoreFactory) -> Store:
    st = make_store()
    await setup(st)
    return st


async def test_schema_is_idempotent(store: Store) -> None:
    await setup(store)
    await setup(store)
    assert await load(store, "nope") is None


async def test_every_field_round_trips(store: Store) -> None:
    f = await started(store)
    assert await load(store, "f1") == f
    full = attrs.evolve(
        f,
        state=State.BLOCKED,
        step_index=2,
        step="ship",
        attempt=7,
        data='{"k":["é",1.5,null,true]}',
        revision=2,
        updated_at=T0 + 0.125,
        error="why it compensates",
        park_deadline=T0 + 3600.5,
        on_timeout="continue",
        wake='{"payment":"ok"}',
        timed_out=True,
        stack=(0, 1),
        blocked="why it is blocked",
        blocked_from=State.PARKED,
        owner="engine-7",
        released_at=T0 + 30.25,
    )
    t = Transition(full, EMPTY_MAILBOX, 1)
    changed((await write(store, _op.Change("f1", lambda _f, _b: t, flow=f)))[0])
    assert await load(store, "f1") == full


async def test_history_round_trips(store: Store) -> None:
    f = await started(store)
    p = changed((await write(store, step(f, park(60))))[0]).flow
    events = await store.transact(partial(s.load_history, flow_id="f1"))
    assert events is not None
    assert [(e.revision, e.kind, e.step, e.attempt) for e in events] == [
        (1, "started", None, None),
        (2, "step", "reserve", 1),
        (2, "parked", "reserve", 1),
    ]
    assert events[0].detail == {"plan": "order", "version": 1} and events[0].at == T0
    assert events[2].detail == {"deadline": T0 + 61, "on_timeout": "compensate"}
    assert p.park_deadline == T0 + 61
    assert await store.transact(partial(s.load_history, flow_id="nope")) is None


async def test_a_stale_revision_is_refused_and_writes_nothing(store: Store) -> None:
    f = await started(store)
    f2 = changed((await write(store, step(f)))[0]).flow
    (r,) = await write(store, step(f, data='{"stale":1}'))
    assert r == _op.Conflict("f1", 1, 2, None)
    assert await load(store, "f1") == f2
    assert await history_kinds(store, "f1") == [(1, "started"), (2, "step")]


async def test_a_loaded_change_checks_expected(store: Store) -> None:
    f = await started(store)

    def cancel(flow: Flow, _box: Mailbox) -> Transition:
        return m.cancel(flow, SHAPE, "x", T0)

    (r,) = await write(store, _op.Change("f1", cancel, expected=5))
    assert r == _op.Conflict("f1", 5, 1, None)
    assert await load(store, "f1") == f
    (r,) = await write(store, _op.Change("nope", cancel))
    assert r == _op.Missing("nope")


async def test_start_is_idempotent_and_a_reused_id_is_reported(store: Store) -> None:
    f = await started(store, data='{"a":1}')
    (same,) = await write(store, _op.Create(m.start(SHAPE, "f1", '{"a":1}', T0 + 9)))
    assert same == _op.Existing(f, same=True)
    (other,) = await write(store, _op.Create(m.start(SHAPE, "f1", '{"a":2}', T0)))
    assert isinstance(other, _op.Existing) and not other.same
    other_plan = attrs.evolve(SHAPE, name="refund")
    (plan,) = await write(store, _op.Create(m.start(other_plan, "f1", '{"a":1}', T0)))
    assert isinstance(plan, _op.Existing) and not plan.same
    # the start data is what is compared, not the data the flow has now
    changed((await write(store, step(f, data='{"a":99}')))[0])
    (again,) = await write(store, _op.Create(m.start(SHAPE, "f1", '{"a":1}', T0)))
    assert isinstance(again, _op.Existing) and again.same
    assert await history_kinds(store, "f1") == [(1, "started"), (2, "step")]


async def test_update_race_between_two_writers(make_store: StoreFactory) -> None:
    a, b = make_store(), make_store()
    await setup(a)
    for round_ in range(5):
        f = await started(a, f"race-{round_}")
        results: dict[str, _op.Result] = {}

        async def go(name: str, st: Store, data: str, f: Flow = f, results: Any = results) -> None:
            (results[name],) = await write(st, step(f, data=data))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(go, "a", a, '{"by":"a"}')
            nursery.start_soon(go, "b", b, '{"by":"b"}')
        wins = [n for n, r in results.items() if isinstance(r, _op.Changed)]
        losses = [r for r in results.values() if isinstance(r, _op.Conflict)]
        assert len(wins) == 1 and len(losses) == 1, results
        assert losses[0].revision == 2
        stored = await load(a, f.flow_id)
        assert stored is not None and stored.data == f'{{"by":"{wins[0]}"}}'
        assert await history_kinds(a, f.flow_id) == [(1, "started"), (2, "step")]


async def test_insert_race_between_two_writers(make_store: StoreFactory) -> None:
    a, b = make_store(), make_store()
    await setup(a)
    for round_ in range(5):
        fid = f"ins-{round_}"
        results: dict[str, _op.Result] = {}

        async def go(name: str, st: Store, fid: str = fid, results: Any = results) -> None:
            t = m.start(SHAPE, fid, f'{{"by":"{name}"}}', T0)
            (results[name],) = await write(st, _op.Create(t))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(go, "a", a)
            nursery.start_soon(go, "b", b)
        created = [n for n, r in results.items() if isinstance(r, _op.Created)]
        existing = [r for r in results.values() if isinstance(r, _op.Existing)]
        assert len(created) == 1 and len(existing) == 1, results
        assert not existing[0].same and existing[0].flow.data == f'{{"by":"{created[0]}"}}'
        assert await history_kinds(a, fid) == [(1, "started")]


async def test_mailbox_deduplicates_and_keeps_a_wake_that_comes_before_the_park(
    store: Store,
) -> None:
    f = await started(store)
    q = changed((await write(store, wake("f1", "evt-1", '"early"')))[0])
    assert q.delivery is Delivery.QUEUED and not q.written
    (dup,) = await write(store, wake("f1", "evt-1", '"again"'))
    assert changed(dup).delivery is Delivery.DUPLICATE
    assert await load(store, "f1") == f  # a queued wake leaves the row alone
    box = await store.transact(partial(s.load_mailbox, flow_id="f1"))
    assert box == Mailbox((Message("evt-1", '"early"'),), frozenset({"evt-1"}))
    # the park takes it in the same transaction: the flow runs on at once
    t = changed((await write(store, step(f, park(60))))[0])
    assert t.flow.state is State.RUNNING and t.flow.step == "charge" and t.flow.wake == '"early"'
    box = await store.transact(partial(s.load_mailbox, flow_id="f1"))
    assert box == Mailbox((), frozenset({"evt-1"}))
    assert await history_kinds(store, "f1") == [
        (1, "started"),
        (2, "step"),
        (2, "parked"),
        (2, "woken"),
    ]
    # now parked for real; a wake resumes it; the same id again is a duplicate
    p = changed((await write(store, step(t.flow, park(None))))[0]).flow
    assert p.state is State.PARKED
    r = changed((await write(store, wake("f1", "evt-2")))[0])
    assert r.delivery is Delivery.RESUMED and r.flow.step == "ship"
    assert changed((await write(store, wake("f1", "evt-2")))[0]).delivery is Delivery.DUPLICATE
    done = changed((await write(store, step(r.flow)))[0]).flow
    assert done.state is State.COMPLETED
    assert changed((await write(store, wake("f1", "evt-1")))[0]).delivery is Delivery.DUPLICATE
    assert changed((await write(store, wake("f1", "evt-3")))[0]).delivery is Delivery.STALE
    (unknown,) = await write(store, wake("nope", "evt-1"))
    assert unknown == _op.Missing("nope")


async def test_a_batch_with_one_conflicting_flow_commits_the_others(store: Store) -> None:
    flows = [await started(store, f"b{i}") for i in range(3)]
    stale = flows[1]
    changed((await write(store, step(stale)))[0])
    results = await write(store, step(flows[0]), step(stale), step(flows[2]), wake("b0", "m"))
    assert isinstance(results[0], _op.Changed) and isinstance(results[2], _op.Changed)
    assert results[1] == _op.Conflict("b1", 1, 2, None)
    assert changed(results[3]).delivery is Delivery.QUEUED
    for fid in ("b0", "b2"):
        stored = await load(store, fid)
        assert stored is not None and stored.revision == 2 and stored.step == "charge"
        assert await history_kinds(store, fid) == [(1, "started"), (2, "step")]
    box = await store.transact(partial(s.load_mailbox, flow_id="b0"))
    assert box.seen == {"m"}


async def test_ops_on_one_flow_in_one_batch_apply_in_order(store: Store) -> None:
    f = await started(store)
    t1 = m.step_done(f, EMPTY_MAILBOX, SHAPE, CONTINUE, f.data, T0)
    second = step(t1.flow)
    results = await write(store, _op.Change("f1", lambda _f, _b: t1, flow=f), second, step(f))
    assert [type(r) for r in results] == [_op.Changed, _op.Changed, _op.Conflict]
    stored = await load(store, "f1")
    assert stored is not None and stored.revision == 3 and stored.step == "ship"


async def test_recovery_reads(store: Store) -> None:
    running = await started(store, "run")
    p1 = changed((await write(store, step(await started(store, "p1"), park(100))))[0]).flow
    p0 = changed((await write(store, step(await started(store, "p0"), park(5))))[0]).flow
    changed((await write(store, step(await started(store, "pn"), park(None))))[0])
    c = await started(store, "comp")
    c = changed((await write(store, step(c)))[0]).flow
    c = changed(
        (await write(store, _op.Change("comp", lambda f, _b: m.cancel(f, SHAPE, "x", T0))))[0]
    ).flow
    assert c.state is State.COMPENSATING
    active = await store.transact(s.load_active)
    assert {f.flow_id for f in active} == {"run", "comp"}
    assert next(f for f in active if f.flow_id == "run") == running
    deadlines = await store.transact(s.load_deadlines)
    assert deadlines == [(T0 + 6, "p0", p0.revision), (T0 + 101, "p1", p1.revision)]
    counts = await store.transact(s.count_states)
    assert counts == {State.RUNNING: 1, State.PARKED: 3, State.COMPENSATING: 1}


async def test_timeout_fires_only_at_the_armed_revision(store: Store) -> None:
    f = await started(store)
    p = changed((await write(store, step(f, park(10))))[0]).flow

    def fire(flow: Flow, _box: Mailbox) -> Transition:
        return m.timeout(flow, SHAPE, T0 + 100, expected=p.revision)

    r = changed((await write(store, wake("f1", "m1"), _op.Change("f1", fire)))[1])
    assert not r.done and not r.written  # the wake came first: the timer is stale
    stored = await load(store, "f1")
    assert stored is not None and stored.state is State.RUNNING


async def test_wake_and_park_race_never_loses_the_wake(make_store: StoreFactory) -> None:
    a, b = make_store(), make_store()
    await setup(a)
    for round_ in range(6):
        f = await started(a, f"wp-{round_}")
        out: dict[str, _op.Result] = {}

        async def do_park(f: Flow = f, out: Any = out) -> None:
            (out["park"],) = await write(a, step(f, park(None)))

        async def do_wake(f: Flow = f, out: Any = out) -> None:
            (out["wake"],) = await write(b, wake(f.flow_id, "w"))

        async with trio.open_nursery() as nursery:
            if round_ % 2:
                nursery.start_soon(do_park)
                nursery.start_soon(do_wake)
            else:
                nursery.start_soon(do_wake)
                nursery.start_soon(do_park)
        stored = await load(a, f.flow_id)
        assert stored is not None
        # whichever came first, the wake was not lost: the flow went on to its next step
        assert stored.state is State.RUNNING and stored.step == "charge" and stored.wake == "1"
        assert changed(out["wake"]).delivery in (Delivery.QUEUED, Delivery.RESUMED)
        box = await a.transact(partial(s.load_mailbox, flow_id=f.flow_id))
        assert box.queued == ()


async def test_a_transition_that_raises_is_refused_alone(store: Store) -> None:
    flows = [await started(store, f"r{i}") for i in range(3)]

    def broken(_f: Flow, _b: Mailbox) -> Transition:
        raise RuntimeError("a bug")

    ops = [
        step(flows[2]),
        _op.Change("r1", broken),
        step(flows[0]),
        _op.Change("r1", broken, flow=flows[1]),
    ]
    results = await write(store, *ops)
    assert isinstance(results[0], _op.Changed) and isinstance(results[2], _op.Changed)
    assert isinstance(results[1], _op.Refused) and isinstance(results[3], _op.Refused)
    assert str(results[1].error) == "a bug"
    assert changed(results[0]).flow.flow_id == "r2"  # results come back in the order of the ops
    stored = await load(store, "r1")
    assert stored == flows[1]


# ---------------------------------------------------------------------------------- the fleet


def owned_start(flow_id: str, owner: str | None) -> _op.Create:
    return _op.Create(m.start(SHAPE, flow_id, "{}", T0, owner=owner))


async def heartbeat(store: Store, owner: str, until: float) -> None:
    await store.transact(partial(s.heartbeat, owner=owner, until=until, now=T0))


async def test_orphans_are_the_active_flows_that_no_live_engine_holds(store: Store) -> None:
    await heartbeat(store, "alive", T0 + 10)
    await heartbeat(store, "dead", T0 - 1)
    await write(
        store,
        owned_start("held", "alive"),
        owned_start("let-go", "alive"),
        owned_start("dead's", "dead"),
        owned_start("unknown's", "never-heard-of"),
        owned_start("nobody's", None),
    )
    assert not await store.transact(  # let go at another revision: written since
        partial(s.release, owner="alive", flows=[("let-go", 2)], at=T0)
    )
    assert await store.transact(partial(s.release, owner="alive", flows=[("let-go", 1)], at=T0))
    assert not await store.transact(partial(s.release, owner="x", flows=[("held", 1)], at=T0))
    other = m.start(attrs.evolve(SHAPE, version=2), "v2", "{}", T0, owner="dead")
    await write(store, _op.Create(other))
    p = await load(store, "held")
    assert p is not None
    changed((await write(store, step(p, park(60))))[0])  # parked: not active
    orphans = await store.transact(partial(s.load_orphans, now=T0 + 1))
    assert sorted(f.flow_id for f in orphans) == [
        "dead's",
        "let-go",
        "nobody's",
        "unknown's",
        "v2",
    ]
    mine = await store.transact(partial(s.load_orphans, now=T0 + 1, plans=[("order", 1)]))
    assert "v2" not in {f.flow_id for f in mine} and len(mine) == 4
    assert await store.transact(partial(s.load_orphans, now=T0 + 1, plans=[])) == []
    assert len(await store.transact(partial(s.load_orphans, now=T0 + 1, limit=1))) == 1
    later = await store.transact(partial(s.load_orphans, now=T0 + 11))  # "alive" lapsed too
    assert len(later) == 5
    owned = await store.transact(partial(s.load_active, owner="dead"))
    assert sorted(f.flow_id for f in owned) == ["dead's", "v2"]
    engines = await store.transact(s.load_engines)
    assert engines == [("alive", T0 + 10, T0, 1), ("dead", T0 - 1, T0, 2)]
    assert await store.transact(partial(s.prune_engines, before=T0)) == 0  # dead holds flows
    await heartbeat(store, "gone", T0 - 5)
    assert await store.transact(partial(s.prune_engines, before=T0)) == 1
    ids = [f"x{i}" for i in range(1200)]  # more than one statement's worth
    await write(store, *(owned_start(fid, "alive") for fid in ids))
    flows = [(fid, 1) for fid in ids]
    released = await store.transact(partial(s.release, owner="alive", flows=flows, at=T0))
    assert released == 1200
    rows = await store.transact(partial(s.load_many, flow_ids=[*ids[:3], "nope"]))
    assert sorted((f.flow_id, f.released_at) for f in rows) == [(i, T0) for i in ids[:3]]


async def test_a_takeover_loses_to_a_renewal_and_to_a_write(store: Store) -> None:
    await heartbeat(store, "a", T0 - 1)
    await write(store, owned_start("f", "a"))
    seen = await load(store, "f")
    assert seen is not None

    def take(by: str) -> _op.Change:
        def apply(f: Flow, _b: Mailbox) -> Transition:
            return _holders.take_over(f, by, T0)

        return _op.Change("f", apply, flow=seen, lapsed_at=T0)

    await heartbeat(store, "a", T0 + 30)  # a renewed its lease meanwhile
    (r,) = await write(store, take("b"))  # the revision is the same, the flow is not an orphan
    assert r == _op.Conflict("f", 1, 1, "a")
    await heartbeat(store, "a", T0 - 1)
    (won,) = await write(store, take("b"))
    f = changed(won).flow
    assert (f.owner, f.released_at, f.attempt, f.revision) == ("b", None, 2, 2)
    (lost,) = await write(store, take("c"))  # the same read, now stale
    assert isinstance(lost, _op.Conflict) and lost.owner == "b"


def takeover(seen: Flow, by: str, now: float = T0) -> _op.Change:
    """`by`'s takeover of the flow its scan read as `seen` (compare-and-set, orphan check)."""

    def apply(f: Flow, _b: Mailbox) -> Transition:
        return _holders.take_over(f, by, now)

    return _op.Change(seen.flow_id, apply, flow=seen, lapsed_at=now)


async def test_a_takeover_waits_for_a_renewal_in_flight_and_loses_to_it(
    pg_server: pg.PgServer,
) -> None:
    """PostgreSQL, where transactions overlap: engine a renews its lapsed lease and re-reads
    its flow in one transaction, still open (ADR 0047). Engine b's takeover of that flow must
    wait for the renewal (it locks a's lease row) and then lose to it. Without the lock, the
    takeover's statement reads a's lease in a snapshot taken before the renewal commits, finds
    it lapsed and takes the flow a has just read as its own: both would run it (ADR 0048)."""
    dsn = pg_server.fresh_schema_dsn()
    async with PostgresStore(dsn, connections=1) as a, PostgresStore(dsn, connections=1) as b:
        await setup(a)
        await heartbeat(a, "a", T0 - 1)  # a's lease lapsed (a was frozen, say)
        await write(a, owned_start("f", "a"))
        seen = await load(b, "f")  # b's scan read f: nobody's
        assert seen is not None
        read, commit = threading.Event(), threading.Event()

        def renewal(tx: Tx) -> list[Flow]:
            rows = s.renew(tx, "a", T0 + 30, T0, reread=["f"])
            read.set()
            commit.wait(30)  # the renewal stays open until b's takeover has tried
            return rows

        def impatient_takeover(tx: Tx) -> list[_op.Result]:
            tx.execute("SET LOCAL lock_timeout = 200")  # ms: fail rather than wait
            return _batch.write_batch(tx, [takeover(seen, "b")])

        renewed: list[list[Flow]] = []

        async def renew() -> None:
            renewed.append(await a.transact(renewal))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(renew)
            assert await trio.to_thread.run_sync(read.wait, 30)
            try:
                with pytest.raises(Exception) as waited:  # its SQLSTATE is checked below
                    await b.transact(impatient_takeover)
            finally:
                commit.set()
        assert getattr(waited.value, "sqlstate", None) == "55P03"  # lock_not_available
        assert [(f.owner, f.revision) for f in renewed[0]] == [("a", 1)]
        (lost,) = await write(b, takeover(seen, "b"))  # after the renewal committed
        assert lost == _op.Conflict("f", 1, 1, "a")


async def test_an_unfenced_write_overwrites_whatever_the_revision(store: Store) -> None:
    """The tests' switch with fencing off: a stale copy's write goes through (and would undo
    the newer state) and takes the next revision."""
    f = await started(store)
    changed((await write(store, step(f)))[0])
    stale = _op.Change("f1", step(f, data='{"stale":1}').apply, flow=f)
    unfenced = switches.unfenced(_batch.write_batch)
    t = changed((await store.transact(partial(unfenced, ops=[stale])))[0])
    assert t.flow.revision == 3 and t.events[0].revision == 3
    now = await load(store, "f1")
    assert now is not None and now.data == '{"stale":1}' and now.revision == 3
    assert await history_kinds(store, "f1") == [(1, "started"), (2, "step"), (3, "step")]


async def test_plan_shapes_round_trip_and_the_last_registration_wins(store: Store) -> None:
    other = Shape("refund", 3, ("a",), (False,), (1,))
    await store.transact(partial(s.register_plans, shapes=[SHAPE, other], now=T0))
    await store.transact(partial(s.register_plans, shapes=[SHAPE], now=T0 + 5))
    assert await store.transact(s.load_plans) == [(SHAPE, T0 + 5), (other, T0)]
    renamed = attrs.evolve(SHAPE, steps=("reserve", "pay", "ship"))
    await store.transact(partial(s.register_plans, shapes=[renamed], now=T0 + 6))
    assert (await store.transact(s.load_plans))[0] == (renamed, T0 + 6)


async def test_deadlines_up_to_a_horizon(store: Store) -> None:
    for i, timeout in enumerate((10, 20, 30)):
        f = await started(store, f"p{i}")
        changed((await write(store, step(f, park(timeout))))[0])
    due = await store.transact(partial(s.load_deadlines, before=T0 + 21))
    assert [(d - T0, fid) for d, fid, _r in due] == [(11, "p0"), (21, "p1")]


# --------------------------------------------------------------------- the batch's shape


class CountingTx:
    """A transaction that counts the statements sent through it."""

    def __init__(self, tx: Tx) -> None:
        self.tx = tx
        self.statements: list[str] = []

    @property
    def dialect(self) -> str:
        return self.tx.dialect

    @property
    def connection(self) -> Any:
        return self.tx.connection

    def execute(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        self.statements.append(sql)
        return self.tx.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> None:
        self.statements.append(sql)
        self.tx.executemany(sql, rows)


async def start_many(store: Store, n: int, prefix: str = "n") -> list[Flow]:
    ops = [_op.Create(m.start(SHAPE, f"{prefix}{i:04d}", "{}", T0)) for i in range(n)]
    return [changed_or_created(r) for r in await write(store, *ops)]


def changed_or_created(r: _op.Result) -> Flow:
    assert isinstance(r, _op.Created | _op.Changed), r
    return r.transition.flow


async def test_one_stale_flow_in_a_batch_of_1000_is_refused_alone(store: Store) -> None:
    flows = await start_many(store, 1000)
    stale = flows[437]
    changed((await write(store, step(stale)))[0])  # another writer moved it on
    results = await write(store, *(step(f) for f in reversed(flows)))
    refused = [(i, r) for i, r in enumerate(reversed(results)) if not isinstance(r, _op.Changed)]
    assert refused == [(437, _op.Conflict(stale.flow_id, 1, 2, None))]
    stored = await store.transact(partial(s.load_many, flow_ids=[f.flow_id for f in flows]))
    assert sorted(f.revision for f in stored) == [2] * 1000
    assert all(f.step == "charge" for f in stored)
    again = await store.transact(partial(s.load_history, flow_id=stale.flow_id))
    assert again is not None and [e.kind for e in again] == ["started", "step"]


async def test_a_batch_of_compare_and_sets_is_a_few_statements_on_postgres(
    make_store: StoreFactory,
) -> None:
    """On PostgreSQL a batch costs a fixed number of round trips whatever its size: a batch of
    1,000 runner writes is the rows' lock, one update and one history insert."""
    store = make_store()
    await setup(store)
    if store.dialect != "postgres":
        pytest.skip("SQLite writes a batch a row at a time (in process)")
    flows = await start_many(store, 1000)
    counted: list[CountingTx] = []

    def counting(tx: Tx) -> list[_op.Result]:
        counted.append(CountingTx(tx))
        return _batch.write_batch(counted[-1], [step(f) for f in flows])

    results = await store.transact(counting)
    assert all(isinstance(r, _op.Changed) for r in results)
    kinds = [sql.split()[0] for sql in counted[0].statements]
    assert kinds == ["SELECT", "UPDATE", "INSERT"], counted[0].statements


async def test_racing_batches_over_the_same_rows_never_deadlock(
    make_store: StoreFactory,
) -> None:
    """Two writers (two stores, like two engines) write batches over the same rows, one in
    the opposite order of the other, at the same time, several rounds: every batch commits
    (PostgreSQL would end one of a deadlocked pair with an error), and every write counts."""
    a, b = make_store(), make_store()
    await setup(a)
    flows = await start_many(a, 300, "d")
    ids = [f.flow_id for f in flows]

    def bump(f: Flow, _box: Mailbox) -> Transition:
        return Transition(attrs.evolve(f, revision=f.revision + 1), EMPTY_MAILBOX, f.revision)

    async def go(st: Store, order: list[str]) -> None:
        results = await write(st, *(_op.Change(fid, bump) for fid in order))
        assert all(isinstance(r, _op.Changed) for r in results), results

    rounds = 4
    for _ in range(rounds):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(go, a, ids)
            nursery.start_soon(go, b, ids[::-1])
    stored = await a.transact(partial(s.load_many, flow_ids=ids))
    assert sorted(f.revision for f in stored) == [1 + 2 * rounds] * len(ids)


async def test_a_start_a_wake_and_a_park_of_one_flow_in_one_batch_apply_in_order(
    store: Store,
) -> None:
    """Each op of a flow sees what the ops of that flow before it in the batch wrote: a wake
    queued by the first is seen (a duplicate) by the second and taken by the park after."""
    t = m.start(SHAPE, "w1", "{}", T0)
    first = changed_or_created((await write(store, _op.Create(t)))[0])
    results = await write(
        store,
        _op.Create(m.start(SHAPE, "w2", "{}", T0)),
        wake("w1", "evt"),
        wake("w1", "evt", '"again"'),
        step(first, park(60)),
        wake("w2", "evt"),
    )
    assert isinstance(results[0], _op.Created)
    assert changed(results[1]).delivery is Delivery.QUEUED
    assert changed(results[2]).delivery is Delivery.DUPLICATE
    parked = changed(results[3]).flow
    assert parked.state is State.RUNNING and parked.wake == "1"  # took the queued wake
    assert changed(results[4]).delivery is Delivery.QUEUED
    box = await store.transact(partial(s.load_mailbox, flow_id="w1"))
    assert box == Mailbox((), frozenset({"evt"}))


async def test_a_change_of_some_columns_writes_those_and_keeps_the_rest(store: Store) -> None:
    """A compare-and-set writes the columns its transition changed: each change of one column
    at a time, from a row with every column set, reads back as written, and the rest as they
    were."""
    f = await started(store)
    full = attrs.evolve(
        f,
        state=State.BLOCKED,
        step_index=2,
        step="ship",
        attempt=7,
        error="why",
        park_deadline=T0 + 9.5,
        on_timeout="continue",
        wake='"w"',
        timed_out=True,
        stack=(0, 1),
        blocked="held",
        blocked_from=State.PARKED,
        owner="e1",
        revision=2,
    )
    row = changed(
        (
            await write(
                store, _op.Change("f1", lambda _f, _b: Transition(full, EMPTY_MAILBOX, 1), flow=f)
            )
        )[0]
    ).flow
    changes: list[dict[str, Any]] = [
        {"state": State.RUNNING},
        {"step_index": 0, "step": "reserve"},
        {"attempt": 1},
        {"data": '{"b":2}'},
        {"updated_at": T0 + 3.25},
        {"error": None},
        {"park_deadline": None, "on_timeout": None},
        {"wake": None, "timed_out": False},
        {"stack": ()},
        {"blocked": None, "blocked_from": None},
        {"owner": "e2"},
        {"released_at": T0 + 4.0},
        {"released_at": None},
    ]
    for change in changes:
        new = attrs.evolve(row, revision=row.revision + 1, **change)

        def apply(_f: Flow, _b: Mailbox, new: Flow = new, at: int = row.revision) -> Transition:
            return Transition(new, EMPTY_MAILBOX, at)

        row = changed((await write(store, _op.Change("f1", apply, flow=row)))[0]).flow
        assert await load(store, "f1") == new, change


async def test_sqlite_sets_only_the_changed_columns(make_store: StoreFactory) -> None:
    """On SQLite a runner's compare-and-set is an UPDATE of the columns its transition
    changed (and ``lease_until``, see the next test), in a multi-row statement that returns the
    ids of the rows it wrote."""
    store = make_store()
    await setup(store)
    if store.dialect != "sqlite":
        pytest.skip("PostgreSQL writes a batch's rows whole, in one statement")
    f = await started(store)
    seen: list[str] = []

    def traced(tx: Tx) -> list[_op.Result]:
        tx.connection.set_trace_callback(seen.append)
        try:
            return _batch.write_batch(tx, [step(f)])
        finally:
            tx.connection.set_trace_callback(None)

    (r,) = await store.transact(traced)
    t = changed(r)
    assert await load(store, "f1") == t.flow
    (update,) = [q for q in seen if q.startswith("UPDATE")]
    sets = update.split(" SET ")[1].split(" FROM ")[0]
    written = {c.split(" = ")[0] for c in sets.split(", ")}
    assert written == {"step_index", "step", "stack", "revision", "updated_at", "lease_until"}, (
        update
    )


async def test_a_write_after_a_release_holds_the_flow_again(store: Store) -> None:
    """A release sets ``lease_until`` (`Flow.released_at`) without a new revision, so the
    engine's copy is still current: its next write (which holds the flow, ``released_at`` None
    in its copy and in its
    transition) must write that column even though its transition did not change it."""
    f = await started(store)

    def own(flow: Flow, box: Mailbox) -> Transition:
        t = m.step_done(flow, box, SHAPE, CONTINUE, flow.data, T0 + 1)
        return _holders.assign_holder(t, flow, "e1", keep_runner=False)

    held = changed((await write(store, _op.Change("f1", own, flow=f)))[0]).flow
    assert held.owner == "e1" and held.released_at is None
    let_go = partial(s.release, owner="e1", flows=[("f1", held.revision)], at=T0 + 5)
    assert await store.transact(let_go) == 1
    assert await load(store, "f1") == attrs.evolve(held, released_at=T0 + 5)
    again = changed((await write(store, _op.Change("f1", own, flow=held)))[0]).flow
    assert again.released_at is None
    assert await load(store, "f1") == again


async def test_sqlite_writes_a_batch_of_starts_and_steps_in_a_few_statements(
    make_store: StoreFactory,
) -> None:
    """On SQLite the starts and plain compare-and-sets of a batch go in multi-row statements
    (chunks of at most 512 rows), each op still answered alone: an id that exists is
    `Existing`, a stale revision is `Conflict`, the rest are written."""
    store = make_store()
    await setup(store)
    if store.dialect != "sqlite":
        pytest.skip("PostgreSQL writes a batch with arrays")
    old = await start_many(store, 3, prefix="x")
    seen: list[str] = []

    def traced(ops: Sequence[_op.Op], tx: Tx) -> list[_op.Result]:
        tx.connection.set_trace_callback(seen.append)
        try:
            return _batch.write_batch(tx, ops)
        finally:
            tx.connection.set_trace_callback(None)

    creates = [_op.Create(m.start(SHAPE, f"n{i:04d}", "{}", T0)) for i in range(1000)]
    creates[10] = _op.Create(m.start(SHAPE, "x0001", '{"other":1}', T0))
    results = await store.transact(partial(traced, creates))
    assert results[10] == _op.Existing(old[1], same=False)
    flows = [changed_or_created(r) for i, r in enumerate(results) if i != 10]
    inserts = [q for q in seen if q.startswith("INSERT INTO flow_flows")]
    assert len(inserts) == 6, [q[:60] for q in inserts]  # 1,000 = 512 + 256 + 128 + 64 + 32 + 8
    seen.clear()
    changed((await write(store, step(flows[700])))[0])  # another writer moved it on
    results = await store.transact(partial(traced, [step(f) for f in flows]))
    assert [(i, r) for i, r in enumerate(results) if not isinstance(r, _op.Changed)] == [
        (700, _op.Conflict(flows[700].flow_id, 1, 2, None))
    ]
    assert len([q for q in seen if q.startswith("UPDATE")]) == 8  # 999 = 512 + 256 + ... + 2 + 1
    stored = await store.transact(partial(s.load_many, flow_ids=[f.flow_id for f in flows]))
    assert sorted(f.revision for f in stored) == [2] * 999
    assert await history_kinds(store, flows[3].flow_id) == [(1, "started"), (2, "step")]


async def test_a_batch_of_parks_and_wakes_answers_each_op_alone(store: Store) -> None:
    """Parks (which read the first queued message) and wakes (which read the row and the ids
    seen), each its flow's only op in one batch: each is answered as it would be alone."""
    f = [await started(store, f"p{i}") for i in range(7)]
    for message_id in ("e1", "e2"):  # two wakes queued before p0 parks: it takes the first
        assert changed((await write(store, wake("p0", message_id)))[0]).delivery is Delivery.QUEUED
    parked = changed((await write(store, step(f[2], park(None))))[0]).flow
    changed((await write(store, wake("p3", "dup")))[0])
    changed((await write(store, step(f[4])))[0])  # another writer moved p4 on

    def broken(_f: Flow, _b: Mailbox) -> Transition:
        raise RuntimeError("a bug")

    ops = [
        step(f[0], park(60)),
        step(f[1], park(60)),
        wake("p2", "go", '"on"'),
        wake("p3", "dup"),
        step(f[4], park(60)),  # from a stale copy
        wake("nope", "x"),
        _op.Change("p5", broken),
        wake("p6", "later"),
    ]
    r = await write(store, *ops)
    took = changed(r[0])
    assert took.flow.state is State.RUNNING and took.flow.step == "charge"
    assert took.flow.wake == "1" and took.messages == (Taken(Message("e1", "1")),)
    assert changed(r[1]).flow.state is State.PARKED
    assert changed(r[2]).delivery is Delivery.RESUMED and changed(r[2]).flow.wake == '"on"'
    assert changed(r[3]).delivery is Delivery.DUPLICATE
    assert r[4] == _op.Conflict("p4", 1, 2, None)
    assert r[5] == _op.Missing("nope")
    assert isinstance(r[6], _op.Refused) and str(r[6].error) == "a bug"
    assert changed(r[7]).delivery is Delivery.QUEUED and not changed(r[7]).written
    for i in (0, 1, 2):
        assert await load(store, f"p{i}") == changed(r[i]).flow
    assert (await load(store, "p2")) == attrs.evolve(
        changed(r[2]).flow, revision=parked.revision + 1
    )
    assert await load(store, "p5") == f[5]
    boxes = {
        fid: await store.transact(partial(s.load_mailbox, flow_id=fid))
        for fid in ("p0", "p2", "p6")
    }
    assert boxes["p0"] == Mailbox((Message("e2", "1"),), frozenset({"e1", "e2"}))
    assert boxes["p2"] == Mailbox((), frozenset({"go"}))
    assert boxes["p6"] == Mailbox((Message("later", "1"),), frozenset({"later"}))
    assert await history_kinds(store, "p0") == [
        (1, "started"),
        (2, "step"),
        (2, "parked"),
        (2, "woken"),
    ]
    assert await history_kinds(store, "p2") == [
        (1, "started"),
        (2, "step"),
        (2, "parked"),
        (3, "woken"),
    ]


async def test_sqlite_writes_a_batch_of_wakes_in_a_few_statements(
    make_store: StoreFactory,
) -> None:
    """On SQLite the ops that read a flow's row or mailbox (a wake, a park), one per flow, read
    and write in multi-row statements too: a batch of 1,000 wakes is a few dozen statements,
    not a few per wake."""
    store = make_store()
    await setup(store)
    if store.dialect != "sqlite":
        pytest.skip("PostgreSQL writes a batch with arrays")
    flows = await start_many(store, 1000)
    parks = await write(store, *(step(f, park(None)) for f in flows))
    assert all(changed(r).flow.state is State.PARKED for r in parks)
    seen: list[str] = []

    def traced(ops: Sequence[_op.Op], tx: Tx) -> list[_op.Result]:
        tx.connection.set_trace_callback(seen.append)
        try:
            return _batch.write_batch(tx, ops)
        finally:
            tx.connection.set_trace_callback(None)

    ops = [wake(f.flow_id, f"m{i}") for i, f in enumerate(flows)]
    results = await store.transact(partial(traced, ops))
    assert all(changed(r).delivery is Delivery.RESUMED for r in results)
    assert len(seen) <= 30, [q[:60] for q in seen]  # 6 chunks each: rows, seen, UPDATE, mailbox
    stored = await store.transact(partial(s.load_many, flow_ids=[f.flow_id for f in flows]))
    assert sorted((f.revision, f.step) for f in stored) == [(3, "charge")] * 1000
    box = await store.transact(partial(s.load_mailbox, flow_id=flows[999].flow_id))
    assert box == Mailbox((), frozenset({"m999"}))


@pytest.mark.parametrize("n", [1, 2, 512])
def test_sqlite_batch_reads_search_by_index(n: int) -> None:
    """The multi-row reads of a SQLite batch look each flow up in an index: none scans the
    flows or the mailbox (a batch would then cost as much as the tables are large)."""
    conn = sqlite3.connect(":memory:")
    for statement in _schema.ddl("sqlite"):
        conn.execute(statement)
    for sql in (_sql.select_rows(n), _sql.seen_rows(n), _sql.first_queued_rows(n)):
        plan = [r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, ["x"] * sql.count("?"))]
        assert not [p for p in plan if p.startswith("SCAN flow_")], (sql[:60], plan)
        assert [p for p in plan if p.startswith("SEARCH")], (sql[:60], plan)
