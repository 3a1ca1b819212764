"""`Engine.abandon` and the inspector's ``abandon``: a `BLOCKED` flow whose compensation can never
succeed ends `FAILED` without running it, with who, why and what was skipped in its history."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio

from ferry import flow

from .test_inspect import run, run_json


def refund_plan(refunds: list[str]) -> flow.Plan:
    plan = flow.Plan("order")

    async def release(ctx: flow.Context) -> None:
        refunds.append(f"release {ctx.flow_id}")

    async def refund(ctx: flow.Context) -> None:
        refunds.append(f"refund {ctx.flow_id}")
        raise ConnectionError("the account is closed")

    @plan.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        pass

    @plan.step(compensate=refund, attempts=1)
    async def charge(ctx: flow.Context) -> None:
        pass

    @plan.step(attempts=1)
    async def ship(ctx: flow.Context) -> None:
        raise RuntimeError("the carrier lost it")

    return plan


async def blocked(engine: flow.Engine, plan: flow.Plan, fid: str) -> flow.Snapshot:
    await engine.start(plan, flow_id=fid, data={})
    while True:
        snap = await engine.get(fid)
        if snap is not None and snap.state is flow.State.BLOCKED:
            return snap
        await trio.sleep(0.01)


async def test_abandon_ends_a_blocked_flow_failed_without_its_compensations(
    tmp_path: Path,
) -> None:
    refunds: list[str] = []
    plan = refund_plan(refunds)
    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        snap = await blocked(engine, plan, "o1")
        assert refunds == ["refund o1"]
        assert await engine.cancel("o1") is False  # what an operator had: no way out
        assert await engine.abandon("o1", reason="refunded by hand", by="ana") is True
        snap = await engine.wait("o1", timeout=10)
        assert snap.state is flow.State.FAILED
        assert snap.error is not None
        assert snap.error.startswith("abandoned by ana while blocked (compensation of step")
        assert snap.error.endswith(": refunded by hand")
        events = await engine.history("o1")
        assert [e.kind for e in events[-2:]] == ["abandoned", "failed"]
        assert events[-2].detail == {
            "reason": "refunded by hand",
            "by": "ana",
            "blocked": (
                "compensation of step 'charge' failed: ConnectionError('the account is closed')"
                " on attempt 1 (1 of 1 tries)"
            ),
            "skipped": ["charge", "reserve"],
        }
        assert await engine.abandon("o1", reason="again") is False  # not blocked any more
        assert await engine.abandon("nobody", reason="x") is False
        await trio.sleep(0.2)
    assert refunds == ["refund o1"], "a skipped compensation ran"


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"reason": 3}, TypeError),
        ({"reason": "  "}, ValueError),
        ({"reason": "x", "by": ""}, ValueError),
        ({"reason": "\ud800"}, ValueError),
        ({"reason": "ok", "by": 7}, TypeError),
    ],
)
async def test_a_bad_reason_or_by_is_refused_at_the_call(
    tmp_path: Path, options: dict[str, Any], error: type[Exception]
) -> None:
    refunds: list[str] = []
    plan = refund_plan(refunds)
    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await blocked(engine, plan, "o1")
        with pytest.raises(error):
            await engine.abandon("o1", **options)
        assert (await engine.get("o1")).state is flow.State.BLOCKED  # type: ignore[union-attr]


def test_abandon_from_the_inspector(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "f.db")
    refunds: list[str] = []
    plan = refund_plan(refunds)

    async def make() -> None:
        async with flow.open_engine(path, plans=[plan]) as engine:
            await blocked(engine, plan, "o1")
            await blocked(engine, plan, "o2")

    trio.run(make)
    report = run_json(capsys, path, "abandon", "o1", "--reason", "refunded by hand")
    assert report["abandoned"] is True and report["state"] == "FAILED"
    code, _out, err = run(capsys, path, "abandon", "o1", "--reason", "again")
    assert code == 1 and "only a BLOCKED flow can be abandoned" in err
    code, _out, err = run(capsys, path, "abandon", "o2")
    assert code == 2 and "--reason" in err
    conn = sqlite3.connect(path)
    try:
        states = dict(conn.execute("SELECT flow_id, state FROM flow_flows"))
    finally:
        conn.close()
    assert states == {"o1": "FAILED", "o2": "BLOCKED"}
    assert refunds == ["refund o1", "refund o2"]


def test_abandon_every_blocked_flow_a_filter_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "f.db")
    refunds: list[str] = []
    plan = refund_plan(refunds)

    async def make() -> None:
        async with flow.open_engine(path, plans=[plan]) as engine:
            for fid in ("o1", "o2", "o3"):
                await blocked(engine, plan, fid)

    trio.run(make)
    report = run_json(
        capsys, path, "abandon", "--state", "BLOCKED", "--reason", "closed accounts", "--yes"
    )
    assert (report["matched"], report["acted"]) == (3, 3)
    assert report["outcomes"] == {"abandoned": 3}
    conn = sqlite3.connect(path)
    try:
        states = {r[0] for r in conn.execute("SELECT state FROM flow_flows")}
        by = [
            r[0] for r in conn.execute("SELECT detail FROM flow_history WHERE kind = 'abandoned'")
        ]
    finally:
        conn.close()
    assert states == {"FAILED"}
    assert len(by) == 3 and all('"by":' in d and "@" in d for d in by)
