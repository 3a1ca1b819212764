"""The outside requests of the public engine: their input checks, their ops, and the plan version
each one's transition is computed with.

A request (`start`, `wake`, `cancel`, `resume`, `publish`) is checked whole before anything is
written (bad input raises `TypeError`/`ValueError`/`UnknownPlan` and nothing is stored), then
written as one op, or one all-or-nothing batch for a `publish` (`_writes.Writes.request`,
`Writes.batch`): a call that raises `Cancelled` did not happen, and one that wrote returns its
result. The transition of a wake, cancel or resume depends on the flow's plan version, known only
inside the transaction: `versioned` gives it the shape of that version (or None: the machine then
blocks the flow, versions fail closed).
"""

from __future__ import annotations

import inspect
import json
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, NoReturn, TypeVar

import trio

from ferry import Failed
from ferry.projected import Store

from .._model import _checks, _ops
from .._model import _machine as m
from .._model._errors import IdReused, UnknownPlan
from .._model._limits import NO_QUEUE, Queue, StartOptions, checked_start
from .._model._plan import Plan
from .._model._types import IGNORE, Delivery, Json, Start, Wake
from .._model._values import Message, Shape
from .._store import _batch, _op, _store
from . import _read, _tracing
from ._clock import Clock
from ._config import Config
from ._live import Tally
from ._mode import Mode
from ._versions import Versions
from ._writes import Writes

T = TypeVar("T")


