"""Exhaustive model check of one flow: the pure machine composed with the actors around it.

`ferry.flow._model._machine` decides what a flow does; the store, the engine, the timer and the
outside world decide *when* each transition is asked for and on which copy of the row. This model
explores every interleaving of those actors for small bounds with the search of
`checker.py` (BFS, deduplicated states, shortest counterexample traces), asking the machine for
every transition through a `FlowProtocol` object, so that a test can plant a bug by overriding one.

Actors and their steps
----------------------
- the store holds the durable row (`Flow`), the mailbox and (abstracted to what the properties
  need, see `Ghost`) the history. A write is atomic. It is either a compare-and-set on the
  revision of the writer's copy (`_op.Change(flow=copy)`: the runner's writes, recovery's
  `rerun`, a closing engine's `let_go`) or a transition applied to the held row (`Change`
  without `flow`: wake, cancel, resume, the timer's `timeout` with ``expected=`` the revision it
  was armed for). A transition sees the mailbox as the store shows it: ``message_id in seen``
  and the first queued message. The store applies `Transition.messages` to the mailbox (not
  `Transition.mailbox`), as `_store._Batch.messages` does.
- an engine (`Engine`; a tuple of them: `tests/model/fleet.py` runs two with leases) is up or
  down. Up, it has at most one runner for the flow and at most one armed timer:
  - runner ``(READY,)``: read the row; run it if it is running or compensating, arm its timer if
    it is parked with a deadline, else stop. ``(RUN, copy, failures)``: run the step's or the
    compensation's body once (the side effect, counted per idempotency key), which continues,
    completes, parks, fails or raises as the bound allows. ``(DONE, copy, result, failures)``:
    ask the machine for the transition (`step_done`; `next_attempt` after a raise while this
    drive has raised fewer than ``attempts`` times, else `step_failed`; `compensated`;
    `next_attempt` or `compensation_failed`) and write it as a compare-and-set on `copy`:
    accepted, the runner goes on with the new row (or stops, arming a timer for a park);
    refused, it reads again (`Runner._advance`). A write may also commit and lose its answer (a
    cancelled or broken connection during COMMIT, ADR 0011): the engine cannot tell, and sends
    the same write again. The real runner is also cancelled when someone else moves its flow;
    here it runs on and finds out at its write, which allows every interleaving the real one
    has.
  - timer: fires once the clock reaches the armed deadline: `timeout` on the held row with
    ``expected=`` the armed revision (`Writes.time_out`). If the flow runs on, the engine runs it.
  - who holds the flow: every write the engine makes names it in the row's `owner` while the
    flow stays active, and none once it is not (`_holders.assign_holder`, as
    `Writes.holders`, the store's `HolderRule`; the flow starts held by it).
  - crash: the engine loses its runner, its retry budget and its timer. Restart: recovery, in
    one step because `open_engine` finishes it before it lets any call in (`_recovery.recover`):
    a running or compensating flow gets `rerun` written and runs again, as attempt + 1 if the
    row names an owner (that engine may have begun a run and recorded nothing), else with the
    attempt it holds (attempts count runs that began, ADR 0064); a parked one gets its timer.
  - close (bounded by ``closes``): the engine's graceful close (`_recovery.let_go_unbegun`). Its
    runner stops; if it was about to run a body (``(RUN, copy, failures)``: its run had not
    begun) it lets the flow go, `let_go` as a compare-and-set on `copy` (owner none, attempt
    kept), so that the next run keeps the attempt number; a body that had run without its
    result written is lost as in a crash. Then the engine is down, and restarts as after a
    crash. With
    ``unregistered``, a restart may come up without the flow's plan version (a deploy that
    dropped it): versions fail closed, so that engine blocks an active flow instead of running
    it (at recovery, or ``(BLOCK, copy)``: `block` as a compare-and-set), and asks `wake`,
    `timeout`, `cancel` and `resume` with no plan (``shape=None``). A later restart may bring
    the plan back.
- the outside world, through any engine that is up: sends each wake of the bound once, in order
  (``message_id`` from the bound: two equal ids make a duplicate), at any moment, so before the
  park, during it and after it; cancels once; resumes a `BLOCKED` flow (bounded); with
  ``abandon``, abandons a `BLOCKED` flow once (`Engine.abandon`); or stops (sends nothing more:
  a confirmation that never comes, a blocked flow nobody resumes).
- the clock: jumps to the next deadline (the row's, or an armed timer's).

The engine starts with the flow just started (revision 1) and its runner about to run step 0.

Properties
----------
In every state: the machine's `check_invariants` (row, mailbox and shape); the mailbox holds
exactly the accepted ids and, queued in arrival order, the accepted messages not yet taken; a
parked flow has no accepted wake left untaken (a wake before the park is never lost); a flow that
compensated or failed never runs forward, parks or completes again; a blocked flow can be resumed
by its own plan (`mismatch` finds nothing once the plan version is back).

On every write: the revision grows by exactly 1 per accepted write (none for an unwritten one)
and every event carries the new revision; no step outcome is recorded twice; compensations are
recorded in the reverse order of the completion of their steps, each once; a message is taken
exactly when a ``woken`` event names it, at most once; a timeout never fires after a wake was
accepted for that park (nor a wake after the timeout); a wake's `Delivery` is what the world's
ledger says (DUPLICATE iff its id was accepted, STALE iff the flow ended or compensates, RESUMED
iff parked before its deadline; at or after it, the timeout comes first);
the mailbox never gets a second message with one id (the store's unique key). On every body
run: never for a step or compensation whose outcome is recorded; its attempt number above every
earlier run's (attempt numbers never repeat, ADR 0024) and at most one above the last run's, plus
one for each time an engine went down (crash or close) leaving the flow there under its name and
each resume that re-drove it (numbers skip only where a run may have begun, ADR 0064); runs per
idempotency key <= 1 + crashes that hit an unrecorded run of it + resumes that re-drove it + its
retries (``attempts - 1`` in each drive: the engine's retry budget is in memory, so a crash gives
a fresh one).

An abandon ends the flow `FAILED` in its own write and names, as skipped, exactly the
compensations not yet recorded, in the order they would have run; no body runs after it.

In every terminal state (nothing can move): the flow is `COMPLETED`, `FAILED` or `BLOCKED` with
a reason; a completed flow compensated nothing; a failed one compensated every completed step
that has a compensation (an abandoned one: those recorded, then the skipped ones, in reverse
order of completion); no runner is left; no accepted wake that a later park should have taken
is left queued.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import attrs

from ferry.flow._model import _holders, _invariants, _values
from ferry.flow._model import _machine as fm
from ferry.flow._model._checks import fail, park
from ferry.flow._model._types import COMPLETE, CONTINUE, Delivery, Outcome, State
from ferry.flow._model._values import Flow, Mailbox, Message, Received, Shape, Taken, Transition
from tests.model.checker import Search, _step_violation

RUNNING, PARKED, COMPENSATING = State.RUNNING, State.PARKED, State.COMPENSATING
COMPLETED, FAILED, BLOCKED = State.COMPLETED, State.FAILED, State.BLOCKED
ACTIVE = (RUNNING, COMPENSATING)

OWNER = "engine"  # the one engine's `owner` name (on SQLite, `open_engine` makes one up)

# Runner phases (first element of an engine's runner tuple).
READY, RUN, DONE, BLOCK = "ready", "run", "done", "block"
# What a body may do: a step's outcomes, "raise"; a compensation: "ok" or "raise".
STEP_RESULTS = ("continue", "complete", "park", "fail", "raise")
COMPENSATION_RESULTS = ("ok", "raise")


@attrs.frozen
class StepSpec:
    """One step of the modelled plan: what its body may do, and its compensation's."""

    name: str
    outcomes: tuple[str, ...] = ("continue",)
    compensation: tuple[str, ...] | None = None  # None: the step has no compensation
    attempts: int = 1

    def __attrs_post_init__(self) -> None:
        assert self.outcomes and set(self.outcomes) <= set(STEP_RESULTS), self.outcomes
        assert self.compensation is None or set(self.compensation) <= set(COMPENSATION_RESULTS)
        assert self.attempts >= 1


