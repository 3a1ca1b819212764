"""`Engine.wait`: a watch per flow somebody waits for, and how a wait learns that its flow settled.

Design
------
A wait is an stm transaction on its flow's watch (`_Watch`) that returns once the watch holds
a settled row (`COMPLETED`, `FAILED`, `BLOCKED`). What moves the watch, and what it costs, depends
on who may write the flow (docs/adr/0096):

1. *One engine per store* (SQLite: the file's engine lock keeps every other engine, and the
   operator's tools, which open one, out while this one is open): every write of every flow is
   this engine's, and `Engine._track` puts each one in the watch (`Waiters.saw`). A wait reads
   the row once if this engine does not hold the flow, and never again.
2. *A fleet, and this engine holds the flow* (it is in `Engine._live`: running, compensating, or
   waiting for a runner slot): the writes that move it are this engine's own, or ones it hears
   of at its next write or check of the flow (a cancel made by another engine). No read.
3. *A fleet, and the flow is elsewhere* (parked, which any engine may wake; run by another
   engine; held by nobody): on PostgreSQL the batch that settles it notifies (`_notify`), this
   engine's listener hears it (`_listener`, started by the first wait that needs it, stopped
   with the engine), and one read brings the rows of all the flows a notification names that
   somebody here waits for. Besides, a fallback read at most once per lease per flow, for a
   notification that was lost (the listener was reconnecting). While the listener is not
   listening (or the store has none), a wait reads its row 50 ms after the last read, doubling
   up to 1 s (a poll), as before notifications.

A flow moves between 2 and 3 under a wait: `Held`, the map of the flows the engine holds, tells
the watches. Taken over, woken or adopted here (3 to 2): reads stop. Let go, lost, released,
parked, or ended by this engine (2 to 3): reads start. A notification of a flow held here is
not read but remembered (`_Watch.missed`): if the flow leaves at a revision older than that,
one read follows; the listener's reconnection makes every held watch remember "unknown".

A wait whose flow cannot settle answers at once (`_Watch.answer`), whichever case it is in:

- *Gone*: a read finds no row for it (on a fleet, the flow ended and was purged, by retention or
  the inspector's ``purge``, before this engine read it): `UnknownFlow`, as for an unknown id.
- *Refused*: the database refuses every write of its row (`refused`: the runner, or recovery,
  could not even fail the flow, docs/adr/0117): `ferry.Failed` naming the database's reason,
  for every wait on it from then on, until a newer row of the flow is seen (`saw`).

Reads are shared: a flow whose read is due goes into `_pending` and its watch is marked
`stale`; the first of the waits so woken takes everything pending and reads it in one
transaction (`_store.load_many`); the others find their watch moved. A wait cancelled during
that read puts what it took back.

Invariants (all on the trio thread of the engine's run):

- `_watches[fid]` exists while a wait for `fid` runs (`users` > 0), and not after.
- `_Watch.known` is the newest row of the flow this engine knows; it never moves back to an
  older revision. The TVar `_Watch.flow` holds the same row whenever that row is settled or was
  read for a wait; else it may hold an older unsettled row, or None (`_put`).
- In a fleet, `_Watch.here` is True iff the flow is in `held` (off a fleet nothing reads it,
  and it is not kept).
- `_Watch.stale` is True only while its flow id is in `_pending` (an id may be pending without
  it: left there by a read the store could not answer, for the next read to take along); every
  id in `_pending` has a watch.
"""

from __future__ import annotations

import enum
import logging
import math
import sys
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import trio

import stm
from ferry import Closed, Failed

from .._model import _checks
from .._model._errors import UnknownFlow
from .._model._types import State
from .._model._values import Flow
from .._store import _store
from .._store._notify import SETTLED
from . import _retry
from ._mode import Listen, Listening

T = TypeVar("T")

_log = logging.getLogger("ferry.flow")

_POLL_FIRST = 0.05  # seconds: without notifications, a wait reads its row this long after the last
_POLL_MAX = 1.0  # and at most this far apart (the delay doubles)
_UNKNOWN = sys.maxsize  # `_Watch.missed` when the listener may have missed anything


class Reader(Protocol):
    """How the waits read (`Engine._read`): ``fn(tx)`` in a transaction, `ferry.Failed` if the
    store failed while `what`."""

    def __call__(self, fn: Callable[[Any], T], what: str, /) -> Awaitable[T]: ...


