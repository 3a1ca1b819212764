"""The working parts of one engine, wired together, and their lifecycle.

`Parts` builds each part once and hands each the narrow methods of the others it needs (so no
part imports another that sits above it), and starts and stops them for the engine's lifetime
(`_open._lifetime`): `begin` (the write ferry and the nursery), `recover`, `start_tasks`,
`close`, `leave`, `end`. The public `Engine` only reads through them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from ferry.projected import Store

from .._fleet._fleet import Fleet
from .._fleet._lease import Lease
from .._model._plan import Plan
from .._model._values import Flow
from .._runtime import _retention, _tracing
from .._runtime._clock import Clock
from .._runtime._live import Live, Tally
from .._runtime._recovery import let_go_unbegun, recover
from .._runtime._requests import Requests
from .._runtime._runner import Runner
from .._runtime._timer_loop import Timers
from .._runtime._versions import Versions
from .._runtime._writes import Writes
from .._store import _op

_GUARD = 1 / 4  # of the lease: how long a fleet engine's transaction may sit idle (locks held)
_GUARD_MIN = 0.5


class Parts:
    """The parts of one engine (see each module's docstring) and their lifecycle."""

    def __init__(
        self,
        store: Store,
        plans: dict[tuple[str, int], Plan],
        *,
        owner: str,
        max_running: int,
        lease: float,
        serve: bool,
        fleet: bool,
        max_data_bytes: int,
        group_commit: bool,
        scan_interval: float | None,
        wall_clock: Callable[[], float],
        retain: float | None,
        tracing: _tracing.Tracing | None,
        seen: Callable[[Flow], None],
        refused: Callable[[Flow, str, BaseException], None],
        live: dict[str, Live],
    ) -> None:
        self._store = store
        self._owner = owner
        self._serve = serve
        self._fleet = fleet
        self.fleet_mode = fleet  # leases and scans (PostgreSQL; SQLite in some tests)
        self._tracing = tracing
        self.clock = clock = Clock(wall_clock)
        self.versions = versions = Versions(plans)
        self.tally = tally = Tally()
        tally.tracing = tracing  # the end span of each flow this engine ends
        self.timers = timers = Timers(clock, fleet=fleet)
        guard = max(_GUARD_MIN, lease * _GUARD) if fleet else None
        runner: Runner  # made below: the write path hands it the flows that become live

        def runnable(live: Live) -> None:
            runner.enqueue(live)

        self.writes = writes = Writes(
            store,
            clock,
            tally,
            versions,
            owner=owner,
            serve=serve,
            fleet=fleet,
            group_commit=group_commit,
            guard=guard,
            seen=seen,
            refused=refused,
            live=live,
            runnable=runnable,
            arm=timers.arm,
        )
        self.lease = Lease(store, clock, writes, tally, owner=owner, lease=lease, fleet=fleet)
        self.fleet = Fleet(
            store,
            clock,
            writes,
            self.lease,
            versions,
            tally,
            owner=owner,
            max_running=max_running,
            scan_interval=lease / 3 if scan_interval is None else scan_interval,
            arm=timers.arm,
        )
        self.runner = runner = Runner(
            writes,
            self.lease,
            versions,
            clock,
            tally,
            max_running=max_running,
            max_data=max_data_bytes,
            fleet=fleet,
            tracing=tracing,
            hand_over=self.fleet.hand_over,
        )
        self.requests = Requests(
            store,
            clock,
            writes,
            versions,
            tally,
            plans,
            owner=owner,
            serve=serve,
            fleet=fleet,
            max_data=max_data_bytes,
            tracing=tracing,
        )
        # Deletes finished flows `retain` seconds after they ended (a task of a serving engine).
        self.retention = (
            _retention.Retention(store, retain, clock.now, guard)
            if retain is not None and serve
            else None
        )
        self.nursery: trio.Nursery | None = None

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
            self.timers,
            self.lease,
            self.fleet if self._fleet else None,
            owner=self._owner,
            serve=self._serve,
        )

    def start_tasks(self) -> None:
        """The engine's own tasks: the timer (a serving engine), the fleet's heartbeat and
        scans, retention."""
        nursery = self.nursery
        assert nursery is not None
        writes = self.writes
        if self._serve:
            fire = _tracing.timed(self._tracing, writes.time_out)  # off: `time_out` itself
            nursery.start_soon(self.timers.run, nursery, writes.stale, fire)
        if self._serve and self._fleet:
            nursery.start_soon(self.fleet.heartbeat_loop)
            nursery.start_soon(self.fleet.scan_loop)
        if self.retention is not None:
            nursery.start_soon(self.retention.run)

    def close(self) -> None:
        """The block ends: no flow gets a runner any more."""
        self.runner.close()

    async def leave(self, *, touch_flows: bool) -> None:
        """At close, after the tasks ended: let go of the flows not begun (unless a task failed:
        then no flow is touched, they run again) and, in a fleet, end the lease. Unshielded:
        the caller shields and bounds it."""
        if not self._serve:
            return
        if touch_flows:
            await let_go_unbegun(self._store, self.clock, self.writes)
        if self._fleet:
            await self.lease.end()

    async def end(self) -> None:
        """Last: nothing is written any more; the heartbeat thread is stopped."""
        self.writes.close()
        await self.lease.stop_keeper()
