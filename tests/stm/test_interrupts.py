"""Ctrl-C during a commit, at every bytecode of it: all or nothing.

Each run commits one transfer between two TVars under `trio.run` and raises SIGINT at one chosen
bytecode of stm's own code (`sys.settrace` with opcode events). `signal.raise_signal` runs trio's
SIGINT handler at once, in the traced frame, so the interrupt behaves as a real Ctrl-C landing
there: trio raises `KeyboardInterrupt` on the spot in unprotected code and delivers it at the next
checkpoint in KeyboardInterrupt-protected code. The test walks the chosen bytecode over every
point of the transaction, from `atomically` being called to it returning, and checks after each
run that:

- the transfer is all or nothing: both TVars old, or both new;
- the clock covers every installed version, so readers see the state without conflicting;
- the commit lock is free, and every waiter the commit fired was woken (none left registered);
- the Ctrl-C was not lost: `trio.run` raised `KeyboardInterrupt`.

It runs on both commit paths: the ordinary validated commit and the irrevocable one (forced by
setting the conflict budget to 0). Without one KeyboardInterrupt-protected install, the
irrevocable path left half-written transfers whose readers conflicted on every attempt.
"""

from __future__ import annotations

import dis
import signal
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import trio

import stm
from stm import TVar, _atomically, _txn

_STM_FILES = frozenset({_txn.__file__, _atomically.__file__})


# Where CPython 3.11 runs pending signal handlers (its "eval breaker" checks): at the start of a
# function (RESUME with oparg 0 or 1), on backward jumps, and as a call returns. A Ctrl-C can
# land only there, so that is where the tracer raises it: an instruction that follows a call, a
# backward jump, or a RESUME. Elsewhere (say, inside a `finally` block before it has run a call)
# no real interrupt can appear, and no code could defend against one.
_CALLS = frozenset({"CALL", "CALL_FUNCTION_EX"})
_CHECKS = frozenset(
    {
        "JUMP_BACKWARD",
        "POP_JUMP_BACKWARD_IF_FALSE",
        "POP_JUMP_BACKWARD_IF_TRUE",
        "POP_JUMP_BACKWARD_IF_NONE",
        "POP_JUMP_BACKWARD_IF_NOT_NONE",
    }
)


