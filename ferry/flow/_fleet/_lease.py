"""A fleet engine's name and lease: the checks of `owner` and `lease`, who holds a name, and
what an engine may trust while it holds its lease (`Lease`).

Each `open_engine` on a fleet is an *incarnation* of its owner name (a new uuid): the name's row
in ``ns_engines`` says which incarnation holds it, where that one runs and until when its lease
runs (`_store.claim`). One live engine per name: a second opening while the holder's lease runs
raises `flow.StoreLocked` naming the owner, unless the holder's process is proven gone
(`process_gone`: it ran on this very host, in this pid namespace and boot, and that process id
no longer exists), as after a crash and a restart on the same machine. A clean close ends the
lease (`_store.end_lease`), so a restart after one claims the name at once too. docs/adr/0071.

The lease's range is what the store can enforce: its guard on idle transactions is a quarter of
the lease in milliseconds, a 32-bit count on PostgreSQL, and a lease under half a second leaves no
time for a renewal on a loaded machine.

Trust after a lapse (docs/adr/0047), the one rule every other place points to: a renewal that
may come after the lease lapsed (the engine stopped trusting it before the renewal, or the renewal
came back past the margin) must not make the engine trust what it has in memory: another engine
may have taken those flows over meanwhile, and nothing forbids renewing a lapsed lease. So such a
renewal starts a new *epoch* (`Lease.epoch`), and no copy of a flow made in an older epoch
(`Live.epoch`) is trusted until it has been read again: the renewal itself re-reads the flows the
engine runs (`recheck`: each followed, dropped or confirmed before the lease is trusted
again, with no checkpoint in between), and a runner re-reads any other copy before it runs a
body on it (`_mode.Fleet.confirm`). Until the lease is trusted again nothing runs: every body runs
under a deadline at the lease's margin, moved on with each renewal (`Lease.retrust`,
docs/adr/0073), and an engine whose lease is within the margin of lapsing (`Lease.lapsing`) lets
its flows go (`Lease.lose_all`), to be released in the store with its next renewal.

One clock for leases (docs/adr/0110): in a fleet the database's clock decides whose lease runs
(every lease transaction reads it first, `_store.lease_clock`, and writes and compares the
lease times on it); no host's clock does. The engine's own view of how long its lease runs is
local elapsed time on trio's clock: a renewal that began at trio time ``t`` and went through
holds the lease until ``t + lease`` (the database granted ``lease`` seconds from a moment after
``t``), so no step of the host's wall clock can make it trust its lease longer than the
database does.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from functools import cache, partial

import trio

from ferry.projected import Store

from .._model import _checks
from .._model._errors import StoreLocked
from .._model._values import Flow
from .._runtime import _retry
from .._runtime._clock import Clock
from .._runtime._live import Live, Tally
from .._runtime._writes import Writes
from .._store import _store
from . import _heartbeat

_log = logging.getLogger("ferry.flow")

_LEASE_MARGIN = 0.1  # of the lease: an engine lets its flows go this long before it lapses

OWNER_MAX = 200  # characters
LEASE_MIN = 0.5  # seconds
LEASE_MAX = 86_400.0  # seconds (one day)


def check_owner(owner: object) -> str:
    """`owner` if it is a usable engine name; else a `ValueError` saying why."""
    if not isinstance(owner, str):
        raise ValueError(
            f"owner must be a str (the engine's name in the fleet) or None, got {owner!r}"
        )
    if not owner:
        raise ValueError("owner must not be empty: give each engine a name, or None for a new uuid")
    if len(owner) > OWNER_MAX:
        raise ValueError(
            f"owner must be at most {OWNER_MAX} characters, got {len(owner)}"
            f" ({owner[:20]!r}...): use a short name such as a host and an instance number"
        )
    if not owner.isprintable():
        bad = next(ch for ch in owner if not ch.isprintable())
        raise ValueError(
            f"owner must be printable text, got {owner!r} (it holds {bad!r}, a control,"
            " separator or unpaired surrogate character): use letters, digits and punctuation"
        )
    return owner


def check_lease(lease: object) -> float:
    """`lease` in seconds if it is in the range the store can enforce; else a `ValueError`."""
    if isinstance(lease, bool) or not isinstance(lease, int | float):
        raise ValueError(f"lease must be a number of seconds, got {lease!r}")
    if not (_checks.finite(lease) and LEASE_MIN <= lease <= LEASE_MAX):
        raise ValueError(
            f"lease must be between {LEASE_MIN:g} s and {LEASE_MAX:g} s (one day), got"
            f" {_checks.shown_number(lease)}:"
            " engines renew it every third, and the database ends a transaction left idle for a"
            " quarter of it"
        )
    return float(lease)


@cache
def host_identity() -> str:
    """This machine and process namespace, as precisely as it can be told: the host name, the
    boot id and the pid namespace (two containers on one host, or one host before and after a
    reboot, are different hosts here: a process id means something only within one of them)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("")
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append("")
    return "/".join(parts)


