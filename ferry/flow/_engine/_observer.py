"""The public observer hook (docs/adr/0138): `Observer`, the methods an engine calls on what
happened, and `bind`, which checks what `open_engine(observers=...)` and `Engine.add_observer`
are given and looks each hook up once.

Every method of the protocol is optional. An observer is any object with one or more of them
(`_observe.HOOKS`); a subclass of `Observer` inherits a no-op for each one it leaves out, and the
engine does not call those. A later version adds a method to `Observer` (a child flow started,
a wake queued, a schedule fired): observers written before it lack it, or inherit its no-op,
and are not called for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from .._model._observed import FlowEnd, ScheduleTick, StepRun
from .._runtime._observe import HOOKS, Bound

if TYPE_CHECKING:
    from ._engine import Engine


class Observer:
    """What an engine tells of what happened, for metrics, traces or an application's own
    bookkeeping: give one to `open_engine(..., observers=[...])` (it sees everything from the
    open on) or `Engine.add_observer` (from then on).

    Subclass it and override the methods you need (the others are no-ops the engine does not
    call), or pass any object that has one or more of these methods. They are called on the
    engine's trio thread, in the order the engine's writes committed, and must not block or
    await (count, or hand the record to a queue). What one raises is logged on ``ferry.flow``
    (a WARNING, at most one a minute) and changes nothing a flow or a caller sees.

    New kinds of events are new methods with a no-op here: an observer written today keeps
    working, and is not called for them."""

    __slots__ = ()

    def step_ran(self, step: StepRun) -> None:
        """An attempt of a step or of a compensation returned or raised (`StepRun`)."""

    def flow_ended(self, flow: FlowEnd) -> None:
        """This engine wrote a flow `COMPLETED`, `FAILED` or `BLOCKED` (`FlowEnd`)."""

    def schedule_ticked(self, tick: ScheduleTick) -> None:
        """This engine fired a schedule: a tick, a waiting tick, a trigger or a backfill
        started its flows, or passed ticks over as skipped or missed (`ScheduleTick`)."""

    def engine_opened(self, engine: Engine) -> None:
        """`engine`, given this observer at `open_engine`, opens: called once, before it
        recovers or runs any step. Not called by `Engine.add_observer` (the engine is open
        then)."""

    def engine_closed(self, engine: Engine) -> None:
        """`engine`'s block has ended: it will not run, write or count anything again (its
        `Engine.statistics` are final). Called once, after the engine let go of its flows."""


def _hook(observer: object, name: str, where: str) -> Callable[[Any], None] | None:
    """`observer`'s method `name`, or None (it has none, or the no-op of `Observer`)."""
    if isinstance(observer, Observer) and getattr(type(observer), name) is getattr(Observer, name):
        return None
    hook = getattr(observer, name, None)
    if hook is not None and not callable(hook):
        raise TypeError(
            f"{where} is {observer!r}, whose {name} is {hook!r}: an observer's {name} must be a"
            " method (see flow.Observer)"
        )
    return cast("Callable[[Any], None] | None", hook)


def bind_one(observer: object, where: str) -> Bound:
    """`observer`'s hooks; `TypeError` naming it (`where`) if it is not an observer."""
    if isinstance(observer, type):
        raise TypeError(
            f"{where} is the class {observer.__qualname__}, not an observer: pass an instance"
            f" ({observer.__qualname__}())"
        )
    hooks = {name: _hook(observer, name, where) for name in HOOKS}
    if not isinstance(observer, Observer) and all(h is None for h in hooks.values()):
        raise TypeError(
            f"{where} is {observer!r} ({type(observer).__qualname__}), not an observer: an"
            f" observer is a flow.Observer, or has one or more of the methods {', '.join(HOOKS)}"
        )
    return Bound(observer, **hooks)


def bind(observers: object) -> tuple[Bound, ...]:
    """What `open_engine(observers=...)` was given, checked and looked up: `TypeError` for a
    value that is not a list of observers, or an item that is not one (naming it), `ValueError`
    for one given twice."""
    if isinstance(observers, str | bytes) or not isinstance(observers, Iterable):
        raise TypeError(f"observers must be a list of flow.Observer objects, got {observers!r}")
    bound: list[Bound] = []
    for i, observer in enumerate(observers):
        for j, other in enumerate(bound):
            if other.observer is observer:
                raise ValueError(f"observers[{i}] is observers[{j}] again: give each one once")
        bound.append(bind_one(observer, f"observers[{i}]"))
    return tuple(bound)
