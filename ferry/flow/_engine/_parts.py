"""The working parts of one engine, wired together, and their lifecycle.

`Parts` builds each part once and hands each the narrow methods of the others it needs (so no
part imports another that sits above it), and starts and stops them for the engine's lifetime
(`_open._lifetime`): `begin` (the write ferry and the nursery), `recover`, `start_tasks`,
`close`, `leave`, `end`. The public `Engine` only reads through them.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

import stm
from ferry.projected import Store

from .._fleet._mode import Fleet
from .._model._plan import Plan
from .._model._types import FlowStatistics, State
from .._model._values import Flow
from .._runtime import _retention, _tracing
from .._runtime._clock import Clock
from .._runtime._config import Config
from .._runtime._feeds import Feeds
from .._runtime._live import Live, Tally
from .._runtime._mode import Mode, OneFile
from .._runtime._recovery import let_go_unbegun, recover
from .._runtime._requests import Requests
from .._runtime._runner import Runner
from .._runtime._schedule_loop import Schedules
from .._runtime._timer_loop import Timers
from .._runtime._versions import Versions
from .._runtime._waiters import Waiters
from .._runtime._writes import Writes
from .._store import _op

T = TypeVar("T")


def pick_mode(
    store: Store, clock: Clock, tally: Tally, versions: Versions, timers: Timers, config: Config
) -> tuple[Mode, Fleet | None]:
    """The mode of the engine (`_runtime._mode`), picked once: a fleet's (leases and scans),
    or one file's. The fleet's also as itself, to be bound to the write path."""
    if config.fleet:
        fleet = Fleet(store, clock, tally, versions, config, arm=timers.arm)
        return fleet, fleet
    return OneFile(store, timers.load), None


class Parts:
    """The parts of one engine (see each module's docstring) and their lifecycle."""

    def __init__(self, store: Store, plans: dict[tuple[str, int], Plan], config: Config) -> None:
        self._store = store
        self._config = config
        self.clock = clock = Clock(config.wall_clock)
        self.versions = versions = Versions(plans)
        self.tally = tally = Tally()
        tally.observers = config.observers  # `open_engine(observers=...)`, tracing first
        self.timers = timers = Timers(clock)
        self.mode, fleet = pick_mode(store, clock, tally, versions, timers, config)
        # Set when the block ends: waits raise `ferry.Closed`.
        self.closed = stm.TVar(False)
        self.waiters: Waiters[Live] = Waiters(
            shared=self.mode.shared,
            listen=self.mode.listen,
            lease=config.lease,
            closed=self.closed,
            read=self._read,
        )
        # The readers of events and streams (SPEC 5.10); in a fleet a waiting reader also reads
        # once per lease (another engine's writes are not heard here).
        fallback = config.lease if self.mode.shared else math.inf
        self.feeds = Feeds(self._read, fallback=fallback, listen=self.mode.listen_signals)
        self.writes = writes = self._writes(store, config)
        if fleet is not None:
            fleet.bind(writes)
        self.runner = Runner(writes, self.mode, versions, clock, tally, config)
        self.requests = Requests(store, clock, writes, versions, tally, plans, config, self.mode)
        self.schedules = Schedules(store, clock, writes, tally, versions.shapes, config, self.mode)
        # Deletes finished flows `retain` seconds after they ended (a task of a serving engine).
        self.retention = (
            _retention.Retention(store, config.retain, clock.now, self.mode.guard)
            if config.retain is not None and config.serve
            else None
        )
        self.nursery: trio.Nursery | None = None

    def _writes(self, store: Store, config: Config) -> Writes:
        """The write path; it hands the runner the flows that become live (`_runnable`)."""
        waiters = self.waiters
        return Writes(
            store,
            self.clock,
            self.tally,
            self.versions,
            config,
            self.mode,
            seen=self._seen,
            refused=waiters.refused,
            live=waiters.held,
            runnable=self._runnable,
            arm=self.timers.arm,
            ended=self._ended,
        )

    def statistics(self) -> FlowStatistics:
        """`Engine.statistics` from any thread (`ferry.metrics` reads it while serving a
        scrape): it copies a few integers and two dicts whose keys never change, and counts the
        compensating flows among a copy of the live ones (one C call copies them)."""
        live = list(self.writes.live.values())
        tally = self.tally
        return FlowStatistics(
            running=len(live),
            compensating=sum(1 for x in live if x.flow.state is State.COMPENSATING),
            parked=tally.parked,
            blocked_now=tally.blocked,
            queued=tally.queued,
            wakes=dict(tally.wakes),
            purged=0 if self.retention is None else self.retention.purged,
            **tally.stats,
        )

    def _seen(self, flow: Flow) -> None:
        """A committed row of `flow`: its waits and its readers hear of it."""
        self.waiters.saw(flow)
        self.feeds.saw(flow)

    def _runnable(self, live: Live) -> None:
        """A flow became live: the runner runs it (a method, not a closure: the runner is
        built after the write path it reads)."""
        self.runner.enqueue(live)

    def _ended(self, flow: Flow) -> None:
        """This engine's write ended `flow`: a schedule's waiting tick may start (a method:
        the schedules are built after the write path)."""
        self.schedules.ended(flow)

    async def _read(self, fn: Callable[[Any], T], what: str) -> T:
        """The waits' reads: an API call's (`Requests.read`)."""
        return await self.requests.read(fn, what)

    def begin(
        self,
        write_ferry: Callable[[_op.Op], Awaitable[_op.Result]] | None,
        nursery: trio.Nursery,
    ) -> None:
        """The block begins: write through `write_ferry`, run flows and tasks in `nursery`."""
        self.writes.open(write_ferry)
        self.runner.open(nursery)
        self.nursery = nursery

    async def recover(self) -> None:
        """At open (`_recovery.recover`)."""
        await recover(
            self._store,
            self.clock,
            self.versions,
            self.writes,
            self.tally,
            self.mode,
            serve=self._config.serve,
        )
        if self._config.serve:
            await self.schedules.open()

    def start_tasks(self) -> None:
        """The engine's own tasks: the timers of parks and of schedules (a serving engine), the
        mode's (a fleet's heartbeat and scans), retention."""
        nursery = self.nursery
        assert nursery is not None
        writes = self.writes
        if self._config.serve:
            fire = _tracing.timed(self._config.tracing, writes.time_out)  # off: `time_out` itself
            nursery.start_soon(self.timers.run, nursery, writes.stale, fire)
            if self.schedules.needed:
                nursery.start_soon(self.schedules.run)
            self.mode.start(nursery)
        if self.retention is not None:
            nursery.start_soon(self.retention.run)

    def close(self) -> None:
        """The block ends: no flow gets a runner any more."""
        self.runner.close()

    async def leave(self, *, touch_flows: bool) -> None:
        """At close, after the tasks ended: let go of the flows not begun (unless a task failed:
        then no flow is touched, they run again) and end what the mode holds (a fleet's
        lease). Unshielded: the caller shields and bounds it."""
        if not self._config.serve:
            return
        if touch_flows:
            await let_go_unbegun(self._store, self.clock, self.writes)
        await self.mode.leave()

    async def end(self) -> None:
        """Last: nothing is written any more; the mode's threads (a fleet's heartbeat) and the
        waits' listener are stopped."""
        self.writes.close()
        await self.mode.stop()
        await self.waiters.aclose()
        await self.feeds.aclose()
