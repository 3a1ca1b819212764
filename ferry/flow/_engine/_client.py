"""A client of a flow store from any process: `connect` and `Client` (docs/adr/0125).

A client asks; the engine that serves the store acts. Each call that changes a flow (`start`,
`wake`, `cancel`, `resume`, `abandon`, `publish`) or a schedule (`trigger`, `pause`, `unpause`,
`unschedule`, `backfill`: `_client_schedules`) is checked at the call (`TypeError`/
`ValueError`, nothing stored), then stored as one row of ``flow_requests`` under a request id
(durable when the call returns, or raises anything but a bad argument), and then:

- an engine serves the store (SQLite: it holds the file's engine lock; PostgreSQL: a live
  engine's lease row): it is told at once (SQLite: the file's ``data_version`` its watch thread
  reads; PostgreSQL: a notification), applies the request through its own API and writes the
  answer into the row; the client waits for the answer the same way and returns it, or raises
  the engine's error (`IdReused`, `UnknownPlan`, ...). No answer within `timeout`:
  `trio.TooSlowError` (the request stays stored and is applied when an engine can: call again
  with the same `request_id` to wait for its answer);
- no engine serves it: the client applies `wake`, `cancel`, `resume` and `abandon` itself,
  through an operator's engine (``open_engine(store, [], serve=False)``), and returns the answer;
  a `start` or `publish` needs the plans or the mappers of an engine that serves the store, so it
  stays stored, and the next engine to open the store applies it (`Receipt.pending`).

A request id makes a retry safe: the same id again finds the stored request (its answer, or a
wait for it), never applies it twice; the same id with other arguments is a `ValueError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, final

import attrs
import trio

from ferry.projected import PostgresStore, SqliteStore, Store

from .._fleet._asked import Heard
from .._model import _checks, _limits, _values
from .._model._errors import (
    FlowError,
    IdReused,
    StoreLocked,
    UnknownFlow,
    UnknownPlan,
    UnknownSchedule,
)
from .._model._plan import Plan
from .._model._types import Delivery, Event, Json, Snapshot, State
from .._runtime import _read
from .._store import _dialect, _inbox, _notify, _schema, _sql, _store
from .._store._sqlite_file import Written, check_path
from . import _served
from ._client_schedules import ScheduleCalls
from ._client_signals import SignalCalls
from ._engine import Engine
from ._open import open_engine

_ERRORS: dict[str, type[Exception]] = {
    "IdReused": IdReused,
    "UnknownPlan": UnknownPlan,
    "UnknownFlow": UnknownFlow,
    "UnknownSchedule": UnknownSchedule,
    "TypeError": TypeError,
    "ValueError": ValueError,
}
_TICK = 0.002  # seconds between two reads of data_version without inotify, or settling
_LOOK_AGAIN = 1.0  # seconds: with inotify, a look at data_version at least this often
_RETRY_DIRECT = 0.5  # seconds: while waiting, how often to look whether the engine is gone
_SETTLED = frozenset({State.COMPLETED, State.FAILED, State.BLOCKED})


@final
@attrs.frozen
class Receipt:
    """What became of a client's last request (`Client.last`).

    `request_id`: its id. `served`: True if the engine that serves the store applied it (its
    owner name is `applied_by`); False if no engine served the store and a client applied it
    itself (`applied_by` then says which: ``"client (pid N on HOST)"``), or while `pending`.
    `pending`: stored, and left to the next engine that opens the store (a `start` or `publish`
    while no engine serves it); `applied_by` is None then."""

    request_id: str
    served: bool
    applied_by: str | None
    pending: bool


def connect(
    store: Store | str | os.PathLike[str], *, timeout: float = 10.0
) -> contextlib.AbstractAsyncContextManager[Client]:
    """A `Client` of `store` for the duration of an ``async with``; usable from any process,
    while an engine of another process serves the store or none does (see the module doc).

    `store`: the path of an SQLite file an engine has opened (never created: a missing file is
    `FileNotFoundError`, a file without flow tables a `ValueError`), or an open
    `SqliteStore`/`PostgresStore` (left open). `timeout`: seconds a call waits for the serving
    engine's answer (`trio.TooSlowError` after it; the request stays stored)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not (_checks.finite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a finite number > 0, got {timeout!r}")
    if isinstance(store, str | os.PathLike):
        path = check_path(store, who="flow.connect")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"no flow store at {path!r}: flow.connect acts on a store an engine made, and"
                " never creates one"
            )
    elif not isinstance(store, SqliteStore | PostgresStore):
        raise TypeError(f"store must be a path or a SqliteStore/PostgresStore, got {store!r}")
    return _connected(store, float(timeout))


