"""The fleet's periodic work (PostgreSQL, docs/flow-fleet.md): renewing and checking what this
engine holds, scanning for orphans and deadlines, handing a flow to an engine that has its plan
version.

Every ``lease / 3`` an engine renews its lease (`_lease.Lease.renew`) and then compares the active
flows the store says it holds with those it runs (`check_held`); every `scan_interval` (default
``lease / 3``) it scans (`scan`): orphans (active flows of its plan versions that no engine holds)
are taken over by a compare-and-set, and the deadlines of flows parked by any engine are armed
(docs/adr/0040-0043). A database that is unavailable fails one round, never the loop. What the
engine may trust meanwhile is `_lease`'s rule (trust after a lapse, docs/adr/0047).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from ferry.projected import Store

from .._model import _ops
from .._model._values import Flow
from .._runtime import _queues, _retry
from .._runtime._clock import Clock
from .._runtime._config import Config
from .._runtime._live import Live, Tally, about, named
from .._runtime._recovery import answer_refused, rerun
from .._runtime._versions import Versions
from .._runtime._writes import Writes, gather
from .._store import _op, _store
from ._lease import Lease, recheck

_log = logging.getLogger("ferry.flow")

_PRUNE_EVERY = 100  # scans between two prunings of the engines table
_PRUNE_AFTER = 100  # leases: an engine gone that long and holding no flow is forgotten
_SCAN_LIMIT = 1000  # orphans taken over per scan, at most


class Rounds:
    """The periodic tasks of a serving fleet engine (`heartbeat_loop`, `scan_loop`) and the
    scan that recovery runs first (`_mode.Fleet.first_round`). `strays` holds the flows the
    store said this engine holds but that it does not run, at the last check (adopted if seen
    so twice in a row)."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        lease: Lease,
        versions: Versions,
        tally: Tally,
        config: Config,
        *,
        arm: Callable[[float, str, int], None],
    ) -> None:
        self._store = store
        self._clock = clock
        self._writes: Writes  # `bind`
        self._lease = lease
        self._versions = versions
        self._tally = tally
        self._owner = config.owner
        self._max_running = config.max_running
        self.interval = config.scan_interval
        self._arm = arm
        self._strays: dict[str, int] = {}
        self._scanned_at: float | None = None  # the last scan's lease clock (engines that left)

    def bind(self, writes: Writes) -> None:
        """The write path whose flows the rounds take over and check."""
        self._writes = writes

    async def scan(self) -> None:
        """One scan (at open, then every `interval`): take over orphans (active flows of this
        engine's plan versions that no engine holds), as many as it has room for, each by a
        compare-and-set on its revision and on its still being nobody's; and arm the timers of
        parked flows whose deadline comes before the next scan but one (parked by any engine:
        exactly one engine's timeout takes each). An engine whose own lease is lapsing takes
        nothing. Raises on a database error."""
        store = self._store
        writes = self._writes
        shapes = self._versions.shapes
        now = self._clock.now()
        room = min(self._max_running - len(writes.live), _SCAN_LIMIT)
        if room > 0 and shapes and not self._lease.lapsing():
            keys = list(shapes)
            # Nobody's by the lease clock (the database's, docs/adr/0110), and each takeover
            # requires that the flow is still nobody's at that time (`lapsed_at`).
            at, orphans, ended = await store.transact(
                partial(
                    _store.orphans_on_clock,
                    now=now,
                    frozen_after=self._lease.lease,
                    limit=room,
                    plans=keys,
                )
            )
            if ended:
                _say_ended(self._owner, self._lease.lease, ended)
            ops: list[_op.Op] = []
            rows: list[Flow] = []
            for flow in orphans:
                if flow.flow_id in writes.live:
                    continue  # let go a moment ago and not yet forgotten
                take = _ops.TakeOver(self._owner, now)
                op = _op.Change(flow.flow_id, take, flow=flow, lapsed_at=at)
                ops.append(op)
                rows.append(flow)
            results = await gather([partial(writes.write_answered, op) for op in ops])
            answer = partial(answer_refused, writes, self._clock, self._versions, lapsed_at=at)
            refused = [
                partial(answer, f, r)
                for f, r in zip(rows, results, strict=True)
                if isinstance(r, _op.Rejected)  # that flow's own problem (docs/adr/0104)
            ]
            if refused:
                await gather(refused)
            taken = [r for r in results if isinstance(r, _op.Changed)]
            self._tally.stats["claimed"] += len(taken)
            if taken:
                _log.info(
                    "flow engine %r took over %d flow(s) no live engine held (%s)",
                    self._owner,
                    len(taken),
                    _took_from(rows, results, self._owner),
                    extra={"owner": self._owner, "claimed": len(taken)},
                )
        horizon = now + 2 * self.interval
        # Only the timers of its own plan versions: a timeout of a version it lacks is fired by
        # an engine that has it (a rolling deploy), not turned into a BLOCKED flow here.
        due = await store.transact(
            partial(_store.load_deadlines, before=horizon, plans=sorted(shapes))
        )
        for deadline, fid, revision in due:
            self._arm(deadline, fid, revision)
        await self._versions.refresh(store, now)
        # Parked, blocked and queued flows are nobody's: in a fleet `parked`, `blocked` and
        # `queued` are the store's counts, read here (a resume or abandon by another engine or
        # an operator leaves the gauge within one scan: docs/adr/0128).
        tally = self._tally
        tally.parked, tally.blocked, tally.queued = await store.transact(_store.count_waiting)
        if shapes:  # flow control and delayed starts: an engine that left
            since = self._scanned_at
            at = await _queues.when_engines_leave(writes, self._clock, self._versions, since)
            self._scanned_at = at if since is None else max(since, at)

    async def scan_loop(self) -> None:
        """`scan` every `interval`, and now and then forget engines long gone."""
        scans = 0
        while True:
            await trio.sleep(self.interval)
            try:
                await self.scan()
                scans += 1
                if scans % _PRUNE_EVERY == 0:  # engines long gone that hold nothing
                    prune = partial(
                        _store.prune_engines_on_clock,
                        now=self._clock.now(),
                        after=_PRUNE_AFTER * self._lease.lease,
                    )
                    await self._store.transact(prune)
            except Exception as exc:
                _retry.next_round(
                    exc,
                    f"flow engine {self._owner!r} scanned the fleet",
                    then=f"the next scan is in {self.interval:.1f} s",
                    extra={"owner": self._owner, "delay": self.interval},
                )

    async def heartbeat_loop(self) -> None:
        """Renew this engine's lease every ``lease / 3`` (one row: `_store.renew`), then check
        the flows the store says it holds against those it runs (`check_held`). If the lease is
        about to lapse before a renewal got through (the database is down or slow, or the
        process was frozen), the renewal lets every flow go: another engine may take them over
        from then on."""
        every = self._lease.lease / 3
        while True:
            await trio.sleep(every)
            await self._lease.renew()
            try:
                await self.check_held()
            except Exception as exc:
                _retry.next_round(
                    exc,
                    f"flow engine {self._owner!r} read the flows it holds",
                    then=f"again in {every:.1f} s",
                    extra={"owner": self._owner, "delay": every},
                )

    async def check_held(self) -> None:
        """Compare the active flows the store says this engine holds with those it runs: follow
        a flow whose row moved on without it (a cancel through another engine) or that it no
        longer holds; adopt (attempt + 1) one it holds but does not run, seen so twice in a row
        (a takeover whose answer was lost with its connection: it must not stay stranded)."""
        writes = self._writes
        ids = set(writes.live)
        lease = self._lease
        epoch = lease.epoch
        rows = await self._store.transact(partial(_store.load_active, owner=self._owner))
        strays: dict[str, int] = {}
        adopt: list[Flow] = []
        for row in rows:
            fid = row.flow_id
            live = writes.live.get(fid)
            if live is not None:
                ids.discard(fid)
                recheck(writes, live, row, epoch)
                continue
            if row.released_at is not None or lease.released.get(fid) == row.revision:
                continue  # let go: any engine may take it (once the next renewal releases it)
            if self._strays.get(fid) == row.revision:
                adopt.append(row)
            else:
                strays[fid] = row.revision
        self._strays = strays
        gone = [fid for fid in ids if fid in writes.live]
        if gone:
            epoch = lease.epoch
            for row in await self._store.transact(partial(_store.load_many, flow_ids=gone)):
                live = writes.live.get(row.flow_id)
                if live is not None:
                    recheck(writes, live, row, epoch)
        if adopt and not self._lease.lapsing():
            self._tally.stats["claimed"] += await rerun(writes, self._clock, self._versions, adopt)

    async def hand_over(self, live: Live) -> bool:
        """A flow this engine holds but lacks the plan version of (it came back to it while no
        engine with the version was live, or the fleet's list was stale): if a live engine has
        the version now, let the flow go (released with the next renewal, then taken over by
        such an engine) and say True; else False (it is blocked: no live engine could run it).
        A checkpoint; a store error counts as "no"."""
        try:
            await self._versions.refresh(self._store, self._clock.now())
        except Exception as exc:
            _retry.next_round(
                exc,
                f"flow engine {self._owner!r} read the fleet's plan versions",
                then=f"{named(live.flow)} is blocked",
                extra=about(live.flow),
            )
            return False
        writes = self._writes
        if writes.live.get(live.flow.flow_id) is not live or not self._versions.elsewhere(
            live.flow
        ):
            return False
        writes.let_go(live, release=True)
        return True


