"""The waiting room of a ferry: one immutable value and the pure transitions on it.

PURE: this module never imports trio, never reads a clock and does no I/O. Time comes in as the
`now` argument. The trio shell applies each transition in exactly one `stm` transaction on one
TVar; the model check (tests/model/) explores every interleaving of them.

State (`Lanes`, the root value)
-------------------------------
- `lanes`: key -> `Lane`, for every key with inputs waiting or a call in flight, and no other.
- `ready`: FIFO of lanes that can be taken: `(stamp, key)` in an `Array` from `ready_head` on.
- `waiting`: lanes with a partial batch, by deadline. A binary min-heap of
  `(deadline, stamp, key)` in an `Array` (slots 0 to `waiting_size` - 1).
- `queued`, `weight`: inputs waiting (not in flight) and their total weight, over all lanes.
- `busy`: calls in flight (batches and direct calls); always the sum of `Lane.calls`.
- counters for statistics, all plain fields of the root, listed once (`COUNTERS`).

Lane states: a lane is WAITING(deadline) or READY when it has inputs and may be taken, or IDLE
(in neither queue) when it has no inputs or, with the per-key guard, while its call is in flight
("busy": `calls > 0`). An empty lane with no call in flight is removed at once.

    admit (new lane) --> WAITING --(full, or deadline passed: take promotes)--> READY
    admit (delay 0 or full) --------------------------------------------------> READY
    READY --take--> busy --release--> gone (empty) | tail of READY | WAITING (partial, not due)
    admit (direct call, idle key) --> busy (no items)

Why these structures
--------------------
- Lazy deletion: an entry of `ready` or `waiting` carries the lane's `stamp` at the time it was
  queued; the entry is live only while the lane still has that stamp and that state. Moving a lane
  out of a queue is then O(1): give it a new stamp. Dead entries are skipped when they reach the
  front; the top of `waiting` is always live (every transition that can kill it pops dead tops),
  so `next_deadline` is a read. Dead `waiting` entries leave by their own deadline at the latest.
- A lane of inputs with no rank (the common case) is a chunked FIFO (`ferry._persistent`): a
  `PVector` of full chunks, a short `tail` tuple, and a head index. Admitting copies the small
  tail (and appends it as a chunk when full), taking a prefix only moves the head (whole consumed
  chunks are dropped once they are half the vector), and cancelling replaces the slot with a
  tombstone (found by binary search on the arrival sequence). Ranked lanes use a persistent treap
  keyed by `(rank, seq)`; the rank-free path never pays for it. `ferry._persistent` says why.
- The root and `Lane` are slotted records, frozen once built: a transition copies the old one
  into a writable draft, changes a few fields and freezes it (see "records" below; ADR 0033).
  Items are named tuples created once per input.
- Float weights are summed incrementally; the room resets its weight to exactly 0.0 whenever it is
  empty, and `check_invariants` compares sums with a tolerance.

The plain ferry is the same core with `one_in_flight=False` and a single key, so its lane may be
queued while batches from it are in flight; its `lanes` is a one-slot `OneLane` map instead of a
`immutables.Map` (same interface, less per admission).

Open question: a lane's deadline is not postponed when its oldest input is cancelled (it may be
taken a little early, never late).
"""

from __future__ import annotations

import enum
import math
from typing import Any, Generic, NamedTuple, TypeVar, final

import attrs
import immutables
from pyrsistent import PMap, PVector, pmap

from ._persistent import (
    CHUNK,
    EMPTY_ARRAY,
    EMPTY_VECTOR,
    SHIFT,
    Array,
    LaneMap,
    OneLane,
    Tombstone,
    fifo_build,
    fifo_get,
    fifo_iter,
    fifo_set,
    fifo_trim,
    heap_pop,
    heap_push,
    queue_drop,
    queue_iter,
    queue_push,
    treap_delete,
    treap_insert,
    treap_iter,
    treap_min,
    treap_pop_min,
    treap_priority,
)

K = TypeVar("K")
E = TypeVar("E")
R = TypeVar("R")

__all__ = [
    "Admission",
    "Batch",
    "Item",
    "Lane",
    "Lanes",
    "Limits",
    "admit",
    "cancel",
    "check_invariants",
    "claim",
    "drain",
    "empty",
    "next_deadline",
    "release",
    "take",
]

# Lane.where
IDLE = 0
WAITING = 1
READY = 2

_new = object.__new__


class Admission(enum.Enum):
    """The outcome of `admit`, in the order the rules are tried."""

    CLOSED = "closed"
    CLAIMED = "claimed"
    ADMITTED = "admitted"
    REJECTED = "rejected"


# The two admissions that serve a caller (named as in `ferry._shell`), as module constants:
# reading a member off the enum class costs about 13 times a global read (117 against 9 ns).
_ADMITTED = Admission.ADMITTED
_CLAIMED = Admission.CLAIMED


