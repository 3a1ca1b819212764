"""What an engine tells its observers (`flow.Observer`, docs/adr/0138), and what it does
when observability code raises.

An engine holds a tuple of `Bound` observers (those given to `open_engine(observers=...)` or
`Engine.add_observer`, and its tracing), empty when there is none. The engine's two hot paths
ask ``if observers:`` and do nothing more when it is empty: no clock is read, no record is made
and nothing is imported. An observer is called on the engine's trio thread, in commit order, and
must not block (it only counts). Each is handed a public record (`StepRun`, `FlowEnd`) or the
engine, never a row of the store.

Observability is never part of the outcome (docs/adr/0113). An observer, a tracer or a span
processor that raises changes nothing a flow or a caller sees: the engine calls each of them at
one guarded place (`ran`, `ended`, `opened` and `closed` here; the spans in `_tracing`), and what
they raise (an `Exception`) goes to `failed`, which logs it on ``ferry.flow`` as a WARNING with
the exception, at most once per `_EVERY` seconds for each kind of hook (`TRACING`,
`OBSERVER`), saying how many failures it did not log in between. The engine then goes on as
if the hook had done its work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from .._model._observed import FlowEnd, ScheduleTick, StepRun
from .._model._values import Flow

_log = logging.getLogger("ferry.flow")

#: Seconds between two warnings of one kind of hook (the first failure is logged at once).
_EVERY: Final = 60.0
#: The kinds of hook `failed` is told of (each rate limited on its own).
TRACING: Final = "OpenTelemetry (the tracer or a span processor)"
OBSERVER: Final = "an observer (such as the ferry.metrics collector)"


#: The methods an observer may have (`flow.Observer`); each is optional.
HOOKS: Final = ("step_ran", "flow_ended", "engine_opened", "engine_closed", "schedule_ticked")

_Hook = Callable[[Any], None]


class Bound:
    """One observer and the hooks it has (None: it has not that one, or it kept the no-op of
    `flow.Observer`), looked up once, when it is attached."""

    __slots__ = (
        "engine_closed",
        "engine_opened",
        "flow_ended",
        "observer",
        "schedule_ticked",
        "step_ran",
    )

    def __init__(
        self,
        observer: object,
        *,
        step_ran: _Hook | None = None,
        flow_ended: _Hook | None = None,
        engine_opened: _Hook | None = None,
        engine_closed: _Hook | None = None,
        schedule_ticked: _Hook | None = None,
    ) -> None:
        self.observer = observer
        self.schedule_ticked = schedule_ticked
        self.step_ran = step_ran
        self.flow_ended = flow_ended
        self.engine_opened = engine_opened
        self.engine_closed = engine_closed

    def __repr__(self) -> str:
        return repr(self.observer)


class _Complaints:
    """The rate limit of `failed`: per kind, when it last logged and how many it kept quiet.
    Any thread may report (engines of several trio runs share it): one lock, taken only when
    something failed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def report(self, kind: str, what: str, exc: Exception) -> None:
        now = self._clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < _EVERY:
                self._quiet[kind] = self._quiet.get(kind, 0) + 1
                return
            self._last[kind] = now
            quiet = self._quiet.pop(kind, 0)
        since = f"; {quiet} more failures of it since the last warning" if quiet else ""
        _log.warning(
            "%s raised while %s (%s: %r), and was ignored: observability never changes what"
            " flows do (at most one warning of it per %g s%s)",
            kind,
            what,
            type(exc).__name__,
            exc,
            _EVERY,
            since,
            exc_info=exc,
            extra={"hook": kind},
        )


_complaints = _Complaints()


def failed(kind: str, what: str, exc: Exception) -> None:
    """Observability code of `kind` (`TRACING`, `OBSERVER`) raised `exc` while
    `what`: log it (rate limited, the module docstring); the caller goes on without it. Never
    raises; no checkpoint."""
    _complaints.report(kind, what, exc)


def ran(
    observers: tuple[Bound, ...],
    flow: Flow,
    step: str,
    compensating: bool,
    result: object,
    error: BaseException | None,
    seconds: float,
    void: bool,
) -> None:
    """Tell each observer of one attempt (`Observer.step_ran`); what one raises is `failed`."""
    record: StepRun | None = None
    for bound in observers:
        hook = bound.step_ran
        if hook is None:
            continue
        if record is None:
            record = StepRun(
                flow_id=flow.flow_id,
                plan=flow.plan,
                version=flow.version,
                step=step,
                attempt=flow.attempt,
                compensating=compensating,
                result=result,
                error=error,
                seconds=seconds,
                void=void,
            )
        try:
            hook(record)
        except Exception as exc:
            failed(OBSERVER, f"told of an attempt of step {step!r} ({bound!r})", exc)


def ended(observers: tuple[Bound, ...], flow: Flow, step: str | None, how: str) -> None:
    """Tell each observer that this engine ended `flow` (`Observer.flow_ended`), guarded:
    `step` is the step it was at before, `how` how it ended (`FlowEnd.how`)."""
    record: FlowEnd | None = None
    for bound in observers:
        hook = bound.flow_ended
        if hook is None:
            continue
        if record is None:
            record = FlowEnd(
                flow_id=flow.flow_id,
                plan=flow.plan,
                version=flow.version,
                state=flow.state,
                how=how,
                step=step,
                error=flow.blocked if flow.blocked is not None else flow.error,
                started_at=flow.created_at,
                ended_at=flow.updated_at,
                traceparent=flow.trace,
                parent=flow.parent,
            )
        try:
            hook(record)
        except Exception as exc:
            failed(OBSERVER, f"told that flow {flow.flow_id!r} ended ({bound!r})", exc)


def ticked(observers: tuple[Bound, ...], tick: ScheduleTick) -> None:
    """Tell each observer of a schedule's firing (`Observer.schedule_ticked`), guarded."""
    for bound in observers:
        if bound.schedule_ticked is not None:
            try:
                bound.schedule_ticked(tick)
            except Exception as exc:
                failed(OBSERVER, f"told of a tick of schedule {tick.schedule!r} ({bound!r})", exc)


def opened(observers: tuple[Bound, ...], engine: object) -> None:
    """Tell each observer that `engine` opens (`Observer.engine_opened`), guarded."""
    for bound in observers:
        if bound.engine_opened is not None:
            try:
                bound.engine_opened(engine)
            except Exception as exc:
                failed(OBSERVER, f"told that the engine opened ({bound!r})", exc)


def closed(observers: tuple[Bound, ...], engine: object) -> None:
    """Tell each observer that `engine` closed (`Observer.engine_closed`), guarded."""
    for bound in observers:
        if bound.engine_closed is not None:
            try:
                bound.engine_closed(engine)
            except Exception as exc:
                failed(OBSERVER, f"told that the engine closed ({bound!r})", exc)
