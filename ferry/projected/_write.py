"""`ProjectedWrite`: a ready-made per-key batch call, "append durably, then update a view".

Design
------
One batch for one key is two store transactions (docs/adr/0010, 0011):

1. the journal transaction (`_journal.append`): fence the key, ingest its pending postings,
   replay known input ids, run `decide` over the new inputs in order, write records, postings and
   the key's new state. All or nothing. A `FenceConflict` or any other exception fails the batch
   (the ferry hands `ferry.Failed` to every caller); this process then forgets the key, so the
   retry reloads it.
2. the projection (`_journal.project_step`): bring the key's view up to date in journal order,
   earlier unprojected records first, advancing the projected offset in the same transaction.
   Failures here never fail the batch: the records are durable, so their callers get
   `ferry.Committed(stored answer, cause)` and a later batch or `sweep()` finishes the view.

What this process knows of a key (fence version, last seq, decision state) is cached, and the
journal transaction is a compare-and-set on the version. The cache entry is removed before each
journal transaction and put back only after it committed, so an error or a cancellation (whose
outcome is unknown) always leaves the key forgotten. At most one batch per key runs at a time in
this process (the per-key ferry guarantees it; a per-key lock also keeps `sweep()` out of a key a
batch holds).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Generic, NoReturn, TypeVar, final

import attrs
import trio

from .._errors import Committed, IdReused
from .._text import canonical_json
from ._errors import FenceConflict, ProjectionBlocked
from ._journal import (
    AppendOutcome,
    Decide,
    JournalSnapshot,
    KeyCache,
    Project,
    Stored,
    append,
    audit,
    behind_keys,
    check_namespace,
    create_schema,
    project_step,
    read_snapshot,
)
from ._types import (
    Json,
    ProjectedWriteStatistics,
    Store,
    SweepReport,
    Tx,
)

I = TypeVar("I")  # noqa: E741

#: The most keys of each kind (behind, or with postings waiting) one `sweep()` looks at.
SWEEP_KEYS = 100_000


@attrs.frozen
class _Projected:
    projected_seq: int
    count: int
    failed_seq: int | None = None
    failure: BaseException | None = attrs.field(default=None, eq=False)
    error: BaseException | None = attrs.field(default=None, eq=False)


@final
class ProjectedWrite(Generic[I]):
    """A per-key batch call for `ferry.open_per_key_ferry`: journal, then projection.

    ``await pw(key, inputs)`` returns one slot per input, in order: the stored answer (the view is
    confirmed), ``ferry.Committed(answer, cause)`` (durable, view not confirmed), or an
    ``ferry.IdReused`` instance (the id was used before with other content; nothing written).
    It raises (the ferry turns that into ``ferry.Failed`` for the whole batch) when the journal
    transaction failed: `FenceConflict`, a database error, or an exception from `decide`.

    Arguments (keyword-only after `store`):

    - `input_id(input) -> str`: the idempotency id, unique across all keys.
    - `content(input) -> JSON`: what is journaled and compared on a retry of the same id.
    - `decide(state, content) -> Decision`: pure; runs in the journal transaction over the batch
      in order, from the key's state (`initial` for a new key). Its answer is stored and returned
      on every retry; its postings go to other keys' inboxes.
    - `project(view, key, records) -> None | [None | exception per record]`: applies records to
      the user's view tables through `view` (a `Tx`) in the transaction that advances the key's
      projected offset. Raising fails the whole attempt (retried `projection_attempts` times with
      exponential backoff from `projection_backoff` seconds); returning an exception for a record
      fails that record (everything done in that call is rolled back and the records before it
      are projected again).
    - `receive(state, payload) -> Decision`: applies an ingested posting (required if `decide`
      ever emits postings).
    - `setup(tx)`: creates the user's view schema; runs once, with the journal schema.
    - `namespace`: prefix of the journal's tables. `cache_size`: keys remembered.
    - `fencing`: TEST ONLY. ``False`` drops the version compare-and-set and the (key, seq)
      uniqueness, to show what goes wrong without them. Never use it in production.
    """

    def __init__(
        self,
        store: Store,
        *,
        input_id: Callable[[I], str],
        content: Callable[[I], Json],
        decide: Decide,
        project: Project,
        initial: Json = None,
        receive: Decide | None = None,
        setup: Callable[[Tx], None] | None = None,
        namespace: str = "ferry",
        projection_attempts: int = 3,
        projection_backoff: float = 0.01,
        projection_chunk: int = 1000,
        cache_size: int = 100_000,
        fencing: bool = True,
    ) -> None:
        if projection_attempts < 1:
            raise ValueError(f"projection_attempts must be >= 1, got {projection_attempts!r}")
        if not projection_backoff >= 0:
            raise ValueError(f"projection_backoff must be >= 0, got {projection_backoff!r}")
        if projection_chunk < 1:
            raise ValueError(f"projection_chunk must be >= 1, got {projection_chunk!r}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size!r}")
        self.store = store
        self.namespace = check_namespace(namespace)
        self._input_id = input_id
        self._content = content
        self._decide = decide
        self._project = project
        self._initial = initial
        self._initial_text = canonical_json(initial)
        self._receive = receive
        self._setup = setup
        self._attempts = projection_attempts
        self._backoff = projection_backoff
        self._chunk = projection_chunk
        self._cache_size = cache_size
        self._fencing = fencing
        self._cache: dict[str, KeyCache] = {}  # insertion order = least recently used first
        self._locks: dict[str, trio.Lock] = {}  # keys a batch or the sweeper holds right now
        self._schema_ready = False
        self._schema_lock = trio.Lock()
        self._stats = dict.fromkeys(attrs.fields_dict(ProjectedWriteStatistics), 0)

    # -- the batch call ------------------------------------------------------------------------

    async def __call__(self, key: str, inputs: Sequence[I]) -> list[Any]:
        """Journal then project one batch for `key`; one slot per input, in order.

        Checkpoints (several store transactions on worker threads). Raises `FenceConflict`, a
        database error, or what `input_id`/`content`/`decide` raise: nothing of the batch was
        written then. If cancelled during the journal transaction, all of the batch or none of it
        is in the journal.
        """
        if not isinstance(key, str):
            raise TypeError(f"ProjectedWrite keys are str, got {type(key).__name__}")
        items = []
        for x in inputs:
            rid = self._input_id(x)
            if not isinstance(rid, str):
                raise TypeError(f"input_id must return a str, got {rid!r}")
            items.append((rid, canonical_json(self._content(x))))
        await self._ensure_schema()
        self._stats["batches"] += 1
        self._stats["inputs"] += len(items)
        async with self._holding(key):
            out = await self._append(key, items)
            seqs = [s.seq for s in out.slots if isinstance(s, Stored)]
            if not seqs:
                return list(out.slots)
            result = await self._project_key(key, max(seqs), self._attempts)
        return self._answers(key, out, result)

    def _answers(self, key: str, out: AppendOutcome, p: _Projected) -> list[Any]:
        answers: list[Any] = []
        for slot in out.slots:
            if isinstance(slot, IdReused):
                answers.append(slot)
                continue
            if slot.seq <= p.projected_seq:
                answers.append(slot.answer)
                continue
            cause: BaseException
            if p.failed_seq is not None and slot.seq == p.failed_seq and p.failure is not None:
                cause = p.failure
            elif p.failed_seq is not None and slot.seq > p.failed_seq:
                cause = ProjectionBlocked(
                    f"record {slot.seq} of key {key!r} waits behind record {p.failed_seq},"
                    " whose projection failed"
                )
                cause.__cause__ = p.failure
            elif p.error is not None:
                cause = p.error
            else:
                cause = RuntimeError(f"record {slot.seq} of key {key!r} was not projected")
            self._stats["committed"] += 1
            answers.append(Committed(slot.answer, cause))
        return answers

    async def _append(self, key: str, items: Sequence[tuple[str, str]]) -> AppendOutcome:
        cache = self._cache.pop(key, None)  # forgotten unless the transaction commits
        try:
            out = await self.store.transact(
                partial(
                    append,
                    ns=self.namespace,
                    key=key,
                    cache=cache,
                    items=items,
                    decide=self._decide,
                    receive=self._receive,
                    initial_text=self._initial_text,
                    fencing=self._fencing,
                )
            )
        except Exception as exc:
            if isinstance(exc, FenceConflict):
                self._stats["fence_conflicts"] += 1
            raise
        if self._cache_size:
            self._cache[key] = out.cache
            if len(self._cache) > self._cache_size:
                del self._cache[next(iter(self._cache))]
        self._stats["written"] += out.written
        self._stats["replayed"] += out.replayed
        self._stats["id_reused"] += sum(isinstance(s, IdReused) for s in out.slots)
        return out

    async def _project_key(self, key: str, target: int | None, attempts: int) -> _Projected:
        failures = 0
        projected_seq = 0
        count = 0
        while True:
            try:
                step = await self.store.transact(
                    partial(
                        project_step,
                        ns=self.namespace,
                        key=key,
                        project=self._project,
                        limit=self._chunk,
                    )
                )
            except Exception as exc:
                failures += 1
                self._stats["projection_attempts_failed"] += 1
                if failures >= attempts:
                    return _Projected(projected_seq, count, error=exc)
                await trio.sleep(self._backoff * 2 ** (failures - 1))
                continue
            projected_seq = step.projected_seq
            count += step.projected
            if step.failed_seq is not None:
                return _Projected(projected_seq, count, step.failed_seq, step.failure)
            goal = step.last_seq if target is None else min(target, step.last_seq)
            if projected_seq >= goal or step.projected == 0:
                return _Projected(projected_seq, count)

    # -- catch-up ------------------------------------------------------------------------------

    async def sweep(self) -> SweepReport:
        """Ingest pending postings and project unprojected records, key by key, up to a cap.

        One call looks at no more than `SWEEP_KEYS` (100,000) keys with unprojected records and
        as many with postings waiting, the first of each in key order; the keys past the cap wait
        for the next call (so call it until `SweepReport.keys` is 0 to be sure, or let
        `run_sweeper` call it periodically). Keys a batch of this process holds right now are
        skipped (that batch catches them up). One projection attempt per key; a key that fails
        is counted and left for the next sweep. Checkpoints; raises only if listing the keys
        fails. Cost: O(keys looked at + their records).
        """
        await self._ensure_schema()
        behind, pending = await self.store.transact(
            partial(behind_keys, ns=self.namespace, limit=SWEEP_KEYS)
        )
        inbox = set(pending)
        keys = sorted(set(behind) | inbox)
        ingested = projected = failed = 0
        for key in keys:
            if key in self._locks:
                continue
            async with self._holding(key):
                try:
                    if key in inbox:
                        ingested += (await self._append(key, [])).ingested
                    p = await self._project_key(key, None, 1)
                except Exception:
                    failed += 1
                    continue
                projected += p.count
                if p.failed_seq is not None or p.error is not None:
                    failed += 1
        self._stats["sweeps"] += 1
        return SweepReport(len(keys), ingested, projected, failed)

    async def run_sweeper(
        self, interval: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Run `sweep()` every `interval` seconds, forever; for ``nursery.start``.

        A sweep that raises is counted (`statistics().sweep_errors`) and the loop goes on.
        """
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        task_status.started()
        while True:
            try:
                await self.sweep()
            except Exception:
                self._stats["sweep_errors"] += 1
            await trio.sleep(interval)

    # -- helpers -------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Create the journal's tables and run the user's `setup` hook, once. Idempotent.

        Called by the first batch or sweep if not called before.
        """
        await self._ensure_schema()

    async def _ensure_schema(self) -> None:
        if self._schema_ready:
            return
        async with self._schema_lock:
            if not self._schema_ready:
                await self.store.transact(
                    partial(
                        create_schema, ns=self.namespace, fencing=self._fencing, setup=self._setup
                    )
                )
                self._schema_ready = True

    @asynccontextmanager
    async def _holding(self, key: str) -> AsyncIterator[None]:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = trio.Lock()
        try:
            await lock.acquire()
        except BaseException:
            self._drop_lock(key, lock)
            raise
        try:
            yield
        finally:
            lock.release()
            self._drop_lock(key, lock)

    def _drop_lock(self, key: str, lock: trio.Lock) -> None:
        idle = not lock.locked() and lock.statistics().tasks_waiting == 0
        if idle and self._locks.get(key) is lock:
            del self._locks[key]

    def forget(self, key: str | None = None) -> None:
        """Drop what this process knows of `key` (of every key if None). No checkpoint."""
        if key is None:
            self._cache.clear()
        else:
            self._cache.pop(key, None)

    async def snapshot(self) -> JournalSnapshot:
        """Read the whole journal, key rows and inbox in one transaction (tests, audits)."""
        await self._ensure_schema()
        return await self.store.transact(partial(read_snapshot, ns=self.namespace))

    async def audit(self) -> list[str]:
        """Problems in the journal (see `ferry.projected.audit`); empty when exact. O(journal)."""
        snap = await self.snapshot()
        return audit(snap, decide=self._decide, receive=self._receive, initial=self._initial)

    def statistics(self) -> ProjectedWriteStatistics:
        """Counters since this object was made. No checkpoint, O(1)."""
        return ProjectedWriteStatistics(**{**self._stats, "cached_keys": len(self._cache)})