@contextlib.asynccontextmanager
async def _connected(
    store: Store | str | os.PathLike[str], wait_for: float
) -> AsyncIterator[Client]:
    own = isinstance(store, str | os.PathLike)
    db: Store
    if isinstance(store, str | os.PathLike):
        db = SqliteStore(os.fspath(store), create=False)
    else:
        db = store
    try:
        if not await db.transact(_schema.has_tables):
            raise ValueError(
                f"{_where(db)} holds no flow tables: no flow engine has opened it (open an"
                " engine on it first)"
            )
        if not await db.transact(_inbox.has_requests):
            await db.transact(_inbox.create)
        yield Client(db, wait_for)
    finally:
        if own:
            with trio.CancelScope(shield=True):
                await db.aclose()


def _where(store: Store) -> str:
    path = getattr(store, "path", None)
    return repr(path) if isinstance(path, str) else "the PostgreSQL store"


def _request_id(value: object) -> str:
    if value is None:
        return uuid.uuid4().hex
    text = _checks.said(value, "request_id")
    if len(text) > 200:
        raise ValueError(f"request_id must be at most 200 characters, got {len(text)}")
    return text


def _raise(answer: dict[str, Any]) -> None:
    if "error" in answer:
        cls = _ERRORS.get(str(answer["error"]), FlowError)
        raise cls(str(answer.get("message", "")))


