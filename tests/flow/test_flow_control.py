"""Flow control through the public API (SPEC 5.8), on SQLite and PostgreSQL: a concurrency
limit holds and each end gives its slot back in its own transaction (a completion, a queued
flow's cancel, a parked flow's cancel and its compensation, a failure), the budget's counters
equal a recount from the flows' states after each; a per-key limit serialises a key's flows
while another key runs; a reopen keeps the slots of the flows in flight and admits what its
ends free; a delayed start waits for its time (MockClock); bad limits and bad start options
are refused at the definition or the call, nothing stored.

Seen to fail with `_queue._asks`'s ``release`` taken out (a completion freed no slot: the
next queued flow never ran, `TooSlowError` after 30 s), and with `_machine.cancel`'s queued
branch taken out (a queued flow's cancel returned False).
"""

from __future__ import annotations

import json
import sqlite3
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ferry import flow
from ferry.flow._store import _admission
from ferry.projected import Tx


def time_now() -> float:
    return time.time()


def _counts(tx: Tx, plan: str) -> tuple[int, int, int, int]:
    used, queued = _admission.usage(tx, plan)
    again = _admission.recount(tx, plan)
    return used.active, queued, sum(again["active"].values()), sum(again["queued"].values())


async def budget(where: Any, plan: str) -> tuple[int, int]:
    """The plan's (active, queued) counters, checked equal to a recount from the flows' rows."""
    if isinstance(where, str):
        db = sqlite3.connect(where)
        try:
            rows = db.execute("SELECT active FROM flow_budgets WHERE plan = ?", (plan,)).fetchall()
            active = rows[0][0] if rows else 0
            queued = db.execute(
                "SELECT COALESCE(SUM(queued), 0) FROM flow_keys WHERE plan = ?", (plan,)
            ).fetchone()[0]
            re_active = db.execute(
                "SELECT COUNT(*) FROM flow_flows WHERE plan = ? AND seq IS NOT NULL AND state IN"
                " ('RUNNING', 'PARKED', 'COMPENSATING')",
                (plan,),
            ).fetchone()[0]
            re_queued = db.execute(
                "SELECT COUNT(*) FROM flow_flows WHERE plan = ? AND state = 'QUEUED'", (plan,)
            ).fetchone()[0]
        finally:
            db.close()
        counts = (active, queued, re_active, re_queued)
    else:
        counts = await where.transact(partial(_counts, plan=plan))
    assert counts[:2] == counts[2:], f"counters {counts[:2]} != recount {counts[2:]}"
    return counts[0], counts[1]


def mail(limits: flow.Limits, log: list[str]) -> flow.Plan:
    """``mail``: a step that parks until woken (a ``fail`` wake fails it), with a compensation."""
    plan = flow.Plan("mail", limits=limits)

    async def undo(ctx: flow.Context) -> None:
        log.append(f"undo {ctx.flow_id}")

    @plan.step(compensate=undo)
    async def send(ctx: flow.Context) -> flow.Outcome:
        log.append(f"send {ctx.flow_id}")
        return flow.park()

    @plan.step
    async def done(ctx: flow.Context) -> None:
        if ctx.wake == "fail":
            raise RuntimeError("bounced")

    return plan


async def state(engine: flow.Engine, fid: str, want: flow.State) -> None:
    """Until the flow's durable row is in `want` (a parked flow tells no waiter); a failure,
    not a hang, if it never gets there."""
    with trio.fail_after(30):
        while (snap := await engine.get(fid)) is None or snap.state is not want:  # noqa: ASYNC110
            await trio.sleep(0.001)


