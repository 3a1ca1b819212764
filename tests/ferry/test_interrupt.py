"""Ctrl-C at every instruction of the ferry's task code: close still finishes, nothing stays busy.

A real SIGINT is raised while one chosen instruction of `ferry/_shell.py` runs (found with an
opcode tracer), and trio's own handler decides what happens: in code that is protected against
KeyboardInterrupt it goes to the main task at its next checkpoint; elsewhere it is raised right
there (the handler runs in the tracer, whose caller is the traced frame). Either way the run must
end with KeyboardInterrupt, not hang, and leave the ferry closed with no call in flight and no
input waiting. The point that matters most: between a worker taking a batch and owning it (the
`try` that answers and releases it), where a KeyboardInterrupt used to leave the lane busy for
ever and the close waiting for it. Before the task code was protected, about one point in five
hung, and others corrupted trio's state.
"""

from __future__ import annotations

import signal
import sys
import types
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import ferry
import ferry._shell
import stm

SHELL = ferry._shell.__file__
# The user's call runs unprotected, as user code does anywhere in trio: a Ctrl-C there raises
# there (and in an awaiting frame it can tear a suspended coroutine from its cancel scope, which
# no library can prevent). `_unprotected` is the first frame of that code, so it is left out.
USER_CODE = ferry._shell._unprotected.__code__


@attrs.define
class Injector:
    """Raises SIGINT at the `at`-th opcode run in `ferry/_shell.py` (never, if None)."""

    at: int | None
    count: int = 0
    fired: bool = False

    def start(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if self.fired or frame.f_code.co_filename != SHELL or frame.f_code is USER_CODE:
            return None
        frame.f_trace_opcodes = True
        return self.step

    def step(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if self.fired:
            return None
        if event == "opcode":
            self.count += 1
            if self.count == self.at:
                self.fired = True
                signal.raise_signal(signal.SIGINT)
        return self.step


@attrs.define
class Run:
    f: ferry.PerKeyFerry[tuple[str, int], Any] | None = None
    outcomes: dict[tuple[str, int], str] = attrs.Factory(dict)
    hung: bool = False


async def _scenario(injector: Injector, run: Run) -> None:
    async def call(key: str, xs: list[tuple[str, int]]) -> list[tuple[str, int]]:
        await trio.sleep(1.0)
        return xs

    async def one(f: ferry.PerKeyFerry[tuple[str, int], Any], x: tuple[str, int]) -> None:
        try:
            await f(x)
            run.outcomes[x] = "result"
        except ferry.Closed:
            run.outcomes[x] = "closed"

    async def watchdog() -> None:
        await trio.sleep(500)  # everything else ends within seconds (MockClock)
        run.hung = True
        assert run.f is not None
        room = run.f._shell.room  # let the stuck close finish, so that the test can report
        for key, lane in list(room.state.peek().lanes.items()):
            for _ in range(lane.calls):
                stm.atomically_nowait(room.release, key, 0.0, False)

    async with trio.open_nursery() as outer:
        outer.start_soon(watchdog)
        sys.settrace(injector.start)
        try:
            async with ferry.open_per_key_ferry(
                call, key=lambda x: x[0], max_batch_size=2, max_in_flight_batches=1
            ) as f:
                run.f = f
                async with trio.open_nursery() as callers:
                    for x in (("a", 1), ("a", 2), ("a", 3)):
                        callers.start_soon(one, f, x)
                        await trio.testing.wait_all_tasks_blocked()
        finally:
            sys.settrace(None)
            outer.cancel_scope.cancel()


def _interrupted(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_interrupted(e) or isinstance(e, trio.Cancelled) for e in exc.exceptions)
    return False


def _run(at: int | None) -> tuple[Injector, Run, BaseException | None]:
    injector, run = Injector(at), Run()
    clock = trio.testing.MockClock(autojump_threshold=0)
    # The same schedule on every run, so that the n-th instruction is the same point each time.
    # (trio shuffles its run queue with this Random; hypothesis seeds it the same way.)
    trio._core._run._r.seed(8)
    try:
        trio.run(_scenario, injector, run, clock=clock)
    except BaseException as exc:
        return injector, run, exc
    finally:
        sys.settrace(None)
    return injector, run, None


def _sweep(step: int) -> None:
    """A Ctrl-C at every `step`-th instruction of the task code, one run each."""
    injector, run, error = _run(None)
    assert error is None and not run.hung
    assert sorted(run.outcomes.values()) == ["result"] * 3
    points = injector.count
    assert points > 500  # the tracer sees the shell's code
    failures = []
    for at in range(1, points + 1, step):
        waiters = stm.statistics().waiters
        injector, run, error = _run(at)
        assert injector.fired
        problems = []
        if run.hung:
            problems.append("close hung")
        if error is None or not _interrupted(error):
            problems.append(f"ended with {error!r}, not KeyboardInterrupt")
        s = None if run.f is None else run.f.statistics()  # None: interrupted while opening
        if s is not None and (s.busy, s.lanes, s.queued) != (0, 0, 0):
            problems.append(f"left busy={s.busy} lanes={s.lanes} queued={s.queued}")
        if stm.statistics().waiters != waiters:
            problems.append("a waiter is left registered")
        if problems:
            failures.append((at, problems))
    assert not failures, f"{len(failures)} of {points} points: {failures[:5]}"


def test_ctrl_c_at_every_third_instruction_of_the_task_code_leaves_nothing_busy() -> None:
    _sweep(3)


@pytest.mark.slow
def test_ctrl_c_at_every_instruction_of_the_task_code_leaves_nothing_busy() -> None:
    _sweep(1)
