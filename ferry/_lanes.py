"""The waiting room of a ferry: one immutable value and the pure transitions on it.

PURE: this module never imports trio, never reads a clock and does no I/O. Time comes in as the
`now` argument. The trio shell applies each transition in exactly one `stm` transaction on one
TVar; the model check (tests/model/) explores every interleaving of them.

State (`Lanes`, the root value)
-------------------------------
- `lanes`: key -> `Lane`, for every key with inputs waiting or a call in flight, and no other.
- `ready`: FIFO of lanes that can be taken. A `PVector` of `(stamp, key)` plus a head index.
- `waiting`: lanes with a partial batch, by deadline. A binary min-heap of
  `(deadline, stamp, key)` kept in a `PVector` (the first `waiting_size` slots; the rest are None).
- `queued`, `weight`: inputs waiting (not in flight) and their total weight, over all lanes.
- `busy`: calls in flight (batches and direct calls); always the sum of `Lane.calls`.
- counters for statistics, all plain fields of the root (`submitted`, `admitted`, ...).

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
- A lane of inputs with no rank (the common case) is a chunked FIFO: a `PVector` of full chunks
  (tuples of 32 slots), a `tail` tuple of fewer than 32, and a head index. Admitting copies the
  small tail (and appends it as a chunk when full), taking a prefix only moves the head (whole
  consumed chunks are dropped once they are half the vector), and cancelling replaces the slot
  with a tombstone (found by binary search on the arrival sequence). Why chunks and not one flat
  `PVector`: the C vector's GC traversal visits every element, so a young 100k-element vector
  made by each append cost about 1 ms in every gen-0 collection, more than the admissions
  themselves at 100k waiting inputs. A young tail tuple costs nothing. Ranked lanes use a small
  persistent treap keyed by `(rank, seq)`; the rank-free path never pays for it.
- The root and `Lane` are attrs frozen records without slots, so a transition can copy one dict
  and change a few entries (`_evolve`, about 0.4 us for the root instead of 3 us for
  `attrs.evolve`); items are slotted records created once per input.
- Float weights are summed incrementally; the room resets its weight to exactly 0.0 whenever it is
  empty, and `check_invariants` compares sums with a tolerance.

The plain ferry is the same core with `one_in_flight=False` and a single key, so its lane may be
queued while batches from it are in flight; its `lanes` is a one-slot `_OneLane` map instead of a
`PMap` (same interface, no 1.3 us `PMap.set` per admission).

Open question: a lane's deadline is not postponed when its oldest input is cancelled (it may be
taken a little early, never late).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

import attrs
from pyrsistent import PMap, PVector, pmap, pvector

K = TypeVar("K")
V = TypeVar("V")
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

_EMPTY_VECTOR: PVector[Any] = pvector()
_SHIFT = 5
_CHUNK = 1 << _SHIFT  # slots per chunk of a rank-free lane's FIFO
_new = object.__new__
_set_dict = object.__setattr__


class Admission(enum.Enum):
    """The outcome of `admit`, in the order the rules are tried."""

    CLOSED = "closed"
    CLAIMED = "claimed"
    ADMITTED = "admitted"
    REJECTED = "rejected"


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

    def __attrs_post_init__(self) -> None:
        assert self.max_batch_size >= 1
        assert self.max_batch_weight > 0
        assert self.max_batch_delay >= 0
        assert self.max_queueing >= 0
        assert self.max_queued_weight >= 0
        assert not (self.direct_calls and not self.one_in_flight), "direct calls are per-key only"


@attrs.frozen
class Item(Generic[E]):
    """One caller's input: its entry (opaque to the core), weight, submission time, rank, seq."""

    entry: E
    weight: float
    submitted: float
    rank: Any
    seq: int


@attrs.frozen
class _Dropped:
    """Tombstone left in a rank-free lane by `cancel`; keeps the seq for the binary search."""

    seq: int


@attrs.frozen
class Batch(Generic[K, E]):
    """What `take` hands to a worker: a key and its items, never empty."""

    key: K
    items: tuple[Item[E], ...]


# A treap node: (sort key (rank, seq), priority, item, left, right). Max-heap on priority.
_Node = tuple[Any, int, Item[Any], Any, Any]


