"""The runner: runner slots (at most `max_running` flows run at once, the others wait first come
first served) and the tasks that run a live flow's steps or compensations.

One task drives one live flow (`Runner._drive`) until it parks, ends, blocks or is let go, then
takes the next flow waiting for a slot. Each run of a step or compensation is an *attempt*: a
retry writes attempt + 1 before it runs (docs/adr/0024), and the outcome is written as one
transition of the flow (`_advance`, a compare-and-set on the runner's copy). The runner checks
what a body left (its outcome, its data) and turns a problem into the flow's own failure.

A runner task has one cancel scope (not one per attempt: a scope is a few objects and their
bookkeeping in trio); a body runs in it, and only then may it be cancelled (`Live.scope`): by a
write someone else made to the flow, or by the lease's deadline. A cancelled scope stays
cancelled, so the attempt that saw it is void and the task goes on in a fresh scope (`_Void`).

A body runs only on a copy the mode trusts (`_mode.Mode.ready`; in a fleet the lease's rule, trust
after a lapse, ADR 0047: a copy from an older epoch is read again first, an engine whose lease is
lapsing lets the flow go), and while a body runs the scope has the mode's deadline
(`Mode.body_deadline`: the lease's in a fleet; inf the rest of the time, and always on one file).
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import trio

from .._model import _checks, _ops, _values
from .._model._children import ChildResult, Spawn
from .._model._plan import StepDef
from .._model._signals import Signals
from .._model._types import Context, MisusedOutcome, Park, State
from .._model._values import Flow, Shape
from .._store import _op
from . import _emits, _observe, _retry, _spawns
from ._clock import Clock
from ._config import Config
from ._live import Live, Tally, about, named
from ._mode import Mode
from ._versions import Versions
from ._writes import Writes

_log = logging.getLogger("ferry.flow")

_RUNNING = State.RUNNING
_COMPENSATING = State.COMPENSATING
STEP_BACKOFF = 0.1  # seconds before the first retry of a step; doubles with every retry


def step_backoff(failures: int) -> float:
    """Seconds to wait after the `failures`-th failed attempt of a step, before the next."""
    return STEP_BACKOFF * 2.0 ** (failures - 1)


class _Void(Exception):
    """The runner's cancel scope was cancelled while a body ran in it (the attempt is void):
    raised by `Runner._attempt` before any other checkpoint, caught by `Runner._run`, which goes
    on in a fresh scope (a cancelled scope stays cancelled). Also raised by `_left_over` when
    the flow moved on while its stream's length was read (that attempt is void too)."""


def _not_only_cancelled(exc: BaseException) -> None:
    """Raise what `exc` holds besides `trio.Cancelled` (a body's nursery may group a cancel
    with its own errors), as the runner's cancel scope would have; return if it is only
    that."""
    if isinstance(exc, trio.Cancelled):
        return
    if isinstance(exc, BaseExceptionGroup):
        _cancelled, rest = exc.split(trio.Cancelled)
        if rest is None:
            return
        raise rest
    raise exc


def context(
    flow: Flow,
    name: str,
    compensating: bool,
    children: Mapping[str, ChildResult] | None = None,
) -> Context:
    """The `Context` a body of `flow`'s current step `name` (or its compensation) runs with;
    `children`: the results of the spawn before it (``ctx.children``)."""
    key = _checks.idempotency_key(flow.flow_id, flow.step_index, name, compensation=compensating)
    return Context(
        flow_id=flow.flow_id,
        plan=flow.plan,
        version=flow.version,
        step=name,
        step_index=flow.step_index,
        attempt=flow.attempt,
        data=json.loads(flow.data),
        wake=None if flow.wake is None else json.loads(flow.wake),
        timed_out=flow.timed_out,
        error=flow.error if compensating else None,
        idempotency_key=key,
        children={} if children is None else children,
    )


def _data_text(ctx: Context, max_data: int, what: str) -> tuple[str, str | None]:
    """The JSON text of what a body left in ``ctx.data``, or the problem with it."""
    try:
        return _checks.json_object_text(ctx.data, "ctx.data", max_bytes=max_data), None
    except TypeError as exc:
        return "", f"{what} left data that is not JSON: {exc}"
    except ValueError as exc:
        return "", f"{what} left data that cannot be stored: {exc}"


