"""Closing an engine (its block cancelled) while a write batch is in the store's hands: the batch
is written to its end, so every call in it gets its true answer, and the cancel is absorbed by
whoever cancelled, not turned into errors of every caller (docs/adr/0108)."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from ferry import flow


def quick() -> flow.Plan:
    plan = flow.Plan("quick")

    @plan.step
    async def one(ctx: flow.Context) -> None:
        ctx.data["one"] = True

    return plan


async def test_cancelling_the_block_while_a_batch_is_written_absorbs_the_cancel(
    tmp_path: Path,
) -> None:
    plan = quick()
    path = tmp_path / "flows.db"
    returned: list[str] = []
    cancelled: list[int] = []

    with trio.CancelScope() as scope:
        async with flow.open_engine(path, plans=[plan]) as engine:

            async def start(i: int) -> None:
                try:
                    returned.append(await engine.start(plan, flow_id=f"f{i}"))
                except trio.Cancelled:
                    cancelled.append(i)
                    raise

            async def cancel_while_written() -> None:
                # Every start now waits for the batch the store's thread is writing.
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()

            async with trio.open_nursery() as nursery:
                for i in range(500):
                    nursery.start_soon(start, i)
                nursery.start_soon(cancel_while_written)
    assert scope.cancelled_caught  # no error of any caller came out of the block

    # A start that returned was written; one that raised Cancelled did not happen.
    assert returned, "the batch in flight was not written to its end"
    assert len(returned) + len(cancelled) == 500
    async with flow.open_engine(path, plans=[plan]) as engine:
        for fid in returned:
            assert await engine.get(fid) is not None, fid
        for i in cancelled:
            assert await engine.get(f"f{i}") is None, i
