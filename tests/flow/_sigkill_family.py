"""The SIGKILL test's parents and children (issue 28, docs/adr/0162): the plans, what each
parent's scenario expects of its children, and the oracle's family half.

A parent (plan ``batch``): ``prepare`` (compensated by ``unprepare``), ``fan`` (spawns
``CHILDREN`` children of plan ``item``, with the scenario's ``max_running`` and ``on_failure``),
``collect`` (reads ``ctx.children``; fails for the ``rejected`` scenario). A child (``item``):
``pick`` (compensated by ``unpick``), ``pack`` (returns ``fail()`` for the scenario's bad child).
Every body and compensation makes the side table's "external call", as the plain flows' do.

The family oracle (`audit_family`, pure), on top of the per-flow one (which every child's
history and keys go through too):
- each child that should start has one row and one ``started`` event, and a kept child that
  should never start has no row;
- each child ends as its parent's scenario says;
- each parent records ``children_ended`` once (its spawn ended once), and its next step
  (``collect``) made its first call after the first call of every child's every step (the
  parent resumed after its last child ended, by the side table's order of calls);
- a failed parent compensated (``undone_by_parent``, once) every child that completed, and
  with ``max_running=1`` in the reverse order of their completion; a completed parent undid none.
"""

from __future__ import annotations

import random
import sqlite3
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs

from ferry import flow

Call = Callable[[flow.Context], Awaitable[None]]

CHILDREN = 3
PARENT_STEPS = ("prepare", "fan", "collect")
CHILD_STEPS = ("pick", "pack")

#: parent scenario -> (weight, expected end state of the parent)
FAMILIES: dict[str, tuple[int, flow.State]] = {
    "fanout": (4, flow.State.COMPLETED),  # every child completes; collect runs
    "stop": (2, flow.State.FAILED),  # one at a time; one child fails: no later one starts
    "stopwide": (2, flow.State.FAILED),  # all at once; one child fails: the others undone
    "carryon": (2, flow.State.COMPLETED),  # on_failure="continue": collect sees the failure
    "rejected": (2, flow.State.FAILED),  # every child completes; collect fails: all undone
}


@attrs.frozen
class KidSpec:
    """One child of a parent's scenario: its flow id and how it must end (None: never starts)."""

    flow_id: str
    expected: flow.State | None


def family_data(kind: str, rng: random.Random) -> dict[str, Any]:
    """The data of a parent of scenario `kind` (its children's shape)."""
    bad = rng.randrange(CHILDREN) if kind in ("stop", "stopwide", "carryon") else -1
    max_running: int | None
    if kind == "stop":
        max_running = 1
    elif kind == "stopwide":
        max_running = None
    else:
        max_running = rng.choice([1, 2, None])
    return {
        "kind": kind,
        "pause": round(rng.uniform(0.0, 0.08), 3),
        "bad": bad,
        "max": max_running,
        "on_failure": "continue" if kind == "carryon" else "compensate",
    }


def kid_specs(flow_id: str, data: Mapping[str, Any]) -> tuple[KidSpec, ...]:
    """The children of parent `flow_id` and how each must end."""
    kind, bad = data["kind"], data["bad"]
    out = []
    for i in range(CHILDREN):
        fid = f"{flow_id}/1/c{i}"
        expected: flow.State | None
        if kind in ("fanout", "carryon"):
            expected = flow.State.FAILED if i == bad else flow.State.COMPLETED
        elif kind == "stop" and i > bad:
            expected = None  # kept behind the failed one: never started
        else:  # failed, cancelled, or completed and undone by the parent
            expected = flow.State.FAILED
        out.append(KidSpec(fid, expected))
    return tuple(out)