async def _read_again(writes: Writes, live: Live, flow: Flow) -> None:
    """A runner's compare-and-set on `flow`, its copy, was lost and no newer copy came since:
    read the row again (its unavailability retried) and follow it (`Writes.track`), or forget
    a flow that is gone."""
    epoch = writes.epoch

    async def load() -> Flow | None:
        nonlocal epoch
        epoch = writes.epoch
        return await writes.load_row(flow.flow_id)

    stored = await _retry.retrying(
        load, what=lambda: f"reading {named(flow)}", extra=partial(about, flow)
    )
    if writes.live.get(flow.flow_id) is not live or live.flow.revision > flow.revision:
        return
    if stored is None:
        writes.drop(live)
    else:
        writes.track(flow.state, stored, True, epoch=epoch, write=False)


def _step_problem(
    step: StepDef, attempt: int, error: BaseException | None, failures: int, outcome: object
) -> str:
    """Why a step whose body raised `error` (on its `failures`-th try) or returned a
    non-outcome (`outcome`, `_checks.outcome`'s problem text) fails."""
    if isinstance(error, MisusedOutcome):
        return (
            f"step {step.name!r} raised {_checks.describe(error)} on attempt {attempt} (a bad"
            " argument to park() or fail(): not retried)"
        )
    if error is not None:
        return (
            f"step {step.name!r} raised {_checks.describe(error)} on attempt {attempt}"
            f" ({failures} of {step.attempts} tries)"
        )
    return f"step {step.name!r} {outcome}"


def _log_attempt(flow: Flow, step: StepDef) -> None:
    """DEBUG: an attempt of the flow's step or compensation begins."""
    _log.debug(
        "flow %r (plan %r): running %s %r, attempt %d",
        flow.flow_id,
        flow.plan,
        "compensation of step" if flow.state is _COMPENSATING else "step",
        step.name,
        flow.attempt,
        extra=about(flow),
    )


async def _backoff(
    flow: Flow, step: StepDef, error: BaseException, failures: int, compensating: bool
) -> None:
    """WARNING, then the pause before the next attempt of a body that raised `error` on its
    `failures`-th try (`step_backoff`)."""
    delay = step_backoff(failures)
    _log.warning(
        "flow %r (plan %r): %s %r raised %s on attempt %d (%d of %d tries); it runs"
        " again in %.1f s",
        flow.flow_id,
        flow.plan,
        "compensation of step" if compensating else "step",
        step.name,
        _checks.describe(error, 200),
        flow.attempt,
        failures,
        step.attempts,
        delay,
        extra={**about(flow), "step": step.name, "error_type": type(error).__name__},
    )
    await trio.sleep(delay)


class Slots:
    """Runner slots: `running` runners (at most `max_running`) and the flows waiting for one,
    first come first served. Plain state (nothing waits on it)."""

    __slots__ = ("max_running", "running", "waiting")

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self.running = 0
        self.waiting: deque[Live] = deque()

    def admit(self, live: Live) -> bool:
        """True: `live` has a slot now (a runner starts for it); else it waits in line."""
        if self.running < self.max_running:
            self.running += 1
            return True
        self.waiting.append(live)
        return False

    def next(self) -> Live | None:
        """A runner is done with its flow: the next flow waiting, for the same runner; or None,
        and the slot is free."""
        if self.waiting:
            return self.waiting.popleft()
        self.running -= 1
        return None


