"""Exhaustive model check of admission: flows of one limited plan on a fleet of engines.

The pure rule (`ferry.flow._model._admission`: `admit`, `apply`, `next_wake`) composed with the
store's transactions as docs/adr/0141 writes them, explored over every interleaving with the
search of `checker.py` (BFS, deduplicated states, shortest counterexample traces). The
transitions go through an `AdmissionProtocol`, so that a test can plant a bug by overriding one.

The store and its transactions
------------------------------
The store holds each flow's state and holder (``new`` before its start), the queue (`Waiting`
records), the plan's budget (`Usage`: the counter rows and the admission times) and the clock.
Every step below is one transaction, applied whole or not at all: on PostgreSQL each holds the
plan's budget row (``FOR UPDATE``) from its first look at the budget to its commit, so the
transactions of one plan are serial and a crash or a lost connection in the middle of one is its
rollback (the state before it). A write computes its slot change from the states before and after
(`_admission.apply`); a write that gives a slot back or queues a flow runs `admit` in the same
transaction, and the flows it admits are held by its engine.

- start (flows in index order, through any engine that is up): queue the flow (its turn from
  `turn_for`, its ``not_before``), then admit;
- a holder's runner (its engine up and named by the row: a lapsed engine's write is refused by
  the row's revision): a running flow completes, parks (once) or blocks (``blocks`` in all); a
  compensating one ends ``FAILED``;
- any engine: wakes a parked flow (it runs on, held by that engine); cancels (``cancels`` in
  all): a queued flow ends ``FAILED`` (it never held a slot), an active one compensates; resumes
  a blocked one (``resumes`` in all): it is queued again and admitted if it may;
- takeover: an engine takes an active flow whose holder is down, or (``lapses`` in all) whose
  holder is up but lost its lease;
- a wake for a queued flow (``queued_wakes`` in all) is a transaction that locks the flow's row
  and admits nothing: while it is open an admission skips the row (``SKIP LOCKED``); its commit
  sends the plan's notification, on which an engine that is up admits;
- crash (``crashes`` in all) and restart: the flows stay as the store has them, the crashed
  engine's open transactions roll back (sending nothing); the fleet's scan after its lapse
  admits, and so does the restart (a flow whose time passed while no engine ran starts at open);
- time: the timer of an engine that is up fires at the plan's `next_wake` (the durable times:
  ``not_before``, the rate window's oldest admission) and admits; the clock jumps to that time.

Properties
----------
In every state: the limits hold, counted from the flows' own states (`ACTIVE`, SPEC 5.8's
definition written out, not the rule's `holds_slot`): never more active flows than
``concurrency``, nor of one key than ``per_key``; the budget counts exactly the active flows, in
all and per key (no slot leaked, none doubled); the queue holds exactly the queued flows; no
queued flow whose row is not locked may be admitted while nothing will admit it (a slot free,
its time come) unless no engine is up (its restart admits), a notification or a lapse is yet to
be followed by an admission, or an admission is under way (the planted two-part admission). On
every admission: the rate (at most ``count`` admissions in any ``per`` seconds, from a ghost
list of admission times kept apart from the budget's). In every terminal state: every flow ended
or is blocked with no resume left; nothing is queued.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import attrs

from ferry.flow._model import _admission as adm
from ferry.flow._model._admission import QUEUED, Usage, Waiting
from ferry.flow._model._limits import Limits, Rate
from ferry.flow._model._types import State
from tests.model.checker import Search, _step_violation

RUNNING, PARKED, COMPENSATING = State.RUNNING, State.PARKED, State.COMPENSATING
COMPLETED, FAILED, BLOCKED = State.COMPLETED, State.FAILED, State.BLOCKED
NEW = "new"
ENDED = (COMPLETED, FAILED)
#: Active as SPEC 5.8 says it, written out here (not `_admission.holds_slot`, which it checks).
ACTIVE = (RUNNING, PARKED, COMPENSATING)
#: The flows an engine may take over from its holder: active ones being run.
RUN_STATES = (RUNNING, COMPENSATING)


def _key(data: Any) -> str:
    return str(data["key"])


@attrs.frozen
class AdmissionConfig:
    """Bounds of one admission model check: one flow per entry of `keys`."""

    name: str
    limits: Limits
    keys: tuple[str, ...] = ("a", "a", "b")
    priorities: tuple[int, ...] | None = None
    not_before: tuple[float | None, ...] | None = None
    engines: int = 2
    crashes: int = 1
    lapses: int = 1
    cancels: int = 1
    blocks: int = 1
    resumes: int = 1
    parks: bool = True
    queued_wakes: int = 0  # transactions that lock a queued flow's row and admit nothing

    def priority(self, i: int) -> int:
        return 0 if self.priorities is None else self.priorities[i]

    def time(self, i: int) -> float | None:
        return None if self.not_before is None else self.not_before[i]


class AdmissionProtocol:
    """The transactions' rules: the real ones. Subclass to plant a bug."""

    #: admission in two transactions (look at the budget and the queue, skipping rows another
    #: engine's admission holds, then claim), the budget written from the look's copy
    admission_from_a_copy = False
    #: a transaction that locked a queued flow's row (which an admission may have skipped)
    #: sends the plan's notification at its commit
    notifies_after_a_lock = True
    #: the fleet's scan after an engine's lapse admits (a transaction of it rolled back, and a
    #: row it had locked may have been skipped)
    scans_after_a_lapse = True

    def apply(
        self, limits: Limits, usage: Usage, key: str | None, before: Any, after: Any, now: float
    ) -> Usage:
        return adm.apply(limits, usage, key, before, after, now)

    def admits_after(self, before: Any, after: Any) -> bool:
        """Does a write from `before` to `after` run `admit` in its transaction?"""
        return adm.slot_change(before, after) < 0 or after == QUEUED

    def admit(
        self, limits: Limits, usage: Usage, queue: tuple[Waiting, ...], now: float
    ) -> tuple[tuple[Waiting, ...], Usage]:
        return adm.admit(limits, usage, queue, now)

    def next_wake(
        self, limits: Limits, usage: Usage, queue: tuple[Waiting, ...], now: float
    ) -> float | None:
        return adm.next_wake(limits, usage, queue, now)


