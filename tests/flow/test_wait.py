"""`Engine.wait` without polling (docs/adr/0096).

What a wait costs is counted at the store: every engine here has its store's `transact` wrapped
(`reads`), which records the reads of flow rows (`_store.load`, `_store.load_many`), the only
reads a wait makes. On PostgreSQL engines form a fleet: a flow the waiting engine runs is followed
in its memory (no read); a flow another engine runs is read when that engine's batch, settling
it, notifies (one read), and at most once per lease besides. The waits that would have polled
are given time to show it (a short real sleep while the flow is held open): the assertions hold
however long that is.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import attrs
import psycopg
import pytest
import trio
import trio.testing

import stm
from ferry import Closed, flow
from ferry.flow._fleet import _listener
from ferry.flow._model import _machine as m
from ferry.flow._model._values import Flow, Mailbox, Transition
from ferry.flow._store import _batch, _notify, _op, _schema, _store
from ferry.projected import PostgresStore
from tests import pg, switches

from ._helpers import PlantedStore

_READS = (_store.load, _store.load_many)


def reads(monkeypatch: pytest.MonkeyPatch, store: Any) -> list[str]:
    """Record (by name) every read of flow rows that goes through `store` from now on."""
    calls: list[str] = []
    transact = store.transact

    async def counting(fn: Callable[[Any], Any], **options: Any) -> Any:
        func = getattr(fn, "func", fn)
        if func in _READS:
            calls.append(func.__name__)
        return await transact(fn, **options)

    monkeypatch.setattr(store, "transact", counting)
    return calls


def gated(gates: dict[str, trio.Event]) -> flow.Plan:
    """One step that waits for ``gates[flow_id]`` (made on first use), then a second one."""
    plan = flow.Plan("gated")

    @plan.step
    async def hold(ctx: flow.Context) -> None:
        await gates.setdefault(ctx.flow_id, trio.Event()).wait()

    @plan.step
    async def done(ctx: flow.Context) -> None:
        ctx.data["done"] = True

    return plan


async def listening(engine: flow.Engine, up: bool = True) -> None:
    """Until the engine's wait listener is (or is no longer) listening."""
    tvar = engine._waiters._listening
    await stm.atomically(lambda: None if tvar.get() is up else stm.retry())


async def idle(engine: flow.Engine, fid: str) -> None:
    """Until the engine listens and its wait for `fid` has begun every read it needs so far
    (its first, and the one every wait makes when the listening begins)."""
    await trio.testing.wait_all_tasks_blocked()
    waiters = engine._waiters
    watch = waiters._watches[fid]

    def ready() -> None:
        if not waiters._listening.get() or watch.flow.get() is None or watch.stale.get():
            stm.retry()

    await stm.atomically(ready)


def listener_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ferry.flow wait listener")]


@pytest.fixture
def dsn(pg_server: pg.PgServer) -> str:
    return pg_server.fresh_schema_dsn()


@asynccontextmanager
async def engines(dsn: str, plan: flow.Plan, *owners: str) -> AsyncIterator[list[flow.Engine]]:
    async with AsyncExitStack() as stack:
        opened = []
        for owner in owners:
            store = await stack.enter_async_context(PostgresStore(dsn, connections=2))
            opened.append(
                await stack.enter_async_context(flow.open_engine(store, [plan], owner=owner))
            )
        yield opened


# ---------------------------------------------------------------- the flows this engine runs