class Runner:
    """Runs the live flows of one engine in its nursery (`open`); `enqueue` gives a flow that
    became live a runner or a place in line."""

    def __init__(
        self,
        writes: Writes,
        mode: Mode,
        versions: Versions,
        clock: Clock,
        tally: Tally,
        config: Config,
    ) -> None:
        self._writes = writes
        self._mode = mode  # how this engine shares its store: trust, deadlines, hand-overs
        self._versions = versions
        self._clock = clock
        self._tally = tally
        self._max_data = config.max_data  # of a flow's data as UTF-8 JSON text
        self._tracing = config.tracing  # OpenTelemetry spans of every run (None: traces off)
        self.slots = Slots(config.max_running)
        self._nursery: trio.Nursery | None = None

    def open(self, nursery: trio.Nursery) -> None:
        """Start runners in `nursery` from now on."""
        self._nursery = nursery

    def close(self) -> None:
        """Start no runner any more (the engine is closing)."""
        self._nursery = None

    def enqueue(self, live: Live) -> None:
        """Give a live flow a runner now, or a place in line for one (first come first served)."""
        nursery = self._nursery
        if nursery is not None and self.slots.admit(live):
            nursery.start_soon(self._run, live)

    async def _run(self, live: Live | None) -> None:
        # One cancel scope for the runner's life, not one per attempt (each costs a `CancelStatus`
        # and its bookkeeping): it can be cancelled only while a body runs in it (`live.scope`
        # is set only then; off a fleet its deadline stays inf, in a fleet it has the lease's
        # deadline only then), and a scope once cancelled stays so: `_attempt` then raises
        # `_Void` before any other checkpoint, and the runner goes on in a fresh scope.
        while live is not None:
            with trio.CancelScope() as scope:
                try:
                    while live is not None:
                        await self._drive(live, scope)
                        live = self.slots.next()
                except _Void:
                    pass  # the same flow again (or whatever it became), in a fresh scope
            # An engine closing at the same time as a void: stop here, not in a new body.
            await trio.lowlevel.checkpoint_if_cancelled()

    async def _drive(self, live: Live, scope: trio.CancelScope) -> None:
        """Run the flow's steps or compensations until it parks, ends, blocks or is let go."""
        fid = live.flow.flow_id
        lives = self._writes.live
        shapes = self._versions.shapes
        steps = self._versions.steps
        while lives.get(fid) is live:
            flow = live.flow
            key = (flow.plan, flow.version)
            shape = shapes.get(key)
            reason = _values.mismatch(flow, shape)
            if reason is not None and await self._mode.hand_over(live):
                return  # a version another live engine has: left to it, not blocked
            if reason is not None:
                now = self._clock.now()
                await self._advance(live, _ops.Block(reason, now))
            elif flow.state is _RUNNING:
                assert shape is not None
                await self._run_step(live, shape, steps[key][flow.step_index], scope)
            else:
                assert shape is not None
                await self._run_compensation(live, shape, steps[key][flow.step_index], scope)

    async def _attempt(
        self,
        live: Live,
        step: StepDef,
        fn: Callable[[Context], Awaitable[Any]],
        failures: int,
        scope: trio.CancelScope,
    ) -> tuple[Context, object, BaseException | None] | None:
        """Run one attempt of the flow's current step or compensation (and, if it raised and may
        be retried, the backoff after it) in the runner's `scope`. None if the flow was moved by
        someone else meanwhile: the attempt is void and its changes are discarded. Raises
        `_Void` (no checkpoint first) if `scope` was cancelled: a cancel or the lease's deadline
        voided the attempt, and the runner needs a fresh scope."""
        mode = self._mode
        if not mode.ready(live) and not await mode.make_ready(live):
            return None  # moved on without this engine, or let go (a lapsing lease)
        flow = live.flow
        compensating = flow.state is _COMPENSATING
        children = None
        if flow.fan_in is not None and not compensating:  # the step after a spawn
            children = await _spawns.results(self._writes, flow)
        ctx = context(flow, step.name, compensating, children)
        if _log.isEnabledFor(logging.DEBUG):
            _log_attempt(flow, step)
        observers = self._tally.observers
        began = trio.current_time() if observers else 0.0
        # The body may run only while the mode trusts it (a fleet's lease; inf on one file,
        # where the runner's scope keeps its deadline inf throughout).
        bounded = (deadline := mode.body_deadline()) != math.inf
        if bounded:
            scope.deadline = deadline
        live.scope = scope
        live.began = flow.revision
        result: object = None
        error: BaseException | None = None
        seconds = math.nan
        try:
            result, error = await self._body(fn, ctx, flow, compensating)
            if observers:
                seconds = trio.current_time() - began
            retried = error is not None and failures + 1 < step.attempts
            if retried and not isinstance(error, MisusedOutcome):
                assert error is not None
                await _backoff(flow, step, error, failures + 1, compensating)
        except BaseException as exc:
            if not scope.cancel_called:
                raise  # not this attempt's cancel (the engine is closing, say)
            _not_only_cancelled(exc)  # what else was raised with it goes on up
        finally:
            live.scope = None
        if bounded:
            # No deadline on the runner's writes. And set before `cancel_called` is read: on an
            # open scope that read cancels it if its deadline has passed. A body that held the
            # loop past the deadline and returned without a checkpoint ran to its end (its
            # lease kept by the lease thread, or not): its result is written as a compare-and-set
            # like any other, refused if another engine took the flow meanwhile.
            scope.deadline = math.inf
        cancelled = scope.cancel_called
        void = cancelled or live.flow is not flow
        if observers:
            _observe.ran(observers, flow, step.name, compensating, result, error, seconds, void)
        if cancelled:
            mode.voided(live)  # a lapsing lease: every flow let go
            raise _Void
        if void:
            return None
        return ctx, result, error

    async def _body(
        self, fn: Callable[[Context], Awaitable[Any]], ctx: Context, flow: Flow, compensating: bool
    ) -> tuple[object, Exception | None]:
        """Run the body: what it returned, or the exception it raised (a cancel goes up)."""
        tracing = self._tracing
        try:
            if tracing is None:
                return await fn(ctx), None
            return await tracing.run(fn, ctx, flow.trace, compensating), None
        except Exception as exc:
            return None, exc

    async def _attempts(
        self,
        live: Live,
        step: StepDef,
        fn: Callable[[Context], Awaitable[Any]],
        counter: str,
        scope: trio.CancelScope,
    ) -> tuple[Context, object, BaseException | None, int] | None:
        """Attempts of the flow's current step or compensation until one returns or `attempts`
        have raised; attempt + 1 is written before every retry. Returns the last attempt's
        context, result, exception and the number of failures; None if the flow was moved by
        someone else meanwhile (its attempt is void)."""
        failures = 0
        fid = live.flow.flow_id
        stats = self._tally.stats
        while True:
            flow = live.flow
            stats[counter] += 1
            ran = await self._attempt(live, step, fn, failures, scope)
            if ran is None:
                return None
            ctx, result, error = ran
            if error is None:
                return ctx, result, None, failures
            failures += 1
            if failures >= step.attempts or isinstance(error, MisusedOutcome):
                return ctx, result, error, failures
            if counter == "steps_run":
                stats["step_retries"] += 1
            failed = _checks.failure(error)
            accepted = await self._advance(live, _ops.NextAttempt(self._clock.now(), failed))
            # ours must be the last write applied: a cancel may have come right after it
            if not accepted or live.flow.revision != flow.revision + 1:
                return None
            if self._writes.live.get(fid) is not live:
                return None

    async def _run_step(
        self, live: Live, shape: Shape, step: StepDef, scope: trio.CancelScope
    ) -> None:
        ran = await self._attempts(live, step, step.fn, "steps_run", scope)
        if ran is None:
            return
        ctx, result, error, failures = ran
        outcome = _checks.outcome(result)
        attempt = live.flow.attempt
        now = self._clock.now()
        if error is None and not isinstance(outcome, str):
            data, signals, problem = await _left_over(self, live, ctx, f"step {step.name!r}")
            if problem is None and isinstance(outcome, Spawn):
                shapes, most = self._versions.shapes, self._max_data
                problem = await _spawns.spawned(
                    self._writes, live, shape, outcome, data, now, shapes, most, _read_again,
                    self._tracing, signals,
                )  # fmt: skip
                if problem is None:
                    return
            if problem is None:
                done, park = _ops.StepDone(shape, outcome, data, now), isinstance(outcome, Park)
                await self._advance(live, done, first_queued=park, out=signals)
                return
        else:
            problem = _step_problem(step, attempt, error, failures, outcome)
        tb = None if error is None else _checks.traceback_text(error)
        await self._advance(live, _ops.StepFailed(shape, problem, now, tb))

    async def _run_compensation(
        self, live: Live, shape: Shape, step: StepDef, scope: trio.CancelScope
    ) -> None:
        assert step.compensate is not None  # the machine stacks only steps with one
        ran = await self._attempts(live, step, step.compensate, "compensations_run", scope)
        if ran is None:
            return
        ctx, _result, error, failures = ran
        now = self._clock.now()
        if error is None:
            data, signals, message = await _left_over(self, live, ctx, "it")
            if message is None:
                await self._advance(live, _ops.Compensated(shape, data, now), out=signals)
                return
        else:
            message = (
                f"{_checks.describe(error)} on attempt {live.flow.attempt} ({failures} of"
                f" {step.attempts} tries)"
            )
        tb = None if error is None else _checks.traceback_text(error)
        await self._advance(live, _ops.CompensationFailed(message, now, shape, tb))

    async def _advance(
        self,
        live: Live,
        move: _ops.Move,
        *,
        first_queued: bool = False,
        fallback: str | None = None,
        out: Signals | None = None,
    ) -> bool:
        """Write a transition of the flow this runner drives, as a compare-and-set on its copy;
        True if it was accepted.

        The store's unavailability is retried (`_retry`); a lost compare-and-set means the flow
        moved on without this runner: it re-reads the row and carries on from there (or lets
        go). A row the database refuses fails the flow instead (`_fail_refused`; False); if
        the write that fails it (`fallback`: why) is refused too, the flow is left as it is
        (`Writes.left_as_it_is`, docs/adr/0117; False): its problem, not the engine's.
        """
        writes = self._writes
        flow = live.flow
        holder = writes.holders.rule(outside=False)
        op = _op.Change(
            flow.flow_id, move, flow=flow, first_queued=first_queued, holder=holder, signals=out
        )
        try:  # the first try without `_retry.retrying`'s objects: the common case
            result = await writes.write_answered(op)
        except Exception as exc:
            if not _retry.unavailable(exc):
                raise
            result = await _retry.retrying(
                partial(writes.write_answered, op),
                what=lambda: f"writing {named(flow)}",
                extra=partial(about, flow),  # made only for a retry's WARNING, as its `what`
                failed=exc,
            )
        if isinstance(result, _op.Changed):
            _emits.noted(live, flow.revision, out)  # the stream's length after it
            return True
        if isinstance(result, _op.Rejected):
            if fallback is not None:  # even the write that fails the flow was refused
                problem = f"{fallback}; and refused that too: {_checks.describe(result.error)}"
                writes.left_as_it_is(flow, problem, result.error)
                return False
            await _fail_refused(self, live, result)
            return False
        if live.flow.revision <= flow.revision:
            await _read_again(writes, live, flow)
        return False


