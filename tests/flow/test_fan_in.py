"""The fan-in's cost and what it hands the next step (SPEC 5.7, docs/adr/0173): the last child's
end moves its parent on without reading the other children back, the next step's
``ctx.children`` comes from the ends this engine kept as they committed, and it is the same
mapping (types, spawn order, equality, repr, a failed child's entry) as the one read back from
the store after a reopen, on SQLite and PostgreSQL. `_gathered.Gathered`'s own rules (what it
forgets, when it answers None) are checked on it directly.

Seen to fail: with `_kin._ended` reading the kid rows for every last end again (407 rows read
for 200 children against 15 for 4), with `Gathered.take` never answering (209 against 13), and
with the kept ends in the order they came (the kept mapping differs from the one read back).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from ferry import flow
from ferry.flow._model._children import ChildResult
from ferry.flow._model._values import COMPLETED, FAILED, PARKED, RUNNING, Flow
from ferry.flow._runtime._gathered import Gathered
from ferry.projected import SqliteStore, Tx

Seen = list[tuple[type, list[tuple[str, ChildResult]], str]]


def plans(seen: Seen, gate: list[trio.Event]) -> tuple[flow.Plan, flow.Plan]:
    """``fan-parent`` (fan: a spawn of ``n`` ``fan-kid`` children with ``continue``; after:
    notes ``ctx.children``) and ``fan-kid`` (waits for ``gate[0]`` if its data says so, fails
    if its index is odd, else completes with ``out`` added to its data). ``gate[1]`` is set
    once the body of every child but the waiting one has run."""
    kid = flow.Plan("fan-kid")
    gate.append(trio.Event())
    ran = [0]

    @kid.step
    async def work(ctx: flow.Context) -> flow.Outcome | None:
        if ctx.data.get("wait"):
            await gate[0].wait()
        else:
            ran[0] += 1
            if ran[0] == ctx.data["of"] - 1:
                gate[1].set()
        if ctx.data["n"] % 2:
            return flow.fail(f"odd {ctx.data['n']}")
        ctx.data["out"] = ctx.data["n"] * 10
        return None

    parent = flow.Plan("fan-parent")

    @parent.step
    async def fan(ctx: flow.Context) -> flow.Outcome:
        n = ctx.data["n"]
        children = [
            flow.Child(kid, key=f"c{i}", data={"n": i, "of": n, "wait": i == 0}) for i in range(n)
        ]
        return flow.spawn(children, on_failure="continue")

    @parent.step
    async def after(ctx: flow.Context) -> None:
        children = ctx.children
        seen.append((type(children), list(children.items()), repr(children)))

    return parent, kid


async def others_ended(engine: flow.Engine, gate: list[trio.Event], n: int, pid: str = "p") -> None:
    """Every child of `pid` but the first (which waits for the gate) has ended."""
    await gate[1].wait()
    for i in range(1, n):
        snap = await engine.wait(f"{pid}/0/c{i}")
        assert snap.state in (flow.State.COMPLETED, flow.State.FAILED)


def expected(n: int) -> list[tuple[str, ChildResult]]:
    out = []
    for i in range(n):
        data: dict[str, Any] = {"n": i, "of": n, "wait": i == 0}
        if i % 2:
            out.append((f"c{i}", ChildResult(f"p/0/c{i}", FAILED, data, f"odd {i}")))
        else:
            out.append(
                (f"c{i}", ChildResult(f"p/0/c{i}", COMPLETED, {**data, "out": i * 10}, None))
            )
    return out


async def test_the_kept_children_are_the_ones_read_back_after_a_reopen(where: Any) -> None:
    """The first child ends last (its end is the last of the spawn, its key the first): the
    mapping kept as the ends came, and the one read back from the store by an engine that
    opened after the others ended, are equal to each other and to what the children wrote, in
    spawn order, with the same type and repr."""
    n = 6
    kept: Seen = []
    gate = [trio.Event()]
    parent, kid = plans(kept, gate)
    async with flow.open_engine(where, plans=[parent, kid]) as engine:
        await engine.start(parent, flow_id="p", data={"n": n})
        await others_ended(engine, gate, n)
        gate[0].set()
        assert (await engine.wait("p")).state is flow.State.COMPLETED
        history = await engine.history("p")
    summary = [e.detail for e in history if e.kind == "children_ended"]
    assert summary == [{"ended": n, "failed": n // 2}]  # the failures counted on the index

    read: Seen = []
    gate = [trio.Event()]
    parent, kid = plans(read, gate)
    async with flow.open_engine(where, plans=[parent, kid]) as engine:
        await engine.start(parent, flow_id="q", data={"n": n})
        await others_ended(engine, gate, n, "q")
    gate[0].set()  # the first child runs again after the reopen, and ends there
    async with flow.open_engine(where, plans=[parent, kid]) as engine:
        assert (await engine.wait("q")).state is flow.State.COMPLETED

    assert len(kept) == len(read) == 1
    assert kept[0][0] is dict and read[0][0] is dict
    assert kept[0][1] == expected(n)
    as_q = [(k, attrs.evolve(r, flow_id=r.flow_id.replace("q/", "p/", 1))) for k, r in read[0][1]]
    assert as_q == kept[0][1]
    assert read[0][2].replace("'q/", "'p/") == kept[0][2]


class _Counting:
    """A `Tx` that counts the rows its statements return (into `box`)."""

    def __init__(self, tx: Tx, box: list[int]) -> None:
        self._tx = tx
        self._box = box

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        rows = self._tx.execute(sql, params)
        self._box[0] += len(rows)
        return rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tx, name)


async def rows_of_a_fan_in(path: str, n: int) -> int:
    """Rows the store's statements return from the last child's release to the parent's
    next step's end, for a spawn of `n` children."""
    box = [0]
    counting = [False]
    store = SqliteStore(path)
    transact = store.transact

    async def wrapped(fn: Callable[[Tx], Any], **kw: Any) -> Any:
        if not counting[0]:
            return await transact(fn, **kw)
        return await transact(lambda tx: fn(_Counting(tx, box)), **kw)

    setattr(store, "transact", wrapped)  # noqa: B010 - an instance's method, replaced
    seen: Seen = []
    gate = [trio.Event()]
    parent, kid = plans(seen, gate)
    try:
        async with flow.open_engine(store, plans=[parent, kid]) as engine:
            await engine.start(parent, flow_id="p", data={"n": n})
            await others_ended(engine, gate, n)
            counting[0] = True
            gate[0].set()
            assert (await engine.wait("p")).state is flow.State.COMPLETED
            counting[0] = False
    finally:
        await store.aclose()
    assert len(seen[0][1]) == n
    return box[0]