def _took_from(rows: list[Flow], results: list[Any], owner: str) -> str:
    """Whose flows a scan took over, for its log line: ``3 from 'eu-1', 1 another engine took
    first``. A flow its engine let go (it closed) names it as well; this engine's own, taken
    back after its lease lapsed, is ``itself``."""
    froms = collections.Counter(
        f.owner for f, r in zip(rows, results, strict=True) if isinstance(r, _op.Changed)
    )
    parts = [
        f"{n} from {'itself' if o == owner else 'no engine' if o is None else repr(o)}"
        for o, n in sorted(froms.items(), key=lambda item: (-item[1], str(item[0])))
    ]
    lost = sum(isinstance(r, _op.Conflict) for r in results)
    if lost:
        parts.append(f"{lost} another engine took first")
    return ", ".join(parts)


def _say_ended(owner: str, lease: float, ended: list[tuple[int, str]]) -> None:
    """Tell the operator which database sessions a scan ended (`_store.end_frozen_holders`)."""
    sessions = ", ".join(f"pid {pid} ({name or 'no application_name'})" for pid, name in ended)
    _log.warning(
        "flow engine %r ended %d database session(s) that held flow rows and had waited on "
        "their client in the middle of a request for more than a lease (%.1f s; a frozen "
        "engine): %s",
        owner,
        len(ended),
        lease,
        sessions,
        extra={"owner": owner, "ended": len(ended)},
    )
