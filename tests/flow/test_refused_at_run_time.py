"""A flow whose every later write the database refuses, while the engine runs it, is that flow's
own problem (docs/adr/0117): the engine keeps running every other flow (those that shared the
refused write's batch commit), the flow is left as the database keeps it, a WARNING names it
with the database's reason, a wait on it answers at once with that reason, and the engine's
block ends normally. Before, the refused write that fails the flow ended the block with
`ferry.Failed` and every other flow stopped with it."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import pytest
import trio

from ferry import Failed, flow
from ferry.flow._store import _batch, _op, _store
from ferry.projected import PostgresStore

OTHERS = [f"{c}" for c in "BCDEFGHIJKLMNOPQRSTUVWXYZ"]

# An operator's trigger: every change of flow "A" once its first step is recorded is refused.
_SQLITE_REFUSE_A = (
    "CREATE TRIGGER refuse_a BEFORE UPDATE ON flow_flows"
    " WHEN OLD.flow_id = 'A' AND OLD.step_index >= 1"
    " BEGIN SELECT RAISE(ABORT, 'flow A is frozen by the DBA'); END"
)
_PG_REFUSE_A = """
CREATE FUNCTION refuse_a() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.flow_id = 'A' AND OLD.step_index >= 1 THEN
        RAISE EXCEPTION 'flow A is frozen by the DBA' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_a BEFORE UPDATE ON flow_flows
    FOR EACH ROW EXECUTE FUNCTION refuse_a();
"""


def _plan(second: trio.Event, undone: list[str], all_in: trio.Event) -> flow.Plan:
    """Three steps; every flow's second step waits for `second` (`all_in` is set once every
    flow is in it), so that their writes share batches."""
    plan = flow.Plan("refused-while-running")
    arrived: list[str] = []

    async def undo(ctx: flow.Context) -> None:
        undone.append(ctx.flow_id)

    @plan.step(compensate=undo)
    async def reserve(ctx: flow.Context) -> None:
        ctx.data["reserved"] = True

    @plan.step
    async def charge(ctx: flow.Context) -> None:
        arrived.append(ctx.flow_id)
        if len(arrived) == 1 + len(OTHERS):
            all_in.set()
        await second.wait()
        ctx.data["charged"] = True

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        ctx.data["shipped"] = True

    return plan


def _batches(monkeypatch: pytest.MonkeyPatch, store: Any) -> list[set[str]]:
    """The flow ids of every batch of writes through `store` from now on, as they are tried."""
    batches: list[set[str]] = []
    transact = store.transact

    async def recording(fn: Any, **options: Any) -> Any:
        if getattr(fn, "func", None) is _batch.write_batch:
            batches.append({_op.op_flow_id(op) for op in fn.keywords["ops"]})
        return await transact(fn, **options)

    monkeypatch.setattr(store, "transact", recording)
    return batches


async def test_a_flow_whose_later_writes_are_refused_is_its_own_problem_and_the_rest_run(
    make_store: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="ferry.flow")
    second = trio.Event()
    undone: list[str] = []
    all_in = trio.Event()
    plan = _plan(second, undone, all_in)
    store = make_store()
    batches = _batches(monkeypatch, store)
    async with store:
        with trio.fail_after(30):
            async with flow.open_engine(store, [plan], owner="a") as engine:
                postgres = isinstance(store, PostgresStore)
                await store.transact(
                    lambda tx: tx.execute(_PG_REFUSE_A if postgres else _SQLITE_REFUSE_A)
                )
                for fid in ["A", *OTHERS]:
                    await engine.start(plan, flow_id=fid)
                await all_in.wait()
                answers: list[BaseException] = []

                async def wait_for_a() -> None:
                    with pytest.raises(Failed) as raised:
                        await engine.wait("A")
                    answers.append(raised.value)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(wait_for_a)
                    await trio.sleep(0.05)
                    second.set()  # every flow writes its second step: A's is refused
                    for fid in OTHERS:
                        snap = await engine.wait(fid)
                        assert snap.state is flow.State.COMPLETED, snap
                assert len(answers) == 1
                # A's refused write shared a batch with others' writes, which committed
                assert any("A" in b and len(b) > 1 for b in batches), batches
                message = str(answers[0])
                assert "'A'" in message and "flow A is frozen by the DBA" in message
                with pytest.raises(Failed, match="frozen by the DBA"):  # a later wait too
                    await engine.wait("A", timeout=5)
                a = await engine.get("A")
                assert a is not None and a.state is flow.State.RUNNING and a.step == "charge"
                stats = engine.statistics()
                assert stats.completed == len(OTHERS)
    assert undone == []
    left = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "left as it is" in r.getMessage()
    ]
    assert left and all(getattr(r, "flow_id", None) == "A" for r in left)
    assert "flow A is frozen by the DBA" in left[0].getMessage()


_SQLITE_REFUSE_PARKED_T = (
    "CREATE TRIGGER refuse_t BEFORE UPDATE ON flow_flows"
    " WHEN OLD.flow_id = 'T' AND OLD.state = 'PARKED'"
    " BEGIN SELECT RAISE(ABORT, 'flow T is frozen by the DBA'); END"
)
_PG_REFUSE_PARKED_T = """
CREATE FUNCTION refuse_t() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.flow_id = 'T' AND OLD.state = 'PARKED' THEN
        RAISE EXCEPTION 'flow T is frozen by the DBA' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_t BEFORE UPDATE ON flow_flows
    FOR EACH ROW EXECUTE FUNCTION refuse_t();
