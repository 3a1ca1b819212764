"""Child flows end to end through the public API (SPEC 5.7), on SQLite and PostgreSQL: a fan-out
held to `max_running`, the fan-in's results in ``ctx.children``, a failed child stopping its
spawn, ``on_failure="continue"``, a parent's compensation undoing its completed children (the
last ended first, each once, before the spawning step's own), a cancel three levels deep, a
blocked child keeping its parent waiting, a wake for a waiting parent queued, a child cancelled
alone failing for its parent, and what is refused: an unknown child plan or data too large
fails the parent with no child row. What takes time (the spawn's
timeout, a whole flow's deadline, a reopen) is in `test_children_in_time.py`.

Seen to fail with the parent's hold for its children's undo taken out of `_store/_kin.py`
(`_hold_past`: no child is compensated when a later step fails).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.lowlevel

from ferry import flow

Log = list[tuple[str, ...]]
Opener = Callable[..., Any]


def plans(log: Log, *, gate: dict[str, trio.Event] | None = None) -> tuple[flow.Plan, flow.Plan]:
    """``order`` (reserve, ship_all: a spawn of ``box`` children, invoice) and ``box`` (pack,
    compensated by unpack). A box's data says what it does: ``fail``, ``park``, or (with
    `gate`) wait for its key's event; ``slow_undo``: its unpack takes 100 s."""
    box = flow.Plan("box")
    running = [0]

    async def unpack(ctx: flow.Context) -> None:
        if ctx.data.get("slow_undo"):
            await trio.sleep(100)
        log.append(("unpack", ctx.flow_id.rsplit("/", 1)[1], ctx.error or ""))

    @box.step(compensate=unpack)
    async def pack(ctx: flow.Context) -> flow.Outcome | None:
        key = ctx.flow_id.rsplit("/", 1)[1]
        running[0] += 1
        log.append(("pack", key, str(running[0])))
        try:
            if gate is not None and key in gate:
                await gate[key].wait()
            await trio.lowlevel.checkpoint()
        finally:
            running[0] -= 1
        if ctx.data.get("fail"):
            return flow.fail("no box")
        if ctx.data.get("park"):
            return flow.park()
        ctx.data["tracking"] = f"T-{key}"
        log.append(("packed", key))
        return None

    order = flow.Plan("order")

    async def release(ctx: flow.Context) -> None:
        log.append(("release",))

    async def cancel_boxes(ctx: flow.Context) -> None:
        log.append(("cancel_boxes",))

    @order.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        log.append(("reserve",))

    @order.step(compensate=cancel_boxes)
    async def ship_all(ctx: flow.Context) -> flow.Outcome:
        boxes = [
            {**b, "pad": "x" * ctx.data["pad"]} if "pad" in ctx.data else b
            for b in ctx.data["boxes"]
        ]
        return flow.spawn(
            [flow.Child(box, key=f"b{i}", data=b) for i, b in enumerate(boxes)],
            max_running=ctx.data.get("max"),
            timeout=ctx.data.get("timeout"),
            on_failure=ctx.data.get("on_failure", "compensate"),
        )

    @order.step
    async def invoice(ctx: flow.Context) -> flow.Outcome | None:
        got = {k: [c.state.name, c.data.get("tracking"), c.error] for k, c in ctx.children.items()}
        ctx.data["got"] = got
        log.append(("invoice", ",".join(got)))
        return flow.fail("invoice refused") if ctx.data.get("refuse") else None

    return order, box


@asynccontextmanager
async def engine_at(where: Any, *ps: flow.Plan, **options: Any) -> AsyncIterator[flow.Engine]:
    async with flow.open_engine(where, plans=list(ps), **options) as engine:
        yield engine


def only(log: Log, kind: str) -> list[tuple[str, ...]]:
    return [e for e in log if e[0] == kind]


async def reached(engine: flow.Engine, flow_id: str, state: flow.State) -> flow.Snapshot:
    """The flow's snapshot once it is in `state` (a child has no row until it starts; a parked
    one tells no waiter): its durable row read until then, not a race with a clock."""
    while (snap := await engine.get(flow_id)) is None or snap.state is not state:  # noqa: ASYNC110
        await trio.sleep(0.001)
    return snap


