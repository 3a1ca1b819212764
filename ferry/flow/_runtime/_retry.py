"""The one retry rule of the flow engine's own store calls (docs/adr/0061).

The engine retries a store call only when the store says "not available now": the call did not
happen (or rolled back) for a reason that has nothing to do with what it asked, and the same call
may well succeed a moment later. Anything else is raised: a bug in the engine, a corrupted row or
a row the database refuses must be seen, not spun on.

Unavailable (`unavailable`):

- SQLite (`sqlite3.OperationalError`): ``SQLITE_BUSY`` and ``SQLITE_LOCKED`` (another connection
  holds the file or a table), ``SQLITE_IOERR`` (the disk or the file system failed the read or
  write) and ``SQLITE_FULL`` (no space left: the transaction was rolled back, and space may come
  back). Other SQLite errors (a constraint, a malformed statement, a corrupt file) are raised.
- PostgreSQL (psycopg 3): an ``OperationalError`` without an SQLSTATE (the client lost or could
  not open its connection), SQLSTATE class ``08`` (connection exception), ``40001``
  (serialization failure) and ``40P01`` (deadlock detected), class ``53`` (insufficient
  resources: too many connections, out of memory, disk full), ``57P01``-``57P03`` (the server
  is shutting down, crashed or is starting), and ``25P03`` (the server ended one of our
  transactions that sat idle too long, see `_batch.guard_locks`).
- `ferry.Failed` whose cause (``__cause__``) is one of those: a batch that went through a ferry.
- `ferry.Failed` whose cause is `trio.TooSlowError`: the write ferry cancelled a batch that ran
  past its ``call_timeout`` (a store that did not answer in time, or a process that was frozen
  longer than that, for example under SIGSTOP). The batch may or may not have committed, but
  every write the engine retries is a compare-and-set on the flow's revision or an idempotent
  insert, so running it again is safe: a write that had committed comes back as a conflict,
  and the runner re-reads the row.
- An exception group all of whose exceptions are one of those (concurrent writes of a scan).

Delays (a `Schedule`; never the step backoff, which is the user's retry policy): `STORE`, for a
call the engine needs done, 0.05 s, doubling, at most 2 s, for as long as it takes;
`LEASE_RENEWAL`, at once (the pool opens a fresh connection for a dead one), then 0.05 s
doubling to 1 s, until the renewal's deadline (the caller's cancel scope); `ROLLBACK`, a batch
the database rolled back on its own (a deadlock), 0.01 s times the retry, at most 3 retries.
Each retry logs a WARNING on ``logging.getLogger("ferry.flow")`` naming what failed and the next
delay. The rule (which errors, the log, the pause) is written once, in `Backoff`.

A loop that tries again at its own next round (a fleet's scans and checks, the first scan at
open, letting go and ending the lease at close) does not pause here: it asks `next_round`, the
one rule for rounds (`for_now`: unavailable, or any `ferry.Failed` of a write the ferry could
not get through, or a group of those, is a WARNING; anything else is raised; docs/adr/0132).
"""

from __future__ import annotations

import logging
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeAlias, TypeVar

import attrs
import trio

from ferry import Failed

T = TypeVar("T")

#: A value, or a function without arguments that makes it when (and if) it is needed.
Lazy: TypeAlias = T | Callable[[], T]

FIRST_DELAY = 0.05  # seconds before the first retry
MAX_DELAY = 2.0  # the delay doubles up to this

_log = logging.getLogger("ferry.flow")

# Primary result codes (the low byte of an extended code).
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_IOERR = 10
_SQLITE_FULL = 13
_SQLITE_CODES = frozenset({_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_IOERR, _SQLITE_FULL})
_SQLITE_TEXTS = ("database is locked", "database table is locked", "disk i/o error", "is full")

_PG_STATES = frozenset({"40001", "40P01", "57P01", "57P02", "57P03", "25P03"})
_PG_CLASSES = ("08", "53")


def _sqlite_unavailable(exc: sqlite3.Error) -> bool:
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in _SQLITE_CODES
    text = str(exc).lower()  # a driver without error codes: the message says it
    return any(t in text for t in _SQLITE_TEXTS)


def _pg_unavailable(exc: BaseException) -> bool:
    psycopg = sys.modules.get("psycopg")  # never imported here: if absent, it raised nothing
    if psycopg is None or not isinstance(exc, psycopg.Error):
        return False
    state = getattr(exc, "sqlstate", None)
    if state is None:
        return isinstance(exc, psycopg.OperationalError)
    state = str(state)
    return state in _PG_STATES or state.startswith(_PG_CLASSES)


def unavailable(exc: BaseException) -> bool:
    """Does `exc` say that the store is not available now (so the same call may be retried)?
    An exception group (concurrent writes, say) does if every exception in it does."""
    if isinstance(exc, BaseExceptionGroup):
        return all(unavailable(e) for e in exc.exceptions)
    if isinstance(exc, Failed):
        cause = exc.__cause__
        if isinstance(cause, trio.TooSlowError):  # a batch cancelled after its call_timeout
            return True
        return cause is not None and unavailable(cause)
    if isinstance(exc, sqlite3.Error):
        return _sqlite_unavailable(exc)
    return _pg_unavailable(exc)


