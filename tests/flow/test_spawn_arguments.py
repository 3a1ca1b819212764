"""Every argument of `Child(...)` and `spawn(...)` is checked at the call (SPEC 5.7): a bad one is
a `TypeError`/`ValueError` there, naming what was wrong, and marked as a step's mistake (raised
in a step, it fails the flow at once, like `park()`'s). The values are pure (`_model/_children`):
a child's data is kept as its canonical text, so a change to the caller's dict after the call
changes nothing; a child's flow id splits back into its parent, step index and key.

Each check was seen to fail with its branch in `_children` taken out (a key with '/', a bool
`max_running`, a duplicate key, 10,001 children, a lone surrogate in the data all got through).
"""

from __future__ import annotations

import datetime
import itertools
from typing import Any

import pytest

from ferry.flow._model._children import (
    MAX_CHILDREN,
    Child,
    ChildResult,
    Spawn,
    child_id,
    parent_of,
    spawn,
    spawn_problem,
)
from ferry.flow._model._plan import Plan
from ferry.flow._model._types import MisusedOutcome, State

PLAN = Plan("shipment")
ANY: Any = None  # a value typed as anything, to pass what the signatures refuse


def deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


def test_a_child_keeps_its_plan_key_and_a_copy_of_its_data() -> None:
    data = {"box": 1, "items": ["a", "b"]}
    child = Child(PLAN, key="box-1", data=data)
    data["box"] = 2
    assert child.plan is PLAN and child.key == "box-1"
    assert child.data == {"box": 1, "items": ["a", "b"]}
    child.data["box"] = 3  # a fresh copy each time
    assert child.data["box"] == 1
    assert Child(PLAN, key="k").data == {}
    assert Child(PLAN, key="é-☃-" + "x" * 196).key.endswith("x")  # 200 characters, not ASCII


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"plan": "shipment", "key": "a"}, TypeError, "Child(plan) must be a flow.Plan"),
        ({"plan": None, "key": "a"}, TypeError, "Child(plan) must be a flow.Plan"),
        ({"key": 1}, TypeError, "Child(key=...) must be a str, got 1"),
        ({"key": b"a"}, TypeError, "must be a str"),
        ({"key": None}, TypeError, "must be a str"),
        ({"key": ""}, ValueError, "it is empty"),
        ({"key": "x" * 201}, ValueError, "201 characters, more than 200"),
        ({"key": "box/1"}, ValueError, "holds '/' at index 3"),
        ({"key": "box\n1"}, ValueError, "not printable"),
        ({"key": "box\x00"}, ValueError, "NUL character"),
        ({"key": "\u200bbox"}, ValueError, "not printable"),  # a zero-width space: invisible
        ({"key": "box\udc80"}, ValueError, "lone surrogate"),
        ({"key": "a", "data": [1, 2]}, TypeError, "must be a JSON object (a dict), got list"),
        ({"key": "a", "data": "text"}, TypeError, "must be a JSON object"),
        ({"key": "a", "data": {1: "x"}}, TypeError, "dict keys must be str"),
        ({"key": "a", "data": {"t": (1, 2)}}, TypeError, "sequences lists"),
        ({"key": "a", "data": {"x": float("nan")}}, TypeError, "must be JSON"),
        ({"key": "a", "data": {"x": {1, 2}}}, TypeError, "must be JSON"),
        ({"key": "a", "data": {"x": "\udc80"}}, ValueError, "lone surrogate"),
        ({"key": "a", "data": {"\udc80": 1}}, ValueError, "lone surrogate"),
        ({"key": "a", "data": deep(70)}, ValueError, "nested deeper than 64"),
    ],
)
def test_a_bad_child_argument_is_refused_at_the_call(
    kwargs: dict[str, Any], error: type[Exception], says: str
) -> None:
    plan = kwargs.pop("plan", PLAN)
    with pytest.raises(error) as raised:
        Child(plan, **kwargs)
    assert says in str(raised.value)
    assert isinstance(raised.value, MisusedOutcome)  # raised in a step: fails the flow at once
    assert type(raised.value).__name__ == error.__name__  # shown as what it is to the user


def test_a_child_data_nested_a_million_levels_is_refused_quickly() -> None:
    value: Any = []
    for _ in range(1_000_000):
        value = [value]
    with pytest.raises(ValueError, match="nested deeper"):
        Child(PLAN, key="a", data={"x": value})


def test_a_self_containing_child_data_is_refused() -> None:
    value: dict[str, Any] = {}
    value["me"] = value
    with pytest.raises(ValueError, match="contains"):
        Child(PLAN, key="a", data=value)


def children(n: int) -> list[Child]:
    return [Child(PLAN, key=f"c{i}") for i in range(n)]


def test_spawn_keeps_its_children_in_order_and_its_keywords() -> None:
    s = spawn(children(3), max_running=2, timeout=datetime.timedelta(minutes=1))
    assert [c.key for c in s.children] == ["c0", "c1", "c2"]
    assert (s.max_running, s.timeout, s.on_failure) == (2, 60.0, "compensate")
    assert isinstance(s.timeout, float)
    s = spawn(tuple(children(1)), on_failure="continue", timeout=0)
    assert (s.max_running, s.timeout, s.on_failure) == (None, 0.0, "continue")
    generated = spawn(Child(PLAN, key=f"g{i}") for i in range(MAX_CHILDREN))
    assert len(generated.children) == MAX_CHILDREN
    assert spawn(children(1), max_running=10**30).max_running == 10**30


