"""A serving engine's side of the clients of other processes (`flow.connect`, docs/adr/0125),
and, on SQLite, its heartbeat (docs/adr/0126).

`serve` is a task of a serving engine. It applies every request it finds pending in
``flow_requests`` (`_store._inbox`) through the engine's own API, in the order they came, and
writes each answer into the request's row: first at open (what was left pending while no
engine served the store, or when the engine before died), then each time it is told a request
came. It never reads the flows to find out.

Who tells it, on SQLite: `Watch`, a plain thread with one connection of its own to the file.
It sleeps until the file is written by any process (`_sqlite_file.Written`: Linux's inotify
on the file and its ``-wal``; a commit writes the ``-wal``), then reads ``PRAGMA data_version``
(a counter in the connection's memory that changes when another connection commits: no table
read, no lock, a few microseconds) and, when it changed, looks for a pending request (one
indexed read of an empty partial index); only then does it wake the trio task
(``TrioToken.run_sync_soon``). Idle, it costs nothing but its heartbeat; where inotify is
missing it reads ``data_version`` every `TICK` instead. The same thread renews the engine's
heartbeat row in ``flow_engines`` every `RENEW` seconds of real time (owner, pid, host, when it
started, alive until three renewals on) and removes it at a clean close. A thread, not a trio
task: a trio timer would advance a test's `MockClock` by 10 ms steps forever, and the heartbeat
must say whether the process is alive, not whether its loop is idle.

On PostgreSQL the client's commit sends a notification (on the store's channel of requests,
``ferry_flow_asked_...``), which `_asked.Listen` (a thread LISTENing on one connection of its
own) hands on the same way; a fleet's engines each
hold a lease already (their heartbeat), and any of them may take a request: the answer is
written only once (`_inbox.answer` takes a pending row only), and a request two engines both
applied is applied like a retry (see ADR 0125 on what is idempotent).
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import sqlite3
import threading
import time
import uuid
from functools import partial
from typing import Any

import trio

from ferry import Closed, Failed

from .._fleet._asked import Listen
from .._model._errors import FlowError, UnknownPlan
from .._model._plan import Plan
from .._model._types import Delivery, Json
from .._store import _dialect, _inbox
from .._store._sqlite_file import Written
from ._engine import Engine

_log = logging.getLogger("ferry.flow")

TICK = 0.02  # seconds between two reads of data_version where inotify is missing (not Linux)
# A commit writes the -wal file (the event) before it makes the commit visible (the wal-index, in
# shared memory: no event): after an event, data_version is read again until it changed, for at
# most SETTLE seconds, first after SETTLE_TICK seconds and then at twice the pause before, up to
# SETTLE_TICK_MAX. A starved writer thread may take a second to make its commit visible: a
# window of 0.1 s missed it, and the change waited for the next timed look (5 s).
SETTLE_TICK = 0.002
SETTLE_TICK_MAX = 0.05
SETTLE = 2.0
RENEW = 5.0  # seconds between two renewals of an SQLite engine's heartbeat
ALIVE_FOR = 3  # renewals: a heartbeat not renewed for this many is an engine gone
_BATCH = 100  # requests read at once


def _plan(engine: Engine, name: str, version: int | None) -> Plan:
    """The plan of a start request: the engine's plan of that name and version (the newest it
    has when `version` is None); `UnknownPlan` if it has none."""
    have = [v for (n, v) in engine._plans if n == name]
    if version is None and have:
        version = max(have)
    plan = engine._plans.get((name, version)) if version is not None else None
    if plan is None:
        got = ", ".join(f"v{v}" for v in sorted(have)) or "none"
        raise UnknownPlan(
            f"the engine serving the store has no plan {name!r}"
            + ("" if version is None else f" version {version}")
            + f" (its versions of it: {got})"
        )
    return plan


#: The requests of a schedule that take its name alone (`Engine.trigger`, ...).
_SCHEDULE_CALLS = ("trigger", "pause", "unpause", "unschedule")


def _encoded(value: object) -> Json:
    """A call's result as the JSON of an answer."""
    if isinstance(value, Delivery):
        return {"delivery": value.name}
    if isinstance(value, list):
        return [_encoded(v) for v in value]
    if value is None or isinstance(value, bool | str | int):
        return value
    raise AssertionError(f"no answer encodes {value!r}")


