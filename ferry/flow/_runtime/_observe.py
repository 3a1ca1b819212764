"""What an engine tells an observer (the metrics collector of `ferry.metrics`), and what it does
when observability code raises.

An engine holds a tuple of observers, empty unless a collector attached one. The engine's two hot
paths ask ``if self._observers:`` and do nothing more when it is empty: no clock is read, no
object is made and nothing is imported. An observer is called on the engine's trio thread, in
commit order, and must not block (it only counts).

Observability is never part of the outcome (docs/adr/0113). An observer, a tracer or a span
processor that raises changes nothing a flow or a caller sees: the engine calls each of them at
one guarded place (`ran`, `ended` and `closed` here; the spans in `_tracing`), and what they
raise (an `Exception`) goes to `failed`, which logs it on ``ferry.flow`` as a WARNING with the
exception, at most once per `_EVERY` seconds for each kind of hook (`TRACING`,
`OBSERVER`), saying how many failures it did not log in between. The engine then goes on as
if the hook had done its work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Protocol

from .._model._values import Flow

if TYPE_CHECKING:
    from .._engine._engine import Engine

_log = logging.getLogger("ferry.flow")

#: Seconds between two warnings of one kind of hook (the first failure is logged at once).
_EVERY: Final = 60.0
#: The kinds of hook `failed` is told of (each rate limited on its own).
TRACING: Final = "OpenTelemetry (the tracer or a span processor)"
OBSERVER: Final = "an observer (such as the ferry.metrics collector)"


class Observer(Protocol):
    def ran(
        self,
        flow: Flow,
        step: str,
        compensating: bool,
        result: object,
        error: BaseException | None,
        seconds: float,
        void: bool,
    ) -> None:
        """One attempt of a step (or of its compensation) of `flow` returned `result` or raised
        `error` after `seconds`; `void`: someone else moved the flow meanwhile (a cancel, a
        takeover) and the attempt counts for nothing."""

    def ended(self, flow: Flow) -> None:
        """This engine wrote `flow` COMPLETED, FAILED or BLOCKED."""

    def closed(self, engine: Engine) -> None:
        """`engine`'s block has ended: it will not run, write or count anything again (its
        statistics are final). Called once, after the engine let go of its flows."""


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
    observers: tuple[Observer, ...],
    flow: Flow,
    step: str,
    compensating: bool,
    result: object,
    error: BaseException | None,
    seconds: float,
    void: bool,
) -> None:
    """Tell each observer of one attempt (`Observer.ran`); what one raises is `failed`."""
    for observer in observers:
        try:
            observer.ran(flow, step, compensating, result, error, seconds, void)
        except Exception as exc:
            failed(OBSERVER, f"told of an attempt of step {step!r} ({observer!r})", exc)


def ended(observers: tuple[Observer, ...], flow: Flow) -> None:
    """Tell each observer that this engine ended `flow` (`Observer.ended`), guarded."""
    for observer in observers:
        try:
            observer.ended(flow)
        except Exception as exc:
            failed(OBSERVER, f"told that flow {flow.flow_id!r} ended ({observer!r})", exc)


def closed(observers: tuple[Observer, ...], engine: Engine) -> None:
    """Tell each observer that `engine` closed (`Observer.closed`), guarded."""
    for observer in observers:
        try:
            observer.closed(engine)
        except Exception as exc:
            failed(OBSERVER, f"told that the engine closed ({observer!r})", exc)
