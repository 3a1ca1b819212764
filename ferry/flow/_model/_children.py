"""Child flows, the values a step deals in: `Child`, `spawn(...) -> Spawn`, `ChildResult`.

PURE, like the rest of `_model`: frozen records and the checks of SPEC 5.7 at the call (a bad
argument is `TypeError`/`ValueError` at `Child(...)` or `spawn(...)`, naming what was wrong).
Raised in a step, such an error fails the flow at once, as `park()`'s and `fail()`'s do (the
same code would make the same mistake on every attempt: `MisusedOutcome`).

Public as ``flow.Child``, ``flow.spawn``, ``flow.Spawn`` and ``flow.ChildResult`` (the engine
runs a spawn: docs/adr/0148).

- `Child(plan, *, key, data=None)`: `plan` a `Plan`; `key` a printable str of 1 to
  `MAX_KEY_CHARS` characters without ``/`` (it ends the child's flow id, `child_id`); `data` a
  JSON object (a dict) or None (an empty object). The data is checked (storable JSON, `_checks`)
  and kept as its canonical text, so that a change to the caller's dict after the call changes
  nothing. Its size is checked against the engine's ``max_data_bytes`` when the outcome is
  recorded (the engine's limit is not known here).
- `spawn(children, *, max_running=None, timeout=None, on_failure="compensate")`: 1 to
  `MAX_CHILDREN` `Child` values with unique keys (a list, a tuple or any other iterable, read
  at most one past the limit); `max_running` an int >= 1 or None (no limit); `timeout` as
  `park()`'s (seconds, finite and >= 0, or a `datetime.timedelta`, or None);
  `on_failure` ``"compensate"`` or ``"continue"``.
- `ChildResult(flow_id, state, data, error)`: what the next step reads of one child in
  ``ctx.children``: its data when it ended (a dict, also for a `FAILED` child), and `error` None
  for a `COMPLETED` one.

`spawn_problem` re-checks a `Spawn` built by hand (``Spawn(...)``, not `spawn()`), as
`_checks.outcome` does for `Park` and `Fail`: the runner fails such a flow like a malformed
outcome.
"""

from __future__ import annotations

import datetime
import itertools
import json
from collections.abc import Iterable, Mapping
from typing import Final, Literal, TypeAlias, final

import attrs

from ._checks import describe, finite, json_object_text, shown_number, text_problem
from ._plan import Plan
from ._types import Fail, Json, MisusedOutcome, Park, State, _Complete, _Continue

__all__ = [
    "MAX_CHILDREN",
    "MAX_KEY_CHARS",
    "Child",
    "ChildResult",
    "OnFailure",
    "Outcome",
    "Spawn",
    "child_id",
    "key_problem",
    "parent_of",
    "spawn",
    "spawn_problem",
]

MAX_CHILDREN: Final = 10_000  # children of one spawn
MAX_KEY_CHARS: Final = 200  # characters of a child's key

OnFailure: TypeAlias = Literal["compensate", "continue"]


class _OutcomeTypeError(MisusedOutcome, TypeError):
    pass


class _OutcomeValueError(MisusedOutcome, ValueError):
    pass


# Shown as what they are to the user (in a flow's error, a traceback): a TypeError, a ValueError.
# (The same pair as park()'s and fail()'s; kept here while those move between modules.)
for _cls, _shown in ((_OutcomeTypeError, TypeError), (_OutcomeValueError, ValueError)):
    _cls.__name__ = _cls.__qualname__ = _shown.__name__
    _cls.__module__ = "builtins"


def key_problem(key: str) -> str | None:
    """Why the str `key` cannot be a child's key, or None if it can."""
    if not key:
        return "it is empty"
    if len(key) > MAX_KEY_CHARS:
        return f"it has {len(key)} characters, more than {MAX_KEY_CHARS}"
    problem = text_problem(key)
    if problem is not None:
        return problem
    if "/" in key:
        return (
            f"it holds '/' at index {key.index('/')}: the key ends the child's flow id"
            " (parent/step_index/key), which must split back into its parts"
        )
    if not key.isprintable():
        bad = next(c for c in key if not c.isprintable())
        return f"it holds {bad!r} at index {key.index(bad)}, which is not printable"
    return None