class Holding(Protocol):
    """What the engine holds a flow with (`Engine._Live`): its latest committed row."""

    flow: Flow


H = TypeVar("H", bound=Holding)


class _Step(enum.Enum):
    """What a wait does next, other than return its flow (`Waiters._next`)."""

    LISTEN = enum.auto()  # start the listener first
    TAKE = enum.auto()  # read what is pending (this flow among it)
    READ = enum.auto()  # read this flow (and what is pending): its fallback read or poll is due


class _Watch:
    """The flows somebody waits for, one each (see the module's invariants)."""

    __slots__ = ("answer", "flow", "here", "known", "missed", "read_at", "stale", "users")

    def __init__(self, here: bool) -> None:
        self.flow: stm.TVar[Flow | None] = stm.TVar(
            None
        )  # `known`, as of the last read or settling
        self.known: Flow | None = None  # the same, outside transactions
        self.here = stm.TVar(here)  # is the flow held by this engine?
        self.stale = stm.TVar(False)  # is a read of it pending?
        self.missed = 0  # the newest revision a notification named while the flow was held
        self.read_at = -math.inf  # trio time the last read of its row began
        self.users = 0  # waits on it
        # What its waits raise at once (the flow is gone, or refuses every write), or None.
        self.answer: stm.TVar[Callable[[], Exception] | None] = stm.TVar(None)


class Held(dict[str, H]):
    """The flows the engine holds, by id (`Engine._live`): a dict that tells the waiters when
    a flow comes or goes, whichever way that happens, so that no path of the engine can move a
    flow without its waits knowing. O(1) more per change; reads are plain dict reads."""

    __slots__ = ("_waiters",)

    def __init__(self, waiters: Waiters[H]) -> None:
        super().__init__()
        self._waiters = waiters

    def __setitem__(self, fid: str, value: H) -> None:
        new = fid not in self
        super().__setitem__(fid, value)
        if new:
            self._waiters._moved(fid, here=True)

    def __delitem__(self, fid: str) -> None:
        super().__delitem__(fid)
        self._waiters._moved(fid, here=False)

    def pop(self, fid: str, *default: Any) -> Any:
        if fid not in self:
            return super().pop(fid, *default)
        value = self[fid]
        del self[fid]
        return value

    def popitem(self) -> tuple[str, H]:
        fid = next(reversed(self))
        return fid, self.pop(fid)

    def clear(self) -> None:
        for fid in list(self):
            del self[fid]

    def setdefault(self, fid: str, default: H) -> H:
        if fid not in self:
            self[fid] = default
        return self[fid]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for fid, value in dict(*args, **kwargs).items():
            self[fid] = value