async def test_a_concurrency_limit_holds_and_every_end_gives_its_slot_back(where: Any) -> None:
    log: list[str] = []
    plan = mail(flow.Limits(concurrency=2), log)
    async with flow.open_engine(where, plans=[plan]) as engine:
        for i in range(5):
            await engine.start(plan, flow_id=f"m{i}")
        await state(engine, "m0", flow.State.PARKED)
        await state(engine, "m1", flow.State.PARKED)
        for i in (2, 3, 4):
            snap = await engine.get(f"m{i}")
            assert snap is not None and snap.state is flow.State.QUEUED
        assert await budget(where, "mail") == (2, 3)
        # A completion frees a slot: the first queued flow is admitted by that transaction.
        await engine.wake("m0", "ok")
        assert (await engine.wait("m0", timeout=30)).state is flow.State.COMPLETED
        await state(engine, "m2", flow.State.PARKED)
        assert await budget(where, "mail") == (2, 2)
        # A queued flow's cancel ends it FAILED with its reason; no step ran.
        assert await engine.cancel("m4", "not needed")
        snap = await engine.get("m4")  # durable when cancel returns
        assert snap is not None and snap.state is flow.State.FAILED
        assert snap.error == "not needed"
        assert "send m4" not in log
        assert await budget(where, "mail") == (2, 1)
        # A parked flow's cancel compensates, then gives its slot back: m3 runs.
        assert await engine.cancel("m1", "stop")
        assert (await engine.wait("m1", timeout=30)).state is flow.State.FAILED
        assert "undo m1" in log
        await state(engine, "m3", flow.State.PARKED)
        assert await budget(where, "mail") == (2, 0)
        # A failure (compensated) gives its slot back too.
        await engine.wake("m2", "fail")
        assert (await engine.wait("m2", timeout=30)).state is flow.State.FAILED
        assert await budget(where, "mail") == (1, 0)
        await engine.wake("m3", "ok")
        assert (await engine.wait("m3", timeout=30)).state is flow.State.COMPLETED
        assert await budget(where, "mail") == (0, 0)


async def test_a_per_key_limit_serialises_a_key_and_lets_another_run(where: Any) -> None:
    log: list[str] = []
    plan = mail(flow.Limits(key=lambda d: str(d["user"]), per_key=1), log)
    async with flow.open_engine(where, plans=[plan]) as engine:
        await engine.start(plan, flow_id="a1", data={"user": "a"})
        await engine.start(plan, flow_id="a2", data={"user": "a"})
        await engine.start(plan, flow_id="b1", data={"user": "b"})
        await state(engine, "a1", flow.State.PARKED)
        await state(engine, "b1", flow.State.PARKED)
        snap = await engine.get("a2")
        assert snap is not None and snap.state is flow.State.QUEUED
        await engine.wake("b1", "ok")
        assert (await engine.wait("b1", timeout=30)).state is flow.State.COMPLETED
        snap = await engine.get("a2")
        assert snap is not None and snap.state is flow.State.QUEUED  # b's end frees no 'a' slot
        await engine.wake("a1", "ok")
        await state(engine, "a2", flow.State.PARKED)
        assert await budget(where, "mail") == (1, 0)