@attrs.frozen
class FlowConfig:
    """Bounds of one flow model check (see the module doc for what each actor does)."""

    name: str
    steps: tuple[StepSpec, ...]
    timeout: float | None = 10.0  # the park's timeout
    on_timeout: str = "compensate"
    wakes: tuple[str, ...] = ("m1", "m2")  # message ids the world sends, in this order
    cancel: bool = True
    resumes: int = 1
    abandon: bool = False  # an operator may abandon a blocked flow (`Engine.abandon`), once
    crashes: int = 1
    closes: int = 0  # graceful closes of an engine (each followed by a restart)
    ambiguous: int = 0  # writes that commit and lose their answer
    unregistered: int = 0  # restarts that may come up without the flow's plan version
    engines: int = 1
    freezes: int = 0  # the fleet: an engine that runs the flow may freeze (SIGSTOP), then thaw
    # the fleet: an engine that runs the flow may have its trio loop blocked while its lease
    # thread runs on (a step's `time.sleep`, a full pipe), for longer than its lease
    blocks: int = 0
    outages: int = 0  # the fleet: an engine that runs the flow may fail to renew in time
    same_name: bool = False  # the fleet: engine 1 is a second incarnation of engine 0's name
    versions: bool = False  # the fleet: engine 1 lacks the flow's plan version (a deploy)
    skew: bool = False  # the fleet: engine 1's host clock is ahead by more than a lease

    @property
    def shape(self) -> Shape:
        return Shape(
            name="order",
            version=1,
            steps=tuple(s.name for s in self.steps),
            compensable=tuple(s.compensation is not None for s in self.steps),
            attempts=tuple(s.attempts for s in self.steps),
        )


Apply = Callable[[Flow, Mailbox], Transition]


@attrs.frozen
class Write:
    """One write as an engine sends it to the store (`_op.Change`): `apply` runs on `copy`
    as a compare-and-set on its revision, or (`copy` None) on the held row; the transition sees
    the mailbox's `message_id` entry and, with `first_queued`, its first queued message."""

    apply: Apply
    copy: Flow | None = None
    message_id: str | None = None
    first_queued: bool = False
    #: the fleet's takeover (`_op.Change.lapsed_at`): the row must also be nobody's
    orphan: bool = False
    #: compare-and-set the copy's revision (None: as the protocol's `runner_cas` says)
    cas: bool | None = None
    #: the engine that sends it (the fleet's takeover: whose host clock a planted orphan check
    #: reads, `FlowConfig.skew`)
    by: int | None = None


