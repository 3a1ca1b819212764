"""The cost of `ferry.metrics` on a flow engine (SQLite, WAL, ``synchronous=FULL``).

Each row runs 1,000 concurrent 3-step flows (``start`` then ``wait``, as in bench_flow) with
steps that do a little work (a few hundred microseconds of CPU, so that the per-step cost of
observing is not hidden behind the store alone), alternating subject and baseline rounds, the
best of each. The figure is the process's CPU time per flow (all its threads: the store's
included), not wall time: the machine is shared, and what the hook costs is CPU.

- **metrics on**: a collector registered (``metrics.register(engine)``) and scraped once at the
  end, against the same engine without one. Reported, with a target of 1.25x.
- **metrics off**: today's engine without a collector, against the same engine with the
  observer hook taken out of the step path (`_attempt` as it was before the hook, monkeypatched
  in this module): the hook's cost when nothing observes, target 1.05x (within noise).

``BENCH_ROUNDS`` sets the rounds (at least 5).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio
from prometheus_client import CollectorRegistry, generate_latest

from ferry import flow, metrics
from ferry.flow._model._types import MisusedOutcome
from ferry.flow._runtime import _runner
from tests.bench._harness import Row, paired

ROUNDS = max(5, int(os.environ.get("BENCH_ROUNDS", "3")))
FLOWS = 1000

work = flow.Plan("work")


def _busy() -> int:
    return sum(i * i for i in range(2000))


@work.step
async def a(ctx: flow.Context) -> None:
    ctx.data["a"] = _busy()


@work.step
async def b(ctx: flow.Context) -> None:
    ctx.data["b"] = _busy()


@work.step
async def c(ctx: flow.Context) -> None:
    ctx.data["c"] = _busy()


async def _run(path: Path, observed: bool) -> float:
    async with flow.open_engine(path, plans=[work]) as engine:
        registry = CollectorRegistry()
        if observed:
            metrics.register(engine, registry=registry)

        async def one(i: int) -> None:
            await engine.wait(await engine.start(work, flow_id=f"f{i}", data={}))

        t0 = time.process_time()
        async with trio.open_nursery() as nursery:
            for i in range(FLOWS):
                nursery.start_soon(one, i)
        if observed:
            assert b"ferry_flow_steps_total" in generate_latest(registry)
        took = (time.process_time() - t0) / FLOWS
        assert engine.statistics().completed == FLOWS
    return took


async def _attempt_before_the_hook(
    self: Any,
    live: Any,
    step: Any,
    fn: Callable[[Any], Awaitable[Any]],
    failures: int,
    scope: trio.CancelScope,
) -> Any:
    """`Runner._attempt` as it is without the observer hook (its two clock reads and the
    `_observe.ran` call left out; everything else as the runner does it, the mode's checks
    included). Kept in step with `_runner.Runner._attempt`: tests/test_bench_builds.py runs it."""
    mode = self._mode
    if not mode.ready(live) and not await mode.make_ready(live):
        return None
    flow_ = live.flow
    compensating = flow_.state is _runner._COMPENSATING
    ctx = _runner.context(flow_, step.name, compensating)
    if _runner._log.isEnabledFor(logging.DEBUG):
        _runner._log_attempt(flow_, step)
    bounded = (deadline := mode.body_deadline()) != math.inf
    if bounded:
        scope.deadline = deadline
    live.scope = scope
    live.began = flow_.revision
    result: object = None
    error: BaseException | None = None
    try:
        result, error = await self._body(fn, ctx, flow_, compensating)
        retried = error is not None and failures + 1 < step.attempts
        if retried and not isinstance(error, MisusedOutcome):
            await _runner._backoff(flow_, step, error, failures + 1, compensating)
    except BaseException as exc:
        if not scope.cancel_called:
            raise
        _runner._not_only_cancelled(exc)
    finally:
        live.scope = None
    if bounded:
        scope.deadline = math.inf
    cancelled = scope.cancel_called
    if cancelled:
        mode.voided(live)
        raise _runner._Void
    if live.flow is not flow_:
        return None
    return ctx, result, error


@contextmanager
def _without_the_hook() -> Iterator[None]:
    today = _runner.Runner._attempt
    _runner.Runner._attempt = _attempt_before_the_hook  # type: ignore[method-assign]
    try:
        yield
    finally:
        _runner.Runner._attempt = today  # type: ignore[method-assign]


def benchmarks() -> list[Row]:
    rows: list[Row] = []
    counter = iter(range(1_000_000))
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as name:
        tmp = Path(name)

        def one(observed: bool) -> float:
            gc.collect()
            took: float = trio.run(_run, tmp / f"m{next(counter)}.db", observed)
            return took

        def before() -> float:
            with _without_the_hook():
                return one(False)

        on, off = paired(ROUNDS, lambda: one(True), lambda: one(False))
        rows.append(
            Row(
                f"flow metrics: {FLOWS:,} 3-step flows, collector registered vs none",
                on,
                off,
                1.25,
                note="CPU per flow; a histogram and a counter per step attempt, one per flow",
            )
        )
        off, old = paired(ROUNDS, lambda: one(False), before)
        rows.append(
            Row(
                f"flow metrics: {FLOWS:,} 3-step flows, no collector vs no hook",
                off,
                old,
                1.05,
                note="CPU per flow; the hook's cost when nothing observes",
            )
        )
    return rows
