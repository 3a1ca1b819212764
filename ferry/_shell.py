"""The task code of a ferry: callers, workers, direct calls and close, around its `Room`.

Design
------
All scheduling state is in the room (`ferry._room`): one immutable `Lanes` value in one
`stm.TVar`, changed only by the room's transactions. This module adds what a value cannot hold:
parked tasks, cancel scopes and the calls themselves.

- A caller computes key, rank and weight first (bad values raise at once, nothing admitted), then
  admits itself in one transaction that never blocks (`Room.admit`): the room has no lock and
  admission adds no checkpoint of its own, so the caller parks exactly once, for its answer.
- A caller parks with `wait_task_rescheduled`. Its `_Entry` is the only mutable per-caller object:
  `task` is set while somebody may still answer it, and whoever answers (a worker, close, or the
  caller's own abort) clears it first. Everything runs on the ferry's trio thread, so "clear, then
  act" needs no lock.
- Workers take in one transaction (`Room.take`) and, with nothing ready, sleep on the room's
  doorbell until it rings or the earliest deadline passes (ADR 0006); nothing polls.
- A direct call runs in its caller's task, inside a cancel scope the ferry registers, so closing the
  ferry cancels it like a batch in flight, and cancelling the caller cancels it too. Its key is
  released in a `finally`, only once the call is over (ADR 0004).
- Close (ADR 0005): cancel the workers (each answers the callers it holds with `Closed` and releases
  its lane), cancel direct calls, then one transaction marks the room closed and drains it; drained
  callers get `Closed`. The ferry then waits, shielded, for the last in-flight call to be released,
  so `statistics()` after the `async with` shows an empty, idle room.

A ferry belongs to the trio run that opened it: call it only from tasks of that run.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from types import CoroutineType
from typing import Any, TypeVar

import outcome
import trio

import stm

from . import _lanes
from ._errors import BatchContractError, Closed, Failed, InputError, Rejected, wrong_run
from ._room import Room
from ._schedule_points import reader as _read_schedule_points
from ._stats import FerryStatistics

F = TypeVar("F")

_thread_id = threading.get_ident
_new_object = object.__new__
_reschedule = trio.lowlevel.reschedule
_CLAIMED, _Item = _lanes.Admission.CLAIMED, _lanes.Item
_checkpoint_if_cancelled = trio.lowlevel.checkpoint_if_cancelled
_current_task = trio.lowlevel.current_task
_wait_task_rescheduled = trio.lowlevel.wait_task_rescheduled

# A task's count of schedule points, or None if trio keeps none (`ferry._schedule_points`).
_schedule_points = _read_schedule_points()

# How to call a ferry right from another thread, for the error of a call from outside its run.
_FROM_THREAD = "trio.from_thread.run(f, x, trio_token=token)"


# Ctrl-C: the task code below is KI-protected (a KeyboardInterrupt that arrives while it runs goes
# to the main task at its next checkpoint, as in trio's own code), so that taking a batch and
# owning it, or claiming a key and releasing it, are steps a Ctrl-C cannot split. Only the user's
# call runs unprotected, where Ctrl-C can interrupt it as it would anywhere in user code; it raises
# there, into a `try` that answers the callers and releases the key.
@trio.lowlevel.disable_ki_protection
async def _unprotected(aw: Awaitable[Any]) -> Any:
    return await aw


class _Entry(outcome.Outcome[Any]):
    """One caller. `task` is set while the caller is parked and nobody has answered it yet.

    An entry is also its caller's abort function (`__call__`), so parking allocates nothing more,
    and the common answer: an `outcome.Outcome` of its own whose value is its slot of a batch's
    list of results (`result`), so answering allocates nothing either (ADR 0105). `submit` makes
    it with `object.__new__` and writes its slots (no `__init__` frame per caller).
    """

    __slots__ = ("input", "item", "key", "result", "room", "task")

    input: Any
    key: Any
    room: Room[Any, _Entry]
    item: _lanes.Item[_Entry] | None
    task: trio.lowlevel.Task | None
    result: Any

    def unwrap(self) -> Any:
        """The answer `wait_task_rescheduled` gives the caller when a worker rescheduled it with
        the entry: `result`, or, for an `InputError`, raised to it. Called once; unlike
        `outcome.Value` it does not check that (nothing else holds the entry as an outcome)."""
        result = self.result
        if isinstance(result, InputError):
            self.result = None
            try:
                raise result
            finally:
                # As `outcome.Error.unwrap`: no cycle through this frame and the traceback.
                del result, self
        return result

    def send(self, gen: Any) -> Any:
        """`outcome.Outcome.send`: the answer sent into (or raised in) `gen`."""
        try:
            value = self.unwrap()
        except InputError as exc:
            return gen.throw(exc)
        return gen.send(value)

    async def asend(self, agen: Any) -> Any:
        """`outcome.Outcome.asend`: the answer sent into (or raised in) `agen`."""
        try:
            value = self.unwrap()
        except InputError as exc:
            return await agen.athrow(exc)
        return await agen.asend(value)

    def __call__(self, raise_cancel: Any) -> trio.lowlevel.Abort:
        """The caller was cancelled while parked: it stops waiting, whether its input still
        waits (dropped now, nothing is sent for it) or is in a batch in flight (which runs on
        for the others)."""
        self.task = None
        item = self.item
        if item is not None:
            self.room.cancel(self.key, item)
        return trio.lowlevel.Abort.SUCCEEDED


class Shell:
    """What both ferries share: the room, the workers, answering callers, close."""

    def __init__(
        self,
        call: Callable[..., Any],
        extract: Callable[[Any, Any], Any] | None,
        limits: _lanes.Limits,
        workers: int,
        timeout: float,
        *,
        plain: bool,
    ) -> None:
        """`call(inputs)` for the plain ferry, `call(key, inputs)` for the per-key one; each call
        is cancelled after `timeout` seconds (inf: never)."""
        self.room: Room[Any, _Entry] = Room(limits)
        self._call = call
        self._extract = extract
        self._workers = workers
        self._timeout = timeout
        self._plain = plain
        # The direct calls in flight: their scopes, in start order, with their start times
        # (0.0 without a timeout), and those the timer cancelled for running too long.
        self._direct_scopes: dict[trio.CancelScope, float] = {}
        self._expired: set[trio.CancelScope] = set()
        self._timer = limits.direct_calls and timeout < math.inf
        self._closing = False
        # The thread of the run that opened the ferry: a thread runs one trio run at a time, so
        # while the ferry is open, "same thread" is "same run", and cheaper to check.
        self._thread: int | None = None
        self._timed = limits.max_batch_delay > 0
        # The run's clock (set at open): `clock.current_time()` is `trio.current_time()` without
        # the two calls in between.
        self._clock_now: Callable[[], float] = trio.current_time
        #: the per-key ferry's `(key, weight, rank)` of an input, checked; None for the plain one
        self.classify: Callable[[Any], tuple[Any, float, Any]] | None = None

    def _now(self) -> float:
        # Times matter only for deadlines: with zero delay there are none.
        return self._clock_now() if self._timed else 0.0

    # ---------------------------------------------------------------------------------- callers

    @trio.lowlevel.enable_ki_protection
    async def submit(self, x: Any) -> Any:
        """Admit `x` and wait for its answer (the coroutine the ferry's `__call__` returns).
        Always a checkpoint.

        The per-key ferry's `classify(x)` runs first (its errors raise before anything else);
        then RuntimeError if called outside the run that opened the ferry. A caller that claims
        an idle key makes its direct call here (one coroutine for both paths: ADR 0033).
        """
        classify = self.classify
        if classify is None:
            key, weight, rank = None, 1.0, None  # the plain room: one lane, under key None
        else:
            key, weight, rank = classify(x)
        if _thread_id() != self._thread:
            raise wrong_run("a ferry", "a ferry", _FROM_THREAD)
        await _checkpoint_if_cancelled()
        room = self.room
        # Its slots written here (no __init__ frame): `item` and `task` once admitted, since
        # nothing reads them before (the room hands out only admitted entries).
        entry: _Entry = _new_object(_Entry)
        entry.input = x
        entry.key = key
        entry.room = room
        admission = room.admit(key, entry, weight, rank, self._clock_now() if self._timed else 0.0)
        if type(admission) is _Item:
            entry.item = admission
            entry.task = _current_task()
            return await _wait_task_rescheduled(entry)
        if admission is not _CLAIMED:
            await trio.lowlevel.cancel_shielded_checkpoint()
            if admission is _lanes.Admission.CLOSED:
                raise Closed("the ferry is closed")
            raise Rejected("the waiting room is full; back off and retry, or shed load")

        # The caller claimed an idle key (per-key ferry, zero delay): it sends its input itself,
        # in a cancel scope registered so that close can cancel it, with its start time, so that
        # the timer task can cancel it after `call_timeout` (no deadline per call: ADR 0032).
        # Whether `call` makes a schedule point, trio's own count tells (ADR 0032).
        count = _schedule_points
        task = trio.lowlevel.current_task()
        schedule_points = -1 if count is None else count(task)
        scopes = self._direct_scopes
        scope = trio.CancelScope()
        scopes[scope] = self._clock_now() if self._timer else 0.0
        if self._closing:
            scope.cancel()
        failed = False
        error: BaseException | None = None
        output: Any = None
        try:
            with scope:
                aw = self._call(key, [x])
                if type(aw) is CoroutineType or inspect.isawaitable(aw):
                    output = await _unprotected(aw)
                else:
                    error = BatchContractError(_not_awaitable(aw))
            if scope.cancelled_caught:
                if scope in self._expired:
                    raise _too_slow(self._timeout)
                error = Closed("the ferry closed during this caller's direct call")
        except Exception as exc:
            failed = True
            error = _failed(exc, key, False)
        finally:
            if scopes.pop(scope, None) is None:  # the timer took it out: it expired
                self._expired.discard(scope)
            room.release(key, 0.0, failed)  # zero delay: no deadline to compute
        if error is None:
            if self._extract is None and type(output) is list and len(output) == 1:
                result = output[0]  # the common shape, on a short path
                if isinstance(result, InputError):
                    error = result
            else:
                answer = self._answers(output, [entry])[0]
                if type(answer) is outcome.Error:
                    error = answer.error
                else:
                    result = answer.unwrap()
        # `await f(x)` is always a checkpoint: its cancel point was the one above; its schedule
        # point is the call's own, or, if the call never yielded, this one.
        if count is None or count(task) == schedule_points:
            await trio.lowlevel.cancel_shielded_checkpoint()
        if error is not None:
            raise error
        return result

    @trio.lowlevel.enable_ki_protection
    async def _direct_timer(self) -> None:
        """Cancel each direct call that runs longer than `call_timeout`, oldest first.

        One task for all direct calls, instead of a deadline on each call's scope (which costs
        about 3 us per call). `_direct_scopes` is in start order, so its first entry is the
        next to expire; with none, it looks again after `call_timeout` (a call that starts
        meanwhile expires later than that). Runs in the workers' nursery.
        """
        scopes, expired, timeout = self._direct_scopes, self._expired, self._timeout
        while True:
            now = trio.current_time()
            if not scopes:
                await trio.sleep_until(now + timeout)
                continue
            scope, start = next(iter(scopes.items()))
            if now < start + timeout:
                await trio.sleep_until(start + timeout)
                continue
            expired.add(scope)
            scope.cancel()
            del scopes[scope]  # it is cancelled; the next one is next

    # ---------------------------------------------------------------------------------- workers

    @trio.lowlevel.enable_ki_protection
    async def _worker(self) -> None:
        room, take, now = self.room, self.room.take, self._now
        while True:
            await trio.lowlevel.checkpoint()
            # Taking a batch and owning it are one step: nothing can cancel in between.
            batch = take(now())
            if batch is None:
                # Nothing ready: sleep until the bell rings or the earliest deadline passes.
                # No checkpoint since the failed take, so no ring can have been missed.
                await self._sleep(room.bell.peek(), room.sleep_deadline())
                continue
            # In a call of its own, so that nothing of a batch (its inputs, its results) stays
            # referenced while the worker sleeps.
            await self._send(batch)

    @trio.lowlevel.enable_ki_protection
    async def _send(self, batch: _lanes.Batch[Any, _Entry]) -> None:
        """Call the user's function with the batch and answer its callers."""
        call, plain, timeout = self._call, self._plain, self._timeout
        key = batch.key
        entries = [item.entry for item in batch.items]
        inputs = []
        for e in entries:
            # Taken: a cancelled caller has nothing left to drop from the room. And the entry
            # no longer holds its item, which holds it: without that cycle, what the caller
            # sent is freed when its answer is taken, not by the garbage collector.
            e.item = None
            inputs.append(e.input)
        failed = False
        bad: str | None = None
        results: list[Any] | None = None
        try:
            try:
                aw = call(inputs) if plain else call(key, inputs)
                if type(aw) is not CoroutineType and not inspect.isawaitable(aw):
                    bad = _not_awaitable(aw)
                elif timeout == math.inf:
                    output = await _unprotected(aw)
                else:
                    with trio.CancelScope(deadline=trio.current_time() + timeout) as limit:
                        output = await _unprotected(aw)
                    if limit.cancelled_caught:
                        raise _too_slow(timeout)
            except Exception as exc:
                failed = True
                answers = _failures(exc, key, entries, plain)
            else:
                if bad is not None:
                    answers = _all_errors(entries, bad)
                elif self._extract is None and type(output) is list and len(output) == len(entries):
                    results = output  # the common shape, on a short path below
                else:
                    answers = self._answers(output, entries)
        except BaseException:
            # The ferry is closing (or the process is being interrupted): whoever this batch
            # still holds is told so, and the exception goes on.
            _close_out(entries)
            raise
        finally:
            self.room.release(key, self._now(), failed)
        if results is not None:
            for e, result in zip(entries, results, strict=True):
                task = e.task
                if task is not None:
                    e.task = None
                    e.result = result
                    _reschedule(task, e)  # the entry is the answer: `_Entry.unwrap`
            return
        for e, answer in zip(entries, answers, strict=True):
            task = e.task
            if task is not None:
                e.task = None
                _reschedule(task, answer)

    async def _sleep(self, rung: int, deadline: float | None) -> None:
        """Until the bell rings past `rung`, or `deadline` passes. A checkpoint."""
        if deadline is None:
            await stm.atomically(self.room.sleep, rung)
        else:
            with trio.move_on_at(deadline):
                await stm.atomically(self.room.sleep, rung)

    def _answers(self, output: Any, entries: Sequence[_Entry]) -> list[outcome.Outcome[Any]]:
        """One outcome per entry, from the batch call's `output` (docs/errors-and-lifecycle.md)."""
        extract = self._extract
        if extract is not None:
            answers: list[outcome.Outcome[Any]] = []
            for e in entries:
                try:
                    answers.append(_slot(extract(output, e.input)))
                except Exception as exc:
                    error = BatchContractError(f"extract raised {exc!r} for input {e.input!r}")
                    error.__cause__ = exc
                    answers.append(outcome.Error(error))
            return answers
        if not isinstance(output, Sequence) or isinstance(output, str | bytes):
            what = type(output).__name__
            return _all_errors(
                entries, f"the batch call returned a {what}, not a sequence of results"
            )
        if len(output) != len(entries):
            return _all_errors(
                entries,
                f"the batch call returned {len(output)} results for {len(entries)} inputs",
            )
        return [_slot(r) for r in output]

    # ------------------------------------------------------------------------------------ close

    @asynccontextmanager
    @trio.lowlevel.enable_ki_protection
    async def lifetime(self, ferry: F) -> AsyncIterator[F]:
        """Own the workers for the `async with` block; close as ADR 0005 says when it ends."""
        body_error: BaseException | None = None
        self._thread = _thread_id()
        self._clock_now = trio.lowlevel.current_clock().current_time
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(self._workers):
                    nursery.start_soon(self._worker)
                if self._timer:
                    nursery.start_soon(self._direct_timer)
                try:
                    yield ferry
                except BaseException as exc:
                    # Re-raised below, outside the nursery, so the user's own exception is not
                    # wrapped in an ExceptionGroup.
                    body_error = exc
                finally:
                    # Workers first: each answers the callers it holds and releases its lane.
                    self._closing = True
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as failures:
            # A worker failed (say, a KeyboardInterrupt in a call). If the block raised too,
            # neither may be lost; the block's Cancelled is only the echo of this failure.
            if body_error is None or isinstance(body_error, trio.Cancelled):
                raise
            raise BaseExceptionGroup(
                "the ferry's block raised, and so did its workers while closing",
                [body_error, *failures.exceptions],
            ) from None
        finally:
            self._close_room()
            with trio.CancelScope(shield=True):
                await stm.atomically(self.room.idle)
        if body_error is not None:
            raise body_error

    def _close_room(self) -> None:
        """Mark the room closed and answer every drained caller with `Closed` (one transaction)."""
        self._closing = True
        for scope in self._direct_scopes:
            scope.cancel()
        drained = self.room.drain()
        _close_out([item.entry for item in drained])

    def statistics(self) -> FerryStatistics:
        """A snapshot of the room and the counters since open; one TVar peek, no checkpoint."""
        return self.room.statistics(plain=self._plain)


