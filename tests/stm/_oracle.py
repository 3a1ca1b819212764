"""A serializability checker for list-append histories (the idea of Jepsen's Elle, in small).

Every TVar holds a tuple; a transaction appends unique elements to some and reads others. Because
elements are unique and appends only extend, the final tuple of a key gives the order in which
its writes were installed, and each read tells exactly which writes it saw. From that:

- ww: the writer of element n of a key precedes the writer of element n + 1;
- wr: the writer of the last element a transaction read precedes that transaction;
- rw: a transaction that read the first n elements precedes the writer of element n + 1.

A serializable history has an acyclic graph. Lost appends and reads that are not prefixes of
the final value are reported too.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence

import attrs


@attrs.frozen
class Committed:
    """One committed transaction: what it read (first read of each key) and what it appended."""

    txn_id: int
    reads: Mapping[int, tuple[int, ...]]
    appends: Mapping[int, int]


def anomalies(history: Sequence[Committed], final: Mapping[int, tuple[int, ...]]) -> list[str]:
    """Everything wrong with `history` given the final value of every key; [] if serializable."""
    found: list[str] = []
    writer: dict[tuple[int, int], int] = {}
    for t in history:
        for key, element in t.appends.items():
            writer[key, element] = t.txn_id
            if element not in final[key]:
                found.append(f"lost append: T{t.txn_id} appended {element} to {key!r}")
    for t in history:
        for key, seen in t.reads.items():
            if final[key][: len(seen)] != seen:
                found.append(f"T{t.txn_id} read {seen} of {key!r}: not a prefix of {final[key]}")

    edges: dict[int, set[int]] = defaultdict(set)
    for key, elements in final.items():
        for a, b in itertools.pairwise(elements):
            edges[writer[key, a]].add(writer[key, b])
    for t in history:
        for key, seen in t.reads.items():
            full = final[key]
            if seen and (key, seen[-1]) in writer:
                w = writer[key, seen[-1]]
                if w != t.txn_id:
                    edges[w].add(t.txn_id)
            if len(seen) < len(full):
                nxt = writer[key, full[len(seen)]]
                if nxt != t.txn_id:
                    edges[t.txn_id].add(nxt)
    cycle = find_cycle(edges)
    if cycle:
        found.append("dependency cycle: " + " -> ".join(f"T{t}" for t in cycle))
    return found


def find_cycle(edges: Mapping[int, set[int]]) -> list[int] | None:
    """A cycle of the directed graph as [a, b, ..., a], or None. Iterative DFS."""
    white, grey, black = 0, 1, 2
    color: dict[int, int] = defaultdict(int)
    for root in list(edges):
        if color[root] != white:
            continue
        stack: list[tuple[int, list[int]]] = [(root, sorted(edges.get(root, ())))]
        path = [root]
        color[root] = grey
        while stack:
            node, todo = stack[-1]
            if not todo:
                color[node] = black
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop()
            if color[nxt] == grey:
                return [*path[path.index(nxt) :], nxt]
            if color[nxt] == white:
                color[nxt] = grey
                path.append(nxt)
                stack.append((nxt, sorted(edges.get(nxt, ()))))
    return None