def process_gone(host: str | None, pid: int | None) -> bool:
    """Is the process that holds a name proven gone? Only if it ran in this host identity and
    its process id exists no more. False whenever it cannot be told (another host, an engine of
    an older version that recorded neither): then its lease must lapse first."""
    if host is None or pid is None or host != host_identity():
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's): alive
        return False
    return False


class Lease:
    """This engine's own lease in a fleet, and what it may trust on it (the module docstring).

    `until` is how long the lease runs by this engine's own renewals (trio's clock, the module
    docstring; -inf before the first and after a lapse was seen); the heartbeat thread
    (`_heartbeat.Keeper`, PostgreSQL) may know of a later one (`runs_until`). Only a fleet
    engine has one (`_mode.Fleet`); `epoch` and `released` are its own (docs/adr/0133)."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        tally: Tally,
        *,
        owner: str,
        lease: float,
    ) -> None:
        self._store = store
        self._clock = clock
        self._writes: Writes  # `bind`: the write path, built after the mode it asks
        self._tally = tally
        self._owner = self.owner = owner
        self.lease = float(lease)
        # The trust epoch (only grows: the module docstring) and the flows this engine let go,
        # to be released with the next renewal (id -> the revision let go at; an id leaves when
        # that renewal is through, or when a write gives the flow back). The lease's own state:
        # the others read it and tell the lease (`_mode.Fleet`).
        self.epoch = 0
        self.released: dict[str, int] = {}
        # This opening of the owner name (docs/adr/0071): a fleet engine's lease row names it,
        # and only this incarnation renews it.
        self.incarnation = uuid.uuid4().hex
        # How long before its lease lapses (by its own view) this engine lets the flow go: for
        # the rates of its clock and the database's, which may differ a little.
        self.margin = lease * _LEASE_MARGIN
        self.until = -math.inf
        # The thread that renews the lease without the trio loop (PostgreSQL), and the
        # instrument that follows its renewals when the loop wakes up.
        self._keeper: _heartbeat.Keeper | None = None
        self._instrument: _heartbeat.Trust | None = None
        self._trusted_until = -math.inf  # the lease the step deadlines were last set to
        self._superseded = False  # another incarnation holds the owner name now
        # What the lease row says besides the lease, to write it again if it goes missing
        # (`renew`); set by `claim`.
        self._registration: _store.Registration | None = None

    def bind(self, writes: Writes) -> None:
        """The write path whose live flows this lease's trust is about."""
        self._writes = writes

    # --------------------------------------------------------------------- opening, closing

    async def claim(self, now: float, plans: list[tuple[str, int]]) -> None:
        """Open this incarnation of the owner name (docs/adr/0071): `StoreLocked` while another
        incarnation holds it with a live lease (and is not proven gone), by the lease clock. On
        PostgreSQL, start the thread that renews the lease from then on (`_heartbeat.Keeper`).
        `now` is the engine's clock (the lease clock on SQLite)."""
        began = trio.current_time()
        claim = partial(
            _store.claim_on_clock,
            owner=self._owner,
            incarnation=self.incarnation,
            lease=self.lease,
            now=now,
            host=host_identity(),
            pid=os.getpid(),
            plans=plans,
            gone=process_gone,
        )
        holder, at = await self._store.transact(claim)
        if holder is not None:
            raise _locked(self._owner, holder, at)
        until = began + self.lease
        self.until = until
        self._trusted_until = until
        self._registration = _store.Registration(
            host=host_identity(), pid=os.getpid(), started_at=at, plans=tuple(plans)
        )
        dsn = _heartbeat.keeper_for(self._store)
        if dsn is not None:
            self._keeper = _keeper(dsn, self, until)
            self._instrument = _heartbeat.Trust(self._on_loop_wake)
            trio.lowlevel.add_instrument(self._instrument)
            self._keeper.start()
        _log.info(
            "flow engine %r opened on the fleet (incarnation %s, lease %g s)",
            self._owner,
            self.incarnation,
            self.lease,
            extra={"owner": self._owner},
        )

    async def stop_keeper(self) -> None:
        """Stop the heartbeat thread (waiting for it) and remove the instrument. Idempotent;
        shielded."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            await keeper.stop()
        if self._instrument is not None:
            trio.lowlevel.remove_instrument(self._instrument)
            self._instrument = None

    async def end(self) -> None:
        """At close: end this engine's lease (its steps are cancelled by then), so that other
        engines take its flows over at their next scan instead of after the lease. Best effort:
        a database error leaves them to lapse."""
        await self.stop_keeper()
        now = self._clock.now()
        end = partial(
            _store.end_lease_on_clock, owner=self._owner, incarnation=self.incarnation, now=now
        )
        try:
            await self._store.transact(end)
        except Exception as exc:
            _retry.next_round(
                exc,
                f"flow engine {self._owner!r} ended its lease at close",
                then="its flows wait for the lease to lapse",
                extra={"owner": self._owner},
            )

    # ------------------------------------------------------------------------------- trust

    def runs_until(self) -> float:
        """How long this engine's lease is known to run (trio's clock): its own renewals and its
        heartbeat thread's, whichever is later; -inf once another incarnation holds the name."""
        keeper = self._keeper
        if self._superseded or (keeper is not None and keeper.superseded):
            return -math.inf
        if keeper is None:
            return self.until
        return max(self.until, keeper.held_until)

    def lapsing(self) -> bool:
        """Is this engine's lease about to lapse (within the margin)?"""
        return trio.current_time() >= self.runs_until() - self.margin

    def trust_deadline(self) -> float:
        """The trio time until which a body may run on this engine's lease."""
        return self.runs_until() - self.margin

    def _retrust(self) -> None:
        """Move the deadlines of the bodies this engine runs to what its lease allows now. No
        checkpoint; O(flows it runs), once per renewal."""
        until = self.runs_until()
        if until == self._trusted_until:
            return
        self._trusted_until = until
        deadline = self.trust_deadline()
        for live in self._writes.live.values():
            if live.scope is not None:
                live.scope.deadline = deadline

    def _on_loop_wake(self) -> None:
        """Before trio fires expired deadlines (`_heartbeat.Trust`): follow the heartbeat
        thread's renewals, so that a body's deadline expires only if the lease lapsed."""
        if self.runs_until() != self._trusted_until:
            self._retrust()

    def lose_all(self, why: str) -> None:
        """This engine's lease lapsed (or is about to): stop every step and compensation it runs
        (their changes are discarded, nothing is recorded for them), forget their flows (to be
        released with the next renewal) and say so once (WARNING). No checkpoint."""
        lives = list(self._writes.live.values())
        for live in lives:
            self._writes.let_go(live, release=True)
        self.until = min(self.until, trio.current_time())
        if lives:
            _log.warning(
                "flow engine %r lost its lease (%s): it let %d running flow(s) go, their steps"
                " cancelled; another engine takes them over",
                self._owner,
                why,
                len(lives),
                extra={"owner": self._owner, "lost": len(lives)},
            )

    # ------------------------------------------------------------------------------ renewal

    async def renew(self) -> None:
        """One renewal of this engine's lease, given up at the margin before it lapses. The
        flows it let go meanwhile are released in the same transaction: the moment its lease
        runs again, they are orphans for any engine to take, not stranded under its name. A
        renewal after a lapse starts a new epoch and rechecks the flows it runs (the module
        docstring).

        A lease row gone missing (`_store.RowMissing`: the database lost it, or another engine
        pruned it after a lapse) is no other incarnation's: the renewal is made again at once,
        writing the row again, and counts as one after a lapse (its flows re-read, those taken
        meanwhile let go), with a WARNING. Only a row of another incarnation is `Superseded`."""
        began = trio.current_time()
        until = began + self.lease  # what this renewal holds, if it goes through
        lapsed = self.lapsing()
        deadline = max(self.until - self.margin, began + self.lease / 3)
        released = dict(self.released)
        if self._superseded:
            return
        with trio.move_on_at(deadline):
            try:
                rows, restored = await self._renewal(released, lapsed)
            except _store.Superseded:
                self._superseded = True
                _log.warning(
                    "flow engine %r lost its lease for good: another engine opened under the"
                    " same owner name after this one's lease lapsed; this one runs no flow"
                    " any more (close it)",
                    self._owner,
                    extra={"owner": self._owner},
                )
                self.lose_all("another engine opened under the same owner name")
                return
            self._renewed(rows, lapsed or restored, until, released)
            return
        if self.lapsing():
            # Until a renewal gets through it runs nothing: what it starts or accepts is let go
            # at once (`Runner`), an orphan for the others to take over.
            self.lose_all("it could not renew it in time")

    async def _renewal(self, released: dict[str, int], lapsed: bool) -> tuple[list[Flow], bool]:
        """The renewal's transaction, retried while the store is unavailable (the caller
        bounds it), written again once if the row went missing: the rows it re-read (after a
        lapse), and whether it wrote the row again (a WARNING)."""
        now = self._clock.now()
        restore: _store.Registration | None = None
        while True:
            renew = partial(
                _store.renew_on_clock,
                owner=self._owner,
                lease=self.lease,
                now=now,
                let_go=sorted(released.items()),
                reread=sorted(self._writes.live) if lapsed else None,
                incarnation=self.incarnation,
                restore=restore,
            )
            try:
                # At once again (the pool opens a fresh connection for a dead one), then after
                # a pause, until the margin.
                rows: list[Flow] = await _retry.retrying(
                    partial(self._store.transact, renew),
                    what=f"renewing the lease of flow engine {self._owner!r}",
                    extra={"owner": self._owner},
                    schedule=_retry.LEASE_RENEWAL,
                )
            except _store.RowMissing:
                if restore is not None or self._registration is None:
                    raise  # a bug: a renewal that restores writes the row
                restore = self._registration
                lapsed = True
                continue
            break
        if restore is not None:
            _log.warning(
                "flow engine %r: its lease row was missing from the engines table (lost by the"
                " database in a crash or a restore, or pruned after its lease lapsed) and was"
                " written again: as after a lapse, it re-read the %d flow(s) it runs and lets"
                " go those another engine took over meanwhile",
                self._owner,
                len(rows),
                extra={"owner": self._owner, "reread": len(rows)},
            )
        return rows, restore is not None

    def _renewed(
        self, rows: list[Flow], lapsed: bool, until: float, released: dict[str, int]
    ) -> None:
        """A renewal went through: after a lapse a new epoch, the flows it runs rechecked on
        the rows it re-read; the lease trusted until `until`; the flows it `released` are
        forgotten (unless let go again since). No checkpoint."""
        writes = self._writes
        if lapsed or self.lapsing():
            self.epoch += 1
            for row in rows:
                live = writes.live.get(row.flow_id)
                if live is not None:
                    recheck(writes, live, row, self.epoch)
        self.until = until
        if self._keeper is not None:
            self._keeper.extend(until)
        self._retrust()
        self._tally.stats["renewals"] += 1
        for fid, revision in released.items():
            if self.released.get(fid) == revision:
                del self.released[fid]