"""


async def test_a_parked_flow_whose_timeout_is_refused_is_its_own_problem(
    make_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The same for a park's timeout: the database refuses it and the write that blocks the
    flow instead; the flow is left parked, its wait answers, and a flow started after it runs."""
    caplog.set_level(logging.INFO, logger="ferry.flow")
    plan = flow.Plan("parks-briefly")

    @plan.step
    async def wait_briefly(ctx: flow.Context) -> flow.Outcome:
        return flow.park(timeout=0.2)

    @plan.step
    async def after(ctx: flow.Context) -> None:
        pass

    quick = flow.Plan("quick")
    quick.step(name="only")(after)
    store = make_store()
    async with store:
        with trio.fail_after(30):
            async with flow.open_engine(store, [plan, quick], owner="a") as engine:
                postgres = isinstance(store, PostgresStore)
                await store.transact(
                    lambda tx: tx.execute(
                        _PG_REFUSE_PARKED_T if postgres else _SQLITE_REFUSE_PARKED_T
                    )
                )
                await engine.start(plan, flow_id="T")
                with pytest.raises(Failed, match="flow T is frozen by the DBA"):
                    await engine.wait("T")
                await engine.start(quick, flow_id="Q")
                assert (await engine.wait("Q")).state is flow.State.COMPLETED
                t = await engine.get("T")
                assert t is not None and t.state is flow.State.PARKED
    left = [r for r in caplog.records if "left as it is" in r.getMessage()]
    assert left and getattr(left[0], "flow_id", None) == "T"


_SQLITE_REFUSE_W = (
    "CREATE TRIGGER refuse_w BEFORE UPDATE ON flow_flows WHEN OLD.flow_id = 'W'"
    " BEGIN SELECT RAISE(ABORT, 'flow W is frozen by the DBA'); END"
)
_PG_REFUSE_W = """
CREATE FUNCTION refuse_w() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.flow_id = 'W' THEN
        RAISE EXCEPTION 'flow W is frozen by the DBA' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_w BEFORE UPDATE ON flow_flows
    FOR EACH ROW EXECUTE FUNCTION refuse_w();
"""


async def test_a_flow_waiting_for_a_runner_whose_row_is_refused_at_close_is_left_as_it_is(
    make_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """At close the engine lets go of the flows whose run had not begun (one batch); a row the
    database refuses there is left as it is, with a WARNING, the others are let go, and the
    block ends normally (before, the close raised the database's error)."""
    caplog.set_level(logging.INFO, logger="ferry.flow")
    running = trio.Event()
    plan = flow.Plan("one-at-a-time")

    @plan.step
    async def hold(ctx: flow.Context) -> None:
        running.set()
        await trio.sleep_forever()

    store = make_store()
    async with store:
        with trio.fail_after(30):
            async with flow.open_engine(store, [plan], owner="a", max_running=1) as engine:
                postgres = isinstance(store, PostgresStore)
                await store.transact(
                    lambda tx: tx.execute(_PG_REFUSE_W if postgres else _SQLITE_REFUSE_W)
                )
                await engine.start(plan, flow_id="first")
                await running.wait()
                await engine.start(plan, flow_id="W")  # waits for the only runner slot
                await engine.start(plan, flow_id="X")  # and so does this one
                before = await store.transact(partial(_store.load, flow_id="X"))
            after = await store.transact(partial(_store.load, flow_id="X"))
            assert after.revision == before.revision + 1  # X was let go, W's refusal aside
            left = [r for r in caplog.records if "left as it is" in r.getMessage()]
            assert left and getattr(left[0], "flow_id", None) == "W"
            assert "flow W is frozen by the DBA" in left[0].getMessage()