@attrs.frozen
class Limits:
    """The options of a ferry that the core needs. The shell validates them (ValueError)."""

    max_batch_size: int = 100
    max_batch_weight: float = math.inf
    max_batch_delay: float = 0.0
    max_queueing: int = 10_000
    max_queued_weight: float = math.inf
    direct_calls: bool = False
    one_in_flight: bool = True
    #: most calls in flight at once, batched or direct (`busy`); `take` and the direct-call rule
    #: of `admit` respect it. math.inf: no bound beyond the number of workers.
    max_in_flight: float = math.inf

    def __attrs_post_init__(self) -> None:
        assert self.max_batch_size >= 1
        assert self.max_batch_weight > 0
        assert self.max_batch_delay >= 0
        assert self.max_queueing >= 0
        assert self.max_queued_weight >= 0
        assert not (self.direct_calls and not self.one_in_flight), "direct calls are per-key only"
        assert self.max_in_flight >= 1


class Item(NamedTuple, Generic[E]):
    """One caller's input: its entry (opaque to the core), weight, submission time, rank, seq.

    A named tuple, made with `tuple.__new__`: one is made per input, and that costs a third of
    an attrs record's `__init__`. Compared by identity (`cancel`), never by value.
    """

    entry: E
    weight: float
    submitted: float
    rank: Any
    seq: int


_new_tuple = tuple.__new__


@attrs.frozen
class Batch(Generic[K, E]):
    """What `take` hands to a worker: a key and its items, never empty."""

    key: K
    items: tuple[Item[E], ...]


# ---- records: slotted, and frozen once built ----------------------------------------------------
#
# `Lane` and `Lanes` are immutable records that every transition copies with a few fields changed,
# and whose fields every transition reads many times. Each is a pair of classes with one layout:
# the draft (`_LaneDraft`, `_LanesDraft`) holds the slots and the methods and takes writes; the
# record (`Lane`, `Lanes`) adds nothing but refuses them (`attrs.exceptions.FrozenInstanceError`,
# as the attrs records they replace did). A transition copies a record into a draft (`_lane_draft`,
# `_draft`: one slot load and store per field), changes that, and freezes it by switching its
# class (`new.__class__ = Lanes`, allowed between two classes of the same layout). Only a draft
# the running transition made is ever written, and it is frozen before it is returned.
#
# Why not attrs records (ADR 0033): a frozen slotted attrs record can be built only through
# `object.__setattr__`, several times the cost of this copy; the records without slots used
# before made the copy one dict copy, but then every attribute read is a generic dict lookup,
# about twelve times a slot read (370 against 30 instructions under callgrind), and a transition
# reads twenty to forty fields.


def _refuse_write(self: object, name: str, value: object = None) -> None:
    raise attrs.exceptions.FrozenInstanceError()


_LANE_FIELDS = (
    "ranked",
    "fifo",
    "tail",
    "head",
    "tree",
    "count",
    "weight",
    "where",
    "calls",
    "deadline",
    "stamp",
)


class _LaneDraft(Generic[E]):
    """A `Lane` being built by a transition: the slots and methods of a lane, writable."""

    __slots__ = _LANE_FIELDS

    ranked: bool
    fifo: PVector[Any]
    tail: tuple[Any, ...]
    head: int
    tree: Any
    count: int
    weight: float
    where: int
    calls: int
    deadline: float
    stamp: int

    def items(self) -> list[Item[E]]:
        """The live items in take order. O(n)."""
        if self.ranked:
            return list(treap_iter(self.tree))
        slots = fifo_iter(self.fifo, self.tail, self.head)
        return [it for it in slots if type(it) is not Tombstone]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _LANE_FIELDS)
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _LaneDraft):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _LANE_FIELDS)

    __hash__ = None  # type: ignore[assignment]


@final
class Lane(_LaneDraft[E]):
    """One key's inputs in ascending (rank, arrival) order, and its state. Immutable.

    `where` is IDLE, WAITING or READY; `calls` counts calls in flight for this key (0 or 1 with
    the per-key guard); `deadline` is meaningful while WAITING; `stamp` identifies the lane's live
    entry in `ready` or `waiting`. Rank-free lanes keep their slots (items and tombstones) from
    logical index `head` on in the chunked FIFO `fifo` + `tail` (see the module comment);
    ranked lanes keep the treap `tree`. `count` and `weight` are over live items only.
    """

    __slots__ = ()
    __setattr__ = _refuse_write
    __delattr__ = _refuse_write


def _lane_draft(old: Lane[E]) -> Lane[E]:
    """A writable copy of `old` (a `_LaneDraft`); freeze it with `new.__class__ = Lane`. O(1)."""
    new: Lane[E] = _new(_LaneDraft)  # type: ignore[arg-type]
    new.ranked = old.ranked
    new.fifo = old.fifo
    new.tail = old.tail
    new.head = old.head
    new.tree = old.tree
    new.count = old.count
    new.weight = old.weight
    new.where = old.where
    new.calls = old.calls
    new.deadline = old.deadline
    new.stamp = old.stamp
    return new


_NO_BATCHES: PMap[int, int] = pmap()

