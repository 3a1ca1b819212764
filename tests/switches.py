"""Engines opened with the switches only tests and benchmarks use (group commit off, the fleet's
leases forced on or off, fencing off, another scan interval or wall clock: a host clock that
is skewed or stepped, which on PostgreSQL reaches durable times but not leases), which are not in
`flow.open_engine`'s signature. Every other option is `open_engine`'s own, with its defaults.

Fencing off is a planted bug, made here and nowhere in the package: while such an engine is
open, the store's batch writer (`_batch.write_batch`) is replaced by `unfenced`, which rebases
every write from a caller's copy onto the revision the store holds and drops a takeover's
"nobody holds it" condition. A stale copy's write then goes through (it overwrites whatever the
row holds and takes the next revision), which is what the fleet's tests must catch.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs

from ferry import flow
from ferry.flow._engine import _open
from ferry.flow._store import _batch, _op, _store
from ferry.projected import Tx

WriteBatch = Callable[..., list[_op.Result]]


def unfenced(write_batch: WriteBatch) -> WriteBatch:
    """`write_batch` without fencing: each `Change` from a copy is rebased on the stored
    revision (read in the same transaction, before the batch), and a takeover no longer asks
    whether another engine holds the flow."""

    def write(tx: Tx, ops: Sequence[_op.Op], **options: Any) -> list[_op.Result]:
        ids = sorted({op.flow_id for op in ops if isinstance(op, _op.Change) and op.flow})
        stored = {f.flow_id: f.revision for f in _store.load_many(tx, ids)}
        rebased: list[_op.Op] = []
        for op in ops:
            if isinstance(op, _op.Change) and op.flow is not None and op.flow_id in stored:
                copy = attrs.evolve(op.flow, revision=stored[op.flow_id])
                op = attrs.evolve(op, flow=copy, lapsed_at=None)
            rebased.append(op)
        return write_batch(tx, rebased, **options)

    return write


@asynccontextmanager
async def _without_fencing(
    opening: AbstractAsyncContextManager[flow.Engine],
) -> AsyncIterator[flow.Engine]:
    fenced = _batch.write_batch
    write = unfenced(fenced)
    _batch.write_batch = write
    try:
        async with opening as engine:
            yield engine
    finally:
        _batch.write_batch = fenced


def open_engine(
    store: Any,
    plans: Any,
    *,
    group_commit: bool = True,
    wall_clock: Callable[[], float] = time.time,
    fleet: bool | None = None,
    fencing: bool = True,
    scan_interval: float | None = None,
    **options: Any,
) -> AbstractAsyncContextManager[flow.Engine]:
    """`flow.open_engine(store, plans, **options)` with the given switches."""
    bound = inspect.signature(flow.open_engine).bind(store, plans, **options)
    bound.apply_defaults()
    switches = _open._Switches(
        group_commit=group_commit,
        wall_clock=wall_clock,
        fleet=fleet,
        scan_interval=scan_interval,
    )
    opening = _open._Opening(_open._opened(*bound.args, **bound.kwargs, switches=switches))
    return opening if fencing else _without_fencing(opening)
