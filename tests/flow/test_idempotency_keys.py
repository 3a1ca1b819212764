"""Idempotency keys never collide: no compensation's key is another flow's step key."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from ferry import flow


async def test_no_compensation_key_is_another_flows_step_key(tmp_path: Path) -> None:
    """Flow `a`, step `1` at index 0, compensated; flow `a/0`, step `compensate` at index 1:
    their keys were both `a/0/1/compensate`."""
    keys: dict[str, tuple[str, str]] = {}

    def record(kind: str) -> Callable[[flow.Context], Awaitable[None]]:
        async def run(ctx: flow.Context) -> None:
            assert keys.setdefault(ctx.idempotency_key, (ctx.flow_id, kind)) == (
                ctx.flow_id,
                kind,
            ), f"{ctx.idempotency_key!r} given twice"

        return run

    first = flow.Plan("first", version=1)
    first.step(name="1", compensate=record("undo 1"))(record("step 1"))

    @first.step
    async def refuse(ctx: flow.Context) -> flow.Fail:
        return flow.fail("no")

    second = flow.Plan("second", version=1)
    second.step(name="x")(record("step x"))
    second.step(name="compensate")(record("step compensate"))

    async with flow.open_engine(str(tmp_path / "f.db"), plans=[first, second]) as engine:
        await engine.start(first, flow_id="a")
        await engine.start(second, flow_id="a/0")
        assert (await engine.wait("a")).state is flow.State.FAILED
        assert (await engine.wait("a/0")).state is flow.State.COMPLETED
    assert keys == {
        "a/0/1": ("a", "step 1"),
        "a/0-compensate/1": ("a", "undo 1"),
        "a/0/0/x": ("a/0", "step x"),
        "a/0/1/compensate": ("a/0", "step compensate"),
    }