class M(NamedTuple):
    """One state: the store, the engines, what the world has left to do, a ghost."""

    flows: tuple[tuple[Any, int | None], ...]  # per flow: (state, holder engine or None)
    queue: tuple[Waiting, ...]  # sorted by flow id
    usage: Usage
    now: float
    seq: int  # the next insert's number in the queue
    up: tuple[bool, ...]
    # per engine: None, ("look",) an admission to run, ("claim", copy, chosen): its second half
    pending: tuple[tuple[Any, ...] | None, ...]
    left: tuple[int, ...]  # crashes, lapses, cancels, blocks, resumes, queued wakes
    parked: tuple[bool, ...]  # per flow: parked once already
    takes: tuple[float, ...]  # ghost: the admission times within the rate window
    locked: tuple[int | None, ...]  # per flow: the engine whose open transaction locks its row
    woken: bool  # a notification or a lapse not yet followed by an admission


class AdmissionChecker(Search):
    """Every interleaving of the store's transactions for one `AdmissionConfig`."""

    def __init__(self, config: AdmissionConfig, protocol: AdmissionProtocol | None = None) -> None:
        self.config = config
        self.name = config.name
        self.protocol = protocol or AdmissionProtocol()
        self.coverage: set[str] = set()

    def initial(self) -> M:
        cfg = self.config
        n, e = len(cfg.keys), cfg.engines
        return M(
            flows=((NEW, None),) * n,
            queue=(),
            usage=adm.EMPTY,
            now=0.0,
            seq=0,
            up=(True,) * e,
            pending=(None,) * e,
            left=(cfg.crashes, cfg.lapses, cfg.cancels, cfg.blocks, cfg.resumes, cfg.queued_wakes),
            parked=(False,) * n,
            takes=(),
            locked=(None,) * n,
            woken=False,
        )

    def canon(self, m: M) -> Any:
        return m

    # ---- the transactions ------------------------------------------------------------------

    def _set(self, m: M, i: int, state: Any, holder: int | None) -> M:
        flows = list(m.flows)
        flows[i] = (state, holder)
        return m._replace(flows=tuple(flows))

    def _write(self, m: M, e: int, i: int, after: Any, holder: int | None) -> M:
        """One flow's write from engine `e`: its slot change, the queue, and (if it frees or
        queues) the admission, all in one transaction."""
        cfg, proto = self.config, self.protocol
        before = m.flows[i][0]
        key = cfg.keys[i]
        usage = proto.apply(cfg.limits, m.usage, key, before, after, m.now)
        queue = tuple(w for w in m.queue if w.flow_id != str(i))
        seq = m.seq
        if after == QUEUED:
            w = Waiting(
                str(i),
                seq,
                key,
                cfg.priority(i),
                adm.turn_for(usage, queue, key),
                cfg.time(i) if before == NEW else None,
            )
            queue = tuple(sorted((*queue, w), key=lambda w: w.flow_id))
            seq += 1
        m = self._set(m, i, after, holder)._replace(usage=usage, queue=queue, seq=seq)
        if proto.admits_after(before, after):
            m = self._admission(m, e)
        return m

    def _admission(self, m: M, e: int) -> M:
        if self.protocol.admission_from_a_copy:
            pending = list(m.pending)
            pending[e] = ("look",)
            return m._replace(pending=tuple(pending))
        taken, usage = self.protocol.admit(self.config.limits, m.usage, _visible(m), m.now)
        return self._admitted(m._replace(usage=usage, woken=False), e, taken)

    def _admitted(self, m: M, e: int, taken: tuple[Waiting, ...]) -> M:
        gone = {w.flow_id for w in taken}
        m = m._replace(queue=tuple(w for w in m.queue if w.flow_id not in gone))
        takes = m.takes
        rate = self.config.limits.rate
        for w in taken:
            i = int(w.flow_id)
            m = self._set(m, i, RUNNING, e)
            if rate is not None:
                takes = tuple(t for t in (*takes, m.now) if t > m.now - rate.per)
                if len(takes) > rate.count:
                    raise _step_violation(
                        f"admit {w.flow_id}",
                        f"{len(takes)} admissions within {rate.per}s, more than {rate.count}",
                    )
        if taken:
            self.coverage.add("admitted")
        return m._replace(takes=takes)

    def successors(self, m: M) -> Iterator[tuple[str, M]]:
        """Every transaction enabled in `m`; what each is (its label's verb) goes to `coverage`."""
        for label, nxt in self._steps(m):
            verb = label.split(" ")[1]
            self.coverage.add(f"{verb} {label.split(' ')[2]}" if verb == "cancels" else verb)
            yield label, nxt

    def _steps(self, m: M) -> Iterator[tuple[str, M]]:
        cfg = self.config
        up = [e for e in range(cfg.engines) if m.up[e]]
        crashes, lapses, cancels, blocks, resumes, wakes = m.left
        started = next((i for i, f in enumerate(m.flows) if f[0] == NEW), None)
        held = _held(m) | {str(i) for i, by in enumerate(m.locked) if by is not None}
        for e in up:
            yield from self._pending(m, e)
            if started is not None:
                yield f"E{e} starts {started}", self._write(m, e, started, QUEUED, None)
        for i, (state, holder) in enumerate(m.flows):
            yield from self._locks(m, i, up, bool(wakes) and str(i) not in held)
            if holder is not None and m.up[holder] and state == RUNNING:
                yield f"E{holder} completes {i}", self._write(m, holder, i, COMPLETED, None)
                if cfg.parks and not m.parked[i]:
                    parked = _put(m.parked, i, True)
                    nxt = self._write(m, holder, i, PARKED, holder)._replace(parked=parked)
                    yield f"E{holder} parks {i}", nxt
                if blocks:
                    nxt = self._write(m, holder, i, BLOCKED, None)
                    yield f"E{holder} blocks {i}", self._left(nxt, 3)
            if holder is not None and m.up[holder] and state == COMPENSATING:
                yield f"E{holder} compensated {i}", self._write(m, holder, i, FAILED, None)
            for e in up:
                if state == PARKED:
                    yield f"E{e} wakes {i}", self._write(m, e, i, RUNNING, e)
                if cancels and state == QUEUED and str(i) not in held:  # else: waits for the lock
                    yield (
                        f"E{e} cancels queued {i}",
                        self._left(self._write(m, e, i, FAILED, None), 2),
                    )
                if cancels and state in (RUNNING, PARKED):
                    to = holder if state == RUNNING else e
                    nxt = self._write(m, e, i, COMPENSATING, to)
                    yield f"E{e} cancels {state.name} {i}", self._left(nxt, 2)
                if resumes and state == BLOCKED and str(i) not in held:
                    yield f"E{e} resumes {i}", self._left(self._write(m, e, i, QUEUED, None), 4)
                if state in RUN_STATES and holder is not None and holder != e:
                    if not m.up[holder]:
                        yield f"E{e} takes {i} over", self._set(m, i, state, e)
                    elif lapses:
                        self.coverage.add("lease lapsed")
                        nxt = self._left(self._set(m, i, state, e), 1)
                        yield f"E{e} takes {i} over (E{holder}'s lease lapsed)", nxt
        if m.woken and up:
            yield f"E{up[0]} admits on the plan's wake", self._admission(m, up[0])
        yield from self._engines_and_time(m, up, crashes)

    def _locks(self, m: M, i: int, up: list[int], may_lock: bool) -> Iterator[tuple[str, M]]:
        """A wake for a queued flow: its transaction locks the row, then commits (notifying)."""
        by = m.locked[i]
        if by is not None:
            nxt = m._replace(locked=_put(m.locked, i, None))
            if self.protocol.notifies_after_a_lock:
                nxt = nxt._replace(woken=True)
            yield f"E{by} commits its wake of queued {i}", nxt
        elif may_lock and m.flows[i][0] == QUEUED:
            for e in up:
                nxt = self._left(m._replace(locked=_put(m.locked, i, e)), 5)
                yield f"E{e} locks queued {i} (a wake for it)", nxt

    def _left(self, m: M, which: int) -> M:
        left = list(m.left)
        left[which] -= 1
        return m._replace(left=tuple(left))

    def _engines_and_time(self, m: M, up: list[int], crashes: int) -> Iterator[tuple[str, M]]:
        cfg = self.config
        for e in range(cfg.engines):
            if m.up[e] and crashes:
                pending = _put(m.pending, e, None)
                locked = tuple(None if by == e else by for by in m.locked)  # rolled back
                nxt = m._replace(up=_put(m.up, e, False), pending=pending, locked=locked)
                if self.protocol.scans_after_a_lapse:
                    nxt = nxt._replace(woken=True)
                yield f"E{e} crashes", self._left(nxt, 0)
            if not m.up[e]:
                nxt = m._replace(up=_put(m.up, e, True))
                yield f"E{e} restarts and admits", self._admission(nxt, e)
        wake = self.protocol.next_wake(cfg.limits, m.usage, m.queue, m.now)
        if wake is not None and up:
            nxt = m._replace(now=wake)
            yield f"E{up[0]} timer fires at {wake}", self._admission(nxt, up[0])

    def _pending(self, m: M, e: int) -> Iterator[tuple[str, M]]:
        job = m.pending[e]
        if job is None:
            return
        cfg = self.config
        clear = _put(m.pending, e, None)
        if job[0] == "look":
            held = _held(m)
            visible = tuple(w for w in _visible(m) if w.flow_id not in held)
            taken, _ = self.protocol.admit(cfg.limits, m.usage, visible, m.now)
            pending = _put(clear, e, ("claim", m.usage, taken))
            yield f"E{e} looks: admits {[w.flow_id for w in taken]}", m._replace(pending=pending)
            return
        _, copy, taken = job
        still = tuple(w for w in taken if m.flows[int(w.flow_id)][0] == QUEUED)
        for w in still:  # the budget as the look read it, and the flows it still finds queued
            copy = adm.take(cfg.limits, copy, w.key, m.now, w.turn)
        nxt = self._admitted(m._replace(usage=copy, pending=clear), e, still)
        yield f"E{e} claims {[w.flow_id for w in still]}", nxt

    # ---- properties --------------------------------------------------------------------------

    def _check_state(self, m: M) -> None:
        cfg = self.config
        limits = cfg.limits
        active: dict[str, int] = {}
        for i, (state, _) in enumerate(m.flows):
            if state in ACTIVE:
                active[cfg.keys[i]] = active.get(cfg.keys[i], 0) + 1
        total = sum(active.values())
        if limits.concurrency is not None:
            assert total <= limits.concurrency, (
                f"{total} active flows, more than concurrency={limits.concurrency}"
            )
        if limits.per_key is not None:
            for key, n in active.items():
                assert n <= limits.per_key, (
                    f"{n} active flows of key {key!r}, more than per_key={limits.per_key}"
                )
        counted = (m.usage.active, dict(m.usage.keys))
        assert counted == (total, active), (
            f"the budget counts {m.usage.active} active {dict(m.usage.keys)}, the flows are"
            f" {total} {active}: a slot leaked or doubled"
        )
        for w in m.queue:
            self.coverage.add(f"waits for {adm.waits_for(limits, m.usage, w, m.now)}")
        queued = {str(i) for i, f in enumerate(m.flows) if f[0] == QUEUED}
        assert {w.flow_id for w in m.queue} == queued and len(m.queue) == len(queued), (
            f"the queue holds {[w.flow_id for w in m.queue]}, the queued flows are {queued}"
        )
        if any(m.pending) or not any(m.up) or m.woken:
            return
        # Every transaction that frees a slot admits in it, and time moves only with the
        # timer that admits: a flow that may go now and is still queued is stuck.
        free, _ = adm.admit(limits, m.usage, _visible(m), m.now)
        assert not free, (
            f"queued flow {free[0].flow_id} may be admitted at {m.now} (a slot is free) and"
            " nothing will admit it"
        )

    def _check_terminal(self, m: M) -> None:
        resumes = m.left[4]
        for i, (state, _) in enumerate(m.flows):
            assert state in ENDED or (state == BLOCKED and not resumes), (
                f"flow {i} left {state if isinstance(state, str) else state.name}"
            )
        assert not m.queue, f"left queued: {[w.flow_id for w in m.queue]}"