async def test_starts_and_ends_written_together_are_settled_together(
    where: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starts and ends that one batch writes are settled together (docs/adr/0182): 8 starts
    over two keys at once (2 a key and 4 in all may run), then the 4 running woken at once:
    their ends admit the 4 queued; then 4 more at once with room for all (admitted as they are
    queued). At the end every counter is back to 0, no key row is left and each flow was
    admitted once. (Made to fail by a group's release leaving its key's count as it was: the
    queued flows of that key never ran; and by a group of starts counting one key's slots
    twice: the last wave queued.)"""
    from ferry.flow._store import _admission_batch as many

    grouped: list[str] = []
    for name in ("release_many", "start_many"):
        real = getattr(many, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            got = _real(*args, **kwargs)
            grouped.append(_name if got is not None else f"{_name}: one by one")
            return got

        monkeypatch.setattr(many, name, spy)
    log: list[str] = []
    plan = mail(flow.Limits(concurrency=4, key=lambda d: str(d["user"]), per_key=2), log)
    ids = [f"{u}{i}" for u in "ab" for i in range(4)]
    async with flow.open_engine(where, plans=[plan]) as engine:
        async with trio.open_nursery() as nursery:
            for fid in ids:
                nursery.start_soon(partial(engine.start, plan, flow_id=fid, data={"user": fid[0]}))
        first = [f"{u}{i}" for u in "ab" for i in range(2)]
        for fid in first:
            await state(engine, fid, flow.State.PARKED)
        assert await budget(where, "mail") == (4, 4)
        for wave in (first, [f for f in ids if f not in first]):
            async with trio.open_nursery() as nursery:
                for fid in wave:
                    nursery.start_soon(engine.wake, fid, "ok")
            for fid in wave:
                assert (await engine.wait(fid, timeout=30)).state is flow.State.COMPLETED
            if wave is first:
                for fid in ids:
                    if fid not in first:
                        await state(engine, fid, flow.State.PARKED)
                assert await budget(where, "mail") == (4, 0)
        assert await budget(where, "mail") == (0, 0)
        # 4 more at once, room for all: admitted as they are queued, together.
        more = [f"{u}{i}" for u in "ab" for i in range(4, 6)]
        async with trio.open_nursery() as nursery:
            for fid in more:
                nursery.start_soon(partial(engine.start, plan, flow_id=fid, data={"user": fid[0]}))
        for fid in more:
            await state(engine, fid, flow.State.PARKED)
        assert await budget(where, "mail") == (4, 0)
        async with trio.open_nursery() as nursery:
            for fid in more:
                nursery.start_soon(engine.wake, fid, "ok")
        for fid in more:
            assert (await engine.wait(fid, timeout=30)).state is flow.State.COMPLETED
        assert await budget(where, "mail") == (0, 0)
        ids += more

    keys_sql = "SELECT COUNT(*) FROM flow_keys WHERE plan = 'mail'"
    admitted_sql = (
        "SELECT flow_id, COUNT(*) FROM flow_history WHERE kind = 'admitted'"
        " GROUP BY flow_id ORDER BY flow_id"
    )
    if isinstance(where, str):
        db = sqlite3.connect(where)
        try:
            keys = db.execute(keys_sql).fetchone()[0]
            admitted = [tuple(r) for r in db.execute(admitted_sql)]
        finally:
            db.close()
    else:

        def left(tx: Tx) -> tuple[int, list[tuple[Any, ...]]]:
            return int(tx.execute(keys_sql)[0][0]), [tuple(r) for r in tx.execute(admitted_sql)]

        keys, admitted = await where.transact(left)
    assert keys == 0
    assert admitted == [(fid, 1) for fid in sorted(ids)]
    assert "release_many" in grouped and "start_many" in grouped, grouped


async def test_a_reopen_keeps_the_slots_in_flight_and_admits_what_an_end_frees(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "flows.db")
    log: list[str] = []
    plan = mail(flow.Limits(concurrency=1), log)
    async with flow.open_engine(path, plans=[plan]) as engine:
        await engine.start(plan, flow_id="x")
        await engine.start(plan, flow_id="y")
        await state(engine, "x", flow.State.PARKED)
    assert await budget(path, "mail") == (1, 1)
    plan = mail(flow.Limits(concurrency=1), log)
    async with flow.open_engine(path, plans=[plan]) as engine:
        snap = await engine.get("y")
        assert snap is not None and snap.state is flow.State.QUEUED
        await engine.wake("x", "ok")
        await state(engine, "y", flow.State.PARKED)
        assert await budget(path, "mail") == (1, 0)


async def test_a_delayed_start_waits_for_its_time(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    ran: list[float] = []
    plan = flow.Plan("remind", limits=flow.Limits(concurrency=10))

    @plan.step
    async def remind(ctx: flow.Context) -> None:
        ran.append(trio.current_time())

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        began = trio.current_time()
        await engine.start(plan, flow_id="later", delay=3600)
        snap = await engine.get("later")
        assert snap is not None and snap.state is flow.State.QUEUED
        assert (await engine.wait("later", timeout=7200)).state is flow.State.COMPLETED
        assert len(ran) == 1 and ran[0] - began >= 3600


async def test_bad_limits_and_bad_start_options_are_refused_at_the_call(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="concurrency must be in"):
        flow.Limits(concurrency=0)
    with pytest.raises(ValueError, match="needs a key function"):
        flow.Limits(per_key=1)
    with pytest.raises(TypeError, match="limits must be a flow"):
        flow.Plan("p", limits=3)  # type: ignore[arg-type]

    def bad_key(data: Any) -> str:
        raise KeyError("user")

    log: list[str] = []
    keyed = mail(flow.Limits(key=bad_key, per_key=1), log)
    free = flow.Plan("free")

    @free.step
    async def only(ctx: flow.Context) -> None:
        return None

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[keyed, free]) as engine:
        with pytest.raises(ValueError, match="key function of plan 'mail' raised"):
            await engine.start(keyed, flow_id="k")
        with pytest.raises(ValueError, match="not both"):
            await engine.start(free, flow_id="f", delay=1, at=2)
        with pytest.raises(ValueError, match="delay must be 0 seconds or more"):
            await engine.start(free, flow_id="f", delay=-1)
        with pytest.raises(TypeError, match="priority must be a whole number"):
            await engine.start(free, flow_id="f", priority=1.5)  # type: ignore[arg-type]
        assert await engine.get("k") is None and await engine.get("f") is None


async def test_a_blocked_flow_gives_its_slot_back_and_queues_again_when_resumed(
    where: Any,
) -> None:
    """A compensation that fails blocks its flow: its slot goes to the queued flow; resumed, it
    waits in the queue like a start and is admitted back COMPENSATING when a slot frees."""
    broken = {"refund": True}
    plan = flow.Plan("pay", limits=flow.Limits(concurrency=1))

    async def refund(ctx: flow.Context) -> None:
        if broken["refund"]:
            raise RuntimeError("refund service down")

    @plan.step(compensate=refund, attempts=1)
    async def charge(ctx: flow.Context) -> flow.Outcome:
        return flow.park()

    @plan.step
    async def receipt(ctx: flow.Context) -> None:
        return None

    async with flow.open_engine(where, plans=[plan]) as engine:
        await engine.start(plan, flow_id="p1")
        await engine.start(plan, flow_id="p2")
        await state(engine, "p1", flow.State.PARKED)
        assert await engine.cancel("p1", "refund it")
        assert (await engine.wait("p1", timeout=30)).state is flow.State.BLOCKED
        await state(engine, "p2", flow.State.PARKED)
        assert await budget(where, "pay") == (1, 0)
        broken["refund"] = False
        assert await engine.resume("p1")
        snap = await engine.get("p1")
        assert snap is not None and snap.state is flow.State.QUEUED
        assert await budget(where, "pay") == (1, 1)
        await engine.wake("p2", "ok")
        assert (await engine.wait("p2", timeout=30)).state is flow.State.COMPLETED
        snap = await engine.wait("p1", timeout=30)
        assert snap.state is flow.State.FAILED and snap.error == "refund it"
        assert await budget(where, "pay") == (0, 0)


async def test_a_rate_limit_lets_count_go_per_window(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """``Rate(2, per=60)``: of five flows started at once, two run at once, the next two when
    the window has moved on (60 s later, by the plan's timer), the last 60 s after that."""
    ran: list[float] = []
    plan = flow.Plan("bank", limits=flow.Limits(rate=flow.Rate(2, per=60.0)))

    @plan.step
    async def call(ctx: flow.Context) -> None:
        ran.append(trio.current_time())

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        began = trio.current_time()
        for i in range(5):
            await engine.start(plan, flow_id=f"c{i}")
        for i in range(5):
            assert (await engine.wait(f"c{i}", timeout=600)).state is flow.State.COMPLETED
        offsets = sorted(round(t - began) for t in ran)
        assert offsets[:2] == [0, 0] and 60 <= offsets[2] <= offsets[3] < 61
        assert 120 <= offsets[4] < 121


async def test_operators_see_the_queue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], autojump_clock: trio.testing.MockClock
) -> None:
    """`Snapshot.not_before`, `statistics().queued` and ``list --state QUEUED``."""
    from ferry.flow._ops import _inspect

    path = str(tmp_path / "f.db")
    plan = mail(flow.Limits(concurrency=1), [])
    async with flow.open_engine(path, plans=[plan]) as engine:
        before = time_now()
        await engine.start(plan, flow_id="now")
        await engine.start(plan, flow_id="soon", delay=600)
        await engine.start(plan, flow_id="at", at=before + 10**6)
        await state(engine, "now", flow.State.PARKED)
        soon = await engine.get("soon")
        assert soon is not None and soon.state is flow.State.QUEUED
        assert soon.not_before is not None and before + 599 <= soon.not_before < before + 700
        later = await engine.get("at")
        assert later is not None and later.not_before == before + 10**6
        now_snap = await engine.get("now")
        assert now_snap is not None and now_snap.not_before is None
        assert engine.statistics().queued == 2
    argv = [path, "list", "--state", "QUEUED", "--json"]
    assert await trio.to_thread.run_sync(_inspect.main, argv) == 0  # it runs trio of its own
    listed = json.loads(capsys.readouterr().out)["flows"]
    assert sorted(f["flow_id"] for f in listed) == ["at", "soon"]
    plan = mail(flow.Limits(concurrency=1), [])
    async with flow.open_engine(path, plans=[plan]) as engine:
        assert engine.statistics().queued == 2  # counted at open


async def test_engines_that_give_one_plan_version_other_limits_are_refused(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "f.db")
    async with flow.open_engine(path, plans=[mail(flow.Limits(concurrency=1), [])]):
        pass
    with pytest.raises(ValueError, match=r"plan 'mail' version 1 is registered by .* limits"):
        async with flow.open_engine(path, plans=[mail(flow.Limits(concurrency=2), [])]):
            pass
