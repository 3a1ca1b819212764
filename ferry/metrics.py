"""Prometheus metrics for flow engines and ferries (the optional extra ``stm-ferry[metrics]``).

One call registers a collector::

    from ferry import metrics

    collector = metrics.register(engine, ferries={"lookups": lookups})

Serving the registry is the application's: ``prometheus_client.start_http_server(9100,
addr="127.0.0.1")`` (loopback: without ``addr`` it listens on every interface), its ASGI app, or
the endpoint the service already has. See docs/operating.md for every metric and the names
(docs/adr/0128): ``ferry_flow_*`` are this collector's, what its engines hold or did;
``ferry_flow_store_*`` the dashboard's store-wide counts; a ``state`` label is a `flow.State`
name in lower case.

Design
------
A scrape reads the statistics an engine or ferry already keeps (`Engine.statistics`,
`Ferry.statistics`) when it is collected: the counters and gauges cost nothing between scrapes.
Step and flow durations are seen only as they happen, so the collector is a `flow.Observer` of
each engine (the public hook, docs/adr/0138: `Engine.add_observer`, or given to
``open_engine(..., observers=[collector])``, which adds the engine to it as it opens): the engine
calls it once per step attempt (`flow.StepRun`), once per flow that ends (`flow.FlowEnd`), once
per firing of a schedule (`flow.ScheduleTick`), and once when it closes. A closed engine is
dropped then (docs/adr/0114): its gauges leave the scrape, and its counters' last values stay
in the sums (`_retired`), so a counter never goes down because an engine closed; the
collector keeps no engine after its block ended, however many open and close. Without an
observer the engine's hot path pays one truth test. The histograms are kept here, under one
lock, because a scrape may come from another thread (``start_http_server`` serves from its own): the
engine's trio thread writes them, the scrape copies them.

`import ferry` and `import ferry.flow` never import this module, nor prometheus_client.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol, final

import attrs
from prometheus_client.core import (
    REGISTRY,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from ferry import Closed, FerryStatistics
from ferry.flow import (
    Delivery,
    Engine,
    Fail,
    FlowEnd,
    FlowStatistics,
    Observer,
    Park,
    ScheduleTick,
    StepRun,
)

__all__ = [
    "BATCH_SIZE_BUCKETS",
    "FLOW_BUCKETS",
    "STEP_BUCKETS",
    "FerryLike",
    "Metrics",
    "register",
]

#: Upper bounds (seconds) of the step and compensation duration histograms.
STEP_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0
)  # fmt: skip
#: Upper bounds (seconds) of the flow duration histogram: flows that park may take days.
FLOW_BUCKETS: tuple[float, ...] = (
    0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0, 7 * 86400.0,
    30 * 86400.0,
)  # fmt: skip
#: Upper bounds of the batch size histogram.
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class FerryLike(Protocol):
    """`ferry.Ferry` or `ferry.PerKeyFerry`: anything with a `statistics()` of a ferry."""

    def statistics(self) -> FerryStatistics: ...


class _Histogram:
    """Bucket counts and a sum per label tuple; written on one thread, read on any (the lock)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.series: dict[tuple[str, ...], list[float]] = {}  # labels -> [*buckets, +Inf, sum]

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self.series.get(labels)
        if counts is None:
            counts = self.series[labels] = [0.0] * (len(self.bounds) + 2)
        counts[bisect.bisect_left(self.bounds, value)] += 1
        counts[-1] += value

    def family(self, name: str, doc: str, labels: Sequence[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=labels)
        for key, counts in sorted(self.series.items()):
            running = 0.0
            buckets = []
            for bound, n in zip((*map(_le, self.bounds), "+Inf"), counts[:-1], strict=True):
                running += n
                buckets.append((bound, running))
            family.add_metric(list(key), buckets, counts[-1])
        return family

    def copy(self) -> _Histogram:
        other = _Histogram(self.bounds)
        other.series = {k: list(v) for k, v in self.series.items()}
        return other


def _le(bound: float) -> str:
    return repr(float(bound))


def _step_outcome(result: object, error: BaseException | None, void: bool) -> str:
    if void:
        return "void"
    if error is not None:
        return "raised"
    if isinstance(result, Park):
        return "parked"
    if isinstance(result, Fail):
        return "failed"
    return "ok"


@final
class Metrics(Collector, Observer):
    """The collector `register` made: engines' and ferries' metrics, read at every scrape.

    `add_engine` and `add_ferry` add more; an engine opened with
    ``open_engine(..., observers=[collector])`` is added as it opens (its steps observed from
    the first). `unregister` takes it out of its registry and detaches it from its engines.
    Durations are observed from the moment an engine was added. An engine is dropped when its
    block ends (its last counts kept in the totals, its gauges gone)."""

    def __init__(
        self,
        *,
        step_buckets: Sequence[float] = STEP_BUCKETS,
        flow_buckets: Sequence[float] = FLOW_BUCKETS,
    ) -> None:
        self._lock = threading.Lock()
        self._engines: list[Engine] = []
        # The counters of the engines that closed, summed (their last statistics): scrapes go on
        # counting them, and the engines themselves are let go.
        self._retired: Counter[str] = Counter()
        self._retired_wakes: Counter[Delivery] = Counter()
        self._ferries: dict[str, FerryLike] = {}
        self._registry: CollectorRegistry | None = None
        self._steps = _Histogram(step_buckets)  # (plan, step)
        self._compensations = _Histogram(step_buckets)  # (plan, step)
        self._flows = _Histogram(flow_buckets)  # (plan, state)
        self._outcomes: dict[tuple[str, str], int] = {}  # (plan, outcome) of step attempts
        self._comp_outcomes: dict[tuple[str, str], int] = {}
        self._ticks: dict[tuple[str, str], int] = {}  # (schedule, started|skipped|missed)

    # ------------------------------------------------------------------ what the engine calls

    def step_ran(self, step: StepRun) -> None:
        if step.compensating:
            outcome = "void" if step.void else "ok" if step.error is None else "raised"
            counts, histogram = self._comp_outcomes, self._compensations
        else:
            outcome = _step_outcome(step.result, step.error, step.void)
            counts, histogram = self._outcomes, self._steps
        key = (step.plan, outcome)
        with self._lock:
            counts[key] = counts.get(key, 0) + 1
            if not math.isnan(step.seconds):
                histogram.observe((step.plan, step.step), step.seconds)

    def flow_ended(self, flow: FlowEnd) -> None:
        seconds = max(0.0, flow.ended_at - flow.started_at)
        with self._lock:
            self._flows.observe((flow.plan, flow.state.name.lower()), seconds)

    def schedule_ticked(self, tick: ScheduleTick) -> None:
        ticks = self._ticks
        with self._lock:
            for outcome, n in (
                ("started", tick.started),
                ("skipped", tick.skipped),
                ("missed", tick.missed),
            ):
                if n:
                    key = (tick.schedule, outcome)
                    ticks[key] = ticks.get(key, 0) + n

    def engine_opened(self, engine: Engine) -> None:
        """`engine` was opened with this collector among its observers: expose it."""
        with self._lock:
            if not any(e is engine for e in self._engines):
                self._engines.append(engine)

    def engine_closed(self, engine: Engine) -> None:
        """`engine`'s block ended: drop it, keeping its counters' final values."""
        stats = engine.statistics()  # final, and readable from any thread now
        with self._lock:
            if not any(e is engine for e in self._engines):
                return
            self._engines = [e for e in self._engines if e is not engine]
            for field in _COUNTED:
                self._retired[field] += getattr(stats, field)
            self._retired_wakes.update(stats.wakes)
        engine.remove_observer(self)

    def _retired_statistics(self) -> FlowStatistics:
        """The closed engines' counters as one engine's statistics, holding no flow (under the
        lock)."""
        return FlowStatistics(
            running=0,
            parked=0,
            compensating=0,
            blocked_now=0,
            wakes=dict(self._retired_wakes),
            **{field: self._retired[field] for field in _COUNTED},
        )

    # ------------------------------------------------------------------------------ the API

    def add_engine(self, engine: Engine) -> None:
        """Expose `engine`'s statistics and observe its steps and flows (until `unregister`, or
        until its block ends). Raises `TypeError` for something else than an engine,
        `ValueError` for one already here or closed."""
        if not isinstance(engine, Engine):
            raise TypeError(
                f"add_engine takes a flow.Engine (from flow.open_engine), got {engine!r}"
            )
        with self._lock:
            if any(e is engine for e in self._engines):
                raise ValueError(f"{engine!r} is already in this collector")
        try:
            engine.add_observer(self)
        except Closed:
            raise ValueError(
                f"{engine!r} is closed (its `async with open_engine(...)` block ended): add an"
                " engine while it is open"
            ) from None
        with self._lock:
            self._engines.append(engine)

    def add_ferry(self, name: str, ferry: FerryLike) -> None:
        """Expose `ferry`'s statistics with the label ``ferry=name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a ferry's name is a label value: a non-empty str, got {name!r}")
        if not callable(getattr(ferry, "statistics", None)):
            raise TypeError(
                f"add_ferry takes a ferry (from open_ferry or open_per_key_ferry), got {ferry!r}"
            )
        with self._lock:
            if name in self._ferries:
                raise ValueError(f"a ferry named {name!r} is already in this collector")
            self._ferries[name] = ferry

    def unregister(self) -> None:
        """Take the collector out of its registry and detach it from its engines
        (`Engine.remove_observer`: from their trio run while they are open)."""
        with self._lock:
            engines, self._engines = self._engines, []
            registry, self._registry = self._registry, None
        for engine in engines:
            engine.remove_observer(self)
        if registry is not None:
            registry.unregister(self)

    # ----------------------------------------------------------------------------- scraping

    def describe(self) -> Iterable[Metric]:
        """The families (so that a registry refuses a second collector of the same names)."""
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            engines = list(self._engines)
            retired = self._retired_statistics()
            ferries = dict(self._ferries)
            steps, compensations = self._steps.copy(), self._compensations.copy()
            flows = self._flows.copy()
            outcomes, comp_outcomes = dict(self._outcomes), dict(self._comp_outcomes)
            ticks = dict(self._ticks)
        yield from _engine_metrics([retired, *(e._statistics() for e in engines)])
        family = CounterMetricFamily(
            "ferry_flow_steps",
            "Step attempts, by plan and outcome (ok, parked, failed, raised, void).",
            labels=["plan", "outcome"],
        )
        for (plan, outcome), n in sorted(outcomes.items()):
            family.add_metric([plan, outcome], n)
        yield family
        family = CounterMetricFamily(
            "ferry_flow_compensations",
            "Compensation attempts, by plan and outcome (ok, raised, void).",
            labels=["plan", "outcome"],
        )
        for (plan, outcome), n in sorted(comp_outcomes.items()):
            family.add_metric([plan, outcome], n)
        yield family
        yield steps.family(
            "ferry_flow_step_duration_seconds",
            "How long one attempt of a step ran, by plan and step.",
            ["plan", "step"],
        )
        yield compensations.family(
            "ferry_flow_compensation_duration_seconds",
            "How long one attempt of a compensation ran, by plan and step.",
            ["plan", "step"],
        )
        yield flows.family(
            "ferry_flow_flow_duration_seconds",
            "From a flow's start to its end (completed, failed or blocked), by plan and state.",
            ["plan", "state"],
        )
        family = CounterMetricFamily(
            "ferry_flow_schedule_ticks",
            "Ticks of schedules this collector's engines fired, by schedule and outcome: started"
            " (a flow started: a tick, a waiting tick, a trigger or a backfill), skipped (by"
            " the overlap rule), missed (later than catchup after downtime).",
            labels=["schedule", "outcome"],
        )
        for (name, outcome), n in sorted(ticks.items()):
            family.add_metric([name, outcome], n)
        yield family
        yield from _ferry_metrics({name: f.statistics() for name, f in ferries.items()})


def _engine_metrics(stats: list[FlowStatistics]) -> Iterator[Metric]:
    def total(field: str) -> int:
        return sum(int(getattr(s, field)) for s in stats)

    gauge = GaugeMetricFamily(
        "ferry_flow_flows",
        "Flows of the engines now, by state (a flow.State, lower case): running and"
        " compensating (the engines run them, or they wait for a slot); parked, blocked and"
        " queued (in the store as each engine knows it: in a fleet every engine counts the"
        " store's, so take the max over engines, not the sum; queued: waiting in their plans'"
        " flow control, SPEC 5.8).",
        labels=["state"],
    )
    compensating = total("compensating")
    gauge.add_metric(["running"], total("running") - compensating)
    gauge.add_metric(["compensating"], compensating)
    gauge.add_metric(["parked"], total("parked"))
    gauge.add_metric(["blocked"], total("blocked_now"))
    gauge.add_metric(["queued"], total("queued"))
    yield gauge
    ended = CounterMetricFamily(
        "ferry_flow_ended",
        "Flows the engines wrote COMPLETED, FAILED or BLOCKED, by state.",
        labels=["state"],
    )
    for state in ("completed", "failed", "blocked"):
        ended.add_metric([state], total(state))
    yield ended
    wakes = CounterMetricFamily(
        "ferry_flow_wakes", "Wakes, by delivery (RESUMED, QUEUED, ...).", labels=["delivery"]
    )
    by_delivery: dict[str, int] = {}
    for s in stats:
        for delivery, n in s.wakes.items():
            label = delivery.name.lower()
            by_delivery[label] = by_delivery.get(label, 0) + n
    for label, n in sorted(by_delivery.items()):
        wakes.add_metric([label], n)
    yield wakes
    for field, name, doc in _ENGINE_COUNTERS:
        yield CounterMetricFamily(name, doc, value=total(field))


#: The counters of `FlowStatistics` (all but its gauges and its wakes by delivery).
_COUNTED: tuple[str, ...] = tuple(
    name
    for name in attrs.fields_dict(FlowStatistics)
    if name not in ("running", "compensating", "parked", "blocked_now", "wakes")
)

_ENGINE_COUNTERS = (
    ("step_retries", "ferry_flow_step_retries", "Step attempts after an exception."),
    ("writes", "ferry_flow_writes", "Boundary writes the store accepted."),
    ("write_batches", "ferry_flow_write_batches", "Store transactions that carried them."),
    ("conflicts", "ferry_flow_conflicts", "Writes refused by the revision check."),
    ("recovered", "ferry_flow_recovered", "Running or compensating flows resumed at open."),
    ("claimed", "ferry_flow_claimed", "Flows taken over from engines whose lease lapsed."),
    ("lost", "ferry_flow_lost", "Flows this engine was running and let go."),
    ("renewals", "ferry_flow_lease_renewals", "Renewals of the engines' leases."),
    ("children_started", "ferry_flow_children_started", "Child flows the engines started."),
    (
        "children_ended",
        "ferry_flow_children_ended",
        "Child flows the engines wrote COMPLETED or FAILED (each end once).",
    ),
)


def _ferry_metrics(stats: Mapping[str, FerryStatistics]) -> Iterator[Metric]:
    for field, name, doc in _FERRY_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["ferry"])
        for label, s in sorted(stats.items()):
            family.add_metric([label], float(getattr(s, field)))
        yield family
    calls = CounterMetricFamily(
        "ferry_calls",
        "Calls that reached admission, by what became of them: admitted (to the waiting room),"
        " rejected (it was full), after_close, direct (sent at once by their caller).",
        labels=["ferry", "outcome"],
    )
    for label, s in sorted(stats.items()):
        calls.add_metric([label, "admitted"], s.admitted)
        calls.add_metric([label, "rejected"], s.rejected)
        calls.add_metric([label, "after_close"], s.after_close)
        calls.add_metric([label, "direct"], s.direct_calls)
    yield calls
    for field, name, doc in _FERRY_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["ferry"])
        for label, s in sorted(stats.items()):
            counter.add_metric([label], getattr(s, field))
        yield counter
    sizes = HistogramMetricFamily(
        "ferry_batch_size", "Inputs per batch sent by the workers.", labels=["ferry"]
    )
    for label, s in sorted(stats.items()):
        counts = [0] * (len(BATCH_SIZE_BUCKETS) + 1)
        for size, n in s.batch_sizes.items():
            counts[bisect.bisect_left(BATCH_SIZE_BUCKETS, size)] += n
        running, buckets = 0, []
        for bound, n in zip((*map(_le, BATCH_SIZE_BUCKETS), "+Inf"), counts, strict=True):
            running += n
            buckets.append((bound, float(running)))
        total = sum(size * n for size, n in s.batch_sizes.items())
        sizes.add_metric([label], buckets, float(total))
    yield sizes


_FERRY_GAUGES = (
    ("queued", "ferry_queued", "Inputs waiting now."),
    ("queued_weight", "ferry_queued_weight", "Their total weight."),
    ("busy", "ferry_calls_in_flight", "Calls in flight now (batched or direct)."),
    ("lanes", "ferry_lanes", "Keys with inputs waiting or a call in flight."),
    ("ready", "ferry_lanes_ready", "Lanes in line to be taken by a worker."),
    ("waiting", "ferry_lanes_waiting", "Lanes holding a partial batch until their deadline."),
)
_FERRY_COUNTERS = (
    ("batches", "ferry_batches", "Batches sent by the workers."),
    ("inputs_sent", "ferry_inputs_sent", "Inputs those batches carried."),
    ("failed_batches", "ferry_failed_calls", "Calls (batched or direct) that raised."),
    ("dropped", "ferry_dropped", "Inputs whose callers were cancelled while they waited."),
    ("drained", "ferry_drained", "Inputs still waiting when the ferry closed."),
)


def register(
    *engines: Engine,
    ferries: Mapping[str, FerryLike] | None = None,
    registry: CollectorRegistry = REGISTRY,
    step_buckets: Sequence[float] = STEP_BUCKETS,
    flow_buckets: Sequence[float] = FLOW_BUCKETS,
) -> Metrics:
    """Register one collector of `engines`' and `ferries`' metrics (ferries by name: the
    ``ferry`` label) in `registry` (prometheus_client's default one unless given); returns it.

    The metrics are read from their statistics at every scrape; step and flow durations are
    observed from now on. Raises `ValueError` if the registry already has these names (a second
    collector: add engines and ferries to the first one instead), `TypeError` for something
    that is not an engine or a ferry. No checkpoint."""
    collector = Metrics(step_buckets=step_buckets, flow_buckets=flow_buckets)
    for name, ferry in (ferries or {}).items():
        collector.add_ferry(name, ferry)
    registry.register(collector)
    collector._registry = registry
    try:
        for engine in engines:
            collector.add_engine(engine)
    except BaseException:
        collector.unregister()
        raise
    return collector
