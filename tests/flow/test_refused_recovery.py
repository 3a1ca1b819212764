"""A row the database refuses while an opening engine recovers its flows is that flow's own
problem (docs/adr/0104): the flow is answered as a runner answers a refused write (a step fails
and the flow compensates; a compensation fails and the flow blocks), a WARNING names it, and the
engine opens and runs every other flow."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
import trio

from ferry import Failed, flow
from ferry.projected import PostgresStore
from tests import pg

GOOD = [f"good-{i}" for i in range(6)]


class _Stuck:
    """Counts the flows that wait for ever on their first attempt; `all_in` is set at 7."""

    def __init__(self) -> None:
        self.count = 0
        self.all_in = trio.Event()

    async def wait_for_ever(self) -> None:
        self.count += 1
        if self.count == len(GOOD) + 1:
            self.all_in.set()
        await trio.sleep_forever()


def _saga(undone: list[str], *, stuck: str, waiting: _Stuck) -> flow.Plan:
    """Two steps; on attempt 1 the second step (`stuck="step"`) or the first step's compensation
    (`stuck="compensation"`, the second step then fails) waits for ever, so that an engine that
    closes leaves the flow running or compensating, begun: the next engine runs it again."""
    plan = flow.Plan("refused-at-open", version=1)

    async def undo(ctx: flow.Context) -> None:
        if stuck == "compensation" and ctx.attempt == 1:
            await waiting.wait_for_ever()
        undone.append(ctx.flow_id)

    @plan.step(compensate=undo)
    async def reserve(ctx: flow.Context) -> None:
        pass

    @plan.step
    async def hold(ctx: flow.Context) -> flow.Outcome | None:
        if stuck == "compensation":
            return flow.fail("no stock")
        if ctx.attempt == 1:
            await waiting.wait_for_ever()
        return None

    return plan


def _refuse_reruns_of_poison(path: str, *, any_update: bool = False) -> None:
    """An operator's trigger: SQLite refuses to run a "poison" flow again (a row of attempt 2
    or more), or, with `any_update`, refuses every change of such a row."""
    when = "NEW.data LIKE '%poison%'" + ("" if any_update else " AND NEW.attempt > 1")
    with sqlite3.connect(path) as conn:
        conn.execute(
            f"CREATE TRIGGER refuse_rerun BEFORE UPDATE ON flow_flows WHEN {when}"
            " BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
        )


async def _leave_begun(engine: flow.Engine, plan: flow.Plan, waiting: _Stuck) -> None:
    """Start the good flows and the poisoned one; return once every one of them waits in its
    step or compensation (begun: the engine that closes now leaves them active)."""
    for fid in GOOD:
        await engine.start(plan, flow_id=fid)
    await engine.start(plan, flow_id="bad", data={"poison": True})
    await waiting.all_in.wait()


@pytest.mark.parametrize(
    ("stuck", "answered"),
    [("step", flow.State.FAILED), ("compensation", flow.State.BLOCKED)],
)
async def test_a_row_refused_at_open_is_its_flows_problem_and_the_engine_opens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, stuck: str, answered: flow.State
) -> None:
    caplog.set_level(logging.INFO, logger="ferry.flow")
    path = str(tmp_path / "flows.db")
    undone: list[str] = []
    waiting = _Stuck()
    plan = _saga(undone, stuck=stuck, waiting=waiting)
    with trio.fail_after(10):
        async with flow.open_engine(path, plans=[plan]) as engine:
            await _leave_begun(engine, plan, waiting)
        _refuse_reruns_of_poison(path)
        for reopen in range(2):  # and a reopen after that opens too (nothing left to recover)
            undone.clear()
            async with flow.open_engine(path, plans=[plan]) as engine:
                bad = await engine.wait("bad")
                assert bad.state is answered
                assert bad.error is not None and "poisoned row" in bad.error
                assert "the database refused to run" in bad.error
                for fid in GOOD:
                    snap = await engine.wait(fid)
                    assert snap.state is (
                        flow.State.COMPLETED if stuck == "step" else flow.State.FAILED
                    )
                assert engine.statistics().recovered == (len(GOOD) if reopen == 0 else 0)
            if reopen == 1:
                assert undone == []
            elif stuck == "step":
                assert undone == ["bad"]  # the refused step failed: the flow compensated
            else:
                assert sorted(undone) == GOOD  # the blocked one keeps its compensation
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "ferry.flow"]
    assert len(warned) == 1
    assert getattr(warned[0], "flow_id", None) == "bad"
    assert "'bad'" in warned[0].getMessage() and "poisoned row" in warned[0].getMessage()


async def test_a_flow_whose_row_refuses_every_change_is_left_as_it_is_and_the_rest_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ferry.flow")
    path = str(tmp_path / "flows.db")
    waiting = _Stuck()
    plan = _saga([], stuck="step", waiting=waiting)
    with trio.fail_after(10):
        async with flow.open_engine(path, plans=[plan]) as engine:
            await _leave_begun(engine, plan, waiting)
        _refuse_reruns_of_poison(path, any_update=True)
        async with flow.open_engine(path, plans=[plan]) as engine:
            for fid in GOOD:
                assert (await engine.wait(fid)).state is flow.State.COMPLETED
            bad = await engine.get("bad")
            assert bad is not None and bad.state is flow.State.RUNNING and bad.step == "hold"
            # it cannot end: a wait on it answers at once, with the database's reason
            with pytest.raises(Failed, match="poisoned row"):
                await engine.wait("bad", timeout=1)
            assert engine.statistics().recovered == len(GOOD)
    left = [r for r in caplog.records if "left as it is" in r.getMessage()]
    assert len(left) == 1 and left[0].levelno == logging.WARNING
    assert getattr(left[0], "flow_id", None) == "bad"


_PG_REFUSE_RERUNS = """
CREATE FUNCTION refuse_rerun() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.data LIKE '%poison%' AND NEW.attempt > 1 THEN
        RAISE EXCEPTION 'poisoned row' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_rerun BEFORE UPDATE ON flow_flows
    FOR EACH ROW EXECUTE FUNCTION refuse_rerun();
"""


@pytest.mark.parametrize("owner", ["a", "b"])
async def test_on_postgres_a_row_refused_at_a_restart_or_a_takeover_is_its_flows_problem(
    pg_server: pg.PgServer, owner: str
) -> None:
    """The same on PostgreSQL (a failed statement aborts the whole transaction there): an
    engine that restarts under the same owner name ("a") resumes its flows, or another engine
    ("b") takes them over at its first scan; the one whose row is refused fails alone."""
    undone: list[str] = []
    waiting = _Stuck()
    plan = _saga(undone, stuck="step", waiting=waiting)
    async with PostgresStore(pg_server.fresh_schema_dsn()) as store:
        with trio.fail_after(20):
            async with flow.open_engine(store, plans=[plan], owner="a") as engine:
                await _leave_begun(engine, plan, waiting)
            await store.transact(lambda tx: tx.execute(_PG_REFUSE_RERUNS))
            async with flow.open_engine(store, plans=[plan], owner=owner) as engine:
                bad = await engine.wait("bad")
                assert bad.state is flow.State.FAILED
                assert bad.error is not None and "poisoned row" in bad.error
                for fid in GOOD:
                    assert (await engine.wait(fid)).state is flow.State.COMPLETED
                stats = engine.statistics()
                assert (stats.recovered if owner == "a" else stats.claimed) == len(GOOD)
    assert undone == ["bad"]
