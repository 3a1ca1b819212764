"""What an operator reads of a flow's family (SPEC 5.7, docs/adr/0159): its parent, and each of
its spawns with the spawn's phase and counters and its children's keys, states and ids.

The inspector's ``show`` and the dashboard's flow page both read it here (`family_of`), in
their one read-only transaction; ``list --parent ID`` and the dashboard's ``/flows?parent=ID``
list a parent's children through `_query.FlowFilter.parent` instead (every child, paged).

Synchronous, like `_store`: no trio, no clock. Cost: one probe of the parent's row, one read of
the flow's spawns (its primary key), and per spawn one range of ``flow_children`` by its
primary key joined to the children's flow rows, at most `limit` rows: a spawn of 10,000
children costs what one of `limit` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs

from ferry.projected import Tx

from .._model._family import KEPT
from .._model._values import Flow
from . import _schema, _sql, _store

__all__ = ["CHILDREN_SHOWN", "Family", "Kin", "SpawnShown", "family_of", "root_of"]

#: How many children of each spawn `family_of` reads (the rest: ``list --parent ID``).
CHILDREN_SHOWN: Final = 100


@attrs.frozen
class Kin:
    """One child of a spawn as an operator sees it: `state` is its flow's state's name, or
    ``"KEPT"`` (not started yet: no flow row); `undone` True once its parent's compensation
    compensated it; `ended` its place in the order of its spawn's ends (0: not ended)."""

    index: int
    key: str
    flow_id: str
    plan: str
    version: int
    state: str
    undone: bool
    ended: int


@attrs.frozen
class SpawnShown:
    """One spawn of a flow: the step that spawned (`step_index`), its `phase` (``waiting``,
    ``stopping``, ``over``, ``undoing``, ``undone``), its counters (`total`, `active`,
    `ended`, `kept`: not started yet), its options, why it stopped (`reason`), and its first
    `CHILDREN_SHOWN` children in spawn order (`children`)."""

    step_index: int
    phase: str
    total: int
    active: int
    ended: int
    kept: int
    max_running: int | None
    on_failure: str
    reason: str | None
    undoing: int | None
    children: tuple[Kin, ...]

    @property
    def more(self) -> int:
        """How many of its children `children` leaves out."""
        return self.total - len(self.children)


@attrs.frozen
class Family:
    """A flow's `parent` (None: a top-level flow) and that parent's state's name (None if its
    row is gone), and the flow's own spawns, the first step first."""

    parent: str | None
    parent_state: str | None
    spawns: tuple[SpawnShown, ...]

    @property
    def children(self) -> int:
        """How many children the flow spawned, in all its spawns."""
        return sum(s.total for s in self.spawns)


_SPAWN: Final = (
    "step_index, phase, total, active, ended, next_kept, max_running, on_failure, reason, undoing"
)


def _kin(row: Sequence[Any]) -> Kin:
    state = row[5] if row[5] is not None else row[6].upper()
    if row[6] == KEPT:
        state = "KEPT"
    return Kin(row[0], row[1], row[2], row[3], row[4], str(state), bool(row[7]), int(row[8]))


def family_of(tx: Tx, flow: Flow, *, limit: int | None = None) -> Family:
    """The family of `flow` (a row read in this transaction), the first `limit` children of
    each spawn (None: `CHILDREN_SHOWN`): see the module doc."""
    limit = CHILDREN_SHOWN if limit is None else limit
    parent_state = None
    if flow.parent is not None:
        found = tx.execute(f"SELECT state FROM {_sql.FLOWS} WHERE flow_id = ?", (flow.parent,))
        parent_state = found[0][0] if found else None
    spawns = []
    rows = tx.execute(
        f"SELECT {_SPAWN} FROM {_schema.SPAWNS} WHERE parent = ? ORDER BY step_index",
        (flow.flow_id,),
    )
    for r in rows:
        kids = tx.execute(
            f"SELECT c.idx, c.child_key, c.flow_id, c.plan, c.version, f.state, c.status,"
            f" c.undone, c.ended FROM {_schema.CHILDREN} c LEFT JOIN {_sql.FLOWS} f"
            f" ON f.flow_id = c.flow_id WHERE c.parent = ? AND c.step_index = ?"
            f" ORDER BY c.idx LIMIT {int(limit)}",
            (flow.flow_id, r[0]),
        )
        spawns.append(
            SpawnShown(
                step_index=r[0],
                phase=r[1],
                total=r[2],
                active=r[3],
                ended=r[4],
                kept=r[2] - r[5],
                max_running=r[6],
                on_failure=r[7],
                reason=r[8],
                undoing=r[9],
                children=tuple(_kin(k) for k in kids),
            )
        )
    return Family(flow.parent, parent_state, tuple(spawns))


def root_of(tx: Tx, flow: Flow) -> Flow:
    """The top-level flow of `flow`'s tree (itself if it has no parent): one probe per level."""
    seen = {flow.flow_id}
    while flow.parent is not None:
        up = _store.load(tx, flow.parent)
        if up is None or up.flow_id in seen:
            break
        seen.add(up.flow_id)
        flow = up
    return flow
