"""Bad input refused at the call (ADR 0060, 0062): a bad start, bad start data, a bad wake or
publish, a cancel reason that cannot be stored raise a clear error at that call and fail no
neighbour of its batch; data that JSON gives back equal is stored."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest
import trio
import trio.testing

import ferry
from ferry import flow


def _deep(levels: int) -> dict[str, object]:
    """A dict nested `levels` levels deep in all (itself counted)."""
    value: dict[str, object] = {}
    for _ in range(levels - 1):
        value = {"d": value}
    return value


async def test_a_bad_start_is_refused_at_its_call_and_fails_no_neighbour(tmp_path: Path) -> None:
    """One start with a lone surrogate among 40 concurrent ones: it alone raises ValueError
    (it was ferry.Failed, and so were the others of its batch); nothing is stored for it."""
    plan = flow.Plan("calls", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    refused: list[BaseException] = []
    started: list[str] = []

    async def start(fid: str, data: dict[str, object]) -> None:
        try:
            started.append(await engine.start(plan, flow_id=fid, data=data))
        except (TypeError, ValueError, ferry.Failed) as exc:
            refused.append(exc)

    async with flow.open_engine(str(tmp_path / "flows.db"), plans=[plan]) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(40):
                data: dict[str, object] = {"x": "\udc80"} if i == 20 else {"i": i}
                nursery.start_soon(start, f"f-{i}", data)
        assert len(refused) == 1
        assert isinstance(refused[0], ValueError)
        assert "surrogate" in str(refused[0])
        assert sorted(started) == sorted(f"f-{i}" for i in range(40) if i != 20)
        assert await engine.get("f-20") is None


@pytest.mark.parametrize(
    ("data", "error", "words"),
    [
        (_deep(10_000), ValueError, "deeper than 64"),
        (_deep(65), ValueError, "deeper than 64"),
        ({"x": "y" * 1000}, ValueError, "max_data_bytes=1000"),
        ({"x": {1, 2}}, TypeError, "must be JSON"),
        ({1: "x"}, TypeError, "round trip"),
        ({"x": [[1, (2, 3)]]}, TypeError, "round trip"),  # a tuple deep inside
        ({"x": {"y": {2: "z"}}}, TypeError, "round trip"),  # a non-str key deep inside
        ({"x": "\u00e9" * 600}, ValueError, "1208 bytes"),  # counted in UTF-8 bytes, not chars
    ],
)
async def test_bad_start_data_is_a_clear_error(
    tmp_path: Path, data: dict[str, object], error: type[Exception], words: str
) -> None:
    plan = flow.Plan("calls", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    path = str(tmp_path / "f.db")
    async with flow.open_engine(path, plans=[plan], max_data_bytes=1000) as engine:
        with pytest.raises(error, match=words):
            await engine.start(plan, flow_id="f", data=data)
        assert await engine.get("f") is None
        assert await engine.start(plan, flow_id="ok", data=_deep(64)) == "ok"  # 64 levels in all


async def test_start_data_that_json_gives_back_equal_is_stored(tmp_path: Path) -> None:
    """Subclasses of JSON's types (an IntEnum, a str subclass, a dict subclass) are not JSON's
    own, but survive a round trip equal: stored as plain JSON, as before the check was cheap."""

    class Level(enum.IntEnum):
        HIGH = 3

    class Name(str):
        pass

    class Doc(dict):  # type: ignore[type-arg]
        pass

    plan = flow.Plan("calls", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    data = {"level": Level.HIGH, "name": Name("n"), "doc": Doc(a=[1.5, None, True])}
    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.wait(await engine.start(plan, flow_id="f", data=data))
        snap = await engine.get("f")
        assert snap is not None
        assert snap.data == {"level": 3, "name": "n", "doc": {"a": [1.5, None, True]}}
        assert type(snap.data["level"]) is int and type(snap.data["doc"]) is dict


async def test_bad_wakes_and_publishes_are_refused_at_their_call(tmp_path: Path) -> None:
    plan = flow.Plan("calls", version=1)

    @plan.step
    async def wait_here(ctx: flow.Context) -> flow.Park:
        return flow.park()

    @plan.step
    async def after(ctx: flow.Context) -> None:
        ctx.data["woken"] = ctx.wake

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.start(plan, flow_id="p")
        with pytest.raises(ValueError, match="surrogate"):
            await engine.wake("p", {"x": "\udc80"})
        with pytest.raises(ValueError, match="deeper"):
            await engine.wake("p", _deep(100))
        with pytest.raises(ValueError, match="message_id"):
            await engine.wake("p", None, message_id="evt-\udc80")
        with pytest.raises(ValueError, match="flow_id"):
            await engine.wake("p\x00", None)
        engine.on("bad", lambda event: flow.Start(plan, "s", data={"x": "\udc80"}))
        with pytest.raises(ValueError, match="surrogate"):
            await engine.publish("bad", {})
        assert await engine.get("s") is None
        assert await engine.wake("p", {"ok": 1}) is flow.Delivery.RESUMED
        snap = await engine.wait("p")
        assert snap.state is flow.State.COMPLETED and snap.data == {"woken": {"ok": 1}}


async def test_a_cancel_reason_that_cannot_be_stored_is_refused_at_the_call(
    tmp_path: Path,
) -> None:
    plan = flow.Plan("calls", version=1)

    @plan.step
    async def hold(ctx: flow.Context) -> flow.Park:
        return flow.park()

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[plan]) as engine:
        await engine.start(plan, flow_id="p")
        while (snap := await engine.get("p")) is None or snap.state is not flow.State.PARKED:
            await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ValueError, match="surrogate"):
            await engine.cancel("p", reason="bad \udc80")
        assert (await engine.get("p")).state is flow.State.PARKED  # type: ignore[union-attr]
        assert await engine.cancel("p", reason="customer") is True
