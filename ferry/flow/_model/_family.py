"""Child flows, the pure transitions of a family: a parent, its spawn, its children (ADR 0139).

PURE, like `_machine`: no trio, no clock, no I/O; time comes in as `now`. A child is an ordinary
flow, driven by `_machine` like any other; this module adds what ties it to its parent. Each
function here is ONE write of the store (one transaction): it takes the rows that transaction
reads and returns every row it writes (`Move`). The next round wires them into the store and the
runner; until then only the model check (tests/model/children.py) drives them.

The rows (one table each; docs/adr/0139 gives their columns and keys)
--------------------------------------------------------------------
- the parent: its `Flow` row, `PARKED` at the spawning step from the spawn until its last child
  ends (`park_deadline` the spawn's timeout, `on_timeout` its `on_failure`);
- `Brood`: the spawn's own row (``flow_spawns``, keyed by parent and step index): the count of
  children still active, the index of the first kept one, the count that ended, the phase. A
  child's end changes only this row's counters and its own `Kid` row: O(1), never a read of
  its brothers;
- `Kid`: one row per child (``flow_children``, keyed by parent, step index and child index): its
  status, and from its end its data, error, place in the order of ends and the compensation
  stack it ended with (what its parent's compensation runs);
- each child's own `Flow` row (none while it is kept).

Phases of a spawn (`Brood.phase`) and the functions that move them
-----------------------------------------------------------------
::

    spawned --------------------------------> WAITING (the first `max_running` children started)
    WAITING --child_ended-------------------> WAITING (the next kept child started), or, the last
                                              one ended: OVER (the parent runs its next step)
    WAITING --child_ended(FAILED, compensate)
            --timed_out / cancel_waiting----> STOPPING (the active children cancelled, no kept
                                              one starts)
    STOPPING --child_ended (the last)-------> OVER (the parent compensates, or, a timeout with
                                              on_failure="continue", runs its next step)
    OVER --compensating (the parent compensates past the spawn)
                                           -> UNDOING (its completed children compensated, the
                                              last ended first, one at a time) | UNDONE (none)
    UNDOING --child_ended (the child being undone)
                                           -> UNDOING (the next one) | UNDONE (the parent goes
                                              on: the spawning step's own compensation, or the
                                              steps below it, or FAILED)

While a spawn is UNDOING its parent's row is `COMPENSATING` at the spawning step and runs
nothing (`runnable`): the store reads the spawn row with the parent's (one key lookup). Its
stack may then lack the spawning step (a spawning step without a compensation of its own):
`_invariants.check_invariants` holds for the parent at every other moment, and `check_family`
states the rules of a family at every moment.

From outside: `cancel` (the one cancel of a flow that may have a spawn, also for a whole flow's
deadline), `cascade_due` (a child that waits for children of its own, left by a stop for its
own cancel), `wake_waiting` (a wake for a waiting parent is queued for its next park), and
`results` (``ctx.children``). A child that BLOCKS has not ended: its parent waits.

Where it lives (split by concern; this module re-exports every public name): the rows and the
reading of a spawn in `_family_rows`, the spawn and a child's end in `_family_spawn`, the stops
from outside in `_family_stops`, the parent's compensation of its children in `_family_undo`,
the rules of a family in `_family_check`.
"""

from __future__ import annotations

from ._family_check import check_family
from ._family_rows import (
    ACTIVE,
    KEPT,
    OVER,
    STOPPING,
    UNDOING,
    UNDONE,
    WAITING,
    Brood,
    Kid,
    Move,
    ShapeOf,
    cascade_due,
    child_stack,
    results,
    runnable,
    waits,
    wake_waiting,
)
from ._family_spawn import child_ended, go_on, spawned
from ._family_stops import cancel, cancel_waiting, timed_out
from ._family_undo import compensating

__all__ = [
    "ACTIVE",
    "KEPT",
    "OVER",
    "STOPPING",
    "UNDOING",
    "UNDONE",
    "WAITING",
    "Brood",
    "Kid",
    "Move",
    "ShapeOf",
    "cancel",
    "cancel_waiting",
    "cascade_due",
    "check_family",
    "child_ended",
    "child_stack",
    "compensating",
    "go_on",
    "results",
    "runnable",
    "spawned",
    "timed_out",
    "waits",
    "wake_waiting",
]
