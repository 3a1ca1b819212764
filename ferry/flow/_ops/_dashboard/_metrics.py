"""``/metrics`` of the dashboard: what the store says, in Prometheus' text format.

The dashboard runs no engine, so it has no engine statistics to export (an application's
engines register their own collector, served by the application). What it can say for any
store, whoever runs the engines, is how many flows are in each state, per plan version. Its
names say so: ``ferry_flow_store_`` (docs/adr/0128), never an engine collector's name with
another meaning. ``ferry_flow_store_flows{state}`` (every state, lower case: running, parked,
compensating, completed, failed, blocked, and any state added later by its lower-case name)
and, for the unfinished states, ``ferry_flow_store_plan_flows{plan,version,state}``: gauges
read at each scrape (a pass over the state index, and a row per unfinished flow); and
``ferry_flow_store_engines{alive}``.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ferry.projected import Tx

from ..._store import _store
from ._reads import count_by_state, count_unfinished_plans


class _Counts(Collector):
    def __init__(self, tx: Tx) -> None:
        self.tx = tx

    def collect(self) -> list[GaugeMetricFamily]:
        flows = GaugeMetricFamily(
            "ferry_flow_store_flows",
            "Flows in the store (whichever engines run them), by state",
            labels=["state"],
        )
        plans = GaugeMetricFamily(
            "ferry_flow_store_plan_flows",
            "Unfinished flows in the store, by plan version and state",
            labels=["plan", "version", "state"],
        )
        engines = GaugeMetricFamily(
            "ferry_flow_store_engines",
            "Engines known to the store, by whether their lease runs",
            labels=["alive"],
        )
        for name, n in count_by_state(self.tx).items():
            flows.add_metric([name.lower()], n)
        for plan, version, state, n in count_unfinished_plans(self.tx):
            plans.add_metric([plan, str(version), state.lower()], n)
        now = _store.lease_clock(self.tx, time.time())  # the database's: docs/adr/0110
        known = _store.load_engines(self.tx)
        alive = sum(1 for e in known if e[1] >= now)
        engines.add_metric(["true"], alive)
        engines.add_metric(["false"], len(known) - alive)
        return [flows, plans, engines]


def scrape(tx: Tx) -> bytes:
    """One scrape, read in this transaction."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Counts(tx))
    return generate_latest(registry)
