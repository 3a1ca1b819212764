"""The park deadlines' persistent heap (`_model/_timers`): entries come out in order, the heap is
the leftist heap of its definition node for node, and a push is one call whatever its size.

`test_a_push_is_one_call_on_a_large_heap` fails on the recursive merge (about 30 calls for a
push on a heap of 1,000 entries: a frame per level of the right spine, three rank lookups each).
"""

from __future__ import annotations

import random
import sys
from types import FrameType
from typing import Any

from ferry.flow._model import _timers
from ferry.flow._model._timers import Entry, Heap


def _rank(h: Heap) -> int:
    return 0 if h is None else h[0]


def _merged(a: Heap, b: Heap) -> Heap:
    """The leftist merge as it is defined (recursive): the reference."""
    if a is None:
        return b
    if b is None:
        return a
    if b[1] < a[1]:
        a, b = b, a
    left, right = a[2], _merged(a[3], b)
    if _rank(left) < _rank(right):
        left, right = right, left
    return (_rank(right) + 1, a[1], left, right)


def _entries(n: int, seed: int) -> list[Entry]:
    rng = random.Random(seed)
    return [(float(rng.randrange(50)), f"f{i}", rng.randrange(3)) for i in range(n)]


def test_the_heap_is_the_leftist_heap_of_its_definition() -> None:
    for seed in range(20):
        h: Heap = None
        reference: Heap = None
        for entry in _entries(200, seed):
            h = _timers.push(h, entry)
            reference = _merged(reference, (1, entry, None, None))
            assert h == reference
        for _ in range(100):
            assert h is not None and reference is not None
            h, reference = _timers.pop(h), _merged(reference[2], reference[3])
            assert h == reference
        other = _timers.from_sorted(sorted(_entries(50, seed + 100)))
        assert _timers.merge(h, other) == _merged(reference, other)
        assert _timers.merge(other, None) is other and _timers.merge(None, other) is other


def test_entries_come_out_in_order() -> None:
    entries = _entries(500, 7)
    h: Heap = None
    for entry in entries:
        h = _timers.push(h, entry)
    out = []
    while (first := _timers.top(h)) is not None:
        out.append(first)
        h = _timers.pop(h)
    assert out == sorted(entries)


def test_a_push_is_one_call_on_a_large_heap() -> None:
    h: Heap = None
    for entry in _entries(1000, 3):
        h = _timers.push(h, entry)
    calls: list[str] = []

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        _timers.merge(h, (1, (25.5, "late", 0), None, None))
    finally:
        sys.setprofile(None)
    assert calls == ["merge"]