def _priority(seq: int) -> int:
    return (seq * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF


def _t_insert(node: _Node | None, key: Any, prio: int, item: Item[Any]) -> _Node:
    if node is None:
        return (key, prio, item, None, None)
    nk, np, ni, left, right = node
    if key < nk:
        sub = _t_insert(left, key, prio, item)
        if sub[1] > np:
            return (sub[0], sub[1], sub[2], sub[3], (nk, np, ni, sub[4], right))
        return (nk, np, ni, sub, right)
    sub = _t_insert(right, key, prio, item)
    if sub[1] > np:
        return (sub[0], sub[1], sub[2], (nk, np, ni, left, sub[3]), sub[4])
    return (nk, np, ni, left, sub)


def _t_merge(a: _Node | None, b: _Node | None) -> _Node | None:
    if a is None:
        return b
    if b is None:
        return a
    if a[1] > b[1]:
        return (a[0], a[1], a[2], a[3], _t_merge(a[4], b))
    return (b[0], b[1], b[2], _t_merge(a, b[3]), b[4])


def _t_delete(node: _Node | None, key: Any) -> tuple[_Node | None, bool]:
    if node is None:
        return None, False
    nk, np, ni, left, right = node
    if key == nk:
        return _t_merge(left, right), True
    if key < nk:
        sub, found = _t_delete(left, key)
        return ((nk, np, ni, sub, right) if found else node), found
    sub, found = _t_delete(right, key)
    return ((nk, np, ni, left, sub) if found else node), found


def _t_min(node: _Node) -> Item[Any]:
    while node[3] is not None:
        node = node[3]
    return node[2]


def _t_pop_min(node: _Node) -> tuple[Item[Any], _Node | None]:
    nk, np, ni, left, right = node
    if left is None:
        return ni, right
    item, sub = _t_pop_min(left)
    return item, (nk, np, ni, sub, right)


def _t_iter(node: _Node | None) -> Iterator[Item[Any]]:
    while node is not None:
        yield from _t_iter(node[3])
        yield node[2]
        node = node[4]


@attrs.frozen(slots=False)
class Lane(Generic[E]):
    """One key's inputs in ascending (rank, arrival) order, and its state.

    `where` is IDLE, WAITING or READY; `calls` counts calls in flight for this key (0 or 1 with
    the per-key guard); `deadline` is meaningful while WAITING; `stamp` identifies the lane's live
    entry in `ready` or `waiting`. Rank-free lanes keep their slots (items and tombstones) from
    logical index `head` on in the chunked FIFO `fifo` + `tail` (see the module comment);
    ranked lanes keep the treap `tree`. `count` and `weight` are over live items only.
    """

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
            return list(_t_iter(self.tree))
        return [it for it in _f_iter(self.fifo, self.tail, self.head) if type(it) is not _Dropped]


class _MapEvolver(Protocol[K, V]):
    def set(self, key: K, val: V) -> _MapEvolver[K, V]: ...
    def remove(self, key: K) -> _MapEvolver[K, V]: ...
    def persistent(self) -> LaneMap[K, V]: ...


class LaneMap(Protocol[K, V]):
    """What the transitions need of `Lanes.lanes`: a persistent map (a `PMap`, or `_OneLane`)."""

    def get(self, key: K, /) -> V | None: ...
    def __getitem__(self, key: K, /) -> V: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[K]: ...
    def items(self) -> Iterable[tuple[K, V]]: ...
    def values(self) -> Iterable[V]: ...
    def set(self, key: K, val: V, /) -> LaneMap[K, V]: ...
    def remove(self, key: K, /) -> LaneMap[K, V]: ...
    def evolver(self) -> _MapEvolver[K, V]: ...


class _OneLane(Mapping[K, V]):
    """The plain room's `lanes`: it never holds more than its one lane.

    Same interface as the `PMap` of the per-key room, without its cost: a `PMap.set` is about
    1.3 us of pure Python and the plain room pays one on every admission. Persistent like a
    `PMap`: `set` and `remove` return a new map. O(1) everything.
    """

    __slots__ = ("_key", "_value")

    def __init__(self, key: Any = None, value: V | None = None) -> None:
        self._key = key
        self._value = value

    def get(self, key: K, default: Any = None) -> Any:
        value = self._value
        if value is not None and key == self._key:
            return value
        return default

    def __getitem__(self, key: K) -> V:
        value = self._value
        if value is None or key != self._key:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return self._value is not None and key == self._key

    def __len__(self) -> int:
        return 0 if self._value is None else 1

    def __iter__(self) -> Iterator[K]:
        if self._value is not None:
            yield self._key

    def set(self, key: K, val: V) -> _OneLane[K, V]:
        assert self._value is None or key == self._key, "the plain room has a single lane"
        return _OneLane(key, val)

    def remove(self, key: K) -> _OneLane[K, V]:
        if key not in self:
            raise KeyError(key)
        return _OneLane()

    def evolver(self) -> _OneLaneEvolver[K, V]:
        return _OneLaneEvolver(self)

    def __repr__(self) -> str:
        return f"_OneLane({dict(self.items())!r})"


class _OneLaneEvolver(Generic[K, V]):
    __slots__ = ("_map",)

    def __init__(self, lanes: _OneLane[K, V]) -> None:
        self._map = lanes

    def set(self, key: K, val: V) -> _OneLaneEvolver[K, V]:
        self._map = self._map.set(key, val)
        return self

    def remove(self, key: K) -> _OneLaneEvolver[K, V]:
        self._map = self._map.remove(key)
        return self

    def persistent(self) -> _OneLane[K, V]:
        return self._map


@attrs.frozen(slots=False)
class Lanes(Generic[K, E]):
    """The whole waiting room: one immutable value. See the module comment for each field."""

    limits: Limits
    lanes: LaneMap[K, Lane[E]]
    ready: PVector[tuple[int, K]]
    ready_head: int
    waiting: PVector[Any]
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
    direct_calls: int
    batches: int
    inputs_sent: int
    failed_batches: int
    dropped: int
    drained: int
    batch_sizes: PMap[int, int]

    def ready_keys(self) -> list[K]:
        """Keys of the READY lanes, first come first. O(len(ready))."""
        lanes = self.lanes
        out = []
        for stamp, key in self.ready[self.ready_head :]:
            lane = lanes.get(key)
            if lane is not None and lane.stamp == stamp and lane.where == READY:
                out.append(key)
        return out

    def waiting_keys(self) -> list[tuple[float, K]]:
        """(deadline, key) of the WAITING lanes, earliest first. O(n log n)."""
        lanes = self.lanes
        out = []
        for entry in self.waiting[: self.waiting_size]:
            deadline, stamp, key = entry
            lane = lanes.get(key)
            if lane is not None and lane.stamp == stamp and lane.where == WAITING:
                out.append((deadline, stamp, key))
        out.sort(key=lambda e: (e[0], e[1]))
        return [(d, k) for d, _, k in out]


def _evolve(old: R, changes: dict[str, Any]) -> R:
    """A copy of the frozen record `old` with `changes`: one dict copy (the hand-written evolve)."""
    d = old.__dict__.copy()
    d.update(changes)
    new = _new(type(old))
    _set_dict(new, "__dict__", d)
    return new


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
    new = _new(Lane)
    _set_dict(
        new,
        "__dict__",
        {
            "ranked": ranked,
            "fifo": fifo,
            "tail": tail,
            "head": head,
            "tree": tree,
            "count": count,
            "weight": weight,
            "where": where,
            "calls": calls,
            "deadline": deadline,
            "stamp": stamp,
        },
    )
    return new


def empty(limits: Limits) -> Lanes[Any, Any]:
    """A new, open, empty room. O(1)."""
    return Lanes(
        limits=limits,
        lanes=pmap() if limits.one_in_flight else _OneLane(),
        ready=_EMPTY_VECTOR,
        ready_head=0,
        waiting=_EMPTY_VECTOR,
        waiting_size=0,
        queued=0,
        weight=0.0,
        busy=0,
        closed=False,
        seq=0,
        n_ready=0,
        n_waiting=0,
        submitted=0,
        admitted=0,
        rejected=0,
        direct_calls=0,
        batches=0,
        inputs_sent=0,
        failed_batches=0,
        dropped=0,
        drained=0,
        batch_sizes=pmap(),
    )


# ---- the chunked FIFO of a rank-free lane: full chunks in a PVector, then a short tail tuple ----


def _f_iter(fifo: PVector[Any], tail: tuple[Any, ...], start: int) -> Iterator[Any]:
    """The slots from logical index `start` on. O(1) to start, O(1) per slot."""
    c = start >> _SHIFT
    n = len(fifo)
    if c < n:
        yield from fifo[c][start & (_CHUNK - 1) :]
        for k in range(c + 1, n):
            yield from fifo[k]
        yield from tail
    else:
        yield from tail[start - (n << _SHIFT) :]


def _f_get(fifo: PVector[Any], tail: tuple[Any, ...], i: int) -> Any:
    """Slot `i`. O(log n)."""
    c = i >> _SHIFT
    if c < len(fifo):
        return fifo[c][i & (_CHUNK - 1)]
    return tail[i - (len(fifo) << _SHIFT)]


def _f_set(
    fifo: PVector[Any], tail: tuple[Any, ...], i: int, slot: Any
) -> tuple[PVector[Any], tuple[Any, ...]]:
    """Replace slot `i`. O(log n + chunk)."""
    c = i >> _SHIFT
    if c < len(fifo):
        chunk, j = fifo[c], i & (_CHUNK - 1)
        return fifo.set(c, (*chunk[:j], slot, *chunk[j + 1 :])), tail
    j = i - (len(fifo) << _SHIFT)
    return fifo, (*tail[:j], slot, *tail[j + 1 :])


def _f_trim(fifo: PVector[Any], head: int) -> tuple[PVector[Any], int]:
    """Drop the whole chunks before `head` once they are half the vector. Amortized O(1)."""
    k = head >> _SHIFT
    if k and 2 * k >= len(fifo):
        return fifo[k:], head - (k << _SHIFT)
    return fifo, head


def _f_build(slots: list[Any]) -> tuple[PVector[Any], tuple[Any, ...]]:
    """A FIFO holding `slots`. O(n)."""
    full = len(slots) >> _SHIFT << _SHIFT
    chunks = pvector([tuple(slots[k : k + _CHUNK]) for k in range(0, full, _CHUNK)])
    return chunks, tuple(slots[full:])


# ---- the waiting heap: a binary min-heap in the first `size` slots of a PVector ----------------


def _heap_push(heap: PVector[Any], size: int, entry: Any) -> PVector[Any]:
    """O(log n); O(1) on average when deadlines arrive in order (the common case)."""
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        above = heap[parent]
        if above <= entry:
            break
        heap = heap.set(i, above) if i < len(heap) else heap.append(above)
        i = parent
    return heap.set(i, entry) if i < len(heap) else heap.append(entry)


def _heap_pop(heap: PVector[Any], size: int) -> PVector[Any]:
    """Remove the top of a non-empty heap of `size` entries. O(log n)."""
    last = size - 1
    moved = heap[last]
    # Shrink the spare slots at a quarter full: O(n) once per n pops.
    heap = heap[:last] if last > 64 and last * 4 < len(heap) else heap.set(last, None)
    if last == 0:
        return heap
    i = 0
    while True:
        child = 2 * i + 1
        if child >= last:
            break
        right = child + 1
        if right < last and heap[right] < heap[child]:
            child = right
        below = heap[child]
        if below >= moved:
            break
        heap = heap.set(i, below)
        i = child
    return heap.set(i, moved)


def _purge(heap: PVector[Any], size: int, lanes: Any) -> tuple[PVector[Any], int]:
    """Pop dead entries off the top of `waiting` until the top is live. O(d log n) for d dead."""
    while size:
        _, stamp, key = heap[0]
        lane = lanes.get(key)
        if lane is not None and lane.stamp == stamp and lane.where == WAITING:
            break
        heap = _heap_pop(heap, size)
        size -= 1
    return heap, size


def _oldest(lane: Lane[Any]) -> float:
    """The earliest submission time among a lane's live items. O(physical items)."""
    if lane.ranked:
        return min(it.submitted for it in _t_iter(lane.tree))
    items = [it for it in _f_iter(lane.fifo, lane.tail, lane.head) if type(it) is not _Dropped]
    oldest: float = min(it.submitted for it in items)
    return oldest


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
    """Admission of one input (SPEC 2.3): CLOSED, CLAIMED, ADMITTED or REJECTED, in that order.

    `submitted` always counts; `admitted`, `rejected` or `direct_calls` per outcome. CLAIMED makes
    a busy lane with no items for `key` (the caller makes a direct call, then `release`s). Only
    ADMITTED returns the new `Item` (keep it to `cancel`). `rank=None` orders by arrival; a lane
    holds either rank-free or ranked items, not both. Never raises on a valid state.

    Cost: O(log n) in waiting inputs (one PMap write, one PVector append or one treap insert, at
    most one heap push); amortized O(1) extra for dead heap tops.
    """
    limits = state.limits
    if state.closed:
        return _evolve(state, {"submitted": state.submitted + 1}), Admission.CLOSED, None
    lanes = state.lanes
    lane = lanes.get(key)
    if lane is None and limits.direct_calls and limits.max_batch_delay == 0:
        return _claim(state, key, 1), Admission.CLAIMED, None
    new_weight = state.weight + weight
    if state.queued >= limits.max_queueing or new_weight > limits.max_queued_weight:
        counts = {"submitted": state.submitted + 1, "rejected": state.rejected + 1}
        return _evolve(state, counts), Admission.REJECTED, None

    seq = state.seq
    item: Item[E] = Item(entry, weight, now, rank, seq)
    changes: dict[str, Any] = {
        "submitted": state.submitted + 1,
        "admitted": state.admitted + 1,
        "queued": state.queued + 1,
        "weight": new_weight,
        "seq": seq + 1,
    }
    if lane is None or lane.count == 0:
        ranked = rank is not None
        calls = 0 if lane is None else lane.calls
        tail: tuple[Any, ...]
        if ranked:
            tail, tree = (), (((rank, seq), _priority(seq), item, None, None))
        else:
            tail, tree = (item,), None
        if calls and limits.one_in_flight:
            new_lane = _lane(
                ranked, _EMPTY_VECTOR, tail, 0, tree, 1, weight, IDLE, calls, math.inf, 0
            )
        else:
            deadline = now + limits.max_batch_delay
            where, stamp = _queue_new(state, changes, key, weight, deadline)
            new_lane = _lane(
                ranked, _EMPTY_VECTOR, tail, 0, tree, 1, weight, where, calls, deadline, stamp
            )
    else:
        assert lane.ranked == (rank is not None), "a lane holds ranked or rank-free items, not both"
        d = lane.__dict__.copy()
        if lane.ranked:
            d["tree"] = _t_insert(lane.tree, (rank, seq), _priority(seq), item)
        else:
            tail = lane.tail
            if len(tail) < _CHUNK - 1:
                d["tail"] = (*tail, item)
            else:
                d["fifo"], d["tail"] = lane.fifo.append((*tail, item)), ()
        count = d["count"] = lane.count + 1
        lane_weight = d["weight"] = lane.weight + weight
        if lane.where == WAITING:
            deadline = now + limits.max_batch_delay
            if count >= limits.max_batch_size or lane_weight >= limits.max_batch_weight:
                seq += 1
                d["stamp"] = seq
                d["where"] = READY
                changes["ready"] = state.ready.append((seq, key))
                changes["n_ready"] = state.n_ready + 1
                changes["n_waiting"] = state.n_waiting - 1
                changes["seq"] = seq + 1
                changes["_dirty"] = True
            elif deadline < lane.deadline:
                seq += 1
                d["stamp"] = seq
                d["deadline"] = deadline
                changes["waiting"] = _heap_push(
                    state.waiting, state.waiting_size, (deadline, seq, key)
                )
                changes["waiting_size"] = state.waiting_size + 1
                changes["seq"] = seq + 1
                changes["_dirty"] = True
        new_lane = _new(Lane)
        _set_dict(new_lane, "__dict__", d)
    changes["lanes"] = lanes.set(key, new_lane)
    if changes.pop("_dirty", False):
        changes["waiting"], changes["waiting_size"] = _purge(
            changes.get("waiting", state.waiting),
            changes.get("waiting_size", state.waiting_size),
            changes["lanes"],
        )
    return _evolve(state, changes), Admission.ADMITTED, item


def _queue_new(
    state: Lanes[Any, Any], changes: dict[str, Any], key: Any, weight: float, deadline: float
) -> tuple[int, int]:
    """Queue a lane that just got its first input: READY if due or full, else WAITING.

    Returns the lane's new (where, stamp). O(1) on average, O(log n) at worst.
    """
    limits = state.limits
    stamp = changes["seq"]
    changes["seq"] = stamp + 1
    if (
        limits.max_batch_delay == 0
        or limits.max_batch_size == 1
        or weight >= limits.max_batch_weight
    ):
        changes["ready"] = state.ready.append((stamp, key))
        changes["n_ready"] = state.n_ready + 1
        return READY, stamp
    changes["waiting"] = _heap_push(state.waiting, state.waiting_size, (deadline, stamp, key))
    changes["waiting_size"] = state.waiting_size + 1
    changes["n_waiting"] = state.n_waiting + 1
    return WAITING, stamp


def _claim(state: Lanes[K, E], key: K, submitted: int) -> Lanes[K, E]:
    lane = _lane(False, _EMPTY_VECTOR, (), 0, None, 0, 0.0, IDLE, 1, math.inf, 0)
    return _evolve(
        state,
        {
            "lanes": state.lanes.set(key, lane),
            "busy": state.busy + 1,
            "direct_calls": state.direct_calls + 1,
            "submitted": state.submitted + submitted,
        },
    )


def claim(state: Lanes[K, E], key: K) -> Lanes[K, E]:
    """Claim an idle key for a direct call: a busy lane with no items; counts `direct_calls`.

    The key must have no lane and the room must be open (AssertionError otherwise). `admit` does
    this itself for CLAIMED; this is the branch alone, for the model. O(log n).
    """
    assert not state.closed and key not in state.lanes
    return _claim(state, key, 0)


def _requeue(
    state: Lanes[Any, Any],
    d: dict[str, Any],
    changes: dict[str, Any],
    key: Any,
    now: float,
) -> None:
    """Queue the lane in `d` (which has items, is IDLE): tail of READY if due or full, else WAITING.

    O(log n), plus O(b) to find the oldest of a partial remainder of b < max_batch_size items.
    """
    limits = state.limits
    seq = changes.get("seq", state.seq)
    changes["seq"] = seq + 1
    d["stamp"] = seq
    full = d["count"] >= limits.max_batch_size or d["weight"] >= limits.max_batch_weight
    deadline = -math.inf
    if not full and limits.max_batch_delay > 0:
        probe = _new(Lane)
        _set_dict(probe, "__dict__", d)
        deadline = _oldest(probe) + limits.max_batch_delay
    if full or deadline <= now:
        d["where"] = READY
        changes["ready"] = changes.get("ready", state.ready).append((seq, key))
        changes["n_ready"] = changes.get("n_ready", state.n_ready) + 1
    else:
        d["where"] = WAITING
        d["deadline"] = deadline
        size = changes.get("waiting_size", state.waiting_size)
        changes["waiting"] = _heap_push(
            changes.get("waiting", state.waiting), size, (deadline, seq, key)
        )
        changes["waiting_size"] = size + 1
        changes["n_waiting"] = changes.get("n_waiting", state.n_waiting) + 1


def take(state: Lanes[K, E], now: float) -> tuple[Lanes[K, E], Batch[K, E] | None]:
    """Promote due lanes, then take the first READY lane's batch; None if nothing is ready.

    A batch is the lane's longest prefix within `max_batch_size` and `max_batch_weight`, at
    least one input, tombstones skipped. The lane becomes busy (with the per-key guard: IDLE
    until `release`; without it, the rest is queued again at once). Counts `batches`,
    `inputs_sent` and `batch_sizes`. Returns `state` itself (no write) when nothing changed.

    Cost: O(b + (p + 1) log n) for a batch of b inputs and p lanes promoted; dead queue entries
    skipped on the way are paid for by whoever killed them.
    """
    limits = state.limits
    lanes = state.lanes
    heap, size = state.waiting, state.waiting_size
    changes: dict[str, Any] = {}
    updated: dict[K, Lane[E]] = {}  # lanes promoted in this call, written once at the end
    if size and heap[0][0] <= now:
        ready = state.ready
        n_ready, n_waiting, seq = state.n_ready, state.n_waiting, state.seq
        while size and heap[0][0] <= now:
            _, stamp, key = heap[0]
            heap = _heap_pop(heap, size)
            size -= 1
            lane = lanes.get(key)  # a dead entry never matches, even for a lane promoted here
            if lane is not None and lane.stamp == stamp and lane.where == WAITING:
                d = lane.__dict__.copy()
                d["where"] = READY
                d["stamp"] = seq
                ready = ready.append((seq, key))
                seq += 1
                n_ready += 1
                n_waiting -= 1
                promoted = _new(Lane)
                _set_dict(promoted, "__dict__", d)
                updated[key] = promoted
        changes.update(
            ready=ready,
            n_ready=n_ready,
            n_waiting=n_waiting,
            seq=seq,
            waiting=heap,
            waiting_size=size,
        )
        heap, size = _purge(heap, size, lanes)
        changes["waiting"], changes["waiting_size"] = heap, size
    if not changes.get("n_ready", state.n_ready):
        if not changes:
            return state, None
        changes["lanes"] = _write(lanes, updated)
        return _evolve(state, changes), None

    # Find the first live READY entry.
    ready = changes.get("ready", state.ready)
    head = state.ready_head
    while True:
        stamp, key = ready[head]
        head += 1
        lane = updated.get(key) or lanes.get(key)
        if lane is not None and lane.stamp == stamp and lane.where == READY:
            break
    if head >= 32 and head * 2 >= len(ready):
        ready = ready[head:]  # compaction: O(n) once per n/2 takes
        head = 0
    changes["ready"] = ready
    changes["ready_head"] = head

    max_size, max_weight = limits.max_batch_size, limits.max_batch_weight
    out: list[Item[E]] = []
    total = 0.0
    d = lane.__dict__.copy()
    if lane.ranked:
        tree = lane.tree
        while tree is not None and len(out) < max_size:
            first = _t_min(tree)
            if out and total + first.weight > max_weight:
                break
            _, tree = _t_pop_min(tree)
            out.append(first)
            total += first.weight
        d["tree"] = tree
    else:
        fifo, tail = lane.fifo, lane.tail
        i = lane.head
        for it in _f_iter(fifo, tail, i):
            if type(it) is _Dropped:
                i += 1
                continue
            if len(out) >= max_size or (out and total + it.weight > max_weight):
                break
            out.append(it)
            total += it.weight
            i += 1
        d["fifo"], d["head"] = _f_trim(fifo, i)
    taken = len(out)
    count = d["count"] = lane.count - taken
    if count == 0:
        d.update(fifo=_EMPTY_VECTOR, tail=(), head=0, tree=None, weight=0.0)
    else:
        d["weight"] = lane.weight - total
    d["where"] = IDLE
    d["calls"] = lane.calls + 1
    changes["n_ready"] = changes.get("n_ready", state.n_ready) - 1
    if count and not limits.one_in_flight:
        _requeue(state, d, changes, key, now)
    new_lane = _new(Lane)
    _set_dict(new_lane, "__dict__", d)
    updated[key] = new_lane
    queued = state.queued - taken
    changes.update(
        lanes=_write(lanes, updated),
        queued=queued,
        weight=state.weight - total if queued else 0.0,
        busy=state.busy + 1,
        batches=state.batches + 1,
        inputs_sent=state.inputs_sent + taken,
        batch_sizes=state.batch_sizes.set(taken, state.batch_sizes.get(taken, 0) + 1),
    )
    return _evolve(state, changes), Batch(key, tuple(out))


def _write(lanes: LaneMap[K, Lane[E]], updated: dict[K, Lane[E]]) -> LaneMap[K, Lane[E]]:
    """`lanes` with the `updated` entries: a plain set for one, one evolver for several."""
    if len(updated) == 1:
        ((key, lane),) = updated.items()
        return lanes.set(key, lane)
    if not updated:
        return lanes
    evolver = lanes.evolver()
    for key, lane in updated.items():
        evolver.set(key, lane)
    return evolver.persistent()


def release(state: Lanes[K, E], key: K, now: float, *, failed: bool = False) -> Lanes[K, E]:
    """The call for `key` (a batch or a direct call) is over: `busy -= 1`.

    With the per-key guard, the lane is then removed if empty, else queued at the tail of READY,
    or WAITING when only a partial batch is left and its deadline is ahead. Without the guard the
    lane is only removed when it is empty and has no call left. `failed` counts `failed_batches`.
    The key must have a call in flight (AssertionError otherwise).

    Cost: O(log n), plus O(b) to find the oldest input of a partial remainder of b inputs.
    """
    lane = state.lanes.get(key)
    assert lane is not None and lane.calls > 0, f"release of {key!r} with no call in flight"
    changes: dict[str, Any] = {"busy": state.busy - 1}
    if failed:
        changes["failed_batches"] = state.failed_batches + 1
    calls = lane.calls - 1
    if calls == 0 and lane.count == 0:
        changes["lanes"] = state.lanes.remove(key)
        return _evolve(state, changes)
    d = lane.__dict__.copy()
    d["calls"] = calls
    if lane.count and lane.where == IDLE and (calls == 0 or not state.limits.one_in_flight):
        _requeue(state, d, changes, key, now)
    new_lane = _new(Lane)
    _set_dict(new_lane, "__dict__", d)
    changes["lanes"] = state.lanes.set(key, new_lane)
    return _evolve(state, changes)


def cancel(state: Lanes[K, E], key: K, item: Item[E]) -> tuple[Lanes[K, E], bool]:
    """Drop one waiting input whose caller was cancelled.

    True if `item` was waiting in `key`'s lane and is now gone (counts `dropped`; `queued` and
    `weight` fall at once; an emptied idle lane is removed). False, and `state` itself, if it is
    not there any more (taken, drained, or never admitted). Does not postpone the lane's deadline.

    Cost: O(log n): a binary search on arrival order (rank-free) or a treap delete (ranked);
    rank-free lanes compact their tombstones when they outnumber the live items (amortized O(1)).
    """
    lane = state.lanes.get(key)
    if lane is None or lane.count == 0:
        return state, False
    d = lane.__dict__.copy()
    if lane.ranked:
        tree, found = _t_delete(lane.tree, (item.rank, item.seq))
        if not found:
            return state, False
        d["tree"] = tree
    else:
        fifo, tail = lane.fifo, lane.tail
        n = (len(fifo) << _SHIFT) + len(tail)
        lo, hi = lane.head, n
        seq = item.seq
        while lo < hi:
            mid = (lo + hi) >> 1
            if _f_get(fifo, tail, mid).seq < seq:
                lo = mid + 1
            else:
                hi = mid
        if lo == n or _f_get(fifo, tail, lo) is not item:
            return state, False
        fifo, tail = _f_set(fifo, tail, lo, _Dropped(seq))
        live = lane.count - 1
        if live and n - lane.head > 2 * live + _CHUNK:
            fifo, tail = _f_build([it for it in _f_iter(fifo, tail, lane.head) if type(it) is Item])
            d["head"] = 0
        d["fifo"], d["tail"] = fifo, tail
    count = d["count"] = lane.count - 1
    queued = state.queued - 1
    changes: dict[str, Any] = {
        "queued": queued,
        "weight": state.weight - item.weight if queued else 0.0,
        "dropped": state.dropped + 1,
    }
    if count == 0:
        if lane.where == READY:
            changes["n_ready"] = state.n_ready - 1
        elif lane.where == WAITING:
            changes["n_waiting"] = state.n_waiting - 1
        if lane.calls == 0:
            lanes = state.lanes.remove(key)
        else:
            d.update(fifo=_EMPTY_VECTOR, tail=(), head=0, tree=None, weight=0.0, where=IDLE)
            lanes = state.lanes.set(key, _evolve_lane(d))
        if lane.where == WAITING:
            changes["waiting"], changes["waiting_size"] = _purge(
                state.waiting, state.waiting_size, lanes
            )
    else:
        d["weight"] = lane.weight - item.weight
        lanes = state.lanes.set(key, _evolve_lane(d))
    changes["lanes"] = lanes
    return _evolve(state, changes), True


def _evolve_lane(d: dict[str, Any]) -> Lane[Any]:
    new = _new(Lane)
    _set_dict(new, "__dict__", d)
    return new


def drain(state: Lanes[K, E]) -> tuple[Lanes[K, E], list[Item[E]]]:
    """Close the room: `closed = True`, every waiting input removed and returned (lane by lane).

    Lanes with a call in flight stay, busy and empty, until released; every other lane goes.
    Idempotent. Cost: O(lanes + items).
    """
    out: list[Item[E]] = []
    lanes = state.lanes.evolver()
    for key, lane in state.lanes.items():
        if lane.count:
            out.extend(lane.items())
        if lane.calls:
            if lane.count or lane.where != IDLE:
                lanes.set(
                    key,
                    _lane(False, _EMPTY_VECTOR, (), 0, None, 0, 0.0, IDLE, lane.calls, math.inf, 0),
                )
        else:
            lanes.remove(key)
    return (
        _evolve(
            state,
            {
                "closed": True,
                "lanes": lanes.persistent(),
                "ready": _EMPTY_VECTOR,
                "ready_head": 0,
                "waiting": _EMPTY_VECTOR,
                "waiting_size": 0,
                "n_ready": 0,
                "n_waiting": 0,
                "queued": 0,
                "weight": 0.0,
                "drained": state.drained + len(out),
            },
        ),
        out,
    )


def next_deadline(state: Lanes[Any, Any]) -> float | None:
    """The earliest deadline of a WAITING lane, or None if none waits. O(1)."""
    if state.waiting_size:
        deadline: float = state.waiting[0][0]
        return deadline
    return None


def check_invariants(state: Lanes[Any, Any]) -> None:
    """Assert every invariant of the room; AssertionError names the first broken one. O(n)."""
    limits = state.limits
    queued = busy = 0
    weight = 0.0
    n_ready = n_waiting = 0
    for key, lane in state.lanes.items():
        items = lane.items()
        assert lane.count == len(items), f"{key!r}: count {lane.count} != {len(items)} items"
        lane_weight = sum(it.weight for it in items)
        assert math.isclose(lane.weight, lane_weight, abs_tol=1e-9), f"{key!r}: lane weight"
        order = [(it.rank, it.seq) if lane.ranked else it.seq for it in items]
        assert order == sorted(order), f"{key!r}: items not in (rank, arrival) order"
        assert all((it.rank is None) != lane.ranked for it in items), f"{key!r}: mixed ranks"
        assert all(it.seq < state.seq for it in items), f"{key!r}: item from the future"
        if not lane.ranked:
            slots = list(_f_iter(lane.fifo, lane.tail, lane.head))
            assert all(type(it) in (Item, _Dropped) for it in slots), f"{key!r}: bad fifo slot"
            assert len(lane.tail) < _CHUNK, f"{key!r}: tail of a full chunk"
            assert all(len(chunk) == _CHUNK for chunk in lane.fifo), f"{key!r}: partial chunk"
            assert lane.head <= (len(lane.fifo) << _SHIFT) + len(lane.tail), f"{key!r}: head"
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
    assert all(heap[i] is None for i in range(size, len(heap))), "waiting: junk past the end"
    for i in range(1, size):
        assert heap[(i - 1) >> 1] <= heap[i], "waiting: heap order broken"
    if size:
        assert waiting and waiting[0][0] == heap[0][0], "waiting: dead entry on top"
    assert 0 <= state.ready_head <= len(state.ready)
    if state.closed:
        assert queued == 0 and not ready and not waiting, "inputs in a closed room"
    assert state.admitted == state.queued + state.inputs_sent + state.dropped + state.drained, (
        "admitted inputs not conserved"
    )
    assert sum(state.batch_sizes.values()) == state.batches
    assert sum(s * n for s, n in state.batch_sizes.items()) == state.inputs_sent