async def test_a_wait_on_flows_this_engine_runs_reads_nothing(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gates: dict[str, trio.Event] = {}
    plan = gated(gates)
    async with PostgresStore(dsn, connections=2) as store:
        calls = reads(monkeypatch, store)
        async with flow.open_engine(store, [plan], owner="a") as a:
            ids = [await a.start(plan, flow_id=f"f{i}") for i in range(20)]
            results: dict[str, flow.State] = {}

            async def waiter(fid: str) -> None:
                results[fid] = (await a.wait(fid, timeout=60)).state

            async with trio.open_nursery() as nursery:
                for fid in ids:
                    nursery.start_soon(waiter, fid)
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(0.3)  # a poll (50 ms, then doubling) would have read by now
                for fid in ids:
                    gates[fid].set()
            assert results == dict.fromkeys(ids, flow.State.COMPLETED)
            assert calls == []
            assert a._waiters.listener is None  # nothing to listen for


# ---------------------------------------------------------------- flows another engine runs


async def test_a_wait_on_another_engines_flow_is_woken_by_its_notification(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gates: dict[str, trio.Event] = {}
    plan = gated(gates)
    async with engines(dsn, plan, "a", "b") as (a, b):
        calls = reads(monkeypatch, a._store)
        await b.start(plan, flow_id="f")
        got: list[flow.Snapshot] = []
        returned = trio.Event()

        async def waiter() -> None:
            got.append(await a.wait("f"))
            returned.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await idle(a, "f")
            before = len(calls)
            assert before >= 1  # the flow, read once (and once more when the listener began)
            await trio.sleep(0.3)  # b still runs the flow: a poll would have read by now
            assert len(calls) == before
            gates["f"].set()
            with trio.fail_after(10):  # the fallback read comes only after a lease (30 s)
                await returned.wait()
        assert got[0].state is flow.State.COMPLETED
        assert calls[before:] == ["load_many"]  # one read, for the notification
        assert a._waiters.listener is not None and a._waiters.listener.connects == 1


async def test_a_wait_goes_on_when_the_listening_connection_is_killed(
    dsn: str, pg_server: pg.PgServer, caplog: pytest.LogCaptureFixture
) -> None:
    gates: dict[str, trio.Event] = {}
    plan = gated(gates)
    async with engines(dsn, plan, "a", "b") as (a, b):
        for fid in ("f", "g"):
            await b.start(plan, flow_id=fid)
        got: dict[str, flow.State] = {}

        async def waiter(fid: str) -> None:
            got[fid] = (await a.wait(fid, timeout=60)).state

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, "f")
            nursery.start_soon(waiter, "g")
            await listening(a)
            with caplog.at_level(logging.WARNING, logger="ferry.flow"):
                with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
                    (killed,) = admin.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                        " WHERE application_name = %s",
                        (_listener.APPLICATION_NAME,),
                    ).fetchone() or (0,)
                assert killed == 1
                await listening(a, up=False)
                gates["f"].set()  # settles while a does not listen: its waits read the store
                with trio.fail_after(10):
                    while "f" not in got:  # noqa: ASYNC110 (the wait under test sets it)
                        await trio.sleep(0.01)
                await listening(a)  # listening again, on a new connection
                gates["g"].set()
        assert got == {"f": flow.State.COMPLETED, "g": flow.State.COMPLETED}
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("listening for settled flows failed" in r.getMessage() for r in warned)
        assert a._waiters.listener is not None and a._waiters.listener.connects == 2


async def test_closing_an_engine_ends_its_waits_and_its_listener(dsn: str) -> None:
    gates: dict[str, trio.Event] = {}
    plan = gated(gates)
    async with PostgresStore(dsn, connections=2) as store_b:
        async with flow.open_engine(store_b, [plan], owner="b") as b:
            await b.start(plan, flow_id="f")
            raised: list[BaseException] = []

            async def waiter(a: flow.Engine) -> None:
                try:
                    await a.wait("f")
                except Closed as exc:
                    raised.append(exc)

            async with PostgresStore(dsn, connections=2) as store_a, trio.open_nursery() as n:
                async with flow.open_engine(store_a, [plan], owner="a") as a:
                    n.start_soon(waiter, a)
                    await listening(a)
                    assert len(listener_threads()) == 1
                    await trio.testing.wait_all_tasks_blocked()
            assert len(raised) == 1 and "closed" in str(raised[0])
            assert listener_threads() == []
            gates["f"].set()
            assert (await b.wait("f", timeout=10)).state is flow.State.COMPLETED
    assert [t.name for t in threading.enumerate() if t.name.startswith("ferry.flow")] == []


# ------------------------------------------------------------------ the store's notifications


