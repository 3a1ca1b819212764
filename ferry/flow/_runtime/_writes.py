"""The engine's write path: every durable change of a flow, and the map of live flows that
follows the commits.

Every durable change of every flow, whoever asks for it (the runner of the flow, a wake, a timer,
a cancel, a resume, recovery, a takeover), is one store op: a pure transition run on the flow's
row inside the transaction that records it, compare-and-set on the row's revision (docs/adr/0020).
An op names its transition as a record (`_model._ops`: ``Wake(...)``, ``StepDone(...)``), which
the store runs on its own thread (`_store._apply.run`, docs/adr/0130). The ops go through one
plain ferry whose batch call (`Writes.batch`) runs a whole batch in one `store.transact`
(`_batch.write_batch`): concurrent flows share transactions (group commit), and an op whose
compare-and-set fails is answered alone with `Conflict` while the others commit (docs/adr/0022).
A row the database refuses is answered `Rejected` to its op alone (ADR 0063).

What the engine holds in memory follows the commits, in commit order: the batch call applies each
result (`applied`, `track`) before it answers anyone. A flow this engine should run
(`runs_here`) is live: a `_live.Live` in `live`, handed to the runner (`runnable`). A flow that
leaves the active states is dropped at once: a parked flow holds no task, only a timer if it has a
deadline (`arm`). A write someone else made to a live flow (a cancel) replaces the runner's copy
and cancels the step it runs; the runner's own next write then fails its compare-and-set.

Who holds a flow after a write (the engine named on its row as the one that runs it: the one
meaning of "hold") is one pure rule (`_holders.assign_holder`), given to every op as data
(`Holders`, `_ops.HolderRule`) and applied by the store. What differs between one file and a
fleet is asked of the mode (`_mode.Mode`, picked once): whether the store names this engine as
a flow's holder, which timers it fires, the trust epoch a write begins in, and the flows let go,
to be released with the next renewal (the mode's own state: this module tells it,
`release_later` and `given_back`). The live map has one owner, this module: the other parts
drop a flow from it through `let_go` and `drop`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import trio

from ferry import Closed, Failed
from ferry.projected import Store

from .._model import _checks, _ops
from .._model._types import State
from .._model._values import ACTIVE, TERMINAL, Flow, Shape, Transition
from .._store import _batch, _op, _store
from . import _observe, _queues, _read, _retry, _whole
from ._apart import split
from ._clock import Clock
from ._config import Config
from ._flight import Flight
from ._flight import answered as _answered
from ._flight import rolled_back as _rolled_back
from ._flight import unless_rejected as _unless_rejected
from ._live import LOGGED, Live, Tally, about, kin_counted, log_ended, named
from ._mode import Mode
from ._versions import Versions

T = TypeVar("T")

_NOWHERE: dict[tuple[str, int], Shape] = {}

_log = logging.getLogger("ferry.flow")

_PARKED = State.PARKED
_RUNNING = State.RUNNING
_BLOCKED = State.BLOCKED
_ENDS = {State.COMPLETED: "completed", State.FAILED: "failed", State.BLOCKED: "blocked"}


def _end_of(t: Transition) -> str:
    """How the flow of `t`, a transition that ended it, ended (`FlowEnd.how`, the
    ``workflow.end`` of its end span): ``abandoned`` or ``cancelled`` if that transition was an
    operator's, else its state."""
    kinds = {e.kind for e in t.events}
    if "abandoned" in kinds:
        return "abandoned"
    if "cancelled" in kinds:
        return "cancelled"
    return _ENDS[t.flow.state]


