"""Exhaustive model check of child flows: a parent, its spawn of 2 children, and the actors.

`ferry.flow._model._family` decides what a family records at each write (the spawn, a child's
end, the parent moving on, the undoing of its children); `_machine` drives each flow's own
steps. This model explores every interleaving of the actors for small bounds with the search of
`checker.py` (BFS, deduplicated states, shortest counterexample traces), asking for every family
transition through a `ChildrenProtocol` object, so that a test can plant a bug by overriding one.

The plans
---------
The parent (``order``): step 0 ``ship`` spawns children ``a`` and ``b`` (``max_running``,
``on_failure``, a timeout as the bound says; with or without a compensation of its own), step 1
``invoice`` continues or fails. A child (``box``): steps ``pack`` and ``label``, each with a
compensation, each continuing or failing. Compensations succeed.

Actors and their steps
----------------------
- the store holds every row (the parent's, the spawn's, the children's rows of ``flow_children``
  and each child's flow row). A write is atomic: one `Move` of `_family`, or one transition of
  `_machine`, with what `_family` adds to it in the same transaction (a child's end, the parent
  compensating past its spawn). A write that starts a child whose row exists is refused by the
  store's unique key: the model reports it ("started twice").
- the engine runs every runnable flow (the parent unless its spawn waits or undoes, any active
  child): run the body once (a side effect), then write its outcome as a compare-and-set on the
  revision it read: refused if the row moved meanwhile (a cancel), and the body's result is lost.
  A crash (bounded) loses every body whose result is not written; recovery (`recover`) finds
  everything it needs in the rows and does nothing of its own.
- the outside world cancels the parent once, and (with ``child_cancel``) child ``a`` once,
  at any moment.
- the clock: the spawn's timeout may fire whenever the parent waits with a deadline.

Properties
----------
In every state: each row's `check_invariants` (the parent's except while its spawn undoes its
children, when it waits at the spawning step); `check_family` (the spawn's counters equal what
its children's rows say, no child active or kept once the parent went on, a parent waiting iff
its spawn waits); no child started twice; no step outcome and no compensation recorded twice;
the parent moved on from its spawn at most once; the spawning step's own compensation recorded
only after every completed child was compensated. In every terminal state: the parent ended,
no child is active; a completed parent compensated no child; a failed parent compensated every
child that completed, each once, in the reverse order of their ends, each ending `FAILED` with
an error that names the parent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import attrs

from ferry.flow._model import _family as fam
from ferry.flow._model import _invariants
from ferry.flow._model import _machine as fm
from ferry.flow._model._family import Brood, Kid, Move
from ferry.flow._model._types import Fail
from ferry.flow._model._values import (
    COMPENSATING,
    COMPLETED,
    EMPTY_MAILBOX,
    FAILED,
    PARKED,
    RUNNING,
    TERMINAL,
    Flow,
    Shape,
    Transition,
)
from tests.model.checker import Search, _step_violation

NOW = 0.0  # no clock: the timer is an actor that may fire whenever a deadline is armed
KEYS = ("a", "b", "c")  # the children, by key: the first `ChildrenConfig.children` of them
CHILD = Shape("box", 1, ("pack", "label"), (True, True), (1, 1))


def shape_of(plan: str, version: int) -> Shape:
    assert (plan, version) == ("box", 1)
    return CHILD


@attrs.frozen
class ChildrenConfig:
    """Bounds of one children model check (see the module doc)."""

    name: str
    max_running: int | None = None
    on_failure: str = "compensate"
    timeout: bool = True  # the spawn has a timeout (the timer may fire)
    spawn_compensates: bool = True  # the spawning step has a compensation of its own
    children: int = 2
    invoice: tuple[str, ...] = ("continue", "fail")
    pack: tuple[str, ...] = ("continue", "fail")
    crashes: int = 1
    cancel: bool = True
    child_cancel: bool = False

    def __attrs_post_init__(self) -> None:
        assert 1 <= self.children <= len(KEYS)

    @property
    def keys(self) -> tuple[str, ...]:
        return KEYS[: self.children]

    @property
    def shape(self) -> Shape:
        return Shape("order", 1, ("ship", "invoice"), (self.spawn_compensates, False), (1, 1))


class ChildrenProtocol:
    """The family's transitions as the real code makes them. Subclass to plant a bug."""

    def spawned(self, parent: Flow, shape: Shape, cfg: ChildrenConfig) -> Move:
        return fam.spawned(
            parent,
            shape,
            [(k, CHILD, "{}") for k in cfg.keys],
            max_running=cfg.max_running,
            timeout=0.0 if cfg.timeout else None,
            on_failure="continue" if cfg.on_failure == "continue" else "compensate",
            data=parent.data,
            now=NOW,
        )

    def child_ended(self, m: C, shape: Shape, index: int, before: Flow, after: Transition) -> Move:
        assert m.brood is not None
        return fam.child_ended(
            m.brood, m.kids, m.children, m.parent, shape, index, before, after, shape_of, NOW
        )

    def compensating(self, m: C, shape: Shape, t: Transition) -> Move:
        assert m.brood is not None
        return fam.compensating(t, m.brood, m.kids, m.children, shape, shape_of, NOW)

    def cancel(self, m: C, shape: Shape) -> Move | Transition:
        return fam.cancel(m.parent, m.brood, m.kids, m.children, shape, "cancelled", shape_of, NOW)

    def timed_out(self, m: C, shape: Shape) -> Move:
        assert m.brood is not None
        return fam.timed_out(m.brood, m.kids, m.children, m.parent, shape, shape_of, NOW)

    def recover(self, m: C) -> Move | None:
        """The write an engine makes for the family at open, after a crash: none (it is all in
        the rows; the runner finds the runnable flows)."""
        return None