class FlowProtocol:
    """The machine's transitions and the engine's choices, as the real code makes them.

    Subclass to plant a bug (`tests/model/planted_flow.py`)."""

    #: the runner's writes compare-and-set the revision of its copy (``AND revision = ?``)
    runner_cas = True
    #: without that compare, the UPDATE still sets ``revision = revision + 1`` (else: the copy's)
    blind_write_bumps_stored_revision = True
    #: the timer's `timeout` runs on the held row with ``expected=`` the armed revision
    timer_checks_revision = True
    #: recovery arms the timers of parked flows
    recovery_arms_timers = True

    #: recovery writes `rerun` before it re-runs a step or compensation (ADR 0024, 0064)
    recovery_bumps_attempt = True
    #: a closing engine lets go only of a flow whose run had not begun (ADR 0064)
    close_lets_go_of_unbegun_runs_only = True

    def retries(self, flow: Flow, shape: Shape, failures: int) -> bool:
        """After the body raised for the ``failures + 1``-th time in this drive of the flow: run
        again (`next_attempt`), or give up (`step_failed`, `compensation_failed`). The budget
        is the engine's memory: a crash does not use it up (ADR 0024)."""
        return failures + 1 < shape.attempts[flow.step_index]

    def step_done(
        self, flow: Flow, mailbox: Mailbox, shape: Shape, outcome: Outcome, now: float
    ) -> Transition:
        return fm.step_done(flow, mailbox, shape, outcome, flow.data, now)

    def step_failed(self, flow: Flow, shape: Shape, error: str, now: float) -> Transition:
        return fm.step_failed(flow, shape, error, now)

    def next_attempt(self, flow: Flow, now: float) -> Transition:
        return fm.next_attempt(flow, now)

    def rerun(self, flow: Flow, now: float) -> Transition:
        return _holders.rerun(flow, now)

    def let_go(self, flow: Flow, now: float) -> Transition:
        return _holders.let_go(flow, now)

    def assign_holder(
        self, t: Transition, before: Flow, writer: str | None, keep_runner: bool
    ) -> Transition:
        return _holders.assign_holder(t, before, writer, keep_runner=keep_runner)

    def compensated(self, flow: Flow, shape: Shape, now: float) -> Transition:
        return fm.compensated(flow, shape, flow.data, now)

    def compensation_failed(self, flow: Flow, shape: Shape, error: str, now: float) -> Transition:
        return fm.compensation_failed(flow, error, now, shape)

    # Asked from outside, also through an engine that lacks the plan version (`shape` None).

    def wake(
        self, flow: Flow, mailbox: Mailbox, message: Message, shape: Shape | None, now: float
    ) -> Transition:
        return fm.wake(flow, mailbox, message, shape, now)

    def timeout(
        self, flow: Flow, shape: Shape | None, now: float, expected: int | None
    ) -> Transition:
        return fm.timeout(flow, shape, now, expected=expected)

    def cancel(self, flow: Flow, shape: Shape | None, now: float) -> Transition:
        return fm.cancel(flow, shape, "cancelled", now)

    def resume(self, flow: Flow, mailbox: Mailbox, shape: Shape | None, now: float) -> Transition:
        return fm.resume(flow, mailbox, shape, now)

    def block(self, flow: Flow, reason: str, now: float) -> Transition:
        return fm.block(flow, reason, now)

    def abandon(self, flow: Flow, shape: Shape | None, now: float) -> Transition:
        return fm.abandon(flow, shape, "abandoned", "an operator", now)


class Engine(NamedTuple):
    """One engine's memory: lost on a crash."""

    up: bool
    # (READY,) | (RUN, copy, failures) | (DONE, copy, result, failures) | (BLOCK, copy); None:
    # not running the flow. `failures`: raises in this drive of the flow. The fleet adds
    # (TAKE, copy): a scan read the flow as an orphan and is about to take it over.
    runner: tuple[Any, ...] | None
    timer: Flow | None  # the parked row it armed a timer for (at its `park_deadline`)
    plan: bool  # it has the flow's plan version (else it blocks the flow instead of running it)
    # The fleet (tests/model/fleet.py); constant in the one-engine model.
    frozen: bool = False  # SIGSTOP: it takes no step and answers no call until it thaws
    blocked: bool = False  # frozen, but only its trio loop: its lease thread runs on
    trust: bool = True  # it believes its lease holds (not `Lease.lapsing()`)
    # It let the flow go at this revision (0: it did not); its next renewal releases the flow
    # in the store if the row is still at that revision.
    released: int = 0
    void: bool = False  # ghost: its lease lapsed while its current run was in flight


class World(NamedTuple):
    """What the outside world and the bounds have used up."""

    sent: int  # wakes sent (the next one is `wakes[sent]`)
    cancelled: bool
    resumes: int
    crashes: int
    ambiguous: int
    unregistered: int
    freezes: int = 0  # the fleet: engines frozen (SIGSTOP) so far
    blocks: int = 0  # the fleet: trio loops blocked so far
    outages: int = 0  # the fleet: renewals an engine could not make in time while it ran on
    closes: int = 0  # graceful closes so far
    abandoned: bool = False  # an operator abandoned the blocked flow


class Ghost(NamedTuple):
    """What the properties need of the history and of the side effects, folded write by write."""

    outcomes: frozenset[int]  # steps whose outcome is recorded
    done: tuple[int, ...]  # completed steps with a compensation, in completion order
    compensated: tuple[int, ...]  # compensations recorded, in order
    took: tuple[int, ...]  # per park begun: the ledger index of the wake it took, or -1
    park: str  # the current park: "" (none yet), "open", "woken", "timed_out", "cancelled"
    ledger: tuple[tuple[str, int, str], ...]  # accepted wakes in order: (id, parks then, status)
    runs: tuple[int, ...]  # body runs per key: steps, then compensations
    drives: tuple[int, ...]  # drives (runs with a fresh retry budget) per key
    attempts: tuple[int, ...]  # the attempt number of the last run, per key
    hits: tuple[int, ...]  # crashes that hit a run whose outcome was not written, per key
    # times an engine went down (crash, close) leaving the flow active under its name, per key:
    # each may make the next run's attempt number skip one (a run that may have begun)
    skips: tuple[int, ...]
    resumes: tuple[int, ...]  # resumes that re-drove each key
    undoing: bool  # the flow compensated or failed: it never runs forward again
    # the compensations an operator's abandon skipped (ended the flow without), in the order
    # they would have run; None: not abandoned
    skipped: tuple[int, ...] | None = None


class S(NamedTuple):
    """One state of the flow model."""

    row: Flow
    mailbox: Mailbox
    now: float
    engines: tuple[Engine, ...]
    world: World
    ghost: Ghost
    leases: tuple[bool, ...] = ()  # the fleet: each engine's lease in the store (True: held)
    # the fleet: each engine's incarnation holds its owner name's row (False: another opened
    # under the name since, or it never opened)
    holders: tuple[bool, ...] = ()