def _put(values: tuple[Any, ...], i: int, value: Any) -> tuple[Any, ...]:
    """`values` with its `i`-th item replaced by `value`."""
    return (*values[:i], value, *values[i + 1 :])


def _visible(m: M) -> tuple[Waiting, ...]:
    """The queue as an admission sees it: the rows another transaction locks are skipped."""
    return tuple(w for w in m.queue if m.locked[int(w.flow_id)] is None)


def _held(m: M) -> set[str]:
    """The queued flows whose rows an admission under way has locked (its look chose them)."""
    return {w.flow_id for p in m.pending if p and p[0] == "claim" for w in p[2]}


#: The default bounds (in `make test`): a per-key limit of 1 and a global limit on two engines.
ADMISSION_DEFAULT = [
    AdmissionConfig(
        "2 engines, concurrency 2, per_key 1, keys a a b, crash, lapse, cancel, block",
        Limits(concurrency=2, key=_key, per_key=1),
    ),
    AdmissionConfig(
        "2 engines, concurrency 1, priorities, a delayed start",
        Limits(concurrency=1),
        keys=("a", "b", "c"),
        priorities=(0, -1, 0),
        not_before=(None, None, 5.0),
        lapses=0,
        parks=False,
    ),
    AdmissionConfig(
        "2 engines, per_key 1, keys a a b, a queued flow's row locked by a wake, crash",
        Limits(key=_key, per_key=1),
        lapses=0,
        cancels=0,
        blocks=0,
        resumes=0,
        queued_wakes=1,
    ),
    AdmissionConfig(
        "2 engines, rate 1 per 10 s, per_key 1, a delayed start",
        Limits(key=_key, per_key=1, rate=Rate(1, per=10.0)),
        keys=("a", "b", "a"),
        not_before=(None, 5.0, None),
        lapses=0,
        parks=False,
    ),
]

#: Larger bounds (`-m long`, about 50 s): four flows of two keys, two crashes, a priority.
ADMISSION_SLOW = [
    AdmissionConfig(
        "2 engines, concurrency 2, per_key 1, keys a a b b, a priority, two crashes",
        Limits(concurrency=2, key=_key, per_key=1),
        keys=("a", "a", "b", "b"),
        priorities=(0, 0, -1, 0),
        crashes=2,
    ),
]
