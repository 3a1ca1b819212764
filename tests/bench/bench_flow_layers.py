"""`ferry.flow`'s CPU per flow against the code from before the package became layers with ops
as records (commit `COMMIT`, main before that work began), measured in the same run.

The same child (`tests/bench/_speed.py`) and the same pairing as `bench_flow_speed` (ADR 0100):
rounds alternate between the two codes (ABBA), each run on a fresh SQLite file (WAL,
``synchronous=FULL``), 1,000 flows driven by ``wait()``; the engine's CPU per flow (every thread
of the child, over the timed part), medians, today over the baseline. Target: at most 0.85 for
3-step flows, and for flows that park and are woken. ``BENCH_ROUNDS`` (default 3) runs of each
code; ``BENCH_SPEED_FLOWS`` (default 1000) flows per run. Without that commit in the checkout,
today's figures alone. Run alone with ``python -m tests.bench flow_layers``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.bench import _baseline
from tests.bench._harness import Row
from tests.bench.bench_flow_speed import FLOWS, ROOT, ROUNDS, WORKLOADS, Run, Stores, cpu_row

COMMIT = "ce91ae3"  # main before the layers and ops as records began
TARGET = 0.85


def _rows(stores: Stores, base: _baseline.Baseline) -> Iterator[Row]:
    for workload, what in WORKLOADS.items():
        today: list[Run] = []
        before: list[Run] = []
        for r in range(ROUNDS):  # ABBA: neither code always runs right after the other
            if base.code is not None and r % 2 == 0:
                before.append(stores.run(base.code, workload, who=base.commit))
            today.append(stores.run(ROOT, workload, who="today"))
            if base.code is not None and r % 2 == 1:
                before.append(stores.run(base.code, workload, who=base.commit))
        name = f"flow layers SQLite: {FLOWS:,} {what} flows, wait()"
        yield cpu_row(name, TARGET, today, before, base)


def benchmarks() -> Iterator[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-layers-") as name:
        tmp = Path(name)
        (tmp / "baseline").mkdir()
        base = _baseline.extract(tmp / "baseline", commit=COMMIT)
        if base.code is None:
            print(f"baseline missing ({base.reason}): today's figures only", flush=True)
        yield from _rows(Stores(tmp, None), base)