#: The counters since open, for statistics: fields of `Lanes` that start at 0 and only grow.
#: `FerryStatistics` reports each under the same name.
COUNTERS: tuple[str, ...] = (
    "submitted",
    "admitted",
    "rejected",
    "after_close",
    "direct_calls",
    "batches",
    "inputs_sent",
    "failed_batches",
    "dropped",
    "drained",
)

_LANES_FIELDS = (
    "limits",
    "lanes",
    "ready",
    "ready_head",
    "waiting",
    "waiting_size",
    "queued",
    "weight",
    "busy",
    "closed",
    "seq",
    "n_ready",
    "n_waiting",
    *COUNTERS,
    "batch_sizes",
)


class _LanesDraft(Generic[K, E]):
    """A `Lanes` being built by a transition: the slots and methods of the room, writable."""

    __slots__ = _LANES_FIELDS

    limits: Limits
    lanes: LaneMap[K, Lane[E]]
    ready: Array[int, tuple[int, K]]
    ready_head: int
    waiting: Array[int, Any]
    waiting_size: int
    queued: int
    weight: float
    busy: int
    closed: bool
    seq: int
    n_ready: int
    n_waiting: int
    submitted: int
    admitted: int
    rejected: int
    after_close: int
    direct_calls: int
    batches: int
    inputs_sent: int
    failed_batches: int
    dropped: int
    drained: int
    batch_sizes: PMap[int, int]  # batch size -> number of batches of that size

    def ready_keys(self) -> list[K]:
        """Keys of the READY lanes, first come first. O(len(ready))."""
        lanes = self.lanes
        out = []
        for stamp, key in queue_iter(self.ready, self.ready_head):
            lane = lanes.get(key)
            if lane is not None and lane.stamp == stamp and lane.where == READY:
                out.append(key)
        return out

    def waiting_keys(self) -> list[tuple[float, K]]:
        """(deadline, key) of the WAITING lanes, earliest first. O(n log n)."""
        lanes = self.lanes
        out = []
        for entry in self.waiting.values():
            deadline, stamp, key = entry
            lane = lanes.get(key)
            if lane is not None and lane.stamp == stamp and lane.where == WAITING:
                out.append((deadline, stamp, key))
        out.sort(key=lambda e: (e[0], e[1]))
        return [(d, k) for d, _, k in out]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _LANES_FIELDS)
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _LanesDraft):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _LANES_FIELDS)

    __hash__ = None  # type: ignore[assignment]


@final
class Lanes(_LanesDraft[K, E]):
    """The whole waiting room: one immutable value. See the module comment for each field."""

    __slots__ = ()
    __setattr__ = _refuse_write
    __delattr__ = _refuse_write


def _draft(old: Lanes[K, E]) -> Lanes[K, E]:
    """A writable copy of `old` (a `_LanesDraft`); freeze it with `new.__class__ = Lanes`. O(1)."""
    new: Lanes[K, E] = _new(_LanesDraft)  # type: ignore[arg-type]
    new.limits = old.limits
    new.lanes = old.lanes
    new.ready = old.ready
    new.ready_head = old.ready_head
    new.waiting = old.waiting
    new.waiting_size = old.waiting_size
    new.queued = old.queued
    new.weight = old.weight
    new.busy = old.busy
    new.closed = old.closed
    new.seq = old.seq
    new.n_ready = old.n_ready
    new.n_waiting = old.n_waiting
    new.submitted = old.submitted
    new.admitted = old.admitted
    new.rejected = old.rejected
    new.after_close = old.after_close
    new.direct_calls = old.direct_calls
    new.batches = old.batches
    new.inputs_sent = old.inputs_sent
    new.failed_batches = old.failed_batches
    new.dropped = old.dropped
    new.drained = old.drained
    new.batch_sizes = old.batch_sizes
    return new


def _evolve(old: R, changes: dict[str, Any]) -> R:
    """A copy of the record `old` (a `Lanes` or a `Lane`) with `changes`. For tests and cold
    paths; the transitions write drafts directly."""
    if isinstance(old, Lanes):
        new: Any = _draft(old)
        frozen: type = Lanes
    else:
        assert isinstance(old, Lane)
        new, frozen = _lane_draft(old), Lane
    for name, value in changes.items():
        setattr(new, name, value)
    new.__class__ = frozen
    return new  # type: ignore[no-any-return]


def _lane(
    ranked: bool,
    fifo: PVector[Any],
    tail: tuple[Any, ...],
    head: int,
    tree: Any,
    count: int,
    weight: float,
    where: int,
    calls: int,
    deadline: float,
    stamp: int,
) -> Lane[Any]:
    """A lane from all its fields, positionally."""
    new: Lane[Any] = _new(_LaneDraft)  # type: ignore[arg-type]
    new.ranked = ranked
    new.fifo = fifo
    new.tail = tail
    new.head = head
    new.tree = tree
    new.count = count
    new.weight = weight
    new.where = where
    new.calls = calls
    new.deadline = deadline
    new.stamp = stamp
    new.__class__ = Lane
    return new