class Waiters(Generic[H]):
    """The waits of one engine (see the module's docstring). `held` is the engine's map of the
    flows it holds; `saw` is told every row the engine commits or reads; `aclose` stops the
    listener. `reads` counts the store reads made for waits; `listener` is the listener, once a
    wait started it.

    `shared`: other engines write the store's flows (a fleet, `_mode.Mode.shared`): a flow not
    held here may move without this engine. `listen` makes the listener (`_mode.Mode.listen`;
    None: there is none, waits poll)."""

    def __init__(
        self,
        *,
        shared: bool,
        listen: Listen | None,
        lease: float,
        closed: stm.TVar[bool],
        read: Reader,
    ) -> None:
        self._shared = shared
        self._lease = lease
        self._closed = closed
        self._read = read
        self._make_listener = listen
        self._watches: dict[str, _Watch] = {}
        self._pending: set[str] = set()
        self._listening = stm.TVar(False)
        self._shut = False
        self.listener: Listening | None = None
        self.held: Held[H] = Held(self)
        self.reads = 0
        # The flows whose every write the database refuses (`refused`), by id: the row left as
        # it is and what its waits raise, until a newer row of it is seen.
        self._refused: dict[str, tuple[Flow, Callable[[], Exception]]] = {}

    # ------------------------------------------------------------------- the engine's side

    def saw(self, flow: Flow) -> None:
        """A committed row of the flow (written or read by the engine): into its watch, if a
        wait watches it, unless the watch has a newer one. O(1); no checkpoint."""
        watch = self._watches.get(flow.flow_id)
        if watch is not None:
            _put(watch, flow)
        if self._refused:
            left = self._refused.get(flow.flow_id)
            if left is not None and _newer(flow, left[0]):
                del self._refused[flow.flow_id]  # the row took a write after all
                if watch is not None:
                    stm.atomically_nowait(watch.answer.set, None)

    def refused(self, flow: Flow, problem: str, error: BaseException) -> None:
        """The database refuses every write of `flow` (this row), even the one that fails it:
        it is left as it is (docs/adr/0117), and every wait on it raises `ferry.Failed` naming
        `problem` (its cause `error`) at once, until a newer row of it is seen. No checkpoint."""
        fid = flow.flow_id
        answer = partial(_cannot_end, flow, problem, error)
        self._refused[fid] = (flow, answer)
        watch = self._watches.get(fid)
        if watch is not None:
            stm.atomically_nowait(watch.answer.set, answer)

    def _moved(self, fid: str, *, here: bool) -> None:
        """The engine took the flow (`here`) or let it go (`Held`)."""
        watch = self._watches.get(fid)
        if watch is None or not self._shared:
            return  # off a fleet no wait reads `here` (every change is this engine's to see)
        stm.atomically_nowait(watch.here.set, here)
        missed, watch.missed = watch.missed, 0
        if here:
            return
        watch.read_at = trio.current_time()  # the engine knew the flow until now
        known = watch.known
        if known is None or (known.state not in SETTLED and missed > known.revision):
            self._due([fid])

    async def aclose(self) -> None:
        """Stop the listener, if a wait started one (waits raise `Closed` by then). A
        checkpoint; idempotent."""
        self._shut = True
        listener, self.listener = self.listener, None
        if listener is not None:
            await listener.stop()
        else:
            await trio.lowlevel.checkpoint()

    # --------------------------------------------------------------------- the listener's side

    def _listen(self) -> None:
        """Start the listener, if there can be one and it is not running. No checkpoint."""
        make = self._make_listener
        if make is None or self.listener is not None or self._shut:
            return
        self.listener = make(self._heard, self._state)
        self.listener.start()

    def _state(self, listening: bool) -> None:
        """The listener started (again) or stopped listening: what was announced while it did
        not listen is lost, so every flow waited for is read once (or, if held here, once it
        leaves)."""
        if self._shut:
            return
        stm.atomically_nowait(self._listening.set, listening)
        if listening:
            self._heard(None)

    def _heard(self, pairs: list[tuple[str, int]] | None) -> None:
        """A notification: these flows settled at these revisions (None: any flow may have).
        The flows waited for here whose watch is older are read (once, for all of them); those
        held here are remembered instead."""
        if self._shut:
            return
        if pairs is None:
            pairs = [(fid, _UNKNOWN) for fid in self._watches]
        due: list[str] = []
        for fid, revision in pairs:
            watch = self._watches.get(fid)
            if watch is None:
                continue
            known = watch.known
            if known is not None and (known.state in SETTLED or known.revision >= revision):
                continue
            if watch.here.peek():
                watch.missed = max(watch.missed, revision)
            else:
                due.append(fid)
        self._due(due)

    def _due(self, fids: Iterable[str]) -> None:
        """A read of these flows is due: pending, and their waits woken."""
        woken: list[stm.TVar[bool]] = []
        for fid in fids:
            watch = self._watches.get(fid)
            if watch is None:
                continue
            self._pending.add(fid)
            if not watch.stale.peek():
                woken.append(watch.stale)
        if woken:
            stm.atomically_nowait(_set_all, woken, True)

    def _take(self) -> set[str]:
        """Everything pending, no longer pending (their reads begin now)."""
        fids, self._pending = self._pending, set()
        now = trio.current_time()
        stale = []
        for fid in fids:
            watch = self._watches[fid]
            watch.read_at = now
            stale.append(watch.stale)
        if stale:
            stm.atomically_nowait(_set_all, stale, False)
        return fids

    # --------------------------------------------------------------------------- the wait

    async def wait(self, fid: str, timeout: float | None) -> Flow:  # noqa: ASYNC109
        """Until the flow is settled; its row then (see `Engine.wait`)."""
        _check_timeout(timeout)
        watch = self._watches.get(fid)
        if watch is None:
            watch = self._watches[fid] = _Watch(fid in self.held)
        watch.users += 1
        deadline = trio.current_time() + (math.inf if timeout is None else timeout)
        try:
            left = self._refused.get(fid)
            if left is not None:
                await trio.lowlevel.checkpoint()
                raise left[1]()
            held = self.held.get(fid)
            if held is not None:
                flow = held.flow
            else:
                if self._shared:
                    self._listen()  # before the read: a settling after it is heard
                watch.read_at = trio.current_time()
                loaded = await self._load_until(fid, deadline)
                if loaded is None:
                    raise UnknownFlow(f"no flow has id {fid!r}")
                flow = loaded
            # A read row always reaches the TVar; the engine's own copy, like its writes, only
            # if settled (a held flow is active: the wait's transaction has nothing to see yet).
            _put(watch, flow, read=held is None)
            if flow.state in SETTLED:
                await trio.lowlevel.checkpoint()
                return flow
            if timeout is None:  # no cancel scope to open (each costs its bookkeeping)
                return await self._until_settled(fid, watch)
            with trio.move_on_at(deadline):
                return await self._until_settled(fid, watch)
            raise trio.TooSlowError(_timed_out_message(watch.known or flow, timeout))
        finally:
            watch.users -= 1
            if not watch.users and self._watches.get(fid) is watch:
                del self._watches[fid]
                self._pending.discard(fid)

    async def _until_settled(self, fid: str, watch: _Watch) -> Flow:
        poll = _POLL_FIRST
        failing = False  # the last read failed: read again after `poll`, not after a lease
        while True:
            step = await stm.atomically(self._next, watch, poll, failing)
            if isinstance(step, Flow):
                return step
            if step is _Step.LISTEN:
                self._listen()
                continue
            if step is _Step.READ:
                if self._listening.peek() and not failing:
                    # Another wait's read brought this row meanwhile (the same revision)?
                    if trio.current_time() < watch.read_at + self._lease:
                        continue
                else:
                    poll = min(poll * 2, _POLL_MAX)
                self._pending.add(fid)  # with whatever else is due
            failing = not await self._read_due(fid)

    def _next(self, watch: _Watch, poll: float, failing: bool) -> Flow | _Step:
        """The wait's transaction: its settled row, or what to do before waiting again."""
        if self._closed.get():
            raise Closed("the flow engine closed while waiting")
        flow = watch.flow.get()
        if flow is not None and flow.state in SETTLED:
            return flow
        answer = watch.answer.get()
        if answer is not None:
            raise answer()
        if not self._shared or watch.here.get():
            stm.retry()  # every change of the flow is this engine's to see
        if watch.stale.get():
            return _Step.TAKE
        if self._make_listener is not None and self.listener is None and not self._shut:
            return _Step.LISTEN
        period = poll if failing or not self._listening.get() else self._lease
        stm.retry(deadline=watch.read_at + period)
        return _Step.READ

    async def _read_due(self, fid: str) -> bool:
        """Read every pending flow in one transaction into its watch; False if the store was
        unavailable (WARNING; they stay pending, and this wait reads again after its poll).
        Raises `ferry.Failed` if the store failed otherwise (the others read them again)."""
        fids = self._take()
        if not fids:
            return True
        before = {f: self._watches[f].known for f in fids}
        self.reads += 1
        try:
            rows = await self._read(
                partial(_store.load_many, flow_ids=sorted(fids)),
                f"reading {len(fids)} flows waited for",
            )
        except Failed as exc:
            if not _retry.unavailable(exc):
                self._due(fids)  # the other waits read them (and meet the error themselves)
                raise
            _log.warning(
                "flow store unavailable while waiting for flow %r: %r; reading again in"
                " %.2f s at most",
                fid,
                exc.__cause__,
                _POLL_MAX,
                extra={"flow_id": fid},
            )
            # Pending, but nobody is woken: each wait reads them at its next poll.
            self._pending.update(f for f in fids if f in self._watches)
            return False
        except BaseException:  # cancelled (the wait's timeout): another wait reads them
            self._due(fids)
            raise
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("waits: read %d flows (%d found)", len(fids), len(rows))
        for row in rows:
            watch = self._watches.get(row.flow_id)
            if watch is not None:
                _put(watch, row, read=True)
        if len(rows) < len(fids):
            _answer_gone(self._watches, fids - {row.flow_id for row in rows}, before)
        return True

    async def _load_until(self, fid: str, deadline: float) -> Flow | None:
        """The flow's row, retried while the store is unavailable, until `deadline` (trio time):
        then `ferry.Failed` (the flow could not be read once)."""
        load = partial(_store.load, flow_id=fid)
        what = f"reading flow {fid!r}"
        backoff = _retry.Backoff(what, extra={"flow_id": fid})
        try:
            self.reads += 1
            return await self._read(load, what)
        except Failed as exc:
            last = exc
        with trio.move_on_at(deadline):
            while True:
                await backoff.pause(last)
                try:
                    self.reads += 1
                    return await self._read(load, what)
                except Failed as exc:
                    last = exc
        raise Failed(
            f"the flow store stayed unavailable while waiting for flow {fid!r}: {last}"
        ) from last.__cause__


