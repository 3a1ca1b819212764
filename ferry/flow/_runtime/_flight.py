"""A batch of the write ferry in flight, and how its results answer their callers (`_writes`).

Pure bookkeeping over trio events: no store access.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ferry import Failed

from .._model import _checks
from .._store import _op


def rolled_back(exc: BaseException) -> bool:
    """Did the database roll the transaction back on its own (SQLSTATE class 40: a deadlock, a
    serialization failure)? Then nothing of it was written, and running it again is safe."""
    return str(getattr(exc, "sqlstate", None) or "").startswith("40")


class Flight:
    """A batch the write ferry runs (`Writes.batch`): its ops and, once `done` is set, their
    results, or what the batch raised."""

    __slots__ = ("done", "error", "ops", "results")

    def __init__(self, ops: Sequence[_op.Op]) -> None:
        self.ops = ops
        self.done = trio.Event()
        self.results: list[_op.Result] | None = None
        self.error: BaseException | None = None

    def landed(self, op: _op.Op) -> _op.Result:
        """The answer `Writes.write` would have given `op`, written by this batch, to a caller
        that was cancelled while the batch ran (`Writes.request`)."""
        if self.results is None:
            error = self.error
            if isinstance(error, Exception):
                raise Failed(f"the flow store raised {error!r}") from error
            raise Failed(
                "the batch of this write was cancelled while it ran (the engine is closing, or"
                " the store did not answer in time): it may or may not have been written;"
                " read the flow to know"
            ) from error
        index = next(i for i, o in enumerate(self.ops) if o is op)
        return unless_rejected(answered(self.results[index]))


def answered(result: _op.Result) -> _op.Result:
    """An op's result as `write_answered` gives it: a transition that raised is raised, a
    store that failed is `ferry.Failed`."""
    if isinstance(result, _op.Refused):
        raise result.error
    if isinstance(result, _op.Unwritten):
        raise Failed(f"the flow store raised {result.error!r}") from result.error
    return result


def unless_rejected(result: _op.Result) -> _op.Result:
    """`result`, or `ferry.Failed` if the database refused the op's row (as `write` raises)."""
    if isinstance(result, _op.Rejected):
        raise Failed(
            f"the database refused the write of flow {result.flow_id!r}:"
            f" {_checks.describe(result.error)}; nothing of it was written"
        ) from result.error
    return result