def _busy_lane(calls: int) -> Lane[Any]:
    """A lane with no items and `calls` calls in flight: a claimed key, or a drained busy lane."""
    return _lane(False, EMPTY_VECTOR, (), 0, None, 0, 0.0, IDLE, calls, math.inf, 0)


# The lane of a key claimed by a direct call (one call in flight, nothing queued); immutable, so
# every claimed key can share it.
_DIRECT_CALL_LANE = _busy_lane(1)


def empty(limits: Limits) -> Lanes[Any, Any]:
    """A new, open, empty room. O(1)."""
    new: Lanes[Any, Any] = _new(_LanesDraft)  # type: ignore[arg-type]
    new.limits = limits
    new.lanes = immutables.Map() if limits.one_in_flight else OneLane()
    new.ready = EMPTY_ARRAY
    new.ready_head = 0
    new.waiting = EMPTY_ARRAY
    new.waiting_size = 0
    new.queued = 0
    new.weight = 0.0
    new.busy = 0
    new.closed = False
    new.seq = 0
    new.n_ready = 0
    new.n_waiting = 0
    for name in COUNTERS:
        setattr(new, name, 0)
    new.batch_sizes = _NO_BATCHES
    new.__class__ = Lanes
    return new


def _purge(heap: Array[int, Any], size: int, lanes: Any) -> tuple[Array[int, Any], int]:
    """Pop dead entries off the top of `waiting` until the top is live. O(d log n) for d dead."""
    while size:
        _, stamp, key = heap[0]
        lane = lanes.get(key)
        if lane is not None and lane.stamp == stamp and lane.where == WAITING:
            break
        heap = heap_pop(heap, size)
        size -= 1
    return heap, size


def _oldest(lane: Lane[Any]) -> float:
    """The earliest submission time among a lane's live items. O(physical items)."""
    return min(it.submitted for it in lane.items())


# ---- transitions --------------------------------------------------------------------------------


def admit(
    state: Lanes[K, E],
    key: K,
    entry: E,
    *,
    weight: float = 1.0,
    rank: Any = None,
    now: float,
) -> tuple[Lanes[K, E], Admission, Item[E] | None]:
    """Admission of one input: CLOSED, CLAIMED, ADMITTED or REJECTED, the first whose rule holds.

    - CLOSED once `drain` has run;
    - CLAIMED when direct calls are on, the delay is zero, `key` has no lane, and the room is quiet:
      the calls in flight plus the lanes ready for a worker are fewer than `max_in_flight`
      (ADR 0031). Makes a busy lane with no items for `key`; the caller makes a direct call,
      then `release`s;
    - ADMITTED if there is room by count and weight; it returns the new `Item` (keep it to
      `cancel`). `rank=None` orders by arrival; a lane holds ranked or rank-free items, not both;
    - else REJECTED (docs/guide.md, "Backpressure").

    `submitted` always counts, and one of `after_close`, `direct_calls`, `admitted` or `rejected`
    by outcome. Never raises on a valid state.

    Cost: O(log n) in waiting inputs (one map write, one tail copy or treap insert, at most one
    heap push); amortized O(1) extra for dead heap tops.
    """
    limits = state.limits
    if state.closed:
        new = _draft(state)
        new.submitted = state.submitted + 1
        new.after_close = state.after_close + 1
        new.__class__ = Lanes
        return new, Admission.CLOSED, None
    lanes = state.lanes
    lane = lanes.get(key)
    if (
        lane is None
        and limits.direct_calls
        and limits.max_batch_delay == 0
        and state.busy + state.n_ready < limits.max_in_flight
    ):
        return _claim(state, key), _CLAIMED, None
    new_weight = state.weight + weight
    if state.queued >= limits.max_queueing or new_weight > limits.max_queued_weight:
        new = _draft(state)
        new.submitted = state.submitted + 1
        new.rejected = state.rejected + 1
        new.__class__ = Lanes
        return new, Admission.REJECTED, None

    seq = state.seq
    item: Item[E] = _new_tuple(Item, (entry, weight, now, rank, seq))
    new = _draft(state)
    new.submitted = state.submitted + 1
    new.admitted = state.admitted + 1
    new.queued = state.queued + 1
    new.weight = new_weight
    new.seq = seq + 1
    purge = False
    if lane is None or lane.count == 0:
        ranked = rank is not None
        calls = 0 if lane is None else lane.calls
        tail: tuple[Any, ...]
        if ranked:
            tail, tree = (), (((rank, seq), treap_priority(seq), item, None, None))
        else:
            tail, tree = (item,), None
        if calls and limits.one_in_flight:
            new_lane = _lane(
                ranked, EMPTY_VECTOR, tail, 0, tree, 1, weight, IDLE, calls, math.inf, 0
            )
        else:
            deadline = now + limits.max_batch_delay
            where, stamp = _queue_new(new, key, weight, deadline)
            new_lane = _lane(
                ranked, EMPTY_VECTOR, tail, 0, tree, 1, weight, where, calls, deadline, stamp
            )
    else:
        assert lane.ranked == (rank is not None), "a lane holds ranked or rank-free items, not both"
        new_lane = _lane_draft(lane)
        if lane.ranked:
            new_lane.tree = treap_insert(lane.tree, (rank, seq), treap_priority(seq), item)
        else:
            tail = lane.tail
            # A concatenation, not `(*tail, item)`: that builds a list first (a third more).
            if len(tail) < CHUNK - 1:
                new_lane.tail = tail + (item,)  # noqa: RUF005
            else:
                new_lane.fifo, new_lane.tail = lane.fifo.append(tail + (item,)), ()  # noqa: RUF005
        count = new_lane.count = lane.count + 1
        lane_weight = new_lane.weight = lane.weight + weight
        if lane.where == WAITING:
            deadline = now + limits.max_batch_delay
            if count >= limits.max_batch_size or lane_weight >= limits.max_batch_weight:
                seq += 1
                new_lane.stamp = seq
                new_lane.where = READY
                new.ready = queue_push(state.ready, state.ready_head, (seq, key))
                new.n_ready = state.n_ready + 1
                new.n_waiting = state.n_waiting - 1
                new.seq = seq + 1
                purge = True
            elif deadline < lane.deadline:
                seq += 1
                new_lane.stamp = seq
                new_lane.deadline = deadline
                new.waiting = heap_push(state.waiting, state.waiting_size, (deadline, seq, key))
                new.waiting_size = state.waiting_size + 1
                new.seq = seq + 1
                purge = True
        new_lane.__class__ = Lane
    new.lanes = lanes = lanes.set(key, new_lane)
    if purge:
        new.waiting, new.waiting_size = _purge(new.waiting, new.waiting_size, lanes)
    new.__class__ = Lanes
    return new, _ADMITTED, item


