"""Child flows across time, on SQLite (SPEC 5.7): a reopen mid fan-in (every child runs once,
the parent resumes once), the spawn's timeout (the active children cancelled with reason
"timeout"), a whole flow's deadline (`start(deadline=...)`: the tree cancelled with reason
"deadline", also after a reopen), a bad deadline refused at the call, and retention (children
kept while their parent lives, the tree purged after). Under `MockClock(autojump_threshold=0)`
where time passes.

Seen to fail with the purge's ``parent IS NULL`` taken out (`_store/_purge.py`: the children
went while their parent was parked), and with the deadlines not armed at open
(`_runtime/_recovery.py`: the reopened flow waited for ever).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import trio
import trio.testing

from ferry import flow

from .test_children import Log, engine_at, only, plans, reached, tree


async def test_a_reopen_mid_fan_in_runs_every_child_once_and_resumes_the_parent_once(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "flows.db")
    log: Log = []
    gate = {"b2": trio.Event(), "b3": trio.Event()}
    order, box = plans(log, gate=gate)
    async with engine_at(path, order, box) as engine:
        await engine.start(order, flow_id="o", data={"boxes": [{}] * 4})
        for key in ("b0", "b1"):
            await reached(engine, f"o/1/{key}", flow.State.COMPLETED)
        while len(only(log, "pack")) < 4:  # noqa: ASYNC110 (b2, b3 have begun)
            await trio.sleep(0.001)
        # closed here: b2 and b3 are running, their steps cancelled (they run again)
    assert sorted(e[1] for e in only(log, "packed")) == ["b0", "b1"]
    log2: Log = []
    order, box = plans(log2)
    async with engine_at(path, order, box) as engine:
        snap = await engine.wait("o", timeout=30)
        assert snap.state is flow.State.COMPLETED
        assert list(snap.data["got"]) == ["b0", "b1", "b2", "b3"]
    packed = Counter(e[1] for e in only(log, "packed") + only(log2, "packed"))
    assert packed == {"b0": 1, "b1": 1, "b2": 1, "b3": 1}
    assert len(only(log2, "invoice")) == 1 and only(log, "invoice") == []


async def test_a_bad_deadline_is_refused_at_the_call(tmp_path: Path) -> None:
    order, box = plans([])
    async with engine_at(str(tmp_path / "f.db"), order, box) as engine:
        for bad, error in ((0, ValueError), (-1, ValueError), (float("inf"), ValueError)):
            with pytest.raises(error, match="deadline must be finite and > 0"):
                await engine.start(order, flow_id="o", data={"boxes": [{}]}, deadline=bad)
        for wrong in ("10", True, [1]):
            with pytest.raises(TypeError, match="deadline must be a number"):
                await engine.start(order, flow_id="o", deadline=wrong)  # type: ignore[arg-type]
        assert await engine.get("o") is None


async def test_a_spawn_timeout_cancels_the_active_children(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    log: Log = []
    order, box = plans(log)
    async with engine_at(str(tmp_path / "f.db"), order, box) as engine:
        boxes = [{}, {"park": True}, {"park": True}]
        data = {"boxes": boxes, "timeout": 60, "on_failure": "continue"}
        began = trio.current_time()
        await engine.start(order, flow_id="o", data=data)
        snap = await engine.wait("o", timeout=3600)
        assert trio.current_time() - began >= 60
        assert snap.state is flow.State.COMPLETED
        got = snap.data["got"]
        assert got["b0"][0] == "COMPLETED"
        assert got["b1"] == ["FAILED", None, "timeout"] == got["b2"]
        assert sorted(e[1] for e in only(log, "unpack")) == ["b1", "b2"]  # each compensated


async def test_a_whole_flow_deadline_cancels_the_tree_with_reason_deadline(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    log: Log = []
    top, mid, leaf = tree(log)
    path = str(tmp_path / "f.db")
    async with engine_at(path, top, mid, leaf) as engine:
        began = trio.current_time()
        await engine.start(top, flow_id="t", deadline=90)
        stored = await engine.get("t")
        assert stored is not None and stored.deadline is not None
        snap = await engine.wait("t", timeout=3600)
        assert trio.current_time() - began >= 90
        assert snap.state is flow.State.FAILED and snap.error == "deadline"
        assert [e[:3] for e in only(log, "undo")] == [
            ("undo", "leaf", "deadline"),
            ("undo", "mid", "deadline"),
            ("undo", "top", "deadline"),
        ]
        child = await engine.get("t/0/m")
        assert child is not None and child.deadline is None  # children do not copy it


async def test_a_whole_flow_deadline_survives_a_reopen(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    log: Log = []
    top, mid, leaf = tree(log)
    path = str(tmp_path / "f.db")
    async with engine_at(path, top, mid, leaf) as engine:
        await engine.start(top, flow_id="t", deadline=90)
        await reached(engine, "t/0/m/0/l", flow.State.PARKED)
    async with engine_at(path, top, mid, leaf) as engine:
        snap = await engine.wait("t", timeout=3600)
        assert snap.state is flow.State.FAILED and snap.error == "deadline"


async def test_retention_keeps_children_while_their_parent_lives_then_purges_the_tree(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The children end long before their parent (it parks after the fan-in): retention leaves
    them while the parent lives, and deletes the whole tree once the parent is old enough."""
    box = flow.Plan("box")

    @box.step
    async def pack(ctx: flow.Context) -> None:
        pass

    order = flow.Plan("order")

    @order.step
    async def ship_all(ctx: flow.Context) -> flow.Outcome:
        return flow.spawn([flow.Child(box, key=f"b{i}") for i in range(3)])

    @order.step
    async def confirm(ctx: flow.Context) -> flow.Outcome | None:
        return None if ctx.wake is not None else flow.park()

    day = 600.0  # the retention's period
    async with engine_at(str(tmp_path / "f.db"), order, box, retain=day) as engine:
        await engine.start(order, flow_id="o")
        await reached(engine, "o", flow.State.PARKED)
        await trio.sleep(3 * day)
        assert [await engine.get(f"o/0/b{i}") is not None for i in range(3)] == [True] * 3
        assert await engine.wake("o", {}) is flow.Delivery.RESUMED
        assert (await engine.wait("o", timeout=60)).state is flow.State.COMPLETED
        await trio.sleep(day / 2)
        assert await engine.get("o/0/b0") is not None  # the parent is not old enough yet
        await trio.sleep(3 * day)
        assert await engine.get("o") is None
        assert [await engine.get(f"o/0/b{i}") for i in range(3)] == [None] * 3


async def test_a_stopping_spawn_waits_for_its_cancelled_children_whatever_comes_meanwhile(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """b0 fails at once and stops the spawn; b1, cancelled, takes 100 s to compensate. Neither
    the spawn's timeout (60 s) nor a cancel of the parent meanwhile makes the parent compensate
    before b1 has ended: the timeout does nothing, the cancel answers False."""
    log: Log = []
    order, box = plans(log)
    async with engine_at(str(tmp_path / "f.db"), order, box) as engine:
        boxes = [{"fail": True}, {"park": True, "slow_undo": True}]
        await engine.start(order, flow_id="o", data={"boxes": boxes, "timeout": 60})
        await reached(engine, "o/1/b1", flow.State.COMPENSATING)
        assert not await engine.cancel("o", "too late")
        snap = await engine.wait("o", timeout=3600)
        assert snap.state is flow.State.FAILED and "child 'b0' failed" in (snap.error or "")
        undo = [e[:2] for e in log if e[0] in ("unpack", "cancel_boxes", "release")]
        assert undo == [("unpack", "b1"), ("cancel_boxes",), ("release",)]