def _slot(result: Any) -> outcome.Outcome[Any]:
    """A caller's answer from its slot of the output: an `InputError` there is raised to it."""
    if isinstance(result, InputError):
        return outcome.Error(result)
    return outcome.Value(result)


def _failed(exc: Exception, key: Any, plain: bool) -> Failed:
    """The `Failed` for one caller of a call that raised `exc`."""
    error = Failed(f"the batch call {'' if plain else f'for key {key!r} '}raised {exc!r}")
    error.__cause__ = exc
    return error


def _failures(
    exc: Exception, key: Any, entries: Sequence[_Entry], plain: bool
) -> list[outcome.Outcome[Any]]:
    """A `Failed` of its own for each caller of a batch whose call raised `exc`."""
    return [outcome.Error(_failed(exc, key, plain)) for _ in entries]


def _too_slow(timeout: float) -> trio.TooSlowError:
    return trio.TooSlowError(f"the call ran longer than call_timeout={timeout!r} seconds")


def _not_awaitable(result: Any) -> str:
    return (
        f"the batch call returned a {type(result).__name__}, not an awaitable: call must be an "
        "async function (async def), or return an awaitable"
    )


def _all_errors(entries: Sequence[_Entry], message: str) -> list[outcome.Outcome[Any]]:
    return [outcome.Error(BatchContractError(message)) for _ in entries]


def _close_out(entries: Sequence[_Entry]) -> None:
    for e in entries:
        task = e.task
        if task is not None:
            e.task = None
            trio.lowlevel.reschedule(task, outcome.Error(Closed("the ferry closed")))
