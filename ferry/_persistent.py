"""The persistent structures the waiting room is built from: PURE, no trio, no clock.

`ferry._lanes` holds the room's records and transitions; this module holds the data structures
under them, each persistent (an update returns a new version and leaves the old one intact, so a
rerun transaction can start again from the value it read):

- the chunked FIFO of a rank-free lane: full chunks (tuples of `CHUNK` slots) in a `PVector`, a
  short `tail` tuple, and a head index kept by the lane;
- the treap of a ranked lane, keyed by `(rank, seq)`;
- the binary min-heap of waiting lanes, in the first `size` slots of a `PVector`;
- `OneLane`, the plain room's one-slot map, and `LaneMap`, what the transitions need of a map.

Why chunks and not one flat `PVector` for a lane: pvectorc's GC traversal visits every element,
so a young 100k-element vector made by each append costs about 1 ms in every gen-0 collection,
more than the admissions themselves at 100k waiting inputs. A young tail tuple costs nothing.
Why a treap for ranks: inserts anywhere and pops of the minimum in O(log n), persistent, with
deterministic priorities (so runs replay); the rank-free path never pays for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

import attrs
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


# ---- the waiting heap: a binary min-heap in the first `size` slots of a PVector ----------------


def heap_push(heap: PVector[Any], size: int, entry: Any) -> PVector[Any]:
    """O(log n); O(1) on average when entries arrive in order (the common case for deadlines)."""
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        above = heap[parent]
        if above <= entry:
            break
        heap = heap.set(i, above) if i < len(heap) else heap.append(above)
        i = parent
    return heap.set(i, entry) if i < len(heap) else heap.append(entry)


def heap_pop(heap: PVector[Any], size: int) -> PVector[Any]:
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


# ---- maps of lanes -------------------------------------------------------------------------------


class MapEvolver(Protocol[K, V]):
    def set(self, key: K, val: V) -> MapEvolver[K, V]: ...
    def remove(self, key: K) -> MapEvolver[K, V]: ...
    def persistent(self) -> LaneMap[K, V]: ...


class LaneMap(Protocol[K, V]):
    """What the transitions need of `Lanes.lanes`: a persistent map (a `PMap`, or `OneLane`)."""

    def get(self, key: K, /) -> V | None: ...
    def __getitem__(self, key: K, /) -> V: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[K]: ...
    def items(self) -> Iterable[tuple[K, V]]: ...
    def values(self) -> Iterable[V]: ...
    def set(self, key: K, val: V, /) -> LaneMap[K, V]: ...
    def remove(self, key: K, /) -> LaneMap[K, V]: ...
    def evolver(self) -> MapEvolver[K, V]: ...


class OneLane(Mapping[K, V]):
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

    def set(self, key: K, val: V) -> OneLane[K, V]:
        assert self._value is None or key == self._key, "the plain room has a single lane"
        return OneLane(key, val)

    def remove(self, key: K) -> OneLane[K, V]:
        if key not in self:
            raise KeyError(key)
        return OneLane()

    def evolver(self) -> _OneLaneEvolver[K, V]:
        return _OneLaneEvolver(self)

    def __repr__(self) -> str:
        return f"OneLane({dict(self.items())!r})"


class _OneLaneEvolver(Generic[K, V]):
    __slots__ = ("_map",)

    def __init__(self, lanes: OneLane[K, V]) -> None:
        self._map = lanes

    def set(self, key: K, val: V) -> _OneLaneEvolver[K, V]:
        self._map = self._map.set(key, val)
        return self

    def remove(self, key: K) -> _OneLaneEvolver[K, V]:
        self._map = self._map.remove(key)
        return self

    def persistent(self) -> OneLane[K, V]:
        return self._map
