"""Exhaustive model check of the trio shell's protocol (ferry/_shell.py) around its room.

`checker.py` explores the core's transitions with abstract actors. This module replaces those
actors by the shell's own, step for step: each step below is one transaction of `Room`
(ferry/_room.py), or one synchronous stretch of `Shell`'s trio code between two checkpoints, so any
interleaving trio allows is an interleaving explored here (and a few more: the model never relies
on "no checkpoint here" where the code does not rely on it either).

Actors and their steps (code they mirror in `Shell` and `Room`)
---------------------------------------------------------------
- caller (`Shell.submit`): `admit` is `Room.admit` plus, synchronously, parking with `entry.task`
  set (ADMITTED), the direct call's scope registration (CLAIMED: the scope is cancelled at once when
  the ferry is closing), or the immediate answer (REJECTED, CLOSED). A parked caller may `abort`
  (its abort_fn: clear `task`, then `Room.cancel`, which drops the input only if it still waits).
  A direct call ends by returning, raising, the ferry's scope or the caller's own cancellation;
  each end is one step: the `finally` releases the key (`Room.release`), then the caller has its
  outcome.
- worker (`Shell._worker`): after its checkpoint, `take` is `Room.take` (a batch, or nothing: the
  failed attempt leaves no trace) and, when nothing was ready, the peek of the doorbell and of the
  next deadline (no checkpoint in between), i.e. it goes to sleep remembering them. It `wake`s
  when the bell has rung since (the bell's value is abstracted to "rung since it slept") or its
  deadline has passed (`Room.sleep` under `move_on_at`). A call in flight ends by returning or
  raising (`Room.release`, then every
  entry whose `task` is still set is answered) or, once the ferry closes, by cancellation
  (`_close_out`: every entry still parked gets Closed; then the release). A worker that is not
  holding a batch exits at its next checkpoint once the ferry closes.
- the doorbell: `Room.admit` and `Room.release` ring when a lane became ready while a call may
  start, when a call's end brought `busy` back under `max_in_flight` while lanes are ready or
  waiting, or when the earliest deadline moved earlier (`ferry._room.rings`); `Room.take` rings
  when lanes are still ready after the take and another call may start. Every sleeping worker
  sees a ring. A worker that finds nothing while `max_in_flight` calls are in flight sleeps with
  no deadline (`Room.sleep_deadline`).
- the clock: small ticks up to a horizon, or a jump to the next event (the room's earliest
  deadline or a sleeping worker's).
- close (`Shell.lifetime`, ADR 0005): `close begins` (`_closing`, workers cancelled); once every
  worker has exited, `close drains` (`_close_room`: cancel the direct calls' scopes, `drain`,
  answer the drained callers Closed); `close done` once `busy == 0` (`Room.idle`).

Properties
----------
In every state: the core's `check_invariants` (among them: no more than `max_in_flight` calls in
flight); every parked caller's input is in exactly one place (the room or one worker's batch) and
no other caller's input is in the room; at most one call in flight per key (batches and direct
calls); while the ferry is open, no lost wake-up: if a lane is ready (or waiting, due at its
deadline), a call may start, and every worker sleeps, one of them has been rung or wakes by then;
and, stronger, no worker oversleeps: every sleeping worker has been rung or wakes by the time the
earliest work is due (so due work never waits for a busy worker while one idles).
On each step: nobody is answered twice (whoever answers clears `task` first); a batch holds only
inputs of parked callers (nothing is sent for a cancelled caller); no admission after the drain;
takes are first come first served. In terminal states: every caller has exactly
one outcome, no worker holds a batch, no lane is left, `busy == 0`, nothing queued, and close (if
it began) finished.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import attrs

from ferry import _lanes as core
from ferry._lanes import Admission, Lanes
from tests.model.checker import Checker, Config, Protocol, _canon_room, _step_violation

# Caller statuses: (NEW,) | (PARKED, item) | (DIRECT, scope cancelled) | (DONE, outcome)
NEW, PARKED, DIRECT, DONE = "new", "parked", "direct", "done"
# Worker statuses: (IDLE,) | (PEEK,) | (SLEEP, deadline, rung) | (HOLD, key, ids) | (EXITED,)
IDLE, PEEK, SLEEP, HOLD, EXITED = "idle", "peek", "sleep", "hold", "exited"
# Close phases
OPEN, CLOSING, DRAINED, CLOSED = "open", "closing", "drained", "closed"


@attrs.frozen
class ShellConfig(Config):
    """`Config` plus: `hang`, calls never end by themselves (only cancellation ends them)."""

    hang: bool = False


class ShellProtocol(Protocol):
    """The shell's decisions, as `Shell` and `Room` make them. Subclass to plant a bug."""

    #: the abort_fn cancels the waiting input (`Room.cancel`) after clearing `task`
    abort_drops_input = True
    #: a worker answers only entries whose `task` is still set (and clears it first)
    answer_checks_task = True
    #: a worker cancelled at close answers the callers of its batch (`_close_out`)
    cancelled_worker_answers = True
    #: the bell and the deadline are read with no checkpoint after the failed take
    peek_without_checkpoint = True
    #: `_close_room` cancels the direct calls' scopes before waiting for `busy == 0`
    close_cancels_direct_calls = True

    def ring(self, old: Lanes[Any, Any], new: Lanes[Any, Any]) -> bool:
        """The doorbell rule: a lane became ready while a call may start; a call ended that made
        room under the bound while lanes are ready or waiting; the earliest deadline moved
        earlier."""
        bound = new.limits.max_in_flight
        if new.busy < bound and new.n_ready > old.n_ready:
            return True
        if old.busy >= bound > new.busy and (new.n_ready or new.waiting_size):
            return True
        d_new, d_old = core.next_deadline(new), core.next_deadline(old)
        return d_new is not None and (d_old is None or d_new < d_old)

    def admit_rings(self, old: Lanes[Any, Any], new: Lanes[Any, Any]) -> bool:
        """`Room.admit`."""
        return self.ring(old, new)

    def release_rings(self, old: Lanes[Any, Any], new: Lanes[Any, Any]) -> bool:
        """`Room.release`."""
        return self.ring(old, new)

    def take_rings(self, new: Lanes[Any, Any]) -> bool:
        """`Room.take`: more work than this worker, and room for another call."""
        return bool(new.n_ready) and new.busy < new.limits.max_in_flight

    def sleep_deadline(self, room: Lanes[Any, Any]) -> float | None:
        """`Room.sleep_deadline`: no deadline while the bound holds every call back."""
        if room.busy >= room.limits.max_in_flight:
            return None
        return core.next_deadline(room)


