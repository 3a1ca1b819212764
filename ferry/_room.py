"""The waiting room of one ferry as shared state: its TVars and the seven transactions on them.

Trio-free and clock-free: time comes in as `now`. Each method below is a transaction *function*:
the task code (`ferry._shell`) runs it in exactly one `stm` transaction (`atomically_nowait`, or
`atomically` for the two that block), and the model check (tests/model/shell.py) mirrors each one.

- `state`: the whole scheduling state, one immutable `Lanes` value (ADR 0003); every change is one
  pure transition of `ferry._lanes`.
- `bell`: not state, a doorbell (ADR 0006). Workers with nothing to do sleep on it alone, and a
  transaction rings it (in the same commit as its change to `state`) exactly when it makes work a
  sleeping worker could do (`rings`): a lane became ready while a call may start, a call ended
  that made room under `max_in_flight` for work that waits, or the earliest deadline moved
  earlier. So an admission into a lane already queued, a claim, a cancel, or a release of an
  emptied lane with nothing waiting wakes nobody.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import stm

from . import _lanes
from ._lanes import Admission, Batch, Item, Lanes, Limits
from ._stats import FerryStatistics

K = TypeVar("K")
E = TypeVar("E")


def _earlier(new: float | None, old: float | None) -> bool:
    """True if the deadline `new` is due before `old` (None: no deadline)."""
    return new is not None and (old is None or new < old)


def rings(old: Lanes[Any, Any], new: Lanes[Any, Any]) -> bool:
    """The doorbell rule, for an admission or a release from `old` to `new` (ADR 0006).

    True when a sleeping worker could now do something it could not before: a lane became ready
    and a call may start (`busy < max_in_flight`); or a call ended that brought `busy` back under
    `max_in_flight` while lanes are ready or waiting (a worker blocked by the bound sleeps
    without a deadline, so it must look again); or the earliest waiting deadline moved earlier
    (a sleeper wakes at its own deadline anyway, so a later one needs no ring).
    """
    bound = new.limits.max_in_flight
    if new.busy < bound and (
        new.n_ready > old.n_ready or (old.busy >= bound and (new.n_ready or new.waiting_size))
    ):
        return True
    if not new.waiting_size:
        return False  # no deadline at all
    return _earlier(_lanes.next_deadline(new), _lanes.next_deadline(old))


class Room(Generic[K, E]):
    """The TVars of one ferry's waiting room and its transactions. Made by the shell.

    Every method except `next_deadline` and `statistics` must run inside a transaction.
    """

    __slots__ = ("bell", "state")

    def __init__(self, limits: Limits) -> None:
        self.state: stm.TVar[Lanes[K, E]] = stm.TVar(_lanes.empty(limits))
        self.bell = stm.TVar(0)

    # ---- the seven transactions ----------------------------------------------------------------

    def admit(
        self, key: K, entry: E, weight: float, rank: Any, now: float
    ) -> tuple[Admission, Item[E] | None]:
        """`_lanes.admit`; a rank that does not compare with its lane's is a clear TypeError."""
        state = self.state
        old = state.get()
        try:
            new, admission, item = _lanes.admit(old, key, entry, weight=weight, rank=rank, now=now)
        except TypeError as exc:
            if rank is None:
                raise
            raise TypeError(
                f"rank(x) returned {rank!r}, which does not compare with the ranks already "
                f"waiting for key {key!r}: {exc}"
            ) from exc
        state.set(new)
        if rings(old, new):
            self._ring()
        return admission, item

    def take(self, now: float) -> Batch[K, E]:
        """`_lanes.take`: a batch, now owned by the caller; `stm.retry()` if nothing is ready (or
        `max_in_flight` calls are in flight).

        Rings when lanes are still ready and another call may start, so that another sleeping
        worker comes.
        """
        state = self.state
        new, batch = _lanes.take(state.get(), now)
        if batch is None:
            stm.retry()
        state.set(new)
        if new.n_ready and new.busy < new.limits.max_in_flight:
            self._ring()
        return batch

    def sleep(self, rung: int) -> None:
        """Block (`stm.retry`) until the bell has rung since it read `rung`."""
        if self.bell.get() == rung:
            stm.retry()

    def release(self, key: K, now: float, failed: bool) -> None:
        """`_lanes.release`: the call for `key` is over."""
        state = self.state
        old = state.get()
        new = _lanes.release(old, key, now, failed=failed)
        state.set(new)
        if rings(old, new):
            self._ring()

    def cancel(self, key: K, item: Item[E]) -> bool:
        """`_lanes.cancel`: drop a waiting input; False (and no write) if it is not waiting."""
        state = self.state
        new, dropped = _lanes.cancel(state.get(), key, item)
        if dropped:
            state.set(new)
        return dropped

    def drain(self) -> list[Item[E]]:
        """`_lanes.drain`: close the room and return every waiting input."""
        state = self.state
        new, drained = _lanes.drain(state.get())
        state.set(new)
        return drained

    def idle(self) -> None:
        """Block (`stm.check`) until no call is in flight."""
        stm.check(self.state.get().busy == 0)

    # ---- reads without a transaction ------------------------------------------------------------

    def sleep_deadline(self) -> float | None:
        """Until when a worker that found nothing to take sleeps, unless the bell rings: the
        earliest waiting deadline, or None (only the bell) while `max_in_flight` calls are in
        flight, since then only a call's end can make work, and it rings. One TVar peek."""
        state = self.state.peek()
        if state.busy >= state.limits.max_in_flight:
            return None
        return _lanes.next_deadline(state)

    def statistics(self, *, plain: bool) -> FerryStatistics:
        """A snapshot of the room and its counters. One TVar peek; O(1)."""
        state = self.state.peek()
        counters = {name: getattr(state, name) for name in _lanes.COUNTERS}
        return FerryStatistics(
            queued=state.queued,
            queued_weight=0.0 if plain else state.weight,
            busy=state.busy,
            lanes=0 if plain else len(state.lanes),
            ready=0 if plain else state.n_ready,
            waiting=0 if plain else state.n_waiting,
            batch_sizes=state.batch_sizes,
            **counters,
        )

    def _ring(self) -> None:
        bell = self.bell
        bell.set(bell.get() + 1)