async def test_a_fan_out_keeps_to_max_running_and_the_next_step_reads_every_result(
    where: Any,
) -> None:
    log: Log = []
    order, box = plans(log)
    async with engine_at(where, order, box) as engine:
        await engine.start(order, flow_id="o", data={"boxes": [{}] * 6, "max": 2})
        snap = await engine.wait("o", timeout=30)
        assert snap.state is flow.State.COMPLETED, snap.error
        assert max(int(e[2]) for e in only(log, "pack")) <= 2  # never more than 2 at once
        assert sorted(e[1] for e in only(log, "pack")) == [f"b{i}" for i in range(6)]  # once each
        got = snap.data["got"]
        assert list(got) == [f"b{i}" for i in range(6)]
        assert all(v == ["COMPLETED", f"T-{k}", None] for k, v in got.items())
        assert snap.children == ()  # wait's snapshot is the engine's memory: no family read
        stored = await engine.get("o")
        assert stored is not None and stored.children == tuple(f"o/1/b{i}" for i in range(6))
        kinds = [e.kind for e in await engine.history("o")]
        assert kinds.count("children_ended") == 1 and kinds[-1] == "completed"
        child = await engine.get("o/1/b3")
        assert child is not None and child.state is flow.State.COMPLETED
        assert child.data == {"tracking": "T-b3"}


async def test_a_failed_child_stops_the_spawn_and_the_parent_undoes_its_completed_children(
    where: Any,
) -> None:
    log: Log = []
    order, box = plans(log)
    boxes = [{}, {"fail": True}, {}, {}]
    async with engine_at(where, order, box) as engine:
        await engine.start(order, flow_id="o", data={"boxes": boxes, "max": 1})
        snap = await engine.wait("o", timeout=30)
        assert snap.state is flow.State.FAILED
        assert "child 'b1' failed" in (snap.error or "")
        assert [e[1] for e in only(log, "pack")] == ["b0", "b1"]  # no kept child started
        assert [e[0] for e in log if e[0] in ("unpack", "cancel_boxes", "release")] == [
            "unpack",
            "cancel_boxes",
            "release",
        ]
        assert only(log, "unpack")[0][1] == "b0"  # the completed child, once
        assert await engine.get("o/1/b2") is None  # kept, never started: no row
        b0 = await engine.get("o/1/b0")
        assert b0 is not None and b0.state is flow.State.FAILED
        assert "its parent 'o' compensates" in (b0.error or "")


async def test_with_continue_the_next_step_sees_the_failure(where: Any) -> None:
    log: Log = []
    order, box = plans(log)
    boxes = [{}, {"fail": True}, {}]
    async with engine_at(where, order, box) as engine:
        data = {"boxes": boxes, "on_failure": "continue"}
        await engine.start(order, flow_id="o", data=data)
        snap = await engine.wait("o", timeout=30)
        assert snap.state is flow.State.COMPLETED
        assert snap.data["got"]["b1"][0] == "FAILED" and snap.data["got"]["b1"][2] == "no box"
        assert snap.data["got"]["b2"][:2] == ["COMPLETED", "T-b2"]
        assert only(log, "unpack") == []


async def test_a_later_failure_undoes_the_children_last_completed_first_then_the_step(
    where: Any,
) -> None:
    log: Log = []
    order, box = plans(log)
    async with engine_at(where, order, box) as engine:
        data = {"boxes": [{}, {}, {}], "max": 1, "refuse": True}
        await engine.start(order, flow_id="o", data=data)
        snap = await engine.wait("o", timeout=30)
        assert snap.state is flow.State.FAILED and snap.error == "invoice refused"
        undone = [e for e in log if e[0] in ("unpack", "cancel_boxes", "release")]
        assert [e[:2] for e in undone] == [
            ("unpack", "b2"),
            ("unpack", "b1"),
            ("unpack", "b0"),
            ("cancel_boxes",),
            ("release",),
        ]
        assert all("invoice refused" in e[2] for e in undone if e[0] == "unpack")
        for key in ("b0", "b1", "b2"):
            kinds = [e.kind for e in await engine.history(f"o/1/{key}")]
            assert kinds.count("undone_by_parent") == 1 and kinds[-1] == "failed"