class _Interrupter:
    """A tracer that raises SIGINT at the `at`-th point of stm's own code where CPython could
    run a signal handler (or only counts the points, when `at` is None)."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.seen = 0
        self.fired = False
        self.previous: dict[types.FrameType, str] = {}

    def trace_calls(self, frame: types.FrameType, event: str, arg: object) -> Any:
        if frame.f_code.co_filename in _STM_FILES:
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return self.trace_opcodes
        return None

    def trace_opcodes(self, frame: types.FrameType, event: str, arg: object) -> Any:
        if event != "opcode":
            return self.trace_opcodes
        code, i = frame.f_code.co_code, frame.f_lasti
        op = dis.opname[code[i]]
        checks = (
            op in _CHECKS
            or (op == "RESUME" and code[i + 1] < 2)
            or self.previous.get(frame) in _CALLS
        )
        self.previous[frame] = op
        if checks:
            if self.seen == self.at:
                self.fired = True
                signal.raise_signal(signal.SIGINT)  # trio's handler runs here, in `frame`
            self.seen += 1
        return self.trace_opcodes


class _Recorder(_txn.Waiter):
    """A waiter that only records its wake-up."""

    __slots__ = ("woken",)

    def __init__(self) -> None:
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1


def _wait_on(*tvars: TVar[Any]) -> _Recorder:
    probe = _txn.Txn(_txn._clock)
    probe.reads = {tv: tv._state for tv in tvars}
    waiter = _Recorder()
    assert _txn.register(probe, waiter)
    return waiter


def _run_once(at: int | None, scenario: str) -> tuple[_Interrupter, bool]:
    """Transfer 10 from `a` to `b` with a Ctrl-C at point `at`; check what it left.

    `scenario` "commit": the transfer commits at once. "park": it first waits (retry) for a gate
    that a callback of the loop opens once the task has parked, then commits.
    """
    baseline = stm.statistics().waiters
    a, b, gate = TVar(100), TVar(0), TVar(0)
    on_a, on_both = _wait_on(a), _wait_on(a, b)

    def transfer() -> None:
        stm.check(scenario == "commit" or gate.get())
        a.set(a.get() - 10)
        b.set(b.get() + 10)

    interrupter = _Interrupter(at)

    async def main() -> None:
        if scenario == "park":
            trio.lowlevel.current_trio_token().run_sync_soon(stm.atomically_nowait, gate.set, 1)
        previous = sys.gettrace()
        sys.settrace(interrupter.trace_calls)
        try:
            await stm.atomically(transfer)
        finally:
            sys.settrace(previous)

    interrupted = False
    try:
        trio.run(main)
    except KeyboardInterrupt:
        interrupted = True
    values = (a.peek(), b.peek())
    where = f"{scenario}: Ctrl-C at point {at}"

    assert interrupted == interrupter.fired, f"{where}: the interrupt was lost"
    assert values in {(100, 0), (90, 10)}, f"{where}: half a transfer is visible: {values}"
    assert not _txn._lock.locked(), f"{where}: the commit lock is still held"
    assert _txn.here.txn is None, f"{where}: the thread is still inside a transaction"
    for tv in (a, b, gate):
        assert tv._state[0] <= _txn._clock, f"{where}: a version is ahead of the clock"
    before = stm.statistics()
    assert stm.atomically_nowait(lambda: (a.get(), b.get())) == values
    after = stm.statistics()
    assert after.conflicts == before.conflicts, f"{where}: a reader conflicted"
    assert after.irrevocable_runs == before.irrevocable_runs
    committed = values == (90, 10)
    _check_waiters(where, committed, (on_a, on_both), baseline)
    return interrupter, committed


def _check_waiters(where: str, committed: bool, waiters: tuple[Any, ...], baseline: int) -> None:
    """A commit woke each waiter once; without it none fired, and each is still registered
    (unregistered here); either way no registration is left behind."""
    for waiter in waiters:
        if committed:
            assert waiter.fired and waiter.woken == 1, f"{where}: a fired waiter was not woken"
        else:
            assert not waiter.fired and waiter.woken == 0
            assert _txn.unregister(waiter)
    left = stm.statistics().waiters - baseline
    assert left == 0, f"{where}: {left} waiter registrations left behind"


@pytest.fixture
def trio_owns_sigint() -> Iterator[None]:
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.fail("SIGINT has a handler already: trio would not install its own")
    yield
    # After a failure, free what a torn run left, so that the next test starts clean.
    _txn.here.txn = None
    if _txn._lock.locked():
        _txn._lock.release()


# A Ctrl-C between making a coroutine (say, a checkpoint's) and awaiting it leaves it never
# awaited: Python warns, as it would for a real Ctrl-C there.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("scenario", ["commit", "park"])
@pytest.mark.parametrize("path", ["validated", "irrevocable"])
def test_ctrl_c_at_every_point_of_a_transaction_is_all_or_nothing(
    path: str, scenario: str, trio_owns_sigint: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "irrevocable":
        monkeypatch.setattr(_atomically, "MAX_CONFLICTS", 0)
    counted, committed = _run_once(None, scenario)
    assert committed and counted.seen > 20
    outcomes = set()
    for at in range(counted.seen):
        _, committed = _run_once(at, scenario)
        outcomes.add(committed)
    assert outcomes == {True, False}  # interrupts landed both before and after the commit


# ---- the single-TVar transaction (`_txn.update`, ADR 0033) ---------------------------------------


def _update_once(at: int | None) -> tuple[_Interrupter, bool]:
    """`_txn.update` of a pair held in one TVar that also rings its bell, with a Ctrl-C at point
    `at`; check that the pair and the bell changed together or not at all, and the rest."""
    baseline = stm.statistics().waiters
    pair, bell = TVar((100, 0)), TVar(0)
    on_pair, on_both = _wait_on(pair), _wait_on(pair, bell)

    def transfer(old: tuple[int, int], _: None) -> tuple[tuple[int, int], str, bool]:
        return (old[0] - 10, old[1] + 10), "done", True

    interrupter = _Interrupter(at)

    async def main() -> None:
        previous = sys.gettrace()
        sys.settrace(interrupter.trace_calls)
        try:
            assert _txn.update(pair, bell, transfer, None) == "done"
        finally:
            sys.settrace(previous)
        await trio.lowlevel.checkpoint()  # where a protected stretch's Ctrl-C is delivered

    interrupted = False
    try:
        trio.run(main)
    except KeyboardInterrupt:
        interrupted = True
    where = f"update: Ctrl-C at point {at}"
    assert interrupted == interrupter.fired, f"{where}: the interrupt was lost"
    state = (pair.peek(), bell.peek())
    assert state in {((100, 0), 0), ((90, 10), 1)}, f"{where}: half a commit is visible: {state}"
    assert not _txn._lock.locked(), f"{where}: the commit lock is still held"
    for tv in (pair, bell):
        assert tv._state[0] <= _txn._clock, f"{where}: a version is ahead of the clock"
    committed = state[1] == 1
    _check_waiters(where, committed, (on_pair, on_both), baseline)
    return interrupter, committed


@pytest.mark.parametrize("path", ["validated", "irrevocable"])
def test_ctrl_c_at_every_point_of_a_single_tvar_update_is_all_or_nothing(
    path: str, trio_owns_sigint: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "irrevocable":
        monkeypatch.setattr(_txn, "MAX_CONFLICTS", 0)
    counted, committed = _update_once(None)
    assert committed and counted.seen > 5
    for at in range(counted.seen):
        _, committed = _update_once(at)
        # `update` is KeyboardInterrupt-protected from its first instruction: every Ctrl-C
        # that lands in it is delivered afterwards, and the commit is whole.
        assert committed


# ---- a Ctrl-C in the transaction function itself ----------------------------------------------


def test_ctrl_c_while_a_retry_unwinds_is_not_lost(trio_owns_sigint: None) -> None:
    """A Ctrl-C that lands in `fn` after it called `retry` (here: in a `finally` block that the
    retry's unwinding runs) ends `atomically` with KeyboardInterrupt. It was once taken for a
    conflict (the attempt was already doomed to retry), the attempt reran, and the Ctrl-C was
    lost: the program went on as if no one had pressed it."""
    ready = TVar(False)
    interrupts = 0

    def wait_until_ready() -> str:
        nonlocal interrupts
        try:
            if not ready.get():
                stm.retry()
            return "ready"
        finally:
            if interrupts == 0:
                interrupts += 1
                signal.raise_signal(signal.SIGINT)  # trio's handler raises it here, in fn

    async def main() -> str:
        async def set_ready() -> None:
            await trio.testing.wait_all_tasks_blocked()
            await stm.atomically(ready.set, True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(set_ready)
            return await stm.atomically(wait_until_ready)

    def only_ctrl_c(error: BaseException) -> bool:
        if isinstance(error, BaseExceptionGroup):
            return all(only_ctrl_c(e) for e in error.exceptions)
        return isinstance(error, KeyboardInterrupt)

    with pytest.raises(BaseException) as raised:
        trio.run(main)  # (before the fix: returned "ready", the Ctrl-C lost)
    assert interrupts == 1
    assert only_ctrl_c(raised.value), raised.value