@final
class Client(ScheduleCalls, SignalCalls):
    """A client of one flow store, made by `connect` (no public constructor). `last`: the
    `Receipt` of its last request (None before the first). Every async method is a checkpoint;
    a call that raises `trio.Cancelled` after its request was stored leaves it stored (a retry
    with the same `request_id` finds it)."""

    def __init__(self, store: Store, timeout: float) -> None:
        self._store = store
        self._timeout = timeout
        self._me = f"client (pid {os.getpid()} on {socket.gethostname()})"
        #: What became of the last request (None before the first).
        self.last: Receipt | None = None
        self._held: Engine | None = None  # `_holding`'s operator's engine

    @contextlib.asynccontextmanager
    async def _holding(self) -> AsyncIterator[None]:
        """For many requests in a row (the inspector's bulk actions): if no engine serves the
        store, hold one operator's engine for all of them, not one per request (SQLite: the
        file's lock is held meanwhile, so no engine can open it; PostgreSQL: nothing is
        held)."""
        if self._held is not None or (
            _dialect.of(self._store).leases
            and await _read.read(
                self._store, partial(_live_engines, now=time.time()), "reading the engines' leases"
            )
        ):
            yield
            return
        try:
            opened = open_engine(self._store, [], serve=False)
            engine = await opened.__aenter__()
        except StoreLocked:
            yield
            return
        self._held = engine
        try:
            yield
        except BaseException as exc:
            self._held = None
            if not await opened.__aexit__(type(exc), exc, exc.__traceback__):
                raise
        else:
            self._held = None
            await opened.__aexit__(None, None, None)

    # ------------------------------------------------------------------------- the requests

    async def start(
        self,
        plan: Plan | str,
        *,
        version: int | None = None,
        flow_id: str | None = None,
        data: dict[str, Json] | None = None,
        request_id: str | None = None,
        deadline: float | None = None,
        priority: int = 0,
        delay: float | None = None,
        at: float | None = None,
    ) -> str:
        """Start a flow of `plan` (a `Plan`, or a plan's name: then `version`, default the
        newest the serving engine has) in the engine that serves the store; its flow id (a new
        uuid4 hex unless given); `deadline` as `Engine.start`'s (counted from when the engine
        starts it); `priority`, `delay` (counted from then too) and `at` as `Engine.start`'s,
        checked here (a key function by the engine). Raises what `Engine.start` raises
        (`IdReused`, `UnknownPlan`)
        once the engine answered. With no engine serving, the start is stored and the next
        engine to open the store starts it (`last.pending`)."""
        seconds = _checks.whole_deadline(deadline)
        _limits.start_priority(priority)
        _limits.not_before(delay, at, 0.0)
        if isinstance(plan, Plan):
            if version is not None and version != plan.version:
                raise ValueError(f"version={version} contradicts plan version {plan.version}")
            name, version = plan.name, plan.version
        elif isinstance(plan, str):
            name = _checks.said(plan, "plan")
        else:
            raise TypeError(f"plan must be a flow.Plan or a plan's name, got {plan!r}")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"version must be an int or None, got {version!r}")
        fid = uuid.uuid4().hex if flow_id is None else _checks.flow_id(flow_id)
        given: Json = {} if data is None else data
        _checks.json_object_text(given, "data", max_bytes=_checks.MAX_DATA_BYTES)
        body: dict[str, Json] = {"plan": name, "version": version, "flow_id": fid, "data": given}
        if seconds is not None:
            body["deadline"] = seconds
        for name, value in (("priority", priority), ("delay", delay), ("at", at)):
            if value is not None and value != 0:
                body[name] = value
        result = await self._ask("start", body, request_id)
        return fid if result is None else str(result)

    async def wake(
        self,
        flow_id: str,
        payload: Json = None,
        *,
        message_id: str | None = None,
        request_id: str | None = None,
    ) -> Delivery:
        """`Engine.wake`, by the serving engine (or this client: see the module doc). A wake
        without `message_id` takes the request id as its message id, so that a retry of the
        request is a `Delivery.DUPLICATE`, never a second message."""
        _checks.flow_id(flow_id)
        _checks.json_text(payload, "payload", max_bytes=_checks.MAX_DATA_BYTES)
        _checks.message_id(message_id, "message_id")
        rid = _request_id(request_id)
        body = {
            "flow_id": flow_id,
            "payload": payload,
            "message_id": f"request:{rid}" if message_id is None else message_id,
        }
        result = await self._ask("wake", body, rid)
        assert isinstance(result, Delivery)
        return result

    async def cancel(
        self, flow_id: str, reason: str = "cancelled", *, request_id: str | None = None
    ) -> bool:
        """`Engine.cancel`, by the serving engine (or this client)."""
        _checks.flow_id(flow_id)
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {reason!r}")
        problem = _checks.text_problem(reason)
        if problem is not None:
            raise ValueError(f"reason {reason!r} cannot be stored: {problem}")
        return bool(await self._ask("cancel", {"flow_id": flow_id, "reason": reason}, request_id))

    async def resume(self, flow_id: str, *, request_id: str | None = None) -> bool:
        """`Engine.resume`, by the serving engine (or this client)."""
        _checks.flow_id(flow_id)
        return bool(await self._ask("resume", {"flow_id": flow_id}, request_id))

    async def abandon(
        self, flow_id: str, *, reason: str, by: str | None = None, request_id: str | None = None
    ) -> bool:
        """`Engine.abandon`, by the serving engine (or this client)."""
        _checks.flow_id(flow_id)
        _checks.said(reason, "reason")
        if by is not None:
            _checks.said(by, "by")
        body = {"flow_id": flow_id, "reason": reason, "by": by}
        return bool(await self._ask("abandon", body, request_id))

    async def publish(
        self, event_type: str, event: Json, *, request_id: str | None = None
    ) -> list[Delivery | str | None] | None:
        """`Engine.publish` in the serving engine, with the mappers it registered (`Engine.on`);
        their results. None when no engine serves the store: the event is stored and the next
        engine to open the store publishes it (`last.pending`)."""
        if not isinstance(event_type, str):
            raise TypeError(f"event_type must be a str, got {event_type!r}")
        _checks.json_text(
            event, f"the event of type {event_type!r}", max_bytes=_checks.MAX_DATA_BYTES
        )
        result = await self._ask("publish", {"event_type": event_type, "event": event}, request_id)
        return None if result is None else list(result)

    # ---------------------------------------------------------------------------- the reads

    async def get(self, flow_id: str) -> Snapshot | None:
        """The flow's durable state, read from the store (no engine needed); None if there is
        no such flow. `ferry.Failed` if the store failed (its cause the driver's error)."""
        fid = _checks.flow_id(flow_id)
        load = partial(_store.load, flow_id=fid)
        flow = await _read.read(self._store, load, f"reading flow {fid!r}")
        return None if flow is None else _values.snapshot(flow)

    async def history(self, flow_id: str) -> list[Event]:
        """Every durable transition of the flow, in order (no engine needed). `UnknownFlow`;
        `ferry.Failed` if the store failed (its cause the driver's error)."""
        fid = _checks.flow_id(flow_id)
        load = partial(_store.load_history, flow_id=fid)
        events = await _read.read(self._store, load, f"reading the history of {fid!r}")
        if events is None:
            raise UnknownFlow(f"no flow has id {fid!r}")
        return events

    async def wait(self, flow_id: str, *, timeout: float | None = None) -> Snapshot:  # noqa: ASYNC109
        """Until the flow is `COMPLETED`, `FAILED` or `BLOCKED`; its snapshot then. Reads the
        flow again each time the store changed (SQLite: the file written and its
        ``data_version`` changed; PostgreSQL: a notification that a flow settled), and at least
        once a second. `UnknownFlow`; `trio.TooSlowError` after `timeout` seconds."""
        fid = _checks.flow_id(flow_id)
        async with _Changes(self._store, _notify.CHANNEL_SQL) as changes:
            with trio.fail_after(math_inf(timeout)):
                while True:
                    snap = await self.get(fid)
                    if snap is None:
                        raise UnknownFlow(f"no flow has id {fid!r}")
                    if snap.state in _SETTLED:
                        return snap
                    await changes.next()

    def _changes(self) -> _Changes:
        """A watch of the store for the readers of events and streams (`_client_signals`)."""
        return _Changes(self._store, (_notify.SIGNALS_CHANNEL_SQL, _notify.CHANNEL_SQL))

    # ------------------------------------------------------------------------ the machinery

    async def _ask(self, kind: str, body: dict[str, Json], request_id: object) -> Any:
        rid = _request_id(request_id)
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        stored_kind, stored_body, answer = await self._store.transact(
            partial(_inbox.put, request_id=rid, kind=kind, body=text, now=time.time())
        )
        if (stored_kind, stored_body) != (kind, text):
            raise ValueError(
                f"request_id {rid!r} was used for another request ({stored_kind} {stored_body}):"
                " give each request its own id; nothing was stored"
            )
        if answer is None:
            answer = await self._direct(kind, rid, body)
        if answer is None:  # an engine serves the store: its answer
            answer = await self._answer(kind, rid, body)
        if answer == "pending":
            self.last = Receipt(rid, served=False, applied_by=None, pending=True)
            return None
        by = await _read.read(
            self._store, partial(_answered_by, request_id=rid), f"reading request {rid!r}"
        )
        self.last = Receipt(rid, served=not answer.get("client"), applied_by=by, pending=False)
        _raise(answer)
        return _served.decoded(answer["value"])

    async def _answer(self, kind: str, rid: str, body: dict[str, Json]) -> Any:
        """Wait for the serving engine's answer (the store's changes, `_Changes`), looking every
        `_RETRY_DIRECT` seconds whether it went away (then this client acts: `_direct`).
        `trio.TooSlowError` after the client's timeout."""
        answer: Any = None
        async with _Changes(self._store) as changes:
            with trio.move_on_after(self._timeout):
                while answer is None:
                    with trio.move_on_after(_RETRY_DIRECT):
                        while True:
                            read = partial(_inbox.answer_of, request_id=rid)
                            answer = await _read.read(self._store, read, f"reading request {rid!r}")
                            if answer is not None:
                                break
                            await changes.next()
                    if answer is None:
                        answer = await self._direct(kind, rid, body)
        if answer is None:
            raise trio.TooSlowError(
                f"the engine serving {_where(self._store)} has not answered {kind} request"
                f" {rid!r} within {self._timeout:g} s; the request is stored and will be"
                " applied once an engine takes it (call again with this request_id to wait"
                " for its answer)"
            )
        return answer

    async def _direct(self, kind: str, rid: str, body: dict[str, Json]) -> Any:
        """Apply the request here if no engine serves the store: its answer, ``"pending"``
        (a start or publish, left to the next engine), or None (an engine serves it)."""
        if _dialect.of(self._store).leases and await _read.read(
            self._store, partial(_live_engines, now=time.time()), "reading the engines' leases"
        ):
            return None
        if self._held is not None:
            return await self._apply(self._held, kind, rid, body)
        try:
            async with open_engine(self._store, [], serve=False) as engine:
                return await self._apply(engine, kind, rid, body)
        except StoreLocked:
            return None

    async def _apply(self, engine: Engine, kind: str, rid: str, body: dict[str, Json]) -> Any:
        """Apply the request with this client's operator's `engine` and write its answer."""
        read = partial(_inbox.answer_of, request_id=rid)
        answer = await _read.read(self._store, read, f"reading request {rid!r}")
        if answer is not None:
            return answer
        if kind in ("start", "publish"):
            return "pending"
        answer = await _served.apply(engine, kind, body)
        assert isinstance(answer, dict)
        answer["client"] = True  # applied by a client, no engine serving: `Receipt.served`
        await self._store.transact(
            partial(
                _inbox.answer,
                request_id=rid,
                text=json.dumps(answer),
                by=self._me,
                now=time.time(),
            )
        )
        return answer


