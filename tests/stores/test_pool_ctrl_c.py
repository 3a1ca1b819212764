"""Ctrl-C (SIGINT under trio's default handling) at every line of a store's transaction call:
the call raises KeyboardInterrupt, the connection comes back, and trio itself never fails.

A line tracer raises SIGINT when `ConnectionPool.transact` reaches its k-th line, for k = 1, 2,
... until the call ends before the k-th line: every moment at which a real Ctrl-C can land in it.
Before the call was KeyboardInterrupt-protected, a Ctrl-C after the connection was taken left it
taken (the next call and the store's close waited forever), and one between starting the worker
thread and parking made the thread's completion reschedule a task that had not parked: an
AssertionError inside trio's own callback, `trio.TrioInternalError`, the whole run lost.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import trio

from ferry.projected import SqliteStore, Tx
from ferry.projected._pool import ConnectionPool

TRANSACT = ConnectionPool.transact.__code__


def select_one(tx: Tx) -> int:
    n: int = tx.execute("SELECT 1")[0][0]
    return n


def interrupted_at_line(path: Path, k: int) -> str:
    """Run one transaction with a SIGINT at the k-th line `transact` executes; what happened:
    ``"interrupted"`` (KeyboardInterrupt from the call or the checkpoint after it, and the store
    still works and closes), ``"finished"`` (the call returned before its k-th line)."""
    lines = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
            if lines == k:
                signal.raise_signal(signal.SIGINT)
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code is TRANSACT and lines < k else None

    async def main() -> str:
        store = SqliteStore(path, connections=1)
        assert await store.transact(select_one) == 1  # the connection is open
        before = sys.gettrace()
        sys.settrace(calls)
        interrupted = False
        try:
            await store.transact(select_one)
            await trio.lowlevel.checkpoint()  # where a Ctrl-C in its last lines is raised
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(before)
        if lines < k:
            return "finished"
        assert interrupted, f"line {k}: the Ctrl-C was lost"
        with trio.move_on_after(2) as waited:  # its one connection must come back
            assert await store.transact(select_one) == 1
        assert not waited.cancelled_caught, f"line {k}: the connection never came back"
        await store.aclose()
        return "interrupted"

    return trio.run(main)  # a TrioInternalError raises here


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, which trio replaces with its own during a run (a test run
    started in the background may have inherited SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_at_any_line_of_a_transaction(tmp_path: Path, default_sigint: None) -> None:
    seen: list[int] = []
    failed: list[str] = []
    for k in range(1, 100):
        try:
            what = interrupted_at_line(tmp_path / "pool.db", k)
        except (AssertionError, trio.TrioInternalError) as exc:
            failed.append(f"line {k}: {exc!r}")
            continue
        if what == "finished":
            break
        seen.append(k)
    assert not failed, "\n".join(failed)
    assert len(seen) >= 5, f"the tracer reached too few lines of transact: {seen}"