async def apply(engine: Engine, kind: str, body: dict[str, Any] | str) -> Json:
    """Apply one request (its body, or the body's JSON text as stored) through the engine's
    API; its answer (``{"value": ...}``, or ``{"error": type, "message": ...}`` for what the
    engine refused, a body that is no request included). A store error (`Failed`) and `Closed`
    are raised: the request stays pending."""
    try:
        if isinstance(body, str):
            body = json.loads(body)
            if not isinstance(body, dict):
                raise ValueError(f"a request's body is a JSON object, got {body!r}")
        if kind == "start":
            plan = _plan(engine, body["plan"], body["version"])
            fid, data, deadline = body["flow_id"], body["data"], body.get("deadline")
            queue: Any = {k: body[k] for k in ("priority", "delay", "at") if k in body}
            value: object = await engine.start(
                plan, flow_id=fid, data=data, deadline=deadline, **queue
            )
        elif kind == "wake":
            value = await engine.wake(
                body["flow_id"], body["payload"], message_id=body["message_id"]
            )
        elif kind == "cancel":
            value = await engine.cancel(body["flow_id"], body["reason"])
        elif kind == "resume":
            value = await engine.resume(body["flow_id"])
        elif kind == "abandon":
            value = await engine.abandon(body["flow_id"], reason=body["reason"], by=body["by"])
        elif kind == "publish":
            value = await engine.publish(body["event_type"], body["event"])
        elif kind in _SCHEDULE_CALLS:  # trigger, pause, unpause, unschedule
            value = await getattr(engine, kind)(body["name"])
        elif kind == "backfill":
            value = await engine.backfill(body["name"], body["start"], body["end"])
        else:
            raise ValueError(f"no request is called {kind!r}")
    except (Failed, Closed):
        raise
    except (FlowError, TypeError, ValueError, KeyError) as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"value": _encoded(value)}


def decoded(value: Json) -> Any:
    """An answer's value as the call's result (`Delivery`, bool, str, a publish's list)."""
    if isinstance(value, dict) and "delivery" in value:
        return Delivery[str(value["delivery"])]
    if isinstance(value, list):
        return [decoded(v) for v in value]
    return value


async def drain(engine: Engine, by: str) -> int:
    """Apply every pending request, oldest first, and write the answers; how many. A store
    error is `Failed` (the request stays pending, or is applied again: ADR 0125)."""
    done = 0
    while True:
        rows = await engine._read(partial(_inbox.pending, limit=_BATCH), "reading requests")
        if not rows:
            return done
        for request_id, kind, text in rows:
            answer = await apply(engine, kind, text)
            write = partial(
                _inbox.answer,
                request_id=request_id,
                text=json.dumps(answer),
                by=by,
                now=time.time(),
            )
            wrote = await engine._read(write, f"answering request {request_id!r}")
            done += 1
            if wrote:
                _log.info(
                    "flow engine %r applied request %r (%s) of a client: %s",
                    engine._owner,
                    request_id,
                    kind,
                    answer,
                    extra={"owner": engine._owner, "request_id": request_id, "kind": kind},
                )


