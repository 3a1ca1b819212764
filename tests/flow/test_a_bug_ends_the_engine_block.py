"""A bug ends the engine's block: a row the engine cannot read ends the `async with` with that
error instead of a runner spinning on it, and the block's own error is kept beside it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import trio
import trio.testing

from ferry import flow


async def test_a_corrupted_row_ends_the_engine_block_instead_of_spinning(tmp_path: Path) -> None:
    """A runner that finds its row moved on re-reads it; a state column that names no state is
    a bug to be seen: the `async with` ends with that error (it was retried for ever)."""
    path = str(tmp_path / "flows.db")
    gate = trio.Event()
    began = trio.Event()
    plan = flow.Plan("corrupt", version=1)

    @plan.step
    async def first(ctx: flow.Context) -> None:
        began.set()
        await gate.wait()

    with trio.fail_after(10), pytest.raises(KeyError, match="BOGUS"):
        async with flow.open_engine(path, plans=[plan]) as engine:
            await engine.start(plan, flow_id="f")
            await began.wait()
            with sqlite3.connect(path) as conn:  # someone writes a state no engine knows
                conn.execute(
                    "UPDATE flow_flows SET state = 'BOGUS', revision = revision + 1"
                    " WHERE flow_id = 'f'"
                )
            gate.set()
            await trio.sleep_forever()


async def test_the_blocks_own_error_is_kept_beside_an_engine_tasks(tmp_path: Path) -> None:
    """A task of the engine fails (the corrupted row above) and the block, cancelled by it,
    raises an error of its own while it unwinds: the block ends with both, neither lost."""
    path = str(tmp_path / "flows.db")
    gate = trio.Event()
    began = trio.Event()
    plan = flow.Plan("corrupt", version=1)

    @plan.step
    async def first(ctx: flow.Context) -> None:
        began.set()
        await gate.wait()

    with trio.fail_after(10), pytest.raises(ExceptionGroup) as caught:
        async with flow.open_engine(path, plans=[plan]) as engine:
            await engine.start(plan, flow_id="f")
            await began.wait()
            with sqlite3.connect(path) as conn:
                conn.execute(
                    "UPDATE flow_flows SET state = 'BOGUS', revision = revision + 1"
                    " WHERE flow_id = 'f'"
                )
            gate.set()
            try:
                await trio.sleep_forever()
            finally:
                raise RuntimeError("the block's own cleanup failed")
    block, task = caught.value.exceptions
    assert isinstance(block, RuntimeError) and "cleanup" in str(block)
    assert isinstance(task, KeyError) and "BOGUS" in str(task)
