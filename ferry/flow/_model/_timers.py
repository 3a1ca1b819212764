"""The engine's park deadlines: a persistent min-heap of ``(deadline, flow_id, revision)``.

PURE: no trio, no clock. The engine keeps the heap in one `stm.TVar`; one timer task sleeps in
``retry(deadline=...)`` on its top. A parked flow costs one heap node and nothing else (no task,
no coroutine).

Why a leftist heap: it is persistent (every operation returns a new heap sharing most of the old
one, as a value in a TVar must be), its nodes are plain tuples (about 200 bytes per entry with
the entry itself), push and pop are O(log n), and a heap built from an already sorted list (the
store returns parked flows by deadline at open) is a chain made in O(n) with no merging.
Entries are never removed early: a flow woken before its deadline leaves its entry behind, and
when that entry comes up the timeout transition, armed for the park's revision, does nothing.

A node is ``(rank, entry, left, right)``; `rank` is the length of its right spine, and every
node's left child has a rank at least that of its right child.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeAlias

Entry: TypeAlias = tuple[float, str, int]  # (deadline, flow_id, revision)
Heap: TypeAlias = "tuple[int, Entry, Heap, Heap] | None"

EMPTY: Heap = None


def merge(a: Heap, b: Heap) -> Heap:
    """The union of two heaps. O(log(len(a) + len(b))).

    The leftist merge made a loop: down the two right spines, smaller entry first (the nodes
    kept in `spine`), then the new nodes built bottom-up, each with the child of larger rank on
    the left. The heap is the one the recursive definition makes, node for node, in one call
    (no frame per level: a push on a heap of 1,000 parked flows cost about 30 calls)."""
    spine: list[tuple[int, Entry, Heap, Heap]] = []
    while a is not None and b is not None:
        if b[1] < a[1]:
            a, b = b, a
        spine.append(a)
        a = a[3]
    h = b if a is None else a
    for node in reversed(spine):
        left = node[2]
        ranked = 0 if left is None else left[0]
        right = 0 if h is None else h[0]
        # the child of larger rank goes left; the node's rank is its right child's plus one
        h = (ranked + 1, node[1], h, left) if ranked < right else (right + 1, node[1], left, h)
    return h


def push(h: Heap, entry: Entry) -> Heap:
    """`h` with `entry` added. O(log n)."""
    return merge(h, (1, entry, None, None))


def top(h: Heap) -> Entry | None:
    """The smallest entry, or None if empty. O(1)."""
    return None if h is None else h[1]


def pop(h: Heap) -> Heap:
    """`h` without its smallest entry (`h` must not be empty). O(log n)."""
    assert h is not None, "pop from an empty heap"
    return merge(h[2], h[3])


def from_sorted(entries: Iterable[Entry]) -> Heap:
    """A heap of `entries`, which must be in ascending order. O(n), no comparisons."""
    h: Heap = None
    for entry in reversed(list(entries)):
        h = (1, entry, h, None)
    return h
