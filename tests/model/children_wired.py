"""The children model check on the wired engine's rule (issue 28, docs/adr/0163).

The engine records an ordinary child's end (while its spawn waits or stops) not with the pure
`_family.child_ended` but with SQL on counters (`_store._family.record_end`), then, for the end
that stops the spawn or is its last, the pure `stop`/`maybe_on` or `go_on` on the rows read back
(`_store._kin._ended`). `WiredProtocol` makes every such end of the model that way, on a real
SQLite database (in memory, the family's own tables, loaded with the model's rows for each end),
and checks, at every end the search reaches, that the wired rule writes what the pure one says
(the same parent transition, spawn row, children's rows and flow writes). Any other end (one
that the parent's compensation undoes) is the pure function's, as in `_kin._ended`.

What the wired rule cannot be checked for here: the statements' locks and a concurrent writer
(the store's own tests do that on PostgreSQL: tests/flow/test_family_store.py).
"""

from __future__ import annotations

import sqlite3
from typing import Any

import attrs

from ferry.flow._model import _family as fam
from ferry.flow._model import _machine as fm
from ferry.flow._model._family import Move
from ferry.flow._model._family_spawn import go_on, maybe_on, stop
from ferry.flow._model._values import Flow, Shape, Transition
from ferry.flow._store import _family as sf
from tests.model.checker import _step_violation
from tests.model.children import NOW, C, ChildrenProtocol, shape_of


class _Memory:
    """A `Tx` over one in-memory SQLite database holding the family's tables."""

    dialect = "sqlite"

    def __init__(self) -> None:
        self.connection = sqlite3.connect(":memory:", isolation_level=None)
        sf.create_tables(self)

    def execute(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        cur = self.connection.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []

    def executemany(self, sql: str, rows: Any) -> None:
        self.connection.executemany(sql, rows)

    def load(self, m: C) -> None:
        """The model's spawn and children's rows, as the store holds them before the end."""
        b = m.brood
        assert b is not None
        self.execute(f"DELETE FROM {sf.SPAWNS}")
        self.execute(f"DELETE FROM {sf.CHILDREN}")
        marks = ", ".join("?" * len(sf._brood_values(b)))
        self.execute(f"INSERT INTO {sf.SPAWNS} ({sf._BROOD}) VALUES ({marks})", sf._brood_values(b))
        rows = [[b.parent, b.step_index, *sf._kid_values(k)] for k in m.kids]
        marks = ", ".join("?" * len(rows[0]))
        self.executemany(
            f"INSERT INTO {sf.CHILDREN} (parent, step_index, {sf._KID}) VALUES ({marks})", rows
        )


class WiredProtocol(ChildrenProtocol):
    """The children protocol with an ordinary end made as the engine makes it (module doc)."""

    def __init__(self, *, cross_check: bool = True) -> None:
        self.cross_check = cross_check  # False: only the model's properties judge the end
        self.tx = _Memory()
        self.wired_ends = 0  # ends made by the wired rule, once per distinct end (`_seen`)
        # The end's inputs -> its wired move: states that differ elsewhere (an engine's pending
        # results, the crashes left, the history folded) share their ends; each runs once.
        self._seen: dict[Any, Move] = {}

    def record_end(self, tx: _Memory, child: Flow, stack: tuple[int, ...]) -> sf.End:
        """The store's `record_end` (a planted bug overrides it)."""
        return sf.record_end(tx, child, stack)

    def child_ended(self, m: C, shape: Shape, index: int, before: Flow, after: Transition) -> Move:
        b = m.brood
        assert b is not None
        if b.phase not in (fam.WAITING, fam.STOPPING):
            # an end the parent's compensation undoes: the pure function's
            return super().child_ended(m, shape, index, before, after)
        # Both rules read of `after` only the row it leaves (`after.flow`).
        key = (b, m.kids, m.children, m.parent, shape, index, before, after.flow)
        wired = self._seen.get(key)
        if wired is not None:
            return wired
        wired = self._seen[key] = self._wired(m, shape, index, before, after)
        self.wired_ends += 1
        pure = super().child_ended(m, shape, index, before, after)
        if self.cross_check and _canon(wired) != _canon(pure):
            raise _step_violation(
                f"child {m.kids[index].key} ends",
                f"the wired end writes {wired!r}, the model's rule {pure!r}",
            )
        return wired

    def _wired(self, m: C, shape: Shape, index: int, before: Flow, after: Transition) -> Move:
        """`_kin._ended`'s recipe on the database: `record_end`, the next kept child started,
        and for the end that stops the spawn or is its last, the rest on the rows read back."""
        tx = self.tx
        tx.load(m)
        b = m.brood
        assert b is not None
        kid = m.kids[index]
        stack = fam.child_stack(before, after.flow, shape_of(kid.plan, kid.version))
        end = self.record_end(tx, after.flow, stack)
        kids_changed = [end.kid]
        moved: list[Transition] = []
        rows = list(m.children)
        rows[index] = after.flow
        if end.start is not None:
            k = end.start
            first = fm.start(shape_of(k.plan, k.version), k.flow_id, k.data, NOW, parent=b.parent)
            moved.append(first)
            kids_changed.append(k)
            rows[k.index] = first.flow
        if not (end.stopped or end.last):
            return Move(None, end.brood, tuple(kids_changed), tuple(moved))
        kids = sf.children(tx, b.parent, b.step_index)
        if end.stopped:
            reason = end.brood.reason
            assert reason is not None
            nb, stopped, cancels = stop(end.brood, kids, rows, "compensate", reason, shape_of, NOW)
            on = maybe_on(nb, kids, rows, m.parent, shape, shape_of, NOW, stopped, cancels)
        else:
            on = go_on(end.brood, kids, rows, m.parent, shape, shape_of, NOW)
        return Move(on.parent, on.brood, (*kids_changed, *on.kids), (*moved, *on.children))


def _canon(move: Move) -> Any:
    """A move as what it writes: the parent's transition, the spawn row, each child's row (by
    index, the last change of each) and each flow write (by flow id)."""
    kids = {k.index: k for k in move.kids}
    flows = {t.flow.flow_id: attrs.astuple(t, recurse=False) for t in move.children}
    parent = None if move.parent is None else attrs.astuple(move.parent, recurse=False)
    return (parent, move.brood, sorted(kids.items()), sorted(flows.items()))
