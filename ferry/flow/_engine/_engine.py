"""The public flow engine: `Engine`, the API and its choreography; it checks input and delegates
to the parts that do the work.

Where each job lives: the map of the package's folders, docs/flow.md ("The folders"). Calls go
one way, down the folders; a part reaches another only through the methods it was given at
construction (`_parts.Parts` wires them), and no part imports this module.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar, final

import stm
from ferry import Closed
from ferry._errors import wrong_run
from ferry.projected import Store
from stm._internal import NoPublicConstructor

from .._model import _checks, _values
from .._model._errors import UnknownFlow
from .._model._limits import Queue
from .._model._plan import Plan
from .._model._types import Delivery, Event, FlowStatistics, Json, Snapshot, Start, Wake
from .._runtime._config import Config
from .._runtime._requests import check_mapper
from .._store import _family, _store
from ._observer import Observer, bind_one
from ._parts import Parts
from ._signals import SignalReads

T = TypeVar("T")

_log = logging.getLogger("ferry.flow")


_thread_id = threading.get_ident


_SYNC = ("on", "statistics", "add_observer", "remove_observer")


def _wrong_run(method: str) -> RuntimeError:
    run = "run_sync" if method in _SYNC else "run"
    hint = f"trio.from_thread.{run}(engine.{method}, ..., trio_token=token)"
    return wrong_run(f"flow.Engine.{method}", "an engine", hint)


@final
class Engine(SignalReads, metaclass=NoPublicConstructor):
    """Runs the flows of one store. Made by `open_engine`; no public constructor.

    Every async method is a checkpoint and raises `ferry.Closed` once the engine is closed.
    Only the tasks of the trio run that opened the engine may call it: a call from another
    run or thread raises `RuntimeError` (use ``trio.from_thread.run(..., trio_token=...)``).
    A database error in a write is raised as `ferry.Failed` (its `__cause__` is the error);
    nothing of that call was written then, unless the error came while committing (unknown).
    """

    def __init__(
        self, store: Store, plans: dict[tuple[str, int], Plan], config: Config, parts: Parts
    ) -> None:
        self._store = store
        self._plans = plans
        self._owner = config.owner
        self._serve = config.serve  # False: an operator's engine, which never leases or runs
        self._parts = parts
        self._closed_tv = parts.closed
        # The waits (`_waiters`), and the map of the flows this engine holds, which tells them.
        self._waiters = parts.waiters
        self._requests = parts.requests
        self._shapes = parts.versions.shapes
        self._tally = parts.tally
        self._live = parts.writes.live  # the live flows (read only here)
        self._closing = False
        self._mappers: dict[str, list[Callable[[Json], object]]] = {}
        self._thread = _thread_id()  # of the run that opened it: only its tasks may call it

    def _close(self) -> None:
        """The block ends: calls raise `ferry.Closed`, waiters wake, no flow gets a runner."""
        self._closing = True
        self._parts.close()
        self._parts.feeds.close()
        stm.atomically_nowait(self._closed_tv.set, True)

    def _check(self, method: str) -> None:
        """Raise unless `method` is called by a task of the engine's own run, while it is open.
        Cheap: one thread id compared (a thread runs one trio run at a time, so while the
        engine is open, "this thread" is "its run"), as ferry's own calls do."""
        if _thread_id() != self._thread:
            raise _wrong_run(method)
        if self._closing:
            raise Closed(
                f"Engine.{method}: the flow engine is closed (its `async with open_engine(...)`"
                " block has ended); call the engine inside that block"
            )

    async def _read(self, fn: Callable[[Any], T], what: str) -> T:
        """A read of an API call (`Requests.read`): a store error is `ferry.Failed`."""
        return await self._requests.read(fn, what)

    # ----------------------------------------------------------------------------- the calls

    async def start(
        self,
        plan: Plan,
        *,
        flow_id: str | None = None,
        data: dict[str, Json] | None = None,
        deadline: float | None = None,
        priority: int = 0,
        delay: float | None = None,
        at: float | None = None,
    ) -> str:
        """Start a flow of `plan`; durable when this returns; returns its id.

        `flow_id` defaults to a new uuid4 hex. Idempotent: the same id with the same plan and
        data returns the id and runs nothing again. `deadline`: seconds (finite, > 0) after
        which the whole flow, its children included, is cancelled with reason ``"deadline"``
        wherever it is (`Snapshot.deadline` is the wall-clock time). Raises `UnknownPlan` (a
        plan not given to `open_engine`), `IdReused` (the id names a flow of another plan or
        other start data), `TypeError` (data not a JSON object, a deadline not a number),
        `ValueError` (a deadline not finite and > 0); nothing is stored then.

        Flow control (SPEC 5.8): a flow of a plan with ``limits=`` starts `State.QUEUED` and
        runs when its plan's limits let it; `priority` (an int, lower first). `delay` (seconds
        from now, >= 0) or `at` (a wall-clock time, ``time.time()``'s) keep a flow of any plan
        `QUEUED` until then. Bad options (`delay` and `at` both, a delay < 0, a key function
        that raises or returns a non-str) are `TypeError`/`ValueError`.
        """
        self._check("start")
        queue = Queue(priority, delay, at)
        return await self._requests.start(plan, flow_id, data, deadline, queue)

    async def wake(
        self, flow_id: str, payload: Json = None, *, message_id: str | None = None
    ) -> Delivery:
        """Put a message in the flow's durable mailbox; durable when this returns.

        Returns `Delivery.RESUMED` (the flow was parked and now runs its next step with
        ``ctx.wake = payload``), `QUEUED` (kept: its next park takes it at once), `DUPLICATE`
        (`message_id` was delivered before), `STALE` (completed, failed or compensating) or
        `UNKNOWN`. Time wins at the deadline: a wake at or after a parked flow's deadline meets
        the timeout first (`STALE` if it then compensates, `QUEUED` if it runs on).
        Raises `TypeError` for a payload that is not JSON or a bad id, `ValueError` for an empty
        or unstorable one (nothing stored).
        """
        self._check("wake")
        return await self._requests.wake(flow_id, payload, message_id)

    def on(self, event_type: str, mapper: Callable[[Json], object]) -> None:
        """Register `mapper` for `event_type` (choreography). No checkpoint.

        ``mapper(event)`` is a plain function returning `Wake`, `Start`, `IGNORE` or None;
        several mappers of one type run in registration order.
        """
        self._check("on")
        check_mapper(event_type, mapper)
        self._mappers.setdefault(event_type, []).append(mapper)

    async def publish(self, event_type: str, event: Json) -> list[Delivery | str | None]:
        """Apply every mapper of `event_type` to `event`; one result per mapper, in order.

        A `Wake` is delivered (its `Delivery`), a `Start` started (its flow id), `IGNORE`/None
        gives None. Every mapper runs and every decision is checked (type, JSON, plan) before
        any is applied: a mapper that returns anything else raises `TypeError` and nothing is
        applied. All or nothing: the decisions are applied in one transaction, and if one
        cannot be (a `Start` whose id is taken: `IdReused`), none is and that error is raised;
        a database error raises `ferry.Failed`, nothing applied. Events are at-least-once:
        give wakes a `message_id` (the event's id).

        The event is checked like a payload before any mapper sees it, whether or not a mapper
        uses it: `TypeError` if it is not JSON (a set, bytes, NaN), `ValueError` if it cannot be
        stored (nested deeper than 64 levels, a lone surrogate, larger than `max_data_bytes`);
        nothing is applied then.
        """
        self._check("publish")
        if not isinstance(event_type, str):
            raise TypeError(f"event_type must be a str, got {event_type!r}")
        self._requests.event(event_type, event)
        decisions: list[Wake | Start | None] = []
        for mapper in self._mappers.get(event_type, ()):
            decision = mapper(event)
            try:
                decisions.append(self._requests.decision(decision))
            except (TypeError, ValueError) as exc:
                raise type(exc)(
                    f"mapper {mapper!r} for {event_type!r} returned {decision!r}: {exc};"
                    " nothing was applied"
                ) from None
        return await self._requests.publish(decisions)

    async def wait(self, flow_id: str, *, timeout: float | None = None) -> Snapshot:  # noqa: ASYNC109
        """Until the flow is `COMPLETED`, `FAILED` or `BLOCKED`; its snapshot then.

        No polling (docs/adr/0096): a flow this engine runs is followed in its memory (an stm
        retry on the engine's state, no read); on SQLite, so is every flow (one engine writes
        the file). On a fleet, a flow another engine runs, or a parked one, is read once, then
        again when a PostgreSQL notification says it settled, and at most once per lease
        besides. A store that is unavailable is retried until the timeout. Raises `UnknownFlow`,
        `trio.TooSlowError` after `timeout` seconds (its message says where the flow still is),
        `ferry.Failed` if the store failed for another reason, or was unavailable until the
        timeout before the flow could be read once, `ferry.Closed` if the engine closes
        meanwhile.
        """
        self._check("wait")
        return _values.snapshot(await self._waiters.wait(_checks.flow_id(flow_id), timeout))

    async def get(self, flow_id: str) -> Snapshot | None:
        """The flow's durable state, read from the store (with the child ids of its latest
        spawn, `Snapshot.children`); None if there is no such flow."""
        self._check("get")
        fid = _checks.flow_id(flow_id)
        read = partial(_family.snapshot_of, flow_id=fid)
        found = await self._read(read, f"reading flow {fid!r}")
        return None if found is None else _values.snapshot(*found)

    async def cancel(self, flow_id: str, reason: str = "cancelled") -> bool:
        """Stop a running or parked flow and compensate its completed steps; durable on return.

        A running step is cancelled and its changes discarded. Returns False (nothing changes)
        for a flow that is terminal, compensating, blocked or unknown.
        """
        self._check("cancel")
        return await self._requests.cancel(flow_id, reason)

    async def resume(self, flow_id: str) -> bool:
        """Re-drive a `BLOCKED` flow from where it stopped (a step or compensation runs again as
        attempt + 1; a park is restored). False if it is not blocked, unknown, or its plan
        version is still not registered."""
        self._check("resume")
        return await self._requests.resume(flow_id)

    async def abandon(self, flow_id: str, *, reason: str, by: str | None = None) -> bool:
        """Give up on a `BLOCKED` flow: it ends `FAILED` at once, without running the
        compensations left on its stack (the one that keeps failing among them); durable on
        return. For a compensation that can never succeed (a refund to a closed account) once
        its effect was handled by hand: `resume` would only run it again.

        The history's ``abandoned`` event records `reason`, `by` (who; None records "an
        operator"), why the flow was blocked and which compensations were skipped; the flow's
        `error` says it was abandoned. Returns False (nothing changes) for a flow that is not
        blocked or unknown. Raises `TypeError`/`ValueError` for a `reason` or `by` that is not
        a non-empty str that can be stored.
        """
        self._check("abandon")
        return await self._requests.abandon(flow_id, reason, by)

    async def history(self, flow_id: str) -> list[Event]:
        """Every durable transition of the flow, in order. Raises `UnknownFlow`."""
        self._check("history")
        fid = _checks.flow_id(flow_id)
        read = partial(_store.load_history, flow_id=fid)
        events = await self._read(read, f"reading the history of flow {fid!r}")
        if events is None:
            raise UnknownFlow(f"no flow has id {fid!r}")
        return events

    # ------------------------------------------------------------------ schedules (SPEC 5.9)

    async def trigger(self, name: str) -> str | None:
        """Start one run of the stored schedule `name` now, paused or not, under its `overlap`
        rule: the flow ``f"{name}@{T}"``, T the current second; durable on return. Returns its
        id (a second trigger within that second is the same flow: nothing runs again), or
        None when the rule did not start it (``"skip"``: counted as skipped; ``"queue"``: it
        waits for the schedule's flow to end). Raises `UnknownSchedule`."""
        self._check("trigger")
        return await self._parts.schedules.trigger(name)

    async def pause(self, name: str) -> None:
        """Stop the schedule's ticks (its flows go on; `trigger` still starts one). Raises
        `UnknownSchedule`."""
        self._check("pause")
        await self._parts.schedules.pause(name)

    async def unpause(self, name: str) -> None:
        """Tick again, from the first tick after now (the ticks of the pause are neither
        started nor counted as missed). Raises `UnknownSchedule`."""
        self._check("unpause")
        await self._parts.schedules.unpause(name)

    async def unschedule(self, name: str) -> None:
        """Remove the stored schedule (its flows stay); declaring it again starts it afresh.
        Raises `UnknownSchedule`."""
        self._check("unschedule")
        await self._parts.schedules.unschedule(name)

    async def backfill(self, name: str, start: float, end: float) -> int:
        """Start, oldest first, a flow for every tick T of the schedule with ``start <= T <=
        end`` (wall-clock seconds) that has none yet, whatever `overlap` says; how many it
        started. `ValueError` for a span of more than 10,000 ticks; `UnknownSchedule`."""
        self._check("backfill")
        return await self._parts.schedules.backfill(name, start, end)

    def add_observer(self, observer: Observer) -> None:
        """Tell `observer` (a `flow.Observer`) of what this engine does from now on, after the
        observers it has. No checkpoint. Raises `TypeError` for something that is not an
        observer, `ValueError` for one it has already, `ferry.Closed` once closed."""
        self._check("add_observer")
        bound = bind_one(observer, "the observer")
        if any(b.observer is observer for b in self._tally.observers):
            raise ValueError(f"{observer!r} already observes this engine")
        self._tally.observers = (*self._tally.observers, bound)

    def remove_observer(self, observer: Observer) -> bool:
        """Stop telling `observer` anything; False if it was not observing this engine. No
        checkpoint. Allowed after the engine closed (from any thread then)."""
        if _thread_id() != self._thread and not self._closing:
            raise _wrong_run("remove_observer")
        kept = tuple(b for b in self._tally.observers if b.observer is not observer)
        removed = len(kept) != len(self._tally.observers)
        self._tally.observers = kept
        return removed

    def statistics(self) -> FlowStatistics:
        """Gauges and counters of this engine (see `FlowStatistics`). No checkpoint; O(flows
        this engine runs) (its `compensating` are counted).

        Readable after the engine closed; while it is open, only from its own run's tasks
        (`RuntimeError` otherwise)."""
        if _thread_id() != self._thread and not self._closing:
            raise _wrong_run("statistics")
        return self._statistics()

    def _statistics(self) -> FlowStatistics:
        """`statistics()` from any thread (`ferry.metrics` reads it while serving a scrape):
        it copies a few integers and two dicts whose keys never change, and counts the
        compensating flows among a copy of the live ones (one C call copies them)."""
        return self._parts.statistics()

    def __repr__(self) -> str:
        return f"<flow.Engine running={len(self._live)} parked={self._tally.parked}>"