class Ghost(NamedTuple):
    """What the properties need of the history, folded write by write."""

    starts: tuple[int, ...] = ()  # rows written for each child by a start
    outcomes: tuple[tuple[int, int], ...] = ()  # (flow, step) outcomes recorded: 0 the parent
    compensated: tuple[tuple[int, int], ...] = ()  # (flow, step) compensations, in order
    ends: tuple[int, ...] = ()  # children that ended COMPLETED, in the order of their ends
    undone: tuple[int, ...] = ()  # children the parent's compensation reopened, in order
    went_on: int = 0  # times the parent left its spawn (its next step or its compensation)


class C(NamedTuple):
    """One state of the children model."""

    parent: Flow
    brood: Brood | None
    kids: tuple[Kid, ...]
    children: tuple[Flow | None, ...]
    pending: tuple[tuple[str, int] | None, ...]  # per flow (0 the parent): (result, revision)
    crashes: int
    cancel: bool
    child_cancel: bool
    ghost: Ghost


def _canon_flow(f: Flow | None) -> Any:
    return None if f is None else attrs.astuple(attrs.evolve(f, updated_at=0.0), recurse=False)


class ChildrenChecker(Search):
    """Breadth-first search of every interleaving for one `ChildrenConfig` and one protocol."""

    def __init__(
        self,
        config: ChildrenConfig,
        protocol: ChildrenProtocol | None = None,
        *,
        check_family: bool = True,
    ) -> None:
        self.check_family = check_family  # False: only the ghost's properties (to test those)
        self.config = config
        self.name = config.name
        self.shape = config.shape
        if protocol is None:  # the engine's rule for an ordinary end (docs/adr/0163)
            from tests.model.children_wired import WiredProtocol

            protocol = WiredProtocol()
        self.protocol = protocol
        self.coverage: set[str] = set()

    def initial(self) -> C:
        parent = fm.start(self.shape, "order", "{}", NOW).flow
        return C(
            parent,
            None,
            (),
            (None,) * self.config.children,
            (None,) * (self.config.children + 1),
            self.config.crashes,
            self.config.cancel,
            self.config.child_cancel,
            Ghost(starts=(0,) * self.config.children),
        )

    def canon(self, m: C) -> Any:
        return (
            _canon_flow(m.parent),
            m.brood,
            m.kids,
            tuple(_canon_flow(c) for c in m.children),
            m.pending,
            m.crashes,
            m.cancel,
            m.child_cancel,
            m.ghost,
        )

    # ---- rows ----------------------------------------------------------------------------

    def _row(self, m: C, x: int) -> Flow | None:
        return m.parent if x == 0 else m.children[x - 1]

    def _shape(self, x: int) -> Shape:
        return self.shape if x == 0 else CHILD

    def _name(self, x: int) -> str:
        return "parent" if x == 0 else f"child {KEYS[x - 1]}"

    def _runnable(self, m: C, x: int) -> bool:
        row = self._row(m, x)
        if row is None or row.state not in (RUNNING, COMPENSATING):
            return False
        return x != 0 or fam.runnable(row, m.brood)

    # ---- the actors' steps ---------------------------------------------------------------

    def successors(self, m: C) -> Iterator[tuple[str, C]]:
        for x in range(len(m.pending)):
            if m.pending[x] is None and self._runnable(m, x):
                row = self._row(m, x)
                assert row is not None
                for result in self._results(x, row):
                    label = f"{self._name(x)} runs {row.step} ({row.state.name}): {result}"
                    yield label, self._pend(m, x, (result, row.revision))
            elif m.pending[x] is not None:
                yield self._write(m, x)
        if m.crashes and any(p is not None for p in m.pending):
            self.coverage.add("crash")
            crashed = m._replace(pending=(None,) * len(m.pending), crashes=m.crashes - 1)
            label = "the engine crashes and opens again"
            move = self.protocol.recover(crashed)
            yield label, crashed if move is None else self._apply(crashed, move, label)
        if m.cancel:
            yield self._cancel_parent(m)
        if m.child_cancel and m.children[0] is not None:
            step = self._cancel_child(m)
            if step is not None:
                yield step
        if (
            m.brood is not None
            and m.parent.state is PARKED
            and m.parent.park_deadline is not None
            and m.brood.phase == fam.WAITING
        ):
            move = self.protocol.timed_out(m, self.shape)
            if move.parent is not None and move.parent.done:
                self.coverage.add("timeout")
                yield "the spawn's timeout fires", self._apply(m, move, "timeout")

    def _results(self, x: int, row: Flow) -> tuple[str, ...]:
        if row.state is COMPENSATING:
            return ("ok",)
        if x == 0:
            return ("spawn",) if row.step_index == 0 else self.config.invoice
        return self.config.pack

    def _pend(self, m: C, x: int, p: tuple[str, int] | None) -> C:
        pending = list(m.pending)
        pending[x] = p
        return m._replace(pending=tuple(pending))

    def _write(self, m: C, x: int) -> tuple[str, C]:
        p = m.pending[x]
        assert p is not None
        result, revision = p
        row = self._row(m, x)
        assert row is not None
        label = f"{self._name(x)} writes {result}"
        m = self._pend(m, x, None)
        if row.revision != revision:
            self.coverage.add("write refused")
            return f"{label}: refused (the row moved)", m
        shape = self._shape(x)
        if row.state is COMPENSATING:
            t = fm.compensated(row, shape, row.data, NOW)
        elif x == 0 and result == "spawn":
            return label, self._apply(m, self.protocol.spawned(row, shape, self.config), label)
        elif result == "fail":
            t = fm.step_done(row, EMPTY_MAILBOX, shape, Fail(f"{row.step} failed"), row.data, NOW)
        else:
            t = fm.step_done(row, EMPTY_MAILBOX, shape, None, row.data, NOW)
        return label, self._after(m, x, row, t, label)

    def _after(self, m: C, x: int, before: Flow, t: Transition, label: str) -> C:
        """The write of `t` (a transition of flow `x` from its row `before`), with what the
        family adds to it in the same transaction."""
        if x == 0:
            if m.brood is not None and t.flow.state in (COMPENSATING, FAILED):
                return self._apply(m, self.protocol.compensating(m, self.shape, t), label)
            return self._apply(m, None, label, plain=t)
        if t.flow.state in TERMINAL:
            move = self.protocol.child_ended(m, self.shape, x - 1, before, t)
            return self._apply(m, move, label, child=(x - 1, t))
        return self._apply(m, None, label, child=(x - 1, t))

    def _cancel_parent(self, m: C) -> tuple[str, C]:
        m = m._replace(cancel=False)
        moved = self.protocol.cancel(m, self.shape)
        if isinstance(moved, Transition):  # no spawn yet: the machine's cancel alone
            self.coverage.add(f"cancel {moved.done}")
            if not moved.done:
                return "cancel the parent: nothing to do", m
            return "cancel the parent", self._apply(m, None, "cancel", plain=moved)
        assert moved.parent is not None
        waiting = fam.waits(m.parent, m.brood)
        self.coverage.add(f"cancel {'waiting ' if waiting else ''}{moved.parent.done}")
        if not moved.parent.done:
            return "cancel the parent: nothing to do", m
        label = "cancel the parent" + (" waiting for its children" if waiting else "")
        return label, self._apply(m, moved, "cancel")

    def _cancel_child(self, m: C) -> tuple[str, C] | None:
        row = m.children[0]
        assert row is not None
        m = m._replace(child_cancel=False)
        t = fm.cancel(row, CHILD, "cancelled", NOW)
        if not t.done:
            return "cancel child a: nothing to do", m
        self.coverage.add("cancel a child")
        return "cancel child a", self._after(m, 1, row, t, "cancel child a")

    # ---- the store ------------------------------------------------------------------------

    def _apply(
        self,
        m: C,
        move: Move | None,
        label: str,
        *,
        plain: Transition | None = None,
        child: tuple[int, Transition] | None = None,
    ) -> C:
        """One write: the store's compare-and-sets, and the ghost folded over what it records."""
        g = m.ghost
        parent, children, kids = m.parent, list(m.children), list(m.kids)
        writes: list[tuple[int, Transition]] = []
        if child is not None:
            writes.append((child[0] + 1, child[1]))
        pt = plain if move is None else move.parent
        if pt is not None and pt.written:
            writes.append((0, pt))
        if move is not None:
            for ct in move.children:
                i = next(j for j, k in enumerate(KEYS) if ct.flow.flow_id.endswith(f"/{k}"))
                writes.append((i + 1, ct))
            if m.brood is None:
                kids = list(move.kids)
            else:
                for k in move.kids:
                    was = kids[k.index]
                    if k.status == "completed" and was.status != "completed":
                        g = g._replace(ends=(*g.ends, k.index))
                    kids[k.index] = k
        starts = list(g.starts)
        for x, t in writes:
            row = parent if x == 0 else children[x - 1]
            if t.expected == 0:
                if row is not None:
                    raise _step_violation(label, f"{self._name(x)} started twice")
                starts[x - 1] += 1
            elif row is None or row.revision != t.expected:
                raise _step_violation(label, f"{self._name(x)}: a write on a stale row")
            else:
                g = self._fold(g, x, row, t, label, kids, children)
            if x == 0:
                if parent.state is PARKED and t.flow.state is not PARKED:
                    g = g._replace(went_on=g.went_on + 1)
                parent = t.flow
            else:
                children[x - 1] = t.flow
        g = g._replace(starts=tuple(starts))
        brood = m.brood if move is None else move.brood
        for e in ("spawn", "children_ended", "undone_by_parent", "timed_out"):
            if any(ev.kind == e for _, t in writes for ev in t.events):
                self.coverage.add(e)
        return m._replace(
            parent=parent, brood=brood, kids=tuple(kids), children=tuple(children), ghost=g
        )

    def _fold(
        self,
        g: Ghost,
        x: int,
        row: Flow,
        t: Transition,
        label: str,
        kids: list[Kid],
        children: list[Flow | None],
    ) -> Ghost:
        for ev in t.events:
            if ev.kind == "step" and x == 0 and row.step_index == 1:
                for k, child in zip(kids, children, strict=True):
                    if child is not None and child.state not in TERMINAL:
                        raise _step_violation(
                            label, f"the parent ran its next step while child {k.key} is active"
                        )
            if ev.kind == "step":
                key = (x, row.step_index)
                if key in g.outcomes:
                    raise _step_violation(label, f"{self._name(x)}: step {ev.step} recorded twice")
                g = g._replace(outcomes=(*g.outcomes, key))
            elif ev.kind == "compensated":
                key = (x, row.step_index)
                if key in g.compensated:
                    raise _step_violation(label, f"{self._name(x)} compensated twice")
                if x == 0 and any(k.status == "completed" and not k.undone for k in kids):
                    raise _step_violation(
                        label, "the spawning step compensated before its completed children"
                    )
                g = g._replace(compensated=(*g.compensated, key))
            elif ev.kind == "undone_by_parent":
                if row.state is not COMPLETED:
                    raise _step_violation(
                        label,
                        f"{self._name(x)} compensated for its parent from {row.state}: it is"
                        " compensated twice",
                    )
                g = g._replace(undone=(*g.undone, x - 1))
        return g

    # ---- properties ---------------------------------------------------------------------

    def _check_state(self, m: C) -> None:
        for row in m.children:
            if row is not None:
                _invariants.check_invariants(row, None, CHILD)
        if m.brood is None or m.brood.phase != fam.UNDOING:
            _invariants.check_invariants(m.parent, None, self.shape)
        if m.brood is not None and self.check_family:
            fam.check_family(m.parent, m.brood, m.kids, m.children)
        g = m.ghost
        assert all(n <= 1 for n in g.starts), f"a child started twice: {g.starts}"
        assert g.went_on <= 1, "the parent moved on from its spawn twice"
        assert len(set(g.undone)) == len(g.undone), f"a child compensated twice: {g.undone}"

    def _check_terminal(self, m: C) -> None:
        self.coverage.add(f"end {m.parent.state.name}")
        assert m.parent.state in TERMINAL, f"the parent never ended: {m.parent.state}"
        for key, row in zip(self.config.keys, m.children, strict=True):
            assert row is None or row.state in TERMINAL, f"child {key} left {row.state}"
        g = m.ghost
        if m.brood is not None and m.brood.reason is None:
            kept = [k.key for k in m.kids if k.status == fam.KEPT]
            assert not kept, f"children {kept} never started, and nothing stopped the spawn"
        if m.parent.state is COMPLETED:
            assert not g.undone, f"a completed parent compensated its children {g.undone}"
            return
        if m.brood is None:
            return
        assert g.undone == tuple(reversed(g.ends)), (
            f"the failed parent compensated children {list(g.undone)}; those that completed,"
            f" newest first, are {list(reversed(g.ends))}"
        )
        for i in g.ends:
            row = m.children[i]
            assert row is not None and row.state is FAILED
            assert row.error is not None and "'order'" in row.error, row.error
            self.coverage.add("a child undone")