def make_family(call: Call) -> tuple[flow.Plan, flow.Plan]:
    """The parent plan ``batch`` and the child plan ``item``; `call` is the external call."""
    item = flow.Plan("item")

    async def unpick(ctx: flow.Context) -> None:
        await call(ctx)

    @item.step(compensate=unpick)
    async def pick(ctx: flow.Context) -> None:
        await call(ctx)

    @item.step
    async def pack(ctx: flow.Context) -> flow.Outcome | None:
        if ctx.data["bad"]:
            return flow.fail("no room in the box")
        await call(ctx)
        return None

    batch = flow.Plan("batch")

    async def unprepare(ctx: flow.Context) -> None:
        await call(ctx)

    @batch.step(compensate=unprepare)
    async def prepare(ctx: flow.Context) -> None:
        await call(ctx)

    @batch.step
    async def fan(ctx: flow.Context) -> flow.Outcome:
        pause = ctx.data["pause"]
        return flow.spawn(
            [
                flow.Child(item, key=f"c{i}", data={"pause": pause, "bad": i == ctx.data["bad"]})
                for i in range(CHILDREN)
            ],
            max_running=ctx.data["max"],
            on_failure=ctx.data["on_failure"],
        )

    @batch.step
    async def collect(ctx: flow.Context) -> flow.Outcome | None:
        await call(ctx)
        assert list(ctx.children) == [f"c{i}" for i in range(CHILDREN)]
        if ctx.data["kind"] == "rejected":
            return flow.fail("the batch is refused")
        return None

    assert tuple(s.name for s in batch.steps) == PARENT_STEPS
    assert tuple(s.name for s in item.steps) == CHILD_STEPS
    return batch, item


def step_index(flow_id: str, step: str) -> int:
    """The index of `step` in the plan of flow `flow_id` (a child's id has a ``/``)."""
    if "/" in flow_id:
        return CHILD_STEPS.index(step)
    return PARENT_STEPS.index(step) if step in PARENT_STEPS else -1


def read_order(side: sqlite3.Connection) -> dict[str, list[int]]:
    """Key -> the side table's row ids of its calls, in order (the order calls were made)."""
    order: dict[str, list[int]] = {}
    for rowid, key in side.execute("SELECT rowid, key FROM runs ORDER BY rowid"):
        order.setdefault(key, []).append(rowid)
    return order


def audit_family(
    parent: str,
    kind: str,
    max_running: int | None,
    kids: Sequence[KidSpec],
    states: Mapping[str, flow.State | None],
    history: Mapping[str, Sequence[flow.Event]],
    order: Mapping[str, Sequence[int]],
) -> list[str]:
    """The family oracle (module doc) for one parent; one line per violation."""
    problems = []
    ended = [e for e in history.get(parent, ()) if e.kind == "children_ended"]
    if len(ended) != 1:
        problems.append(f"{parent} ({kind}): its spawn ended {len(ended)} times, not once")
    undone: list[str] = []
    for k in kids:
        state = states.get(k.flow_id)
        events = history.get(k.flow_id, ())
        starts = sum(e.kind == "started" for e in events)
        if k.expected is None:
            if state is not None or starts:
                problems.append(f"{k.flow_id}: a kept child started ({state}, {starts} starts)")
            continue
        if starts != 1:
            problems.append(f"{k.flow_id}: started {starts} times, not once")
        if state is not k.expected:
            problems.append(f"{k.flow_id} ({kind}) ended {state}, expected {k.expected}")
        n = sum(e.kind == "undone_by_parent" for e in events)
        completed = any(
            e.kind == "step" and e.step == "pack" and e.detail["outcome"] != "fail" for e in events
        )
        if n > 1:
            problems.append(f"{k.flow_id}: compensated for its parent {n} times")
        wanted = int(completed and FAMILIES[kind][1] is flow.State.FAILED)
        if n != wanted:
            problems.append(f"{k.flow_id}: undone by its parent {n} times, expected {wanted}")
        if n:
            undone.append(k.flow_id)
    # A step's outcome is written after its first effective call: a child's forward calls that
    # came first all came before it ended (a later one is a body a takeover left running).
    resumed = order.get(f"{parent}/2/collect", ())
    firsts = [
        min(calls)
        for k in kids
        for s, name in enumerate(CHILD_STEPS)
        if (calls := order.get(f"{k.flow_id}/{s}/{name}"))
    ]
    if resumed and firsts and min(resumed) < max(firsts):
        problems.append(f"{parent} ({kind}): collect ran before its last child ended")
    if max_running == 1 and undone:
        firsts = [order.get(f"{fid}/0-compensate/pick", [0])[0] for fid in undone]
        if firsts != sorted(firsts, reverse=True):
            problems.append(f"{parent}: children undone in the order {undone}, not newest first")
    return problems


def family_summary(hits: Counter[str]) -> str:
    caught = sum(n for key, n in hits.items() if key.count("/") > 2)
    return f"{caught} children's steps caught in flight"