def tree(log: Log) -> tuple[flow.Plan, flow.Plan, flow.Plan]:
    """top spawns one mid, which spawns one leaf, which parks for ever."""
    leaf = flow.Plan("leaf")
    mid = flow.Plan("mid")
    top = flow.Plan("top")

    async def undo_leaf(ctx: flow.Context) -> None:
        log.append(("undo", "leaf", ctx.error or ""))

    @leaf.step(compensate=undo_leaf)
    async def wait_for_ever(ctx: flow.Context) -> flow.Outcome:
        log.append(("parked", "leaf"))
        return flow.park()

    async def undo_mid(ctx: flow.Context) -> None:
        log.append(("undo", "mid", ctx.error or ""))

    @mid.step(compensate=undo_mid)
    async def spawn_leaf(ctx: flow.Context) -> flow.Outcome:
        return flow.spawn([flow.Child(leaf, key="l")])

    async def undo_top(ctx: flow.Context) -> None:
        log.append(("undo", "top", ctx.error or ""))

    @top.step(compensate=undo_top)
    async def spawn_mid(ctx: flow.Context) -> flow.Outcome:
        return flow.spawn([flow.Child(mid, key="m")])

    return top, mid, leaf


async def test_a_cancel_reaches_every_descendant_three_levels_deep(where: Any) -> None:
    log: Log = []
    top, mid, leaf = tree(log)
    async with engine_at(where, top, mid, leaf) as engine:
        await engine.start(top, flow_id="t")
        await reached(engine, "t/0/m/0/l", flow.State.PARKED)
        assert await engine.cancel("t", "stop it")
        snap = await engine.wait("t", timeout=30)
        assert snap.state is flow.State.FAILED
        for fid in ("t/0/m/0/l", "t/0/m"):
            s = await engine.get(fid)
            assert s is not None and s.state is flow.State.FAILED, (fid, s)
        assert [e[:2] for e in only(log, "undo")] == [
            ("undo", "leaf"),
            ("undo", "mid"),
            ("undo", "top"),
        ]
        assert all(e[2] == "stop it" for e in only(log, "undo"))


async def test_a_blocked_child_keeps_its_parent_waiting_until_an_operator_ends_it(
    where: Any,
) -> None:
    log: Log = []
    order, _box = plans(log)
    stuck = flow.Plan("box")  # a box whose compensation keeps raising: it blocks

    async def unpack(ctx: flow.Context) -> None:
        raise RuntimeError("the shelf is locked")

    @stuck.step(compensate=unpack, attempts=1)
    async def pack(ctx: flow.Context) -> None:
        pass

    @stuck.step(attempts=1)
    async def label(ctx: flow.Context) -> None:
        raise RuntimeError("no label")

    async with engine_at(where, order, stuck) as engine:
        await engine.start(order, flow_id="o", data={"boxes": [{}]})
        await reached(engine, "o/1/b0", flow.State.BLOCKED)
        parent = await engine.get("o")
        assert parent is not None and parent.state is flow.State.PARKED
        assert parent.children == ("o/1/b0",)
        assert await engine.wake("o", {"early": True}) is flow.Delivery.QUEUED
        assert await engine.abandon("o/1/b0", reason="handled by hand")
        snap = await engine.wait("o", timeout=30)
        assert snap.state is flow.State.FAILED and "child 'b0' failed" in (snap.error or "")


async def test_a_child_cancelled_alone_is_a_failed_child_of_its_parent(where: Any) -> None:
    log: Log = []
    order, box = plans(log)
    boxes = [{"park": True}, {}]
    async with engine_at(where, order, box) as engine:
        await engine.start(order, flow_id="o", data={"boxes": boxes, "on_failure": "continue"})
        await reached(engine, "o/1/b0", flow.State.PARKED)
        assert await engine.cancel("o/1/b0", "not needed")
        snap = await engine.wait("o", timeout=30)
        assert snap.state is flow.State.COMPLETED
        assert snap.data["got"]["b0"][0] == "FAILED" and snap.data["got"]["b0"][2] == "not needed"


async def test_an_unknown_child_plan_or_data_too_large_fails_the_parent_and_writes_no_child(
    where: Any,
) -> None:
    log: Log = []
    order, _box = plans(log)  # `box` not given to the engine
    async with engine_at(where, order) as engine:
        await engine.start(order, flow_id="o", data={"boxes": [{}]})
        snap = await engine.wait("o", timeout=30)
        assert snap.state is flow.State.FAILED
        assert "plan 'box' version 1, which is not registered" in (snap.error or "")
        assert await engine.get("o/1/b0") is None
        stored = await engine.get("o")
        assert stored is not None and stored.children == ()
    order, box = plans(log)
    async with engine_at(where, order, box, max_data_bytes=200) as engine:
        await engine.start(order, flow_id="p", data={"boxes": [{}], "pad": 300})
        snap = await engine.wait("p", timeout=30)
        assert snap.state is flow.State.FAILED
        assert "more than max_data_bytes (200)" in (snap.error or "")
        assert await engine.get("p/1/b0") is None
