"""The trio shell of ferry: callers, workers, direct calls and close, around the pure `Lanes` core.

Design
------
All scheduling state is one immutable `Lanes` value in one `stm.TVar`. Every decision is one pure
transition from `ferry._lanes`, applied in exactly one transaction on that TVar; the shell adds only
what a pure value cannot hold: parked tasks, cancel scopes and the calls themselves.

- A caller computes key, rank and weight first (bad values raise at once, nothing admitted), then
  admits itself with `stm.atomically_nowait`: the room has no lock and admission adds no
  checkpoint of its own, so the caller parks exactly once, for its answer.
- A caller parks with `wait_task_rescheduled`. Its `_Entry` is the only mutable per-caller object:
  `task` is set while somebody may still answer it, and whoever answers (a worker, close, or the
  caller's own abort) clears it first. Everything runs on the ferry's trio thread, so "clear, then
  act" needs no lock.
- Workers take with `stm.atomically_nowait` and, with nothing ready, sleep in
  `stm.retry(deadline=earliest waiting deadline)` on a doorbell TVar that the room's transitions
  ring when they make work for them (ADR 0006); nothing polls.
- A direct call runs in its caller's task, inside a cancel scope the ferry registers, so closing the
  ferry cancels it like a batch in flight, and cancelling the caller cancels it too. Its key is
  released in a `finally`, only once the call is over (ADR 0004).
- Close (ADR 0005): cancel the workers (each answers the callers it holds with `Closed` and releases
  its lane), cancel direct calls, then one transaction marks the room closed and drains it; drained
  callers get `Closed`. The ferry then waits, shielded, for the last in-flight call to be released,
  so `stats()` after the `async with` shows an empty, idle room.

A ferry belongs to the trio run that opened it: call it only from tasks of that run.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Generic, TypeVar, final, overload

import outcome
import trio

import stm

from . import _lanes
from ._errors import BatchContractError, Closed, Failed, InputError, Rejected
from ._stats import FerryStatistics

I = TypeVar("I")  # noqa: E741  (input)
O = TypeVar("O")  # noqa: E741  (output of the batch call)
R = TypeVar("R")  # result of one caller
K = TypeVar("K")
F = TypeVar("F")

_PLAIN_KEY = None  # the plain ferry's one room is a single lane under this key


class _Entry:
    """One caller. `task` is set while the caller is parked and nobody has answered it yet.

    An entry is also its caller's abort function (`__call__`), so parking allocates nothing more.
    """

    __slots__ = ("input", "item", "key", "shell", "task")

    def __init__(self, x: Any, key: Any, shell: _Shell) -> None:
        self.input = x
        self.key = key
        self.shell = shell
        self.item: _lanes.Item[_Entry] | None = None
        self.task: trio.lowlevel.Task | None = None

    def __call__(self, raise_cancel: Any) -> trio.lowlevel.Abort:
        """The caller was cancelled while parked: it stops waiting, whether its input still
        waits (dropped now, nothing is sent for it) or is in a batch in flight (which runs on
        for the others)."""
        self.task = None
        item = self.item
        if item is not None:
            stm.atomically_nowait(self.shell._cancel_txn, self.key, item)
        return trio.lowlevel.Abort.SUCCEEDED


class _Shell:
    """What both ferries share: the room, the workers, answering callers, close."""

    def __init__(
        self,
        send: Callable[[Any, list[Any]], Awaitable[Any]],
        extract: Callable[[Any, Any], Any] | None,
        limits: _lanes.Limits,
        workers: int,
        *,
        plain: bool,
    ) -> None:
        self._send = send
        self._extract = extract
        self._workers = workers
        self._plain = plain
        self._room: stm.TVar[_lanes.Lanes[Any, _Entry]] = stm.TVar(_lanes.empty(limits))
        # Not state: a doorbell the room's transitions ring when a sleeping worker may find work.
        # Workers sleep on it alone, so admissions that change nothing for them wake nobody.
        self._bell = stm.TVar(0)
        self._direct_scopes: set[trio.CancelScope] = set()
        self._closing = False
        self._timed = limits.max_batch_delay > 0

    # ----------------------------------------------------------------------------- transactions

    def _admit_txn(
        self, key: Any, entry: _Entry, weight: float, rank: Any, now: float
    ) -> tuple[_lanes.Admission, _lanes.Item[_Entry] | None]:
        room = self._room
        old = room.get()
        try:
            state, admission, item = _lanes.admit(
                old, key, entry, weight=weight, rank=rank, now=now
            )
        except TypeError as exc:
            if rank is None:
                raise
            raise TypeError(
                f"rank(x) returned {rank!r}, which does not compare with the ranks already "
                f"waiting for key {key!r}: {exc}"
            ) from exc
        room.set(state)
        if state.n_ready > old.n_ready or state.n_waiting > old.n_waiting:
            self._ring(old, state)
        return admission, item

    def _take_txn(self) -> _lanes.Batch[Any, _Entry]:
        room = self._room
        state, batch = _lanes.take(room.get(), trio.current_time())
        if batch is None:
            stm.retry()
        room.set(state)
        if state.n_ready:  # more work than this worker: wake the others
            self._bell.set(self._bell.get() + 1)
        return batch

    def _sleep_txn(self, rung: int, deadline: float | None) -> None:
        if self._bell.get() == rung and (deadline is None or trio.current_time() < deadline):
            stm.retry(deadline=deadline)

    def _release_txn(self, key: Any, failed: bool) -> None:
        room = self._room
        old = room.get()
        state = _lanes.release(old, key, trio.current_time(), failed=failed)
        room.set(state)
        if state.n_ready > old.n_ready or state.n_waiting > old.n_waiting:
            self._ring(old, state)

    def _ring(self, old: _lanes.Lanes[Any, _Entry], new: _lanes.Lanes[Any, _Entry]) -> None:
        """Wake sleeping workers if a lane became ready or the earliest deadline moved up."""
        if new.n_ready > old.n_ready or _lanes.next_deadline(new) != _lanes.next_deadline(old):
            self._bell.set(self._bell.get() + 1)

    def _cancel_txn(self, key: Any, item: _lanes.Item[_Entry]) -> bool:
        room = self._room
        state, dropped = _lanes.cancel(room.get(), key, item)
        if dropped:
            room.set(state)
        return dropped

    def _drain_txn(self) -> list[_lanes.Item[_Entry]]:
        room = self._room
        state, drained = _lanes.drain(room.get())
        room.set(state)
        return drained

    def _idle_txn(self) -> None:
        stm.check(self._room.get().busy == 0)

    # ---------------------------------------------------------------------------------- callers

    async def _submit(self, x: Any, key: Any, weight: float, rank: Any) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        entry = _Entry(x, key, self)
        # Submission times matter only for deadlines: with zero delay there are none.
        now = trio.current_time() if self._timed else 0.0
        admission, entry.item = stm.atomically_nowait(
            self._admit_txn, key, entry, weight, rank, now
        )
        if admission is _lanes.Admission.ADMITTED:
            entry.task = trio.lowlevel.current_task()
            return await trio.lowlevel.wait_task_rescheduled(entry)
        if admission is _lanes.Admission.CLAIMED:
            return await self._direct(entry)
        await trio.lowlevel.cancel_shielded_checkpoint()
        if admission is _lanes.Admission.CLOSED:
            raise Closed("the ferry is closed")
        raise Rejected("the waiting room is full; back off and retry, or shed load")

    async def _direct(self, entry: _Entry) -> Any:
        """The caller claimed an idle key: send its input itself, in the ferry's scope."""
        key = entry.key
        scope = trio.CancelScope()
        self._direct_scopes.add(scope)
        if self._closing:
            scope.cancel()
        failed = False
        answer: outcome.Outcome[Any] | None = None
        try:
            with scope:
                output = await self._send(key, [entry.input])
        except Exception as exc:
            failed = True
            answer = _failures(exc, key, [entry])[0]
        finally:
            self._direct_scopes.discard(scope)
            stm.atomically_nowait(self._release_txn, key, failed)
        if answer is None:
            if scope.cancelled_caught:
                answer = outcome.Error(Closed("the ferry closed during this caller's direct call"))
            elif self._extract is None and type(output) is list and len(output) == 1:
                answer = _slot(output[0])  # the common shape, on a short path
            else:
                answer = self._answers(output, [entry])[0]
        # A schedule point even if `call` never yielded: `await f(x)` is always a checkpoint.
        await trio.lowlevel.cancel_shielded_checkpoint()
        return answer.unwrap()

    # ---------------------------------------------------------------------------------- workers

    async def _worker(self) -> None:
        room, bell, take, release = self._room, self._bell, self._take_txn, self._release_txn
        while True:
            await trio.lowlevel.checkpoint()
            try:
                # Taking a batch and owning it are one step: nothing can cancel in between.
                batch = stm.atomically_nowait(take)
            except trio.WouldBlock:
                # Nothing ready: sleep until the bell rings or the earliest deadline passes.
                # No checkpoint since the failed take, so no ring can have been missed.
                rung, deadline = bell.peek(), _lanes.next_deadline(room.peek())
                await stm.atomically(self._sleep_txn, rung, deadline)
                continue
            key = batch.key
            entries = [item.entry for item in batch.items]
            failed = False
            try:
                try:
                    output = await self._send(key, [e.input for e in entries])
                except Exception as exc:
                    failed = True
                    answers = _failures(exc, key, entries)
                else:
                    answers = self._answers(output, entries)
            except BaseException:
                # The ferry is closing (or the process is being interrupted): whoever this batch
                # still holds is told so, and the exception goes on.
                _close_out(entries)
                raise
            finally:
                stm.atomically_nowait(release, key, failed)
            for e, answer in zip(entries, answers, strict=True):
                task = e.task
                if task is not None:
                    e.task = None
                    trio.lowlevel.reschedule(task, answer)

    def _answers(self, output: Any, entries: Sequence[_Entry]) -> list[outcome.Outcome[Any]]:
        """One outcome per entry, from the batch call's `output` (SPEC 2.6)."""
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

    def _close_room(self) -> None:
        """Mark the room closed and answer every drained caller with `Closed` (one transaction)."""
        self._closing = True
        for scope in self._direct_scopes:
            scope.cancel()
        drained = stm.atomically_nowait(self._drain_txn)
        _close_out([item.entry for item in drained])

    def stats(self) -> FerryStatistics:
        """A snapshot of the room and the counters since open; one TVar peek, no checkpoint."""
        state = self._room.peek()
        plain = self._plain
        return FerryStatistics(
            queued=state.queued,
            queued_weight=0.0 if plain else state.weight,
            busy=state.busy,
            lanes=0 if plain else len(state.lanes),
            ready=0 if plain else state.n_ready,
            waiting=0 if plain else state.n_waiting,
            submitted=state.submitted,
            admitted=state.admitted,
            rejected=state.rejected,
            direct_calls=state.direct_calls,
            batches=state.batches,
            inputs_sent=state.inputs_sent,
            failed_batches=state.failed_batches,
            dropped=state.dropped,
            batch_sizes=dict(state.batch_sizes),
        )


