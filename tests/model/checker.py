"""Exhaustive model check of the waiting room and the protocol its actors follow.

A breadth-first search over every interleaving of the actors' steps, for small bounds:

- callers: each input is submitted once (`admit`); a caller that claimed its key makes the direct
  call itself (`start`, `end`, then `release`); a waiting caller may be cancelled (`cancel`);
- workers: `take` a batch, `end` the call (answer every caller; success or failure), `release`;
- the clock: `tick` by a small step up to a horizon, or jump to the next deadline;
- the owner: `close` (drain the room once).

Each step is one pure transition of `ferry._lanes`, as the trio shell applies each in one STM
transaction. Visited states are deduplicated on an observable abstraction (lane contents, queue
orders, deadlines, actors, clock), not on the internal stamps and sequence numbers, which only
grow. In every reachable state the checker asserts `check_invariants` and the protocol's
properties (see `Checker._check_state`); in every terminal state, that nothing is left behind.
On a violation it raises `Counterexample` with the shortest trace (BFS order).

The transitions come from a `Protocol` object, so a test can plant a bug by overriding one of
them; the shell's own protocol can be modelled the same way by extending `Checker`. The search
itself (`Search`: BFS, deduplication, shortest traces) is shared by every model of this package.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import attrs

from ferry import _lanes as core
from ferry._lanes import Admission, Batch, Item, Lanes, Limits


class Counterexample(AssertionError):
    """A property failed; `trace` is the shortest list of steps from the start that breaks it."""

    def __init__(self, message: str, trace: list[str]) -> None:
        self.message = message
        self.trace = trace
        steps = "\n".join(f"  {i + 1:2}. {step}" for i, step in enumerate(trace))
        super().__init__(f"{message}\nshortest trace ({len(trace)} steps):\n{steps}")


class _Violation(Exception):
    pass


@attrs.frozen
class Config:
    """Bounds of one model check: one input per entry of `keys`, `workers` workers."""

    name: str
    limits: Limits
    keys: tuple[str, ...] = ("a", "b", "a")
    weights: tuple[float, ...] | None = None
    ranks: tuple[Any, ...] | None = None
    workers: int = 2
    failures: bool = False
    cancels: bool = True
    close: bool = True
    tick: float = 0.5
    horizon: float = 1.0

    def weight(self, i: int) -> float:
        return 1.0 if self.weights is None else self.weights[i]

    def rank(self, i: int) -> Any:
        return None if self.ranks is None else self.ranks[i]


class Protocol:
    """The transitions the actors use: the real ones. Subclass to plant a bug."""

    #: release a direct call's key when the call starts instead of when it ends
    release_direct_at_start = False
    #: admission in two steps (look at `closed`, then insert), not one transaction
    split_admission = False

    def admit(
        self, state: Lanes[Any, Any], key: str, i: int, weight: float, rank: Any, now: float
    ) -> tuple[Lanes[Any, Any], Admission, Item[Any] | None]:
        return core.admit(state, key, i, weight=weight, rank=rank, now=now)

    def take(
        self, state: Lanes[Any, Any], now: float
    ) -> tuple[Lanes[Any, Any], Batch[Any, Any] | None]:
        return core.take(state, now)

    def release(
        self, state: Lanes[Any, Any], key: str, now: float, failed: bool
    ) -> Lanes[Any, Any]:
        return core.release(state, key, now, failed=failed)

    def cancel(
        self, state: Lanes[Any, Any], key: str, item: Item[Any]
    ) -> tuple[Lanes[Any, Any], bool]:
        return core.cancel(state, key, item)

    def drain(self, state: Lanes[Any, Any]) -> tuple[Lanes[Any, Any], list[Item[Any]]]:
        return core.drain(state)


# Caller statuses (first element of the caller's tuple).
NEW, LOOKED, WAITING, DIRECT, BATCH = "new", "looked", "waiting", "direct", "batch"
ANSWERED, DROPPED, DRAINED, REJECTED, REFUSED = (
    "answered",
    "dropped",
    "drained",
    "rejected",
    "refused",
)
FINAL = frozenset({ANSWERED, DROPPED, DRAINED, REJECTED, REFUSED})


class M(NamedTuple):
    """One state of the whole model: the room, the clock and every actor."""

    room: Lanes[Any, Any]
    now: float
    # per input: (NEW,) | (LOOKED,) | (WAITING, item) | (DIRECT, phase, released) | (BATCH, w)
    #   | (ANSWERED,) | ...; phase is "claimed", "calling" or "ended"
    callers: tuple[tuple[Any, ...], ...]
    # per worker: None | (key, input ids, phase, failed); phase is "calling" or "ended"
    workers: tuple[tuple[Any, ...] | None, ...]
    # per key: takes of other keys while this key was ready (bounded: no starvation)
    bypass: tuple[int, ...]


@attrs.frozen
class Report:
    name: str
    states: int
    transitions: int
    seconds: float


def _canon_room(room: Lanes[Any, Any]) -> tuple[Any, ...]:
    lanes = tuple(
        (
            key,
            tuple(it.entry for it in lane.items()),
            lane.where,
            lane.calls,
            lane.deadline if lane.where == core.WAITING else None,
        )
        for key, lane in sorted(room.lanes.items())
    )
    return (room.closed, lanes, tuple(room.ready_keys()), tuple(room.waiting_keys()))


class Search:
    """Breadth-first search of every reachable state of a model, with shortest counterexamples.

    A model subclasses this and gives `name`, `initial`, `canon` (the key states are deduplicated
    on), `successors` (every enabled step, as ``(label, next state)``; it may raise on a step
    property, see `_step_violation`), `_check_state` (every reachable state) and `_check_terminal`
    (every state with no successor). Cost: one `canon` and one `_check_state` per new state, one
    `canon` per step.
    """

    name: str

    def initial(self) -> Any:
        raise NotImplementedError

    def canon(self, m: Any) -> Any:
        raise NotImplementedError

    def successors(self, m: Any) -> Iterator[tuple[str, Any]]:
        raise NotImplementedError

    def _check_state(self, m: Any) -> None:
        raise NotImplementedError

    def _check_terminal(self, m: Any) -> None:
        raise NotImplementedError

    def run(self) -> Report:
        """Explore every reachable state; raise `Counterexample` on the first violation."""
        t0 = time.perf_counter()
        start = self.initial()
        start_key = self.canon(start)
        parent: dict[Any, tuple[Any, str] | None] = {start_key: None}
        todo: deque[tuple[Any, Any]] = deque([(start, start_key)])
        transitions = 0
        self._guard(parent, start_key, None, lambda: self._check_state(start))
        while todo:
            m, mkey = todo.popleft()
            moved = False
            steps = self._guard(parent, mkey, None, lambda m=m: list(self.successors(m)))
            for label, nxt in steps:
                moved = True
                transitions += 1
                nkey = self.canon(nxt)
                if nkey in parent:
                    continue
                parent[nkey] = (mkey, label)
                self._guard(parent, nkey, None, lambda nxt=nxt: self._check_state(nxt))
                todo.append((nxt, nkey))
            if not moved:
                self._guard(parent, mkey, None, lambda m=m: self._check_terminal(m))
        return Report(self.name, len(parent), transitions, time.perf_counter() - t0)

    def find(self) -> Counterexample:
        """The counterexample `run` raises (printed); `AssertionError` if there is none."""
        try:
            report = self.run()
        except Counterexample as found:
            print(f"\n{found}")
            return found
        raise AssertionError(f"no counterexample in {report.states} states ({self.name})")

    def _guard(self, parent: dict[Any, Any], key: Any, _: object, fn: Any) -> Any:
        try:
            return fn()
        except (_Violation, AssertionError) as exc:
            if isinstance(exc, Counterexample):
                raise
            raise Counterexample(str(exc), self._trace(parent, key, exc)) from None

    def _trace(self, parent: dict[Any, Any], key: Any, exc: BaseException) -> list[str]:
        steps: list[str] = []
        while parent[key] is not None:
            key, label = parent[key]
            steps.append(label)
        steps.reverse()
        failing = getattr(exc, "step", None)
        if failing:
            steps.append(f"{failing}  <-- fails here")
        return steps


class Checker(Search):
    """Breadth-first search of every interleaving for one `Config` and one `Protocol`."""

    def __init__(
        self, config: Config, protocol: Protocol | None = None, *, check_room: bool = True
    ) -> None:
        self.config = config
        self.name = config.name
        self.protocol = protocol or Protocol()
        self.check_room = check_room  # False: only the actors' properties (to test those alone)
        self.key_names = tuple(sorted(set(config.keys)))

    # ---- the search ---------------------------------------------------------------------------

    def initial(self) -> M:
        n = len(self.config.keys)
        return M(
            room=core.empty(self.config.limits),
            now=0.0,
            callers=((NEW,),) * n,
            workers=(None,) * self.config.workers,
            bypass=(0,) * len(self.key_names),
        )

    def canon(self, m: M) -> Any:
        callers = tuple(c if c[0] != WAITING else (WAITING,) for c in m.callers)
        return (_canon_room(m.room), m.now, callers, m.workers, m.bypass)

    # ---- the actors' steps ---------------------------------------------------------------------

    def successors(self, m: M) -> Iterator[tuple[str, M]]:
        """Every step enabled in `m`, as (label, next state); checks step properties on the way."""
        cfg, proto = self.config, self.protocol
        for i, caller in enumerate(m.callers):
            status = caller[0]
            key = cfg.keys[i]
            if status == NEW and proto.split_admission:
                if m.room.closed:
                    yield f"look {i} ({key}): closed", self._caller(m, i, (REFUSED,))
                else:
                    yield f"look {i} ({key}): open", self._caller(m, i, (LOOKED,))
            elif status in (NEW, LOOKED):
                yield self._admit(m, i, key, forced_open=status == LOOKED)
            elif status == WAITING and cfg.cancels:
                yield self._cancel(m, i, key, caller[1])
            elif status == DIRECT:
                yield self._direct_step(m, i, key, caller[1], caller[2])
        for w, worker in enumerate(m.workers):
            if worker is None:
                step = self._take(m, w)
                if step is not None:
                    yield step
            elif worker[2] == "calling":
                yield from self._end(m, w, worker)
            else:
                yield self._release(m, w, worker)
        deadline = core.next_deadline(m.room)
        if deadline is not None and deadline > m.now:
            yield f"tick to deadline {deadline}", m._replace(now=deadline)
        if m.now + cfg.tick <= cfg.horizon and (deadline is None or m.now + cfg.tick < deadline):
            yield f"tick to {m.now + cfg.tick}", m._replace(now=m.now + cfg.tick)
        if cfg.close and not m.room.closed:
            yield self._close(m)

    def _caller(self, m: M, i: int, status: tuple[Any, ...]) -> M:
        callers = list(m.callers)
        callers[i] = status
        return m._replace(callers=tuple(callers))

    def _admit(self, m: M, i: int, key: str, forced_open: bool) -> tuple[str, M]:
        cfg = self.config
        room = m.room
        was_closed = room.closed
        if forced_open and room.closed:  # the planted bug: the insert no longer looks at `closed`
            room = core._evolve(room, {"closed": False})
        room, outcome, item = self.protocol.admit(room, key, i, cfg.weight(i), cfg.rank(i), m.now)
        if forced_open and was_closed:
            room = core._evolve(room, {"closed": True})
        label = f"admit {i} ({key}) at {m.now}: {outcome.name}"
        if was_closed and outcome is not Admission.CLOSED:
            raise _step_violation(label, f"input {i} admitted after close")
        status: tuple[Any, ...]
        if outcome is Admission.ADMITTED:
            assert item is not None and item.entry == i
            status = (WAITING, item)
        elif outcome is Admission.CLAIMED:
            status = (DIRECT, "claimed", False)
        elif outcome is Admission.REJECTED:
            status = (REJECTED,)
        else:
            status = (REFUSED,)
        return label, self._caller(m._replace(room=room), i, status)

    def _cancel(self, m: M, i: int, key: str, item: Item[Any]) -> tuple[str, M]:
        room, gone = self.protocol.cancel(m.room, key, item)
        label = f"cancel {i} ({key})"
        if not gone:
            raise _step_violation(label, f"waiting input {i} not found by cancel")
        return label, self._caller(m._replace(room=room), i, (DROPPED,))

    def _direct_step(self, m: M, i: int, key: str, phase: str, released: bool) -> tuple[str, M]:
        if phase == "claimed":
            label = f"direct call {i} ({key}) starts"
            if self.protocol.release_direct_at_start:
                room = self.protocol.release(m.room, key, m.now, False)
                return label, self._caller(m._replace(room=room), i, (DIRECT, "calling", True))
            return label, self._caller(m, i, (DIRECT, "calling", False))
        if phase == "calling":
            label = f"direct call {i} ({key}) ends"
            return label, self._caller(m, i, (ANSWERED,) if released else (DIRECT, "ended", False))
        room = self.protocol.release(m.room, key, m.now, False)
        return f"direct call {i} ({key}) releases", self._caller(
            m._replace(room=room), i, (ANSWERED,)
        )

    def _take(self, m: M, w: int) -> tuple[str, M] | None:
        before = m.room
        due = [k for d, k in before.waiting_keys() if d <= m.now]
        expected = before.ready_keys() + due
        room, batch = self.protocol.take(before, m.now)
        if batch is None:
            if room is before:
                return None
            return f"worker {w} takes nothing at {m.now}", m._replace(room=room)
        ids = tuple(it.entry for it in batch.items)
        label = f"worker {w} takes {batch.key}:{list(ids)} at {m.now}"
        if not ids:
            raise _step_violation(label, "an empty batch was taken")
        if not expected or batch.key != expected[0]:
            raise _step_violation(label, f"not first come first served: ready order {expected}")
        callers = list(m.callers)
        for i in ids:
            if callers[i][0] != WAITING:
                raise _step_violation(label, f"input {i} taken while {callers[i][0]}")
            callers[i] = (BATCH, w)
        bypass = list(m.bypass)
        for k in set(expected):
            bypass[self.key_names.index(k)] += 1
        bypass[self.key_names.index(batch.key)] = 0
        for j, k in enumerate(self.key_names):
            if k not in expected:
                bypass[j] = 0
            elif bypass[j] >= len(self.key_names):
                raise _step_violation(label, f"key {k} bypassed {bypass[j]} times while ready")
        workers = list(m.workers)
        workers[w] = (batch.key, ids, "calling", False)
        return label, m._replace(
            room=room, callers=tuple(callers), workers=tuple(workers), bypass=tuple(bypass)
        )

    def _end(self, m: M, w: int, worker: tuple[Any, ...]) -> Iterator[tuple[str, M]]:
        key, ids, _, _ = worker
        callers = list(m.callers)
        for i in ids:
            if callers[i] != (BATCH, w):
                raise _step_violation(f"worker {w} answers", f"input {i} answered twice")
            callers[i] = (ANSWERED,)
        outcomes = (False, True) if self.config.failures else (False,)
        for failed in outcomes:
            workers = list(m.workers)
            workers[w] = (key, ids, "ended", failed)
            label = f"worker {w} call {key}:{list(ids)} {'fails' if failed else 'succeeds'}"
            yield label, m._replace(callers=tuple(callers), workers=tuple(workers))

    def _release(self, m: M, w: int, worker: tuple[Any, ...]) -> tuple[str, M]:
        key, _, _, failed = worker
        room = self.protocol.release(m.room, key, m.now, failed)
        label = f"worker {w} releases {key} at {m.now}"
        lane = room.lanes.get(key)
        if self.config.limits.one_in_flight and lane is not None and lane.count:
            ready = room.ready_keys()
            if key in ready and ready[-1] != key:
                raise _step_violation(label, f"released key {key} not at the tail of {ready}")
        workers = list(m.workers)
        workers[w] = None
        return label, m._replace(room=room, workers=tuple(workers))

    def _close(self, m: M) -> tuple[str, M]:
        room, drained = self.protocol.drain(m.room)
        callers = list(m.callers)
        for it in drained:
            if callers[it.entry][0] != WAITING:
                raise _step_violation("close", f"input {it.entry} drained while not waiting")
            callers[it.entry] = (DRAINED,)
        return "close", m._replace(room=room, callers=tuple(callers))

    # ---- properties --------------------------------------------------------------------------

    def _check_state(self, m: M) -> None:
        room = m.room
        if self.check_room:
            core.check_invariants(room)
        # Where every input is: exactly one place.
        in_room = {it.entry: key for key, lane in room.lanes.items() for it in lane.items()}
        in_batch = {i: w for w, wk in enumerate(m.workers) if wk is not None for i in wk[1]}
        for i, caller in enumerate(m.callers):
            status = caller[0]
            places = (i in in_room) + (i in in_batch and status == BATCH)
            if status == WAITING:
                assert i in in_room, f"input {i} is waiting but not in the room"
            elif status == BATCH:
                assert in_batch.get(i) == caller[1], f"input {i} not held by its worker"
            else:
                assert i not in in_room, f"input {i} is {status} and still in the room"
            assert places <= 1, f"input {i} in two places"
        # At most one call in flight per key.
        if self.config.limits.one_in_flight:
            flying: dict[str, int] = {}
            for wk in m.workers:
                if wk is not None and wk[2] == "calling":
                    flying[wk[0]] = flying.get(wk[0], 0) + 1
            for i, caller in enumerate(m.callers):
                if caller[0] == DIRECT and caller[1] == "calling":
                    key = self.config.keys[i]
                    flying[key] = flying.get(key, 0) + 1
            for key, n in flying.items():
                assert n <= 1, f"{n} calls in flight for key {key}"

    def _check_terminal(self, m: M) -> None:
        for i, caller in enumerate(m.callers):
            assert caller[0] in FINAL, f"input {i} never ended: {caller[0]}"
        assert all(w is None for w in m.workers), "a worker still holds a batch"
        room = m.room
        assert not room.lanes, f"lanes left behind: {dict(room.lanes)}"
        assert room.busy == 0 and room.queued == 0


def _step_violation(step: str, message: str) -> _Violation:
    exc = _Violation(message)
    exc.step = step  # type: ignore[attr-defined]
    return exc