async def test_the_last_end_and_the_next_step_read_as_many_rows_for_200_children_as_for_4(
    tmp_path: Path,
) -> None:
    few = await rows_of_a_fan_in(str(tmp_path / "few.db"), 4)
    many = await rows_of_a_fan_in(str(tmp_path / "many.db"), 200)
    assert many - few < 20, (few, many)  # a read of the kid rows would be 200 more, each


# ------------------------------------------------------------------------------ `Gathered`


def row(flow_id: str, state: flow.State, **kw: Any) -> Flow:
    base: dict[str, Any] = dict(
        plan="x", version=1, step_index=0, step="s", attempt=1, data="{}", revision=2
    )
    base.update(updated_at=1.0, created_at=1.0)
    return Flow(flow_id, state=state, **{**base, **kw})


def ended(key: str, ok: bool = True, parent: str = "p") -> Flow:
    data = json.dumps({"key": key})
    if ok:
        return row(f"{parent}/0/{key}", COMPLETED, parent=parent, data=data, created_at=5.0)
    return row(f"{parent}/0/{key}", FAILED, parent=parent, data=data, error="e", created_at=5.0)


def gathered(keys: Sequence[str] = ("a", "b"), budget: int = 1 << 20) -> Gathered:
    g = Gathered(budget)
    g.spawned("p", 0, 1.0, tuple(keys))
    return g


RAN = row("p", RUNNING, fan_in=0, step_index=1)


def test_kept_ends_are_handed_over_in_spawn_order_once() -> None:
    g = gathered()
    g.seen(ended("b", ok=False))
    g.seen(row("p", PARKED, revision=3))  # a queued wake: still waiting at the spawn
    g.seen(ended("a"))
    got = g.take(RAN)
    assert got is not None and list(got) == ["a", "b"]
    assert got["a"] == ChildResult("p/0/a", COMPLETED, {"key": "a"}, None)
    assert got["b"] == ChildResult("p/0/b", FAILED, {"key": "b"}, "e")
    assert g.take(RAN) is None and not g.parents  # a retry of the step reads the store


def test_a_spawn_with_an_end_missing_is_read_back() -> None:
    g = gathered()
    g.seen(ended("a"))
    assert g.take(RAN) is None and not g.parents


@pytest.mark.parametrize(
    "what",
    ["second end", "parent compensates", "other flow", "other step", "foreign key", "budget"],
)
def test_a_spawn_it_cannot_vouch_for_is_forgotten(what: str) -> None:
    g = gathered(budget=40)
    g.seen(ended("a"))
    if what == "second end":  # the parent's compensation undid a completed child
        g.seen(ended("a", ok=False))
    elif what == "parent compensates":
        g.seen(row("p", flow.State.COMPENSATING))
    elif what == "foreign key":
        g.seen(ended("z"))
    elif what == "budget":
        g.seen(attrs.evolve(ended("b"), data=json.dumps({"pad": "x" * 50})))
    g.seen(ended("b"))
    if what == "other flow":  # the same id started again after a purge
        assert g.take(attrs.evolve(RAN, created_at=2.0)) is None
    elif what == "other step":
        assert g.take(attrs.evolve(RAN, fan_in=3)) is None
    else:
        assert g.take(RAN) is None
    assert not g.parents


def test_a_spawn_over_the_budget_is_not_kept_and_a_new_one_makes_room() -> None:
    g = gathered(keys=("a" * 30, "b" * 30), budget=40)
    assert not g.parents
    g.seen(ended("a" * 30))
    assert g.take(RAN) is None
    g.spawned("p", 0, 1.0, ("a" * 15,))
    g.spawned("q", 0, 1.0, ("b" * 15,))
    g.spawned("r", 0, 1.0, ("c" * 15,))  # over 40 with the others: the oldest, p, goes
    assert list(g.parents) == ["q", "r"]
