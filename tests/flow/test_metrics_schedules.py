"""The Prometheus extra counts the ticks of schedules (`ferry_flow_schedule_ticks_total`, by
schedule and outcome: started, skipped, missed), told by the engine's observer hook
(`Observer.schedule_ticked`, `flow.ScheduleTick`), after a real scrape on a real SQLite file
under a MockClock. Fails on a collector without the hook (no family) and on an engine that
tells nothing of skipped or missed ticks (their samples are missing)."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing
from prometheus_client import CollectorRegistry

from ferry import flow, metrics

from .test_metrics import scrape, value
from .test_schedules_engine import BASE, MINUTE, Wall, engine_at, slow


async def test_a_scrape_counts_started_skipped_and_missed_ticks(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A minutely ``"skip"`` schedule of a flow that parks: 1:00 starts, 2:00 and 3:00 are
    skipped; the host freezes ten minutes: 13:00 (30 s late, on time) is skipped too, 4:00 to
    12:00 missed; a trigger while the flow still runs is skipped."""
    every = flow.Schedule("every", slow, cron="* * * * *")
    registry = CollectorRegistry()
    collector = metrics.Metrics()
    registry.register(collector)
    async with engine_at(tmp_path / "app.db", Wall(BASE), [every], observers=[collector]) as e:
        await trio.sleep(3.5 * MINUTE)
        autojump_clock.jump(10 * MINUTE)
        await trio.sleep(1)
        assert await e.trigger("every") is None
        samples = scrape(registry)
    name = "ferry_flow_schedule_ticks_total"
    assert value(samples, name, schedule="every", outcome="started") == 1
    assert value(samples, name, schedule="every", outcome="skipped") == 4
    assert value(samples, name, schedule="every", outcome="missed") == 9
