"""Recovery: what an engine does with the store's flows when it opens, and what it leaves when it
closes.

At open a serving engine records its plans, then on one SQLite file resumes every running or
compensating flow and arms every parked flow's timer; in a fleet it resumes the flows its owner
name held (a restart under the same name) and takes over the orphans (its first scan). A flow is
resumed as attempt + 1 if a run of it may have begun (docs/adr/0024). At close it lets go of the
flows whose current run had not begun, so that the next engine keeps their attempt number.
"""

from __future__ import annotations

import logging
from functools import partial

from ferry.projected import Store

from . import _machine as m
from . import _retry, _store
from ._clock import Clock
from ._fleet import Fleet
from ._lease import Lease, transient
from ._live import Tally, on_row
from ._timer_loop import Timers
from ._types import State
from ._values import ACTIVE
from ._versions import Versions
from ._writes import Writes

_log = logging.getLogger("ferry.flow")


async def recover(
    store: Store,
    clock: Clock,
    versions: Versions,
    writes: Writes,
    tally: Tally,
    timers: Timers,
    lease: Lease,
    fleet: Fleet | None,
    *,
    owner: str,
    serve: bool,
) -> None:
    """At open: record this engine's plans; then, on one SQLite file, resume every running or
    compensating flow and arm every parked flow's timer; in a fleet (`fleet` given), resume the
    flows this owner name held and take over the orphans (the first scan, which a database
    outage does not fail: the scan loop goes on)."""
    shapes = versions.shapes
    if shapes:
        registered = list(shapes.values())
        await store.transact(partial(_store.register_plans, shapes=registered, now=clock.now()))
    if not serve:
        return
    tally.parked = (await store.transact(_store.count_states)).get(State.PARKED, 0)
    if fleet is not None:
        now = clock.now()
        await lease.claim(now, now + lease.lease, sorted(shapes))
        held = await store.transact(partial(_store.load_active, owner=owner))
        mine = [f for f in held if (f.plan, f.version) in shapes]
        others = [(f.flow_id, f.revision) for f in held if (f.plan, f.version) not in shapes]
        if others:  # a version this engine lacks: leave those to an engine that has it
            await store.transact(partial(_store.release, owner=owner, flows=others, at=now))
        tally.stats["recovered"] = await writes.rerun(mine)
        try:
            await fleet.scan()
        except Exception as exc:
            if not transient(exc):
                raise
            _log.warning(
                "flow engine %r: its first scan failed (%r); the next one is in %.1f s",
                owner,
                exc,
                fleet.interval,
                extra={"owner": owner},
            )
        return
    timers.load(await store.transact(_store.load_deadlines))
    active = await store.transact(_store.load_active)
    tally.stats["recovered"] = await writes.rerun(active)


async def let_go_unbegun(store: Store, clock: Clock, writes: Writes) -> None:
    """At close: let go of the flows whose current run had not begun in this engine (they
    waited for a runner slot, or for a retry's backoff), each by a compare-and-set on the row it
    knows, so that the engine that runs them next keeps their attempt number (attempts count
    runs that began). A flow that moved on meanwhile is left as it is (its next run then counts
    as attempt + 1: numbers may skip, never repeat)."""
    now = clock.now()
    ops: list[_store.Op] = [
        _store.Change(live.flow.flow_id, on_row(m.let_go, now), flow=live.flow)
        for live in writes.live.values()
        if live.began != live.flow.revision and live.flow.state in ACTIVE
    ]
    if not ops:
        return
    try:
        await store.transact(partial(_store.write_batch, ops=ops, guard=writes.guard))
    except Exception as exc:  # unavailable: they run again as attempt + 1
        _retry.log_or_raise(exc, f"letting go of {len(ops)} flows not begun, at close")
