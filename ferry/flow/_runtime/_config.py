"""One engine's configuration (`Config`, docs/adr/0133): built once by `open_engine` from its
arguments (checked there) and the test switches, and handed whole to the parts, which read the
fields they need, instead of a parameter per option through every constructor."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from .._store._cron import Schedule
from . import _tracing
from ._observe import Bound


@attrs.frozen
class Config:
    """What one engine was opened with, checked (`_engine._open`).

    `owner`: its name in the rows it leases; `max_running`: flows run at once at most;
    `lease`: seconds; `serve`: False for an operator's engine; `fleet`: the mode to pick
    (leases and scans: PostgreSQL, or a test's SQLite), read once by the parts; `max_data`:
    the most UTF-8 JSON text of a flow's data or a payload; `group_commit`: writes share
    transactions through the write ferry; `scan_interval`: seconds between a fleet's scans;
    `wall_clock`: the host's clock of durable times; `retain`: seconds a finished flow is
    kept (None: forever); `tracing`: OpenTelemetry spans (None: off); `observers`: those
    `open_engine` was given, bound (`_observe.Bound`), the end spans' first when tracing is
    on; `schedules`: those it declares at open (checked: unique names, its own plans)."""

    owner: str
    max_running: int
    lease: float
    serve: bool
    fleet: bool
    max_data: int
    group_commit: bool
    scan_interval: float
    wall_clock: Callable[[], float]
    retain: float | None
    tracing: _tracing.Tracing | None
    observers: tuple[Bound, ...] = ()
    schedules: tuple[Schedule, ...] = ()
