"""The trio shell of `ferry.flow`: `open_engine`, `Engine`, the runners, the timer and recovery.

Design
------
The machine (`_machine`) decides, the store (`_store`) records, and this module only moves flows
between them (docs/adr/0020). Every durable change of every flow, whoever asks for it (the task
running the flow, a wake, a timer, a cancel, a resume, recovery), is one store op: a pure
transition run on the flow's row inside the transaction that records it, compare-and-set on the
row's revision. The ops go through one plain ferry whose batch call runs a whole batch in one
`store.transact` (`_store.write_batch`): concurrent flows share transactions (group commit), and
an op whose compare-and-set fails is answered alone with `Conflict` while the others commit
(docs/adr/0022).

What the engine holds in memory follows the commits, in commit order: the batch call applies each
result (`Engine._applied`) before it answers anyone. A flow that is `RUNNING` or `COMPENSATING`
is *live*: a `_Live` record in `_live`, driven by one runner task (or waiting for one). A flow
that leaves those states is dropped from memory at once: a parked flow holds no task and no
coroutine, only an entry in the timer heap if it has a deadline. A write that someone else made
to a live flow (a cancel) replaces the runner's copy and cancels the step it runs; the runner's
own next write then fails its compare-and-set, and it carries on from the new state.

In stm TVars: the scheduler (`_Sched`: running count and the FIFO of flows waiting for one of
`max_running` slots), the timer heap (`_timers`, one task sleeping in ``retry(deadline=)`` on its
top, docs/adr/0023), the closed flag, and the watches of `wait` (`_waiters`: the flows somebody
waits for, followed through `_track` and the map of live flows, `_waiters.Held`; on a fleet also
through PostgreSQL notifications, docs/adr/0096).

Durable times are wall-clock seconds: ``time.time()`` at open plus `trio.current_time()` elapsed
since, so `trio.testing.MockClock` drives hour-long parks in a test. Attempts: a retry writes
attempt + 1 before it runs, and recovery writes attempt + 1 before re-running a step that was
running when the process died or the engine closed (docs/adr/0024). An SQLite file is served by
one engine at a time (an ``flock`` on the database file itself, `_sqlite_file`, docs/adr/0065).

The fleet (PostgreSQL, docs/flow-fleet.md): an engine holds a lease of its own, one row renewed
every ``lease / 3`` (`_heartbeat_loop`), and runs the active flows whose row names it (`_mine`).
Who holds a flow after a write is one pure rule (`_machine.leased`, via `_leasing`). Every
``lease / 3`` it also scans (`_scan`): orphans (active flows nobody holds) are taken over by a
compare-and-set, and the deadlines of flows parked by any engine are armed. An engine that could
not renew in time lets its flows go and releases them with its next renewal (each at the
revision it let go); a flow it holds but does not run is adopted (docs/adr/0040-0043). A renewal
after the lease may have lapsed starts a new epoch: no copy from before it runs a body until it
has been read again (`_heartbeat`, `_confirm`, docs/adr/0047). ``serve=False`` makes an
operator's engine, which runs and leases nothing (docs/adr/0044).

At the fleet's edges (docs/adr/0071-0075): each opening is an incarnation of its owner name
(`_claim`: `StoreLocked` while another live one holds it); on PostgreSQL a thread renews the
lease without the trio loop (`_heartbeat.Keeper`); every body runs under a deadline at the
lease's margin, moved on with each renewal (`_trust_deadline`, `_retrust`), so a loop that
wakes after a lapse cancels its steps before they go on (`_lose_all`); a flow of a version this
engine lacks and a live engine has is left to that engine (`_versioned`, `_elsewhere`).

Parts of their own, hooked in here: retention (`_retention.Retention`, a task of a serving
engine that deletes finished flows, docs/adr/0085) and traces (`_tracing`: a span around
`start`'s write and around every step or compensation run, docs/adr/0086).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from types import TracebackType
from typing import Any, NoReturn, TypeVar, final

import attrs
import trio
from pyrsistent import PVector, pvector

import stm
from ferry import Closed, Failed, open_ferry
from ferry.projected import SqliteStore, Store

from . import _checks, _heartbeat, _lease, _retention, _retry, _store, _tracing, _waiters
from . import _machine as m
from . import _timers as timers
from ._apart import write_apart
from ._errors import IdReused, StoreLocked, UnknownFlow, UnknownPlan
from ._machine import Flow, Mailbox, Message, Shape, Transition
from ._observe import Observer
from ._plan import Plan, StepDef
from ._sqlite_file import EngineLock, check_path
from ._types import (
    IGNORE,
    Context,
    Delivery,
    Event,
    FlowStatistics,
    Json,
    Park,
    Snapshot,
    Start,
    State,
    Wake,
)

T = TypeVar("T")

_log = logging.getLogger("ferry.flow")

_RUNNING = State.RUNNING
_COMPENSATING = State.COMPENSATING
_PARKED = State.PARKED
_ACTIVE = m.ACTIVE
_ENDS = {State.COMPLETED: "completed", State.FAILED: "failed", State.BLOCKED: "blocked"}
_BACKOFF = 0.1  # seconds before the first retry of a step; doubles with every retry
_BATCH_SIZE = 1000
_LEASE_MARGIN = 0.1  # of the lease: an engine lets its flows go this long before it lapses
_PRUNE_EVERY = 100  # scans between two prunings of the engines table
_PRUNE_AFTER = 100  # leases: an engine gone that long and holding no flow is forgotten
_SCAN_LIMIT = 1000  # orphans taken over per scan, at most
_GUARD = 1 / 4  # of the lease: how long a fleet engine's transaction may sit idle (locks held)
_GUARD_MIN = 0.5


_ROLLBACK_RETRIES = 3
_thread_id = threading.get_ident


def _rolled_back(exc: BaseException) -> bool:
    """Did the database roll the transaction back on its own (SQLSTATE class 40: a deadlock, a
    serialization failure)? Then nothing of it was written, and running it again is safe."""
    return str(getattr(exc, "sqlstate", None) or "").startswith("40")


def _transient(exc: BaseException) -> bool:
    """Is `exc` the store failing for now (unavailable, or a write the ferry could not get
    through: `ferry.Failed`), also as an exception group of those? A scan or a check that meets
    one tries again at its next round; anything else is a bug and is raised."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_transient(e) for e in exc.exceptions)
    return isinstance(exc, Failed) or _retry.unavailable(exc)


def _wrong_run(method: str) -> RuntimeError:
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        where = "outside any trio run (a plain thread)"
    else:
        where = "from a task of another trio run"
    run = "run_sync" if method in ("on", "statistics") else "run"
    return RuntimeError(
        f"flow.Engine.{method} was called {where}: an engine belongs to the trio run that"
        " opened it, and only that run's tasks may call it. From another thread, call it in"
        f" its run: trio.from_thread.{run}(engine.{method}, ..., trio_token=token), with the"
        " token of that run (trio.lowlevel.current_trio_token() there)"
    )


_LOGGED = frozenset({State.FAILED, State.BLOCKED})


def _log_ended(before: Flow, after: Flow) -> None:
    """INFO: this engine's write left the flow `FAILED` or `BLOCKED` (an operator may act)."""
    why = after.blocked if after.state is State.BLOCKED else after.error
    _log.info(
        "flow %r (plan %r v%d) is %s at step %r (attempt %d): %s",
        after.flow_id,
        after.plan,
        after.version,
        after.state.name,
        before.step,
        before.attempt,
        why,
        extra={
            "flow_id": after.flow_id,
            "plan": after.plan,
            "step": before.step,
            "attempt": before.attempt,
            "state": after.state.name,
            "error": why,
        },
    )


def _named(flow: Flow) -> str:
    """The flow, its plan, step and attempt, for a log line or an error."""
    return (
        f"flow {flow.flow_id!r} (plan {flow.plan!r} v{flow.version}, step {flow.step_index}"
        f" {flow.step!r}, attempt {flow.attempt}, {flow.state.name})"
    )


def _about(flow: Flow) -> dict[str, object]:
    """The `extra=` of a log record about the flow."""
    return {
        "flow_id": flow.flow_id,
        "plan": flow.plan,
        "step": flow.step,
        "attempt": flow.attempt,
    }


def _backoff(failures: int) -> float:
    return _BACKOFF * 2.0 ** (failures - 1)


class _Unseen(Exception):
    """Raised by a transition for a plan version the engine has not seen in the fleet yet
    (`Engine._versioned`): nothing is written, and the request runs again on a fresh read."""


# ------------------------------------------------------------------------------- in-memory state


class _Live:
    """A flow that is running or compensating in this engine (or waiting for a runner slot)."""

    __slots__ = ("began", "epoch", "flow", "scope")

    def __init__(self, flow: Flow, epoch: int) -> None:
        self.flow = flow  # the latest committed row this engine knows
        self.scope: trio.CancelScope | None = None  # around the running step or compensation
        # The revision of the row whose run (of its step or compensation) began in this engine:
        # a flow whose current row's run has not begun is let go at close (`_let_go_unbegun`).
        self.began = 0
        # The fleet: the engine's `_epoch` when the write or read that gave `flow` began. A
        # copy from an older epoch may predate a lapse of the lease: it is re-read before a
        # body runs on it (`_confirm`).
        self.epoch = epoch


@attrs.frozen
class _Sched:
    """Runner slots: `running` runners, and the flows waiting for one (FIFO: queue[head:])."""

    running: int = 0
    queue: PVector[_Live] = attrs.field(factory=pvector)
    head: int = 0

    @property
    def waiting(self) -> int:
        return len(self.queue) - self.head


_COUNTERS = (
    "completed",
    "failed",
    "blocked",
    "steps_run",
    "step_retries",
    "compensations_run",
    "writes",
    "write_batches",
    "conflicts",
    "recovered",
    "claimed",
    "lost",
    "renewals",
)


# ------------------------------------------------------------------------------------ the engine


