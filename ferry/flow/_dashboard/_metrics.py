"""``/metrics`` of the dashboard: what the store says, in Prometheus' text format.

The dashboard runs no engine, so it has no engine statistics to export (an application's
engines register their own collector, served by the application). What it can say for any
store, whoever runs the engines, is how many flows are in each state, per plan version: that is
``ferry_flow_flows{state}`` and ``ferry_flow_plan_flows{plan,version,state}``, gauges read at
each scrape (one count over the flows), and ``ferry_flow_engines{alive}``.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ferry.projected import Tx

from .. import _store
from .._types import State


class _Counts(Collector):
    def __init__(self, tx: Tx, ns: str) -> None:
        self.tx = tx
        self.ns = ns

    def collect(self) -> list[GaugeMetricFamily]:
        flows = GaugeMetricFamily(
            "ferry_flow_flows", "Flows in the store, by state", labels=["state"]
        )
        plans = GaugeMetricFamily(
            "ferry_flow_plan_flows",
            "Flows in the store, by plan version and state",
            labels=["plan", "version", "state"],
        )
        engines = GaugeMetricFamily(
            "ferry_flow_engines",
            "Engines known to the store, by whether their lease runs",
            labels=["alive"],
        )
        by_state = dict.fromkeys((s.name for s in State), 0)
        for plan, version, state, n in _store.count_plans(self.tx, ns=self.ns):
            by_state[state.name] += n
            plans.add_metric([plan, str(version), state.name], n)
        for name, n in by_state.items():
            flows.add_metric([name], n)
        now = time.time()
        known = _store.load_engines(self.tx, ns=self.ns)
        alive = sum(1 for e in known if e[1] >= now)
        engines.add_metric(["true"], alive)
        engines.add_metric(["false"], len(known) - alive)
        return [flows, plans, engines]


def scrape(tx: Tx, *, ns: str = "flow") -> bytes:
    """One scrape, read in this transaction."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Counts(tx, ns))
    return generate_latest(registry)
