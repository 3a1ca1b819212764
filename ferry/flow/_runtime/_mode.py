"""How this engine shares its store, picked once at open (docs/adr/0132): `Mode`, what the
runtime's parts ask of it, and `OneFile`, the mode of an engine alone on its store.

There are two ways to share a store. *One file* (SQLite): the file's engine lock keeps every
other engine out, so every write of every flow is this engine's, every copy it holds is
trusted, and no lease is kept. *A fleet* (PostgreSQL; SQLite in some tests): engines share the
store under leases, and what a copy or a lease may be trusted for is the lease's rule
(`_fleet._lease`, docs/adr/0047). The composition root (`_engine._parts`) builds one of the two,
as trio picks its IO manager: the runner, the write path, recovery, the waits and the requests
ask it, and never branch on which it is. `_fleet._mode.Fleet` is the fleet's.

`epoch` and the map of the flows let go (`release_later`, `given_back`) are the mode's own
state (the lease's, in a fleet): other parts read `epoch` and tell the mode, never write them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import trio

from ferry.projected import Store

from .._model._timers import Entry
from .._model._values import Flow
from .._store import _store
from ._live import Live


class Listening(Protocol):
    """A thread that hears which flows settled (`_fleet._listener.Listener`); `connects`
    counts its connections."""

    connects: int

    def start(self) -> None: ...

    async def stop(self) -> None: ...


#: Makes the listener of the waits: ``listen(on_flows, on_state)``.
Listen = Callable[
    [Callable[[list[tuple[str, int]] | None], None], Callable[[bool], None]], Listening
]


class Mode(Protocol):
    """What the runtime asks of the way this engine shares its store (the module docstring).

    `shared`: other engines write this store's flows too (a fleet), so a flow this engine does
    not hold may move without it (the waits read it) and an outside request leaves a flow with
    the engine that runs it. `guard`: how long one of this engine's transactions may sit idle
    holding its locks (`_store.guard_locks`), or None. `epoch`: the trust epoch (only grows;
    a copy of a flow made in an older one is read again before a body runs on it). `listen`:
    makes the waits' listener, or None where there is none; `listen_signals`: the readers' of
    events and streams (`_feeds`), which hears their flows' writes too (docs/adr/0177)."""

    shared: bool
    guard: float | None
    listen: Listen | None
    listen_signals: Listen | None

    @property
    def epoch(self) -> int: ...

    # the write path
    def holds(self, flow: Flow) -> bool:
        """Does the store's record say this engine runs this active flow?"""
        ...

    def fires(self, flow: Flow) -> bool:
        """Does this engine fire the timer of this parked flow?"""
        ...

    def release_later(self, fid: str, revision: int) -> None:
        """The engine let the flow go at `revision`: release it in the store with the next
        renewal."""
        ...

    def given_back(self, fid: str) -> None:
        """A write gave the flow back to this engine: a release still pending is void."""
        ...

    # the runner
    def ready(self, live: Live) -> bool:
        """May a body run on this copy now, without a read first? No checkpoint."""
        ...

    async def make_ready(self, live: Live) -> bool:
        """`ready` said no: read the copy again or let the flow go; True if a body may run on
        it now. A checkpoint."""
        ...

    def body_deadline(self) -> float:
        """The trio time until which a body may run (inf: no bound)."""
        ...

    def voided(self, live: Live) -> None:
        """A body's scope was cancelled: if that was the lease lapsing, let every flow go."""
        ...

    async def hand_over(self, live: Live) -> bool:
        """A flow of a version this engine lacks: True if it was left to an engine that has
        it; else False (it is blocked)."""
        ...

    # recovery and the engine's lifetime
    async def claim(self, plans: list[tuple[str, int]]) -> list[Flow]:
        """At open: take what this engine may run, and the active flows it runs again."""
        ...

    async def first_round(self) -> None:
        """At open, after the flows it runs again: what else it takes (a fleet's first
        scan)."""
        ...

    def start(self, nursery: trio.Nursery) -> None:
        """The mode's own tasks of a serving engine (a fleet's heartbeat and scans)."""
        ...

    async def leave(self) -> None:
        """At close, after the tasks ended: end what the mode holds (a fleet's lease)."""
        ...

    async def stop(self) -> None:
        """Last: stop the mode's threads. Idempotent; shielded by the caller."""
        ...


class OneFile:
    """The mode of an engine alone on its store (one SQLite file): every active flow is its to
    run, every copy is trusted, nothing is leased or handed over."""

    shared = False
    guard: float | None = None
    listen: Listen | None = None
    listen_signals: Listen | None = None
    epoch = 0

    def __init__(self, store: Store, load_timers: Callable[[Iterable[Entry]], None]) -> None:
        self._store = store
        self._load_timers = load_timers

    def holds(self, flow: Flow) -> bool:
        return True

    def fires(self, flow: Flow) -> bool:
        return True  # a version it lacks blocks its flow: versions fail closed

    def release_later(self, fid: str, revision: int) -> None:
        pass  # no lease to release it from: the store names no holder to wait for

    def given_back(self, fid: str) -> None:
        pass

    def ready(self, live: Live) -> bool:
        return True

    async def make_ready(self, live: Live) -> bool:
        await trio.lowlevel.checkpoint()
        return True

    def body_deadline(self) -> float:
        return float("inf")

    def voided(self, live: Live) -> None:
        pass

    async def hand_over(self, live: Live) -> bool:
        return False  # no other engine: it blocks (the caller's write is the checkpoint)

    async def claim(self, plans: list[tuple[str, int]]) -> list[Flow]:
        """Every parked flow's timer armed, and every running or compensating flow."""
        self._load_timers(await self._store.transact(_store.load_deadlines))
        return await self._store.transact(_store.load_active)

    async def first_round(self) -> None:
        pass  # nothing more to take (recovery's reads were its checkpoints)

    def start(self, nursery: trio.Nursery) -> None:
        pass

    async def leave(self) -> None:
        await trio.lowlevel.checkpoint()

    async def stop(self) -> None:
        await trio.lowlevel.checkpoint()
