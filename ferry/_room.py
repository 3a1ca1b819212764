"""The waiting room of one ferry as shared state: its TVars and the seven transactions on them.

Trio-free and clock-free: time comes in as `now`. Five transactions never block: `admit`,
`take`, `release`, `cancel` and `drain` each read and write the room's one TVar (and may ring its
doorbell), so they run in `stm`'s single-TVar transaction (`update_single_tvar` of
`stm._internal`, stm's interface for this distribution: a pure function of the committed value,
one validated install; ADR 0033). The two that block, `sleep` and `idle`,
are transaction functions the task code (`ferry._shell`) runs with `stm.atomically`. The model
check (tests/model/shell.py) mirrors each one.

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
from stm._internal import update_single_tvar as _update

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


# ---- the transaction functions: (old state, args) -> (new state, result, ring) ----------------


def _admit(
    old: Lanes[K, E], args: tuple[K, E, float, Any, float]
) -> tuple[Lanes[K, E], Item[E] | Admission, bool]:
    """The admission's result is the new `Item` when admitted, else the `Admission` (CLAIMED,
    CLOSED or REJECTED): one object, no pair per caller."""
    key, entry, weight, rank, now = args
    try:
        new, admission, item = _lanes.admit(old, key, entry, weight=weight, rank=rank, now=now)
    except TypeError as exc:
        if rank is None:
            raise
        raise TypeError(
            f"rank(x) returned {rank!r}, which does not compare with the ranks already "
            f"waiting for key {key!r}: {exc}"
        ) from exc
    # Only an admitted input can make work: a claim, a refusal or a count after close cannot.
    if item is None:
        return new, admission, False
    # `rings` for an admission, which leaves `busy` as it was: a lane became ready while a call
    # may start, or the earliest deadline moved earlier.
    if new.n_ready > old.n_ready and new.busy < new.limits.max_in_flight:
        return new, item, True
    if not new.waiting_size:
        return new, item, False
    return new, item, _earlier(new.waiting[0][0], _lanes.next_deadline(old))


def _take(old: Lanes[K, E], now: float) -> tuple[Lanes[K, E], Batch[K, E] | None, bool]:
    new, batch = _lanes.take(old, now)
    if batch is None:
        return new, None, False
    return new, batch, bool(new.n_ready) and new.busy < new.limits.max_in_flight


def _release(old: Lanes[K, E], args: tuple[K, float, bool]) -> tuple[Lanes[K, E], None, bool]:
    key, now, failed = args
    new = _lanes.release(old, key, now, failed=failed)
    return new, None, rings(old, new)


def _cancel(old: Lanes[K, E], args: tuple[K, Item[E]]) -> tuple[Lanes[K, E], bool, bool]:
    new, dropped = _lanes.cancel(old, *args)
    return new, dropped, False


def _drain(old: Lanes[K, E], _: None) -> tuple[Lanes[K, E], list[Item[E]], bool]:
    new, drained = _lanes.drain(old)
    return new, drained, False


class Room(Generic[K, E]):
    """The TVars of one ferry's waiting room and its transactions. Made by the shell.

    `admit`, `take`, `release`, `cancel` and `drain` are whole transactions, each on the room's
    one TVar (and its doorbell): the pure functions `_admit`, `_take`, ... run in `stm`'s
    single-TVar transaction (`update_single_tvar`, ADR 0033); call them outside any transaction.
    `sleep` and `idle` are transaction functions, for `stm.atomically`.
    """

    __slots__ = ("bell", "state")

    def __init__(self, limits: Limits) -> None:
        self.state: stm.TVar[Lanes[K, E]] = stm.TVar(_lanes.empty(limits))
        self.bell = stm.TVar(0)

    # ---- the transactions ----------------------------------------------------------------------

    def admit(self, key: K, entry: E, weight: float, rank: Any, now: float) -> Item[E] | Admission:
        """`_lanes.admit`: the new `Item` if admitted (keep it to `cancel`), else the `Admission`
        (CLAIMED, CLOSED or REJECTED). A rank that does not compare with its lane's is a clear
        TypeError."""
        return _update(self.state, self.bell, _admit, (key, entry, weight, rank, now))

    def take(self, now: float) -> Batch[K, E] | None:
        """`_lanes.take`: a batch, now owned by the caller; None if nothing is ready (or
        `max_in_flight` calls are in flight), and then nothing changed.

        Rings when lanes are still ready and another call may start, so that another sleeping
        worker comes.
        """
        return _update(self.state, self.bell, _take, now)

    def release(self, key: K, now: float, failed: bool) -> None:
        """`_lanes.release`: the call for `key` is over."""
        _update(self.state, self.bell, _release, (key, now, failed))

    def cancel(self, key: K, item: Item[E]) -> bool:
        """`_lanes.cancel`: drop a waiting input; False (and no write) if it is not waiting."""
        return _update(self.state, self.bell, _cancel, (key, item))

    def drain(self) -> list[Item[E]]:
        """`_lanes.drain`: close the room and return every waiting input."""
        return _update(self.state, self.bell, _drain, None)

    def sleep(self, rung: int) -> None:
        """Transaction function: block (`stm.retry`) until the bell has rung since it read
        `rung`."""
        if self.bell.get() == rung:
            stm.retry()

    def idle(self) -> None:
        """Transaction function: block (`stm.check`) until no call is in flight."""
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
