"""A step that spawns child flows (SPEC 5.7, docs/adr/0148): the runner's half.

`problem` checks what the store cannot (a child plan this engine lacks, child data over
`max_data_bytes`) before anything is written: such a spawn fails its parent like a malformed
outcome, and no child row is written. `write` writes the spawn, the parent's park and the first
children's rows in one transaction (`_store._family.write_spawn`), and memory follows them like
any batch (the children become live here). `results` reads ``ctx.children`` for the step after
a spawn (`Flow.fan_in`): once per fan-in.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial

import attrs
import trio

from .._model import _family, _holders
from .._model._children import KEYED_CHILD, ChildResult, Spawn
from .._model._signals import Signals
from .._model._values import Flow, Shape
from .._store import _batch, _kin, _op
from .._store import _family as sf
from . import _read, _retry, _tracing
from ._live import Live, about, named
from ._writes import Writes

__all__ = ["problem", "results", "spawned", "write"]


async def spawned(
    writes: Writes,
    live: Live,
    shape: Shape,
    outcome: Spawn,
    data: str,
    now: float,
    shapes: Mapping[tuple[str, int], Shape],
    max_data: int,
    read_again: Callable[[Writes, Live, Flow], Awaitable[None]],
    tracing: _tracing.Tracing | None = None,
    signals: Signals | None = None,
) -> str | None:
    """The runner's spawn: why the flow's step fails (`problem`, a child id taken), or None
    once the spawn is written, or once the flow moved on meanwhile (then `read_again`). With
    `tracing`, the write is the span the children's spans are below (`_tracing.spawning`)."""
    flow = live.flow
    why = problem(flow.step or "", outcome, shapes, max_data)
    if why is not None:
        return why
    with _tracing.spawning(tracing, flow, len(outcome.children)) as trace:
        written = await write(
            writes, flow, shape, outcome, data, now, shapes, trace=trace, signals=signals
        )
    if written is False and live.flow.revision <= flow.revision:
        await read_again(writes, live, flow)
    return written if isinstance(written, str) else None


def problem(
    step: str, outcome: Spawn, shapes: Mapping[tuple[str, int], Shape], max_data: int
) -> str | None:
    """Why the spawn `outcome` of step `step` cannot be written, or None."""
    for child in outcome.children:
        plan = child.plan
        if (plan.name, plan.version) not in shapes:
            return (
                f"step {step!r} spawned the child {child.key!r} of plan {plan.name!r} version"
                f" {plan.version}, which is not registered with this engine (give it to"
                " open_engine's plans)"
            )
        limits = shapes[(plan.name, plan.version)].limits  # as registered (`Child` checks too)
        if limits is not None and limits.key is not None:
            return f"step {step!r} spawned the child {child.key!r}: " + KEYED_CHILD.format(
                plan=plan.name
            )
        size = len(child.text.encode())
        if size > max_data:
            return (
                f"step {step!r} spawned the child {child.key!r} with data of {size} bytes, more"
                f" than max_data_bytes ({max_data})"
            )
    return None


async def write(
    writes: Writes,
    flow: Flow,
    shape: Shape,
    outcome: Spawn,
    data: str,
    now: float,
    shapes: Mapping[tuple[str, int], Shape],
    *,
    trace: str | None = None,
    signals: Signals | None = None,
) -> str | bool:
    """Write the spawn `outcome` of the flow's current step (its data now `data`): True if it
    was written; False if the flow moved on meanwhile (nothing written: the runner reads it
    again); a str if a child's id is taken by another flow (nothing written: the parent fails
    with it). The store's unavailability is retried. The children's trace is `trace` (the
    spawn's span), else the parent's own."""
    writer = writes.holders.rule(outside=False).writer
    kids = [(c.key, shapes[(c.plan.name, c.plan.version)], c.text) for c in outcome.children]
    move = _family.spawned(
        flow,
        shape,
        kids,
        max_running=outcome.max_running,
        timeout=outcome.timeout,
        on_failure=outcome.on_failure,
        data=data,
        now=now,
        owner=writer,
        trace=trace if trace is not None else flow.trace,
    )
    assert move.parent is not None
    parent = _holders.assign_holder(move.parent, flow, writer, keep_runner=False)
    move = attrs.evolve(move, parent=parent)
    ops: list[_op.Op] = [_op.Change(flow.flow_id, _kin.Fixed(parent), flow=flow, signals=signals)]
    ops += [_op.Create(c) for c in move.children]
    fn = partial(_kin.write_spawn, before=flow, move=move)
    keys = tuple(c.key for c in outcome.children)
    # Kept from before the write: a child may end as soon as it commits (docs/adr/0173).
    writes.gathered.spawned(flow.flow_id, flow.step_index, flow.created_at, keys)
    written = False
    try:
        with trio.CancelScope(shield=True):
            await _retry.retrying(
                partial(_transact, writes, ops, fn),
                what=lambda: f"writing the spawn of {named(flow)}",
                extra=partial(about, flow),
            )
        written = True
    except (sf.NotSpawned, _batch.Undone) as exc:
        found = exc.results
        if found and isinstance(found[0], _op.Changed):
            taken = [
                r.flow.flow_id for r in found[1:] if isinstance(r, _op.Existing) and not r.same
            ]
            return (
                f"step {flow.step!r} spawned children whose flow ids are taken by other flows:"
                f" {', '.join(map(repr, taken[:5]))}"
            )
        return False
    finally:
        if not written:
            writes.gathered.forget(flow.flow_id)
    return True


async def _transact(
    writes: Writes, ops: Sequence[_op.Op], write: Callable[..., list[_op.Result]]
) -> list[_op.Result]:
    """``write(tx, ops=ops, guard=...)`` in one transaction of its own (a spawn's), then the
    effects of `ops` in memory as of a batch's (`Writes._transact`)."""
    return await writes._transact(ops, write)


async def results(writes: Writes, flow: Flow) -> dict[str, ChildResult]:
    """``ctx.children`` of the flow's current step (its `fan_in` spawn's children): as this
    engine kept them while they ended (`_gathered`), else one read of the store."""
    assert flow.fan_in is not None
    kept = writes.gathered.take(flow)
    if kept is not None:
        await trio.lowlevel.checkpoint()
        return kept
    read = partial(_kin.results_of, parent=flow.flow_id, step_index=flow.fan_in)
    return await _retry.retrying(
        partial(_read.own, writes._store, read),
        what=lambda: f"reading the children of {named(flow)}",
        extra=partial(about, flow),
    )