async def test_a_batch_notifies_the_flows_it_settles_and_nothing_else(dsn: str) -> None:
    plan = flow.Plan("p")
    plan.step(name="s")(_noop)
    shape = plan._close()
    async with PostgresStore(dsn, connections=1) as store:
        await store.transact(_schema.create_schema)
        with psycopg.connect(dsn, autocommit=True) as ear:
            (channel,) = ear.execute(f"SELECT {_notify.CHANNEL_SQL}").fetchone() or ("",)
            ear.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))

            def heard() -> list[str]:
                return [n.payload for n in ear.notifies(timeout=0.2)]

            started = [m.start(shape, fid, "{}", 1.0) for fid in ("x", "y")]
            await store.transact(partial(_batch.write_batch, ops=[_op.Create(t) for t in started]))
            assert heard() == []  # running: nobody's wait ends

            def complete(f: Flow, box: Mailbox) -> Transition:
                return m.step_done(f, box, shape, None, "{}", 2.0)  # its one step: completed

            ops = [_op.Change(t.flow.flow_id, complete, flow=t.flow) for t in started]
            done = await store.transact(partial(_batch.write_batch, ops=ops))
            revisions = [r.transition.flow.revision for r in done]  # type: ignore[union-attr]
            assert [json.loads(p) for p in heard()] == [[["x", revisions[0]], ["y", revisions[1]]]]

            # Rolled back (a publish that also starts a flow under a taken id): nothing.
            z = m.start(shape, "z", "{}", 3.0)
            await store.transact(partial(_batch.write_batch, ops=[_op.Create(z)]))
            undone: list[_op.Op] = [
                _op.Change("z", complete, flow=z.flow),
                _op.Create(m.start(shape, "x", '{"another": "flow"}', 3.0)),
            ]
            with pytest.raises(_batch.Undone):
                await store.transact(partial(_batch.write_all, ops=undone))
            assert heard() == []
            assert (await store.transact(partial(_store.load, flow_id="z"))) == z.flow


def test_payloads_stay_under_the_limit_and_name_every_flow() -> None:
    ended = [(f"flow-{i:05d}-" + "é" * 40, i) for i in range(1000)]
    payloads = _notify.payloads(ended)
    assert len(payloads) > 1
    assert all(len(p.encode()) <= _notify.LIMIT for p in payloads)
    named = [pair for p in payloads for pair in _notify.parse(p) or []]
    assert named == ended
    huge = ("h" * 9000, 1)
    assert _notify.payloads([huge, ("a", 2)]) == ['[["a", 2]]', _notify.EVERYONE]
    assert _notify.parse(_notify.EVERYONE) is None
    assert _notify.parse("not json") is None
    assert _notify.parse('[["a", "2"]]') is None


async def _noop(ctx: flow.Context) -> None:
    pass


# ------------------------------------------------------ one engine per file; a flow let go


