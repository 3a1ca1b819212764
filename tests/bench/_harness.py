"""Tiny benchmark harness: best-of-rounds timings and a ratio to a baseline from the same run.

These machines are shared and noisy, so a figure is never compared with a constant: each row times
the thing and its baseline in the same process, alternating, and reports the best round of each.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs


@attrs.frozen
class Row:
    """One line of the table: `value` and `baseline` are seconds per operation (or any unit)."""

    name: str
    value: float
    baseline: float
    target: float  # the highest acceptable ratio value / baseline; math.inf: reported, no target
    unit: str = "us/op"
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else float("inf")

    @property
    def ok(self) -> bool:
        return self.ratio <= self.target


def best_of(rounds: int, fn: Callable[[], float]) -> float:
    """Run `fn` (which returns the time per op of one round) `rounds` times; keep the best."""
    return min(fn() for _ in range(rounds))


def paired(
    rounds: int, subject: Callable[[], float], baseline: Callable[[], float]
) -> tuple[float, float]:
    """Alternate subject and baseline rounds so both see the same machine; best of each."""
    s: list[float] = []
    b: list[float] = []
    for _ in range(rounds):
        b.append(baseline())
        s.append(subject())
    return min(s), min(b)


def per_op(n: int, fn: Callable[[], object]) -> float:
    """Seconds per op for a function that performs `n` operations."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / n


def _show(value: float, unit: str) -> str:
    if unit.startswith("us/"):  # values are kept in seconds per op
        return f"{value * 1e6:>10.2f} us"
    return f"{value:>10.4g} {unit}"


def print_table(rows: list[Row]) -> None:
    width = max([len(r.name) for r in rows] + [10])
    print(f"{'figure':<{width}}  {'value':>13}  {'baseline':>13}  {'ratio':>7}  {'target':>7}  ok")
    for r in rows:
        reported = r.target == float("inf")  # a figure to report, with no target to meet
        mark = "-" if reported else "yes" if r.ok else "NO"
        target = f"{'-':>7}" if reported else f"{r.target:>6.2f}x"
        value, baseline = _show(r.value, r.unit), _show(r.baseline, r.unit)
        print(
            f"{r.name:<{width}}  {value}  {baseline}  {r.ratio:>6.2f}x  {target}"
            f"  {mark:<3}  {r.note}"
        )
    print("(ok: ratio <= target; '-': a figure reported, with no target)")
