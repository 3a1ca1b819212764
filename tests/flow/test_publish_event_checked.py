"""`Engine.publish` checks its event like any payload (SPEC 5.3.2, docs/adr/0114): an event that
is not JSON or cannot be stored is refused at the call (`TypeError`/`ValueError` naming the event
and what is wrong), before any mapper sees it, whether or not a mapper would have used it;
nothing is applied, and a start in flight at the same moment is not lost.

Before the check, such an event published to no mapper returned ``[]``, and to a mapper that
ignored it ``[None]``, as if it had been a good one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from ferry import flow
from ferry.flow._model._checks import MAX_DEPTH

MAX_DATA = 10_000


def deep(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


BAD = [
    pytest.param({"id": {1, 2}}, TypeError, "must be JSON", id="a set"),
    pytest.param({"id": "o1", "note": "\udcff"}, ValueError, "not valid Unicode", id="surrogate"),
    pytest.param({"id": "o1", "deep": deep(MAX_DEPTH + 1)}, ValueError, "deeper", id="deep"),
    pytest.param({"id": "o1", "total": float("nan")}, TypeError, "must be JSON", id="NaN"),
    pytest.param(b"o1", TypeError, "must be JSON", id="bytes"),
    pytest.param({"id": "o1", "pad": "x" * MAX_DATA}, ValueError, "max_data_bytes", id="too big"),
]


def plans() -> tuple[flow.Plan, list[str]]:
    ran: list[str] = []
    plan = flow.Plan("order", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        ran.append(ctx.flow_id)

    return plan, ran


@pytest.mark.parametrize("mappers", ["none", "ignoring", "starting"])
@pytest.mark.parametrize(("event", "error", "says"), BAD)
async def test_an_event_that_cannot_be_stored_is_refused_at_the_call(
    tmp_path: Path, event: Any, error: type[Exception], says: str, mappers: str
) -> None:
    plan, ran = plans()
    seen: list[object] = []

    def ignoring(ev: object) -> None:
        seen.append(ev)

    def starting(ev: object) -> flow.Start:
        seen.append(ev)
        return flow.Start(plan, flow_id="from-the-event")

    path = str(tmp_path / "flows.db")
    async with flow.open_engine(path, plans=[plan], max_data_bytes=MAX_DATA) as engine:
        if mappers == "ignoring":
            engine.on("ordered", ignoring)
        elif mappers == "starting":
            engine.on("ordered", starting)
        started: list[str] = []

        async def start_meanwhile() -> None:
            started.append(await engine.start(plan, flow_id="meanwhile"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(start_meanwhile)  # in flight while the publish is refused
            with pytest.raises(error, match=says) as caught:
                await engine.publish("ordered", event)
        assert "the event of type 'ordered'" in str(caught.value)
        assert seen == []  # no mapper saw it
        assert started == ["meanwhile"]
        await engine.wait("meanwhile", timeout=10)
        assert await engine.get("from-the-event") is None
        # The engine goes on: a good event is published as before.
        good = await engine.publish("ordered", {"id": "o1"})
        if mappers == "starting":
            await engine.wait("from-the-event", timeout=10)
    assert good == {"none": [], "ignoring": [None], "starting": ["from-the-event"]}[mappers]
    assert ran == (["meanwhile", "from-the-event"] if mappers == "starting" else ["meanwhile"])