def _queue_new(new: Lanes[Any, Any], key: Any, weight: float, deadline: float) -> tuple[int, int]:
    """Queue a lane that just got its first input, in the draft `new`: READY if due or full,
    else WAITING. Returns the lane's new (where, stamp). O(1) on average, O(log n) at worst.
    """
    limits = new.limits
    stamp = new.seq
    new.seq = stamp + 1
    if (
        limits.max_batch_delay == 0
        or limits.max_batch_size == 1
        or weight >= limits.max_batch_weight
    ):
        new.ready = queue_push(new.ready, new.ready_head, (stamp, key))
        new.n_ready += 1
        return READY, stamp
    new.waiting = heap_push(new.waiting, new.waiting_size, (deadline, stamp, key))
    new.waiting_size += 1
    new.n_waiting += 1
    return WAITING, stamp


def _claim(state: Lanes[K, E], key: K) -> Lanes[K, E]:
    new = _draft(state)
    new.lanes = state.lanes.set(key, _DIRECT_CALL_LANE)
    new.busy = state.busy + 1
    new.direct_calls = state.direct_calls + 1
    new.submitted = state.submitted + 1
    new.__class__ = Lanes
    return new


def claim(state: Lanes[K, E], key: K) -> Lanes[K, E]:
    """`admit`'s CLAIMED outcome alone, whatever the options: put a direct call for `key` in flight.

    Makes a busy lane with no items and counts `submitted` and `direct_calls`, as `admit` does;
    `release(key)` ends it. For tests that need a direct call in flight without admission's rules
    (the model check goes through `admit`). The key must have no lane and the room must be open
    (AssertionError otherwise). O(log n).
    """
    assert not state.closed and key not in state.lanes
    return _claim(state, key)


def _requeue(new: Lanes[Any, Any], lane: Lane[Any], key: Any, now: float) -> None:
    """Queue the draft `lane` (which has items, is IDLE) in the draft `new`: tail of READY if due
    or full, else WAITING.

    O(log n), plus O(b) to find the oldest of a partial remainder of b < max_batch_size items.
    """
    limits = new.limits
    seq = new.seq
    new.seq = seq + 1
    lane.stamp = seq
    full = lane.count >= limits.max_batch_size or lane.weight >= limits.max_batch_weight
    deadline = -math.inf
    if not full and limits.max_batch_delay > 0:
        deadline = _oldest(lane) + limits.max_batch_delay
    if full or deadline <= now:
        lane.where = READY
        new.ready = queue_push(new.ready, new.ready_head, (seq, key))
        new.n_ready += 1
    else:
        lane.where = WAITING
        lane.deadline = deadline
        size = new.waiting_size
        new.waiting = heap_push(new.waiting, size, (deadline, seq, key))
        new.waiting_size = size + 1
        new.n_waiting += 1


