"""Engines opened with the switches only tests and benchmarks use (group commit off, the fleet's
leases forced on or off, fencing off, another scan interval or wall clock), which are not in
`flow.open_engine`'s signature. Every other option is `open_engine`'s own, with its defaults."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from ferry import flow
from ferry.flow import _open


def open_engine(
    store: Any,
    plans: Any,
    *,
    group_commit: bool = True,
    wall_clock: Callable[[], float] = time.time,
    fleet: bool | None = None,
    fencing: bool = True,
    scan_interval: float | None = None,
    **options: Any,
) -> AbstractAsyncContextManager[flow.Engine]:
    """`flow.open_engine(store, plans, **options)` with the given switches."""
    bound = inspect.signature(flow.open_engine).bind(store, plans, **options)
    bound.apply_defaults()
    switches = _open._Switches(
        group_commit=group_commit,
        wall_clock=wall_clock,
        fleet=fleet,
        fencing=fencing,
        scan_interval=scan_interval,
    )
    return _open._Opening(_open._opened(*bound.args, **bound.kwargs, switches=switches))