@final
class Engine:
    """Runs the flows of one store. Made by `open_engine`; no public constructor.

    Every async method is a checkpoint and raises `ferry.Closed` once the engine is closed.
    Only the tasks of the trio run that opened the engine may call it: a call from another
    run or thread raises `RuntimeError` (use ``trio.from_thread.run(..., trio_token=...)``).
    A database error in a call is raised as `ferry.Failed` (its `__cause__` is the error);
    nothing of that call was written then, unless the error came while committing (unknown).
    """

    def __init__(
        self,
        store: Store,
        plans: dict[tuple[str, int], Plan],
        *,
        owner: str,
        max_running: int,
        lease: float,
        serve: bool,
        fleet: bool,
        max_data_bytes: int,
        group_commit: bool,
        fencing: bool,
        scan_interval: float | None,
        wall_clock: Callable[[], float],
        retain: float | None = None,
        tracing: _tracing.Tracing | None = None,
    ) -> None:
        self._store = store
        # This opening of the owner name (docs/adr/0071): a fleet engine's lease row names it,
        # and only this incarnation renews it.
        self._incarnation = uuid.uuid4().hex
        # The fleet on PostgreSQL: the thread that renews the lease without the trio loop
        # (`_heartbeat.Keeper`), and the lease the step deadlines were last set to (`_retrust`).
        self._keeper: _heartbeat.Keeper | None = None
        self._trusted_until = -math.inf
        # Plan versions this engine lacks that a live engine of the fleet has (`_fleet_shapes`,
        # refreshed at every scan): a wake or a cancel of such a flow is accepted and the flow
        # left to the fleet, not blocked (a rolling deploy).
        self._fleet_known: dict[tuple[str, int], Shape] = {}
        self._instrument: _heartbeat.Trust | None = None
        self._superseded = False  # another incarnation holds the owner name now
        self._plans = plans
        self._shapes: dict[tuple[str, int], Shape] = {k: p._close() for k, p in plans.items()}
        self._steps: dict[tuple[str, int], tuple[StepDef, ...]] = {
            k: p.steps for k, p in plans.items()
        }
        self._registered = {id(p): k for k, p in plans.items()}
        self._owner = owner
        self._max_running = max_running
        self._max_data = max_data_bytes  # of a flow's data (or a payload) as UTF-8 JSON text
        self._lease = float(lease)
        self._serve = serve  # False: an operator's engine, which never leases or runs a flow
        self._fleet = fleet  # leases are respected (PostgreSQL); else one engine per store
        self._group_commit = group_commit
        self._fencing = fencing
        self._scan_interval = lease / 3 if scan_interval is None else scan_interval
        self._t0_wall = wall_clock()
        self._t0_trio = trio.current_time()
        # The fleet: how long before a lease lapses this engine lets the flow go (for clock
        # skew between hosts), and which (flow, revision) deadlines its timer heap holds (so
        # that a scan does not arm one twice).
        self._margin = lease * _LEASE_MARGIN
        self._lease_until = -math.inf  # this engine's own lease (wall clock), renewed
        # Flows let go (to the revision they were let go at), to release with the next renewal.
        # An id leaves when that renewal is through, or when a write gives the flow back to
        # this engine (`_track`): the release is then void, and is made only at that revision.
        self._released: dict[str, int] = {}
        # Renewals that got through after the lease may have lapsed (ADR 0047): a live flow
        # whose copy is from an older epoch is not trusted until it has been read again.
        self._epoch = 0
        self._strays: dict[str, int] = {}  # flows held but not run, seen at the last check
        self._armed: dict[str, int] = {}
        # How long the database lets one of this engine's transactions sit idle with its locks
        # (`_store.guard_locks`): a fleet engine frozen mid-transaction stalls the others no
        # longer than this.
        self._guard = max(_GUARD_MIN, lease * _GUARD) if fleet else None
        self._tracing = tracing  # OpenTelemetry spans of starts and runs (None: traces off)
        # Deletes finished flows `retain` seconds after they ended (a task of a serving engine).
        self._retention = (
            _retention.Retention(store, retain, self._now, self._guard)
            if retain is not None and serve
            else None
        )
        self._sched: stm.TVar[_Sched] = stm.TVar(_Sched())
        self._timers: stm.TVar[timers.Heap] = stm.TVar(timers.EMPTY)
        self._closed_tv = stm.TVar(False)
        # The waits (`_waiters`), and the flows this engine holds, a map that tells them.
        self._waiters: _waiters.Waiters[_Live] = _waiters.Waiters(
            store, fleet=fleet, lease=lease, closed=self._closed_tv, read=self._read, owner=owner
        )
        self._live = self._waiters.held
        self._closing = False
        self._mappers: dict[str, list[Callable[[Json], object]]] = {}
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._wakes = dict.fromkeys(Delivery, 0)
        self._parked = 0
        self._observers: tuple[Observer, ...] = ()  # ferry.metrics (empty: nothing is observed)
        self._nursery: trio.Nursery | None = None
        self._ferry: Callable[[_store.Op], Awaitable[_store.Result]] | None = None
        self._thread = _thread_id()  # of the run that opened it: only its tasks may call it

    # ------------------------------------------------------------------------------- clocks

    def _now(self) -> float:
        """Wall-clock seconds, advancing with trio's clock."""
        return self._t0_wall + (trio.current_time() - self._t0_trio)

    def _trio_time(self, wall: float) -> float:
        return self._t0_trio + (wall - self._t0_wall)

    # ------------------------------------------------------------------------------- writes

    async def _write(self, op: _store.Op) -> _store.Result:
        """One op, durable when this returns; through the ferry (group commit) or alone.

        Raises `ferry.Failed` if the transaction failed or the database refused this op's row
        alone (ADR 0063; nothing of it was written either way), and the exception of a
        transition that raised (a bug, raised to whoever asked for it alone).
        """
        result = await self._write_own(op)
        if isinstance(result, _store.Rejected):
            raise Failed(
                f"the database refused the write of flow {result.flow_id!r}:"
                f" {_checks.describe(result.error)}; nothing of it was written"
            ) from result.error
        return result

    async def _write_own(self, op: _store.Op) -> _store.Result:
        """`_write`, but a row the database refused is answered (`_store.Rejected`), not
        raised: a runner fails its flow with it."""
        if self._group_commit:
            if self._ferry is None:
                raise Closed("the flow engine is closed")
            result = await self._ferry(op)
        else:
            try:
                (result,) = await self._batch([op])
            except Exception as exc:
                raise Failed(f"the flow store raised {exc!r}") from exc
        if isinstance(result, _store.Refused):
            raise result.error
        if isinstance(result, _store.Unwritten):
            raise Failed(f"the flow store raised {result.error!r}") from result.error
        return result

    def _leasing(self, apply: _store.Apply, *, outside: bool) -> _store.Apply:
        """`apply`, with who holds the flow after its write (`_machine.leased`): a flow left
        active is this engine's (an operator's engine leaves it to whichever engine takes it
        over); an `outside` request (wake, cancel, resume, timeout) on a flow another engine
        of the fleet runs leaves it with that engine."""
        owner = self._owner if self._serve else None
        respect = outside and self._fleet

        def leased(flow: Flow, box: Mailbox) -> Transition:
            holder = None if self._elsewhere(flow) else owner
            return m.leased(apply(flow, box), flow, holder, respect=respect)

        return leased

    def _mine(self, flow: Flow) -> bool:
        """Is this an active flow this engine should run? (On one SQLite file: every active
        flow; in a fleet: those leased to it and not released; an operator's engine runs
        none.)"""
        return (
            self._serve
            and flow.state in _ACTIVE
            and (not self._fleet or (flow.owner == self._owner and flow.lease_until is None))
            and not self._elsewhere(flow)
        )

    def _elsewhere(self, flow: Flow) -> bool:
        """Is this a flow of a plan version this fleet engine lacks and another live engine
        has (a rolling deploy)? It is left to such an engine: nobody's after this engine's
        write, taken over at that engine's next scan, never blocked here (docs/adr/0074)."""
        key = (flow.plan, flow.version)
        return key in self._fleet_known and key not in self._shapes

    async def _request(self, op: _store.Op) -> _store.Result:
        """An API call's write: a cancel point first, then the write shielded, so that a call
        that raises `Cancelled` did not happen, and one that wrote returns its result."""
        await trio.lowlevel.checkpoint_if_cancelled()
        with trio.CancelScope(shield=True):
            result = await self._write(op)
        return result

    async def _batch(self, ops: list[_store.Op], *, whole: bool = False) -> list[_store.Result]:
        """The ferry's batch call: every op in one transaction, then their effects in memory.
        With `whole` (a `publish`), all or nothing: `_store.Undone` if one op was not applied.

        A transaction the database rolled back on its own (a deadlock or a serialization
        failure: SQLSTATE class 40; nothing of it was written) is run again, up to 3 times.
        Without `whole`, a row the database refuses is answered `Rejected` to its op alone and
        the others are written without it (`_apart.write_apart`, ADR 0063)."""
        if whole:
            return await self._transact(ops, _store.write_all)
        return await write_apart(partial(self._transact, write=_store.write_batch), ops)

    async def _transact(
        self, ops: Sequence[_store.Op], write: Callable[..., list[_store.Result]]
    ) -> list[_store.Result]:
        """`ops` in one transaction (retried if the database rolled it back on its own), then
        their effects in memory, in commit order."""
        tries = 0
        while True:
            epoch = self._epoch
            try:
                results = await self._store.transact(partial(write, ops=ops, guard=self._guard))
            except Exception as exc:
                tries += 1
                if tries > _ROLLBACK_RETRIES or not _rolled_back(exc):
                    raise
                await trio.sleep(0.01 * tries)
                continue
            break
        self._stats["write_batches"] += 1
        for op, result in zip(ops, results, strict=True):
            self._applied(op, result, epoch)
        return results

    def _applied(self, op: _store.Op, result: _store.Result, epoch: int) -> None:
        """Bring memory up to date with one committed result (trio thread, commit order) of a
        batch begun in `epoch`."""
        if isinstance(result, _store.Changed):
            t = result.transition
            if t.delivery is not None:
                self._wakes[t.delivery] += 1
            if t.written:
                own = isinstance(op, _store.Change) and op.flow is not None
                if t.flow.state in _LOGGED and t.flow.state is not result.before.state:
                    _log_ended(result.before, t.flow)
                self._track(result.before.state, t.flow, own, epoch=epoch)
        elif isinstance(result, _store.Created):
            self._track(None, result.transition.flow, True, epoch=epoch)
        elif isinstance(result, _store.Conflict):
            self._stats["conflicts"] += 1

    def _track(
        self, before: State | None, flow: Flow, own: bool, *, epoch: int, write: bool = True
    ) -> None:
        """A committed row of `flow` (by this engine's write, or read back; the write or read
        began in `epoch`): follow it. Only this engine's writes count in its
        `completed`/`failed`/`blocked` statistics."""
        stats = self._stats
        if write:
            stats["writes"] += 1
        fid = flow.flow_id
        state = flow.state
        live = self._live.get(fid)
        if live is not None and flow.revision <= live.flow.revision:
            return  # already known (a read that raced this engine's own write)
        if state is not before:
            if before is _PARKED and self._parked > 0:
                # In a fleet, a flow another engine parked since this one's last count.
                self._parked -= 1
            if state is _PARKED:
                self._parked += 1
            elif write and state in _ENDS:
                stats[_ENDS[state]] += 1
                for observer in self._observers:
                    observer.ended(flow)
        self._waiters.saw(flow)
        if live is not None:
            live.flow = flow
            live.epoch = epoch
            if not own and live.scope is not None:
                live.scope.cancel()  # someone else moved the flow: its running step is void
        if self._mine(flow):
            if live is None:
                # Given back to this engine by a write: a release still pending from when it
                # let the flow go is void (the renewal would release it while it runs here).
                self._released.pop(fid, None)
                live = self._live[fid] = _Live(flow, epoch)
                self._enqueue(live)
            return
        if live is not None:
            del self._live[fid]
            if state in _ACTIVE or not write:  # it moved on without this engine: let go of it
                stats["lost"] += 1
                if live.scope is not None:
                    live.scope.cancel()
        if (
            state is _PARKED
            and flow.park_deadline is not None
            and self._serve
            and (not self._fleet or (flow.plan, flow.version) in self._shapes)
        ):  # a fleet engine fires no timer of a version it lacks: one that has it does
            self._arm(flow.park_deadline, fid, flow.revision)

    async def _own(
        self, live: _Live, apply: _store.Apply, *, head: bool = False, fallback: bool = False
    ) -> bool:
        """Write a transition of the flow this runner drives, as a compare-and-set on its copy;
        True if it was accepted.

        The store's unavailability is retried (`_retry`); a lost compare-and-set means the flow
        moved on without this runner: it re-reads the row and carries on from there (or lets
        go). A row the database refuses fails the flow instead (`_refused`; False).
        """
        flow = live.flow
        leased = self._leasing(apply, outside=False)
        op = _store.Change(flow.flow_id, leased, flow=flow, head=head, fenced=self._fencing)
        extra = _about(flow)
        result = await _retry.retrying(
            partial(self._write_own, op), what=f"writing {_named(flow)}", extra=extra
        )
        if isinstance(result, _store.Changed):
            return True
        if isinstance(result, _store.Rejected):
            if fallback:  # even the write that fails the flow was refused: a bug to be seen
                raise Failed(
                    f"the database refused the write that fails {_named(flow)}:"
                    f" {_checks.describe(result.error)}"
                ) from result.error
            await self._refused(live, result)
            return False
        if live.flow.revision > flow.revision:
            return False
        epoch = self._epoch

        async def load() -> Flow | None:
            nonlocal epoch
            epoch = self._epoch
            return await self._load_row(flow.flow_id)

        stored = await _retry.retrying(load, what=f"reading {_named(flow)}", extra=extra)
        if self._live.get(flow.flow_id) is not live or live.flow.revision > flow.revision:
            return False
        if stored is None:
            del self._live[flow.flow_id]
        else:
            self._track(flow.state, stored, True, epoch=epoch, write=False)
        return False

    async def _refused(self, live: _Live, rejected: _store.Rejected) -> None:
        """The database refused a write of the flow this runner drives (its row alone, ADR
        0063): fail the flow with that error (a running step compensates; a compensation
        blocks), so that it is this flow's problem alone."""
        flow = live.flow
        problem = (
            f"the database refused the write of step {flow.step!r} (attempt {flow.attempt}):"
            f" {_checks.describe(rejected.error)}"
        )
        shape = self._shapes.get((flow.plan, flow.version))
        now = self._now()
        if flow.state is _RUNNING:
            apply = _on_row(m.step_failed, shape, problem, now)
        else:
            apply = _on_row(m.compensation_failed, problem, now, shape)
        await self._own(live, apply, fallback=True)

    # ---------------------------------------------------------------------------- scheduling

    def _admit_txn(self, live: _Live) -> bool:
        s = self._sched.get()
        if s.running < self._max_running:
            self._sched.set(attrs.evolve(s, running=s.running + 1))
            return True
        self._sched.set(attrs.evolve(s, queue=s.queue.append(live)))
        return False

    def _next_txn(self) -> _Live | None:
        s = self._sched.get()
        if s.head < len(s.queue):
            live = s.queue[s.head]
            head = s.head + 1
            if head >= 1024 and 2 * head >= len(s.queue):
                self._sched.set(attrs.evolve(s, queue=pvector(s.queue[head:]), head=0))
            else:
                self._sched.set(attrs.evolve(s, head=head))
            return live
        self._sched.set(attrs.evolve(s, running=s.running - 1))
        return None

    def _enqueue(self, live: _Live) -> None:
        """Give a live flow a runner now, or a place in line for one (first come first served)."""
        if self._closing or self._nursery is None:
            return
        if stm.atomically_nowait(self._admit_txn, live):
            self._nursery.start_soon(self._runner, live)

    async def _runner(self, live: _Live | None) -> None:
        while live is not None:
            await self._drive(live)
            live = stm.atomically_nowait(self._next_txn)

    async def _drive(self, live: _Live) -> None:
        """Run the flow's steps or compensations until it parks, ends, blocks or is let go."""
        fid = live.flow.flow_id
        while self._live.get(fid) is live:
            flow = live.flow
            key = (flow.plan, flow.version)
            shape = self._shapes.get(key)
            reason = m.mismatch(flow, shape)
            if reason is not None and self._fleet and await self._to_the_fleet(live):
                return  # a version another live engine has: left to it, not blocked
            if reason is not None:
                now = self._now()
                await self._own(live, _on_row(m.block, reason, now))
            elif flow.state is _RUNNING:
                assert shape is not None
                await self._run_step(live, shape, self._steps[key][flow.step_index])
            else:
                assert shape is not None
                await self._run_compensation(live, shape, self._steps[key][flow.step_index])

    def _context(self, flow: Flow, name: str, compensating: bool) -> Context:
        key = _checks.idempotency_key(
            flow.flow_id, flow.step_index, name, compensation=compensating
        )
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
        )

    async def _attempt(
        self, live: _Live, step: StepDef, fn: Callable[[Context], Awaitable[Any]], failures: int
    ) -> tuple[Context, object, BaseException | None] | None:
        """Run one attempt of the flow's current step or compensation (and, if it raised and may
        be retried, the backoff after it). None if the flow was moved by someone else meanwhile
        (a cancel): the attempt is void and its changes are discarded."""
        if self._fleet:
            if live.epoch != self._epoch and not await self._confirm(live):
                return None  # moved on without this engine, or let go
            if self._lapsing():
                # This engine could not renew the lease in time: another engine may hold the
                # flow by now. Let it go rather than run a step on the strength of a stale lease.
                self._let_go(live, release=True)
                await trio.lowlevel.checkpoint()
                return None
        flow = live.flow
        compensating = flow.state is _COMPENSATING
        ctx = self._context(flow, step.name, compensating)
        result: object = None
        error: BaseException | None = None
        if _log.isEnabledFor(logging.DEBUG):
            kind = "compensation of step" if flow.state is _COMPENSATING else "step"
            _log.debug(
                "flow %r (plan %r): running %s %r, attempt %d",
                flow.flow_id,
                flow.plan,
                kind,
                step.name,
                flow.attempt,
                extra=_about(flow),
            )
        observers = self._observers
        began = trio.current_time() if observers else 0.0
        seconds = math.nan
        tracing = self._tracing
        # In a fleet the body may run only while the lease is trusted: its deadline is the
        # margin before the lease lapses, moved on with every renewal (`_retrust`), so a loop
        # that wakes up after a lapse cancels the body before it goes on (docs/adr/0073).
        with trio.CancelScope(deadline=self._trust_deadline()) as scope:
            live.scope = scope
            live.began = flow.revision
            try:
                if tracing is None:
                    result = await fn(ctx)
                else:
                    result = await tracing.run(fn, ctx, flow.trace, compensating)
            except Exception as exc:
                error = exc
            if observers:
                seconds = trio.current_time() - began
            if error is not None and failures + 1 < step.attempts:
                await trio.sleep(_backoff(failures + 1))
        live.scope = None
        void = scope.cancelled_caught or live.flow is not flow
        for observer in observers:
            observer.ran(flow, step.name, compensating, result, error, seconds, void)
        if scope.cancelled_caught and self._fleet and self._lapsing():
            if self._live.get(flow.flow_id) is live:
                self._lose_all("its lease lapsed while it ran steps")
            return None
        if void:
            return None
        return ctx, result, error

    async def _tries(
        self, live: _Live, step: StepDef, fn: Callable[[Context], Awaitable[Any]], counter: str
    ) -> tuple[Context, object, BaseException | None, int] | None:
        """Attempts of the flow's current step or compensation until one returns or `attempts`
        have raised; attempt + 1 is written before every retry. Returns the last attempt's
        context, result, exception and the number of failures; None if the flow was moved by
        someone else meanwhile (its attempt is void)."""
        failures = 0
        fid = live.flow.flow_id
        while True:
            flow = live.flow
            self._stats[counter] += 1
            ran = await self._attempt(live, step, fn, failures)
            if ran is None:
                return None
            ctx, result, error = ran
            if error is None:
                return ctx, result, None, failures
            failures += 1
            if failures >= step.attempts:
                return ctx, result, error, failures
            if counter == "steps_run":
                self._stats["step_retries"] += 1
            accepted = await self._own(live, _on_row(m.next_attempt, self._now()))
            # ours must be the last write applied: a cancel may have come right after it
            if not accepted or live.flow.revision != flow.revision + 1:
                return None
            if self._live.get(fid) is not live:
                return None

    async def _run_step(self, live: _Live, shape: Shape, step: StepDef) -> None:
        ran = await self._tries(live, step, step.fn, "steps_run")
        if ran is None:
            return
        ctx, result, error, failures = ran
        outcome = _checks.outcome(result)
        problem: str | None = None
        data = ""
        if error is not None:
            problem = (
                f"step {step.name!r} raised {_checks.describe(error)} on attempt"
                f" {live.flow.attempt} ({failures} of {step.attempts} tries)"
            )
        elif isinstance(outcome, str):
            problem = f"step {step.name!r} {outcome}"
        else:
            try:
                data = _checks.json_object_text(ctx.data, "ctx.data", max_bytes=self._max_data)
            except TypeError as exc:
                problem = f"step {step.name!r} left data that is not JSON: {exc}"
            except ValueError as exc:
                problem = f"step {step.name!r} left data that cannot be stored: {exc}"
        now = self._now()
        if problem is not None:
            await self._own(live, _on_row(m.step_failed, shape, problem, now))
        else:
            assert not isinstance(outcome, str)
            parks = isinstance(outcome, Park)
            await self._own(live, _on_row_box(m.step_done, shape, outcome, data, now), head=parks)

    async def _run_compensation(self, live: _Live, shape: Shape, step: StepDef) -> None:
        assert step.compensate is not None  # the machine stacks only steps with one
        ran = await self._tries(live, step, step.compensate, "compensations_run")
        if ran is None:
            return
        ctx, _result, error, failures = ran
        now = self._now()
        if error is None:
            try:
                data = _checks.json_object_text(ctx.data, "ctx.data", max_bytes=self._max_data)
            except TypeError as exc:
                message = f"it left data that is not JSON: {exc}"
            except ValueError as exc:
                message = f"it left data that cannot be stored: {exc}"
            else:
                await self._own(live, _on_row(m.compensated, shape, data, now))
                return
        else:
            message = (
                f"{_checks.describe(error)} on attempt {live.flow.attempt} ({failures} of"
                f" {step.attempts} tries)"
            )
        await self._own(live, _on_row(m.compensation_failed, message, now, shape))

    # -------------------------------------------------------------------------------- timers

    def _arm(self, deadline: float, flow_id: str, revision: int) -> None:
        """Push a timer for the flow parked at `revision` (once: a fleet's scans see it again)."""
        if self._fleet:
            if self._armed.get(flow_id) == revision:
                return
            self._armed[flow_id] = revision
        entry = (deadline, flow_id, revision)
        stm.atomically_nowait(lambda: self._timers.set(timers.push(self._timers.get(), entry)))

    def _due_txn(self) -> list[timers.Entry]:
        heap = self._timers.get()
        first = timers.top(heap)
        if first is None:
            stm.retry()
        now = trio.current_time()
        if now < self._trio_time(first[0]):
            # Tested first, so this is right whether a passed deadline makes `retry` rerun the
            # transaction or return (then the top is due anyway and is taken below).
            stm.retry(deadline=self._trio_time(first[0]))
        due = [first]
        heap = timers.pop(heap)
        while (entry := timers.top(heap)) is not None and self._trio_time(entry[0]) <= now:
            due.append(entry)
            heap = timers.pop(heap)
        self._timers.set(heap)
        return due

    async def _timer_loop(self) -> None:
        while True:
            due = await stm.atomically(self._due_txn)
            nursery = self._nursery
            assert nursery is not None
            for deadline, fid, revision in due:
                if self._armed.get(fid) == revision:
                    del self._armed[fid]
                live = self._live.get(fid)
                if live is not None and live.flow.revision > revision:
                    continue  # woken meanwhile: this timer is stale
                nursery.start_soon(self._fire, fid, revision, deadline)

    async def _fire(self, flow_id: str, revision: int, deadline: float) -> None:
        now = max(self._now(), deadline)
        shapes = self._shapes

        def apply(f: Flow, _b: Mailbox) -> Transition:
            return m.timeout(f, shapes.get((f.plan, f.version)), now, expected=revision)

        # The machine ignores it unless the flow is still parked at `revision`: across a fleet,
        # every engine that armed this deadline fires it, and exactly one of them takes it.
        op = _store.Change(flow_id, self._leasing(apply, outside=True))
        what = f"timing out flow {flow_id!r} (parked at revision {revision})"
        extra = {"flow_id": flow_id}
        result = await _retry.retrying(partial(self._write_own, op), what=what, extra=extra)
        if isinstance(result, _store.Rejected):  # the flow's own problem: it blocks (ADR 0063)
            reason = f"the database refused its timeout: {_checks.describe(result.error)}"
            block = self._leasing(_on_row(m.block, reason, now), outside=True)
            op = _store.Change(flow_id, block, expected=revision)
            await _retry.retrying(partial(self._write, op), what=what, extra=extra)

    # ------------------------------------------------------------------------------ recovery

    async def _recover(self) -> None:
        """At open: record this engine's plans; then, on one SQLite file, resume every
        running or compensating flow and arm every parked flow's timer; in a fleet, resume the
        flows this owner name held (a restart under the same name) and take over the orphans
        (the first scan, which a database outage does not fail: the scan loop goes on)."""
        store = self._store
        if self._shapes:
            shapes = list(self._shapes.values())
            await store.transact(partial(_store.register_plans, shapes=shapes, now=self._now()))
        if not self._serve:
            return
        self._parked = (await store.transact(_store.count_states)).get(_PARKED, 0)
        if self._fleet:
            owner = self._owner
            now = self._now()
            until = now + self._lease
            await self._claim(now, until)
            held = await store.transact(partial(_store.load_active, owner=owner))
            mine = [f for f in held if (f.plan, f.version) in self._shapes]
            have = self._shapes
            others = [(f.flow_id, f.revision) for f in held if (f.plan, f.version) not in have]
            if others:  # a version this engine lacks: leave those to an engine that has it
                await store.transact(partial(_store.release, owner=owner, flows=others, at=now))
            self._stats["recovered"] = await self._resume_active(mine)
            try:
                await self._scan()
            except Exception as exc:
                if not _transient(exc):
                    raise
                _log.warning(
                    "flow engine %r: its first scan failed (%r); the next one is in %.1f s",
                    owner,
                    exc,
                    self._scan_interval,
                    extra={"owner": owner},
                )
            return
        deadlines = await store.transact(_store.load_deadlines)
        stm.atomically_nowait(self._timers.set, timers.from_sorted(deadlines))
        active = await store.transact(_store.load_active)
        self._stats["recovered"] = await self._resume_active(active)

    async def _claim(self, now: float, until: float) -> None:
        """Open this incarnation of the owner name (docs/adr/0071): `StoreLocked` while another
        incarnation holds it with a live lease (and is not proven gone). On PostgreSQL, start
        the thread that renews the lease from then on (`_heartbeat.Keeper`)."""
        claim = partial(
            _store.claim,
            owner=self._owner,
            incarnation=self._incarnation,
            until=until,
            now=now,
            host=_lease.host_identity(),
            pid=os.getpid(),
            plans=sorted(self._shapes),
            gone=_lease.process_gone,
        )
        holder = await self._store.transact(claim)
        if holder is not None:
            where = "this process" if holder.pid == os.getpid() else f"process {holder.pid}"
            if holder.host != _lease.host_identity():
                where += " on another host" if holder.host is not None else ""
            raise StoreLocked(
                f"another flow engine runs as owner {self._owner!r} ({where}; its lease runs"
                f" {holder.lease_until - now:.1f} s more): one live engine per owner name. Give"
                " this engine another owner name, or stop that one (a restart under the same"
                " name takes over once that engine closed, died on this host, or let its lease"
                " lapse)"
            )
        self._lease_until = until
        self._trusted_until = until
        dsn = _heartbeat.keeper_for(self._store)
        if dsn is not None:
            keeper = _heartbeat.Keeper(
                dsn,
                owner=self._owner,
                incarnation=self._incarnation,
                lease=self._lease,
                margin=self._margin,
                held_until=until,
            )
            self._keeper = keeper
            self._instrument = _heartbeat.Trust(self._on_loop_wake)
            trio.lowlevel.add_instrument(self._instrument)
            keeper.start()
        _log.info(
            "flow engine %r opened on the fleet (incarnation %s, lease %g s)",
            self._owner,
            self._incarnation,
            self._lease,
            extra={"owner": self._owner},
        )

    async def _to_the_fleet(self, live: _Live) -> bool:
        """A flow this fleet engine holds but lacks the plan version of (it came back to it
        while no engine with the version was live, or the fleet's list was stale): if a live
        engine has the version now, let the flow go (released with the next renewal, then
        taken over by such an engine) and say True; else False (it is blocked: no live engine
        could run it). A checkpoint; a store error counts as "no"."""
        try:
            await self._fleet_shapes(self._now())
        except Exception as exc:
            if not _transient(exc):
                raise
            return False
        if self._live.get(live.flow.flow_id) is not live or not self._elsewhere(live.flow):
            return False
        self._let_go(live, release=True)
        return True

    def _lease_runs_until(self) -> float:
        """How long this engine's lease is known to run (wall clock): its own renewals and its
        heartbeat thread's, whichever is later; -inf once another incarnation holds the name."""
        keeper = self._keeper
        if self._superseded or (keeper is not None and keeper.superseded):
            return -math.inf
        if keeper is None:
            return self._lease_until
        return max(self._lease_until, keeper.held_until)

    def _trust_deadline(self) -> float:
        """The trio time until which a body may run on this engine's lease (inf off a fleet)."""
        if not self._fleet:
            return math.inf
        return self._trio_time(self._lease_runs_until() - self._margin)

    def _retrust(self) -> None:
        """Move the deadlines of the bodies this engine runs to what its lease allows now. No
        checkpoint; O(flows it runs), once per renewal."""
        until = self._lease_runs_until()
        if until == self._trusted_until:
            return
        self._trusted_until = until
        deadline = self._trust_deadline()
        for live in self._live.values():
            if live.scope is not None:
                live.scope.deadline = deadline

    def _on_loop_wake(self) -> None:
        """Before trio fires expired deadlines (`_heartbeat.Trust`): follow the heartbeat
        thread's renewals, so that a body's deadline expires only if the lease lapsed."""
        if self._lease_runs_until() != self._trusted_until:
            self._retrust()

    def _lose_all(self, why: str) -> None:
        """This engine's lease lapsed (or is about to): stop every step and compensation it runs
        (their changes are discarded, nothing is recorded for them), forget their flows (to be
        released with the next renewal) and say so once (WARNING). No checkpoint."""
        lives = list(self._live.values())
        for live in lives:
            self._let_go(live, release=True)
        self._lease_until = min(self._lease_until, self._now())
        if lives:
            _log.warning(
                "flow engine %r lost its lease (%s): it let %d running flow(s) go, their steps"
                " cancelled; another engine takes them over",
                self._owner,
                why,
                len(lives),
                extra={"owner": self._owner, "lost": len(lives)},
            )

    async def _resume_active(self, active: list[Flow]) -> int:
        """Run `active` flows again (a compare-and-set on the row read): as attempt + 1 if a run
        may have begun, else as the same attempt (`_machine.rerun`); or block those whose plan
        version this engine lacks; how many run again."""
        now = self._now()
        ops: list[_store.Op] = []
        for flow in active:
            reason = m.mismatch(flow, self._shapes.get((flow.plan, flow.version)))
            apply = _on_row(m.rerun, now) if reason is None else _on_row(m.block, reason, now)
            leased = self._leasing(apply, outside=False)
            ops.append(_store.Change(flow.flow_id, leased, flow=flow, fenced=self._fencing))
        results = await _gather([partial(self._write, op) for op in ops])
        return sum(
            1
            for r in results
            if isinstance(r, _store.Changed) and r.transition.flow.state in _ACTIVE
        )

    # ----------------------------------------------------------------------------- the fleet

    async def _scan(self) -> None:
        """One scan of a fleet engine (at open, then every `scan_interval`): take over orphans
        (active flows of this engine's plan versions that no engine holds), as many as it has
        room for, each by a compare-and-set on its revision and on its still being nobody's;
        and arm the timers of parked flows whose deadline comes before the next scan but one
        (parked by any engine: exactly one engine's timeout takes each). An engine whose own
        lease is lapsing takes nothing. Raises on a database error."""
        now = self._now()
        room = min(self._max_running - len(self._live), _SCAN_LIMIT)
        if room > 0 and self._shapes and not self._lapsing():
            keys = list(self._shapes)
            orphans = await self._store.transact(
                partial(_store.load_orphans, now=now, limit=room, plans=keys)
            )
            ops: list[_store.Op] = []
            for flow in orphans:
                if flow.flow_id in self._live:
                    continue  # let go a moment ago and not yet forgotten
                apply = _on_row(m.take_over, self._owner, now)
                op = _store.Change(
                    flow.flow_id, apply, flow=flow, lapsed_at=now, fenced=self._fencing
                )
                ops.append(op)
            results = await _gather([partial(self._write, op) for op in ops])
            taken = [r for r in results if isinstance(r, _store.Changed)]
            self._stats["claimed"] += len(taken)
            if taken:
                _log.info(
                    "flow engine %r took over %d flow(s) no live engine held",
                    self._owner,
                    len(taken),
                    extra={"owner": self._owner, "claimed": len(taken)},
                )
        horizon = now + 2 * self._scan_interval
        # Only the timers of its own plan versions: a timeout of a version it lacks is fired by
        # an engine that has it (a rolling deploy), not turned into a BLOCKED flow here.
        due = await self._store.transact(
            partial(_store.load_deadlines, before=horizon, plans=sorted(self._shapes))
        )
        for deadline, fid, revision in due:
            self._arm(deadline, fid, revision)
        await self._fleet_shapes(now)
        # Parked flows are nobody's: in a fleet `parked` is the store's count, read here.
        self._parked = await self._store.transact(_store.count_parked)

    async def _fleet_shapes(self, now: float) -> dict[tuple[str, int], Shape]:
        """Read which plan versions this engine lacks that a live engine of the fleet has
        (`_store.live_plans`); kept for the wakes, cancels and resumes of flows of those
        versions until the next scan."""
        shapes = await self._store.transact(partial(_store.live_plans, now=now))
        self._fleet_known = {
            (sh.name, sh.version): sh for sh in shapes if (sh.name, sh.version) not in self._shapes
        }
        return self._fleet_known

    async def _scan_loop(self) -> None:
        scans = 0
        while True:
            await trio.sleep(self._scan_interval)
            try:
                await self._scan()
                scans += 1
                if scans % _PRUNE_EVERY == 0:  # engines long gone that hold nothing
                    before = self._now() - _PRUNE_AFTER * self._lease
                    await self._store.transact(partial(_store.prune_engines, before=before))
            except Exception as exc:
                if not _transient(exc):
                    raise
                _log.warning(
                    "flow engine %r: a scan of the fleet failed (%r); the next one is in %.1f s",
                    self._owner,
                    exc,
                    self._scan_interval,
                    extra={"owner": self._owner, "delay": self._scan_interval},
                )

    async def _heartbeat_loop(self) -> None:
        """Renew this engine's lease every ``lease / 3`` (one row: `_store.heartbeat`), then
        check the flows the store says it holds against those it runs (`_check_held`). If the
        lease is about to lapse before a renewal got through (the database is down or slow, or
        the process was frozen), let every flow go: another engine may take them over from
        then on."""
        while True:
            await trio.sleep(self._lease / 3)
            await self._heartbeat()
            try:
                await self._check_held()
            except Exception as exc:
                if not _transient(exc):
                    raise
                _log.warning(
                    "flow engine %r: reading the flows it holds failed (%r); again in %.1f s",
                    self._owner,
                    exc,
                    self._lease / 3,
                    extra={"owner": self._owner, "delay": self._lease / 3},
                )

    async def _heartbeat(self) -> None:
        """One renewal of this engine's lease, given up at the margin before it lapses. The
        flows it let go meanwhile are released in the same transaction: the moment its lease
        runs again, they are orphans for any engine to take, not stranded under its name.

        A renewal that may come after the lease lapsed (the engine stopped trusting it before
        the renewal, or the renewal came back past the margin) must not make the engine trust
        what it has in memory: another engine may have taken those flows over meanwhile, and
        nothing forbids renewing a lapsed lease. So it starts a new epoch, in which no copy
        made before is trusted until it has been read again: the renewal itself re-reads the
        flows the engine runs (`_recheck`: followed, dropped or confirmed before the lease is
        trusted again, with no checkpoint in between), and a runner re-reads any other copy
        before it runs a body on it (`_confirm`). ADR 0047."""
        now = self._now()
        until = now + self._lease
        lapsed = self._lapsing()
        deadline = self._trio_time(max(self._lease_until - self._margin, now + self._lease / 3))
        released = dict(self._released)
        renew = partial(
            _store.renew,
            owner=self._owner,
            until=until,
            now=now,
            let_go=sorted(released.items()),
            reread=sorted(self._live) if lapsed else None,
            incarnation=self._incarnation,
        )
        if self._superseded:
            return
        tries = 0
        with trio.move_on_at(deadline):
            while True:
                try:
                    rows = await self._store.transact(renew)
                except _store.Superseded:
                    self._superseded = True
                    _log.warning(
                        "flow engine %r lost its lease for good: another engine opened under the"
                        " same owner name after this one's lease lapsed; this one runs no flow"
                        " any more (close it)",
                        self._owner,
                        extra={"owner": self._owner},
                    )
                    self._lose_all("another engine opened under the same owner name")
                    return
                except Exception as exc:
                    if not _retry.unavailable(exc):
                        raise
                    # At once again (the pool opens a fresh connection for a dead one), then
                    # after a pause, until the margin.
                    tries += 1
                    delay = 0.0 if tries == 1 else min(_retry.FIRST_DELAY * 2 ** (tries - 2), 1.0)
                    _log.warning(
                        "flow engine %r: renewing its lease failed (%r); retry %d in %.2f s",
                        self._owner,
                        exc,
                        tries,
                        delay,
                        extra={"owner": self._owner, "retry": tries, "delay": delay},
                    )
                    await trio.sleep(delay)
                    continue
                break
            if lapsed or self._lapsing():
                self._epoch += 1
                for row in rows:
                    live = self._live.get(row.flow_id)
                    if live is not None:
                        self._recheck(live, row, self._epoch)
            self._lease_until = until
            if self._keeper is not None:
                self._keeper.extend(until)
            self._retrust()
            self._stats["renewals"] += 1
            for fid, revision in released.items():
                if self._released.get(fid) == revision:
                    del self._released[fid]
            return
        if self._lapsing():
            # Until a renewal gets through it runs nothing: what it starts or accepts is let go
            # at once (`_attempt`), an orphan for the others to take over.
            self._lose_all("it could not renew it in time")

    async def _check_held(self) -> None:
        """Compare the active flows the store says this engine holds with those it runs: follow
        a flow whose row moved on without it (a cancel through another engine) or that it no
        longer holds; adopt (attempt + 1) one it holds but does not run, seen so twice in a row
        (a takeover whose answer was lost with its connection: it must not stay stranded)."""
        ids = set(self._live)
        epoch = self._epoch
        rows = await self._store.transact(partial(_store.load_active, owner=self._owner))
        strays: dict[str, int] = {}
        adopt: list[Flow] = []
        for row in rows:
            fid = row.flow_id
            live = self._live.get(fid)
            if live is not None:
                ids.discard(fid)
                self._recheck(live, row, epoch)
                continue
            if row.lease_until is not None or self._released.get(fid) == row.revision:
                continue  # let go: any engine may take it (once the next renewal releases it)
            if self._strays.get(fid) == row.revision:
                adopt.append(row)
            else:
                strays[fid] = row.revision
        self._strays = strays
        gone = [fid for fid in ids if fid in self._live]
        if gone:
            epoch = self._epoch
            for row in await self._store.transact(partial(_store.load_many, flow_ids=gone)):
                live = self._live.get(row.flow_id)
                if live is not None:
                    self._recheck(live, row, epoch)
        if adopt and not self._lapsing():
            self._stats["claimed"] += await self._resume_active(adopt)

    async def _confirm(self, live: _Live) -> bool:
        """Read the flow's row again before a body runs on a copy made before the last renewal
        that came after a lapse (ADR 0047): True if the row is still that copy and the flow is
        still held by this engine; else the row is followed (a newer one) or the flow let go,
        and False. Retries while the store is unavailable. A checkpoint."""
        fid = live.flow.flow_id
        backoff = _retry.Backoff(f"re-reading {_named(live.flow)}", extra=_about(live.flow))
        while True:
            epoch = self._epoch
            try:
                row = await self._load_row(fid)
            except Exception as exc:
                await backoff.pause(exc)  # raises unless the store is unavailable
                continue
            if self._live.get(fid) is not live:
                return False
            if not self._recheck(live, row, epoch):
                return False
            if epoch == self._epoch:
                return True
            # another renewal after a lapse came meanwhile: read again

    def _recheck(self, live: _Live, row: Flow | None, epoch: int) -> bool:
        """A row of the live flow, read in `epoch`: True if it is the copy this engine runs and
        the flow is still held by this engine (the copy is then trusted in `epoch`); else the
        row is followed (`_track`: a newer row, which may drop the flow) or the flow let go (it
        is released, or gone), and False. An older row (a write of this engine that the read
        did not see yet) changes nothing. No checkpoint."""
        if row is None:
            self._let_go(live)
            return False
        if row.revision > live.flow.revision:
            self._track(live.flow.state, row, False, epoch=epoch, write=False)
            return False
        if row.revision < live.flow.revision:
            return False
        if self._mine(row):
            live.epoch = epoch
            return True
        self._let_go(live)
        return False

    def _lapsing(self) -> bool:
        """Is this engine's lease about to lapse (within the margin)?"""
        return self._now() >= self._lease_runs_until() - self._margin

    def _let_go(self, live: _Live, *, release: bool = False) -> None:
        """Stop the flow's step or compensation (its changes are discarded) and forget it:
        whoever takes it over runs it. With `release` (this engine's lease is lapsing: the
        store may still name it), the next renewal releases the flow in the store."""
        fid = live.flow.flow_id
        if self._live.get(fid) is live:
            del self._live[fid]
            self._stats["lost"] += 1
            if release:
                self._released[fid] = live.flow.revision
        if live.scope is not None:
            live.scope.cancel()

    def _log_opened(self) -> None:
        """INFO: the engine is open, and what it recovered."""
        s = self._stats
        _log.info(
            "flow engine %r opened on %s (%s): %d flows recovered, %d parked, plans %s",
            self._owner,
            _where(self._store),
            "serving" if self._serve else "operator, runs nothing",
            s["recovered"],
            self._parked,
            ", ".join(f"{name} v{version}" for name, version in sorted(self._shapes)) or "none",
            extra={"owner": self._owner, "recovered": s["recovered"], "parked": self._parked},
        )

    def _log_closed(self, error: BaseException | None) -> None:
        """INFO: the engine closed (what it left to the next engine), or why it ended."""
        running = len(self._live)
        if error is not None and not isinstance(error, trio.Cancelled | GeneratorExit):
            _log.info(
                "flow engine %r closed by %s; %d flows running left to the next engine",
                self._owner,
                _checks.describe(error, 200),
                running,
                extra={"owner": self._owner, "running": running},
            )
            return
        _log.info(
            "flow engine %r closed; %d flows running left to the next engine (steps run %d,"
            " completed %d, failed %d, blocked %d)",
            self._owner,
            running,
            self._stats["steps_run"],
            self._stats["completed"],
            self._stats["failed"],
            self._stats["blocked"],
            extra={"owner": self._owner, "running": running},
        )

    async def _let_go_unbegun(self) -> None:
        """At close: let go of the flows whose current run had not begun in this engine (they
        waited for a runner slot, or for a retry's backoff), each by a compare-and-set on the
        row it knows, so that the engine that runs them next keeps their attempt number
        (attempts count runs that began). A flow that moved on meanwhile is left as it is (its
        next run then counts as attempt + 1: numbers may skip, never repeat)."""
        now = self._now()
        ops: list[_store.Op] = [
            _store.Change(live.flow.flow_id, _on_row(m.let_go, now), flow=live.flow)
            for live in self._live.values()
            if live.began != live.flow.revision and live.flow.state in _ACTIVE
        ]
        if not ops:
            return
        try:
            await self._store.transact(partial(_store.write_batch, ops=ops, guard=self._guard))
        except Exception as exc:  # unavailable: they run again as attempt + 1
            _retry.log_or_raise(exc, f"letting go of {len(ops)} flows not begun, at close")

    async def _stop_keeper(self) -> None:
        """Stop the heartbeat thread (waiting for it) and remove the instrument. Idempotent;
        shielded."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            await keeper.stop()
        if self._instrument is not None:
            trio.lowlevel.remove_instrument(self._instrument)
            self._instrument = None

    async def _release(self) -> None:
        """At close, in a fleet: end this engine's lease (its steps are cancelled by then), so
        that other engines take its flows over at their next scan instead of after the lease.
        Best effort: a database error leaves them to lapse."""
        await self._stop_keeper()
        now = self._now()
        end = partial(_store.end_lease, owner=self._owner, incarnation=self._incarnation, now=now)
        try:
            await self._store.transact(end)
        except Exception as exc:
            if not _transient(exc):
                raise
            _log.warning(
                "flow engine %r: ending its lease at close failed (%r): its flows wait for the"
                " lease to lapse",
                self._owner,
                exc,
                extra={"owner": self._owner},
            )

    # ----------------------------------------------------------------------------- the calls

    async def _known_shapes(self) -> dict[tuple[str, int], Shape]:
        """The plan versions whose transitions this engine may ask for: its own plans; for an
        operator's engine also every version any engine registered in the store (read anew on
        every call: an operator's calls are few, and a deploy may have added one)."""
        if self._serve:
            return self._shapes
        stored = await self._read(_store.load_plans, "reading the registered plans")
        return {**{(sh.name, sh.version): sh for sh, _at in stored}, **self._shapes}

    async def _versioned(self, call: Callable[[Callable[[Flow], Shape | None]], Awaitable[T]]) -> T:
        """``await call(shape_of)`` for an outside request (wake, cancel, resume), where
        ``shape_of(flow)`` is the shape of the flow's plan version to compute its transition
        with, or None (the machine then blocks the flow: versions fail closed).

        In a fleet a version this engine lacks but a live engine has is not missing (a rolling
        deploy, docs/adr/0074): its shape comes from the store and the flow is left to an
        engine with the version (`_leasing`). The engine keeps those versions from its last
        scan; a version it does not know of yet makes the transition raise `_Unseen` inside the
        transaction (nothing is written) and the request runs again on a fresh read."""
        if not self._fleet or not self._serve:
            shapes = await self._known_shapes()
            return await call(lambda f: shapes.get((f.plan, f.version)))
        known = {**self._fleet_known, **self._shapes}

        def shape_of(f: Flow) -> Shape | None:
            shape = known.get((f.plan, f.version))
            if shape is None:
                raise _Unseen(f.plan, f.version)
            return shape

        try:
            return await call(shape_of)
        except _Unseen:
            pass
        read = partial(_store.live_plans, now=self._now())
        fresh = await self._read(read, "reading the fleet's plans")
        fleet = {(sh.name, sh.version): sh for sh in fresh}
        self._fleet_known = {k: sh for k, sh in fleet.items() if k not in self._shapes}
        shapes = {**fleet, **self._shapes}
        return await call(lambda f: shapes.get((f.plan, f.version)))

    async def _read(self, fn: Callable[[Any], T], what: str) -> T:
        """A read of an API call: a store error is raised as `ferry.Failed` (its cause the
        driver's error), never as the driver's exception. A checkpoint."""
        try:
            return await self._store.transact(fn)
        except Exception as exc:
            raise Failed(f"the flow store failed while {what}: {exc!r}") from exc

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

    def _shape_of(self, plan: object) -> Shape:
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

    async def start(
        self, plan: Plan, *, flow_id: str | None = None, data: dict[str, Json] | None = None
    ) -> str:
        """Start a flow of `plan`; durable when this returns; returns its id.

        `flow_id` defaults to a new uuid4 hex. Idempotent: the same id with the same plan and
        data returns the id and runs nothing again. Raises `UnknownPlan` (a plan not given to
        `open_engine`), `IdReused` (the id names a flow of another plan or other start data),
        `TypeError` (data not a JSON object); nothing is stored then.
        """
        self._check("start")
        shape, fid, text = self._start_input(plan, flow_id, data, "data")
        with _tracing.starting(self._tracing, shape.name, shape.version, fid) as trace:
            op = self._start_op(shape, fid, text, trace)
            result = await self._request(op)
        return self._started(op, result)

    def _start_input(
        self, plan: Plan, flow_id: str | None, data: dict[str, Json] | None, what: str
    ) -> tuple[Shape, str, str]:
        """A start's input checked (raises `TypeError`/`ValueError`/`UnknownPlan`): its plan's
        shape, its flow id and its data's JSON text."""
        shape = self._shape_of(plan)
        fid = uuid.uuid4().hex if flow_id is None else _checks.flow_id(flow_id)
        data = {} if data is None else data
        return shape, fid, _checks.json_object_text(data, what, max_bytes=self._max_data)

    def _start_op(
        self, shape: Shape, fid: str, text: str, trace: str | None = None
    ) -> _store.Create:
        """The op of a start whose input was checked (`_start_input`)."""
        owner = self._owner if self._serve else None
        return _store.Create(m.start(shape, fid, text, self._now(), owner=owner, trace=trace))

    @staticmethod
    def _started(op: _store.Create, result: _store.Result) -> str:
        fid = op.transition.flow.flow_id
        if isinstance(result, _store.Existing) and not result.same:
            raise IdReused(
                f"flow id {fid!r} is already used by a flow of plan {result.flow.plan!r} with"
                " other start data; nothing was stored (pick another id, or send the same data)"
            )
        return fid

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
        text = self._wake_input(flow_id, payload, message_id, "")

        async def call(shape_of: Callable[[Flow], Shape | None]) -> _store.Result:
            return await self._request(self._wake_op(flow_id, text, message_id, shape_of))

        return self._delivered(await self._versioned(call))

    def _wake_input(self, flow_id: str, payload: Json, message_id: str | None, what: str) -> str:
        """A wake's input checked (`TypeError`/`ValueError`); the payload's JSON text."""
        _checks.flow_id(flow_id)
        text = _checks.json_text(payload, f"{what}payload", max_bytes=self._max_data)
        _checks.message_id(message_id, f"{what}message_id")
        return text

    def _wake_op(
        self,
        flow_id: str,
        text: str,
        message_id: str | None,
        shape_of: Callable[[Flow], Shape | None],
    ) -> _store.Change:
        """The op of a wake whose input was checked (`_wake_input`: `text` is its payload);
        `shape_of` as in `_versioned`."""
        message = Message(uuid.uuid4().hex if message_id is None else message_id, text)
        now = self._now()

        def apply(f: Flow, box: Mailbox) -> Transition:
            return m.wake(f, box, message, shape_of(f), now)

        return _store.Change(flow_id, self._leasing(apply, outside=True), message_id=message_id)

    def _delivered(self, result: _store.Result) -> Delivery:
        if isinstance(result, _store.Changed):
            assert result.transition.delivery is not None
            return result.transition.delivery
        self._wakes[Delivery.UNKNOWN] += 1
        return Delivery.UNKNOWN

    def on(self, event_type: str, mapper: Callable[[Json], object]) -> None:
        """Register `mapper` for `event_type` (choreography). No checkpoint.

        ``mapper(event)`` is a plain function returning `Wake`, `Start`, `IGNORE` or None;
        several mappers of one type run in registration order.
        """
        self._check("on")
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
        """
        self._check("publish")
        if not isinstance(event_type, str):
            raise TypeError(f"event_type must be a str, got {event_type!r}")
        decisions: list[Wake | Start | None] = []
        for mapper in self._mappers.get(event_type, ()):
            decision = mapper(event)
            try:
                decisions.append(self._decision(decision))
            except (TypeError, ValueError) as exc:
                raise type(exc)(
                    f"mapper {mapper!r} for {event_type!r} returned {decision!r}: {exc};"
                    " nothing was applied"
                ) from None
        # Checked and built before anything is written: a start's op (its flow), a wake's text.
        built: list[_store.Create | str | None] = []
        for d in decisions:
            if isinstance(d, Wake):
                built.append(self._wake_input(d.flow_id, d.payload, d.message_id, "Wake."))
            elif isinstance(d, Start):
                built.append(
                    self._start_op(*self._start_input(d.plan, d.flow_id, d.data, "Start.data"))
                )
            else:
                built.append(None)

        async def apply_all(shape_of: Callable[[Flow], Shape | None]) -> list[_store.Result]:
            ops: list[_store.Op] = []
            for d, b in zip(decisions, built, strict=True):
                if isinstance(d, Wake):
                    assert isinstance(b, str)
                    ops.append(self._wake_op(d.flow_id, b, d.message_id, shape_of))
                elif isinstance(b, _store.Create):
                    ops.append(b)
            try:
                return await self._batch(ops, whole=True)
            except _store.Undone as undone:
                self._undone(ops, undone.results)  # raises (`_Unseen`: `_versioned` reads again)
            except Exception as exc:
                raise Failed(f"the flow store raised {exc!r}; nothing was applied") from exc

        await trio.lowlevel.checkpoint_if_cancelled()
        if all(b is None for b in built):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return [None] * len(decisions)
        with trio.CancelScope(shield=True):  # all of them, or (if Cancelled) none
            done = await self._versioned(apply_all)
        answers = iter(done)
        results: list[Delivery | str | None] = []
        for b in built:
            if b is None:
                results.append(None)
            elif isinstance(b, _store.Create):
                results.append(self._started(b, next(answers)))
            else:
                results.append(self._delivered(next(answers)))
        return results

    def _undone(self, ops: list[_store.Op], results: list[_store.Result]) -> NoReturn:
        """Raise why an all-or-nothing batch (a `publish`) was rolled back."""
        for op, result in zip(ops, results, strict=True):
            if isinstance(result, _store.Refused):
                raise result.error
            if isinstance(op, _store.Create):
                self._started(op, result)  # raises IdReused
        raise AssertionError(f"a publish was rolled back for no reason: {results!r}")

    def _decision(self, decision: object) -> Wake | Start | None:
        """A mapper's result, checked (type, ids, JSON, plan); raises `TypeError`/`ValueError`."""
        if decision is None or decision is IGNORE:
            return None
        if isinstance(decision, Wake):
            _checks.flow_id(decision.flow_id)
            _checks.json_text(decision.payload, "Wake.payload", max_bytes=self._max_data)
            _checks.message_id(decision.message_id, "Wake.message_id")
            return decision
        if isinstance(decision, Start):
            self._shape_of(decision.plan)
            _checks.flow_id(decision.flow_id)
            data = {} if decision.data is None else decision.data
            _checks.json_object_text(data, "Start.data", max_bytes=self._max_data)
            return decision
        raise TypeError("a mapper must return flow.Wake, flow.Start, flow.IGNORE or None")

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
        return m.snapshot(await self._waiters.wait(_checks.flow_id(flow_id), timeout))

    async def _load_row(self, flow_id: str) -> Flow | None:
        """The flow's row, for the engine's own use: the store's error is raised as it is (the
        engine retries unavailability, and any other error ends its block)."""
        return await self._store.transact(partial(_store.load, flow_id=flow_id))

    async def _load(self, flow_id: str) -> Flow | None:
        """The flow's row; `ferry.Failed` if the store failed."""
        return await self._read(partial(_store.load, flow_id=flow_id), f"reading flow {flow_id!r}")

    async def get(self, flow_id: str) -> Snapshot | None:
        """The flow's durable state, read from the store; None if there is no such flow."""
        self._check("get")
        flow = await self._load(_checks.flow_id(flow_id))
        return None if flow is None else m.snapshot(flow)

    async def cancel(self, flow_id: str, reason: str = "cancelled") -> bool:
        """Stop a running or parked flow and compensate its completed steps; durable on return.

        A running step is cancelled and its changes discarded. Returns False (nothing changes)
        for a flow that is terminal, compensating, blocked or unknown.
        """
        self._check("cancel")
        fid = _checks.flow_id(flow_id)
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {reason!r}")
        problem = _checks.text_problem(reason)
        if problem is not None:
            raise ValueError(f"reason {reason!r} cannot be stored: {problem}")
        now = self._now()

        async def call(shape_of: Callable[[Flow], Shape | None]) -> _store.Result:
            def apply(f: Flow, _b: Mailbox) -> Transition:
                return m.cancel(f, shape_of(f), reason, now)

            return await self._request(_store.Change(fid, self._leasing(apply, outside=True)))

        result = await self._versioned(call)
        return isinstance(result, _store.Changed) and result.transition.done

    async def resume(self, flow_id: str) -> bool:
        """Re-drive a `BLOCKED` flow from where it stopped (a step or compensation runs again as
        attempt + 1; a park is restored). False if it is not blocked, unknown, or its plan
        version is still not registered."""
        self._check("resume")
        fid = _checks.flow_id(flow_id)
        now = self._now()

        async def call(shape_of: Callable[[Flow], Shape | None]) -> _store.Result:
            def apply(f: Flow, box: Mailbox) -> Transition:
                return m.resume(f, box, shape_of(f), now)

            op = _store.Change(fid, self._leasing(apply, outside=True), head=True)
            return await self._request(op)

        result = await self._versioned(call)
        return isinstance(result, _store.Changed) and result.transition.done

    async def history(self, flow_id: str) -> list[Event]:
        """Every durable transition of the flow, in order. Raises `UnknownFlow`."""
        self._check("history")
        fid = _checks.flow_id(flow_id)
        read = partial(_store.load_history, flow_id=fid)
        events = await self._read(read, f"reading the history of flow {fid!r}")
        if events is None:
            raise UnknownFlow(f"no flow has id {fid!r}")
        return events

    def statistics(self) -> FlowStatistics:
        """Gauges and counters of this engine (see `FlowStatistics`). No checkpoint; O(1).

        Readable after the engine closed; while it is open, only from its own run's tasks
        (`RuntimeError` otherwise)."""
        if _thread_id() != self._thread and not self._closing:
            raise _wrong_run("statistics")
        return self._statistics()

    def _statistics(self) -> FlowStatistics:
        """`statistics()` from any thread (`ferry.metrics` reads it while serving a scrape):
        it copies a few integers and two dicts whose keys never change."""
        return FlowStatistics(
            running=len(self._live),
            parked=self._parked,
            wakes=dict(self._wakes),
            purged=0 if self._retention is None else self._retention.purged,
            **self._stats,
        )

    def __repr__(self) -> str:
        return f"<flow.Engine running={len(self._live)} parked={self._parked}>"