def take(state: Lanes[K, E], now: float) -> tuple[Lanes[K, E], Batch[K, E] | None]:
    """Promote due lanes, then take the first READY lane's batch; None if nothing is ready.

    Nothing at all (`state` itself, None) while `max_in_flight` calls are in flight.

    A batch is the lane's longest prefix within `max_batch_size` and `max_batch_weight`, at
    least one input, tombstones skipped. The lane becomes busy (with the per-key guard: IDLE
    until `release`; without it, the rest is queued again at once). Counts `batches`,
    `inputs_sent` and `batch_sizes`. Returns `state` itself (no write) when nothing changed.

    Cost: O(b + (p + 1) log n) for a batch of b inputs and p lanes promoted; dead queue entries
    skipped on the way are paid for by whoever killed them.
    """
    limits = state.limits
    if state.busy >= limits.max_in_flight:
        return state, None  # no call may start before one ends
    lanes = state.lanes
    heap, size = state.waiting, state.waiting_size
    updated: dict[K, Lane[E]] = {}  # lanes promoted in this call, written once at the end
    new: Lanes[K, E] | None = None
    n_ready = state.n_ready
    if size and heap[0][0] <= now:
        new = _draft(state)
        ready = state.ready
        n_waiting, seq = state.n_waiting, state.seq
        while size and heap[0][0] <= now:
            _, stamp, key = heap[0]
            heap = heap_pop(heap, size)
            size -= 1
            lane = lanes.get(key)  # a dead entry never matches, even for a lane promoted here
            if lane is not None and lane.stamp == stamp and lane.where == WAITING:
                promoted = _lane_draft(lane)
                promoted.where = READY
                promoted.stamp = seq
                promoted.__class__ = Lane
                ready = queue_push(ready, state.ready_head, (seq, key))
                seq += 1
                n_ready += 1
                n_waiting -= 1
                updated[key] = promoted
        new.ready, new.n_ready, new.n_waiting, new.seq = ready, n_ready, n_waiting, seq
        new.waiting, new.waiting_size = _purge(heap, size, lanes)
    if not n_ready:
        if new is None:
            return state, None
        new.lanes = _write(lanes, updated)
        new.__class__ = Lanes
        return new, None
    if new is None:
        new = _draft(state)

    # Find the first live READY entry.
    ready = new.ready
    first = head = state.ready_head
    while True:
        stamp, key = ready[head]
        head += 1
        lane = updated.get(key) or lanes.get(key)
        if lane is not None and lane.stamp == stamp and lane.where == READY:
            break
    new.ready = queue_drop(ready, first, head)  # the dead entries passed, and this one
    new.ready_head = head

    max_size, max_weight = limits.max_batch_size, limits.max_batch_weight
    out: list[Item[E]] = []
    total = 0.0
    taken_lane = _lane_draft(lane)
    if lane.ranked:
        tree = lane.tree
        while tree is not None and len(out) < max_size:
            first_item = treap_min(tree)
            if out and total + first_item.weight > max_weight:
                break
            _, tree = treap_pop_min(tree)
            out.append(first_item)
            total += first_item.weight
        taken_lane.tree = tree
    else:
        fifo, tail = lane.fifo, lane.tail
        i = lane.head
        for it in fifo_iter(fifo, tail, i):
            if type(it) is Tombstone:
                i += 1
                continue
            if len(out) >= max_size or (out and total + it.weight > max_weight):
                break
            out.append(it)
            total += it.weight
            i += 1
        taken_lane.fifo, taken_lane.head = fifo_trim(fifo, i)
    taken = len(out)
    count = taken_lane.count = lane.count - taken
    if count == 0:
        taken_lane.fifo, taken_lane.tail, taken_lane.head = EMPTY_VECTOR, (), 0
        taken_lane.tree, taken_lane.weight = None, 0.0
    else:
        taken_lane.weight = lane.weight - total
    taken_lane.where = IDLE
    taken_lane.calls = lane.calls + 1
    new.n_ready = n_ready - 1
    if count and not limits.one_in_flight:
        _requeue(new, taken_lane, key, now)
    taken_lane.__class__ = Lane
    updated[key] = taken_lane
    queued = state.queued - taken
    new.lanes = _write(lanes, updated)
    new.queued = queued
    new.weight = state.weight - total if queued else 0.0
    new.busy = state.busy + 1
    new.batches = state.batches + 1
    new.inputs_sent = state.inputs_sent + taken
    new.batch_sizes = state.batch_sizes.set(taken, state.batch_sizes.get(taken, 0) + 1)
    new.__class__ = Lanes
    return new, Batch(key, tuple(out))


def _write(lanes: LaneMap[K, Lane[E]], updated: dict[K, Lane[E]]) -> LaneMap[K, Lane[E]]:
    """`lanes` with the `updated` entries: a plain set for one, one mutation for several."""
    if len(updated) == 1:
        ((key, lane),) = updated.items()
        return lanes.set(key, lane)
    if not updated:
        return lanes
    mutation = lanes.mutate()
    for key, lane in updated.items():
        mutation.set(key, lane)
    return mutation.finish()


