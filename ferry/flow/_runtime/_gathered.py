"""A parent's ``ctx.children`` kept as its children's ends commit (docs/adr/0173), so that the
step after a spawn of many children starts without reading them all back.

The store stays the truth: the kid rows (`_store._family`, written in each child's last
transaction) are what ``ctx.children`` is read from (`_kin.results_of`), and that read is what
this module saves, once, on the engine that wrote the spawn and committed every one of its
children's ends. What it keeps is what those commits wrote to the kid rows: for each child its
state (`COMPLETED` or `FAILED`), its data when it ended and its error, the `ChildResult` that
`_family.results` makes of that row; and the spawn order, from the spawn's own write.

Used only when it is whole: every child of the spawn has its end here (none ended on another
engine of a fleet, none kept and never started because the spawn stopped, no restart in
between), and the parent is the flow that spawned (the same ``created_at``: an id reused after
a purge is another flow) at the same step. Anything else, and the next step reads the store as
before. A spawn is forgotten when its results are taken (a retry of that step reads the store:
its copy of the data is fresh), when its parent's row is seen anywhere but waiting at the spawn
or running the step after it (a compensation, a cancel), when one of its children ends twice
(its parent's compensation undid it), and when the results kept by all spawns would pass
`BUDGET` bytes of data (that spawn is read back instead; a new spawn makes room by forgetting
the oldest, such as one whose parent another engine of a fleet moved on).

Trio thread only (`Writes._applied` calls `seen` for every committed row that changed a flow's
state: a child's end, a parent's move); no I/O. Cost: a dict probe per such row while a spawn
is kept, one JSON parse per child's end (of the data the end wrote), nothing at the fan-in (the
results are kept in spawn order from the spawn's write on).
"""

from __future__ import annotations

import json
from typing import Final, cast

from .._model._children import ChildResult, parent_of
from .._model._values import COMPLETED, FAILED, PARKED, RUNNING, Flow

__all__ = ["BUDGET", "Gathered"]

#: The bytes of children's data (and keys) all kept spawns may hold; a spawn past it is dropped.
BUDGET: Final = 32 * 1024 * 1024

_ENDS: Final = (COMPLETED, FAILED)


class _Spawn:
    """One spawn's ends so far: by key in spawn order, None for a child not ended yet."""

    __slots__ = ("created_at", "ended", "results", "size", "step_index")

    def __init__(self, step_index: int, created_at: float, keys: tuple[str, ...]) -> None:
        self.step_index = step_index
        self.created_at = created_at
        self.results: dict[str, ChildResult | None] = dict.fromkeys(keys)
        self.ended = 0
        self.size = sum(len(k) for k in keys)


class Gathered:
    """The children's ends of the spawns this engine wrote, by parent (see the module doc)."""

    __slots__ = ("_budget", "_size", "parents")

    def __init__(self, budget: int = BUDGET) -> None:
        self._budget = budget
        self._size = 0
        #: parent flow id -> its kept spawn (a parent waits for one spawn at a time)
        self.parents: dict[str, _Spawn] = {}

    def spawned(
        self, parent: str, step_index: int, created_at: float, keys: tuple[str, ...]
    ) -> None:
        """This engine writes the spawn of `parent` (started at `created_at`) at `step_index`,
        of the children `keys` in spawn order: keep their ends from now on. Call before the
        write (a child may end right after its commit), and `forget` if it was not written."""
        self.forget(parent)
        entry = _Spawn(step_index, created_at, keys)
        if entry.size > self._budget:
            return
        while self._size + entry.size > self._budget:  # the oldest spawns make room
            self.forget(next(iter(self.parents)))
        self.parents[parent] = entry
        self._size += entry.size

    def forget(self, parent: str) -> None:
        """Keep nothing more of `parent`'s spawn."""
        entry = self.parents.pop(parent, None)
        if entry is not None:
            self._size -= entry.size

    def seen(self, flow: Flow) -> None:
        """A committed row of this engine's write that changed the flow's state: a child's end
        is kept for its parent; a parent seen past its spawn is forgotten."""
        if not self.parents:
            return
        entry = self.parents.get(flow.flow_id)
        if entry is not None and not _waits(flow, entry):
            self.forget(flow.flow_id)
        if flow.parent is None or flow.state not in _ENDS:
            return
        entry = self.parents.get(flow.parent)
        if entry is None:
            return
        found = parent_of(flow.flow_id)
        key = found[2] if found is not None and found[1] == entry.step_index else ""
        # Not a child of this spawn, or its second end (its parent's compensation undid it).
        if key not in entry.results or entry.results[key] is not None:
            self.forget(flow.parent)
            return
        size = len(flow.data) + len(flow.error or "")
        if self._size + size > self._budget:
            self.forget(flow.parent)
            return
        error = None if flow.state is COMPLETED else flow.error
        data = json.loads(flow.data)
        entry.results[key] = ChildResult(flow.flow_id, flow.state, data, error)
        entry.ended += 1
        entry.size += size
        self._size += size

    def take(self, flow: Flow) -> dict[str, ChildResult] | None:
        """``ctx.children`` of `flow`'s current step, if every end of its `fan_in` spawn is
        kept here (in spawn order), else None (read the store). Forgets the spawn either way."""
        entry = self.parents.get(flow.flow_id)
        if entry is None:
            return None
        self.forget(flow.flow_id)
        if (
            flow.fan_in != entry.step_index
            or flow.created_at != entry.created_at
            or entry.ended != len(entry.results)
        ):
            return None
        return cast(dict[str, ChildResult], entry.results)  # every one ended: none is None


def _waits(flow: Flow, entry: _Spawn) -> bool:
    """Is the parent's row still at the spawn (parked at it, or running the step after it)?"""
    if flow.created_at != entry.created_at:
        return False
    if flow.state is PARKED:
        return flow.step_index == entry.step_index
    return flow.state is RUNNING and flow.fan_in == entry.step_index