def _slot(result: Any) -> outcome.Outcome[Any]:
    """A caller's answer from its slot of the output: an `InputError` there is raised to it."""
    if isinstance(result, InputError):
        return outcome.Error(result)
    return outcome.Value(result)


def _failures(exc: Exception, key: Any, entries: Sequence[_Entry]) -> list[outcome.Outcome[Any]]:
    """A `Failed` of its own for each caller of a batch whose call raised `exc`."""
    answers: list[outcome.Outcome[Any]] = []
    for _ in entries:
        error = Failed(f"the batch call for key {key!r} raised {exc!r}")
        error.__cause__ = exc
        answers.append(outcome.Error(error))
    return answers


def _all_errors(entries: Sequence[_Entry], message: str) -> list[outcome.Outcome[Any]]:
    return [outcome.Error(BatchContractError(message)) for _ in entries]


def _close_out(entries: Sequence[_Entry]) -> None:
    for e in entries:
        task = e.task
        if task is not None:
            e.task = None
            trio.lowlevel.reschedule(task, outcome.Error(Closed("the ferry closed")))


@asynccontextmanager
async def _lifetime(shell: _Shell, ferry: F) -> AsyncIterator[F]:
    """Own the workers for the `async with` block; close as SPEC 2.7 says when it ends."""
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            for _ in range(shell._workers):
                nursery.start_soon(shell._worker)
            try:
                yield ferry
            except BaseException as exc:
                # Re-raised below, outside the nursery, so the user's own exception is not
                # wrapped in an ExceptionGroup.
                body_error = exc
            finally:
                # Workers first: each answers the callers it holds and releases its lane.
                shell._closing = True
                nursery.cancel_scope.cancel()
    finally:
        shell._close_room()
        with trio.CancelScope(shield=True):
            await stm.atomically(shell._idle_txn)
    if body_error is not None:
        raise body_error


