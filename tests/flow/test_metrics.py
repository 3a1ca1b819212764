"""The Prometheus extra (`ferry.metrics`): a real scrape, parsed with prometheus_client's own
text parser, after real flows ran on a real SQLite store."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ferry
from ferry import flow, metrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    """Every sample of a scrape, as the Prometheus text format has it, parsed back."""
    text = generate_latest(registry).decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def shop(flaky: dict[str, int]) -> flow.Plan:
    """reserve (compensated) -> pay (raises once for ids in `flaky`, parks) -> ship (fails
    the flows whose data says so)."""
    plan = flow.Plan("shop", version=1)

    async def release(ctx: flow.Context) -> None:
        await trio.sleep(0.5)

    @plan.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        await trio.sleep(2.0)

    @plan.step(attempts=2)
    async def pay(ctx: flow.Context) -> flow.Outcome:
        if flaky.get(ctx.flow_id, 0) > 0:
            flaky[ctx.flow_id] -= 1
            raise RuntimeError("card reader busy")
        return flow.park(timeout=7200)

    @plan.step
    async def ship(ctx: flow.Context) -> flow.Outcome | None:
        if ctx.data.get("fail"):
            return flow.fail("no carrier")
        return None

    return plan


async def test_a_scrape_shows_the_engine_steps_and_flows(tmp_path: Path, autojump_clock) -> None:
    registry = CollectorRegistry()
    plan = shop({"f0": 1})
    # Under the mock clock, time moves only when every task waits for time (docs/adr/0066).
    async with flow.open_engine(str(tmp_path / "flows.db"), plans=[plan]) as engine:
        collector = metrics.register(engine, registry=registry)
        for i in range(3):
            await engine.start(plan, flow_id=f"f{i}", data={"fail": i == 2})
        for i in range(3):
            await wait_state(engine, f"f{i}", flow.State.PARKED)
        mid = scrape(registry)
        await trio.sleep(3600)  # an hour parked
        for i in range(3):
            await engine.wake(f"f{i}", {"paid": True})
        for i in range(3):
            await engine.wait(f"f{i}", timeout=60)
        after = scrape(registry)
    collector.unregister()

    assert value(mid, "ferry_flow_flows", state="parked") == 3
    assert value(after, "ferry_flow_flows", state="parked") == 0
    assert value(after, "ferry_flow_ended_total", state="completed") == 2
    assert value(after, "ferry_flow_ended_total", state="failed") == 1
    # Attempts by outcome: 3 reserve ok, 1 pay raised, 3 pay parked, 2 ship ok, 1 ship failed.
    assert value(after, "ferry_flow_steps_total", plan="shop", outcome="ok") == 5
    assert value(after, "ferry_flow_steps_total", plan="shop", outcome="parked") == 3
    assert value(after, "ferry_flow_steps_total", plan="shop", outcome="raised") == 1
    assert value(after, "ferry_flow_steps_total", plan="shop", outcome="failed") == 1
    assert value(after, "ferry_flow_compensations_total", plan="shop", outcome="ok") == 1
    assert value(after, "ferry_flow_step_retries_total") == 1
    assert value(after, "ferry_flow_wakes_total", delivery="resumed") == 3
    # reserve sleeps 2 s: all three in the (1, 2.5] bucket, none at or below 1 s.
    step = "ferry_flow_step_duration_seconds"
    assert value(after, f"{step}_count", plan="shop", step="reserve") == 3
    assert value(after, f"{step}_bucket", plan="shop", step="reserve", le="1.0") == 0
    assert value(after, f"{step}_bucket", plan="shop", step="reserve", le="2.5") == 3
    assert value(after, f"{step}_sum", plan="shop", step="reserve") == pytest.approx(6.0)
    assert value(after, f"{step}_count", plan="shop", step="pay") == 4
    comp = "ferry_flow_compensation_duration_seconds"
    assert value(after, f"{comp}_sum", plan="shop", step="reserve") == pytest.approx(0.5)
    # Start to end: parked an hour, then woken: just over 3600 s each.
    dur = "ferry_flow_flow_duration_seconds"
    assert value(after, f"{dur}_count", plan="shop", state="completed") == 2
    assert value(after, f"{dur}_count", plan="shop", state="failed") == 1
    assert value(after, f"{dur}_bucket", plan="shop", state="completed", le="3600.0") == 0
    assert value(after, f"{dur}_bucket", plan="shop", state="completed", le="14400.0") == 2
    assert 2 * 3600 < value(after, f"{dur}_sum", plan="shop", state="completed") < 2 * 3700


async def wait_state(engine: flow.Engine, flow_id: str, state: flow.State) -> None:
    """Poll on the mock clock (it costs no real time)."""
    while (snap := await engine.get(flow_id)) is None or snap.state is not state:  # noqa: ASYNC110
        await trio.sleep(0.01)


async def test_a_ferry_in_the_scrape_and_its_batch_sizes(autojump_clock) -> None:
    registry = CollectorRegistry()

    async def double(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    async with ferry.open_ferry(double, max_batch_size=4, max_batch_delay=1.0) as f:
        metrics.register(ferries={"double": f}, registry=registry)
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(f, i)
    s = scrape(registry)
    assert value(s, "ferry_calls_total", ferry="double", outcome="admitted") == 10
    assert value(s, "ferry_batches_total", ferry="double") == 3  # 4 + 4 + 2
    assert value(s, "ferry_inputs_sent_total", ferry="double") == 10
    assert value(s, "ferry_calls_in_flight", ferry="double") == 0
    assert value(s, "ferry_batch_size_count", ferry="double") == 3
    assert value(s, "ferry_batch_size_sum", ferry="double") == 10
    assert value(s, "ferry_batch_size_bucket", ferry="double", le="2.0") == 1
    assert value(s, "ferry_batch_size_bucket", ferry="double", le="4.0") == 3


async def test_served_from_another_thread_on_the_threaded_store(tmp_path: Path) -> None:
    """The public path: ``open_engine(path)``, and a scrape from a thread that is not the
    engine's (as ``start_http_server`` does) while flows run."""
    registry = CollectorRegistry()
    plan = flow.Plan("quick", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        await trio.lowlevel.checkpoint()

    async with flow.open_engine(str(tmp_path / "flows.db"), plans=[plan]) as engine:
        metrics.register(engine, registry=registry)
        for i in range(20):
            await engine.start(plan, flow_id=f"q{i}", data={})
        got: list[Samples] = []
        worker = threading.Thread(target=lambda: got.append(scrape(registry)))
        worker.start()
        for i in range(20):
            await engine.wait(f"q{i}", timeout=30)
        await trio.to_thread.run_sync(worker.join)
        final = scrape(registry)
    assert len(got) == 1  # the scrape from the other thread worked (values: whatever it saw)
    assert value(final, "ferry_flow_ended_total", state="completed") == 20
    assert value(final, "ferry_flow_steps_total", plan="quick", outcome="ok") == 20
    assert value(final, "ferry_flow_writes_total") >= 40  # start + end of each


async def test_one_collector_per_registry_and_bad_arguments(tmp_path: Path) -> None:
    registry = CollectorRegistry(auto_describe=True)
    first = metrics.register(registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.register(registry=registry)
    with pytest.raises(TypeError, match=r"flow\.Engine"):
        first.add_engine(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        first.add_ferry("", object())  # type: ignore[arg-type]
    first.unregister()
    metrics.register(registry=registry)  # the names are free again


async def test_unregister_detaches_from_the_engine(tmp_path: Path) -> None:
    plan = flow.Plan("p", version=1)

    @plan.step
    async def only(ctx: flow.Context) -> None:
        pass

    async with flow.open_engine(str(tmp_path / "flows.db"), plans=[plan]) as engine:
        collector = metrics.register(engine, registry=CollectorRegistry())
        with pytest.raises(ValueError, match="already observes"):
            engine.add_observer(collector)  # it is attached
        collector.unregister()
        assert not engine.remove_observer(collector)  # it was detached


def test_importing_ferry_does_not_import_prometheus_client() -> None:
    code = (
        "import sys, ferry, ferry.flow, ferry.projected; "
        "print(sorted(m for m in sys.modules if m.startswith('prometheus')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"
