"""The transitions a write asks for, as records: which transition of `_machine` and its arguments.

A `_store.Change` carries one of these (its `apply`) and, beside it, a `HolderRule`; the store
runs it on the flow's row inside the transaction that records it, on the store's thread, by one
function (`_store._apply.run`). A record is plain data: frozen, with slots, equal by
value and with a `repr` that names the transition and its arguments, e.g.
``Wake(message=Message(message_id='m-1', payload='{}'), now=12.5)``; the plan versions and shapes it
reads are left out of the `repr`.

An outside request (`Wake`, `Cancel`, `Resume`, `Abandon`, `TimeOut`) is computed with the shape
of the flow's plan version, known only inside the transaction: it carries the versions it may use
(`Known`). In a fleet an engine may not have seen a version yet (a rolling deploy): the transition
is then not run and the op is answered `Unseen`, a result like any other, and the request runs
again on a fresh read of the fleet's versions (`_runtime._requests.Requests.versioned`).

To *hold* a flow means one thing here and everywhere in the engine: to be the engine named on the
flow's row (its ``owner``, with no ``released_at``) as the one that runs it. `HolderRule` is the
rule that says who holds the flow after a write (`_holders.assign_holder`).

PURE: attrs and the model only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

import attrs

from ._types import Json, Outcome
from ._values import Message, Shape

Shapes: TypeAlias = Mapping[tuple[str, int], Shape]
_NO_SHAPES: Shapes = {}


@attrs.frozen
class HolderRule:
    """Who holds the flow after a write (`_holders.assign_holder`): `writer` (the engine that
    writes; None: an operator's engine, which holds nothing) if the write leaves the flow active,
    except a flow of a version in `elsewhere` (a fleet's versions this engine lacks and another
    live engine has), which is left to nobody; with `keep_runner` (an outside request in a
    fleet), a flow another engine holds stays with that engine."""

    writer: str | None
    keep_runner: bool = False
    elsewhere: Shapes = attrs.field(default=_NO_SHAPES, repr=False)


@attrs.frozen
class Known:
    """The plan versions an outside request may compute its transition with. `complete`: a
    version not in `shapes` is missing (the machine blocks the flow: versions fail closed); not
    `complete` (a fleet's serving engine): it is not seen yet, and the op is answered `Unseen`."""

    shapes: Shapes = attrs.field(repr=False)
    complete: bool = True


@attrs.frozen
class Unseen:
    """The op's transition was not run: the flow's plan version is not one the request knew of
    (`Known.complete` false). Nothing was written; the request may run again on a fresh read."""

    flow_id: str
    plan: str
    version: int


# ------------------------------------------------------------------------- outside requests


@attrs.frozen
class Request:
    """A transition an outside request asks for, computed with the shape of the flow's plan
    version from `known`."""

    known: Known = attrs.field(repr=False, kw_only=True)


@attrs.frozen
class Wake(Request):
    """`_machine.wake`: `message` for the flow's mailbox."""

    message: Message
    now: float


@attrs.frozen
class Cancel(Request):
    """`_machine.cancel`."""

    reason: str
    now: float


@attrs.frozen
class Resume(Request):
    """`_machine.resume` (reads the first queued message)."""

    now: float


@attrs.frozen
class Abandon(Request):
    """`_machine.abandon`."""

    reason: str
    by: str | None
    now: float


@attrs.frozen
class TimeOut(Request):
    """`_machine.timeout` of the park at `revision` (a flow moved on since is left as it is)."""

    revision: int
    now: float


# ------------------------------------------------------------------ the engine's own writes


@attrs.frozen
class Block:
    """`_machine.block`."""

    reason: str
    now: float


@attrs.frozen
class Rerun:
    """`_holders.rerun`: run again after a crash or close."""

    now: float


@attrs.frozen
class LetGo:
    """`_holders.let_go`: a run that had not begun, let go at close."""

    now: float


@attrs.frozen
class TakeOver:
    """`_holders.take_over`: `owner` takes an orphan over."""

    owner: str
    now: float


@attrs.frozen
class NextAttempt:
    """`_machine.next_attempt`, after an attempt that raised `failure`."""

    now: float
    failure: Json = None


@attrs.frozen
class StepDone:
    """`_machine.step_done`: the step returned `outcome` (None: continue), data now `data`."""

    shape: Shape = attrs.field(repr=False)
    outcome: Outcome | None
    data: str
    now: float


@attrs.frozen
class StepFailed:
    """`_machine.step_failed`."""

    shape: Shape | None = attrs.field(repr=False)
    problem: str
    now: float
    traceback: str | None = attrs.field(default=None, repr=False)


@attrs.frozen
class Compensated:
    """`_machine.compensated`: the compensation returned, data now `data`."""

    shape: Shape = attrs.field(repr=False)
    data: str
    now: float


@attrs.frozen
class CompensationFailed:
    """`_machine.compensation_failed`."""

    problem: str
    now: float
    shape: Shape | None = attrs.field(default=None, repr=False)
    traceback: str | None = attrs.field(default=None, repr=False)


Move: TypeAlias = (
    Wake
    | Cancel
    | Resume
    | Abandon
    | TimeOut
    | Block
    | Rerun
    | LetGo
    | TakeOver
    | NextAttempt
    | StepDone
    | StepFailed
    | Compensated
    | CompensationFailed
)