class Holders:
    """Who holds a flow after a write of this engine (`_ops.HolderRule`, applied by the store):
    a flow left active is this engine's (an operator's engine leaves it to whichever engine
    takes it over), except one of a version another engine of the fleet has and this one lacks
    (left to nobody: that engine takes it over); an `outside` request (wake, cancel, resume,
    timeout) on a flow another engine of the fleet holds leaves it with that engine. One
    record per kind, made again only when the fleet's versions change (they are replaced as a
    whole, `Versions.learn`)."""

    __slots__ = ("_rules", "_shared", "_versions", "_writer")

    def __init__(self, versions: Versions, *, owner: str, serve: bool, shared: bool) -> None:
        self._versions = versions
        self._writer = owner if serve else None
        self._shared = shared  # other engines write the store (`_mode.Mode.shared`)
        no_rule = _ops.HolderRule(None)
        self._rules: tuple[object, _ops.HolderRule, _ops.HolderRule] = (None, no_rule, no_rule)

    def rule(self, *, outside: bool) -> _ops.HolderRule:
        """The rule for a write of this engine; `outside`: an outside request's."""
        rules = self._rules
        elsewhere = self._versions.fleet_known if self._shared else _NOWHERE  # a fleet's only
        if rules[0] is not elsewhere:
            writer = self._writer
            rules = self._rules = (
                elsewhere,
                _ops.HolderRule(writer, keep_runner=False, elsewhere=elsewhere),
                _ops.HolderRule(writer, keep_runner=self._shared, elsewhere=elsewhere),
            )
        return rules[2] if outside else rules[1]