class Requests:
    """The outside requests of one engine (the module docstring)."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        writes: Writes,
        versions: Versions,
        tally: Tally,
        plans: dict[tuple[str, int], Plan],
        config: Config,
        mode: Mode,
    ) -> None:
        self._store = store
        self._clock = clock
        self._writes = writes
        self._versions = versions
        self._shapes = versions.shapes
        self._tally = tally
        self._plans = plans
        self._registered = {id(p): k for k, p in plans.items()}
        self._owner = config.owner
        self._serve = config.serve
        self._shared = mode.shared  # a fleet: versions elsewhere (`versioned`)
        self._max_data = config.max_data  # of a flow's data (or a payload) as UTF-8 JSON text
        self._tracing = config.tracing  # OpenTelemetry spans of starts (None: traces off)
        self._own = _ops.Known(self._shapes)  # an engine off a fleet knows its own versions
        # A fleet engine's versions (`versioned`), and the fleet's versions they were made of.
        self._fleet_known: tuple[object, _ops.Known] = (None, self._own)

    async def read(self, fn: Callable[[Any], T], what: str) -> T:
        """A read of an API call (`_read.read`: a store error is `ferry.Failed`). A
        checkpoint."""
        return await _read.read(self._store, fn, what)

    # -------------------------------------------------------------------------- plan versions

    async def _stored(self) -> _ops.Known:
        """The plan versions whose transitions an operator's engine may ask for: its own plans
        and every version any engine registered in the store (read anew on every call: an
        operator's calls are few, and a deploy may have added one)."""
        stored = await self.read(_store.load_plans, "reading the registered plans")
        return _ops.Known({**{(sh.name, sh.version): sh for sh, _at in stored}, **self._shapes})

    def _fleet_versions(self) -> _ops.Known:
        """A fleet engine's versions: its own and those it knows live engines have, the
        others not seen yet (`versioned`)."""
        fleet_known = self._versions.fleet_known
        made, known = self._fleet_known
        if made is not fleet_known:
            known = _ops.Known({**fleet_known, **self._shapes}, complete=False)
            self._fleet_known = (fleet_known, known)
        return known

    async def versioned(self, call: Callable[[_ops.Known], Awaitable[T]]) -> T:
        """``await call(known)`` for an outside request (wake, cancel, resume, publish), where
        `known` holds the plan versions to compute its transition with (`_ops.Known`; a
        version not in it: the machine blocks the flow, versions fail closed).

        In a fleet a version this engine lacks but a live engine has is not missing (a rolling
        deploy, `_versions`): its shape comes from the store and the flow is left to an engine
        with the version (`Writes.holders`). The engine keeps those versions from its last scan;
        for a version it does not know of yet, the op is answered `_ops.Unseen` (nothing is
        written) and the request runs again on a fresh read."""
        if not self._shared or not self._serve:
            return await call(self._own if self._serve else await self._stored())
        answer = await call(self._fleet_versions())
        if not _unseen(answer):
            return answer
        read = partial(_store.live_plans_on_clock, now=self._clock.now())
        fresh = await self.read(read, "reading the fleet's plans")
        shapes = {**self._versions.learn(fresh), **self._shapes}
        return await call(_ops.Known(shapes))

    def shape_of(self, plan: object) -> Shape:
        """The shape of `plan`, one of the engine's own (`TypeError`, `UnknownPlan`)."""
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a flow.Plan, got {plan!r}")
        key = self._registered.get(id(plan))
        if key is None and (plan.name, plan.version) in self._plans:
            raise UnknownPlan(
                f"this flow.Plan {plan.name!r} version {plan.version} is not the object given to"
                " open_engine, which has another Plan of that name and version (was the plan"
                " built twice?): start flows with the Plan object the engine was opened with"
            )
        if key is None:
            raise UnknownPlan(
                f"plan {plan.name!r} version {plan.version} was not given to open_engine; an"
                " engine runs only the plans it was opened with"
            )
        return self._shapes[key]

    # ------------------------------------------------------------------------------ requests

    async def start(
        self,
        plan: Plan,
        flow_id: str | None,
        data: dict[str, Json] | None,
        deadline: float | None = None,
        queue: Queue = NO_QUEUE,
    ) -> str:
        """`Engine.start`; `queue`: its `priority`, `delay` and `at`, checked here."""
        seconds = _checks.whole_deadline(deadline)
        shape, fid, text = self._start_input(plan, flow_id, data, "data")
        options = checked_start(shape.limits, shape.name, data or {}, queue, self._clock.now())
        with _tracing.starting(self._tracing, shape.name, shape.version, fid) as trace:
            op = self._start_op(shape, fid, text, trace, seconds, options)
            result = await self._writes.request(op)
        return _started(op, result)

    def _start_input(
        self, plan: Plan, flow_id: str | None, data: dict[str, Json] | None, what: str
    ) -> tuple[Shape, str, str]:
        """A start's input checked (raises `TypeError`/`ValueError`/`UnknownPlan`): its plan's
        shape, its flow id and its data's JSON text."""
        shape = self.shape_of(plan)
        fid = uuid.uuid4().hex if flow_id is None else _checks.flow_id(flow_id)
        data = {} if data is None else data
        return shape, fid, _checks.json_object_text(data, what, max_bytes=self._max_data)

    def _start_op(self, shape: Shape, fid: str, text: str, *more: Any) -> _op.Create:
        """The op of a start whose input was checked (`_start_input`); `more`: its trace, its
        whole deadline (seconds from now), its queue's options (`_create`)."""
        trace, deadline, options = (*more, None, None, None)[:3]
        owner = self._owner if self._serve else None
        return _create(shape, fid, text, self._clock.now(), owner, trace, deadline, options)

    async def wake(self, flow_id: str, payload: Json, message_id: str | None) -> Delivery:
        """`Engine.wake`."""
        text = self._wake_input(flow_id, payload, message_id, "")
        tracing = self._tracing
        began = 0 if tracing is None else tracing.now()
        result = await self.versioned(partial(self._wake, flow_id, text, message_id))
        if tracing is not None:
            _traced_wake(tracing, result, began)
        return self._delivered(result)

    async def _wake(
        self, flow_id: str, text: str, message_id: str | None, known: _ops.Known
    ) -> _op.Result:
        return await self._writes.request(self._wake_op(flow_id, text, message_id, known))

    def _wake_input(self, flow_id: str, payload: Json, message_id: str | None, what: str) -> str:
        """A wake's input checked (`TypeError`/`ValueError`); the payload's JSON text."""
        _checks.flow_id(flow_id)
        text = _checks.json_text(payload, f"{what}payload", max_bytes=self._max_data)
        _checks.message_id(message_id, f"{what}message_id")
        return text

    def _wake_op(
        self, flow_id: str, text: str, message_id: str | None, known: _ops.Known
    ) -> _op.Change:
        """The op of a wake whose input was checked (`_wake_input`: `text` is its payload),
        computed with the versions `known` (`versioned`)."""
        message = Message(uuid.uuid4().hex if message_id is None else message_id, text)
        wake = _ops.Wake(message, self._clock.now(), known=known)
        holder = self._writes.holders.rule(outside=True)
        return _op.Change(flow_id, wake, message_id=message_id, holder=holder)

    def _delivered(self, result: _op.Result) -> Delivery:
        if isinstance(result, _op.Changed):
            assert result.transition.delivery is not None
            return result.transition.delivery
        self._tally.wakes[Delivery.UNKNOWN] += 1
        return Delivery.UNKNOWN

    async def cancel(self, flow_id: str, reason: str) -> bool:
        """`Engine.cancel`."""
        fid = _checks.flow_id(flow_id)
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {reason!r}")
        problem = _checks.text_problem(reason)
        if problem is not None:
            raise ValueError(f"reason {reason!r} cannot be stored: {problem}")
        now = self._clock.now()
        cancel = partial(_ops.Cancel, reason, now)
        result = await self.versioned(partial(self._outside, fid, cancel))
        return isinstance(result, _op.Changed) and result.transition.done

    async def resume(self, flow_id: str) -> bool:
        """`Engine.resume`."""
        fid = _checks.flow_id(flow_id)
        now = self._clock.now()
        resume = partial(_ops.Resume, now)
        result = await self.versioned(partial(self._outside, fid, resume, first_queued=True))
        return isinstance(result, _op.Changed) and result.transition.done

    async def abandon(self, flow_id: str, reason: str, by: str | None) -> bool:
        """`Engine.abandon`."""
        fid = _checks.flow_id(flow_id)
        _checks.said(reason, "reason")
        if by is not None:
            _checks.said(by, "by")
        now = self._clock.now()
        abandon = partial(_ops.Abandon, reason, by, now)
        result = await self.versioned(partial(self._outside, fid, abandon))
        return isinstance(result, _op.Changed) and result.transition.done

    async def _outside(
        self,
        flow_id: str,
        move: Callable[..., _ops.Move],
        known: _ops.Known,
        *,
        first_queued: bool = False,
    ) -> _op.Result:
        """Write an outside request's record, ``move(known=known)``, on the flow `flow_id`."""
        holder = self._writes.holders.rule(outside=True)
        op = _op.Change(flow_id, move(known=known), first_queued=first_queued, holder=holder)
        return await self._writes.request(op)

    # ---------------------------------------------------------------------------- publishing

    def event(self, event_type: str, event: Json) -> None:
        """A published event, checked like a payload (`TypeError`/`ValueError` naming it)."""
        _checks.json_text(event, f"the event of type {event_type!r}", max_bytes=self._max_data)

    def decision(self, decision: object) -> Wake | Start | None:
        """A mapper's result, checked (type, ids, JSON, plan); raises `TypeError`/`ValueError`."""
        if decision is None or decision is IGNORE:
            return None
        if isinstance(decision, Wake):
            _checks.flow_id(decision.flow_id)
            _checks.json_text(decision.payload, "Wake.payload", max_bytes=self._max_data)
            _checks.message_id(decision.message_id, "Wake.message_id")
            return decision
        if isinstance(decision, Start):
            self.shape_of(decision.plan)
            _checks.flow_id(decision.flow_id)
            data = {} if decision.data is None else decision.data
            _checks.json_object_text(data, "Start.data", max_bytes=self._max_data)
            return decision
        raise TypeError("a mapper must return flow.Wake, flow.Start, flow.IGNORE or None")

    async def publish(self, decisions: list[Wake | Start | None]) -> list[Delivery | str | None]:
        """Apply checked `decisions` (`decision`) all or nothing; `Engine.publish`."""
        # Checked and built before anything is written: a start's op (its flow), a wake's text.
        built: list[_op.Create | str | None] = []
        for d in decisions:
            if isinstance(d, Wake):
                built.append(self._wake_input(d.flow_id, d.payload, d.message_id, "Wake."))
            elif isinstance(d, Start):
                built.append(
                    self._start_op(*self._start_input(d.plan, d.flow_id, d.data, "Start.data"))
                )
            else:
                built.append(None)

        await trio.lowlevel.checkpoint_if_cancelled()
        if all(b is None for b in built):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return [None] * len(decisions)
        tracing = self._tracing
        began = 0 if tracing is None else tracing.now()
        with trio.CancelScope(shield=True):  # all of them, or (if Cancelled) none
            done = await self.versioned(partial(self._publish, decisions, built))
        answers = iter(done)
        results: list[Delivery | str | None] = []
        for b in built:
            if b is None:
                results.append(None)
            elif isinstance(b, _op.Create):
                results.append(_started(b, next(answers)))
            else:
                answer = next(answers)
                if tracing is not None:
                    _traced_wake(tracing, answer, began)
                results.append(self._delivered(answer))
        return results

    async def _publish(
        self,
        decisions: list[Wake | Start | None],
        built: list[_op.Create | str | None],
        known: _ops.Known,
    ) -> list[_op.Result]:
        """The ops of a `publish` in one all-or-nothing batch; their results (with an
        `_ops.Unseen` among them if one op's version was not seen yet: nothing was written,
        `versioned` runs it again)."""
        ops: list[_op.Op] = []
        for d, b in zip(decisions, built, strict=True):
            if isinstance(d, Wake):
                assert isinstance(b, str)
                ops.append(self._wake_op(d.flow_id, b, d.message_id, known))
            elif isinstance(b, _op.Create):
                ops.append(b)
        try:
            return await self._writes.batch(ops, whole=True)
        except _batch.Undone as undone:
            if _unseen(undone.results):
                return undone.results
            _undone(ops, undone.results)
        except Exception as exc:
            raise Failed(f"the flow store raised {exc!r}; nothing was applied") from exc


def _started(op: _op.Create, result: _op.Result) -> str:
    """The flow id of a start, unless its id is taken by another flow (`IdReused`)."""
    fid = op.transition.flow.flow_id
    if isinstance(result, _op.Existing) and not result.same:
        raise IdReused(
            f"flow id {fid!r} is already used by a flow of plan {result.flow.plan!r} with"
            " other start data; nothing was stored (pick another id, or send the same data)"
        )
    return fid


def _undone(ops: list[_op.Op], results: list[_op.Result]) -> NoReturn:
    """Raise why an all-or-nothing batch (a `publish`) was rolled back."""
    for op, result in zip(ops, results, strict=True):
        if isinstance(result, _op.Refused):
            raise result.error
        if isinstance(op, _op.Create):
            _started(op, result)  # raises IdReused
    raise AssertionError(f"a publish was rolled back for no reason: {results!r}")


def _unseen(answer: object) -> bool:
    """Is `answer` (a request's result, or a publish's) `_ops.Unseen`, or has one?"""
    if isinstance(answer, list):
        return any(isinstance(r, _ops.Unseen) for r in answer)
    return isinstance(answer, _ops.Unseen)


def _traced_wake(tracing: _tracing.Tracing, result: _op.Result, began: int) -> None:
    """The ``wake`` span of a wake that found its flow, in that flow's trace (ADR 0104)."""
    if isinstance(result, _op.Changed) and result.transition.delivery is not None:
        flow = result.transition.flow
        tracing.moved("wake", flow, result.before.step, began, result.transition.delivery.name)


def check_mapper(event_type: object, mapper: object) -> None:
    """Raise `TypeError` unless `mapper` can be registered for `event_type` (`Engine.on`): a
    plain function of one argument, the event."""
    if not isinstance(event_type, str):
        raise TypeError(f"event_type must be a str, got {event_type!r}")
    if not callable(mapper):
        raise TypeError(f"mapper must be a function, got {mapper!r}")
    if _is_async(mapper):
        raise TypeError(f"mapper must be a plain function, not async: {mapper!r}")
    try:
        signature = inspect.signature(mapper)
    except (TypeError, ValueError):  # no signature to read: publish will tell
        signature = None
    if signature is not None:
        try:
            signature.bind(None)
        except TypeError:
            raise TypeError(
                f"mapper must take one argument, the event (def mapper(event): ...), got"
                f" {mapper!r} taking {signature}"
            ) from None


def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )


def _create(
    shape: Shape,
    fid: str,
    text: str,
    now: float,
    owner: str | None,
    trace: str | None,
    deadline: float | None,
    options: StartOptions | None,
) -> _op.Create:
    """`Requests._start_op`'s op: a plan with limits queues the flow with its options (the
    defaults if None: its key function called on the data)."""
    at = None if deadline is None else now + deadline
    if shape.limits is not None and options is None:
        options = checked_start(shape.limits, shape.name, json.loads(text), NO_QUEUE, now)
    key = None if options is None or shape.limits is None else options.key
    wait = None if options is None else options.not_before
    t = m.start(
        shape, fid, text, now, owner=owner, trace=trace, deadline=at, queue_key=key, not_before=wait
    )
    if options is None:
        return _op.Create(t)
    return _op.Create(t, priority=options.priority, not_before=options.not_before)