def _on_row(fn: Callable[..., Transition], *args: Any) -> _store.Apply:
    """``apply(flow, mailbox)`` for a transition that does not read the mailbox."""
    return lambda flow, _mailbox: fn(flow, *args)


def _on_row_box(fn: Callable[..., Transition], *args: Any) -> _store.Apply:
    """``apply(flow, mailbox)`` for a transition that reads the mailbox."""
    return lambda flow, mailbox: fn(flow, mailbox, *args)


def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )


async def _gather(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the calls concurrently (so that their writes share transactions); results in order."""
    results: list[Any] = [None] * len(calls)

    async def one(i: int) -> None:
        results[i] = await calls[i]()

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(one, i)
    return results


# --------------------------------------------------------------------------------- opening


def _registry(plans: object) -> dict[tuple[str, int], Plan]:
    if isinstance(plans, Plan):
        raise TypeError(f"plans must be a list of flow.Plan: plans=[{plans.name}], got {plans!r}")
    if not isinstance(plans, Iterable) or isinstance(plans, str | bytes):
        raise TypeError(f"plans must be a list of flow.Plan, got {plans!r}")
    registry: dict[tuple[str, int], Plan] = {}
    for plan in plans:
        if not isinstance(plan, Plan):
            raise TypeError(f"plans must hold flow.Plan objects, got {plan!r}")
        plan._close()  # raises ValueError for an empty plan
        key = (plan.name, plan.version)
        if key in registry and registry[key] is not plan:
            raise ValueError(f"two plans are named {plan.name!r} version {plan.version}")
        registry[key] = plan
    return registry


def open_engine(
    store: Store | str | os.PathLike[str],
    plans: Iterable[Plan],
    *,
    owner: str | None = None,
    max_running: int = 10_000,
    lease: float = 30.0,
    serve: bool = True,
    max_data_bytes: int = _checks.MAX_DATA_BYTES,
    retain: float | None = _retention.DEFAULT_RETAIN,
    tracer_provider: object | None = None,
) -> contextlib.AbstractAsyncContextManager[Engine]:
    """Open a flow engine on `store` for the duration of an ``async with``.

    `store`: a path (an SQLite file, created if missing, closed with the engine) or an open
    `SqliteStore`/`PostgresStore` (left open). `plans`: the plans it runs (several versions of
    one plan may be given; at least one, unless ``serve=False``). At most `max_running` flows
    run at once; the others wait their turn, first come first served. `owner` names this
    engine in the rows it leases (default: a new uuid; printable, 1 to 200 characters; on a
    fleet one live engine per name: `StoreLocked` naming the owner while another holds it).
    `lease`: 0.5 s to 86,400 s (`ValueError` outside). Creates the tables if missing, records its
    plans' shapes in the store, takes the SQLite file's engine lock (`StoreLocked` if another
    engine holds the file, by whatever path), then recovers. A path that cannot be
    an engine's file (``":memory:"``, a ``file:`` URI, a directory, an empty path, a file that
    is not SQLite) is a `ValueError` saying what to give instead, before anything is created.

    One SQLite file is served by one engine: at open every running and compensating flow runs
    again (attempt + 1) and every parked flow's timer is armed (overdue ones time out at once).

    On PostgreSQL engines form a fleet (docs/flow-fleet.md): each engine holds a lease of
    `lease` seconds, renewed every ``lease / 3`` (one row, whatever the number of flows), and
    runs the running flows that name it. Every ``lease / 3`` it also scans for orphans (running
    flows of its plan versions that no live engine holds: their engine died, froze or closed)
    and takes them over, each by a compare-and-set, and arms the timers of flows parked by any
    engine whose deadline is near (exactly one engine's timeout takes each). At open it resumes
    the flows its own `owner` name held (a restart under the same name) and scans. An engine
    that could not renew in time lets its flows go (`FlowStatistics.lost`) and releases them
    with its next renewal; one that lost a flow to another engine finds out at its next write,
    which fails, or its next check. Closing ends its lease, so that others take its flows over
    at their next scan. A slow or frozen engine can never advance a flow another engine took
    over: every write is a compare-and-set on the flow's revision.

    `max_data_bytes` (default 1 MiB): the most UTF-8 JSON text a flow's data (at `start` and
    after every step) or a wake's payload may take. A step that leaves more, or returns a
    malformed outcome, fails its flow alone (it compensates and ends `FAILED` with an error
    naming the step and the problem); bad input at a call is refused at that call.

    Only the store's unavailability (a lock held elsewhere, a lost connection, a serialization
    failure) is retried by the engine's own tasks, with a WARNING on the ``ferry.flow`` logger
    per retry; any other error in them ends the ``async with`` block with that exception (in an
    `ExceptionGroup` after the block's own, if the block raised one too).

    `retain` (seconds, default 30 days; None keeps every flow): finished (`COMPLETED` or
    `FAILED`) flows are deleted, with their history and mailbox, `retain` seconds after they
    ended, by a task of the engine (from its open on, every ``retain / 4`` at most ten minutes
    apart), in transactions of at most 500 flows with a pause between them; any engine of a
    fleet may do it at the same time as others (docs/adr/0085). A deleted flow's id is unknown
    from then on: a wake of it is `Delivery.UNKNOWN` and `start` may use it again.
    `ValueError` unless it is a finite number > 0 or None.

    `tracer_provider`: OpenTelemetry traces (the extra ``otel``): every `start` and every run
    of a step or compensation is a span, and one flow is one trace across parks, restarts and
    engines (docs/operating.md). None (default): the application's global provider, if it set
    one; without one (or without OpenTelemetry) traces are off and cost nothing.

    `serve=False` opens an operator's engine (used by ``python -m ferry.flow``): it needs no
    plans (it reads the plan shapes engines recorded in the store), runs no step, leases
    nothing, arms no timer and does no recovery; its `wake`, `cancel` and `resume` are
    recorded, and a flow they make runnable is left to the engines that serve the store (on
    PostgreSQL the next scan of any of them takes it; on SQLite, where the operator's engine
    holds the file's lock like any engine, the next engine to open the file). Its `wait`
    reads a flow once, then, on PostgreSQL, when a notification says it settled (and once per
    lease besides).

    Definition errors (a bad plan, an empty plan, no plans for a serving engine) and bad
    options are raised as they are, before anything is opened. Leaving the block closes the
    engine: running steps and compensations are cancelled (their changes discarded; they run
    again, as attempt + 1, when an engine next takes them), parked flows stay parked, and later
    calls raise `ferry.Closed`.
    """
    return _Opening(
        _opened(
            store,
            plans,
            owner=owner,
            max_running=max_running,
            lease=lease,
            serve=serve,
            max_data_bytes=max_data_bytes,
            retain=retain,
            tracer_provider=tracer_provider,
            switches=_SWITCHES,
        )
    )


@attrs.frozen
class _Switches:
    """What only tests and benchmarks change (tests/switches.py opens engines with them):
    `group_commit=False` commits every write in its own transaction; `fleet` forces the fleet's
    leases on (or off) whatever the store; `fencing=False` makes the runner's writes and
    takeovers skip the compare-and-set (to show that the fleet's oracle catches it);
    `scan_interval` overrides ``lease / 3``; `wall_clock` is the clock of leases and deadlines."""

    group_commit: bool = True
    wall_clock: Callable[[], float] = time.time
    fleet: bool | None = None
    fencing: bool = True
    scan_interval: float | None = None


_SWITCHES = _Switches()


_NOT_WITH = (
    "open_engine(...) is an async context manager, not the engine: open it with"
    " `async with flow.open_engine(store, plans=[...]) as engine:` and call the engine inside"
    " that block"
)


@final
class _Opening(contextlib.AbstractAsyncContextManager[Engine]):
    """What `open_engine` returns: the engine's context manager, which also answers the
    mistake of leaving out ``async with`` (awaiting it, or calling it as if it were the
    engine) with a `TypeError`/`AttributeError` that says how to open it."""

    def __init__(self, opened: contextlib.AbstractAsyncContextManager[Engine]) -> None:
        self._opened = opened

    async def __aenter__(self) -> Engine:
        return await self._opened.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._opened.__aexit__(exc_type, exc, tb)

    def __await__(self) -> Generator[Any, None, Engine]:
        raise TypeError(_NOT_WITH)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{_NOT_WITH} ('.{name}' was asked of the context manager)")


@asynccontextmanager
async def _opened(
    store: Store | str | os.PathLike[str],
    plans: Iterable[Plan],
    *,
    owner: str | None,
    max_running: int,
    lease: float,
    serve: bool,
    max_data_bytes: int,
    retain: float | None,
    tracer_provider: object | None,
    switches: _Switches,
) -> AsyncIterator[Engine]:
    """The body of `open_engine` (its docstring says what it promises)."""
    scan_interval = switches.scan_interval
    registry = _registry(plans)
    if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
        raise ValueError(f"max_running must be an int >= 1, got {max_running!r}")
    lease = _lease.check_lease(lease)
    if owner is not None:
        owner = _lease.check_owner(owner)
    if not isinstance(serve, bool):
        raise TypeError(f"serve must be a bool, got {serve!r}")
    if (
        isinstance(max_data_bytes, bool)
        or not isinstance(max_data_bytes, int)
        or max_data_bytes < 2  # "{}" must fit
    ):
        raise ValueError(f"max_data_bytes must be an int >= 2, got {max_data_bytes!r}")
    retain = _retention.check_retain(retain)
    tracing = _tracing.tracing_for(tracer_provider)
    if serve and not registry:
        raise ValueError(
            "open_engine got no plans: an engine that serves a store runs only the plans it is"
            " given, so this one could run no flow; give it plans=[...], or serve=False for an"
            " operator's engine (it wakes, cancels and resumes flows, and runs none)"
        )
    if scan_interval is not None and not (0 < scan_interval < math.inf):
        raise ValueError(f"scan_interval must be a finite number > 0, got {scan_interval!r}")
    own_store = isinstance(store, str | os.PathLike)
    lock: EngineLock | None = None
    if own_store:
        lock = EngineLock.acquire(check_path(store))
        db: Store = SqliteStore(lock.path)
    elif callable(getattr(store, "transact", None)):
        db = store  # type: ignore[assignment]
        if isinstance(db, SqliteStore):
            lock = EngineLock.acquire(db.path)
    else:
        raise TypeError(f"store must be a path or a SqliteStore/PostgresStore, got {store!r}")
    try:
        await db.transact(_store.create_schema)
        engine = Engine(
            db,
            registry,
            owner=owner if owner is not None else uuid.uuid4().hex,
            max_running=max_running,
            lease=lease,
            serve=serve,
            fleet=db.dialect == "postgres" if switches.fleet is None else switches.fleet,
            max_data_bytes=max_data_bytes,
            group_commit=switches.group_commit,
            fencing=switches.fencing,
            scan_interval=scan_interval,
            wall_clock=switches.wall_clock,
            retain=retain,
            tracing=tracing,
        )
        async with _lifetime(engine) as running:
            yield running
    finally:
        if own_store:
            with trio.CancelScope(shield=True):
                await db.aclose()
        if lock is not None:
            lock.release()


@asynccontextmanager
async def _lifetime(engine: Engine) -> AsyncIterator[Engine]:
    """Own the write ferry and the engine's tasks for the ``async with`` block."""
    body_error: BaseException | None = None
    engine_error: BaseException | None = None
    ferry_cm: contextlib.AbstractAsyncContextManager[Any]
    if engine._group_commit:
        ferry_cm = open_ferry(
            engine._batch,
            max_batch_size=_BATCH_SIZE,
            # PostgreSQL: three batches in flight leave one connection of a default store's
            # four for lease renewals, scans and reads, which must not queue behind batches.
            max_in_flight_batches=1 if engine._store.dialect == "sqlite" else 3,
            max_queueing=1 << 40,
        )
    else:
        ferry_cm = contextlib.nullcontext(None)
    try:
        async with ferry_cm as write_ferry:
            engine._ferry = write_ferry
            try:
                async with trio.open_nursery() as nursery:
                    engine._nursery = nursery
                    try:
                        await engine._recover()
                        engine._log_opened()
                        if engine._serve:
                            nursery.start_soon(engine._timer_loop)
                        if engine._serve and engine._fleet:
                            nursery.start_soon(engine._heartbeat_loop)
                            nursery.start_soon(engine._scan_loop)
                        if engine._retention is not None:
                            nursery.start_soon(engine._retention.run)
                        yield engine
                    except BaseException as exc:
                        body_error = exc  # re-raised below, not wrapped in an exception group
                    finally:
                        engine._closing = True
                        stm.atomically_nowait(engine._closed_tv.set, True)
                        nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # A task of the engine raised (a bug, or an error that is not the store's
                # unavailability): the block ends with that exception, not a group of it (with
                # the block's own too, if it raised one: `_merged`).
                engine_error = _one_error(group)
                if engine_error is None:
                    raise _merged(body_error, group) from None
            if engine._serve:
                with trio.CancelScope(shield=True), trio.move_on_after(engine._lease / 3):
                    if engine_error is None:  # after a bug, touch no flow: they run again
                        await engine._let_go_unbegun()
                    if engine._fleet:
                        await engine._release()
    finally:
        engine._closing = True
        engine._ferry = None
        engine._log_closed(engine_error or body_error)
        with trio.CancelScope(shield=True):
            await engine._stop_keeper()
            await engine._waiters.aclose()
    if engine_error is not None:
        raise _merged(body_error, engine_error)
    if body_error is not None:
        raise body_error


def _merged(body_error: BaseException | None, engine_error: BaseException) -> BaseException:
    """What ends the block when a task of the engine failed: its error, or, if the block raised
    an error of its own too, both (neither may be lost); the block's `trio.Cancelled` is only
    the echo of the task's failure. As `ferry`'s `Shell.lifetime` does."""
    if body_error is None or isinstance(body_error, trio.Cancelled):
        return engine_error
    return BaseExceptionGroup(
        "the engine's block raised, and so did a task of the engine", [body_error, engine_error]
    )


def _where(store: Store) -> str:
    """The store, for a log line: an SQLite path, or the kind of store (no DSN: it may hold a
    password)."""
    path = getattr(store, "path", None)
    return f"SQLite file {path!r}" if isinstance(path, str) else type(store).__name__


def _one_error(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception of `group` that is not a `trio.Cancelled`, if there is one only."""
    _, rest = group.split(trio.Cancelled)
    if rest is None:
        return None
    leaves: list[BaseException] = []
    stack: list[BaseException] = [rest]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else None
