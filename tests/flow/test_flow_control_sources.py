"""Flow control of the flows an engine starts on its own (SPEC 5.8 with 5.7 and 5.9, ADR
0168): a schedule's tick of a limited plan is queued under the key its key function gives the
tick's data and run by the engine that fired it when admitted; a schedule whose ticks the key
function cannot key is refused at its definition; children of a plan with a concurrency limit
(the spawn's first ones and those a sibling's end starts) hold to it; a plan whose limits have
a key function is refused as a child's plan at `flow.Child(...)`.

Seen to fail with `_schedules._tick_create` starting without the key (the tick queued under
'' and a second region's tick waited behind the first), with the schedule task tracking the
tick's row as written instead of following its admission (`_queues.started`: the first tick
never ran, `TooSlowError`), and with `Child`'s check taken out (no ValueError).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ferry import flow
from tests import switches

BASE = 1_796_169_600.0  # 2026-12-02T00:00:00Z


class Wall:
    """A wall clock that is `base` when the test begins, then trio's (a MockClock's)."""

    def __init__(self, base: float) -> None:
        self.base = base - trio.current_time()

    def __call__(self) -> float:
        return self.base + trio.current_time()


def rows(db: Path, plan: str) -> dict[str, tuple[str, str | None]]:
    """Each flow of `plan`: id -> (state, queue key)."""
    con = sqlite3.connect(db)
    try:
        got = con.execute(
            "SELECT flow_id, state, queue_key FROM flow_flows WHERE plan = ? ORDER BY 1", (plan,)
        ).fetchall()
    finally:
        con.close()
    return {r[0]: (r[1], r[2]) for r in got}


async def until(engine: flow.Engine, fid: str, want: flow.State) -> None:
    with trio.fail_after(30):
        while (snap := await engine.get(fid)) is None or snap.state is not want:  # noqa: ASYNC110
            await trio.sleep(0.001)


async def test_a_schedules_ticks_queue_under_their_key_and_run_when_admitted(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    report = flow.Plan("report", limits=flow.Limits(key=lambda d: d["region"], per_key=1))

    @report.step
    async def build(ctx: flow.Context) -> flow.Outcome:
        return flow.park()

    @report.step
    async def done(ctx: flow.Context) -> None:
        pass

    eu = flow.Schedule("eu", report, cron="* * * * *", data={"region": "eu"}, overlap="allow")
    us = flow.Schedule("us", report, cron="* * * * *", data={"region": "us"}, overlap="allow")
    db = tmp_path / "app.db"
    async with switches.open_engine(
        str(db), [report], schedules=[eu, us], wall_clock=Wall(BASE), retain=None
    ) as engine:
        await trio.sleep(61)  # the ticks of 00:01: one per region, each its key's one slot
        first_eu, first_us = "eu@2026-12-02T00:01:00Z", "us@2026-12-02T00:01:00Z"
        await until(engine, first_eu, flow.State.PARKED)
        await until(engine, first_us, flow.State.PARKED)
        await trio.sleep(60)  # 00:02: both wait behind their key's parked flow
        second_eu = "eu@2026-12-02T00:02:00Z"
        assert rows(db, "report")[second_eu] == ("QUEUED", "eu")
        assert rows(db, "report")["us@2026-12-02T00:02:00Z"] == ("QUEUED", "us")
        await engine.wake(first_eu, "go")
        await until(engine, first_eu, flow.State.COMPLETED)
        await until(engine, second_eu, flow.State.PARKED)  # its key's slot, given back
        assert rows(db, "report")["us@2026-12-02T00:02:00Z"][0] == "QUEUED"


def test_a_schedule_whose_ticks_its_plans_key_function_cannot_key_is_refused() -> None:
    report = flow.Plan("report", limits=flow.Limits(key=lambda d: d["region"], per_key=1))

    @report.step
    async def build(ctx: flow.Context) -> None:
        pass

    with pytest.raises(ValueError, match=r"schedule 'nightly'.*key function of plan 'report'"):
        flow.Schedule("nightly", report, cron="0 3 * * *", data={"kind": "daily"})
    numbered = flow.Plan("numbered", limits=flow.Limits(key=lambda d: d["n"], per_key=1))
    with pytest.raises(TypeError, match=r"schedule 'n'.*must return a str, got 3"):
        flow.Schedule("n", numbered, cron="0 3 * * *", data={"n": 3})


def test_a_plan_whose_limits_have_a_key_is_refused_as_a_childs_plan() -> None:
    keyed = flow.Plan("keyed", limits=flow.Limits(key=lambda d: d["k"], per_key=1))
    with pytest.raises(ValueError, match=r"Child\(plan\) cannot be plan 'keyed'.*key function"):
        flow.Child(keyed, key="a", data={"k": "x"})
    flow.Child(flow.Plan("counted", limits=flow.Limits(concurrency=1)), key="a")


@pytest.mark.parametrize("max_running", [None, 2])
async def test_children_of_a_plan_with_a_concurrency_limit_hold_to_it(
    tmp_path: Path, max_running: int | None
) -> None:
    log: list[str] = []
    box = flow.Plan("box", limits=flow.Limits(concurrency=1))

    @box.step
    async def ship(ctx: flow.Context) -> None:
        log.append(f"+{ctx.flow_id}")
        await trio.sleep(0.002)  # room for another child to start, were it let
        log.append(f"-{ctx.flow_id}")

    order = flow.Plan("order")

    @order.step
    async def ship_all(ctx: flow.Context) -> flow.Outcome:
        kids = [flow.Child(box, key=f"b{i}") for i in range(4)]
        return flow.spawn(kids, max_running=max_running)

    @order.step
    async def invoice(ctx: flow.Context) -> None:
        ctx.data["got"] = sorted(k for k, c in ctx.children.items() if c.state.name == "COMPLETED")

    async with flow.open_engine(str(tmp_path / "app.db"), plans=[order, box]) as engine:
        await engine.start(order, flow_id="o")
        with trio.fail_after(30):
            snap = await engine.wait("o")
    assert snap.state is flow.State.COMPLETED
    assert snap.data["got"] == ["b0", "b1", "b2", "b3"]
    assert len(log) == 8
    overlap: list[Any] = [log[i : i + 2] for i in range(0, 8, 2) if log[i][1:] != log[i + 1][1:]]
    assert overlap == [], f"two children of a plan with concurrency=1 ran at once: {log}"