def release(state: Lanes[K, E], key: K, now: float, *, failed: bool = False) -> Lanes[K, E]:
    """The call for `key` (a batch or a direct call) is over: `busy -= 1`.

    With the per-key guard, the lane is then removed if empty, else queued at the tail of READY,
    or WAITING when only a partial batch is left and its deadline is ahead. Without the guard the
    lane is only removed when it is empty and has no call left. `failed` counts `failed_batches`.
    The key must have a call in flight (AssertionError otherwise).

    Cost: O(log n), plus O(b) to find the oldest input of a partial remainder of b inputs.
    """
    lanes = state.lanes
    lane = lanes.get(key)
    assert lane is not None and lane.calls > 0, f"release of {key!r} with no call in flight"
    new = _draft(state)
    new.busy = state.busy - 1
    if failed:
        new.failed_batches = state.failed_batches + 1
    calls = lane.calls - 1
    if calls == 0 and lane.count == 0:
        new.lanes = lanes.delete(key)
    else:
        released = _lane_draft(lane)
        released.calls = calls
        if lane.count and lane.where == IDLE and (calls == 0 or not state.limits.one_in_flight):
            _requeue(new, released, key, now)
        released.__class__ = Lane
        new.lanes = lanes.set(key, released)
    new.__class__ = Lanes
    return new


def cancel(state: Lanes[K, E], key: K, item: Item[E]) -> tuple[Lanes[K, E], bool]:
    """Drop one waiting input whose caller was cancelled.

    True if `item` was waiting in `key`'s lane and is now gone (counts `dropped`; `queued` and
    `weight` fall at once; an emptied idle lane is removed). False, and `state` itself, if it is
    not there any more (taken, drained, or never admitted). Does not postpone the lane's deadline.

    Cost: O(log n): a binary search on arrival order (rank-free) or a treap delete (ranked);
    rank-free lanes compact their tombstones when they outnumber the live items (amortized O(1)).
    """
    lanes = state.lanes
    lane = lanes.get(key)
    if lane is None or lane.count == 0:
        return state, False
    if lane.ranked:
        tree, found = treap_delete(lane.tree, (item.rank, item.seq))
        if not found:
            return state, False
        smaller = _lane_draft(lane)
        smaller.tree = tree
    else:
        fifo, tail = lane.fifo, lane.tail
        n = (len(fifo) << SHIFT) + len(tail)
        lo, hi = lane.head, n
        seq = item.seq
        while lo < hi:
            mid = (lo + hi) >> 1
            if fifo_get(fifo, tail, mid).seq < seq:
                lo = mid + 1
            else:
                hi = mid
        if lo == n or fifo_get(fifo, tail, lo) is not item:
            return state, False
        smaller = _lane_draft(lane)
        fifo, tail = fifo_set(fifo, tail, lo, Tombstone(seq))
        live = lane.count - 1
        if live and n - lane.head > 2 * live + CHUNK:
            live_items = [it for it in fifo_iter(fifo, tail, lane.head) if type(it) is Item]
            fifo, tail = fifo_build(live_items)
            smaller.head = 0
        smaller.fifo, smaller.tail = fifo, tail
    count = smaller.count = lane.count - 1
    queued = state.queued - 1
    new = _draft(state)
    new.queued = queued
    new.weight = state.weight - item.weight if queued else 0.0
    new.dropped = state.dropped + 1
    if count == 0:
        if lane.where == READY:
            new.n_ready = state.n_ready - 1
        elif lane.where == WAITING:
            new.n_waiting = state.n_waiting - 1
        if lane.calls == 0:
            lanes = lanes.delete(key)
        else:
            smaller.fifo, smaller.tail, smaller.head = EMPTY_VECTOR, (), 0
            smaller.tree, smaller.weight, smaller.where = None, 0.0, IDLE
            smaller.__class__ = Lane
            lanes = lanes.set(key, smaller)
        if lane.where == WAITING:
            new.waiting, new.waiting_size = _purge(state.waiting, state.waiting_size, lanes)
    else:
        smaller.weight = lane.weight - item.weight
        smaller.__class__ = Lane
        lanes = lanes.set(key, smaller)
    new.lanes = lanes
    new.__class__ = Lanes
    return new, True


def drain(state: Lanes[K, E]) -> tuple[Lanes[K, E], list[Item[E]]]:
    """Close the room: `closed = True`, every waiting input removed and returned (lane by lane).

    Lanes with a call in flight stay, busy and empty, until released; every other lane goes.
    Idempotent. Cost: O(lanes + items).
    """
    out: list[Item[E]] = []
    lanes = state.lanes.mutate()
    for key, lane in state.lanes.items():
        if lane.count:
            out.extend(lane.items())
        if lane.calls:
            if lane.count or lane.where != IDLE:
                lanes.set(key, _busy_lane(lane.calls))
        else:
            del lanes[key]
    new = _draft(state)
    new.closed = True
    new.lanes = lanes.finish()
    new.ready, new.ready_head = EMPTY_ARRAY, 0
    new.waiting, new.waiting_size = EMPTY_ARRAY, 0
    new.n_ready = new.n_waiting = new.queued = 0
    new.weight = 0.0
    new.drained = state.drained + len(out)
    new.__class__ = Lanes
    return new, out


def next_deadline(state: Lanes[Any, Any]) -> float | None:
    """The earliest deadline of a WAITING lane, or None if none waits. O(1)."""
    if state.waiting_size:
        deadline: float = state.waiting[0][0]
        return deadline
    return None


