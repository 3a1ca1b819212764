"""Recovery: what an engine does with the store's flows when it opens, and what it leaves when it
closes.

At open a serving engine records its plans, then on one SQLite file resumes every running or
compensating flow and arms every parked flow's timer; in a fleet it resumes the flows its owner
name held (a restart under the same name) and takes over the orphans (its first scan). A flow is
resumed as attempt + 1 if a run of it may have begun (docs/adr/0024). A flow whose row the
database refuses meanwhile is that flow's own problem (`rerun`, docs/adr/0104): the engine opens
and runs the others. At close it lets go of the flows whose current run had not begun, so that the
next engine keeps their attempt number.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

from ferry.projected import Store

from .._model import _checks, _ops, _values
from .._model._types import State
from .._model._values import ACTIVE, Flow
from .._store import _batch, _kin, _op, _store
from . import _queues, _retry, _whole
from ._apart import write_apart
from ._clock import Clock
from ._live import Tally, about, named
from ._mode import Mode
from ._versions import Versions
from ._writes import Writes, gather

_log = logging.getLogger("ferry.flow")


async def recover(
    store: Store,
    clock: Clock,
    versions: Versions,
    writes: Writes,
    tally: Tally,
    mode: Mode,
    *,
    serve: bool,
) -> None:
    """At open: record this engine's plans; then take what the mode gives it to run again
    (`Mode.claim`: on one SQLite file every running or compensating flow, every parked flow's
    timer armed; in a fleet the flows this owner name held) and run them again, then the mode's
    first round (a fleet's first scan takes over the orphans)."""
    shapes = versions.shapes
    await _queues.check_and_register(store, versions)
    if shapes:
        registered = list(shapes.values())
        await store.transact(partial(_store.register_plans, shapes=registered, now=clock.now()))
    if not serve:
        return
    counts = await store.transact(_store.count_states)
    tally.parked = counts.get(State.PARKED, 0)
    tally.blocked = counts.get(State.BLOCKED, 0)
    tally.queued = counts.get(State.QUEUED, 0)
    active = await mode.claim(sorted(shapes))
    tally.stats["recovered"] = await rerun(writes, clock, versions, active)
    await _queues.at_open(writes, clock, versions)
    for fid, deadline in await store.transact(_kin.whole_deadlines):  # `start(deadline=...)`
        _whole.arm(writes, fid, deadline)
    await mode.first_round()


async def rerun(writes: Writes, clock: Clock, versions: Versions, active: list[Flow]) -> int:
    """Run `active` flows again in this engine (at open, or adopted in a fleet), each by a
    compare-and-set on the row read: as attempt + 1 if a run may have begun, else as the same
    attempt (`_holders.rerun`); or block those whose plan version this engine lacks. How many
    run again.

    A row the database refuses (a trigger, a constraint: docs/adr/0063) is that flow's own
    problem, answered as a runner answers it (`answer_refused`); the others run. The store's
    unavailability is raised (the open fails, or the fleet's round does)."""
    now = clock.now()
    shapes = versions.shapes
    ops: list[_op.Op] = []
    # A parent that waits for its children's undo runs nothing (docs/adr/0148): left as it is.
    active = [f for f in active if f.fan_in is None or f.state is State.RUNNING]
    for flow in active:
        reason = _values.mismatch(flow, shapes.get((flow.plan, flow.version)))
        move = _ops.Rerun(now) if reason is None else _ops.Block(reason, now)
        holder = writes.holders.rule(outside=False)
        ops.append(_op.Change(flow.flow_id, move, flow=flow, holder=holder))
    results = await gather([partial(writes.write_answered, op) for op in ops])
    refused = [
        (flow, r) for flow, r in zip(active, results, strict=True) if isinstance(r, _op.Rejected)
    ]
    if refused:
        await gather([partial(answer_refused, writes, clock, versions, f, r) for f, r in refused])
    return sum(
        1 for r in results if isinstance(r, _op.Changed) and r.transition.flow.state in ACTIVE
    )


async def answer_refused(
    writes: Writes,
    clock: Clock,
    versions: Versions,
    flow: Flow,
    rejected: _op.Rejected,
    *,
    lapsed_at: float | None = None,
) -> None:
    """The database refused the row that runs `flow` (the row read) again, here or in a fleet's
    takeover (`lapsed_at`: the answer, too, is written only while no engine holds the flow):
    answer it as a runner answers a refused write of its flow (the step fails and the flow
    compensates; a compensation fails and the flow blocks); a flow this engine could not run is
    left as it is. If the database refuses that write too, the flow is left as it is, not run:
    WARNING either way."""
    what = "it" if flow.state is State.COMPENSATING else f"step {flow.step!r}"
    problem = (
        f"the database refused to run {what} again (after attempt {flow.attempt}):"
        f" {_checks.describe(rejected.error)}"
    )
    shape = versions.shapes.get((flow.plan, flow.version))
    now = clock.now()
    answer: _ops.Move | None = None
    if _values.mismatch(flow, shape) is None:
        if flow.state is State.RUNNING:
            answer = _ops.StepFailed(shape, problem, now)
        elif flow.state is State.COMPENSATING:
            answer = _ops.CompensationFailed(problem, now, shape)
    if answer is not None:
        _log.warning(
            "%s: %s; %s instead",
            named(flow),
            problem,
            "its step fails" if flow.state is State.RUNNING else "it blocks",
            extra=about(flow),
        )
        holder = writes.holders.rule(outside=False)
        op = _op.Change(flow.flow_id, answer, flow=flow, lapsed_at=lapsed_at, holder=holder)
        result = await writes.write_answered(op)
        if not isinstance(result, _op.Rejected):
            return
        problem = f"{problem}; and refused that too: {_checks.describe(result.error)}"
        writes.left_as_it_is(flow, problem, result.error)
        return
    _log.warning(
        "%s is left as it is, not run by this engine: %s",
        named(flow),
        problem,
        extra=about(flow),
    )


async def let_go_unbegun(store: Store, clock: Clock, writes: Writes) -> None:
    """At close: let go of the flows whose current run had not begun in this engine (they
    waited for a runner slot, or for a retry's backoff), each by a compare-and-set on the row it
    knows, so that the engine that runs them next keeps their attempt number (attempts count
    runs that began). A flow that moved on meanwhile is left as it is (its next run then counts
    as attempt + 1: numbers may skip, never repeat), and so is one whose row the database
    refuses (split out of the batch, ADR 0063; WARNING): the close goes on."""
    now = clock.now()
    unbegun = [
        live.flow
        for live in writes.live.values()
        if live.began != live.flow.revision and live.flow.state in ACTIVE
    ]
    ops: list[_op.Op] = [_op.Change(flow.flow_id, _ops.LetGo(now), flow=flow) for flow in unbegun]
    if not ops:
        return

    async def run(batch: Sequence[_op.Op]) -> list[_op.Result]:
        return await store.transact(partial(_batch.write_batch, ops=batch, guard=writes.guard))

    try:
        results = await write_apart(run, ops)
    except Exception as exc:  # unavailable: they run again as attempt + 1
        _retry.next_round(exc, f"letting go of {len(ops)} flows not begun, at close")
        return
    for flow, result in zip(unbegun, results, strict=True):
        if isinstance(result, _op.Rejected):  # its own problem (docs/adr/0117)
            _log.warning(
                "%s is left as it is at close, not let go: the database refused that write: %s"
                " (its next run counts as attempt + 1)",
                named(flow),
                _checks.describe(result.error),
                extra=about(flow),
            )
