"""The persistent structures the waiting room is built from: PURE, no trio, no clock.

`ferry._lanes` holds the room's records and transitions; this module holds the data structures
under them, each persistent (an update returns a new version and leaves the old one intact, so a
rerun transaction can start again from the value it read):

- the chunked FIFO of a rank-free lane: full chunks (tuples of `CHUNK` slots) in a `PVector`, a
  short `tail` tuple, and a head index kept by the lane;
- the treap of a ranked lane, keyed by `(rank, seq)`;
- `Array`s: an `immutables.Map` from int to value used as a persistent array, for the FIFO of
  ready lanes (from a head index on) and the binary min-heap of waiting lanes (slots 0 to size-1);
- `LaneMap`, what the transitions need of a map of lanes: an `immutables.Map` (a hash array
  mapped trie in C) for the per-key room, or `OneLane`, the plain room's one-slot map.

Why chunks and not one flat `PVector` for a lane: pvectorc's GC traversal visits every element,
so a young 100k-element vector made by each append costs about 1 ms in every gen-0 collection,
more than the admissions themselves at 100k waiting inputs. A young tail tuple costs nothing.
Why `immutables.Map` for the lanes (ADR 0030): a write costs about 0.5 us and copies only the
path to the key (a few nodes of at most 32 slots), so both its cost and what it leaves for the
next gen-0 collection stay flat up to any number of keys; a `PMap` rebuilds its bucket vector,
which a gen-0 collection then traverses, O(keys). The same holds for the queues of ready and
waiting lanes, which hold an entry per key: as a `PVector` of 100k entries, each new version
costs about 1 ms in the next gen-0 collection, so they are arrays over `immutables.Map` too.

Why a treap for ranks: inserts anywhere and pops of the minimum in O(log n), persistent, with
deterministic priorities (so runs replay); the rank-free path never pays for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

import attrs
import immutables
from pyrsistent import PVector, pvector

K = TypeVar("K")
V = TypeVar("V")

EMPTY_VECTOR: PVector[Any] = pvector()


# ---- the chunked FIFO of a rank-free lane: full chunks in a PVector, then a short tail tuple ----

SHIFT = 5
CHUNK = 1 << SHIFT  # slots per chunk


@attrs.frozen
class Tombstone:
    """What `cancel` leaves in a FIFO slot; keeps the arrival number for the binary search."""

    seq: int


def fifo_iter(fifo: PVector[Any], tail: tuple[Any, ...], start: int) -> Iterator[Any]:
    """The slots from logical index `start` on. O(1) to start, O(1) per slot."""
    c = start >> SHIFT
    n = len(fifo)
    if c < n:
        yield from fifo[c][start & (CHUNK - 1) :]
        for k in range(c + 1, n):
            yield from fifo[k]
        yield from tail
    else:
        yield from tail[start - (n << SHIFT) :]


def fifo_get(fifo: PVector[Any], tail: tuple[Any, ...], i: int) -> Any:
    """Slot `i`. O(log n)."""
    c = i >> SHIFT
    if c < len(fifo):
        return fifo[c][i & (CHUNK - 1)]
    return tail[i - (len(fifo) << SHIFT)]


def fifo_set(
    fifo: PVector[Any], tail: tuple[Any, ...], i: int, slot: Any
) -> tuple[PVector[Any], tuple[Any, ...]]:
    """Replace slot `i`. O(log n + CHUNK)."""
    c = i >> SHIFT
    if c < len(fifo):
        chunk, j = fifo[c], i & (CHUNK - 1)
        return fifo.set(c, (*chunk[:j], slot, *chunk[j + 1 :])), tail
    j = i - (len(fifo) << SHIFT)
    return fifo, (*tail[:j], slot, *tail[j + 1 :])


def fifo_trim(fifo: PVector[Any], head: int) -> tuple[PVector[Any], int]:
    """Drop the whole chunks before `head` once they are half the vector. Amortized O(1)."""
    k = head >> SHIFT
    if k and 2 * k >= len(fifo):
        return fifo[k:], head - (k << SHIFT)
    return fifo, head


def fifo_build(slots: list[Any]) -> tuple[PVector[Any], tuple[Any, ...]]:
    """A FIFO holding `slots`, from index 0. O(n)."""
    full = len(slots) >> SHIFT << SHIFT
    chunks = pvector([tuple(slots[k : k + CHUNK]) for k in range(0, full, CHUNK)])
    return chunks, tuple(slots[full:])


# ---- the treap of a ranked lane -----------------------------------------------------------------

# A node: (sort key (rank, seq), priority, item, left, right). A max-heap on priority.
Node = tuple[Any, int, Any, Any, Any]


def treap_priority(seq: int) -> int:
    """A deterministic pseudo-random priority for the item with arrival number `seq`."""
    return (seq * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF


def treap_insert(node: Node | None, key: Any, prio: int, item: Any) -> Node:
    """`node` with `item` under `key`. O(log n) expected."""
    if node is None:
        return (key, prio, item, None, None)
    nk, np, ni, left, right = node
    if key < nk:
        sub = treap_insert(left, key, prio, item)
        if sub[1] > np:
            return (sub[0], sub[1], sub[2], sub[3], (nk, np, ni, sub[4], right))
        return (nk, np, ni, sub, right)
    sub = treap_insert(right, key, prio, item)
    if sub[1] > np:
        return (sub[0], sub[1], sub[2], (nk, np, ni, left, sub[3]), sub[4])
    return (nk, np, ni, left, sub)


def _treap_merge(a: Node | None, b: Node | None) -> Node | None:
    if a is None:
        return b
    if b is None:
        return a
    if a[1] > b[1]:
        return (a[0], a[1], a[2], a[3], _treap_merge(a[4], b))
    return (b[0], b[1], b[2], _treap_merge(a, b[3]), b[4])


def treap_delete(node: Node | None, key: Any) -> tuple[Node | None, bool]:
    """`node` without `key`, and whether it was there. O(log n) expected."""
    if node is None:
        return None, False
    nk, np, ni, left, right = node
    if key == nk:
        return _treap_merge(left, right), True
    if key < nk:
        sub, found = treap_delete(left, key)
        return ((nk, np, ni, sub, right) if found else node), found
    sub, found = treap_delete(right, key)
    return ((nk, np, ni, left, sub) if found else node), found


def treap_min(node: Node) -> Any:
    """The item with the smallest key of a non-empty treap. O(log n) expected."""
    while node[3] is not None:
        node = node[3]
    return node[2]


def treap_pop_min(node: Node) -> tuple[Any, Node | None]:
    """The smallest item and the treap without it. O(log n) expected."""
    nk, np, ni, left, right = node
    if left is None:
        return ni, right
    item, sub = treap_pop_min(left)
    return item, (nk, np, ni, sub, right)


def treap_iter(node: Node | None) -> Iterator[Any]:
    """The items in key order. O(n)."""
    while node is not None:
        yield from treap_iter(node[3])
        yield node[2]
        node = node[4]


# ---- arrays: the FIFO of ready lanes and the heap of waiting lanes -------------------------------

# A persistent array: slot index -> value. A write copies the path to one slot (a few nodes of
# at most 32 entries), so neither its cost nor its garbage grows with the length.
Array = immutables.Map

EMPTY_ARRAY: Array[int, Any] = immutables.Map()


def queue_push(queue: Array[int, Any], head: int, entry: Any) -> Array[int, Any]:
    """Append `entry` to a FIFO that holds its slots from `head` on. O(log32 n)."""
    return queue.set(head + len(queue), entry)


def queue_drop(queue: Array[int, Any], head: int, new_head: int) -> Array[int, Any]:
    """Forget the slots from `head` to `new_head` (exclusive), already consumed. O(k log32 n)."""
    if new_head == head + 1:
        return queue.delete(head)
    mutation = queue.mutate()
    for i in range(head, new_head):
        del mutation[i]
    return mutation.finish()


def queue_iter(queue: Array[int, Any], head: int) -> Iterator[Any]:
    """The slots in FIFO order. O(n)."""
    for i in range(head, head + len(queue)):
        yield queue[i]


def heap_push(heap: Array[int, Any], size: int, entry: Any) -> Array[int, Any]:
    """O(log n); O(1) on average when entries arrive in order (the common case for deadlines)."""
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        above = heap[parent]
        if above <= entry:
            break
        heap = heap.set(i, above)
        i = parent
    return heap.set(i, entry)


def heap_pop(heap: Array[int, Any], size: int) -> Array[int, Any]:
    """Remove the top of a non-empty heap of `size` entries. O(log n)."""
    last = size - 1
    moved = heap[last]
    heap = heap.delete(last)
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


# ---- maps of lanes -------------------------------------------------------------------------------


class MapMutation(Protocol[K, V]):
    """Several writes to a persistent map at once (`immutables.MapMutation`)."""

    def set(self, key: K, val: V, /) -> None: ...
    def __delitem__(self, key: K, /) -> None: ...
    def finish(self) -> LaneMap[K, V]: ...


class LaneMap(Protocol[K, V]):
    """What the transitions need of `Lanes.lanes`: `immutables.Map`'s interface (or `OneLane`)."""

    def get(self, key: K, /) -> V | None: ...
    def __getitem__(self, key: K, /) -> V: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[K]: ...
    def items(self) -> Iterable[tuple[K, V]]: ...
    def values(self) -> Iterable[V]: ...
    def set(self, key: K, val: V, /) -> LaneMap[K, V]: ...
    def delete(self, key: K, /) -> LaneMap[K, V]: ...
    def mutate(self) -> MapMutation[K, V]: ...


