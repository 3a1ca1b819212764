"""The first contact with a PostgreSQL store at `open_engine`: a database the engine cannot
reach, and a test clock it cannot run under.

The first thing an engine does with its store is to create its tables. On PostgreSQL that opens
the first connection, and a DSN that names a database, a role, a host or a port that is not
there (or a server that is down) fails there. The driver's error alone reads like a bug in the
engine (a traceback through its internals), so `open_engine` answers it as `ferry.Failed` naming
the database (its password masked), the driver's reason in one line and what to do; the driver's
error is its ``__cause__``. It does not wait: a wrong DSN must fail at once, and a server that is
down cannot be told from a wrong port. Once open, the engine retries its store's unavailability
as usual (`_retry`).

A `trio.testing.MockClock` that jumps on its own (``autojump_threshold`` finite) cannot drive an
engine on PostgreSQL: `PostgresStore` runs every statement on a worker thread (a network round
trip may hang, so never on the trio thread, unlike SQLite's), the clock jumps while one is in
flight, and every batch runs past its ``call_timeout`` in virtual time and is retried forever.
`check_clock` refuses it at open, before anything is written, saying what to do instead.
"""

from __future__ import annotations

import math
import sys

import trio
import trio.testing

from ferry import Failed
from ferry._text import masked, shown
from ferry.projected import Store

from .._store import _dialect


def unreachable(store: Store, error: BaseException) -> Failed | None:
    """The `Failed` that `open_engine` raises for `error`, raised by the first transaction on a
    PostgreSQL `store`; None if `error` is not the driver's (the engine's own: raise it)."""
    psycopg = sys.modules.get("psycopg")  # never imported here: if absent, it raised nothing
    if not _dialect.of(store).server or psycopg is None or not isinstance(error, psycopg.Error):
        return None
    dsn = getattr(store, "dsn", None)
    where = shown(dsn) if isinstance(dsn, str) else repr(store)
    reason = masked(" ".join(str(error).split()) or type(error).__name__)
    return Failed(
        f"open_engine could not reach its PostgreSQL database {where}:"
        f" {type(error).__name__}: {reason}. Check the DSN's host, port, database (dbname), user"
        " and password, and that the server is up and accepts connections from here; the engine"
        " does not wait for a server that is down: open it again once the server is up (a loop,"
        " or your service manager's restart)"
    )


def check_clock(store: Store) -> None:
    """`ValueError` if `store` is PostgreSQL and the current trio clock is a `MockClock` that
    jumps on its own (see the module's docstring)."""
    clock = trio.lowlevel.current_clock()
    if (
        _dialect.of(store).server
        and isinstance(clock, trio.testing.MockClock)
        and clock.autojump_threshold != math.inf
    ):
        raise ValueError(
            "open_engine cannot run on PostgreSQL under a trio.testing.MockClock that jumps on"
            " its own (autojump_threshold): PostgresStore runs its statements on worker threads,"
            " the clock jumps while they are in flight, and every write would time out. Test"
            " sagas under MockClock(autojump_threshold=0) on an SQLite file (a temporary one),"
            " and on PostgreSQL with the real clock and short timeouts (docs/flow.md, 'Testing"
            " your sagas')"
        )
