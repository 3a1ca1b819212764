"""The fleet's mode (`_runtime._mode.Mode`, docs/adr/0132): what the runtime's parts ask of an
engine that shares its store with others under leases, answered by its lease (`_lease.Lease`:
the trust epoch, the flows let go), its rounds (`_fleet.Rounds`: scans, checks, hand-overs) and
the waits' listener (`_listener.Listener`). Built once, by the composition root
(`_engine._parts`), for a PostgreSQL store (or an SQLite one in some tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import trio

from ferry.projected import Store

from .._model._values import Flow
from .._runtime import _retry
from .._runtime._clock import Clock
from .._runtime._config import Config
from .._runtime._live import Live, Tally, about, named
from .._runtime._mode import Listen, Listening
from .._runtime._versions import Versions
from .._runtime._writes import Writes
from .._store import _notify, _store
from . import _heartbeat
from ._fleet import Rounds
from ._lease import Lease, recheck
from ._listener import Listener

_log = logging.getLogger("ferry.flow")

_GUARD = 1 / 4  # of the lease: how long a fleet engine's transaction may sit idle (locks held)
_GUARD_MIN = 0.5
#: The channels the readers of events and streams hear: settled flows (a stream ends) and the
#: flows whose events or stream a batch wrote (docs/adr/0177).
_SIGNALLED = (_notify.CHANNEL_SQL, _notify.SIGNALS_CHANNEL_SQL)


class Fleet:
    """The mode of an engine of a fleet (the module docstring). `lease` and `rounds` are its
    parts; `bind` hands them the write path, which is built after the mode it asks."""

    shared = True

    def __init__(
        self,
        store: Store,
        clock: Clock,
        tally: Tally,
        versions: Versions,
        config: Config,
        *,
        arm: Callable[[float, str, int], None],
    ) -> None:
        self._store = store
        self._clock = clock
        self._versions = versions
        self._config = config
        self._owner = config.owner
        self._writes: Writes  # `bind`
        self.lease = Lease(store, clock, tally, owner=config.owner, lease=config.lease)
        self.rounds = Rounds(store, clock, self.lease, versions, tally, config, arm=arm)
        self.guard: float | None = max(_GUARD_MIN, config.lease * _GUARD)
        dsn = _heartbeat.keeper_for(store)
        self.listen: Listen | None = None if dsn is None else partial(self._listener, dsn)
        self.listen_signals: Listen | None = (
            None if dsn is None else partial(self._listener, dsn, channels=_SIGNALLED)
        )

    def bind(self, writes: Writes) -> None:
        """The write path (built with this mode): the lease and the rounds act on its flows."""
        self._writes = writes
        self.lease.bind(writes)
        self.rounds.bind(writes)

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    def _listener(
        self,
        dsn: str,
        on_flows: Callable[[list[tuple[str, int]] | None], None],
        on_state: Callable[[bool], None],
        *,
        channels: tuple[str, ...] = (_notify.CHANNEL_SQL,),
    ) -> Listening:
        return Listener(
            dsn,
            on_flows=on_flows,
            on_state=on_state,
            connect_timeout=max(2.0, self._config.lease / 4),
            owner=self._owner,
            channels=channels,
        )

    # ------------------------------------------------------------------------ the write path

    def holds(self, flow: Flow) -> bool:
        """Leased to this engine, not released, and of a version it has."""
        return (
            flow.owner == self._owner
            and flow.released_at is None
            and not self._versions.elsewhere(flow)
        )

    def fires(self, flow: Flow) -> bool:
        """Only a timer of a version it has: one that has the version fires the others."""
        return (flow.plan, flow.version) in self._versions.shapes

    def release_later(self, fid: str, revision: int) -> None:
        self.lease.released[fid] = revision

    def given_back(self, fid: str) -> None:
        self.lease.released.pop(fid, None)

    # ---------------------------------------------------------------------------- the runner

    def ready(self, live: Live) -> bool:
        """A copy of this epoch, under a lease that is not lapsing."""
        return live.epoch == self.lease.epoch and not self.lease.lapsing()

    async def make_ready(self, live: Live) -> bool:
        """A copy from an older epoch is read again first (`confirm`); an engine whose lease is
        lapsing lets the flow go rather than run a step on the strength of a stale lease."""
        lease = self.lease
        if live.epoch != lease.epoch and not await self.confirm(live):
            return False  # moved on without this engine, or let go
        if lease.lapsing():
            self._writes.let_go(live, release=True)
            await trio.lowlevel.checkpoint()
            return False
        return True

    async def confirm(self, live: Live) -> bool:
        """Read the flow's row again before a body runs on a copy from an older epoch (the
        `_lease` docstring): True if the row is still that copy and the flow is still held by
        this engine; else the row is followed (a newer one) or the flow let go, and False.
        Retries while the store is unavailable. A checkpoint."""
        writes = self._writes
        lease = self.lease
        fid = live.flow.flow_id
        backoff = _retry.Backoff(f"re-reading {named(live.flow)}", extra=about(live.flow))
        while True:
            epoch = lease.epoch
            try:
                row = await writes.load_row(fid)
            except Exception as exc:
                await backoff.pause(exc)  # raises unless the store is unavailable
                continue
            if writes.live.get(fid) is not live:
                return False
            if not recheck(writes, live, row, epoch):
                return False
            if epoch == lease.epoch:
                return True
            # another renewal after a lapse came meanwhile: read again

    def body_deadline(self) -> float:
        return self.lease.trust_deadline()

    def voided(self, live: Live) -> None:
        lease = self.lease
        if lease.lapsing() and self._writes.live.get(live.flow.flow_id) is live:
            lease.lose_all("its lease lapsed while it ran steps")

    async def hand_over(self, live: Live) -> bool:
        return await self.rounds.hand_over(live)

    # -------------------------------------------------------------- recovery and the lifetime

    async def claim(self, plans: list[tuple[str, int]]) -> list[Flow]:
        """Claim the owner name (`Lease.claim`); the active flows it held under that name (a
        restart) of the versions it has; those of versions it lacks are released, for an
        engine that has them."""
        store = self._store
        owner = self._owner
        now = self._clock.now()
        await self.lease.claim(now, plans)
        held = await store.transact(partial(_store.load_active, owner=owner))
        shapes = self._versions.shapes
        mine = [f for f in held if (f.plan, f.version) in shapes]
        others = [(f.flow_id, f.revision) for f in held if (f.plan, f.version) not in shapes]
        if others:  # a version this engine lacks: leave those to an engine that has it
            await store.transact(
                partial(_store.release_on_clock, owner=owner, flows=others, now=now)
            )
        return mine

    async def first_round(self) -> None:
        """The first scan: a database outage does not fail the open (the scan loop goes on)."""
        try:
            await self.rounds.scan()
        except Exception as exc:
            _retry.next_round(
                exc,
                f"flow engine {self._owner!r} scanned the fleet first",
                then=f"the next scan is in {self.rounds.interval:.1f} s",
                extra={"owner": self._owner},
            )

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.rounds.heartbeat_loop)
        nursery.start_soon(self.rounds.scan_loop)

    async def leave(self) -> None:
        await self.lease.end()

    async def stop(self) -> None:
        await self.lease.stop_keeper()