class S(NamedTuple):
    """One state of the shell model."""

    room: Lanes[Any, Any]
    now: float
    callers: tuple[tuple[Any, ...], ...]
    workers: tuple[tuple[Any, ...], ...]
    phase: str


class ShellChecker(Checker):
    """Breadth-first search over the shell's actors (see the module comment)."""

    protocol: ShellProtocol
    config: ShellConfig

    def __init__(
        self,
        config: ShellConfig,
        protocol: ShellProtocol | None = None,
        *,
        check_room: bool = True,
        wakeups: str = "oversleep",
    ) -> None:
        super().__init__(config, protocol or ShellProtocol(), check_room=check_room)
        # "oversleep": both wake-up properties; "stuck": only the stuck state; "off": neither
        # (to show that the terminal checks alone see a lost wake-up too).
        assert wakeups in ("oversleep", "stuck", "off")
        self.wakeups = wakeups

    def initial(self) -> S:  # type: ignore[override]
        n = len(self.config.keys)
        return S(
            room=core.empty(self.config.limits),
            now=0.0,
            callers=((NEW,),) * n,
            workers=((IDLE,),) * self.config.workers,
            phase=OPEN,
        )

    def canon(self, m: S) -> Any:  # type: ignore[override]
        # A parked caller's item is found in the room; an outcome's kind changes nothing later.
        callers = tuple(c[:1] if c[0] in (PARKED, DONE) else c for c in m.callers)
        return (_canon_room(m.room), m.now, callers, m.workers, m.phase)

    # ---- steps ----------------------------------------------------------------------------------

    def successors(self, m: S) -> Iterator[tuple[str, S]]:  # type: ignore[override]
        cfg = self.config
        for i, caller in enumerate(m.callers):
            status = caller[0]
            if status == NEW:
                yield self._admit_step(m, i)
            elif status == PARKED and cfg.cancels:
                yield self._abort(m, i)
            elif status == DIRECT:
                yield from self._direct_ends(m, i, caller[1])
        for w, worker in enumerate(m.workers):
            yield from self._worker_steps(m, w, worker)
        if m.phase == OPEN:
            yield from self._ticks(m)
            if cfg.close:
                workers = tuple((EXITED,) if wk[0] == EXITED else wk for wk in m.workers)
                yield "close begins", m._replace(phase=CLOSING, workers=workers)
        elif m.phase == CLOSING and all(wk[0] == EXITED for wk in m.workers):
            yield self._drain(m)
        elif m.phase == DRAINED and m.room.busy == 0:
            yield self._close_done(m)

    # -- the room and the bell

    def _ring(self, workers: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...]:
        return tuple((SLEEP, None, True) if wk[0] == SLEEP else wk for wk in workers)

    def _answer(
        self, m: S, callers: list[tuple[Any, ...]], i: int, outcome: str, step: str
    ) -> None:
        """Reschedule caller i with `outcome` ("clear task, then act")."""
        if callers[i][0] != PARKED:
            raise _step_violation(step, f"caller {i} answered twice ({callers[i]}, then {outcome})")
        callers[i] = (DONE, outcome)

    def _release_key(self, m: S, key: str, failed: bool) -> tuple[Lanes[Any, Any], bool]:
        old = m.room
        new = self.protocol.release(old, key, m.now, failed)
        return new, self.protocol.release_rings(old, new)

    # -- callers

    def _admit_step(self, m: S, i: int) -> tuple[str, S]:
        cfg = self.config
        key = cfg.keys[i]
        old = m.room
        room, outcome, item = self.protocol.admit(old, key, i, cfg.weight(i), cfg.rank(i), m.now)
        label = f"caller {i} ({key}) admits at {m.now}: {outcome.name}"
        if old.closed and outcome is not Admission.CLOSED:
            raise _step_violation(label, f"input {i} admitted after the drain")
        status: tuple[Any, ...]
        if outcome is Admission.ADMITTED:
            status = (PARKED, item)
        elif outcome is Admission.CLAIMED:
            status = (DIRECT, m.phase != OPEN)  # `_direct`: cancelled at once when closing
        else:
            status = (DONE, outcome.name.lower())
        workers = self._ring(m.workers) if self.protocol.admit_rings(old, room) else m.workers
        callers = list(m.callers)
        callers[i] = status
        return label, m._replace(room=room, callers=tuple(callers), workers=workers)

    def _abort(self, m: S, i: int) -> tuple[str, S]:
        key = self.config.keys[i]
        item = m.callers[i][1]
        room = m.room
        gone = False
        if self.protocol.abort_drops_input:
            room, gone = self.protocol.cancel(room, key, item)
        label = f"caller {i} ({key}) cancelled: {'dropped' if gone else 'stops waiting'}"
        callers = list(m.callers)
        callers[i] = (DONE, "cancelled")
        return label, m._replace(room=room, callers=tuple(callers))

    def _direct_ends(self, m: S, i: int, scope_cancelled: bool) -> Iterator[tuple[str, S]]:
        cfg = self.config
        key = cfg.keys[i]
        ends: list[tuple[str, str, bool]] = []
        if not cfg.hang:
            ends.append(("returns", "result", False))
            if cfg.failures:
                ends.append(("raises", "failed", True))
        if scope_cancelled:
            ends.append(("is cancelled by the ferry", "closed", False))
        if cfg.cancels:
            ends.append(("is cancelled by its caller", "cancelled", False))
        for how, outcome, failed in ends:
            room, rings = self._release_key(m, key, failed)
            callers = list(m.callers)
            callers[i] = (DONE, outcome)
            workers = self._ring(m.workers) if rings else m.workers
            label = f"direct call {i} ({key}) {how}; key released"
            yield label, m._replace(room=room, callers=tuple(callers), workers=workers)

    # -- workers

    def _set_worker(self, m: S, w: int, status: tuple[Any, ...], **kw: Any) -> S:
        workers = list(kw.pop("workers", m.workers))
        workers[w] = status
        return m._replace(workers=tuple(workers), **kw)

    def _worker_steps(self, m: S, w: int, worker: tuple[Any, ...]) -> Iterator[tuple[str, S]]:
        status = worker[0]
        closing = m.phase != OPEN
        if status in (IDLE, PEEK, SLEEP) and closing:
            yield f"worker {w} is cancelled and exits", self._set_worker(m, w, (EXITED,))
        elif status == IDLE:
            yield self._worker_take(m, w)
        elif status == PEEK:
            deadline = self.protocol.sleep_deadline(m.room)
            label = f"worker {w} reads the bell, sleeps until {deadline}"
            yield label, self._set_worker(m, w, (SLEEP, deadline, False))
        elif status == SLEEP:
            _, deadline, rung = worker
            if rung or (deadline is not None and m.now >= deadline):
                why = "the bell" if rung else f"its deadline {deadline}"
                yield f"worker {w} wakes ({why})", self._set_worker(m, w, (IDLE,))
        elif status == HOLD:
            yield from self._call_ends(m, w, worker[1], worker[2])

    def _worker_take(self, m: S, w: int) -> tuple[str, S]:
        before = m.room
        room, batch = self.protocol.take(before, m.now)
        if batch is None:  # `stm.retry()`: the attempt's writes are discarded
            if not self.protocol.peek_without_checkpoint:
                return f"worker {w} takes nothing", self._set_worker(m, w, (PEEK,))
            deadline = self.protocol.sleep_deadline(before)
            label = f"worker {w} takes nothing, sleeps until {deadline}"
            return label, self._set_worker(m, w, (SLEEP, deadline, False))
        ids = tuple(it.entry for it in batch.items)
        label = f"worker {w} takes {batch.key}:{list(ids)} at {m.now}"
        due = [k for d, k in before.waiting_keys() if d <= m.now]
        expected = before.ready_keys() + due
        if not ids:
            raise _step_violation(label, "an empty batch was taken")
        if not expected or batch.key != expected[0]:
            raise _step_violation(label, f"not first come first served: ready order {expected}")
        for i in ids:
            if m.callers[i][0] != PARKED:
                raise _step_violation(label, f"input {i} sent while its caller is {m.callers[i]}")
        workers = self._ring(m.workers) if self.protocol.take_rings(room) else m.workers
        return label, self._set_worker(m, w, (HOLD, batch.key, ids), room=room, workers=workers)

    def _call_ends(self, m: S, w: int, key: str, ids: tuple[int, ...]) -> Iterator[tuple[str, S]]:
        cfg = self.config
        ends: list[tuple[str, str, bool]] = []
        if not cfg.hang:
            ends.append(("returns", "result", False))
            if cfg.failures:
                ends.append(("raises", "failed", True))
        if m.phase != OPEN:
            ends.append(("is cancelled", "closed", False))
        for how, outcome, failed in ends:
            label = f"worker {w} call {key}:{list(ids)} {how}"
            cancelled = outcome == "closed"
            callers = list(m.callers)
            if cancelled and self.protocol.cancelled_worker_answers:  # `_close_out`, then release
                for i in ids:
                    if callers[i][0] == PARKED:
                        self._answer(m, callers, i, outcome, label)
            room, rings = self._release_key(m, key, failed)
            if not cancelled:  # release, then answer whoever still waits
                for i in ids:
                    if callers[i][0] == PARKED or not self.protocol.answer_checks_task:
                        self._answer(m, callers, i, outcome, label)
            workers = self._ring(m.workers) if rings else m.workers
            status = (EXITED,) if cancelled else (IDLE,)
            yield (
                label,
                self._set_worker(m, w, status, room=room, callers=tuple(callers), workers=workers),
            )

    # -- the clock and close

    def _ticks(self, m: S) -> Iterator[tuple[str, S]]:
        cfg = self.config
        events = [d for d in (core.next_deadline(m.room),) if d is not None and d > m.now]
        events += [wk[1] for wk in m.workers if wk[0] == SLEEP and wk[1] is not None]
        events = [e for e in events if e > m.now]
        nxt = min(events) if events else None
        if nxt is not None:
            yield f"tick to {nxt} (next deadline)", m._replace(now=nxt)
        if m.now + cfg.tick <= cfg.horizon and (nxt is None or m.now + cfg.tick < nxt):
            yield f"tick to {m.now + cfg.tick}", m._replace(now=m.now + cfg.tick)

    def _drain(self, m: S) -> tuple[str, S]:
        callers = list(m.callers)
        if self.protocol.close_cancels_direct_calls:
            for i, c in enumerate(callers):
                if c[0] == DIRECT:
                    callers[i] = (DIRECT, True)
        room, drained = self.protocol.drain(m.room)
        label = "close drains"
        if self.protocol.close_cancels_direct_calls:
            label += " (direct calls cancelled)"
        for it in drained:
            if callers[it.entry][0] == PARKED:  # `_close_out` skips callers already answered
                self._answer(m, callers, it.entry, "closed", label)
        return label, m._replace(room=room, callers=tuple(callers), phase=DRAINED)

    def _close_done(self, m: S) -> tuple[str, S]:
        callers = list(m.callers)
        if not self.protocol.close_cancels_direct_calls:  # the planted order: cancel them last
            for i, c in enumerate(callers):
                if c[0] == DIRECT:
                    callers[i] = (DIRECT, True)
        return "close done (busy == 0)", m._replace(callers=tuple(callers), phase=CLOSED)

    # ---- properties ---------------------------------------------------------------------------

    def _check_state(self, m: S) -> None:  # type: ignore[override]
        room = m.room
        if self.check_room:
            core.check_invariants(room)
        in_room = {it.entry for lane in room.lanes.values() for it in lane.items()}
        held: dict[int, int] = {}
        for w, wk in enumerate(m.workers):
            if wk[0] == HOLD:
                for i in wk[2]:
                    assert i not in held, f"input {i} in two batches"
                    held[i] = w
        for i, caller in enumerate(m.callers):
            status = caller[0]
            if status == PARKED:
                places = (i in in_room) + (i in held)
                assert places == 1, f"caller {i} is parked but its input is in {places} places"
            else:
                what = caller[1] if status == DONE else status
                assert i not in in_room, f"input {i} still waits in the room, its caller: {what}"
                if status != DONE:
                    assert i not in held, f"input {i} held by a worker while its caller is {status}"
        if self.config.limits.one_in_flight:
            flying: dict[str, int] = {}
            for wk in m.workers:
                if wk[0] == HOLD:
                    flying[wk[1]] = flying.get(wk[1], 0) + 1
            for i, caller in enumerate(m.callers):
                if caller[0] == DIRECT:
                    key = self.config.keys[i]
                    flying[key] = flying.get(key, 0) + 1
            for key, n in flying.items():
                assert n <= 1, f"{n} calls in flight for key {key}"
        if m.phase == OPEN and self.wakeups != "off":
            self._check_wakeup(m)
        if m.phase in (DRAINED, CLOSED):
            assert room.closed and room.queued == 0, "inputs in the room after the drain"
        if m.phase == CLOSED:
            assert not room.lanes and room.busy == 0, "close done with lanes left"

    def _check_wakeup(self, m: S) -> None:
        """Due work (a ready lane now, or a waiting lane at its deadline) wakes a sleeping worker.

        Lost wake-up (the stuck state): every worker sleeps and none has been rung or wakes by
        then. Oversleeping (stronger): some sleeping worker has not been rung
        and sleeps past it, so the work waits for a busy worker while this one idles.
        """
        room = m.room
        if room.busy >= room.limits.max_in_flight:
            return  # no call may start: no work is due for any worker
        due = m.now if room.n_ready else core.next_deadline(room)
        if due is None:
            return
        what = f"a lane ready at {m.now}" if room.n_ready else f"a lane due at {due}"
        sleepers = [(w, wk) for w, wk in enumerate(m.workers) if wk[0] == SLEEP]
        late = [(w, wk[1]) for w, wk in sleepers if not wk[2] and (wk[1] is None or wk[1] > due)]
        if len(sleepers) == len(m.workers) == len(late):
            raise AssertionError(
                f"lost wake-up: {what}, every worker asleep (until {[d for _, d in late]}) "
                "and none was rung"
            )
        if self.wakeups == "oversleep" and late:
            w, until = late[0]
            raise AssertionError(f"worker {w} oversleeps: {what}, it sleeps until {until}, unrung")

    def _check_terminal(self, m: S) -> None:  # type: ignore[override]
        for i, caller in enumerate(m.callers):
            assert caller[0] == DONE, f"caller {i} never got an outcome: {caller[0]}"
        for w, wk in enumerate(m.workers):
            assert wk[0] != HOLD, f"worker {w} still holds a batch"
        room = m.room
        assert not room.lanes, f"lanes left behind: {sorted(room.lanes)}"
        assert room.busy == 0 and room.queued == 0
        if self.config.close:
            assert m.phase == CLOSED, f"close never finished (phase {m.phase})"