class FlowChecker(Search):
    """Breadth-first search over the flow's actors (see the module doc)."""

    def __init__(
        self,
        config: FlowConfig,
        protocol: FlowProtocol | None = None,
        *,
        check_machine: bool = True,
    ) -> None:
        self.config = config
        self.name = config.name
        self.protocol = protocol or FlowProtocol()
        # False: only the model's own properties, not `check_invariants` (to show they see a
        # planted bug on their own).
        self.check_machine = check_machine
        self.shape = config.shape
        self.n = len(config.steps)
        self.index = {s.name: i for i, s in enumerate(config.steps)}
        self.park = park(config.timeout, config.on_timeout)  # type: ignore[arg-type]
        #: what the search saw happen (deliveries, refused writes, timers, ends...): a test
        #: checks that the bounds reach every case
        self.coverage: set[str] = set()

    #: check that attempt numbers skip only where a run may have begun (the fleet's takeovers
    #: after a lapse skip too: `tests/model/fleet.py` keeps only "never repeat")
    checks_skips = True

    # ---- the search ---------------------------------------------------------------------------

    def initial(self) -> S:
        t = fm.start(self.shape, "f", "{}", 0.0, owner=OWNER)
        engines = [Engine(True, (RUN, t.flow, 0), None, True)]
        engines += [Engine(True, None, None, True)] * (self.config.engines - 1)
        zero = (0,) * (2 * self.n)
        ghost = Ghost(frozenset(), (), (), (), "", (), zero, zero, zero, zero, zero, zero, False)
        return S(t.flow, t.mailbox, 0.0, tuple(engines), World(0, False, 0, 0, 0, 0), ghost)

    def canon(self, m: S) -> Any:
        return m

    def successors(self, m: S) -> Iterator[tuple[str, S]]:
        steps: list[tuple[str, S]] = []
        for e in range(len(m.engines)):
            steps += self._engine_steps(m, e)
        steps += self._world_steps(m)
        steps += self._clock(m)
        yield from steps
        # A crash can hit every point where something else could happen; once nothing can, the
        # state is terminal (a crash there would only hide a flow left stranded).
        if steps:
            yield from self._disruptions(m)

    def _engine_steps(self, m: S, e: int) -> list[tuple[str, S]]:
        """Engine e's own steps: restart if down; else its runner's and its timer's."""
        engine = m.engines[e]
        if not engine.up:
            return list(self._restart(m, e))
        steps: list[tuple[str, S]] = []
        if engine.runner is not None:
            steps += self._runner_steps(m, e, engine.runner)
        deadline = None if engine.timer is None else engine.timer.park_deadline
        if engine.timer is not None and deadline is not None and deadline <= m.now:
            steps.append(self._timer_fires(m, e, engine.timer))
        return steps

    def _disruptions(self, m: S) -> Iterator[tuple[str, S]]:
        """What may hit any point where something else could happen: a crash of an engine, or
        its graceful close."""
        if m.world.crashes < self.config.crashes:
            for e, engine in enumerate(m.engines):
                if engine.up:
                    yield self._crash(m, e)
        if m.world.closes < self.config.closes:
            for e, engine in enumerate(m.engines):
                if engine.up:
                    yield self._close(m, e)

    # ---- the store ------------------------------------------------------------------------------

    def _write(self, m: S, w: Write) -> Transition | None:
        """What the store makes of `w` in state `m`: the transition, or None if the compare-and-set
        is refused (`_op.Conflict`). Nothing is applied yet (`_record` does that)."""
        seen = m.mailbox.seen & {w.message_id} if w.message_id is not None else frozenset()
        view = Mailbox(m.mailbox.queued[:1] if w.first_queued else (), seen)
        if w.copy is None:
            return w.apply(m.row, view)
        cas = self.protocol.runner_cas if w.cas is None else w.cas
        if cas and m.row.revision != w.copy.revision:
            return None
        if w.orphan and not self._nobodys(m, w.by):
            return None
        t = w.apply(w.copy, view)
        if not cas and t.written and self.protocol.blind_write_bumps_stored_revision:
            t = _rebased(t, m.row.revision)  # ``SET revision = revision + 1``, no compare
        return t

    def _nobodys(self, m: S, by: int | None = None) -> bool:
        """Does no engine hold the flow (the fleet's takeover condition, as engine `by` sees
        it)? Never, with one."""
        return False

    def _record(self, m: S, t: Transition, step: str) -> S:
        """The store applies `t` (row if written, events, mailbox writes); step properties."""
        row = m.row
        if t.written:
            if t.flow.revision != row.revision + 1:
                raise _step_violation(
                    step, f"revision went from {row.revision} to {t.flow.revision}, not +1"
                )
        elif t.flow != row:
            raise _step_violation(step, "the row changed without a new revision")
        for ev in t.events:
            if ev.revision != t.flow.revision:
                raise _step_violation(
                    step, f"event {ev.kind!r} has revision {ev.revision}, the write {row.revision}"
                )
        mailbox, ledger, taken = self._messages(m, t, step)
        ghost = self._fold(m.ghost._replace(ledger=ledger), t, taken, step)
        if t.flow.state in (COMPENSATING, FAILED):
            ghost = ghost._replace(undoing=True)
        return m._replace(row=t.flow if t.written else row, mailbox=mailbox, ghost=ghost)

    def _messages(
        self, m: S, t: Transition, step: str
    ) -> tuple[Mailbox, tuple[tuple[str, int, str], ...], frozenset[str]]:
        queued = list(m.mailbox.queued)
        seen = set(m.mailbox.seen)
        ledger = list(m.ghost.ledger)
        parks = len(m.ghost.took)
        taken: set[str] = set()
        for w in t.messages:
            mid = w.message.message_id
            if isinstance(w, Received):
                if mid in seen:
                    raise _step_violation(step, f"message {mid!r} inserted twice in the mailbox")
                seen.add(mid)
                if w.taken:
                    taken.add(mid)
                    ledger.append((mid, parks, "taken"))
                else:
                    queued.append(w.message)
                    ledger.append((mid, parks, "queued"))
            else:
                assert isinstance(w, Taken)
                pending = [j for j, entry in enumerate(ledger) if entry[2] == "queued"]
                at = [j for j in pending if ledger[j][0] == mid]
                if not at or mid not in [q.message_id for q in queued]:
                    raise _step_violation(step, f"message {mid!r} taken but not queued")
                if at[0] != pending[0]:
                    raise _step_violation(
                        step, f"message {mid!r} taken before {ledger[pending[0]][0]!r}"
                    )
                queued = [q for q in queued if q.message_id != mid]
                self.coverage.add("queued wake taken")
                taken.add(mid)
                ledger[at[0]] = (mid, ledger[at[0]][1], "taken")
        return Mailbox(tuple(queued), frozenset(seen)), tuple(ledger), frozenset(taken)

    def _fold(self, g: Ghost, t: Transition, taken: frozenset[str], step: str) -> Ghost:
        """Fold the write's history events into the ghost, checking each."""
        outcomes, done, comps = g.outcomes, g.done, g.compensated
        took, park_state, resumes, skipped = g.took, g.park, g.resumes, g.skipped
        woken: set[str] = set()
        for ev in t.events:
            kind = ev.kind
            self.coverage.add(kind)
            i = self.index.get(ev.step) if ev.step is not None else None
            if kind == "step":
                assert i is not None
                if i in outcomes:
                    raise _step_violation(step, f"the outcome of step {ev.step!r} recorded twice")
                outcomes |= {i}
                if ev.detail["outcome"] in ("continue", "park") and self.shape.compensable[i]:
                    done = (*done, i)
            elif kind == "parked":
                took, park_state = (*took, -1), "open"
            elif kind == "woken":
                mid = ev.detail["message_id"]
                if mid not in taken or mid in woken:
                    raise _step_violation(step, f"woken by {mid!r}, which this write did not take")
                if park_state == "timed_out":
                    raise _step_violation(step, f"woken by {mid!r} after the park timed out")
                woken.add(mid)
                park_state = "woken"
                seq = [j for j, entry in enumerate(g.ledger) if entry[0] == mid]
                took = (*took[:-1], seq[0] if seq else len(g.ledger))
            elif kind == "timed_out":
                if park_state == "woken":
                    raise _step_violation(
                        step, "the park timed out after a wake was accepted for it"
                    )
                if park_state != "open":
                    raise _step_violation(step, f"a timeout fired for a park that is {park_state}")
                park_state = "timed_out"
            elif kind == "cancelled" and park_state == "open":
                park_state = "cancelled"
            elif kind == "compensated":
                assert i is not None
                if i in comps:
                    raise _step_violation(step, f"compensation of {ev.step!r} recorded twice")
                left = [j for j in reversed(done) if j not in comps]
                if not left or left[0] != i:
                    want = "none" if not left else repr(self.shape.steps[left[0]])
                    raise _step_violation(
                        step,
                        f"compensation of {ev.step!r} recorded out of order: completed"
                        f" {[self.shape.steps[j] for j in done]}, compensated"
                        f" {[self.shape.steps[j] for j in comps]}, next should be {want}",
                    )
                comps = (*comps, i)
            elif kind == "resumed" and t.flow.state in ACTIVE:
                key = self._key(t.flow)
                resumes = _bumped(resumes, key)
            elif kind == "abandoned":
                if t.flow.state is not FAILED:
                    raise _step_violation(step, f"abandoned, then {_where(t.flow)}")
                unrun = tuple(j for j in reversed(done) if j not in comps)
                names = [self.shape.steps[j] for j in unrun]
                if ev.detail["skipped"] != names:
                    raise _step_violation(
                        step, f"abandon says it skipped {ev.detail['skipped']}, not {names}"
                    )
                skipped = unrun
        if woken != taken:
            raise _step_violation(step, f"messages {sorted(taken - woken)} taken but not woken")
        before = g
        g = g._replace(
            outcomes=outcomes,
            done=done,
            compensated=comps,
            took=took,
            park=park_state,
            resumes=resumes,
            skipped=skipped,
        )
        # A key whose outcome is recorded never runs again (checked at every run): its counters
        # are forgotten, so that states that differ only in a finished key's past are one.
        finished = [*(outcomes - before.outcomes)]
        finished += [self.n + i for i in comps[len(before.compensated) :]]
        return _forget(g, finished) if finished else g

    def _key(self, flow: Flow) -> int:
        """The idempotency key (step or compensation) a running or compensating row is at."""
        return flow.step_index + (self.n if flow.state is COMPENSATING else 0)

    def _key_name(self, key: int) -> str:
        if key < self.n:
            return f"step {self.shape.steps[key]!r}"
        return f"compensation of {self.shape.steps[key - self.n]!r}"

    # ---- engines --------------------------------------------------------------------------------

    def _set_engine(self, m: S, e: int, **changes: Any) -> S:
        engines = list(m.engines)
        engines[e] = engines[e]._replace(**changes)
        return m._replace(engines=tuple(engines))

    def _after_write(self, m: S, e: int, flow: Flow, failures: int = 0) -> S:
        """The runner goes on with the row it wrote: runs it, or arms a timer for a park."""
        if flow.state in ACTIVE:
            runner = (RUN, flow, failures) if m.engines[e].plan else (BLOCK, flow)
            return self._set_engine(m, e, runner=runner)
        if flow.state is PARKED and flow.park_deadline is not None:
            return self._set_engine(m, e, runner=None, timer=flow)
        return self._set_engine(m, e, runner=None)

    def _drive(self, m: S, e: int, flow: Flow) -> S:
        """An outside write made the flow run (wake, timeout, cancel, resume) through engine e:
        it runs the flow unless its runner already holds it (that one will read again)."""
        if m.engines[e].runner is not None:
            return m
        return self._after_write(m, e, flow)

    def _runner_steps(self, m: S, e: int, runner: tuple[Any, ...]) -> Iterator[tuple[str, S]]:
        phase = runner[0]
        if phase == READY:
            row = m.row
            label = f"engine {e} reads revision {row.revision}: {_where(row)}"
            yield label, self._after_write(m, e, row)
        elif phase == RUN:
            yield from self._run_body(m, e, runner[1], runner[2])
        elif phase == DONE:
            yield from self._write_result(m, e, runner[1], runner[2], runner[3])
        else:
            assert phase == BLOCK
            copy = runner[1]
            what = f"engine {e} lacks the plan: blocks {_where(copy)}"
            t = self._write(m, self._lease(self._block(copy, m.now), e))
            if t is None:
                yield f"{what}: refused", self._set_engine(m, e, runner=(READY,))
            else:
                label = f"{what} (revision {t.flow.revision})"
                yield label, self._after_write(self._record(m, t, label), e, t.flow)

    def _lease(self, w: Write, e: int, *, outside: bool = False) -> Write:
        """`w` as engine e sends it, with who holds the flow after it (`Writes.holders`, the
        store's `HolderRule`): the one engine, while the flow stays active. The fleet overrides
        it."""
        p, apply = self.protocol, w.apply

        def held(f: Flow, b: Mailbox) -> Transition:
            return p.assign_holder(apply(f, b), f, OWNER, False)

        return Write(held, w.copy, w.message_id, w.first_queued, w.orphan, w.cas, w.by)

    def _block(self, copy: Flow, now: float) -> Write:
        """An engine that lacks the plan version blocks the flow (a compare-and-set on `copy`)."""
        reason = _values.mismatch(copy, None)
        assert reason is not None
        return Write(lambda f, _b: self.protocol.block(f, reason, now), copy)

    def _run_body(self, m: S, e: int, copy: Flow, failures: int) -> Iterator[tuple[str, S]]:
        key, name = self._key(copy), self._key_name(self._key(copy))
        spec = self.config.steps[copy.step_index]
        results = spec.outcomes if key < self.n else spec.compensation
        assert results is not None
        g = m.ghost
        label = f"engine {e} runs {name}, attempt {copy.attempt}"
        self._check_run(m, e, copy, label)
        if copy.step_index in (g.outcomes if key < self.n else g.compensated):
            raise _step_violation(label, f"{name} ran again after its outcome was recorded")
        if g.skipped is not None:
            raise _step_violation(label, f"{name} ran after an operator abandoned the flow")
        if copy.attempt <= g.attempts[key]:
            raise _step_violation(
                label, f"{name} ran as attempt {copy.attempt} again (attempts never repeat)"
            )
        most = g.attempts[key] + 1 + g.skips[key] + g.resumes[key]
        if self.checks_skips and copy.attempt > most:
            last = "as its first run" if not g.attempts[key] else f"after {g.attempts[key]}"
            raise _step_violation(
                label,
                f"{name} ran as attempt {copy.attempt} {last}, with {g.skips[key]} engine stops"
                f" and {g.resumes[key]} resumes between: attempts count runs that began",
            )
        runs = _bumped(g.runs, key)
        drives = g.drives if failures else _bumped(g.drives, key)
        retries = (spec.attempts - 1) * drives[key]
        allowed = 1 + g.hits[key] + g.resumes[key] + retries
        if runs[key] > allowed:
            raise _step_violation(
                label,
                f"{name} ran {runs[key]} times; allowed {allowed} (1 + crashes that hit it"
                f" {g.hits[key]} + resumes {g.resumes[key]} + retries {retries}:"
                f" {spec.attempts - 1} in each of {drives[key]} drives)",
            )
        attempts = (*g.attempts[:key], copy.attempt, *g.attempts[key + 1 :])
        nxt = m._replace(ghost=g._replace(runs=runs, drives=drives, attempts=attempts))
        for result in results:
            runner = (DONE, copy, result, failures)
            yield f"{label}: {result}", self._set_engine(nxt, e, runner=runner)

    def _check_run(self, m: S, e: int, copy: Flow, label: str) -> None:
        """Properties of a body about to run (the fleet's: one step at a time)."""

    def _check_write(self, m: S, e: int, copy: Flow, label: str) -> None:
        """Properties of a runner's write the store accepted (the fleet's: only the owner)."""

    def _runner_write(self, copy: Flow, result: str, failures: int, now: float) -> Write:
        """The runner's write for its body's `result` (a compare-and-set on `copy`)."""
        p, shape = self.protocol, self.shape
        apply: Apply
        if copy.state is RUNNING and result != "raise":
            outcomes: dict[str, Outcome] = {"continue": CONTINUE, "complete": COMPLETE}
            outcome = fail("declined") if result == "fail" else outcomes.get(result, self.park)
            apply = lambda f, b: p.step_done(f, b, shape, outcome, now)  # noqa: E731
            return Write(apply, copy, first_queued=result == "park")
        if result == "raise" and p.retries(copy, shape, failures):
            apply = lambda f, _b: p.next_attempt(f, now)  # noqa: E731
        elif copy.state is RUNNING:
            apply = lambda f, _b: p.step_failed(f, shape, "the body raised", now)  # noqa: E731
        elif result == "ok":
            apply = lambda f, _b: p.compensated(f, shape, now)  # noqa: E731
        else:
            apply = lambda f, _b: p.compensation_failed(f, shape, "it raised", now)  # noqa: E731
        return Write(apply, copy)

    def _write_result(
        self, m: S, e: int, copy: Flow, result: str, failures: int
    ) -> Iterator[tuple[str, S]]:
        t = self._write(m, self._lease(self._runner_write(copy, result, failures, m.now), e))
        what = f"engine {e} writes {self._key_name(self._key(copy))} {result}"
        if t is None:
            self.coverage.add("write refused")
            label = f"{what}: refused (copy at {copy.revision}, store at {m.row.revision})"
            yield label, self._set_engine(m, e, runner=(READY,))
            return
        label = f"{what}: revision {t.flow.revision}, {_where(t.flow)}"
        if t.written:
            self._check_write(m, e, copy, label)
        done = self._record(m, t, label)
        retried = result == "raise" and self.protocol.retries(copy, self.shape, failures)
        yield label, self._after_write(done, e, t.flow, failures + 1 if retried else 0)
        if m.world.ambiguous < self.config.ambiguous and t.written:
            self.coverage.add("answer lost")
            lost = f"{label} (committed, answer lost: the engine writes it again)"
            world = m.world._replace(ambiguous=m.world.ambiguous + 1)
            yield lost, self._record(m, t, lost)._replace(world=world)

    def _timer_fires(self, m: S, e: int, armed: Flow) -> tuple[str, S]:
        p, shape = self.protocol, self._shape(m, e)
        what = f"engine {e}'s timer for revision {armed.revision} fires at {m.now}"
        if p.timer_checks_revision:
            fire = Write(lambda f, _b: p.timeout(f, shape, m.now, armed.revision))
            t = self._write(m, self._lease(fire, e, outside=True))
            assert t is not None
        else:  # computed on the armed copy, written over the row without a compare
            fire = Write(lambda f, _b: p.timeout(f, shape, m.now, None))
            t = self._lease(fire, e, outside=True).apply(armed, Mailbox())
            if t.written:
                t = _rebased(t, m.row.revision)
        self.coverage.add(f"timer {'fires' if t.written else 'finds nothing'}")
        if not t.written:
            return f"{what}: nothing to do", self._set_engine(m, e, timer=None)
        label = f"{what}: revision {t.flow.revision}, {_where(t.flow)}"
        m = self._set_engine(self._record(m, t, label), e, timer=None)
        return label, self._drive(m, e, t.flow)

    def _crash(self, m: S, e: int) -> tuple[str, S]:
        runner = m.engines[e].runner
        g = m.ghost
        label = f"engine {e} crashes"
        if runner is not None and runner[0] == DONE and not m.engines[e].void:
            key = self._key(runner[1])
            g = g._replace(hits=_bumped(g.hits, key))
            label += f" ({self._key_name(key)} ran, its result not written)"
        world = m.world._replace(crashes=m.world.crashes + 1)
        m = self._set_engine(m, e, up=False, runner=None, timer=None)
        return label, self._left_held(m._replace(world=world, ghost=g))

    def _left_held(self, m: S) -> S:
        """After an engine went down: if it left the flow active under its name, the next run
        may be one attempt number further on (`rerun`)."""
        row = m.row
        if row.state not in ACTIVE or row.owner is None:
            return m
        return m._replace(ghost=m.ghost._replace(skips=_bumped(m.ghost.skips, self._key(row))))

    def _close(self, m: S, e: int) -> tuple[str, S]:
        """Engine e closes (`_recovery.let_go_unbegun`): a runner about to run a body lets the
        flow go (a compare-and-set on its copy); then it is down, as after a crash, whose
        bookkeeping of a body that ran unrecorded it shares."""
        p, runner, now = self.protocol, m.engines[e].runner, m.now
        label = f"engine {e} closes"
        unbegun = runner is not None and runner[0] == RUN
        began = runner is not None and runner[0] == DONE
        if unbegun or (began and not p.close_lets_go_of_unbegun_runs_only):
            assert runner is not None
            copy = runner[1]
            t = self._write(m, Write(lambda f, _b: p.let_go(f, now), copy))
            if t is None:
                self.coverage.add("let go refused")
                label += f", cannot let go of revision {copy.revision} (moved on)"
            else:
                self.coverage.add("let go")
                label += f", lets go of {_where(copy)}: revision {t.flow.revision}"
                m = self._record(m, t, label)
        else:
            self.coverage.add(f"close {'without a runner' if runner is None else runner[0]}")
        down, m = self._crash(m._replace(world=m.world._replace(crashes=m.world.crashes - 1)), e)
        world = m.world._replace(closes=m.world.closes + 1)
        return label + down.removeprefix(f"engine {e} crashes"), m._replace(world=world)

    def _restart(self, m: S, e: int) -> Iterator[tuple[str, S]]:
        """Recovery (one engine), done before `open_engine` lets any call in: an active flow
        gets `rerun` written (attempt + 1 if the row names an owner, else the same attempt) and
        runs again (or is blocked if the plan version is missing); a parked one gets its
        timer."""
        row, w, p, now = m.row, m.world, self.protocol, m.now
        self.coverage.add(f"restart {row.state.name}")
        plans = [True] + ([False] if w.unregistered < self.config.unregistered else [])
        for plan in plans:
            label = f"engine {e} restarts"
            nxt = self._set_engine(m, e, up=True, plan=plan)
            if not plan:
                label += " without plan 'order' v1"
                nxt = nxt._replace(world=w._replace(unregistered=w.unregistered + 1))
            label += f", recovers {_where(row)}"
            if row.state in ACTIVE and plan and not p.recovery_bumps_attempt:
                yield label, self._set_engine(nxt, e, runner=(RUN, row, 0))
            elif row.state in ACTIVE:
                if plan:
                    write = Write(lambda f, _b: p.rerun(f, now), row)
                    self.coverage.add(f"rerun {'bumps' if row.owner else 'keeps'} the attempt")
                else:
                    write = self._block(row, now)
                t = self._write(nxt, self._lease(write, e))
                assert t is not None  # nothing else writes during recovery
                label += f": revision {t.flow.revision}, {_where(t.flow)}"
                yield label, self._after_write(self._record(nxt, t, label), e, t.flow)
            elif row.state is PARKED and row.park_deadline is not None and p.recovery_arms_timers:
                yield label, self._set_engine(nxt, e, timer=row)
            else:
                yield label, nxt

    def _shape(self, m: S, e: int) -> Shape | None:
        """The plan as engine e has it (None: it lacks the flow's plan version)."""
        return self.shape if m.engines[e].plan else None

    # ---- the outside world and the clock --------------------------------------------------------

    def _world_steps(self, m: S) -> Iterator[tuple[str, S]]:
        """Wakes, cancel and resume, through each engine that is up (it drives the flow on)."""
        up = [e for e, engine in enumerate(m.engines) if engine.up and not engine.frozen]
        calls = 0
        for e in up:
            for what, write, world in self._calls(m, self._shape(m, e)):
                calls += 1
                t = self._write(m, self._lease(write, e, outside=True))
                assert t is not None
                answer = str(t.written) if t.delivery is None else t.delivery.name
                via = f" (engine {e})" if len(m.engines) > 1 else ""
                if not m.engines[e].plan:
                    via += " (no plan)"
                label = f"{what}{via} while {_where(m.row)}: {answer}"
                if t.delivery is not None:
                    self._check_delivery(m, write, t, label, self._shape(m, e) is not None)
                label += f", revision {t.flow.revision}, {_where(t.flow)}" if t.written else ""
                self.coverage.add(f"{what.split()[0]} {answer}")
                nxt = self._record(m, t, label)._replace(world=world)
                yield label, self._drive(nxt, e, t.flow) if t.written else nxt
        if calls:
            cfg, w = self.config, m.world
            # Nothing more comes from outside (a wake that never comes: the park times out; no
            # operator resumes a blocked flow).
            done = w._replace(
                sent=len(cfg.wakes), cancelled=True, resumes=cfg.resumes, abandoned=True
            )
            yield "the world sends nothing more", m._replace(world=done)

    def _calls(self, m: S, shape: Shape | None) -> list[tuple[str, Write, World]]:
        """What the world may ask now: ``(label, write, world after)``."""
        cfg, w, p, now = self.config, m.world, self.protocol, m.now
        calls: list[tuple[str, Write, World]] = []
        if w.sent < len(cfg.wakes):
            mid = cfg.wakes[w.sent]
            message = Message(mid, f'{{"wake":{w.sent}}}')
            wake = Write(lambda f, b: p.wake(f, b, message, shape, now), message_id=mid)
            calls.append((f"wake {mid!r} #{w.sent}", wake, w._replace(sent=w.sent + 1)))
        if cfg.cancel and not w.cancelled:
            cancel = Write(lambda f, _b: p.cancel(f, shape, now))
            calls.append(("cancel", cancel, w._replace(cancelled=True)))
        if m.row.state is BLOCKED and w.resumes < cfg.resumes:
            resume = Write(lambda f, b: p.resume(f, b, shape, now), first_queued=True)
            calls.append(("resume", resume, w._replace(resumes=w.resumes + 1)))
        if cfg.abandon and m.row.state is BLOCKED and not w.abandoned:
            abandon = Write(lambda f, _b: p.abandon(f, shape, now))
            calls.append(("abandon", abandon, w._replace(abandoned=True)))
        return calls

    def _check_delivery(self, m: S, write: Write, t: Transition, label: str, plan: bool) -> None:
        """A wake's answer is what the world's ledger says it must be (a parked flow whose plan
        the engine lacks is blocked, and the wake kept: QUEUED)."""
        row = m.row
        if write.message_id in {mid for mid, _, _ in m.ghost.ledger}:
            want = Delivery.DUPLICATE
        elif row.state in (COMPLETED, FAILED, COMPENSATING):
            want = Delivery.STALE  # ended, or will not park again
        elif row.state is PARKED and row.park_deadline is not None and m.now >= row.park_deadline:
            # Time wins at the deadline: the timeout runs first; the wake then meets a flow that
            # compensates (STALE), runs on (QUEUED) or, without its plan, is blocked (QUEUED).
            compensates = plan and row.on_timeout == "compensate"
            want = Delivery.STALE if compensates else Delivery.QUEUED
        elif row.state is PARKED and plan:
            want = Delivery.RESUMED
        else:
            want = Delivery.QUEUED
        if t.delivery is not want:
            raise _step_violation(label, f"wake answered {t.delivery}, expected {want}")

    def _clock(self, m: S) -> Iterator[tuple[str, S]]:
        deadlines = [x.timer.park_deadline for x in m.engines if x.timer is not None]
        if m.row.state is PARKED:
            deadlines.append(m.row.park_deadline)
        future = [d for d in deadlines if d is not None and d > m.now]
        if future:
            yield f"clock advances to {min(future)}", m._replace(now=min(future))

    # ---- properties -----------------------------------------------------------------------------

    def _check_state(self, m: S) -> None:
        row, box, g = m.row, m.mailbox, m.ghost
        if self.check_machine:
            _invariants.check_invariants(row, box, self.shape)
        accepted = {mid for mid, _, _ in g.ledger}
        assert box.seen == accepted, f"mailbox ids {sorted(box.seen)}, accepted {sorted(accepted)}"
        pending = [mid for mid, _, status in g.ledger if status == "queued"]
        queued = [q.message_id for q in box.queued]
        assert sorted(queued) == sorted(pending), f"queued {queued}, accepted untaken {pending}"
        if row.state is PARKED and pending:
            raise AssertionError(
                f"parked with accepted wakes {pending} untaken: a wake before the park is lost"
            )
        unfit = _values.mismatch(row, self.shape)
        if row.state is BLOCKED and unfit is not None:
            raise AssertionError(f"blocked so that its own plan cannot resume it: {unfit}")
        if g.undoing and row.state in (RUNNING, PARKED, COMPLETED):
            raise AssertionError(f"the flow compensated or failed, then went {row.state.name}")

    def _check_terminal(self, m: S) -> None:
        row, g = m.row, m.ghost
        self.coverage.add(f"end {row.state.name}")
        assert row.state in (COMPLETED, FAILED, BLOCKED), f"the flow stays {_where(row)}"
        if row.state is BLOCKED:
            assert row.blocked, "blocked without a reason"
        if row.state is COMPLETED:
            assert not g.compensated, f"completed after compensating {g.compensated}"
        if row.state is FAILED:
            assert g.compensated + (g.skipped or ()) == tuple(reversed(g.done)), (
                f"failed with compensations {g.compensated} (and skipped {g.skipped}),"
                f" completed {g.done}"
            )
        for e, engine in enumerate(m.engines):
            assert engine.runner is None, f"engine {e} still runs {engine.runner[:1]}"
        for seq, (mid, parks, status) in enumerate(g.ledger):
            if status == "queued" and any(j == -1 or j > seq for j in g.took[parks:]):
                raise AssertionError(f"wake {mid!r} accepted before a park that did not take it")


