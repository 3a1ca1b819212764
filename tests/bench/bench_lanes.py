"""Micro-benchmarks of the pure waiting room (`python -m tests.bench lanes`).

- admit at 100k waiting inputs vs at 1k (target: growth <= 1.5x), rank-free, 1k keys, delay > 0;
- take + release of a batch of 100 (reported against admit of one input, for scale);
- admit into an existing lane vs a plain dict-and-list append (for scale, no target).
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import pyrsistent

from ferry import _lanes as core
from tests.bench._harness import Row, paired

# pyrsistent must be using its C extension (pvectorc), not the pure-Python vector.
assert importlib.import_module("pvectorc").pvector is pyrsistent.pvector, "pvectorc not in use"

N_KEYS = 1000


def _room(n: int) -> core.Lanes[Any, Any]:
    s = core.empty(core.Limits(max_batch_delay=1.0, max_queueing=10**9, max_batch_size=10**9))
    for i in range(n):
        s, _, _ = core.admit(s, i % N_KEYS, i, now=0.0)
    return s


def _admit_round(base: core.Lanes[Any, Any], ops: int = 5000) -> float:
    admit = core.admit
    t0 = time.perf_counter()
    for i in range(ops):
        admit(base, i % N_KEYS, i, now=0.5)  # always from the same base: size stays n
    return (time.perf_counter() - t0) / ops


def _take_release_round(base: core.Lanes[Any, Any], ops: int = 500) -> float:
    take, release = core.take, core.release
    t0 = time.perf_counter()
    s = base
    for _ in range(ops):
        s, batch = take(s, 0.0)
        assert batch is not None and len(batch.items) == 100
        s = release(s, batch.key, 0.0)
    return (time.perf_counter() - t0) / ops


def benchmarks() -> list[Row]:
    small, large = _room(1_000), _room(100_000)
    admit_large, admit_small = paired(7, lambda: _admit_round(large), lambda: _admit_round(small))
    rows = [
        Row(
            "lanes: admit at 100k waiting vs 1k",
            admit_large,
            admit_small,
            1.5,
            note=f"{admit_small * 1e6:.2f} us at 1k",
        )
    ]
    limits = core.Limits(max_batch_size=100, max_queueing=10**9)
    s = core.empty(limits)
    for i in range(500 * 100):
        s, _, _ = core.admit(s, i % 500, i, now=0.0)
    tr, one = paired(5, lambda: _take_release_round(s), lambda: _admit_round(small))
    rows.append(
        Row(
            "lanes: take+release of 100 vs one admit",
            tr,
            one,
            50.0,
            note=f"{tr * 1e6:.1f} us per batch of 100",
        )
    )

    def plain(ops: int = 5000) -> float:
        d: dict[int, list[int]] = {}
        t0 = time.perf_counter()
        for i in range(ops):
            d.setdefault(i % N_KEYS, []).append(i)
        return (time.perf_counter() - t0) / ops

    a, b = paired(7, lambda: _admit_round(small), plain)
    rows.append(Row("lanes: admit vs dict+list append", a, b, 100.0, note="for scale"))
    return rows
