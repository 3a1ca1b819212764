"""Everything the flow store says or does differently on SQLite and on PostgreSQL, in one
`Dialect` record each, and nowhere else (tests/test_layers.py checks that no other module of
``ferry/flow/`` compares a dialect's name). A part that must know asks the dialect of its
transaction or store (`of`) a question, never its name:

- the mailbox's arrival-order column (an identity column, or SQLite's rowid alias);
- holding a row to the end of the transaction (``FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE``
  already holds the whole database for one writer), and skipping the rows another holds;
- a list of values as one parameter (``= ANY(?)`` with an array; SQLite: ``IN (?, ...)``, one
  placeholder per value, in chunks);
- the catalog (does a table exist, which columns does it have, is there an index) and an
  advisory lock around schema changes (PostgreSQL's ``CREATE ... IF NOT EXISTS`` can race);
- text in byte order (PostgreSQL's collation may not order bytewise; SQLite's BINARY does),
  matching text in any case (``ILIKE``; SQLite's ``LIKE`` ignores ASCII case), a number's
  whole part, an index the query planner is told to use (SQLite's ``INDEXED BY``);
- leases: only a PostgreSQL store is shared by a fleet (on SQLite one engine holds the file), so
  only there does a takeover lock the lease row it reads (ADR 0048), only there can a flow be
  an orphan, and only there does the database's clock decide leases (`Dialect.clock`, ADR 0110);
- the batch: PostgreSQL writes a batch in a fixed number of statements whatever its size, with
  arrays (`_arrays`, docs/adr/0094); SQLite, in process, reads and writes the ops of the flows
  that have one op in a batch in multi-row statements (`_row_by_row`), the rest a row at a
  time; how many batches an engine keeps in flight;
- the store itself: a server reached over a connection (PostgreSQL: the driver's errors, other
  processes told of a commit by ``NOTIFY``), or a file of this host that a process watches
  (SQLite), whose free pages can go back to the file system.

No trio, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Protocol

import attrs


@attrs.frozen
class Dialect:
    """Everything the flow store says differently on SQLite and on PostgreSQL."""

    name: str
    #: The mailbox's arrival-order column.
    seq_column: str
    #: Appended to a ``SELECT`` that holds its rows until the transaction ends.
    for_update: str
    #: Appended to a ``SELECT`` that holds its rows and skips those another transaction holds
    #: (two purges take disjoint batches); SQLite's one writer holds the whole database.
    skip_locked: str
    #: Is a fleet of engines sharing the store, holding active flows by leases?
    leases: bool
    #: Appended to a text column (or an index's) to compare it in byte order.
    bytewise: str
    #: The ``LIKE`` that matches text in any (ASCII) case.
    like_any_case: str
    #: SQL: the whole part of `{}` (a non-negative number) as an integer. (SQLite's ``CAST``
    #: truncates, PostgreSQL's rounds.)
    whole_part: str
    #: ``(table name) -> rows``: is the table there (one row, one boolean)?
    table_exists: str
    #: ``(table name) -> rows``: the names of its columns.
    columns_of: str
    #: ``(index name) -> rows``: is the index there (a row if so)? None: the query planner is
    #: never told which index to use (PostgreSQL chooses well by itself).
    index_exists: str | None
    #: Appended to a table's name to have the planner use index `{}` (with `index_exists`).
    indexed_by: str
    #: A transaction-long lock around schema changes, or None.
    schema_lock: str | None
    #: Writes a batch with arrays in a fixed number of statements (`_arrays`), else a row at a
    #: time (`_row_by_row`).
    arrays: bool
    #: How many write batches an engine keeps in flight: SQLite has one writer; on PostgreSQL
    #: three leave one connection of a default store's four for lease renewals, scans and
    #: reads, which must not queue behind batches.
    batches_in_flight: int
    #: SQL: the time by the clock that decides leases, in seconds since the epoch, read in the
    #: transaction (`_store.lease_clock`, docs/adr/0110): the database's own (the transaction's
    #: start). None: the store has no clock of its own (SQLite, where the one engine's lease, or
    #: the leases of a test's engines in one process, go by the engine's clock).
    clock: str | None
    #: Is the store a server reached over a connection (its driver's errors name it), rather
    #: than a file of this host (`SqliteStore.path`)?
    server: bool
    #: Can a transaction tell listening processes of its commit (PostgreSQL's ``pg_notify``,
    #: heard by ``LISTEN``)? Without it, a process watches the file (`_sqlite_file`).
    notifies: bool
    #: Can free pages go back to the file system (SQLite's incremental auto-vacuum)?
    shrinks: bool
    #: Prefixed to a statement to have its plan as rows of text (the last column of each).
    explain: str
    #: How that plan says it reads the whole of table `{}` (a line of the plan that holds it).
    full_scan: str
    #: How that plan says it sorts the rows it read (rather than reading them in an index's
    #: order).
    sorts: str
    #: ``(seconds) -> rows (pid, application_name)``: end the sessions of this database and
    #: role that hold flow rows and have waited on their client in the middle of a request
    #: for longer than `seconds` (`_store.end_frozen_holders`, docs/adr/0158). None: one
    #: engine per file, no session of another process holds a row.
    end_frozen: str | None
    #: Appended to a ``CREATE TABLE`` whose primary key is its only index, to store its rows
    #: in that key's B-tree (SQLite's ``WITHOUT ROWID``: no second copy of the key; a
    #: PostgreSQL table is a heap with its index either way).
    keyed_table: str = ""

    def in_list(self, column: str, n: int) -> str:
        """SQL: `column` is one of a list of `n` values, given as `list_params` makes them."""
        if self.arrays:
            return f"{column} = ANY(?)"
        return f"{column} IN ({', '.join('?' * n)})"

    def list_params(self, values: Sequence[Any]) -> list[Any]:
        """The parameters of `in_list` for `values`."""
        return [list(values)] if self.arrays else list(values)

    def in_plans(self, row: str, n: int) -> str:
        """SQL: the flow `row` is of one of `n` (plan, version)s, given as `plans_params`
        makes them."""
        if self.arrays:
            return f"({row}.plan, {row}.version) IN (SELECT * FROM unnest(?::text[], ?::bigint[]))"
        return f"({row}.plan, {row}.version) IN (VALUES {', '.join(['(?, ?)'] * n)})"

    def plans_params(self, plans: Sequence[tuple[str, int]]) -> list[Any]:
        """The parameters of `in_plans` for `plans`."""
        if self.arrays:
            return [[name for name, _v in plans], [version for _n, version in plans]]
        return [v for pair in plans for v in pair]


SQLITE: Final = Dialect(
    name="sqlite",
    seq_column="seq INTEGER PRIMARY KEY",
    for_update="",
    skip_locked="",
    leases=False,
    bytewise="",
    like_any_case="LIKE",
    whole_part="CAST({} AS INTEGER)",
    table_exists="SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?)",
    columns_of="SELECT name FROM pragma_table_info(?)",
    index_exists="SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = ?",
    indexed_by=" INDEXED BY {}",
    schema_lock=None,
    arrays=False,
    batches_in_flight=1,
    clock=None,
    server=False,
    notifies=False,
    shrinks=True,
    explain="EXPLAIN QUERY PLAN ",
    full_scan="SCAN {}",
    sorts="USE TEMP B-TREE",
    end_frozen=None,
    keyed_table=" WITHOUT ROWID",
)
POSTGRES: Final = Dialect(
    name="postgres",
    seq_column="seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    for_update=" FOR UPDATE",
    skip_locked=" FOR UPDATE SKIP LOCKED",
    leases=True,
    bytewise=' COLLATE "C"',
    like_any_case="ILIKE",
    whole_part="CAST(FLOOR({}) AS INTEGER)",
    table_exists="SELECT to_regclass(?) IS NOT NULL",
    columns_of="SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(?)",
    index_exists=None,
    indexed_by="",
    schema_lock="SELECT pg_advisory_xact_lock(?)",
    arrays=True,
    batches_in_flight=3,
    clock="SELECT EXTRACT(EPOCH FROM now())::float8",
    server=True,
    notifies=True,
    shrinks=False,
    explain="EXPLAIN ",
    full_scan="Seq Scan on {}",
    sorts="Sort ",
    # A session mid-request waits in ClientRead (the rest of a statement it was sent) or
    # ClientWrite (rows its client does not read) with `state = 'active'`: neither
    # `idle_in_transaction_session_timeout` nor `statement_timeout` ends it. Only sessions of
    # this role (which may end them) that hold a lock on the flows table.
    end_frozen=(
        "SELECT a.pid, a.application_name, pg_terminate_backend(a.pid)"
        " FROM pg_stat_activity a"
        " WHERE a.datname = current_database() AND a.usename = current_user"
        " AND a.pid <> pg_backend_pid() AND a.state = 'active'"
        " AND a.wait_event_type = 'Client'"
        " AND a.state_change < now() - make_interval(secs => ?::float8)"
        " AND EXISTS (SELECT 1 FROM pg_locks l"
        "             WHERE l.pid = a.pid AND l.relation = to_regclass('flow_flows'))"
    ),
)
DIALECTS: Final = {d.name: d for d in (SQLITE, POSTGRES)}


class _Speaks(Protocol):
    @property
    def dialect(self) -> str: ...


def of(holder: _Speaks) -> Dialect:
    """The dialect of a transaction or a store (its ``dialect``: ``"sqlite"`` or
    ``"postgres"``)."""
    return DIALECTS[holder.dialect]
