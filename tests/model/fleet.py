"""Exhaustive model check of one flow run by a fleet of two engines with leases.

`tests/model/flow.py` explores one flow with one engine on one SQLite file. This model puts the
same flow on PostgreSQL with two engines, as `ferry/flow/_engine/_engine.py` runs a fleet: each
engine holds a lease of its own (a row it renews every ``lease / 3``); an active flow is held by the
engine named in its `owner` for as long as that engine's lease runs, unless the engine let it go
(`released_at` set on the row); any engine may take over a flow that nobody holds. The store,
the machine's transitions, the world and the clock are those of the one-engine model; what
changes is who may run the flow, and when.

Actors and their steps (on top of `flow.py`'s)
-----------------------------------------------
- the store also holds each engine's lease: held or lapsed (`S.leases`). A flow is *held* by
  engine e when it is active, its `owner` is e, e did not let it go (`released_at` None) and
  e's lease is held; else it is nobody's (`_store._orphan`). Every write an engine makes leaves
  the flow with that engine (`_holders.assign_holder`), except that an outside request (wake,
  cancel, resume, timeout) on an active flow with another owner leaves it with that owner.
- an engine that is up and not frozen, besides its runner, its timer and the calls it serves:
  - scans (`Rounds.scan`): if it trusts its lease and does not run the flow, it reads the flow
    when nobody holds it (runner ``(TAKE, copy)``), then takes it over (`take_over`: attempt
    + 1) as a compare-and-set on the copy's revision *and* on the flow still being nobody's
    (``lapsed_at``). Refused, it forgets it. Its scan also arms the timer of a park that is
    due, whichever engine parked it, and fires it (`Timers.arm`: arming earlier changes
    nothing until the deadline); the engine that parked the flow armed its own already.
  - renews its lease (`Lease.renew`) when it lapsed or the engine stopped trusting it,
    releasing in the same transaction the flow it let go meanwhile if the row is still at the
    revision it let go (`_store.renew`). A renewal after the engine stopped trusting its lease
    re-reads the flow before the engine trusts it again: a copy the row moved past sends the
    runner to read it (ADR 0047).
  - lets the flow go (`Writes.let_go`) when it no longer trusts its lease: the runner stops,
    a body that ran is discarded, and the next renewal releases the flow. A runner about to
    run a body without trusting the lease does the same (`Runner._attempt`). A write that
    leaves the flow with this engine again cancels the release (`Writes.track`).
  - adopts a flow held under its name that it does not run (`Rounds.check_held`: a takeover
    whose answer was lost), writing attempt + 1 as a compare-and-set.
- the leases and time: an engine stops trusting its lease before the lease lapses in the store
  (`_LEASE_MARGIN`: its view of its lease is elapsed time since a renewal began, which the
  database granted from a later moment: ADR 0110). With `skew`, engine 1's host clock is ahead
  of engine 0's by more than a lease: leases go by the database's clock, so nothing changes (a
  planted bug that compares leases with the host's clock lets engine 1 see engine 0's live
  lease as lapsed, in its scan and in its takeover's check). A frozen engine's lease lapses in
  one step (its trust with it), a crashed engine's too. An engine whose renewals fail while it
  runs on (an *outage*) gives up at the margin: it stops trusting its lease and lets the flow go
  in one step; its lease may lapse after that, and a renewal may get through later. Each engine
  in every state either trusts its lease and holds it, or not; nothing else of time is modelled.
- freeze and thaw (SIGSTOP, a long pause): a frozen engine takes no step, answers no call and
  fires no timer; it thaws at any moment later and goes on exactly where it stopped (a body that
  was in flight finishes, a write that was due is sent, a runner about to run a body runs it if
  its lease is trusted by then).
- a blocked loop (a step's `time.sleep`, a write to a pipe nobody reads): as frozen, but its
  lease thread runs on (`_heartbeat.Keeper`). It renews only while the loop answers within a
  lease (ADR 0112), so the lease may lapse while the loop is blocked, and the loop thaws only
  after that: the model's block is longer than any lease (a shorter one is a slow step, which
  it does not tell from any other). A thread that renewed for a blocked loop would hold the
  flow for ever: the terminal states say so.
- crash and restart: a restart keeps the engine's name (`open_engine(owner=...)`): recovery
  renews its lease and re-runs, as attempt + 1, the flow if it is active under its name
  (`_recovery.recover`); its first scan is the scan steps above.

The flow starts held by engine 0 (`start`), its runner about to run step 0; engine 1 is idle.
Freezes and outages are bounded like crashes, and hit an engine in the middle of a step.
`FleetProtocol` holds the engine's choices; a test plants a bug by overriding one.

Properties (on top of every one of `flow.py`'s)
------------------------------------------------
- One step at a time: an engine starts a body (a step's or a compensation's) only if no other
  engine holds the flow, and no other engine has a run in flight whose outcome is not recorded
  and whose lease held all along. A run that was in flight when its engine's lease lapsed (a
  frozen owner) may finish, but is *void*: a body it ran counts in the allowance of runs per
  key, as a crash's (1 + crashes, lapses or let-gos that hit an unrecorded run + resumes +
  retries), and it can never record its outcome. A stale run (an outside request through the
  other engine moved the flow, and nobody holds it now) may start, as in `flow.py`.
- The store accepts a runner's write only from the engine the row names as its owner: a frozen
  owner whose flow was taken over advances nothing after it wakes.
- A takeover is accepted only for a flow that nobody holds.
- A timeout fires exactly once per park across both engines (a second `timed_out` for one park
  violates `flow.py`'s park states), and never after a wake was accepted for that park.
- In every state: a flow that is not active has no owner and no release mark; an active one has
  an owner; an engine that trusts its lease holds it in the store.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from ferry.flow._model import _holders
from ferry.flow._model import _machine as fm
from ferry.flow._model._types import State
from ferry.flow._model._values import Flow, Mailbox, Shape, Transition
from tests.model.checker import _step_violation
from tests.model.flow import (
    ACTIVE,
    BLOCK,
    DONE,
    PARKED,
    READY,
    RUN,
    FlowChecker,
    FlowConfig,
    FlowProtocol,
    S,
    Write,
    _bumped,
    _where,
)

ENDED = (State.COMPLETED, State.FAILED)
TAKE = "take"  # a runner phase: a scan read the flow as nobody's and is about to take it over
NAMES = ("e0", "e1", "e2")  # the engines' `owner` names


class FleetProtocol(FlowProtocol):
    """The fleet engine's transitions and choices as the real code makes them; subclass to
    plant a bug (`tests/model/planted_fleet.py`)."""

    #: a takeover compares-and-sets the revision its scan read (``AND revision = ?``)
    takeover_cas = True
    #: ... and requires the flow to be still nobody's (`_store._orphan`, ``lapsed_at``)
    takeover_checks_orphan = True
    #: a runner about to run a body lets the flow go if it no longer trusts its lease
    runner_checks_lease = True
    #: an outside request leaves a flow another engine holds with that engine (``keep_runner``)
    outside_respects_owner = True
    #: a renewal releases the flow the engine let go (`_store.renew(let_go=...)`)
    renewal_releases = True
    #: ... only if the flow is still under its name (`_store.release`: ``AND owner = ?``)
    release_checks_owner = True
    #: ... and still at the revision it was let go at (``AND revision = ?``)
    release_checks_revision = True
    #: a renewal after the engine stopped trusting its lease re-reads the flow before the
    #: engine trusts it again (`Lease.renew`, ADR 0047)
    renewal_rereads = True
    #: a flow let go and then left with this engine again (a wake, a timer, a cancel through it)
    #: is no longer released by the next renewal (`Writes.track`)
    retaken_not_released = True
    #: an engine opens under an owner name only if no other incarnation that is up holds it
    #: with a live lease, and the name is then its alone (`_store.claim`, ADR 0071)
    claim_checks_incarnation = True
    #: lease times are written and compared on the database's clock, in the transaction
    #: (`_store.lease_clock`, ADR 0110): an engine whose host clock is ahead (`FlowConfig.skew`)
    #: sees no live lease as lapsed, in its scan or in its takeover's check
    leases_by_database_clock = True
    #: an engine without the flow's plan version leaves it to a live engine that has it: an
    #: outside request is computed with the fleet's shape and leaves the flow nobody's, it fires
    #: no timer and takes nothing over of that version, and its runner lets such a flow go
    #: instead of blocking it (`Requests.versioned`, `Versions.elsewhere`, ADR 0074)
    fleet_versions = True
    #: the lease thread renews only while the trio loop answers within a lease: a blocked loop
    #: loses its lease (`_heartbeat.Keeper`, ADR 0112)
    renews_only_while_the_loop_runs = True

    def take_over(self, flow: Flow, owner: str, now: float) -> Transition:
        return _holders.take_over(flow, owner, now)


class FleetChecker(FlowChecker):
    """Breadth-first search over one flow, two engines with leases, and the world."""

    protocol: FleetProtocol
    # A takeover after a lapse may skip an attempt number with no engine down (the owner froze
    # or could not renew before its run began): here attempt numbers are only checked never to
    # repeat.
    checks_skips = False

    def __init__(
        self,
        config: FlowConfig,
        protocol: FleetProtocol | None = None,
        *,
        check_machine: bool = True,
    ) -> None:
        assert 2 <= config.engines <= len(NAMES), config.engines
        assert not config.unregistered, "the fleet model varies versions with `versions`"
        super().__init__(config, protocol or FleetProtocol(), check_machine=check_machine)
        n = config.engines
        #: each engine's owner name: with `same_name`, engine 1 is a second incarnation of
        #: engine 0's name (a copy-pasted configuration, or a restart elsewhere)
        self.names = (NAMES[0], *NAMES[:1], *NAMES[2:n]) if config.same_name else NAMES[:n]
        #: the engines without the flow's plan version (a rolling deploy)
        self.lacks = frozenset({1}) if config.versions else frozenset()
        #: the engines whose host clock is ahead of the others' by more than a lease
        self.skewed = frozenset({1}) if config.skew else frozenset()
        self._ctx: S | None = None  # the state whose successors are being computed

    def initial(self) -> S:
        m = super().initial()
        t = fm.start(self.shape, "f", "{}", 0.0, owner=self.names[0])
        m = self._set_engine(m._replace(row=t.flow), 0, runner=(RUN, t.flow, 0))
        n = self.config.engines
        m = m._replace(leases=(True,) * n, holders=(True,) * n)
        if self.config.same_name:  # the second incarnation has not opened yet
            m = self._set_engine(m, 1, up=False)._replace(
                leases=_set(m.leases, 1, False), holders=_set(m.holders, 1, False)
            )
        for e in self.lacks:
            m = self._set_engine(m, e, plan=False)
        return m

    def successors(self, m: S) -> Iterator[tuple[str, S]]:
        self._ctx = m
        yield from super().successors(m)

    def canon(self, m: S) -> Any:
        """Once the flow has ended, an engine that no longer runs it differs from another only
        in what cannot matter any more: its timer (it finds nothing), its lease and trust (they
        decide who runs an active flow) and its ghost flags."""
        if m.row.state not in ENDED:
            return m
        engines = list(m.engines)
        leases = list(m.leases)
        for e, engine in enumerate(engines):
            if engine.runner is None:
                engines[e] = engine._replace(timer=None, trust=engine.up, released=0)
                leases[e] = True
        return m._replace(engines=tuple(engines), leases=tuple(leases))

    # ---- who holds the flow ---------------------------------------------------------------------

    def _holder(self, m: S) -> int | None:
        """The engine that holds the flow in the store, or None (nobody's, or not active)."""
        holders = self._holders(m)
        return holders[0] if holders else None

    def _holders(self, m: S) -> list[int]:
        """Every engine that holds the flow in the store: more than one only if two
        incarnations of one name both hold it (the bug of ADR 0071)."""
        row = m.row
        if row.state not in ACTIVE or row.owner is None or row.released_at is not None:
            return []
        return [
            e
            for e, name in enumerate(self.names)
            if name == row.owner and m.holders[e] and m.leases[e]
        ]

    def _nobodys(self, m: S, by: int | None = None) -> bool:
        """Is the flow nobody's, as engine `by` sees it (its scan, its takeover's check)? By
        the one clock of the leases (the database's, ADR 0110) that is what the store says;
        by a host clock ahead by more than a lease (`FlowConfig.skew`, a planted bug), every
        other engine's lease has lapsed."""
        if m.row.state not in ACTIVE:
            return False
        holder = self._holder(m)
        if holder is None:
            return True
        return by in self.skewed and holder != by and not self.protocol.leases_by_database_clock

    def _who(self, m: S) -> str:
        row = m.row
        if row.owner is None:
            return "no owner"
        named = [e for e, name in enumerate(self.names) if name == row.owner]
        if len(named) > 1:  # incarnations of one name: the one that holds it, if any
            named = [e for e in named if m.holders[e]] or named
        e = named[0]
        if row.released_at is not None:
            return f"engine {e} let it go"
        return f"engine {e}" + ("" if m.leases[e] and m.holders[e] else ", whose lease lapsed")

    def _live_with_plan(self, m: S, e: int) -> bool:
        """Does an engine other than e, up and with a lease that runs, have the plan version?"""
        return any(
            f != e and engine.up and engine.plan and m.leases[f]
            for f, engine in enumerate(m.engines)
        )

    def _elsewhere(self, m: S, e: int) -> bool:
        """Does engine e leave the flow to another engine (it lacks the version, one that is
        live has it)? `Versions.elsewhere`."""
        return e in self.lacks and self.protocol.fleet_versions and self._live_with_plan(m, e)

    def _shape(self, m: S, e: int) -> Shape | None:
        if m.engines[e].plan:
            return self.shape
        return self.shape if self._elsewhere(m, e) else None

    def _lease(self, w: Write, e: int, *, outside: bool = False) -> Write:
        p = self.protocol
        assert self._ctx is not None
        name = None if self._elsewhere(self._ctx, e) else self.names[e]
        keep_runner = outside and p.outside_respects_owner
        apply = w.apply

        def held(f: Flow, b: Mailbox) -> Transition:
            return p.assign_holder(apply(f, b), f, name, keep_runner)

        return Write(held, w.copy, w.message_id, w.first_queued, w.orphan, w.cas, w.by)

    def _record(self, m: S, t: Transition, step: str) -> S:
        """As `flow.py`'s; and an engine never blocks a flow for a version it lacks while
        another live engine has it (a rolling deploy)."""
        if (
            t.written
            and t.flow.state is State.BLOCKED
            and m.row.state is not State.BLOCKED
            and "not registered" in (t.flow.blocked or "")
        ):
            live = [f for f in range(len(m.engines)) if m.engines[f].plan and m.engines[f].up]
            if any(m.leases[f] for f in live):
                raise _step_violation(
                    step, f"blocked for a missing version while engine {live} has it and is live"
                )
        return super()._record(m, t, step)

    # ---- engine steps ---------------------------------------------------------------------------

    def _engine_steps(self, m: S, e: int) -> list[tuple[str, S]]:
        engine = m.engines[e]
        steps: list[tuple[str, S]] = []
        if engine.up and engine.frozen:
            if not engine.blocked:
                steps.append((f"engine {e} thaws", self._set_engine(m, e, frozen=False)))
            elif not m.leases[e]:  # a block longer than the lease (the module doc)
                self.coverage.add("blocked loop thaws")
                thawed = self._set_engine(m, e, frozen=False, blocked=False)
                steps.append((f"engine {e}'s loop runs again", thawed))
        else:
            steps += super()._engine_steps(m, e)
            if engine.up:
                steps += self._fleet_steps(m, e)
        # The lease thread of a blocked loop renews a lease the engine trusts, unless it
        # watches the loop.
        kept = engine.blocked and engine.trust
        kept = kept and not self.protocol.renews_only_while_the_loop_runs
        if m.leases[e] and (engine.frozen or not engine.trust) and not kept:
            steps.append(self._lapse(m, e))
        return steps

    def _lapse(self, m: S, e: int) -> tuple[str, S]:
        """Engine e's lease lapses in the store (it is frozen, down, or could not renew)."""
        engine = m.engines[e]
        label = f"engine {e}'s lease lapses"
        if engine.blocked:
            label += " while its loop is blocked"
        else:
            label += " while it is frozen" if engine.frozen else "" if engine.up else " (down)"
        leases = _set(m.leases, e, False)
        key, g, void = self._in_flight(m, e), m.ghost, engine.void
        if key is not None:
            g = g._replace(hits=_bumped(g.hits, key))
            void = True
            label += f" ({self._key_name(key)} ran, its result not written)"
            self.coverage.add("lapse hits a run")
        m = self._set_engine(m, e, trust=False, void=void)
        return label, m._replace(leases=leases, ghost=g)

    def _in_flight(self, m: S, e: int) -> int | None:
        """The key of engine e's run in flight: its body ran, its outcome is not recorded (nor
        counted already: a lapse during the run makes it void); else None."""
        engine, g = m.engines[e], m.ghost
        runner = engine.runner
        if runner is None or runner[0] != DONE or engine.void:
            return None
        key = self._key(runner[1])
        # Over if its outcome is recorded (a write whose answer was lost, to be sent again)
        index, recorded = (key, g.outcomes) if key < self.n else (key - self.n, g.compensated)
        return None if index in recorded else key

    def _fleet_steps(self, m: S, e: int) -> list[tuple[str, S]]:
        """Renewal, letting go, scans and adoption of engine e (up, not frozen)."""
        p, engine, row, name = self.protocol, m.engines[e], m.row, self.names[e]
        steps: list[tuple[str, S]] = []
        superseded = not m.holders[e] and p.claim_checks_incarnation
        if (not engine.trust or not m.leases[e] or engine.released) and not superseded:
            steps.append(self._renew(m, e))
        if not engine.trust and engine.runner is not None and engine.runner[0] != TAKE:
            steps.append(self._let_go(m, e, "still cannot renew"))
        lacks = e in self.lacks and p.fleet_versions  # it takes nothing of that version
        if engine.runner is None and engine.trust and row.state in ACTIVE and not lacks:
            if self._nobodys(m, e):
                label = f"engine {e}'s scan reads {_where(row)} ({self._who(m)}): nobody's"
                if not self._nobodys(m):
                    label += " by its own clock, which is ahead"
                steps.append((label, self._set_engine(m, e, runner=(TAKE, row))))
            elif row.owner == name and row.released_at is None and not engine.released:
                # `Rounds.check_held`: held under its name, but not run (a lost answer, a restart)
                now = m.now
                write = Write(lambda f, _b: p.next_attempt(f, now), row)
                t = self._write(m, self._lease(write, e))
                assert t is not None
                label = f"engine {e} adopts the flow held under its name: revision"
                label += f" {t.flow.revision}, {_where(t.flow)}"
                self.coverage.add("adopt")
                steps.append((label, self._after_write(self._record(m, t, label), e, t.flow)))
        deadline = row.park_deadline
        due = row.state is PARKED and deadline is not None and deadline <= m.now
        if due and engine.timer != row and not lacks:
            # A scan arms the timer of every park that comes due before its next scan but one,
            # whichever engine parked it; arming earlier changes nothing until the deadline.
            label, nxt = self._timer_fires(m, e, row)
            steps.append((f"engine {e}'s scan arms a due timer; {label}", nxt))
        return steps

    def _let_go(self, m: S, e: int, why: str) -> tuple[str, S]:
        """`Writes.let_go`: the runner stops (a body that ran is discarded: a hit, as a crash's);
        the next renewal releases the flow."""
        label = f"engine {e} {why}: lets the flow go"
        runner = m.engines[e].runner
        assert runner is not None
        key, g = self._in_flight(m, e), m.ghost
        if key is not None:
            g = g._replace(hits=_bumped(g.hits, key))
            label += f" ({self._key_name(key)} ran, its result not written)"
        self.coverage.add("let go")
        # The revision of the engine's copy; re-reading (READY), it lets go at the row's (its
        # copy once the read is in; after a refused write the real engine may still hold the
        # older copy, whose release then matches nothing and the flow is adopted as a stray).
        revision = runner[1].revision if len(runner) > 1 else m.row.revision
        m = self._set_engine(m, e, runner=None, released=revision, void=False)
        return label, m._replace(ghost=g)

    def _renew(self, m: S, e: int) -> tuple[str, S]:
        """`Lease.renew`: renew the lease, releasing the flow if the engine let it go."""
        p, engine, row, name = self.protocol, m.engines[e], m.row, self.names[e]
        label = f"engine {e} renews its lease"
        if not m.leases[e]:
            label += " (it had lapsed)"
        ours = row.owner == name or not p.release_checks_owner
        same = row.revision == engine.released or not p.release_checks_revision
        if engine.released and p.renewal_releases and row.state in ACTIVE and ours and same:
            # `_store.release`: no new revision; made a moment before any later scan's check
            row = attrs.evolve(row, released_at=m.now - 1.0)
            label += ", releasing the flow it let go"
            self.coverage.add("release")
        runner = engine.runner
        copy = runner[1] if runner is not None and len(runner) > 1 else None
        moved = copy is not None and (row.owner != name or row.revision != copy.revision)
        if p.renewal_rereads and not engine.trust and moved:
            runner = (READY,)
            label += ", and reads the flow again"
        m = self._set_engine(m, e, trust=True, released=0, runner=runner)
        return label, m._replace(row=row, leases=_set(m.leases, e, True))

    def _runner_steps(self, m: S, e: int, runner: tuple[Any, ...]) -> Iterator[tuple[str, S]]:
        engine = m.engines[e]
        if runner[0] == BLOCK and self._elsewhere(m, e):
            # An engine with the version came up meanwhile: leave the flow to it.
            yield self._let_go(m, e, "lacks the version another live engine has")
        elif runner[0] == TAKE:
            yield from self._take_over(m, e, runner[1])
        elif runner[0] == RUN and not engine.trust and self.protocol.runner_checks_lease:
            yield self._let_go(m, e, "does not trust its lease before the body")
        else:
            yield from super()._runner_steps(m, e, runner)

    def _take_over(self, m: S, e: int, copy: Flow) -> Iterator[tuple[str, S]]:
        p, name, now = self.protocol, self.names[e], m.now
        write = Write(
            lambda f, _b: p.take_over(f, name, now),
            copy,
            orphan=p.takeover_checks_orphan,
            cas=p.takeover_cas,
            by=e,
        )
        holder = self._holder(m)
        t = self._write(m, write)
        what = f"engine {e} takes over revision {copy.revision}"
        if t is None:
            self.coverage.add("takeover refused")
            label = f"{what}: refused (store at {m.row.revision}, {self._who(m)})"
            yield label, self._set_engine(m, e, runner=None)
            return
        label = f"{what}: revision {t.flow.revision}, {_where(t.flow)}"
        if holder is not None:
            raise _step_violation(label, f"engine {e} took over a flow engine {holder} holds")
        self.coverage.add("takeover")
        yield label, self._after_write(self._record(m, t, label), e, t.flow)
        if m.world.ambiguous < self.config.ambiguous:
            # The scan's transaction committed but its answer was lost (`Rounds.scan` gives up on
            # the error): the flow is held under e's name and nobody runs it, until e adopts it.
            self.coverage.add("takeover answer lost")
            lost = f"{label} (committed, answer lost: the scan gives up)"
            world = m.world._replace(ambiguous=m.world.ambiguous + 1)
            nxt = self._set_engine(self._record(m, t, lost), e, runner=None)
            yield lost, nxt._replace(world=world)

    def _timer_fires(self, m: S, e: int, armed: Flow) -> tuple[str, S]:
        if e in self.lacks and self.protocol.fleet_versions:
            label = f"engine {e} fires no timer of a version it lacks"
            return label, self._set_engine(m, e, timer=None)
        return super()._timer_fires(m, e, armed)

    def _after_write(self, m: S, e: int, flow: Flow, failures: int = 0) -> S:
        """As `flow.py`'s, but an engine runs only an active flow held under its name."""
        m = self._set_engine(m, e, void=False)  # the run in flight, if any, is over
        if flow.state in ACTIVE and flow.owner != self.names[e]:
            self.coverage.add("not ours")
            return self._set_engine(m, e, runner=None)
        if flow.state in ACTIVE and m.engines[e].released:
            self.coverage.add("let go, then ours again")
            if self.protocol.retaken_not_released:
                m = self._set_engine(m, e, released=0)
        return super()._after_write(m, e, flow, failures)

    def _drive(self, m: S, e: int, flow: Flow) -> S:
        """An outside write through engine e (`Writes.track`, then the runner's loop): e runs
        the flow if the write left it active with e, from the row written (a run of e in flight
        is void: its changes are discarded); else e's runner, if any, stops."""
        return self._after_write(m, e, flow)

    def _write_result(
        self, m: S, e: int, copy: Flow, result: str, failures: int
    ) -> Iterator[tuple[str, S]]:
        for label, nxt in super()._write_result(m, e, copy, result, failures):
            runner = nxt.engines[e].runner
            if runner is None or runner[0] != DONE:  # the run is over (refused: read again)
                nxt = self._set_engine(nxt, e, void=False)
            yield label, nxt

    def _crash(self, m: S, e: int) -> tuple[str, S]:
        label, m = super()._crash(m, e)
        m = self._set_engine(m, e, frozen=False, blocked=False)
        return label, self._set_engine(m, e, trust=False, released=0, void=False)

    def _restart(self, m: S, e: int) -> Iterator[tuple[str, S]]:
        """`_recovery.recover` in a fleet: renew the lease under the same name, then re-run the
        flow (`rerun`: attempt + 1, since it names this engine) if it is active under that
        name."""
        row, p, now = m.row, self.protocol, m.now
        name = self.names[e]
        others = [f for f in range(len(m.engines)) if f != e and self.names[f] == name]
        live = [f for f in others if m.holders[f] and m.engines[f].up and m.leases[f]]
        if live and p.claim_checks_incarnation:
            # `flow.StoreLocked`: another incarnation is up with a live lease (it is not
            # proven gone: it did not crash); this opening fails and changes nothing.
            self.coverage.add("claim refused")
            return
        self.coverage.add(f"restart {row.state.name}")
        label = f"engine {e} opens as {name}, renews its lease"
        if others and any(m.holders[f] for f in others):
            label += f" (taking the name from engine {others})"
            self.coverage.add("claim takes the name")
        holders, leases = _set(m.holders, e, True), _set(m.leases, e, True)
        if p.claim_checks_incarnation:
            for f in others:  # superseded: its lease is no longer its own
                holders, leases = _set(holders, f, False), _set(leases, f, False)
        nxt = self._set_engine(m, e, up=True, trust=True)
        nxt = nxt._replace(leases=leases, holders=holders)
        for f in others:
            if not holders[f] and nxt.engines[f].trust:
                nxt = self._set_engine(nxt, f, trust=False)
        if row.state in ACTIVE and row.owner == self.names[e]:
            write = Write(lambda f, _b: p.rerun(f, now), row)
            t = self._write(nxt, self._lease(write, e))
            assert t is not None  # held under its name: nobody else writes it
            label += f", recovers revision {t.flow.revision}, {_where(t.flow)}"
            yield label, self._after_write(self._record(nxt, t, label), e, t.flow)
        else:
            yield label, nxt

    def _disruptions(self, m: S) -> Iterator[tuple[str, S]]:
        """Crashes, and for an engine that runs the flow: a freeze, or renewals that fail."""
        yield from super()._disruptions(m)
        w, cfg = m.world, self.config
        for e, engine in enumerate(m.engines):
            if not engine.up or engine.frozen or engine.runner is None:
                continue
            if engine.runner[0] not in (RUN, DONE):
                continue  # freezes and outages hit an engine in the middle of a step
            if w.freezes < cfg.freezes:
                self.coverage.add("freeze")
                yield (
                    f"engine {e} freezes",
                    self._set_engine(m, e, frozen=True)._replace(
                        world=w._replace(freezes=w.freezes + 1)
                    ),
                )
            if w.blocks < cfg.blocks:
                self.coverage.add("loop blocked")
                yield (
                    f"engine {e}'s loop blocks (its lease thread runs on)",
                    self._set_engine(m, e, frozen=True, blocked=True)._replace(
                        world=w._replace(blocks=w.blocks + 1)
                    ),
                )
            if w.outages < cfg.outages and engine.trust:
                # The heartbeat gives up at the margin and lets every flow go at once.
                label, nxt = self._let_go(self._set_engine(m, e, trust=False), e, "cannot renew")
                yield label, nxt._replace(world=w._replace(outages=w.outages + 1))

    # ---- properties -----------------------------------------------------------------------------

    def _check_run(self, m: S, e: int, copy: Flow, label: str) -> None:
        for holder in self._holders(m):
            if holder != e:
                raise _step_violation(
                    label, f"engine {e} runs a body of a flow engine {holder} holds: two at once"
                )
        for f in range(len(m.engines)):
            key = None if f == e else self._in_flight(m, f)
            if key is not None:
                raise _step_violation(
                    label,
                    f"engine {f}'s run of {self._key_name(key)} is in flight under a lease that"
                    " never lapsed: two steps at once",
                )

    def _check_write(self, m: S, e: int, copy: Flow, label: str) -> None:
        if m.row.owner != self.names[e]:
            frozen = " (its lease lapsed during the run)" if m.engines[e].void else ""
            raise _step_violation(
                label, f"engine {e}{frozen} recorded its run of a flow held by {m.row.owner}"
            )

    def _check_terminal(self, m: S) -> None:
        """As `flow.py`'s; a flow left with an engine whose loop is blocked is named as such."""
        holder = self._holder(m)
        if holder is not None and m.engines[holder].blocked:
            raise AssertionError(
                f"the flow stays {_where(m.row)} with engine {holder}, whose loop is blocked:"
                " its lease thread renews the lease for a loop that runs nothing, and no other"
                " engine may take the flow over"
            )
        super()._check_terminal(m)

    def _check_state(self, m: S) -> None:
        super()._check_state(m)
        row = m.row
        if row.state in ACTIVE:
            # (nobody's: left to the fleet by an engine without its version, a rolling deploy)
            assert row.owner is not None or self.lacks, f"{_where(row)} with no owner"
        else:
            assert row.owner is None and row.released_at is None, f"{_where(row)} has an owner"
        for e, engine in enumerate(m.engines):
            if engine.up and engine.trust:
                assert m.leases[e], f"engine {e} trusts a lease that lapsed (the margin)"


def _set(values: tuple[bool, ...], i: int, value: bool) -> tuple[bool, ...]:
    return (*values[:i], value, *values[i + 1 :])