async def _fail_refused(runner: Runner, live: Live, rejected: _op.Rejected) -> None:
    """The database refused a write of the flow `runner` drives (its row alone, ADR 0063):
    fail the flow with that error (`_refusal`), its problem alone."""
    flow = live.flow
    shape = runner._versions.shapes.get((flow.plan, flow.version))
    move, problem = _refusal(flow, shape, rejected, runner._clock.now())
    await runner._advance(live, move, fallback=problem)


async def _left_over(
    runner: Runner, live: Live, ctx: Context, what: str
) -> tuple[str, Signals | None, str | None]:
    """What a body that returned left: the JSON text of its data, the record of its events
    and stream values (`_emits.left`), or the problem with them (the flow fails). Raises
    `_Void` if someone else moved the flow while the stream's length was read."""
    data, problem = _data_text(ctx, runner._max_data, what)
    if problem is not None:
        return data, None, problem
    signals, problem = await _emits.left(
        runner._writes, runner._mode, live, ctx, what, runner._max_data
    )
    if problem is _emits.MOVED:
        raise _Void
    return data, signals, problem


def _refusal(
    flow: Flow, shape: Shape | None, rejected: _op.Rejected, now: float
) -> tuple[_ops.Move, str]:
    """The write that fails `flow` whose write the database refused (a running step
    compensates; a compensation blocks), and why."""
    problem = (
        f"the database refused the write of step {flow.step!r} (attempt {flow.attempt}):"
        f" {_checks.describe(rejected.error)}"
    )
    if flow.state is _RUNNING:
        return _ops.StepFailed(shape, problem, now), problem
    return _ops.CompensationFailed(problem, now, shape), problem