@attrs.frozen
class Schedule:
    """When a store call is tried again: `delay(n)` is the pause before retry n (1, 2, ...);
    after `retries` retries (None: no limit) the error is raised."""

    delay: Callable[[int], float]
    retries: int | None = None


def _doubling(first: float, cap: float) -> Callable[[int], float]:
    # The exponent is bounded so that an outage of hours does not overflow a float.
    return lambda n: min(first * 2.0 ** min(n - 1, 30), cap)


_renewal_doubling: Final = _doubling(FIRST_DELAY, 1.0)

#: The engine's store calls: 0.05 s, doubling, at most 2 s, no limit.
STORE: Final = Schedule(_doubling(FIRST_DELAY, MAX_DELAY))
#: A lease renewal: at once, then 0.05 s doubling to 1 s (the renewal's deadline ends it).
LEASE_RENEWAL: Final = Schedule(lambda n: 0.0 if n == 1 else _renewal_doubling(n - 1))
#: A batch the database rolled back on its own: 0.01 s times the retry, 3 retries at most.
ROLLBACK: Final = Schedule(lambda n: 0.01 * n, retries=3)


class Backoff:
    """One run of retries: `await backoff.pause(exc)` raises `exc` unless the store is
    unavailable (`when`, by default `unavailable`) and the `schedule` allows another retry;
    else logs the retry (WARNING) and sleeps before the caller tries again. For loops whose
    body is more than one call; `retrying` is the common case."""

    __slots__ = ("_extra", "_schedule", "_what", "_when", "retries")

    def __init__(
        self,
        what: Lazy[str],
        *,
        extra: Lazy[Mapping[str, Any]] | None = None,
        schedule: Schedule = STORE,
        when: Callable[[BaseException], bool] = unavailable,
    ) -> None:
        self._what = what if isinstance(what, str) else what()
        if extra is not None and not isinstance(extra, Mapping):
            extra = extra()
        self._extra = dict(extra or {})
        self._schedule = schedule
        self._when = when
        self.retries = 0

    async def pause(self, exc: BaseException) -> None:
        limit = self._schedule.retries
        if not self._when(exc) or (limit is not None and self.retries >= limit):
            raise exc
        self.retries += 1
        delay = self._schedule.delay(self.retries)
        _log.warning(
            "flow store unavailable while %s: %r; retry %d in %.2f s",
            self._what,
            exc.__cause__ if isinstance(exc, Failed) and exc.__cause__ is not None else exc,
            self.retries,
            delay,
            extra={**self._extra, "what": self._what, "delay": delay, "retry": self.retries},
        )
        await trio.sleep(delay)


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    what: Lazy[str],
    extra: Lazy[Mapping[str, Any]] | None = None,
    schedule: Schedule = STORE,
    when: Callable[[BaseException], bool] = unavailable,
    failed: BaseException | None = None,
) -> T:
    """``await call()`` until it returns; retried (with `Backoff`, on `schedule`) while the
    store is unavailable (`when`), any other exception raised. `what` names the call in the
    WARNING of each retry ("writing flow 'o-1'"); `extra` goes into its log record (flow_id,
    step, ...). Either may be a function that makes it: it is called only if there is a retry
    to log (a runner writes several times per flow, and formatting its name each time costs
    more than the rest of this call).

    `failed`: the caller made the first try itself and it raised this (which `when` accepts):
    it is logged and paused on as a failed try of this call, before the next. A hot path
    (the runner's writes) so makes no wrapper objects for the common first try that
    succeeds."""
    backoff: Backoff | None = None
    if failed is not None:
        backoff = Backoff(what, extra=extra, schedule=schedule, when=when)
        await backoff.pause(failed)
    while True:
        try:
            return await call()
        except Exception as exc:
            if not when(exc):
                raise
            if backoff is None:
                backoff = Backoff(what, extra=extra, schedule=schedule, when=when)
            await backoff.pause(exc)


def for_now(exc: BaseException) -> bool:
    """Did the store fail only for now, as a loop round sees it: unavailable (`unavailable`),
    or a write the ferry could not get through (`ferry.Failed`, whatever its cause: every op of
    a round is a compare-and-set, tried again at the next round), also as an exception group of
    those? The rule of `next_round`."""
    if isinstance(exc, BaseExceptionGroup):
        return all(for_now(e) for e in exc.exceptions)
    return isinstance(exc, Failed) or unavailable(exc)


def next_round(
    exc: BaseException,
    what: str,
    *,
    then: str = "",
    extra: Mapping[str, Any] | None = None,
) -> None:
    """The one rule for a loop that tries again at its own next round (a fleet's scan and
    check, the first scan at open, letting go and ending the lease at close): raise `exc`
    unless the store failed only for now (`for_now`); else log it (WARNING, naming `what`
    failed and, in `then`, what happens next) and return."""
    if not for_now(exc):
        raise exc
    _log.warning(
        "flow store unavailable while %s: %r%s",
        what,
        exc.__cause__ if isinstance(exc, Failed) and exc.__cause__ is not None else exc,
        f"; {then}" if then else "",
        extra={**(extra or {}), "what": what},
    )
