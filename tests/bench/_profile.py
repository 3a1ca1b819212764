"""Where a flow's CPU goes on SQLite: the figures to judge a lever by (docs/adr/0148).

    python -m tests.bench._profile [three|park] [--flows N] [--top K]

Three runs of one workload of `tests/bench/_speed.py` (the same plans and drivers as
`bench_flow_speed` and `bench_flow_layers`), each on a fresh SQLite file in one process:

1. **Calls per flow** on each thread (every Python and C call `sys.setprofile` sees, over the
   timed part): the engine's trio thread, and the store's thread (inside `Store.transact`'s
   function). Stable to a call or two on a loaded machine, where time is not.
2. **CPU per flow** (microseconds): the whole process, the trio thread, the store's thread
   (inside the transaction functions), and the cyclic garbage collector by generation (its
   collections are counted in the thread that triggers them, so inside the others).
3. With ``--top K``: the trio thread's K functions by own time, and by calls per flow
   (`cProfile`).

Not a benchmark row (it is not run by ``make bench``): a probe to run by hand.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import trio

from ferry import flow
from ferry.projected import SqliteStore, Tx
from tests.bench import _speed

Drive = Callable[[flow.Engine, flow.Plan, int], Awaitable[dict[str, Any]]]
DRIVERS: dict[str, Drive] = {"three": _speed.lockstep, "park": _speed.park_and_wake}


@contextmanager
def _file() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="flow-profile-") as name:
        yield os.path.join(name, "flows.db")


Around = Callable[[Callable[[Tx], Any]], Callable[[Tx], Any]]


async def _drive(
    workload: str,
    n: int,
    around: Around | None,
    on: Callable[[bool], None],
) -> None:
    """Run `workload` on a fresh file; while the `n` flows run, `on(True)` has been called and
    every transaction function of the store is wrapped by `around`."""
    plan = _speed.plans()[workload]
    wrapping: list[Around] = []
    with _file() as path:
        store = SqliteStore(path)
        transact = store.transact

        async def wrapped(fn: Callable[[Tx], Any], **kw: Any) -> Any:
            return await transact(wrapping[0](fn) if wrapping else fn, **kw)

        setattr(store, "transact", wrapped)  # noqa: B010 - an instance's method, replaced
        try:
            async with flow.open_engine(store, plans=[plan]) as engine:
                if around is not None:
                    wrapping.append(around)
                on(True)
                try:
                    await DRIVERS[workload](engine, plan, n)
                finally:
                    on(False)
                    wrapping.clear()
        finally:
            await store.aclose()


def calls(workload: str, n: int) -> dict[str, float]:
    """Python and C calls per flow on the trio thread and on the store's thread."""
    counts: collections.Counter[str] = collections.Counter()

    def counter(side: str) -> Callable[[FrameType, str, Any], None]:
        def count(frame: FrameType, event: str, arg: Any) -> None:
            if event == "call" or event == "c_call":
                counts[side] += 1

        return count

    store_side = counter("store thread")

    def around(fn: Callable[[Tx], Any]) -> Callable[[Tx], Any]:
        def counted(tx: Tx) -> Any:
            sys.setprofile(store_side)
            try:
                return fn(tx)
            finally:
                sys.setprofile(None)

        return counted

    trio_side = counter("trio thread")
    trio.run(_drive, workload, n, around, lambda yes: sys.setprofile(trio_side if yes else None))
    return {side: round(c / n, 1) for side, c in sorted(counts.items())}


def cpu(workload: str, n: int) -> dict[str, float]:
    """CPU microseconds per flow: the process, each thread, each generation's collections."""
    seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
    started: dict[str, float] = {}
    began: list[float] = []

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started["gc"] = time.thread_time()
        else:
            seconds[f"gc gen{info['generation']}"] += time.thread_time() - started["gc"]

    def around(fn: Callable[[Tx], Any]) -> Callable[[Tx], Any]:
        def timed(tx: Tx) -> Any:
            t = time.thread_time()
            try:
                return fn(tx)
            finally:
                seconds["store thread"] += time.thread_time() - t

        return timed

    def on(yes: bool) -> None:
        if yes:
            gc.callbacks.append(collected)
            began[:] = [time.process_time(), time.thread_time()]
        else:
            gc.callbacks.remove(collected)
            seconds["process"] += time.process_time() - began[0]
            seconds["trio thread"] += time.thread_time() - began[1]

    trio.run(_drive, workload, n, around, on)
    return {what: round(s / n * 1e6, 1) for what, s in sorted(seconds.items())}


def top(workload: str, n: int, k: int) -> str:
    """The trio thread's `k` functions by own time, then by calls (cProfile, per flow)."""
    profile = cProfile.Profile()
    trio.run(_drive, workload, n, None, lambda yes: profile.enable() if yes else profile.disable())
    stats = pstats.Stats(profile)
    rows = []
    for (file, line, name), (_cc, nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}({name})" if file != "~" else name
        rows.append((tt / n * 1e6, nc / n, where))
    lines = [f"{'us/flow':>8} {'calls/flow':>10}  function (trio thread, own time)"]
    lines += [f"{t:8.1f} {c:10.1f}  {w}" for t, c, w in sorted(rows, reverse=True)[:k]]
    lines += ["", f"{'us/flow':>8} {'calls/flow':>10}  function (trio thread, by calls)"]
    lines += [f"{t:8.1f} {c:10.1f}  {w}" for t, c, w in sorted(rows, key=lambda r: -r[1])[:k]]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description="where a flow's CPU goes on SQLite")
    p.add_argument("workload", choices=sorted(DRIVERS), nargs="?", default="three")
    p.add_argument("--flows", type=int, default=500)
    p.add_argument("--top", type=int, default=0, help="also the top K functions (cProfile)")
    args = p.parse_args(argv)
    print(f"{args.workload}, {args.flows} flows")
    print("calls per flow:", calls(args.workload, args.flows))
    print("CPU us per flow:", cpu(args.workload, args.flows))
    if args.top:
        print(top(args.workload, args.flows, args.top))


if __name__ == "__main__":
    main(sys.argv[1:])
