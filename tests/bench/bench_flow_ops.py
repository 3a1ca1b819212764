"""`ferry.flow` in operation: the cost of traces, and a purge beside a writer (SQLite).

- **traces off**: what the engine adds per flow when no TracerProvider is set (one test of an
  attribute per start, per step run and per wake, and an empty context manager around the
  start; a park timeout has no hook when traces are off),
  measured alone on 1,000,000 rounds, against the time of one flow of the 3-step row (1,000
  concurrent flows, group commit, traces off). Target: under 1% (within the noise of that row).
- **traces on vs off**: the same 1,000 concurrent 3-step flows with an SDK TracerProvider (a
  `SimpleSpanProcessor` into the in-memory exporter: every span is built and handed over, no
  network) against traces off, rounds alternated. Reported (5 spans per flow: a start, three
  steps and the end), with what one span costs in the SDK alone, for scale.
- **purge beside a writer**: an engine deletes 100,000 finished flows (batches of 500) while a
  task starts and runs new flows as fast as it can: flows purged per second, and the writer's
  longest wait between two accepted starts during the purge against its median wait. Reported.

``BENCH_ROUNDS`` (default 3) sets the rounds of the traces row; ``BENCH_FLOW_PURGE`` (default
100000) the purge's size.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import trio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ferry import flow
from ferry.flow._runtime import _tracing
from ferry.projected import SqliteStore
from tests.bench._harness import Row, paired
from tests.bench.bench_flow import FLOWS, run_three_steps, three

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
SPANS = 5  # per traced 3-step flow: its start, three steps, its end
PURGE = int(os.environ.get("BENCH_FLOW_PURGE", "100000"))


async def _flows(path: Path, provider: TracerProvider | None) -> float:
    async with flow.open_engine(path, plans=[three], tracer_provider=provider) as engine:
        return await run_three_steps(engine)


def _hooks_off(rounds: int = 1_000_000) -> float:
    """Seconds per flow of the trace hooks with traces off: the start's context manager,
    three tests of the engine's tracing attribute (what `_attempt` does per step run) and one
    for a wake (a flow that parks once)."""
    tracing: _tracing.Tracing | None = None
    t0 = time.perf_counter()
    for _ in range(rounds):
        with _tracing.starting(tracing, "three", 1, "f"):
            pass
        for _step in range(3):
            if tracing is not None:
                raise AssertionError
        if tracing is not None:  # `Requests.wake`
            raise AssertionError
    return (time.perf_counter() - t0) / rounds


def _sdk_span(provider: TracerProvider, rounds: int = 2000) -> float:
    """Seconds per span of the SDK alone (``start_as_current_span``, ended, exported)."""
    tracer = provider.get_tracer("bench")
    t0 = time.perf_counter()
    for _ in range(rounds):
        with tracer.start_as_current_span("span"):
            pass
    return (time.perf_counter() - t0) / rounds


def _trace_rows(tmp: Path) -> list[Row]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    counter = iter(range(1_000_000))

    def one(traced: bool) -> float:
        gc.collect()
        exporter.clear()
        path = tmp / f"trace{next(counter)}.db"
        took: float = trio.run(_flows, path, provider if traced else None)
        assert len(exporter.get_finished_spans()) == (SPANS * FLOWS if traced else 0)
        return took

    on, off = paired(ROUNDS, lambda: one(True), lambda: one(False))
    hooks = min(_hooks_off() for _ in range(3))
    sdk = min(_sdk_span(provider) for _ in range(3))
    exporter.clear()
    return [
        Row(
            "flow traces off: the hooks' cost per flow vs a 3-step flow (traces off)",
            hooks,
            off,
            0.01,
            note=f"{hooks * 1e9:.0f} ns per flow, without a TracerProvider",
        ),
        Row(
            f"flow traces on vs off: {FLOWS:,} concurrent 3-step flows",
            on,
            off,
            float("inf"),
            note=f"{1 / on:,.0f} vs {1 / off:,.0f} flows/s; SDK provider, in-memory exporter,"
            f" {SPANS} spans per flow; the SDK alone: {sdk * 1e6:,.0f} us per span",
        ),
    ]


def _seed(tx: object, n: int, at: float) -> None:
    from tests.flow.test_retention import seed

    seed(tx, prefix="old-", n=n, state="COMPLETED", at=at)


async def _purge(path: Path) -> tuple[float, float, float, int]:
    """(seconds for the purge, the writer's longest gap, its median gap, starts meanwhile)."""
    store = SqliteStore(path)
    await store.transact(partial(_seed, n=PURGE, at=time.time() - 2 * 86400))
    gaps: list[float] = []
    try:
        async with flow.open_engine(store, plans=[three], retain=86400) as engine:
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:

                async def writer() -> None:
                    last = time.perf_counter()
                    i = 0
                    while engine.statistics().purged < PURGE:
                        i += 1
                        await engine.start(three, flow_id=f"new-{i}")
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now

                nursery.start_soon(writer)
                while engine.statistics().purged < PURGE:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            took = time.perf_counter() - t0
    finally:
        await store.aclose()
    return took, max(gaps), statistics.median(gaps), len(gaps)


def _purge_row(tmp: Path) -> Row:
    took, longest, median, starts = trio.run(_purge, tmp / "purge.db")
    return Row(
        f"flow retention: purge {PURGE:,} finished flows beside a writer: longest wait",
        longest,
        median,
        float("inf"),
        unit="s",
        note=f"a start's longest wait vs its median; {PURGE / took:,.0f} flows purged/s,"
        f" {starts:,} starts meanwhile; SQLite WAL, synchronous=FULL",
    )


def benchmarks() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-flow-ops-") as name:
        tmp = Path(name)
        return [*_trace_rows(tmp), _purge_row(tmp)]
