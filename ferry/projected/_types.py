"""Value types shared by `ProjectedWrite`, its journal logic and its stores. No trio, no I/O."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias, TypeVar, final

import attrs

T = TypeVar("T")

#: A value that survives `json.dumps`/`json.loads` unchanged in meaning: None, bool, int, float,
#: str, lists and str-keyed dicts of those. Kept as `Any` so user types need no casts.
Json: TypeAlias = Any


@final
@attrs.frozen
class Posting:
    """A cross-key effect: `payload` is delivered to `dest_key`, whose next journal transaction
    (or `sweep()`) ingests it as a record of its own and applies it through `receive`."""

    dest_key: str
    payload: Json


@final
@attrs.frozen
class Decision:
    """What `decide` (or `receive`) returns: the answer stored with the record, the key's new
    decision state, and postings to other keys (their ids are derived from the record's id)."""

    answer: Json
    state: Json
    postings: Sequence[Posting] = ()


@final
@attrs.frozen
class Record:
    """One journal record, as a projection sees it.

    `kind` is ``"input"`` (an input of a batch; `id` is the input id) or ``"posting"`` (ingested
    from the inbox; `id` is the posting id). `content` is the input's content or the posting's
    payload, `answer` the stored decision; both are parsed JSON.
    """

    key: str
    seq: int
    kind: str
    id: str
    content: Json
    answer: Json


class Tx(Protocol):
    """One open database transaction, driven from a worker thread.

    Placeholders are ``?`` on every store (the PostgreSQL store rewrites them). A statement whose
    enclosing call was cancelled raises instead of running. `connection` is the driver's own
    connection (``sqlite3.Connection`` or ``psycopg.Connection``) for anything else.
    """

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgres"``."""
        ...

    @property
    def connection(self) -> Any:
        """The driver's connection object, inside this transaction."""
        ...

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement; return its rows (empty for statements without a result)."""
        ...

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement once per parameter row."""
        ...


@final
@attrs.frozen
class SweepReport:
    """What one `sweep()` did."""

    keys: int
    postings_ingested: int
    records_projected: int
    failed_keys: int


@final
@attrs.frozen
class ProjectedWriteStatistics:
    """Counters of one `ProjectedWrite` since it was made (see `ProjectedWrite.statistics`)."""

    batches: int
    inputs: int
    written: int
    replayed: int
    id_reused: int
    fence_conflicts: int
    committed: int
    projection_attempts_failed: int
    sweeps: int
    sweep_errors: int
    cached_keys: int


class Store(Protocol):
    """What `ProjectedWrite` needs from a database: transactions on worker threads.

    `SqliteStore` and `PostgresStore` implement it; a test may wrap one.
    """

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgres"``: which SQL the journal and the projection may use."""
        ...

    async def transact(self, fn: Callable[[Tx], T]) -> T:
        """Run ``fn(tx)`` in one transaction on a worker thread: commit if it returns, roll back if
        it raises (and re-raise). A checkpoint. If cancelled, the transaction is interrupted and
        rolled back (unless already committing: all of it or none of it) and `trio.Cancelled`
        propagates."""
        ...

    async def aclose(self) -> None:
        """Close the store's connections once in-flight transactions are over."""
        ...