async def serve(
    engine: Engine,
    recovered: trio.Event,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The task of a serving engine (see the module doc); until cancelled. Started before the
    engine's recovery (its thread writes the first heartbeat meanwhile: the engine's open does
    not wait for it, a few milliseconds); applies requests once `recovered` is set."""
    store = engine._store
    token = trio.lowlevel.current_trio_token()
    wakeup = trio.Event()
    incarnation = uuid.uuid4().hex
    by = engine._owner

    def poke() -> None:
        wakeup.set()

    def tell() -> bool:
        try:
            token.run_sync_soon(poke)
        except trio.RunFinishedError:
            return False
        return True

    path = getattr(store, "path", None)
    watch: Watch | Listen | None
    if not _dialect.of(store).server and isinstance(path, str):
        plans = json.dumps(sorted([name, version] for name, version in engine._plans))
        # a fleet (a test's on SQLite) has its lease rows: no heartbeat of its own then
        watch = Watch(
            path, engine._owner, incarnation, plans, tell, beat=not engine._parts.mode.shared
        )
    elif _dialect.of(store).notifies:
        watch = Listen(str(getattr(store, "dsn", "")), engine._owner, tell)
    else:
        watch = None
    try:
        if watch is not None:
            watch.start()
        task_status.started()
        await recovered.wait()
        while True:
            try:
                await drain(engine, by)
            except Closed:  # the engine's block ends: what is pending is left to the next
                return
            except Failed as exc:  # the store is unavailable: the next poke (or tick) retries
                _log.warning(
                    "flow engine %r could not apply the clients' requests: %r; it tries again",
                    engine._owner,
                    exc,
                    extra={"owner": engine._owner},
                )
                with trio.move_on_after(1.0):
                    await wakeup.wait()
                wakeup = trio.Event()
                continue
            await wakeup.wait()
            wakeup = trio.Event()
    finally:
        if watch is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(watch.stop)


class Watch:
    """The SQLite watch thread: ``PRAGMA data_version`` every `TICK`, a wake-up when a request
    is pending, and the heartbeat (see the module doc)."""

    def __init__(
        self, path: str, owner: str, incarnation: str, plans: str, tell: Any, *, beat: bool
    ) -> None:
        self._beats = beat  # write the heartbeat (not where fleet leases are the rows)
        self._path = path
        self._owner = owner
        self._incarnation = incarnation
        self._plans = plans
        self._tell = tell
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # `stop` ends the thread's select at once
        self._started = time.time()
        self._thread = threading.Thread(
            target=self._run, name=f"ferry.flow request watch of {owner!r}", daemon=True
        )
        self.ready = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, which removes the heartbeat row (blocking: from a worker thread)."""
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _beat(self, conn: sqlite3.Connection) -> None:
        tx = _ConnTx(conn)
        conn.execute("BEGIN IMMEDIATE")
        try:
            _inbox.beat(
                tx,
                self._owner,
                time.time() + RENEW * ALIVE_FOR,
                self._started,
                incarnation=self._incarnation,
                host=socket.gethostname(),
                pid=os.getpid(),
                plans=self._plans,
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        written = Written(self._path)
        fd = written.fileno()
        try:
            conn = sqlite3.connect(
                self._path, timeout=10.0, isolation_level=None, check_same_thread=False
            )
            version = None
            next_beat = settling = 0.0
            tick = SETTLE_TICK
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    try:
                        if self._beats:
                            self._beat(conn)
                    except sqlite3.Error as exc:
                        _log.warning(
                            "flow engine %r could not renew its heartbeat: %r",
                            self._owner,
                            exc,
                            extra={"owner": self._owner},
                        )
                    next_beat = now + RENEW
                    self.ready.set()
                seen = conn.execute("PRAGMA data_version").fetchone()[0]
                if seen != version:
                    version = seen
                    try:
                        waiting = bool(_inbox.pending(_ConnTx(conn), 1))
                    except sqlite3.Error as exc:
                        _log.warning(
                            "flow engine %r could not look for requests: %r",
                            self._owner,
                            exc,
                            extra={"owner": self._owner},
                        )
                        waiting = True  # let the engine look, through its own store
                    if waiting and not self._tell():
                        return
                if fd is None:  # no inotify: a timer
                    self._stop.wait(TICK)
                    continue
                now = time.monotonic()
                pause = max(0.0, next_beat - now)
                if now < settling:  # written, not visible yet: look again soon
                    pause = min(pause, tick)
                    tick = min(2 * tick, SETTLE_TICK_MAX)
                ready, _, _ = select.select([fd, self._wake_r], [], [], pause)
                if fd in ready and written.drain():
                    settling, tick = time.monotonic() + SETTLE, SETTLE_TICK
            try:
                if self._beats:
                    conn.execute("BEGIN IMMEDIATE")
                    _inbox.end_beat(_ConnTx(conn), self._owner, self._incarnation)
                    conn.execute("COMMIT")
            except sqlite3.Error as exc:
                _log.warning(
                    "flow engine %r could not remove its heartbeat at close: %r",
                    self._owner,
                    exc,
                    extra={"owner": self._owner},
                )
        except BaseException:
            _log.exception("flow engine %r: its request watch stopped", self._owner)
            raise
        finally:
            self.ready.set()  # never leave the engine's open waiting for a first beat
            written.close()
            if conn is not None:
                conn.close()


class _ConnTx:
    """A `ferry.projected.Tx` on one plain sqlite3 connection (the watch thread's)."""

    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    @property
    def connection(self) -> sqlite3.Connection:
        return self._conn

    def execute(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, params).fetchall()

    def executemany(self, sql: str, rows: Any) -> None:
        self._conn.executemany(sql, rows)