# ---------------------------------------------------------------------------- option checking


def _check_int(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value!r}")
    return value


def _check_real(name: str, value: object, *, positive: bool, finite: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or v < 0 or (positive and v == 0) or (finite and math.isinf(v)):
        need = "> 0" if positive else ">= 0"
        kind = "finite number" if finite else "number"
        raise ValueError(f"{name} must be a {kind} {need}, got {value!r}")
    return v


def _check_callable(name: str, value: object) -> None:
    if not callable(value):
        raise ValueError(f"{name} must be callable, got {value!r}")


# ------------------------------------------------------------------------------- the plain ferry


@final
class Ferry(Generic[I, R]):
    """A plain ferry: `await f(x)` from many tasks becomes a few `call(inputs)` calls.

    Made by `open_ferry`; has no public constructor.
    """

    __slots__ = ("_shell",)

    def __init__(self, shell: _Shell) -> None:
        self._shell = shell

    async def __call__(self, x: I, /) -> R:
        """Submit `x` and wait for its result. Always a checkpoint.

        Raises `Rejected` (room full), `Failed` (the batch call raised), `BatchContractError`
        (malformed output), `Closed` (the ferry closed), or `trio.Cancelled` (the caller's scope).
        """
        result: R = await self._shell._submit(x, _PLAIN_KEY, 1.0, None)
        return result

    def stats(self) -> FerryStatistics:
        """A snapshot of the waiting room and the counters; one TVar peek, no checkpoint."""
        return self._shell.stats()

    def __repr__(self) -> str:
        s = self._shell.stats()
        return f"<ferry.Ferry queued={s.queued} busy={s.busy} batches={s.batches}>"


@overload
def open_ferry(
    call: Callable[[list[I]], Awaitable[Sequence[R]]],
    *,
    max_batch_size: int = ...,
    max_batch_delay: float = ...,
    max_in_flight_batches: int = ...,
    max_queueing: int = ...,
    extract: None = None,
) -> AbstractAsyncContextManager[Ferry[I, R]]: ...


@overload
def open_ferry(
    call: Callable[[list[I]], Awaitable[O]],
    *,
    max_batch_size: int = ...,
    max_batch_delay: float = ...,
    max_in_flight_batches: int = ...,
    max_queueing: int = ...,
    extract: Callable[[O, I], R],
) -> AbstractAsyncContextManager[Ferry[I, R]]: ...


def open_ferry(
    call: Callable[[list[Any]], Awaitable[Any]],
    *,
    max_batch_size: int = 100,
    max_batch_delay: float = 0.0,
    max_in_flight_batches: int = 4,
    max_queueing: int = 10_000,
    extract: Callable[[Any, Any], Any] | None = None,
) -> AbstractAsyncContextManager[Ferry[Any, Any]]:
    """Open a plain ferry over `call(inputs) -> outputs` for the duration of an `async with`.

    Options are checked here (`ValueError` naming the option). Leaving the block closes the
    ferry: callers still waiting get `Closed`, workers are cancelled, nothing outlives the block.
    """
    _check_callable("call", call)
    if extract is not None:
        _check_callable("extract", extract)
    limits = _lanes.Limits(
        max_batch_size=_check_int("max_batch_size", max_batch_size, 1),
        max_batch_delay=_check_real(
            "max_batch_delay", max_batch_delay, positive=False, finite=True
        ),
        max_queueing=_check_int("max_queueing", max_queueing, 0),
        direct_calls=False,
        one_in_flight=False,
    )
    workers = _check_int("max_in_flight_batches", max_in_flight_batches, 1)

    async def send(key: Any, inputs: list[Any]) -> Any:
        return await call(inputs)

    shell = _Shell(send, extract, limits, workers, plain=True)
    return _lifetime(shell, Ferry(shell))


# ----------------------------------------------------------------------------- the per-key ferry


@final
class PerKeyFerry(Generic[I, R]):
    """A per-key ferry: one call in flight per key, batches taken fairly across keys.

    Made by `open_per_key_ferry`; has no public constructor.
    """

    __slots__ = ("_key", "_max_weight", "_rank", "_shell", "_weight")

    def __init__(
        self,
        shell: _Shell,
        key: Callable[[I], Hashable],
        rank: Callable[[I], Any] | None,
        weight: Callable[[I], float] | None,
        max_weight: float,
    ) -> None:
        self._shell = shell
        self._key = key
        self._rank = rank
        self._weight = weight
        self._max_weight = max_weight

    async def __call__(self, x: I, /) -> R:
        """Submit `x` to its key's lane and wait for its result. Always a checkpoint.

        `key(x)`, `rank(x)` and `weight(x)` run first: if one raises, or gives a bad value
        (`TypeError`: unhashable key or non-numeric weight; `ValueError`: negative, NaN or
        infinite weight, or one above `max_queued_weight`), the caller gets that at once and
        nothing is admitted. Then: the result, `Rejected`, `Failed`, `BatchContractError`,
        `Closed`, or `trio.Cancelled` (SPEC 2.6).
        """
        key = self._key(x)
        try:
            hash(key)
        except TypeError:
            raise TypeError(
                f"key(x) must return a hashable value; got {type(key).__name__} for {x!r}"
            ) from None
        rank = None
        if self._rank is not None:
            rank = self._rank(x)
            if rank is None:
                raise TypeError(f"rank(x) returned None for {x!r}; return a comparable value")
        w = 1.0 if self._weight is None else self._checked_weight(x)
        result: R = await self._shell._submit(x, key, w, rank)
        return result

    def _checked_weight(self, x: I) -> float:
        assert self._weight is not None
        w = self._weight(x)
        if isinstance(w, bool) or not isinstance(w, int | float):
            raise TypeError(f"weight(x) must return a number; got {type(w).__name__} for {x!r}")
        w = float(w)
        if not (0.0 <= w < math.inf):
            raise ValueError(f"weight(x) must be a finite number >= 0; got {w!r} for {x!r}")
        if w > self._max_weight:
            raise ValueError(
                f"weight(x) is {w!r}, above max_queued_weight={self._max_weight!r}: "
                f"it could never be admitted ({x!r})"
            )
        return w

    def stats(self) -> FerryStatistics:
        """A snapshot of the lanes and the counters; one TVar peek, no checkpoint."""
        return self._shell.stats()

    def __repr__(self) -> str:
        s = self._shell.stats()
        return (
            f"<ferry.PerKeyFerry lanes={s.lanes} queued={s.queued} busy={s.busy} "
            f"batches={s.batches}>"
        )


@overload
def open_per_key_ferry(
    call: Callable[[K, list[I]], Awaitable[Sequence[R]]],
    *,
    key: Callable[[I], K],
    rank: Callable[[I], Any] | None = ...,
    weight: Callable[[I], float] | None = ...,
    max_batch_size: int = ...,
    max_batch_weight: float = ...,
    max_batch_delay: float = ...,
    max_in_flight_batches: int = ...,
    max_queueing: int = ...,
    max_queued_weight: float = ...,
    direct_calls: bool = ...,
    extract: None = None,
) -> AbstractAsyncContextManager[PerKeyFerry[I, R]]: ...


@overload
def open_per_key_ferry(
    call: Callable[[K, list[I]], Awaitable[O]],
    *,
    key: Callable[[I], K],
    rank: Callable[[I], Any] | None = ...,
    weight: Callable[[I], float] | None = ...,
    max_batch_size: int = ...,
    max_batch_weight: float = ...,
    max_batch_delay: float = ...,
    max_in_flight_batches: int = ...,
    max_queueing: int = ...,
    max_queued_weight: float = ...,
    direct_calls: bool = ...,
    extract: Callable[[O, I], R],
) -> AbstractAsyncContextManager[PerKeyFerry[I, R]]: ...


def open_per_key_ferry(
    call: Callable[[Any, list[Any]], Awaitable[Any]],
    *,
    key: Callable[[Any], Any],
    rank: Callable[[Any], Any] | None = None,
    weight: Callable[[Any], float] | None = None,
    max_batch_size: int = 100,
    max_batch_weight: float = math.inf,
    max_batch_delay: float = 0.0,
    max_in_flight_batches: int = 4,
    max_queueing: int = 10_000,
    max_queued_weight: float = math.inf,
    direct_calls: bool = True,
    extract: Callable[[Any, Any], Any] | None = None,
) -> AbstractAsyncContextManager[PerKeyFerry[Any, Any]]:
    """Open a per-key ferry over `call(key, inputs) -> outputs` for an `async with` block.

    At most one call is in flight per key; keys with inputs ready are served first come, first
    served. Options are checked here (`ValueError` naming the option).
    """
    _check_callable("call", call)
    _check_callable("key", key)
    for name, fn in (("rank", rank), ("weight", weight), ("extract", extract)):
        if fn is not None:
            _check_callable(name, fn)
    if not isinstance(direct_calls, bool):
        raise ValueError(f"direct_calls must be a bool, got {direct_calls!r}")
    max_queued_weight = _check_real(
        "max_queued_weight", max_queued_weight, positive=True, finite=False
    )
    limits = _lanes.Limits(
        max_batch_size=_check_int("max_batch_size", max_batch_size, 1),
        max_batch_weight=_check_real(
            "max_batch_weight", max_batch_weight, positive=True, finite=False
        ),
        max_batch_delay=_check_real(
            "max_batch_delay", max_batch_delay, positive=False, finite=True
        ),
        max_queueing=_check_int("max_queueing", max_queueing, 0),
        max_queued_weight=max_queued_weight,
        direct_calls=direct_calls,
        one_in_flight=True,
    )
    workers = _check_int("max_in_flight_batches", max_in_flight_batches, 1)
    shell = _Shell(call, extract, limits, workers, plain=False)
    return _lifetime(shell, PerKeyFerry(shell, key, rank, weight, max_queued_weight))