class Writes:
    """The write path of one engine and its map of live flows.

    Invariants: `live` holds exactly the flows this engine runs or will run (`runs_here` of
    their latest known row), each copy the latest committed row this engine knows; `live` is
    never rebound (other parts keep a reference; only this class adds to it or drops from it).
    `epoch`, the mode's trust epoch, only grows."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        tally: Tally,
        versions: Versions,
        config: Config,
        mode: Mode,
        *,
        seen: Callable[[Flow], None],
        refused: Callable[[Flow, str, BaseException], None],
        live: dict[str, Live],
        runnable: Callable[[Live], None],
        arm: Callable[[float, str, int], None],
        ended: Callable[[Flow], None],
    ) -> None:
        self._store = store
        self._clock = clock
        self._tally = tally
        self._versions = versions
        self._owner = owner = config.owner
        self._serve = serve = config.serve  # False: an operator's engine, which runs no flow
        self._mode = mode  # one file, or a fleet's leases (PostgreSQL): picked once
        self._group_commit = config.group_commit
        # How long the database lets one of this engine's transactions sit idle with its locks
        # (`_batch.guard_locks`): a fleet engine frozen mid-transaction stalls the others no
        # longer than this.
        self.guard = mode.guard
        self._seen = seen  # every committed row of a flow, for those who wait for it
        self._refused = refused  # a flow whose every write is refused, for those who wait for it
        self._runnable = runnable  # a flow became live: give it a runner
        self._arm = arm  # a flow parked with a deadline
        self._ended = ended  # this engine's write ended a flow: a schedule's waiting tick
        self._ferry: Callable[[_op.Op], Awaitable[_op.Result]] | None = None
        self.live = live  # empty at first (`_waiters.Held`: it tells the waits what comes and goes)
        # The ops of API calls (`request`) on their way through the ferry, by id: None while
        # they wait for a batch, then the batch that took them (`Flight`).
        self._requested: dict[int, Flight | None] = {}
        self.holders = Holders(versions, owner=owner, serve=serve, shared=mode.shared)
        self._own = _ops.Known(self._versions.shapes)  # a timeout's versions: its own
        self.queue_timers: dict[str, float] = {}  # each plan's queue timer armed, not fired
        self.admits_as = owner if serve else None  # who holds the flows its writes admit

    def open(self, write_ferry: Callable[[_op.Op], Awaitable[_op.Result]] | None) -> None:
        """Write through `write_ferry` from now on (group commit; None: one transaction each)."""
        self._ferry = write_ferry

    def close(self) -> None:
        """The ferry is closed: a write through it raises `ferry.Closed` from now on."""
        self._ferry = None

    @property
    def epoch(self) -> int:
        """The mode's trust epoch (`_mode.Mode.epoch`): a write or read begins in it."""
        return self._mode.epoch

    # ------------------------------------------------------------------------------- writes

    async def write(self, op: _op.Op) -> _op.Result:
        """One op, durable when this returns; through the ferry (group commit) or alone.

        Raises `ferry.Failed` if the transaction failed or the database refused this op's row
        alone (ADR 0063; nothing of it was written either way), and the exception of a
        transition that raised (a bug, raised to whoever asked for it alone).
        """
        return _unless_rejected(await self.write_answered(op))

    async def write_answered(self, op: _op.Op) -> _op.Result:
        """`write`, but a row the database refused is answered (`_op.Rejected`), not
        raised: a runner fails its flow with it."""
        if self._group_commit:
            if self._ferry is None:
                raise Closed("the flow engine is closed")
            result = await self._ferry(op)
        else:
            try:
                (result,) = await self.batch([op])
            except Exception as exc:
                raise Failed(f"the flow store raised {exc!r}") from exc
        return _answered(result)

    async def request(self, op: _op.Op) -> _op.Result:
        """An API call's write: a cancel point first, then the write, so that a call that raises
        `Cancelled` did not happen, and one that wrote returns its result (or raises as
        `write`).

        Through the ferry no cancel scope is needed (a shielded one per call cost about 4% of
        a flow's CPU): a caller cancelled while its op waits for a batch is dropped from the
        ferry, nothing of it written, and `Cancelled` is raised; one cancelled while its op is
        in a batch (`batch` notes which, before the batch can be cancelled or end) waits,
        shielded, for that batch and returns its answer. Without the ferry the write runs in
        the caller's task, shielded."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._group_commit:
            with trio.CancelScope(shield=True):
                result = await self.write(op)
            return result
        requested = self._requested
        key = id(op)
        requested[key] = None
        try:
            return _unless_rejected(await self.write_answered(op))
        except trio.Cancelled:
            flight = requested[key]
            if flight is None:
                raise  # it never left the ferry's queue: it did not happen
        finally:
            del requested[key]
        with trio.CancelScope(shield=True):
            await flight.done.wait()
        return flight.landed(op)

    def runs_here(self, flow: Flow) -> bool:
        """Is this an active flow this engine should run? (On one SQLite file: every active
        flow; in a fleet: those leased to it and not released; an operator's engine runs
        none.)"""
        held = flow.fan_in is None or flow.state is _RUNNING  # not while its kids undo (0149)
        return self._serve and flow.state in ACTIVE and held and self._mode.holds(flow)

    async def batch(self, ops: list[_op.Op], *, whole: bool = False) -> list[_op.Result]:
        """The ferry's batch call: every op in one transaction, then their effects in memory.
        With `whole` (a `publish`), all or nothing: `_batch.Undone` if one op was not applied.

        A transaction the database rolled back on its own (a deadlock or a serialization
        failure: SQLSTATE class 40; nothing of it was written) is run again, up to 3 times.
        Without `whole`, a row the database refuses is answered `Rejected` to its op alone and
        the others are written without it (`_apart.write_apart`, ADR 0063).

        Shielded: a batch the ferry took is written to its end even when the engine is closing
        (its block cancelled), so that every caller in it learns what became of its write (a
        `start` returns its flow's id) instead of "it may or may not have been written"; the
        close waits for that one transaction (docs/adr/0108)."""
        requested = self._requested
        if requested:  # API calls wait for answers: note which of them this batch took
            flight = Flight(ops)
            for op in ops:
                if id(op) in requested:
                    requested[id(op)] = flight
            try:
                with trio.CancelScope(shield=True):
                    results = await self._batch(ops, whole)
                flight.results = results
            except BaseException as exc:
                flight.error = exc
                raise
            finally:
                flight.done.set()
            return results
        with trio.CancelScope(shield=True):
            results = await self._batch(ops, whole)
        return results

    async def _batch(self, ops: list[_op.Op], whole: bool) -> list[_op.Result]:
        if whole:
            return await self._transact(ops, _batch.write_all)
        try:  # `_apart.write_apart`, its first try inline: the common case
            return await self._transact(ops, _batch.write_batch)
        except Exception as exc:
            if _retry.unavailable(exc):
                raise
            return await split(partial(self._transact, write=_batch.write_batch), ops, exc)

    async def _transact(
        self, ops: Sequence[_op.Op], write: Callable[..., list[_op.Result]]
    ) -> list[_op.Result]:
        """`ops` in one transaction (retried if the database rolled it back on its own), then
        their effects in memory, in commit order."""
        epoch = self.epoch
        try:  # the first try without `_retry.retrying`'s objects: the common case
            results = await self._store.transact(
                partial(write, ops=ops, guard=self.guard, owner=self.admits_as)
            )
        except Exception as exc:
            if not _rolled_back(exc):
                raise
            epoch, results = await _transact_again(self, ops, write, exc)
        self._tally.stats["write_batches"] += 1
        for op, result in zip(ops, results, strict=True):
            self._applied(op, result, epoch)
        return results

    def _applied(self, op: _op.Op, result: _op.Result, epoch: int) -> None:
        """Bring memory up to date with one committed result (trio thread, commit order) of a
        batch begun in `epoch`."""
        if isinstance(result, _op.Changed):
            t = result.transition
            if t.delivery is not None:
                self._tally.wakes[t.delivery] += 1
            if t.written:
                if t.flow.state is not result.before.state:
                    _ended(self._tally, result.before, t, self._ended)
                own = isinstance(op, _op.Change) and op.flow is not None
                self.track(result.before.state, t.flow, own, epoch=epoch)
            for more_op, more in result.more:  # a family's writes in the same transaction
                self._applied(more_op, more, epoch)
            _queues.follow(self, result, epoch)
        elif isinstance(result, _op.Created):
            _whole.created(self, result.transition.flow, epoch)
            _queues.follow(self, result, epoch)
        elif isinstance(result, _op.Conflict):
            self._tally.stats["conflicts"] += 1

    def track(
        self, before: State | None, flow: Flow, own: bool, *, epoch: int, write: bool = True
    ) -> None:
        """A committed row of `flow` (by this engine's write, or read back; the write or read
        began in `epoch`): follow it. Only this engine's writes count in its
        `completed`/`failed`/`blocked` statistics (`_counted`). Then: those who wait for the
        flow hear of it; the live copy is replaced (and a step it runs is void if someone else
        moved the flow); a flow this engine should run becomes live, one it should not is let
        go (`_dropped`), and a parked flow's deadline is armed (`_armed`)."""
        if write:
            self._tally.stats["writes"] += 1
        live = self.live.get(flow.flow_id)
        if live is not None and flow.revision <= live.flow.revision:
            return  # already known (a read that raced this engine's own write)
        if flow.state is not before:
            _counted(self._tally, before, flow, write)
        self._seen(flow)
        if live is not None:
            live.flow = flow
            live.epoch = epoch
            if not own and live.scope is not None:
                live.scope.cancel()  # someone else moved the flow: its running step is void
        if self.runs_here(flow):
            if live is None:  # given to this engine by a write: it becomes live, with a runner
                # A release still pending from when this engine let the flow go is void (the
                # renewal would release it while it runs here).
                self._mode.given_back(flow.flow_id)
                live = self.live[flow.flow_id] = Live(flow, epoch)
                self._runnable(live)
        else:
            if live is not None:
                _dropped(self.live, self._tally, live, flow, write)
            if flow.state is _PARKED and flow.park_deadline is not None:
                self._armed(flow, flow.park_deadline)

    def _armed(self, flow: Flow, deadline: float) -> None:
        """Arm the deadline of a parked flow, if this engine fires it: a serving engine does;
        a fleet engine fires no timer of a version it lacks (one that has it does)."""
        if self._serve and self._mode.fires(flow):
            self._arm(deadline, flow.flow_id, flow.revision)

    def let_go(self, live: Live, *, release: bool = False) -> None:
        """Stop the flow's step or compensation (its changes are discarded) and forget it:
        whoever takes it over runs it. With `release` (this engine's lease is lapsing: the
        store may still name it), the next renewal releases the flow in the store."""
        fid = live.flow.flow_id
        if self.live.get(fid) is live:
            del self.live[fid]
            self._tally.stats["lost"] += 1
            if release:
                self._mode.release_later(fid, live.flow.revision)
        if live.scope is not None:
            live.scope.cancel()

    def drop(self, live: Live) -> None:
        """The flow's row is gone (deleted while this engine held it): forget it. No
        checkpoint."""
        fid = live.flow.flow_id
        if self.live.get(fid) is live:
            del self.live[fid]

    def left_as_it_is(self, flow: Flow, problem: str, error: BaseException) -> None:
        """See `left_as_it_is` (the module's)."""
        left_as_it_is(self, flow, problem, error)

    async def load_row(self, flow_id: str) -> Flow | None:
        """The flow's row, for the engine's own use (`_read.own`: the store's error as it is;
        the engine retries unavailability, and any other error ends its block)."""
        return await _read.own(self._store, partial(_store.load, flow_id=flow_id))

    # ------------------------------------------------------------- writes of the engine's own

    def stale(self, flow_id: str, revision: int) -> bool:
        """Was the flow parked at `revision` moved on since, as far as this engine knows?"""
        live = self.live.get(flow_id)
        return revision != _whole.WHOLE and live is not None and live.flow.revision > revision

    async def time_out(
        self, flow_id: str, revision: int, deadline: float
    ) -> tuple[Flow, Flow] | None:
        """A park deadline came: time the flow out (`time_out`)."""
        return await time_out(self, flow_id, revision, deadline)


async def time_out(
    writes: Writes, flow_id: str, revision: int, deadline: float
) -> tuple[Flow, Flow] | None:
    """A park deadline came: time the flow out (its own problem if the database refuses that
    write: it blocks, ADR 0063; if it refuses that too, the flow is left as it is, ADR 0117).
    The store's unavailability is retried. The row before and the row written, or None if the
    flow had moved on or was left as it is (for its trace: `_tracing.timed`). A whole flow's
    deadline (`_whole.WHOLE`) cancels the flow instead (`_whole.passed`)."""
    if revision == _whole.WHOLE:
        await _whole.passed(writes, flow_id, deadline)
        return None
    plan = _queues.plan_of(flow_id)
    if plan is not None:  # a plan queue's timer (flow control)
        if writes.queue_timers.get(plan) == deadline:
            del writes.queue_timers[plan]
        await _queues.fire(writes, plan, deadline)
        return None
    now = max(writes._clock.now(), deadline)
    holder = writes.holders.rule(outside=True)
    # The machine ignores it unless the flow is still parked at `revision`: across a fleet,
    # every engine that armed this deadline fires it, and exactly one of them takes it.
    op = _op.Change(flow_id, _ops.TimeOut(revision, now, known=writes._own), holder=holder)
    what = f"timing out flow {flow_id!r} (parked at revision {revision})"
    extra = {"flow_id": flow_id}
    result = await _retry.retrying(partial(writes.write_answered, op), what=what, extra=extra)
    if isinstance(result, _op.Rejected):  # the flow's own problem: it blocks (ADR 0063)
        reason = f"the database refused its timeout: {_checks.describe(result.error)}"
        op = _op.Change(flow_id, _ops.Block(reason, now), expected=revision, holder=holder)
        result = await _retry.retrying(partial(writes.write_answered, op), what=what, extra=extra)
        if isinstance(result, _op.Rejected):  # that too: left as it is (ADR 0117)
            stored = await _retry.retrying(
                partial(writes.load_row, flow_id), what=what, extra=extra
            )
            if stored is not None and stored.revision == revision:
                problem = f"{reason}; and refused that too: {_checks.describe(result.error)}"
                writes.left_as_it_is(stored, problem, result.error)
            return None
    if isinstance(result, _op.Changed) and result.transition.written:
        return result.before, result.transition.flow
    return None


async def _transact_again(
    writes: Writes,
    ops: Sequence[_op.Op],
    write: Callable[..., list[_op.Result]],
    failed: BaseException,
) -> tuple[int, list[_op.Result]]:
    """`Writes._transact` after the database rolled its first try back on its own: retried (up
    to 3 times, `_retry.ROLLBACK`); the epoch the try that committed began in, and its
    results."""
    epoch = writes.epoch

    async def attempt() -> list[_op.Result]:
        nonlocal epoch
        epoch = writes.epoch
        return await writes._store.transact(
            partial(write, ops=ops, guard=writes.guard, owner=writes.admits_as)
        )

    results = await _retry.retrying(
        attempt,
        what=lambda: f"writing a batch of {len(ops)} flow writes (rolled back by the database)",
        schedule=_retry.ROLLBACK,
        when=_rolled_back,
        failed=failed,
    )
    return epoch, results


def _dropped(lives: dict[str, Live], tally: Tally, live: Live, flow: Flow, write: bool) -> None:
    """`live` is no longer this engine's to run (`flow` is its row now): forget it; if it moved
    on without this engine (still active, or read back), its step is stopped."""
    del lives[flow.flow_id]
    if flow.state in ACTIVE or not write:
        tally.stats["lost"] += 1
        if live.scope is not None:
            live.scope.cancel()


def _ended(tally: Tally, before: Flow, t: Transition, hook: Callable[[Flow], None]) -> None:
    """This engine's write `t` moved the flow out of the state of `before`: INFO if it left it
    failed or blocked (an operator may act), the observers (the end span first) of a flow it
    ended, and `hook` of a flow it finished (a schedule's waiting tick may start)."""
    after = t.flow
    if after.state in TERMINAL:
        hook(after)
    if after.state in LOGGED:
        log_ended(before, after)
    if tally.observers and after.state in _ENDS:
        _observe.ended(tally.observers, after, before.step, _end_of(t))


def _counted(tally: Tally, before: State | None, flow: Flow, write: bool) -> None:
    """The gauges and statistics of a flow that went from state `before` to `flow`'s: parked
    and blocked counts (in a fleet another engine may have parked it since this one's last
    count; a blocked flow resumed or abandoned leaves the gauge, docs/adr/0128), and, for
    this engine's own write that ended it, its end statistic."""
    state = flow.state
    if before is _PARKED and tally.parked > 0:
        tally.parked -= 1
    elif before is _BLOCKED and tally.blocked > 0:
        tally.blocked -= 1
    if state is _PARKED:
        tally.parked += 1
    elif state is _BLOCKED:
        tally.blocked += 1
    if before is State.QUEUED and tally.queued > 0:
        tally.queued -= 1
    elif state is State.QUEUED:
        tally.queued += 1
    if write and state in _ENDS:
        tally.stats[_ENDS[state]] += 1
    if write and flow.parent is not None:
        kin_counted(tally, before, flow)


async def gather(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the calls concurrently (so that their writes share transactions); results in order."""
    results: list[Any] = [None] * len(calls)

    async def one(i: int) -> None:
        results[i] = await calls[i]()

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(one, i)
    return results


def left_as_it_is(self: Writes, flow: Flow, problem: str, error: BaseException) -> None:
    """The database refuses every write of `flow` (this row), even the one that fails it
    (docs/adr/0117): a WARNING names it, the engine lets it go if it held it (no runner;
    a step's changes are discarded) and its waits answer at once with `problem`. The
    other flows go on; the next open (or, in a fleet, check round or scan) tries it again
    (docs/adr/0104)."""
    what = "%s is left as it is, not run by this engine: %s"
    _log.warning(what, named(flow), problem, extra=about(flow))
    self._refused(flow, problem, error)
    fid = flow.flow_id
    live = self.live.get(fid)
    if live is not None:
        del self.live[fid]
        if live.scope is not None:
            live.scope.cancel()
