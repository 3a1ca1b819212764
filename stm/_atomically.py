"""Running transactions: `atomically` (trio), `atomically_sync` (threads), `atomically_nowait`,
and what a transaction function can call: `retry`, `check`, `or_else`, `after_commit`.

All three runners share `_txn.attempt` (one synchronous attempt, committed if it wants to) and
differ only in how they wait when an attempt retries:

- `atomically` has the shape of `trio.Lock.acquire`: `checkpoint_if_cancelled()`, attempts run
  synchronously, and either a commit followed by `cancel_shielded_checkpoint()` or a park in
  `wait_task_rescheduled` whose abort_fn unregisters the waiter. Once it has parked it has already
  been a checkpoint, so it returns straight after a later commit (as `Lock.acquire` does). A
  woken task reruns `fn` without another cancel check, unless the abort_fn failed (a cancel came
  after the commit fired the waiter, while the task was still parked): then it raises Cancelled.
  One waiter serves every park of one call.
- `atomically_sync` blocks its thread on a `threading.Lock` that the waking commit releases.
- `atomically_nowait` raises `trio.WouldBlock` instead of waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import CoroutineType
from typing import Any, NoReturn, TypeVar, TypeVarTuple, Unpack, overload

import trio

from . import _txn
from ._errors import RetryWouldHangError
from ._txn import (
    COMMITTED,
    CONFLICT,
    MAX_CONFLICTS,
    RETRY,
    Retry,
    ThreadWaiter,
    TrioWaiter,
    Txn,
    _coroutine_error,
    attempt,
    check_not_nested,
    current,
    register,
    run_effects,
    unregister,
)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

_here = _txn.here
_checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled
_cancel_shielded_checkpoint = trio.lowlevel.cancel_shielded_checkpoint
_wait_task_rescheduled = trio.lowlevel.wait_task_rescheduled

# Whether this thread runs a trio loop: `atomically_sync` asks on every call, `_now` on every
# retry with a deadline. `trio.lowlevel.in_trio_run()` answers it, but costs about 450 ns when
# the answer is no (the common case in `atomically_sync`: its thread-local lookup raises and
# catches an AttributeError); looking the same key up in that thread-local's dict costs about
# 40 ns. tests/stm/test_threads.py checks that the two agree in and out of trio.
try:
    from trio._core._run_context import GLOBAL_RUN_CONTEXT as _trio_run_context
except ImportError:  # pragma: no cover - a trio that moved it: the public, slower check
    _in_trio_run = trio.lowlevel.in_trio_run
else:

    def _in_trio_run() -> bool:
        return "runner" in _trio_run_context.__dict__


_trio_current_time = trio.current_time
_monotonic = time.monotonic


def _hang_error() -> RetryWouldHangError:
    return RetryWouldHangError(
        "the transaction retried without reading any TVar and without a deadline, so no commit "
        "could ever wake it: read the TVars the decision depends on, or pass retry(deadline=...)"
    )


async def atomically(fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
    """Run the synchronous `fn(*args)` as one transaction and return its result.

    Always a checkpoint. If it raises `trio.Cancelled`, nothing was committed; once it has
    committed it returns the result, never `Cancelled`. When `fn` calls `retry`, the task parks
    until a commit writes a TVar that attempt read (or the retry deadline, on `trio.current_time()`,
    passes) and then reruns `fn`; any enclosing cancel scope cancels the wait. `fn` may run more
    than once. Exceptions from `fn` propagate (after a checkpoint) and discard its writes.

    Raises `TypeError` if `fn` is an async function, `RetryWouldHangError` if `fn` retries having
    read nothing and without a deadline, `NestedTransactionError` inside a transaction.
    Cost without contention: one attempt plus, if it wrote, one short lock-held commit.
    """
    await _checkpoint_if_cancelled()
    if _here.txn is not None:
        check_not_nested()
    conflicts = 0
    parked = False  # True once this call has been a checkpoint (it parked)
    waiter: TrioWaiter | None = None  # made at the first park, reused by later ones
    try:
        while True:
            txn = attempt(fn, args, conflicts >= MAX_CONFLICTS)
            status = txn.status
            if status == COMMITTED:
                if txn.effects:
                    run_effects(txn.effects)
                break
            if status == CONFLICT:
                conflicts += 1
                continue
            conflicts = 0
            deadline = txn.deadline
            if deadline is None and not txn.reads:
                raise _hang_error()
            if waiter is None:
                waiter = TrioWaiter()
            parked, was_parked = True, parked
            if not await _park(txn, waiter):  # a read TVar changed: rerun, without a park
                parked = was_parked
                continue
            if waiter.cancel_missed:  # cancelled after the commit fired it: no rerun
                waiter.cancel_missed = False
                await _checkpoint_if_cancelled()
    except BaseException:
        if not parked:
            await _cancel_shielded_checkpoint()
        raise
    if not parked:
        await _cancel_shielded_checkpoint()
    result: T = txn.result
    return result


@trio.lowlevel.enable_ki_protection
async def _park(txn: Txn, waiter: TrioWaiter) -> bool:
    """Register `waiter` on every TVar `txn` read and park until a commit fires it, or until the
    retry deadline; False at once, without parking, if one of those TVars changed meanwhile.

    KeyboardInterrupt-protected, so that no Ctrl-C lands between the registration and the park
    (trio delivers it at the park, whose abort_fn unregisters). Raises what the park raises.
    """
    if not register(txn, waiter):
        return False
    deadline = txn.deadline
    if deadline is None:
        await _wait_task_rescheduled(waiter.abort)
    else:
        with trio.move_on_at(deadline):
            await _wait_task_rescheduled(waiter.abort)
    return True


def atomically_sync(fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
    """Run the synchronous `fn(*args)` as one transaction, blocking this thread while it retries.

    For plain threads and `trio.to_thread` workers. A retry deadline is on `time.monotonic()`.
    Same errors as `atomically`, and `RuntimeError` if this thread runs a trio loop (a task, or a
    callback of the loop): blocking there would stall the loop and could deadlock, so it refuses
    at once, whether or not `fn` would retry (as `trio.from_thread.run` does); use
    `await atomically` or `atomically_nowait` there. `KeyboardInterrupt` while blocked
    unregisters the waiter and propagates.
    """
    if _in_trio_run():
        raise RuntimeError(
            "stm.atomically_sync was called in a thread that runs a trio loop, where blocking "
            "would stall the loop: use `await stm.atomically(...)` in a trio task, or "
            "stm.atomically_nowait(...), or call it from a thread (trio.to_thread.run_sync)"
        )
    check_not_nested()
    conflicts = 0
    while True:
        txn = attempt(fn, args, conflicts >= MAX_CONFLICTS)
        status = txn.status
        if status == COMMITTED:
            if txn.effects:
                run_effects(txn.effects)
            result: T = txn.result
            return result
        if status == CONFLICT:
            conflicts += 1
            continue
        conflicts = 0
        deadline = txn.deadline
        if deadline is None:
            if not txn.reads:
                raise _hang_error()
            timeout = -1.0
        else:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                continue
        waiter = ThreadWaiter()
        try:  # an interrupt anywhere from here on leaves nothing registered
            if not register(txn, waiter):
                continue
            woken = waiter.gate.acquire(timeout=timeout)
        except BaseException:
            unregister(waiter)
            raise
        if not woken:
            unregister(waiter)


def atomically_nowait(fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
    """Run the synchronous `fn(*args)` as one transaction without ever waiting for a retry.

    Commits and returns the result, or raises `trio.WouldBlock` if `fn` retries (nothing is
    committed then). Not a checkpoint; usable in a trio task, a thread, anywhere. It only waits for
    the commit lock, which is held for short commits (or an irrevocable attempt's `fn`). A retry
    deadline is on `trio.current_time()` when called in a thread that runs trio, else on
    `time.monotonic()`. Raises `TypeError` if `fn` is async, `NestedTransactionError` inside a
    transaction.
    """
    if _here.txn is not None:
        check_not_nested()
    txn = attempt(fn, args, False)
    conflicts = 0
    while txn.status != COMMITTED:
        if txn.status == RETRY:
            raise trio.WouldBlock
        conflicts += 1
        txn = attempt(fn, args, conflicts >= MAX_CONFLICTS)
    if txn.effects:
        run_effects(txn.effects)
    result: T = txn.result
    return result


@overload
def retry() -> NoReturn: ...
@overload
def retry(*, deadline: float | None) -> None: ...
def retry(*, deadline: float | None = None) -> None:
    """Abandon this attempt; the transaction blocks, then reruns from the start.

    It reruns once a commit changes a TVar this attempt read, or once `deadline` passes. Once
    `deadline` has passed, `retry` returns normally instead, so the attempt carries on and
    handles its own timeout (as Scala-STM's `retryFor`): a passed deadline never makes the
    transaction rerun in a loop. The deadline is on the runner's clock: `trio.current_time()` in
    a thread running trio (`atomically`, and `atomically_nowait` called there), else
    `time.monotonic()` (`atomically_sync`, and `atomically_nowait` in other threads). Inside
    `or_else`, an alternative that retries gives way to the next one. Raises
    `NoTransactionError` outside a transaction. Not a checkpoint; O(1).
    """
    txn = _here.txn
    if txn is None:
        txn = current("stm.retry()")  # raises NoTransactionError
    if deadline is not None and _now() >= deadline:
        return
    _abandon(txn, deadline)


def check(condition: object, *, deadline: float | None = None) -> None:
    """Return if `condition` is true, else `retry(deadline=deadline)`.

    Once `deadline` has passed with `condition` still false, raises `trio.TooSlowError` (an
    exception from the transaction function: nothing commits, and inside `or_else` the later
    alternatives do not run). Raises `NoTransactionError` outside a transaction. Not a
    checkpoint; O(1).
    """
    if condition:
        return
    txn = _here.txn
    if txn is None:
        txn = current("stm.check()")  # raises NoTransactionError
    if deadline is not None and (now := _now()) >= deadline:
        raise trio.TooSlowError(
            "stm.check: the condition was still false at its deadline, which passed"
            f" {now - deadline:.3f} s ago"
        )
    _abandon(txn, deadline)


def _abandon(txn: Txn, deadline: float | None) -> NoReturn:
    """End the attempt in `retry`, recording `deadline` if it is the earliest so far."""
    if deadline is not None:
        d = txn.deadline
        if d is None or deadline < d:
            txn.deadline = deadline
    txn.doomed = RETRY
    raise Retry


def _now() -> float:
    """The clock retry deadlines are on in this thread: trio's in a thread running trio, else
    `time.monotonic()`. Not a checkpoint; O(1)."""
    if _in_trio_run():
        return _trio_current_time()
    return _monotonic()


def or_else(first: Callable[[], T], second: Callable[[], T], *rest: Callable[[], T]) -> T:
    """Return `first()`; if it retries, discard its writes and effects and try `second()`, etc.

    If every alternative retries, the transaction retries, waiting on every TVar any of them read,
    until the earliest deadline any of them gave. Raises `NoTransactionError` outside one.
    """
    txn = current("stm.or_else()")
    for branch in (first, second, *rest[:-1]) if rest else (first,):
        saved = dict(txn.writes)
        n_effects = len(txn.effects) if txn.effects else 0
        try:
            result = branch()
        except Retry:
            _rollback(txn, saved, n_effects)
            continue
        if txn.doomed == RETRY:  # the branch swallowed its own retry
            _rollback(txn, saved, n_effects)
            continue
        return _not_a_coroutine(result)
    last = rest[-1] if rest else second
    return _not_a_coroutine(last())


def _rollback(txn: Txn, saved: dict[Any, Any], n_effects: int) -> None:
    txn.doomed = None
    txn.writes = saved
    if txn.effects:
        del txn.effects[n_effects:]


def _not_a_coroutine(result: T) -> T:
    if isinstance(result, CoroutineType):
        raise _coroutine_error(result)
    return result


def after_commit(fn: Callable[[Unpack[Ts]], object], *args: *Ts) -> None:
    """Run `fn(*args)` right after this transaction commits, and only if it does.

    Effects run in the order registered, in the committing thread or task, outside the commit
    lock and before `atomically` returns (before its final checkpoint). An attempt that reruns,
    retries, raises, or an `or_else` alternative that retries, drops its effects. If an effect
    raises, later ones are skipped and the exception propagates; the commit stands.
    Raises `NoTransactionError` outside a transaction.
    """
    txn = current("stm.after_commit()")
    if txn.effects is None:
        txn.effects = []
    txn.effects.append((fn, args))
