"""The errors of `ferry.flow`. All derive from `FlowError`.

Bad arguments are also the builtin a caller would expect: an unknown plan and a reused flow id are
`ValueError`s, an unknown flow id is a `LookupError`. After the engine closed, calls raise
`ferry.Closed` (a `ferry.FerryError`, not a `FlowError`), as every closed ferry object does.
"""

from __future__ import annotations

from typing import final


class FlowError(Exception):
    """Root of every error `ferry.flow` raises."""


@final
class UnknownPlan(FlowError, ValueError):
    """The plan was not given to `open_engine` (a flow runs only on the plans its engine has)."""


@final
class IdReused(FlowError, ValueError):
    """`start` with a flow id that already names a flow of another plan or other start data.

    Nothing was stored. The same id with the same plan and data is not an error: `start` returns
    the id and runs nothing again.
    """


@final
class UnknownFlow(FlowError, LookupError):
    """No flow has this id in the engine's store."""


@final
class StoreLocked(FlowError):
    """Another engine (in this process or another) serves this SQLite file right now.

    An SQLite file is served by one engine at a time, whatever the path it is opened by (a
    symlink, a hard link, a relative path); the lock is an OS-level lock on the database file
    itself, released when that engine closes or its process dies.

    On PostgreSQL: another live engine runs under the same `owner` name (one live engine per
    name); the message names the owner. A restart under the name opens once that engine closed,
    its process is gone (on this host), or its lease lapsed.
    """


@final
class UnknownSchedule(FlowError, LookupError):
    """No schedule of this name is stored (`Engine.trigger`, `pause`, `unpause`, `unschedule`,
    `backfill`): it was never declared (`open_engine(schedules=[...])`) or was unscheduled."""