@pytest.mark.parametrize(
    ("children", "kwargs", "error", "says"),
    [
        ([], {}, ValueError, "at least one flow.Child"),
        (iter(()), {}, ValueError, "at least one flow.Child"),
        (children(MAX_CHILDREN + 1), {}, ValueError, "more than 10000 children"),
        (itertools.repeat(Child(PLAN, key="x")), {}, ValueError, "more than 10000"),
        (Child(PLAN, key="a"), {}, TypeError, "must be a list of flow.Child"),
        ("abc", {}, TypeError, "must be a list of flow.Child, got str"),
        ({"a": Child(PLAN, key="a")}, {}, TypeError, "got dict"),
        (42, {}, TypeError, "must be a list of flow.Child, got 42"),
        ([Child(PLAN, key="a"), "b"], {}, TypeError, "spawn(children)[1] must be a flow.Child"),
        ([Child(PLAN, key="a"), None], {}, TypeError, "[1] must be a flow.Child, got None"),
        (
            [Child(PLAN, key="a"), Child(PLAN, key="b"), Child(PLAN, key="a")],
            {},
            ValueError,
            "holds the key 'a' twice, at 0 and 2",
        ),
        (children(2), {"max_running": 0}, ValueError, "must be >= 1"),
        (children(2), {"max_running": -5}, ValueError, "must be >= 1"),
        (children(2), {"max_running": True}, TypeError, "must be an int >= 1 or None, got True"),
        (children(2), {"max_running": 2.0}, TypeError, "must be an int"),
        (children(2), {"max_running": "2"}, TypeError, "must be an int"),
        (children(2), {"timeout": -1}, ValueError, "must be finite and >= 0"),
        (children(2), {"timeout": float("inf")}, ValueError, "must be finite"),
        (children(2), {"timeout": float("nan")}, ValueError, "must be finite"),
        (children(2), {"timeout": 10**400}, ValueError, "(401 characters)"),
        (children(2), {"timeout": datetime.timedelta(seconds=-1)}, ValueError, ">= 0"),
        (children(2), {"timeout": True}, TypeError, "number of seconds"),
        (children(2), {"timeout": "60"}, TypeError, "number of seconds"),
        (children(2), {"on_failure": "retry"}, ValueError, "'compensate' or 'continue'"),
        (children(2), {"on_failure": "Compensate"}, ValueError, "'compensate' or 'continue'"),
        (children(2), {"on_failure": None}, TypeError, "'compensate' or 'continue'"),
        (children(2), {"on_failure": ["compensate"]}, TypeError, "'compensate' or 'continue'"),
    ],
    ids=lambda v: repr(v)[:30] if not isinstance(v, list | tuple) else f"{len(v)}",
)
def test_a_bad_spawn_argument_is_refused_at_the_call(
    children: Any, kwargs: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error) as raised:
        spawn(children, **kwargs)
    assert says in str(raised.value)
    assert isinstance(raised.value, MisusedOutcome)


def test_spawn_needs_its_keywords_by_name() -> None:
    with pytest.raises(TypeError):
        spawn(children(1), 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Child(PLAN, "a")  # type: ignore[call-arg]


def test_a_spawn_built_by_hand_is_checked_as_an_outcome() -> None:
    good = spawn(children(2), max_running=1)
    assert spawn_problem(good) is None
    assert spawn_problem(Spawn(good.children, None, 5, "continue")) is None
    for bad, says in [
        (Spawn((), None, None, "compensate"), "at least one"),
        (Spawn(good.children, 0, None, "compensate"), "max_running"),
        (Spawn(good.children, None, -1.0, "compensate"), "timeout"),
        (Spawn(good.children, None, None, ANY), "on_failure"),
        (Spawn((good.children[0], good.children[0]), None, None, "compensate"), "twice"),
    ]:
        problem = spawn_problem(bad)
        assert problem is not None and problem.startswith("returned Spawn(")
        assert says in problem and "use flow.spawn(...)" in problem


@pytest.mark.parametrize("parent", ["order-1", "a/b/c", "x/0/y", "ö/1", "1"])
@pytest.mark.parametrize("key", ["box-0", "0", "a b", "é"])
def test_a_child_id_splits_back_into_its_parent_step_and_key(parent: str, key: str) -> None:
    assert child_id(parent, 3, key) == f"{parent}/3/{key}"
    assert parent_of(child_id(parent, 3, key)) == (parent, 3, key)
    nested = child_id(child_id(parent, 0, key), 12, key)
    assert parent_of(nested) == (child_id(parent, 0, key), 12, key)


@pytest.mark.parametrize("flow_id", ["order", "a/b", "/1/k", "a/x/k", "a/01/k", "a/1/", "a/١/k"])
def test_an_id_not_shaped_as_a_child_has_no_parent(flow_id: str) -> None:
    assert parent_of(flow_id) is None


def test_a_child_result_holds_what_the_next_step_reads() -> None:
    done = ChildResult("o/0/a", State.COMPLETED, {"tracking": "T1"}, None)
    failed = ChildResult("o/0/b", State.FAILED, {}, "card declined")
    assert done.data["tracking"] == "T1" and done.error is None
    assert failed.state is State.FAILED and failed.error == "card declined"
    with pytest.raises(AttributeError):
        done.state = State.FAILED  # type: ignore[misc]


def test_the_children_values_are_public() -> None:
    """The engine runs a spawn (docs/adr/0148): `ferry.flow` offers the names, as themselves."""
    from ferry import flow

    assert (flow.Child, flow.spawn, flow.Spawn, flow.ChildResult) == (
        Child,
        spawn,
        Spawn,
        ChildResult,
    )
    assert flow.Child.__module__ == "ferry.flow"
