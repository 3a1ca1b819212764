"""The dashboard's ``/metrics``: the store-wide counts under their own names
(``ferry_flow_store_*``, lower-case states), parsed by prometheus_client's own text parser.
Before, it reused the engine collector's ``ferry_flow_flows`` with upper-case states and
another meaning (every flow in the store, not an engine's): a scrape of both added them up."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ferry import flow
from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader

from .test_dashboard import TOKEN, client_of, fill


async def test_the_store_wide_gauges_have_their_own_names_and_lower_case_states(
    tmp_path: Path,
) -> None:
    db = str(tmp_path / "flows.db")
    fill(db)
    dash = Dashboard(reader=Reader(path=db), store=db, where=repr(db), token=TOKEN)
    async with await client_of(dash) as web:
        r: httpx.Response = await web.get("/metrics")
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert set(families) == {
        "ferry_flow_store_flows",
        "ferry_flow_store_plan_flows",
        "ferry_flow_store_engines",
    }, "a store-wide gauge must not reuse an engine collector's name"
    assert all(f.type == "gauge" for f in families.values())
    flows = {s.labels["state"]: s.value for s in families["ferry_flow_store_flows"].samples}
    # Every state, by its lower-case name (the engine collector's label values).
    assert set(flows) == {s.name.lower() for s in flow.State}
    assert flows["blocked"] == 2 and flows["completed"] == 1
    plans = families["ferry_flow_store_plan_flows"].samples
    assert {tuple(sorted(s.labels)) for s in plans} == {("plan", "state", "version")}
    assert {s.labels["state"] for s in plans} <= {"running", "parked", "compensating", "blocked"}
    engines = families["ferry_flow_store_engines"].samples
    assert {s.labels["alive"]: s.value for s in engines} == {"true": 1, "false": 0}