async def test_on_sqlite_a_wait_reads_once_and_never_polls(
    tmp_path: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: one engine writes the file (the operator's tools open an engine too, and are
    refused while this one holds it), so a parked flow, woken an hour later, costs its wait one
    read, at the start."""
    plan = flow.Plan("parks")

    @plan.step
    async def park(ctx: flow.Context) -> flow.Outcome:
        return flow.park()

    plan.step(name="after")(_noop)
    store = PlantedStore(str(tmp_path / "flows.db"))
    calls = reads(monkeypatch, store)
    async with switches.open_engine(store, [plan], fleet=False) as engine:
        await engine.start(plan, flow_id="f")
        await trio.testing.wait_all_tasks_blocked()
        assert engine.statistics().parked == 1
        async with trio.open_nursery() as nursery:
            got: list[flow.Snapshot] = []

            async def waiter() -> None:
                got.append(await engine.wait("f"))

            nursery.start_soon(waiter)
            await trio.sleep(3600)
            assert calls == ["load"]
            assert await engine.wake("f", {}) is flow.Delivery.RESUMED
        assert got[0].state is flow.State.COMPLETED
        assert calls == ["load"]


async def test_a_wait_reads_once_its_engine_lets_the_flow_go(
    tmp_path: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fleet engines on one SQLite file (no notifications there): a's wait reads nothing
    while a runs the flow; a freezes past its lease, lets the flow go, b takes it over and
    completes it, and a's wait, reading again now, returns."""
    from .test_leases import fleet_engine  # the fleet on SQLite, under the mock clock

    gates: dict[str, trio.Event] = {}
    plan = gated(gates)
    path = str(tmp_path / "fleet.db")
    store_a, store_b = PlantedStore(path), PlantedStore(path)
    calls = reads(monkeypatch, store_a)
    async with fleet_engine(store_a, plan, owner="a") as a:
        async with fleet_engine(store_b, plan, owner="b") as b:
            await a.start(plan, flow_id="f")
            got: list[flow.Snapshot] = []

            async def waiter() -> None:
                got.append(await a.wait("f", timeout=600))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.sleep(60)  # two leases: a renews, and its wait reads nothing
                assert calls == [] and a.statistics().running == 1
                store_a.gate = trio.Event()  # a freezes
                await _until(lambda: b.statistics().claimed == 1)
                gates["f"].set()
                assert (await b.wait("f", timeout=60)).state is flow.State.COMPLETED
                store_a.gate.set()  # a thaws, finds it lost the flow, and its wait reads
                store_a.gate = None
        assert got[0].state is flow.State.COMPLETED
        assert calls and set(calls) <= {"load", "load_many"}


async def _until(predicate: Callable[[], bool | Awaitable[bool]]) -> None:
    with trio.fail_after(3600):
        while not predicate():  # noqa: ASYNC110 (engines' state, under the mock clock)
            await trio.sleep(0.5)


# ------------------------------------------------------------------ the waiting rule, alone


class _Holding:
    def __init__(self, f: Flow) -> None:
        self.flow = f


def _rule(rows: dict[str, Flow], lease: float = 30.0) -> tuple[Any, list[list[str]]]:
    """A fleet engine's `Waiters` on no store: its reads come from `rows` (and are logged),
    and it listens (as far as it knows) without a listener."""
    from ferry.flow._runtime._waiters import Waiters

    log: list[list[str]] = []

    async def read(fn: Any, what: str) -> Any:
        await trio.lowlevel.checkpoint()
        ids = fn.keywords.get("flow_ids") or [fn.keywords["flow_id"]]
        log.append(list(ids))
        found = [rows[fid] for fid in ids if fid in rows]
        if "flow_ids" in fn.keywords:
            return found
        return found[0] if found else None

    waiters: Waiters[_Holding] = Waiters(  # no store: `read` answers
        shared=True, listen=None, lease=lease, closed=stm.TVar(False), read=read
    )
    waiters.listener = object()  # type: ignore[assignment]
    stm.atomically_nowait(waiters._listening.set, True)
    return waiters, log


def _row(state: flow.State, revision: int) -> Flow:
    plan = flow.Plan("p")
    plan.step(name="s")(_noop)
    f = m.start(plan._close(), "f", "{}", 1.0).flow
    return attrs.evolve(f, state=state, revision=revision)


async def test_a_settling_heard_while_the_flow_was_held_is_read_once_it_leaves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rows = {"f": _row(flow.State.COMPLETED, 5)}
    waiters, log = _rule(rows)
    waiters.held["f"] = _Holding(_row(flow.State.RUNNING, 2))
    got: list[Flow] = []

    async def waiter() -> None:
        got.append(await waiters.wait("f", None))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        waiters._heard([("f", 5)])  # another engine settled it; this one still holds it
        await trio.sleep(3600)
        assert log == [] and got == []  # held: remembered, not read
        del waiters.held["f"]  # let go, without a newer row
        await trio.testing.wait_all_tasks_blocked()
        assert log == [["f"]] and got == [rows["f"]]  # read at once, not a lease later


async def test_a_flow_elsewhere_is_read_at_most_once_per_lease_without_notifications(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rows = {"f": _row(flow.State.PARKED, 3)}
    waiters, log = _rule(rows, lease=30.0)
    got: list[Flow] = []

    async def waiter() -> None:
        got.append(await waiters.wait("f", None))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(29)
        assert log == [["f"]]  # its first read
        await trio.sleep(2)
        assert log == [["f"], ["f"]]  # a lease later: the fallback read
        rows["f"] = _row(flow.State.COMPLETED, 4)
        waiters._heard([("f", 4)])  # the notification: read at once
        await trio.testing.wait_all_tasks_blocked()
        assert log == [["f"], ["f"], ["f"]] and got == [rows["f"]]