def math_inf(timeout: float | None) -> float:
    """`timeout` as `trio.fail_after` takes it (None: never)."""
    if timeout is None:
        return float("inf")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
        raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    return float(timeout)


def _answered_by(tx: Any, request_id: str) -> str | None:
    rows = tx.execute(
        f"SELECT answered_by FROM {_inbox.REQUESTS} WHERE request_id = ?", (request_id,)
    )
    return rows[0][0] if rows else None


def _live_engines(tx: Any, now: float) -> bool:
    """Does a live engine (its lease running at `now`) serve the PostgreSQL store?"""
    rows = tx.execute(f"SELECT COUNT(*) FROM {_sql.ENGINES} WHERE lease_until >= ?", (now,))
    return bool(rows[0][0])


class _Changes:
    """Waits for the store to change. On SQLite: until the file is written by any process
    (`Written`, inotify: no timer; every `_TICK` where inotify is missing), and then until its
    ``data_version`` (read on one connection of its own: a counter in memory, no table read)
    says another connection committed. On PostgreSQL: until a notification on `channel_sql`
    (`_asked.Heard`). At most `_LOOK_AGAIN` apart either way (a look that finds nothing new
    costs one read)."""

    def __init__(
        self, store: Store, channel_sql: str | tuple[str, ...] = _inbox.ANSWERED_SQL
    ) -> None:
        self._store = store
        self._channel_sql = channel_sql
        self._conn: sqlite3.Connection | None = None
        self._written: Written | None = None
        self._heard: Heard | None = None
        self._version: int | None = None
        # After a write of the file: until when to look again without an event, and how soon
        # (kept across calls, so that a commit that shows after the one a call returned for is
        # looked for too: `_served.SETTLE`).
        self._settling = 0.0
        self._tick = _TICK

    async def __aenter__(self) -> _Changes:
        path = getattr(self._store, "path", None)
        if not _dialect.of(self._store).server and isinstance(path, str):
            self._written = Written(path)
            self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        elif _dialect.of(self._store).notifies:
            self._heard = Heard(str(getattr(self._store, "dsn", "")), self._channel_sql)
            await self._heard.open()
        else:
            await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._heard is not None:
            self._heard.close()
        if self._written is not None:
            fd = self._written.fileno()
            if fd is not None:
                trio.lowlevel.notify_closing(fd)
            self._written.close()
        if self._conn is not None:
            self._conn.close()
        await trio.lowlevel.checkpoint()

    async def next(self) -> None:
        if self._heard is not None:
            with trio.move_on_after(_LOOK_AGAIN):
                await self._heard.next()
            return
        if self._conn is None or self._written is None:
            await trio.sleep(_LOOK_AGAIN)
            return
        fd = self._written.fileno()
        while True:
            if fd is None:
                await trio.sleep(_TICK)
            elif time.monotonic() < self._settling:  # written, not visible yet
                await trio.sleep(self._tick)
                self._tick = min(2 * self._tick, _served.SETTLE_TICK_MAX)
            else:
                with trio.move_on_after(_LOOK_AGAIN) as looked:
                    await trio.lowlevel.wait_readable(fd)
                if self._written.drain():
                    self._settling, self._tick = time.monotonic() + _served.SETTLE, _TICK
                elif not looked.cancelled_caught:
                    continue  # another file of the directory was written
            seen = self._conn.execute("PRAGMA data_version").fetchone()[0]
            if seen != self._version:
                self._version = seen
                return