def _put(watch: _Watch, flow: Flow, *, read: bool = False) -> None:
    """Make `flow` the watch's row, unless the watch has this revision or a newer one of the same
    flow (one created at the same time: an id may be reused once its flow was deleted). A row
    the waits `read` always reaches the TVar (reads are rare); one of the engine's own writes
    only when it settles the flow or leaves a settled state."""
    known = watch.known
    if known is not None:  # (created_at, revision) compared, without building the tuples
        created, was = flow.created_at, known.created_at
        if was > created or (was == created and known.revision >= flow.revision):
            return
    watch.known = flow
    answer = watch.answer.peek()
    if answer is not None and getattr(answer, "func", None) is _gone:
        stm.atomically_nowait(watch.answer.set, None)  # the id was started again
    # The TVar changes only when the flow settles or leaves a settled state: its waits wake once,
    # not at every step (`known` has every row, for the timeout's message).
    shown = watch.flow.peek()
    if read or flow.state in SETTLED or (shown is not None and shown.state in SETTLED):
        stm.atomically_nowait(watch.flow.set, flow)


def _check_timeout(timeout: object) -> None:
    """`ValueError` unless `timeout` is a wait's: seconds >= 0, or None."""
    if timeout is not None and not (
        isinstance(timeout, int | float)
        and not isinstance(timeout, bool)
        and timeout >= 0
        and (timeout == math.inf or _checks.finite(timeout))
    ):
        raise ValueError(
            f"timeout must be a number of seconds >= 0 (a float: at most about 1e308) or"
            f" None, got {_checks.shown_number(timeout)}"
        )


