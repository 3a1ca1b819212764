"""A batch of flow writes in which a row the database refuses is answered to its flow alone
(docs/adr/0063).

The engine writes the boundaries of many flows in one transaction (group commit). If the
database refuses one of their rows for a reason of that row (a constraint, a trigger, a value the
driver cannot send), the whole transaction fails with it, and every flow of the batch with it.
`write_apart` runs the batch; if it fails for a reason that is not the store's unavailability,
it splits the batch in halves and runs each on its own, down to the single op that fails, which
is answered `Rejected` with the database's error; every other op is committed and answered as
usual. A half that meets the store unavailable is answered `Unwritten` (its callers retry it).

Cost: nothing while no row is refused; for one refused row in a batch of n, about 2 log2(n)
more transactions, run one after the other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from .._store._op import Op, Rejected, Result, Unwritten, op_flow_id
from . import _retry

Run = Callable[[Sequence[Op]], Awaitable[list[Result]]]


async def write_apart(run: Run, ops: Sequence[Op]) -> list[Result]:
    """``await run(ops)`` (one transaction of the whole batch); if it raises anything but the
    store's unavailability, the batch is written apart (`split`). The store's unavailability
    of the whole batch is raised (nothing of it was written)."""
    try:
        return await run(ops)
    except Exception as exc:
        if _retry.unavailable(exc):
            raise
        return await split(run, ops, exc)


async def split(run: Run, ops: Sequence[Op], error: Exception) -> list[Result]:
    """Results for `ops`, whose one transaction failed with `error` (not unavailability):
    written apart, in halves."""
    if len(ops) == 1:
        return [Rejected(op_flow_id(ops[0]), error)]
    mid = len(ops) // 2
    results: list[Result] = []
    for half in (ops[:mid], ops[mid:]):
        try:
            results += await run(half)
        except Exception as exc:
            if _retry.unavailable(exc):
                results += [Unwritten(op_flow_id(op), exc) for op in half]
            else:
                results += await split(run, half, exc)
    return results
