"""OpenTelemetry traces of flows (the optional extra ``otel``: opentelemetry-api only).

With the application's TracerProvider, `Engine.start` is a span (a child of the caller's
current span, or a new root), and every run of a step or a compensation is a span whose parent
is that start span: one flow is one trace, across parks, restarts and engines, because the start
span's context is stored with the flow (``Flow.trace``, the W3C ``traceparent`` text) and every
engine that later runs the flow parents its spans on it. A span is current while its step runs,
so the spans a step makes itself (an HTTP call, a query) join the flow's trace.

Attributes (docs/operating.md): ``workflow.name`` (the plan), ``workflow.id``,
``workflow.version``, ``workflow.task.name`` (the step), ``workflow.task.kind`` (``step`` or
``compensation``), ``workflow.task.attempt``, ``workflow.task.outcome`` (``continue``,
``complete``, ``park``, ``fail``, ``invalid``, ``compensated``, ``raised``, ``cancelled``) and,
when it went wrong, the span's status ``ERROR`` with ``error.type`` and the exception recorded.

What moves a parked flow from outside is in its trace too (docs/adr/0104): a wake
(`Engine.wake`, or a `Wake` of `Engine.publish`) is a span ``wake {plan}`` and a park timeout
that took the flow a span ``timeout {plan}``, both children of the start span, lasting the
write, with ``workflow.task.name`` the step the flow was at and, for a wake,
``workflow.wake.delivery`` (``RESUMED``, ``QUEUED``, ``DUPLICATE``, ``STALE``) and a link to the
caller's current span (the caller's trace is its own). A wake to no such flow has no trace.

A flow's end is in its trace (docs/adr/0128; told by the engine's observer hook, docs/adr/0138,
whose first observer `Tracing` is): when this engine writes a flow `COMPLETED`,
`FAILED` or `BLOCKED`, a span ``end {plan}`` (of no length, at the write), a child of the start
span, with ``workflow.state`` (``completed``, ``failed``, ``blocked``), ``workflow.end``
(``completed``, ``failed``, ``blocked``, ``cancelled``: a cancel that ended it at once,
``abandoned``: an operator gave up on it; a flow cancelled while it had steps to compensate ends
``failed`` once they ran, with the cancel's reason as its error), ``workflow.task.name`` (the
step it was at) and, for a failed or blocked flow, ``workflow.error`` (the stored error or why it
is blocked) and the status ``ERROR`` with that text.

Child flows (SPEC 5.7): a spawn's write is a span ``spawn {plan}`` (a child of the parent's start
span, with ``workflow.spawn.children``), and each child is started with that span's
``traceparent`` as its own (a kept child started later takes its sibling's): a child's steps and
end are spans below its parent's spawn, in the parent's trace; a child's end span names its
parent (``workflow.parent.id``).

A tracer or span processor that raises changes nothing (docs/adr/0113): every call into
OpenTelemetry is at one guarded place (`tracing_for`, `Tracing.start`, `Tracing.run` and its
`_ended`, `Tracing.moved`, `Tracing.flow_ended`), what it raises is logged (`_observe.failed`,
rate limited) and the start, step, wake, timeout or end goes on as it would without traces; a
span that could not be begun is left out, the body still runs once.

Cost: `tracing_for` decides once, when an engine opens. Traces are off (None: the engine tests
one attribute per step, per start, per wake and per publish, nothing else; the timer has no hook
at all) unless a provider is given, or the application imported OpenTelemetry and set a global
provider. Importing `ferry.flow` never imports OpenTelemetry; this module imports it only when
traces are on. Design: docs/adr/0086, 0104, 0113.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Final

from .._model._observed import FlowEnd
from .._model._types import Context, Fail, Park, _Complete, _Continue
from ._observe import TRACING, failed

if TYPE_CHECKING:
    from contextvars import Token

    from opentelemetry.context import Context as OtelContext
    from opentelemetry.trace import Span, Tracer

    from .._model._values import Flow

_NO_TRACE: Final = contextlib.nullcontext(None)
_PARENTS_MAX: Final = 10_000


def tracing_for(provider: object | None) -> Tracing | None:
    """The tracing of an engine opened with ``tracer_provider=provider``, or None (off).

    None: the application's global provider, if it imported OpenTelemetry and set one (the
    API's default proxy provider, which no SDK backs, means off). Raises `TypeError` for a
    provider without ``get_tracer``; a ``get_tracer`` that raises is logged (`failed`) and
    traces are off. Cost: a dict lookup when traces are off."""
    if provider is None:
        if "opentelemetry.trace" not in sys.modules:
            return None  # never imported: no provider can have been set
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None
    elif not callable(getattr(provider, "get_tracer", None)):
        raise TypeError(
            f"tracer_provider must be an OpenTelemetry TracerProvider (or None for the"
            f" application's global one), got {provider!r}"
        )
    try:
        return Tracing(provider.get_tracer("ferry.flow"))  # type: ignore[attr-defined]
    except Exception as exc:
        failed(TRACING, "an engine opened (the provider's get_tracer): traces are off", exc)
        return None


def starting(tracing: Tracing | None, plan: str, version: int, flow_id: str) -> Any:
    """A context manager around `Engine.start`'s write: with tracing, the start span (current
    inside), giving the ``traceparent`` to store with the flow; without, None at no cost."""
    if tracing is None:
        return _NO_TRACE
    return tracing.start(plan, version, flow_id)


def spawning(tracing: Tracing | None, flow: Flow, children: int) -> Any:
    """A context manager around the write of `flow`'s spawn of `children` child flows: with
    tracing, the span ``spawn {plan}`` (a child of the flow's start span, lasting the write),
    giving the ``traceparent`` its children are started with, so that their spans are its
    children in the parent's trace; without, None at no cost."""
    if tracing is None:
        return _NO_TRACE
    return tracing.spawn(flow, children)


def timed(
    tracing: Tracing | None,
    time_out: Callable[[str, int, float], Awaitable[tuple[Flow, Flow] | None]],
) -> Callable[[str, int, float], Awaitable[object]]:
    """The timer's ``fire(flow_id, revision, deadline)``: `time_out` itself when traces are off
    (no cost at all); with tracing, `time_out` and then, if it took the flow (it returns the
    row before and the row it wrote; None: the flow had moved on), its ``timeout`` span."""
    if tracing is None:
        return time_out

    async def fire(flow_id: str, revision: int, deadline: float) -> None:
        began = time.time_ns()
        rows = await time_out(flow_id, revision, deadline)
        if rows is not None:
            before, after = rows
            tracing.moved("timeout", after, before.step, began)

    return fire


def _outcome(result: object, compensating: bool) -> str:
    if compensating:
        return "compensated"
    if result is None or isinstance(result, _Continue):
        return "continue"
    if isinstance(result, _Complete):
        return "complete"
    if isinstance(result, Park):
        return "park"
    if isinstance(result, Fail):
        return "fail"
    return "invalid"


class Tracing:
    """An engine's tracer and what it needs of OpenTelemetry (imported here, not at module
    level: see the module doc)."""

    __slots__ = ("_api", "_context", "_parents", "_propagator", "_status", "_trace", "_tracer")

    def __init__(self, tracer: Tracer) -> None:
        from opentelemetry import context as api
        from opentelemetry import trace
        from opentelemetry.context import Context as OtelContext
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer
        self._trace = trace
        self._api = api
        self._context = OtelContext
        self._status = trace.Status, trace.StatusCode
        self._propagator = TraceContextTextMapPropagator()
        # Start contexts by `traceparent`, so that a flow's steps parse it at most once (those
        # started here are never parsed); contexts are immutable. Cleared at `_PARENTS_MAX`.
        self._parents: dict[str, OtelContext] = {}

    @contextlib.contextmanager
    def start(self, plan: str, version: int, flow_id: str) -> Iterator[str | None]:
        """The span of one `Engine.start` (a child of the caller's current span), current while
        the start is written; yields its ``traceparent`` text (None if the span could not be
        begun: the flow is stored without one, as with traces off)."""
        span: Span | None = None
        token: Token[OtelContext] | None = None
        traceparent: str | None = None
        try:
            span = self._tracer.start_span(
                f"start {plan}",
                attributes={
                    "workflow.name": plan,
                    "workflow.id": flow_id,
                    "workflow.version": version,
                },
            )
            token = self._api.attach(self._trace.set_span_in_context(span))
            carrier: dict[str, str] = {}
            self._propagator.inject(carrier)
            traceparent = carrier.get("traceparent")
            if traceparent is not None:
                self._remember(traceparent, self._trace.set_span_in_context(span, self._context()))
        except Exception as exc:
            failed(TRACING, f"beginning the span of starting flow {flow_id!r}", exc)
            traceparent = None
        with self._closing(span, token, f"ending the span of starting flow {flow_id!r}"):
            yield traceparent

    @contextlib.contextmanager
    def spawn(self, flow: Flow, children: int) -> Iterator[str | None]:
        """The span of writing `flow`'s spawn (see `spawning`); yields its ``traceparent``
        (None if the span could not be begun: the children then join the parent's trace at
        its start span, as a flow's steps do)."""
        span: Span | None = None
        traceparent: str | None = None
        try:
            attributes: dict[str, str | int] = {
                "workflow.name": flow.plan,
                "workflow.id": flow.flow_id,
                "workflow.version": flow.version,
                "workflow.spawn.children": children,
            }
            if flow.step is not None:
                attributes["workflow.task.name"] = flow.step
            span = self._tracer.start_span(
                f"spawn {flow.plan}", context=self._parent(flow.trace), attributes=attributes
            )
            context = self._trace.set_span_in_context(span, self._context())
            carrier: dict[str, str] = {}
            self._propagator.inject(carrier, context=context)
            traceparent = carrier.get("traceparent")
            if traceparent is not None:
                self._remember(traceparent, context)
        except Exception as exc:
            failed(TRACING, f"beginning the span of the spawn of flow {flow.flow_id!r}", exc)
            traceparent = None
        with self._closing(span, None, f"ending the span of the spawn of {flow.flow_id!r}"):
            yield traceparent

    @contextlib.contextmanager
    def _closing(
        self, span: Span | None, token: Token[OtelContext] | None, what: str
    ) -> Iterator[None]:
        """End `span` (and detach `token`) when the block ends, with the error it raised."""
        error: Exception | None = None
        try:
            yield
        except Exception as exc:
            error = exc
            raise
        finally:
            self._close(span, token, error, what)

    def _close(
        self,
        span: Span | None,
        token: Token[OtelContext] | None,
        error: Exception | None,
        what: str,
    ) -> None:
        """Detach `token` and end the start `span` (recording `error`), guarded."""
        try:
            try:
                if token is not None:
                    self._api.detach(token)
            finally:
                if span is not None:
                    if error is not None:
                        status, code = self._status
                        span.record_exception(error)
                        span.set_status(status(code.ERROR, f"{type(error).__name__}: {error}"))
                    span.end()
        except Exception as exc:
            failed(TRACING, what, exc)

    def _remember(self, traceparent: str, context: OtelContext) -> OtelContext:
        if len(self._parents) >= _PARENTS_MAX:
            self._parents.clear()
        self._parents[traceparent] = context
        return context

    def _parent(self, parent: str | None) -> OtelContext:
        """The context of a flow's start span from its stored ``traceparent`` (None, or one
        that does not parse: an empty context, so the span is a root of its own)."""
        if parent is None:
            return self._context()
        known = self._parents.get(parent)
        if known is not None:
            return known
        carrier = {"traceparent": parent}
        return self._remember(parent, self._propagator.extract(carrier, self._context()))

    @staticmethod
    def now() -> int:
        """The time a wake or a timeout began (nanoseconds since the epoch, as spans count)."""
        return time.time_ns()

    def moved(
        self, kind: str, flow: Flow, step: str | None, began: int, delivery: str | None = None
    ) -> None:
        """A span ``{kind} {plan}`` (``wake`` or ``timeout``) in `flow`'s trace, from `began`
        (`now`) to now: `flow` is the row written, `step` the step the flow was at. A wake's
        span says its `delivery` and links to the caller's current span, if it has one. Never
        raises (what OpenTelemetry raises is `failed`)."""
        try:
            self._moved(kind, flow, step, began, delivery)
        except Exception as exc:
            failed(TRACING, f"making the {kind} span of flow {flow.flow_id!r}", exc)

    def _moved(
        self, kind: str, flow: Flow, step: str | None, began: int, delivery: str | None
    ) -> None:
        attributes: dict[str, str | int] = {
            "workflow.name": flow.plan,
            "workflow.id": flow.flow_id,
            "workflow.version": flow.version,
        }
        if step is not None:
            attributes["workflow.task.name"] = step
        links = None
        if delivery is not None:
            attributes["workflow.wake.delivery"] = delivery
            caller = self._trace.get_current_span().get_span_context()
            if caller.is_valid:
                links = [self._trace.Link(caller)]
        span = self._tracer.start_span(
            f"{kind} {flow.plan}",
            context=self._parent(flow.trace),
            attributes=attributes,
            links=links,
            start_time=began,
        )
        span.end()

    def flow_ended(self, flow: FlowEnd) -> None:
        """The span ``end {plan}`` of `flow`, which this engine wrote `COMPLETED`, `FAILED` or
        `BLOCKED` (the engine's observer hook, `flow.Observer.flow_ended`: `FlowEnd.how` is how
        it ended, see the module doc). Never raises (what OpenTelemetry raises is `failed`)."""
        try:
            end = flow.how
            attributes: dict[str, str | int] = {
                "workflow.name": flow.plan,
                "workflow.id": flow.flow_id,
                "workflow.version": flow.version,
                "workflow.state": flow.state.name.lower(),
                "workflow.end": end,
            }
            if flow.step is not None:
                attributes["workflow.task.name"] = flow.step
            if flow.parent is not None:
                attributes["workflow.parent.id"] = flow.parent
            error = flow.error
            if end != "completed" and error is not None:
                attributes["workflow.error"] = error
            now = time.time_ns()
            span = self._tracer.start_span(
                f"end {flow.plan}",
                context=self._parent(flow.traceparent),
                attributes=attributes,
                start_time=now,
            )
            if end != "completed":
                status, code = self._status
                span.set_status(status(code.ERROR, error or end))
            span.end(end_time=now)
        except Exception as exc:
            failed(TRACING, f"making the end span of flow {flow.flow_id!r}", exc)

    async def run(
        self,
        fn: Callable[[Context], Awaitable[Any]],
        ctx: Context,
        parent: str | None,
        compensating: bool,
    ) -> Any:
        """``await fn(ctx)`` (a step or a compensation) inside its span, whose parent is the
        flow's start span (`parent`, a ``traceparent``; None: a root of its own). `fn` runs
        once whatever OpenTelemetry raises (`failed`: then without its span, or with a span
        that may not be exported); what `fn` returns or raises is this call's."""
        kind = "compensation" if compensating else "step"
        try:
            span = self._tracer.start_span(
                f"{'compensate' if compensating else 'step'} {ctx.plan}.{ctx.step}",
                context=self._parent(parent),
                attributes={
                    "workflow.name": ctx.plan,
                    "workflow.id": ctx.flow_id,
                    "workflow.version": ctx.version,
                    "workflow.task.name": ctx.step,
                    "workflow.task.kind": kind,
                    "workflow.task.attempt": ctx.attempt,
                },
            )
            token = self._api.attach(self._trace.set_span_in_context(span))
        except Exception as exc:
            failed(TRACING, f"beginning the span of {kind} {ctx.step!r}", exc)
            return await fn(ctx)
        try:
            result = await fn(ctx)
        except Exception as exc:
            self._ended(span, token, ctx, "raised", exc)
            raise
        except BaseException:  # cancelled: the run is void, and runs again
            self._ended(span, token, ctx, "cancelled", None)
            raise
        self._ended(span, token, ctx, _outcome(result, compensating), result)
        return result

    def _ended(
        self, span: Span, token: Token[OtelContext], ctx: Context, outcome: str, what: object
    ) -> None:
        """The end of a run's span: no longer current, its `outcome` (`what`: the exception
        raised, or the result) and status, ended. Never raises (`failed`)."""
        try:
            try:
                self._api.detach(token)
                span.set_attribute("workflow.task.outcome", outcome)
                status, code = self._status
                if outcome == "raised":
                    assert isinstance(what, Exception)
                    span.record_exception(what)
                    span.set_attribute("error.type", type(what).__qualname__)
                    span.set_status(status(code.ERROR, f"{type(what).__name__}: {what}"))
                elif outcome == "fail":
                    assert isinstance(what, Fail)
                    span.set_status(status(code.ERROR, what.reason))
                elif outcome == "invalid":
                    span.set_attribute("error.type", "invalid outcome")
                    span.set_status(status(code.ERROR, f"returned {what!r}, not an outcome"))
            finally:
                span.end()
        except Exception as exc:
            failed(TRACING, f"ending the span of step {ctx.step!r} of flow {ctx.flow_id!r}", exc)
