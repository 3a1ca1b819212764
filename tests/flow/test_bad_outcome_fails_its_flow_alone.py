"""A flow's bad outcome or data is its own (ADR 0062): a step that returns what is not an
outcome, or leaves data JSON cannot store, fails that flow alone; its batch neighbours complete."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from ferry import flow


def _deep(levels: int) -> dict[str, object]:
    """A dict nested `levels` levels deep in all (itself counted)."""
    value: dict[str, object] = {}
    for _ in range(levels - 1):
        value = {"d": value}
    return value


class _NotJson:
    pass


def _set_data(key: str, value: object) -> object:
    def change(ctx: flow.Context) -> None:
        ctx.data[key] = value

    return change


# case: (what the bad step returns, how it changes ctx.data, words in the flow's error)
_BAD: dict[str, tuple[object, object, str]] = {
    "park timeout a str": (flow.Park("60", "continue"), None, "timeout"),  # type: ignore[arg-type]
    "park timeout nan": (flow.Park(float("nan"), "compensate"), None, "timeout"),
    "park timeout < 0": (flow.Park(-1.0, "compensate"), None, "timeout"),
    "park on_timeout unknown": (flow.Park(1.0, "explode"), None, "on_timeout"),  # type: ignore[arg-type]
    "fail reason an exception": (flow.Fail(RuntimeError("x")), None, "reason must be a str"),  # type: ignore[arg-type]
    "fail reason a surrogate": (flow.Fail("bad \udc80"), None, "surrogate"),
    "not an outcome": (42, None, "not an outcome"),
    "data with a lone surrogate": (None, _set_data("x", "\udc80"), "surrogate"),
    "data with a surrogate key": (None, _set_data("\udc80", 1), "surrogate"),
    "data 5000 levels deep": (None, _set_data("d", _deep(5000)), "deeper than 64"),
    "data 65 levels deep": (None, _set_data("d", _deep(64)), "deeper than 64"),
    "data that is not JSON": (None, _set_data("s", _NotJson()), "must be JSON"),
    "data too big": (None, _set_data("s", "x" * 2000), "max_data_bytes=1000"),
}


@pytest.mark.parametrize("case", list(_BAD))
async def test_a_bad_outcome_or_data_fails_that_flow_alone(tmp_path: Path, case: str) -> None:
    """The bad flow compensates and ends FAILED naming the step and the problem; the good flows
    that shared its batches complete; the engine goes on; a reopen does not run it again."""
    returned, change, words = _BAD[case]
    path = str(tmp_path / "flows.db")
    ran: list[str] = []
    undone: list[str] = []
    plan = flow.Plan("edges", version=1)

    async def undo(ctx: flow.Context) -> None:
        undone.append(ctx.flow_id)

    @plan.step(compensate=undo)
    async def reserve(ctx: flow.Context) -> None:
        ctx.data["reserved"] = True

    @plan.step
    async def decide(ctx: flow.Context) -> object:
        if ctx.data.get("bad"):
            ran.append(ctx.flow_id)
            if callable(change):
                change(ctx)
            return returned
        return flow.CONTINUE

    @plan.step
    async def ship(ctx: flow.Context) -> None:
        ctx.data["shipped"] = True

    good = [f"good-{i}" for i in range(20)]
    with trio.fail_after(10):
        async with flow.open_engine(path, plans=[plan], max_data_bytes=1000) as engine:
            async with trio.open_nursery() as nursery:
                for fid in good[:10]:
                    nursery.start_soon(partial(engine.start, plan, flow_id=fid))
                nursery.start_soon(partial(engine.start, plan, flow_id="bad", data={"bad": 1}))
                for fid in good[10:]:
                    nursery.start_soon(partial(engine.start, plan, flow_id=fid))
            snap = await engine.wait("bad")
            assert snap.state is flow.State.FAILED
            assert snap.error is not None
            assert "'decide'" in snap.error
            assert words in snap.error
            for fid in good:
                assert (await engine.wait(fid)).state is flow.State.COMPLETED
            # the engine keeps running flows after it
            await engine.start(plan, flow_id="after")
            assert (await engine.wait("after")).state is flow.State.COMPLETED
        assert undone == ["bad"]
        async with flow.open_engine(path, plans=[plan], max_data_bytes=1000) as engine:
            assert (await engine.wait("bad")).state is flow.State.FAILED
    assert ran == ["bad"]