def _forget(g: Ghost, keys: list[int]) -> Ghost:
    """`g` with the run counters of `keys` at zero."""

    def zeroed(counts: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(0 if k in keys else c for k, c in enumerate(counts))

    return g._replace(
        runs=zeroed(g.runs),
        drives=zeroed(g.drives),
        attempts=zeroed(g.attempts),
        hits=zeroed(g.hits),
        skips=zeroed(g.skips),
        resumes=zeroed(g.resumes),
    )


def _bumped(counts: tuple[int, ...], key: int) -> tuple[int, ...]:
    return (*counts[:key], counts[key] + 1, *counts[key + 1 :])


def _rebased(t: Transition, revision: int) -> Transition:
    """`t` written over a row at `revision`, as an UPDATE with no revision compare would."""
    flow = attrs.evolve(t.flow, revision=revision + 1)
    events = tuple(attrs.evolve(ev, revision=revision + 1) for ev in t.events)
    return attrs.evolve(t, flow=flow, events=events, expected=revision)


def _where(flow: Flow) -> str:
    state = flow.state.name
    if flow.state in ACTIVE:
        return f"{state} {flow.step!r} attempt {flow.attempt}"
    if flow.state is PARKED:
        return f"{state} at {flow.step!r} until {flow.park_deadline}"
    if flow.state is BLOCKED:
        return f"{state} ({flow.blocked})"
    return state