#: Why a plan whose limits have a key function cannot be a child's (docs/adr/0168).
KEYED_CHILD = (
    "Child(plan) cannot be plan {plan!r}: its limits have a key function (Limits(key=...)),"
    " and a child started later by a sibling's end (max_running) is started in the store, where"
    " no key function runs; give the child plan limits without key= (concurrency=, rate=)"
)


def child_id(parent: str, step_index: int, key: str) -> str:
    """The flow id of the child `key` of the spawn at `step_index` of flow `parent`."""
    return f"{parent}/{step_index}/{key}"


def parent_of(flow_id: str) -> tuple[str, int, str] | None:
    """``(parent, step_index, key)`` of a child's flow id (`child_id`'s inverse), or None if
    `flow_id` is not shaped like one. The key holds no ``/`` and the index is digits, so the id
    splits from the right whatever the parent's id holds. A top-level flow may have an id of
    this shape too: the store's parent column, not the id, says whether a flow is a child."""
    parts = flow_id.rsplit("/", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[1].isascii():
        return None
    if parts[1] != str(int(parts[1])) or key_problem(parts[2]) is not None:
        return None
    return parts[0], int(parts[1]), parts[2]


@final
@attrs.frozen(init=False)
class Child:
    """One child of a spawn: a flow of `plan` with `data`, named `key` within the spawn.

    ``Child(plan, *, key, data=None)``; every argument is checked here (see the module doc).
    `data` reads back a fresh copy of the data given; `text` is its canonical JSON text.
    """

    plan: Plan
    key: str
    text: str

    def __init__(self, plan: Plan, *, key: str, data: Json = None) -> None:
        if not isinstance(plan, Plan):
            raise _OutcomeTypeError(f"Child(plan) must be a flow.Plan, got {describe(plan, 200)}")
        if plan.limits is not None and plan.limits.key is not None:
            raise _OutcomeValueError(KEYED_CHILD.format(plan=plan.name))
        if not isinstance(key, str):
            raise _OutcomeTypeError(f"Child(key=...) must be a str, got {describe(key, 200)}")
        problem = key_problem(key)
        if problem is not None:
            raise _OutcomeValueError(
                f"Child(key={describe(key, 60)}) cannot be a child's key: {problem}"
            )
        if data is None:
            text = "{}"
        else:
            try:
                text = json_object_text(data, f"Child(key={key!r}, data=...)")
            except TypeError as exc:
                raise _OutcomeTypeError(str(exc)) from None
            except ValueError as exc:
                raise _OutcomeValueError(str(exc)) from None
        self.__attrs_init__(plan, key, text)

    @property
    def data(self) -> dict[str, Json]:
        """A fresh copy of the child's data."""
        value: dict[str, Json] = json.loads(self.text)
        return value


@final
@attrs.frozen
class Spawn:
    """A step's outcome: start `children` and wait for them; made by `spawn()`."""

    children: tuple[Child, ...]
    max_running: int | None
    timeout: float | None
    on_failure: OnFailure


#: What a step returns (None means `CONTINUE`): the public ``flow.Outcome``.
Outcome: TypeAlias = _Continue | _Complete | Park | Fail | Spawn


def _children(children: object) -> tuple[Child, ...]:
    if isinstance(children, str | bytes | bytearray | Mapping | Child):
        raise _OutcomeTypeError(
            "spawn(children) must be a list of flow.Child, got"
            f" {type(children).__name__} {describe(children, 100)}"
        )
    if not isinstance(children, Iterable):
        raise _OutcomeTypeError(
            f"spawn(children) must be a list of flow.Child, got {describe(children, 200)}"
        )
    given = tuple(itertools.islice(children, MAX_CHILDREN + 1))
    if not given:
        raise _OutcomeValueError("spawn(children) must hold at least one flow.Child, got none")
    if len(given) > MAX_CHILDREN:
        raise _OutcomeValueError(
            f"spawn(children) holds more than {MAX_CHILDREN} children: split the work into"
            " spawns of at most that many (a child may spawn children of its own)"
        )
    seen: dict[str, int] = {}
    for i, child in enumerate(given):
        if not isinstance(child, Child):
            raise _OutcomeTypeError(
                f"spawn(children)[{i}] must be a flow.Child, got {describe(child, 200)}"
            )
        first = seen.setdefault(child.key, i)
        if first != i:
            raise _OutcomeValueError(
                f"spawn(children) holds the key {child.key!r} twice, at {first} and {i}: a key"
                " names one child of the spawn (its flow id ends with it)"
            )
    return given


def _max_running(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _OutcomeTypeError(
            f"spawn(max_running=...) must be an int >= 1 or None, got {describe(value, 60)}"
        )
    if value < 1:
        raise _OutcomeValueError(
            f"spawn(max_running=...) must be >= 1 (or None: no limit), got {shown_number(value)}"
        )
    return value


def _timeout(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise _OutcomeTypeError(
            "spawn(timeout=...) must be a number of seconds, a datetime.timedelta or None, got"
            f" {describe(value, 60)}"
        )
    assert isinstance(value, int | float)
    if not (finite(value) and value >= 0):
        raise _OutcomeValueError(
            f"spawn(timeout=...) must be finite and >= 0, got {shown_number(value)}"
        )
    return float(value)


def _on_failure(value: object) -> OnFailure:
    if not isinstance(value, str):
        raise _OutcomeTypeError(
            f"spawn(on_failure=...) must be 'compensate' or 'continue', got {describe(value, 60)}"
        )
    if value == "compensate":
        return "compensate"
    if value == "continue":
        return "continue"
    raise _OutcomeValueError(
        f"spawn(on_failure=...) must be 'compensate' or 'continue', got {describe(value, 60)}"
    )


def spawn(
    children: Iterable[Child],
    *,
    max_running: int | None = None,
    timeout: float | datetime.timedelta | None = None,
    on_failure: OnFailure = "compensate",
) -> Spawn:
    """Start `children` and park until every one has ended (SPEC 5.7); a step's outcome.

    At most `max_running` of them are active at once (the rest are kept, in order, and each
    starts when an earlier one ends). After `timeout` seconds the active ones are cancelled and
    no kept one starts. With ``on_failure="compensate"`` the first child that fails makes the
    parent cancel the others and compensate; with ``"continue"`` the next step runs once all
    have ended and reads the failures in ``ctx.children``. Every argument is checked here
    (`TypeError`/`ValueError`; raised in a step, it fails the flow at once).
    """
    return Spawn(
        _children(children), _max_running(max_running), _timeout(timeout), _on_failure(on_failure)
    )


def spawn_problem(s: Spawn) -> str | None:
    """What is wrong with a `Spawn` built by hand, as a step's outcome (``returned ...``), or
    None if `spawn()` would have made it."""
    try:
        spawn(s.children, max_running=s.max_running, timeout=s.timeout, on_failure=s.on_failure)
    except (TypeError, ValueError) as exc:
        return f"returned {describe(s, 200)}: {exc} (use flow.spawn(...), which checks it)"
    return None


@final
@attrs.frozen
class ChildResult:
    """One child as its parent's next step sees it (``ctx.children[key]``).

    `flow_id` the child's id (`child_id`); `state` `COMPLETED` or `FAILED`; `data` the child's
    data when it ended (a dict, also for a failed child; for a kept child that never started,
    the data it was given); `error` why it failed, None for a completed one.
    """

    flow_id: str
    state: State
    data: dict[str, Json]
    error: str | None