def _cannot_end(flow: Flow, problem: str, error: BaseException) -> Exception:
    """What the waits on a flow whose every write is refused raise (`Waiters.refused`)."""
    exc = Failed(
        f"flow {flow.flow_id!r} cannot end: {problem}; it is left as it is ({flow.state.name}"
        f" at step {flow.step!r}, revision {flow.revision}), not run by this engine"
    )
    exc.__cause__ = error
    return exc


def _answer_gone(
    watches: dict[str, _Watch], gone: Iterable[str], before: dict[str, Flow | None]
) -> None:
    """A read found no row of these flows: their waits answer `_gone`, unless a row of one came
    meanwhile (the id started again, here)."""
    for fid in gone:
        watch = watches.get(fid)
        if watch is not None and watch.known is before[fid]:
            stm.atomically_nowait(watch.answer.set, partial(_gone, fid))


def _newer(flow: Flow, than: Flow) -> bool:
    """Is `flow` a later row than `than` (a later revision, or the same id started again)?"""
    return (flow.created_at, flow.revision) > (than.created_at, than.revision)


def _gone(fid: str) -> Exception:
    """What a wait raises when its flow's row is no longer there."""
    return UnknownFlow(
        f"no flow has id {fid!r} any more: it was deleted while this wait waited for it (a"
        " finished flow purged, by retention or the inspector's purge, before this engine"
        " read how it ended)"
    )


def _set_all(tvars: list[stm.TVar[bool]], value: bool) -> None:
    for tvar in tvars:
        tvar.set(value)


def _timed_out_message(flow: Flow, timeout: float) -> str:
    """Why `wait` gave up: where the flow still is (as this engine last knew it)."""
    where = f"flow {flow.flow_id!r} is still {flow.state.name} at step {flow.step!r}"
    if flow.state is State.PARKED:
        where += " (a parked flow goes on when it is woken: Engine.wake"
        if flow.park_deadline is not None:
            where += ", or when its park times out"
        where += ")"
    elif flow.attempt > 1:
        where += f" (attempt {flow.attempt})"
    return f"{where} after {timeout:g} s"