def check_invariants(state: Lanes[Any, Any]) -> None:
    """Assert every invariant of the room; AssertionError names the first broken one. O(n)."""
    assert type(state) is Lanes, "a draft of the room escaped its transition"
    limits = state.limits
    queued = busy = 0
    weight = 0.0
    n_ready = n_waiting = 0
    for key, lane in state.lanes.items():
        assert type(lane) is Lane, f"{key!r}: a draft of its lane escaped a transition"
        items = lane.items()
        assert lane.count == len(items), f"{key!r}: count {lane.count} != {len(items)} items"
        lane_weight = sum(it.weight for it in items)
        assert math.isclose(lane.weight, lane_weight, abs_tol=1e-9), f"{key!r}: lane weight"
        order = [(it.rank, it.seq) if lane.ranked else it.seq for it in items]
        assert order == sorted(order), f"{key!r}: items not in (rank, arrival) order"
        assert all((it.rank is None) != lane.ranked for it in items), f"{key!r}: mixed ranks"
        assert all(it.seq < state.seq for it in items), f"{key!r}: item from the future"
        if not lane.ranked:
            slots = list(fifo_iter(lane.fifo, lane.tail, lane.head))
            assert all(type(it) in (Item, Tombstone) for it in slots), f"{key!r}: bad fifo slot"
            assert len(lane.tail) < CHUNK, f"{key!r}: tail of a full chunk"
            assert all(len(chunk) == CHUNK for chunk in lane.fifo), f"{key!r}: partial chunk"
            assert lane.head <= (len(lane.fifo) << SHIFT) + len(lane.tail), f"{key!r}: head"
        assert lane.calls >= 0
        assert lane.count or lane.calls, f"{key!r}: empty idle lane kept"
        if limits.one_in_flight:
            assert lane.calls <= 1, f"{key!r}: {lane.calls} calls in flight"
            if lane.calls:
                assert lane.where == IDLE, f"{key!r}: busy lane is queued"
        if lane.count == 0:
            assert lane.where == IDLE, f"{key!r}: empty lane is queued"
        elif lane.calls == 0 or not limits.one_in_flight:
            assert lane.where in (READY, WAITING), f"{key!r}: lane with items not queued"
        if lane.where == WAITING:
            assert limits.max_batch_delay > 0, f"{key!r}: waiting with zero delay"
            assert lane.count < limits.max_batch_size, f"{key!r}: full lane waiting"
            assert lane.weight < limits.max_batch_weight, f"{key!r}: heavy lane waiting"
            oldest = min(it.submitted for it in items)
            assert lane.deadline <= oldest + limits.max_batch_delay, f"{key!r}: late deadline"
            n_waiting += 1
        elif lane.where == READY:
            n_ready += 1
        queued += lane.count
        weight += lane.weight
        busy += lane.calls
    assert state.queued == queued, f"queued {state.queued} != {queued}"
    assert math.isclose(state.weight, weight, abs_tol=1e-9), f"weight {state.weight} != {weight}"
    assert state.busy == busy, f"busy {state.busy} != {busy}"
    assert busy <= limits.max_in_flight, f"{busy} calls in flight, above {limits.max_in_flight}"
    assert state.n_ready == n_ready, f"n_ready {state.n_ready} != {n_ready}"
    assert state.n_waiting == n_waiting, f"n_waiting {state.n_waiting} != {n_waiting}"
    ready = state.ready_keys()
    assert len(ready) == len(set(ready)) == n_ready, "ready queue: duplicate or missing lane"
    waiting = state.waiting_keys()
    assert len(waiting) == len({k for _, k in waiting}) == n_waiting, "waiting: duplicate/missing"
    assert not set(ready) & {k for _, k in waiting}, "a lane both ready and waiting"
    for deadline, key in waiting:
        assert state.lanes[key].deadline == deadline, f"{key!r}: stale deadline entry"
    heap, size = state.waiting, state.waiting_size
    assert sorted(heap) == list(range(size)), "waiting: slots are not 0 to size - 1"
    for i in range(1, size):
        assert heap[(i - 1) >> 1] <= heap[i], "waiting: heap order broken"
    if size:
        assert waiting and waiting[0][0] == heap[0][0], "waiting: dead entry on top"
    assert all(state.ready_head <= i < state.ready_head + len(state.ready) for i in state.ready), (
        "ready: slots are not from its head on"
    )
    if state.closed:
        assert queued == 0 and not ready and not waiting, "inputs in a closed room"
    # The conservation equations of docs/guide.md ("Watching it"), from public numbers.
    assert state.submitted == (
        state.admitted + state.rejected + state.direct_calls + state.after_close
    ), "submitted calls not conserved"
    assert state.admitted == state.queued + state.inputs_sent + state.dropped + state.drained, (
        "admitted inputs not conserved"
    )
    assert sum(state.batch_sizes.values()) == state.batches
    assert sum(s * n for s, n in state.batch_sizes.items()) == state.inputs_sent