def _locked(owner: str, holder: _store.Holder, at: float) -> StoreLocked:
    """The error of a claim while `holder` holds the owner name (`Lease.claim`)."""
    where = "this process" if holder.pid == os.getpid() else f"process {holder.pid}"
    if holder.host != host_identity():
        where += " on another host" if holder.host is not None else ""
    return StoreLocked(
        f"another flow engine runs as owner {owner!r} ({where}; its lease runs"
        f" {holder.lease_until - at:.1f} s more): one live engine per owner name. Give this"
        " engine another owner name, or stop that one (a restart under the same name takes"
        " over once that engine closed, died on this host, or let its lease lapse)"
    )


def _keeper(dsn: str, lease: Lease, until: float) -> _heartbeat.Keeper:
    """The thread that renews `lease` from `until` on (not started yet). It reads trio's clock
    as perf_counter plus trio's offset: trio's own clock is just that (a MockClock moved by hand
    is not: docs/adr/0110)."""
    offset = trio.current_time() - time.perf_counter()
    return _heartbeat.Keeper(
        dsn,
        owner=lease.owner,
        incarnation=lease.incarnation,
        lease=lease.lease,
        margin=lease.margin,
        held_until=until,
        clock=lambda: time.perf_counter() + offset,
    )


def recheck(writes: Writes, live: Live, row: Flow | None, epoch: int) -> bool:
    """A row of the live flow, read in `epoch`: True if it is the copy this engine runs and the
    flow is still held by this engine (the copy is then trusted in `epoch`); else the row is
    followed (`Writes.track`: a newer row, which may drop the flow) or the flow let go (it is
    released, or gone), and False. An older row (a write of this engine that the read did not
    see yet) changes nothing. No checkpoint."""
    if row is None:
        writes.let_go(live)
        return False
    if row.revision > live.flow.revision:
        writes.track(live.flow.state, row, False, epoch=epoch, write=False)
        return False
    if row.revision < live.flow.revision:
        return False
    if writes.runs_here(row):
        live.epoch = epoch
        return True
    writes.let_go(live)
    return False
