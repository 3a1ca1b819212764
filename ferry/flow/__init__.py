"""ferry.flow: durable sagas on trio: steps with compensations, parking until an external
event, recovery after a crash, on SQLite (embedded) or PostgreSQL.

How to use it::

    from ferry import flow

    order = flow.Plan("order", version=1)

    @order.step(compensate=release_stock)
    async def reserve(ctx: flow.Context) -> None:
        ctx.data["reserved"] = await stock.reserve(ctx.data["sku"], key=ctx.idempotency_key)

    @order.step(compensate=refund, attempts=5)
    async def charge(ctx: flow.Context) -> flow.Outcome:
        await payments.start(ctx.flow_id, ctx.data["amount"], key=ctx.idempotency_key)
        return flow.park(timeout=3600)       # until a wake, else compensate

    @order.step
    async def ship(ctx: flow.Context) -> None:
        ctx.data["tracking"] = await carrier.ship(ctx.data, key=ctx.idempotency_key)

    async with flow.open_engine("orders.db", plans=[order]) as engine:
        await engine.start(order, flow_id="order-42", data={"sku": "A1", "amount": 30})
        await engine.wake("order-42", {"payment": "ok"}, message_id="evt-981")
        snapshot = await engine.wait("order-42", timeout=10)

A step returns None/`CONTINUE` (next step), `COMPLETE` (done), `park()` (persist and stop until
`Engine.wake`) or `fail()` (compensate the completed steps, in reverse order). A step that raises
is retried (`attempts`, backoff from 0.1 s) and then compensates. Every step boundary is one
durable write (a compare-and-set on the flow's revision) shared with other flows' writes in one
transaction. A step that was running when the process died runs again: pass
`Context.idempotency_key` to external calls. Choreography: ``engine.on(event_type, mapper)`` and
``await engine.publish(event_type, event)``.

Several engine processes may share one PostgreSQL database (docs/flow-fleet.md): each holds a
lease, takes over the flows of engines that died, and can never advance a flow another engine
took over. ``python -m ferry.flow STORE`` lists, shows and counts flows, and wakes, cancels or
resumes one as an operator. ``flow.connect(store)`` is a client from any process: it asks the
engine that serves the store to start, wake, cancel, resume, abandon or publish (docs/flow.md,
"From another process"). ``open_engine(..., observers=[...])`` tells `flow.Observer` objects of
every step attempt and every flow's end (`StepRun`, `FlowEnd`): ``ferry.metrics`` is one.
``flow.Schedule(name, plan, cron=...)`` given to ``open_engine(schedules=[...])`` starts a flow
at every tick of a cron expression, each tick once across restarts and a fleet (docs/flow.md,
"Schedules").
"""

from __future__ import annotations

from stm._internal import fixup_module_metadata as _fixup_module_metadata

from ._engine._client import Client as Client
from ._engine._client import Receipt as Receipt
from ._engine._client import connect as connect
from ._engine._engine import Engine as Engine
from ._engine._observer import Observer as Observer
from ._engine._open import open_engine as open_engine
from ._model._checks import fail as fail
from ._model._checks import park as park
from ._model._children import Child as Child
from ._model._children import ChildResult as ChildResult
from ._model._children import Outcome as Outcome
from ._model._children import Spawn as Spawn
from ._model._children import spawn as spawn
from ._model._errors import FlowError as FlowError
from ._model._errors import IdReused as IdReused
from ._model._errors import StoreLocked as StoreLocked
from ._model._errors import UnknownFlow as UnknownFlow
from ._model._errors import UnknownPlan as UnknownPlan
from ._model._errors import UnknownSchedule as UnknownSchedule
from ._model._limits import Limits as Limits
from ._model._limits import Rate as Rate
from ._model._observed import FlowEnd as FlowEnd
from ._model._observed import ScheduleTick as ScheduleTick
from ._model._observed import StepRun as StepRun
from ._model._plan import Plan as Plan
from ._model._plan import StepDef as StepDef
from ._model._types import COMPLETE as COMPLETE
from ._model._types import CONTINUE as CONTINUE
from ._model._types import IGNORE as IGNORE
from ._model._types import Context as Context
from ._model._types import Delivery as Delivery
from ._model._types import Event as Event
from ._model._types import Fail as Fail
from ._model._types import FlowStatistics as FlowStatistics
from ._model._types import Park as Park
from ._model._types import Snapshot as Snapshot
from ._model._types import Start as Start
from ._model._types import State as State
from ._model._types import Wake as Wake
from ._store._cron import Schedule as Schedule

__all__ = [
    "COMPLETE",
    "CONTINUE",
    "IGNORE",
    "Child",
    "ChildResult",
    "Client",
    "Context",
    "Delivery",
    "Engine",
    "Event",
    "Fail",
    "FlowEnd",
    "FlowError",
    "FlowStatistics",
    "IdReused",
    "Limits",
    "Observer",
    "Outcome",
    "Park",
    "Plan",
    "Rate",
    "Receipt",
    "Schedule",
    "ScheduleTick",
    "Snapshot",
    "Spawn",
    "Start",
    "State",
    "StepDef",
    "StepRun",
    "StoreLocked",
    "UnknownFlow",
    "UnknownPlan",
    "UnknownSchedule",
    "Wake",
    "connect",
    "fail",
    "open_engine",
    "park",
    "spawn",
]

# Tracebacks, reprs and help() show the public names, not the private modules.
_fixup_module_metadata(__name__, globals())