_new_object = object.__new__


class OneLane(Mapping[K, V]):
    """The plain room's `lanes`: it never holds more than its one lane.

    Same interface as the `immutables.Map` of the per-key room, for less: the plain room writes
    its lane on every admission. Persistent: `set` and `delete` return a new map. O(1)
    everything.
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

    def set(self, key: K, val: V) -> OneLane[K, V]:
        assert self._value is None or key == self._key, "the plain room has a single lane"
        new: OneLane[K, V] = _new_object(OneLane)  # no __init__ frame: once per admission
        new._key = key
        new._value = val
        return new

    def delete(self, key: K) -> OneLane[K, V]:
        if key not in self:
            raise KeyError(key)
        return OneLane()

    def mutate(self) -> _OneLaneMutation[K, V]:
        return _OneLaneMutation(self)

    def __repr__(self) -> str:
        return f"OneLane({dict(self.items())!r})"


class _OneLaneMutation(Generic[K, V]):
    __slots__ = ("_map",)

    def __init__(self, lanes: OneLane[K, V]) -> None:
        self._map = lanes

    def set(self, key: K, val: V) -> None:
        self._map = self._map.set(key, val)

    def __delitem__(self, key: K) -> None:
        self._map = self._map.delete(key)

    def finish(self) -> OneLane[K, V]:
        return self._map
