"""Limited flows for the SIGKILL test and the fleet test (issue 29, docs/adr/0171): a plan with
flow control, the flows that use it, and the oracle's limits half.

The plan ``limited``: at most `CONCURRENCY` active flows, at most `PER_KEY` per customer (its key
function reads ``data["customer"]``, one of `CUSTOMERS`). Its step ``hold`` makes the external
call and parks (``timeout=data["hold"]``, ``on_timeout="continue"``): a parked flow keeps its
slot, so active flows overlap for a while; ``finish`` makes the call and completes. Flows start
with a priority (-1, 0 or 1) and some with an absolute start time (``at=``: a restarted process
starts them again with the same time, the same flow).

The limits half of the oracle (`audit_limited`, pure):
- every limited flow ended ``COMPLETED``, and its history has exactly one ``admitted`` event (a
  slot taken twice, or never, is a problem), at or after its start time for a delayed one;
- a flow holds its slot from its admission to its end; in the store's commit order of those
  writes (`order`: SQLite's history rows in insertion order, one writer; the fleet test's audit
  of every write on PostgreSQL) no more than `CONCURRENCY` flows ever hold one, nor more than
  `PER_KEY` of one customer. Not by the events' times alone: an admission's time is its op's,
  taken before its transaction waited for the budget row, so it may be a little before the end
  whose slot it took (docs/adr/0171);
- and (`budget_left`) the plan's counters in the store are back to 0 active and 0 queued: no
  slot leaked.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs

from ferry import flow

Call = Callable[[flow.Context], Awaitable[None]]

PLAN = "limited"
CONCURRENCY = 3
PER_KEY = 1
CUSTOMERS = ("c0", "c1", "c2", "c3", "c4")


@attrs.frozen
class Limited:
    """One limited flow: its id, data, priority and start time (None: at once; else seconds
    after the run's epoch)."""

    flow_id: str
    data: dict[str, Any]
    priority: int
    at: float | None


def make_limited(call: Call) -> flow.Plan:
    limits = flow.Limits(concurrency=CONCURRENCY, key=lambda d: d["customer"], per_key=PER_KEY)
    plan = flow.Plan(PLAN, limits=limits)

    @plan.step
    async def hold(ctx: flow.Context) -> flow.Outcome:
        await call(ctx)
        return flow.park(timeout=ctx.data["hold"], on_timeout="continue")

    @plan.step
    async def finish(ctx: flow.Context) -> None:
        await call(ctx)

    return plan


def limited_scenario(n: int, seed: int, prefix: str = "q") -> list[Limited]:
    """`n` limited flows from `seed` (a generator of their own: the other flows' stay as they
    were)."""
    rng = random.Random(seed * 7919 + 29)
    out = []
    for i in range(n):
        data = {
            "kind": "limited",
            "customer": rng.choice(CUSTOMERS),
            "hold": round(rng.uniform(0.01, 0.1), 3),
            "pause": round(rng.uniform(0.0, 0.02), 3),
        }
        at = round(rng.uniform(0.0, 3.0), 3) if rng.random() < 0.2 else None
        out.append(Limited(f"{prefix}{i:05d}", data, rng.choice([-1, 0, 0, 1]), at))
    return out


def audit_limited(
    specs: Sequence[Limited],
    states: Mapping[str, flow.State | None],
    history: Mapping[str, Sequence[flow.Event]],
    epoch: float,
    order: Sequence[tuple[str, str]],
) -> list[str]:
    """Every violation of the limits half of the oracle (module doc); empty if all holds.
    `order`: ``(flow id, "admitted" | "ended")`` of the limited flows' slot writes, in commit
    order."""
    problems = []
    customer = {spec.flow_id: spec.data["customer"] for spec in specs}
    for spec in specs:
        fid = spec.flow_id
        if states.get(fid) is not flow.State.COMPLETED:
            problems.append(f"{fid} (limited) ended {states.get(fid)}, not COMPLETED")
        admitted = [e.at for e in history.get(fid, ()) if e.kind == "admitted"]
        if len(admitted) != 1:
            problems.append(f"{fid} (limited) was admitted {len(admitted)} times, not once")
        elif spec.at is not None and admitted[0] < epoch + spec.at - 1e-6:
            problems.append(f"{fid} was admitted {epoch + spec.at - admitted[0]:.3f} s early")
    active = 0
    per: Counter[str] = Counter()
    for i, (fid, what) in enumerate(order):
        delta = 1 if what == "admitted" else -1
        active += delta
        per[customer[fid]] += delta
        if active > CONCURRENCY:
            problems.append(f"{active} limited flows were active at write {i} ({fid} admitted)")
        if per[customer[fid]] > PER_KEY:
            problems.append(
                f"{per[customer[fid]]} flows of customer {customer[fid]!r} were active at write"
                f" {i} ({fid} admitted; per_key {PER_KEY})"
            )
    return problems


def sqlite_order(tx: Any) -> list[tuple[str, str]]:
    """`audit_limited`'s `order` on SQLite: the limited flows' admissions and ends in the order
    their history rows were inserted (one writer: the commit order)."""
    rows = tx.execute(
        "SELECT h.flow_id, h.kind FROM flow_history h JOIN flow_flows f ON f.flow_id = h.flow_id"
        " WHERE f.plan = ? AND h.kind IN ('admitted', 'completed', 'failed') ORDER BY h.rowid",
        (PLAN,),
    )
    return [(str(f), "admitted" if k == "admitted" else "ended") for f, k in rows]


def budget_left(tx: Any) -> list[str]:
    """The plan's counters once every flow ended: 0 active, 0 queued (no slot leaked)."""
    active = tx.execute("SELECT active FROM flow_budgets WHERE plan = ?", (PLAN,))
    keys = tx.execute(
        "SELECT COALESCE(SUM(active), 0), COALESCE(SUM(queued), 0) FROM flow_keys WHERE plan = ?",
        (PLAN,),
    )
    got = (int(active[0][0]) if active else 0, int(keys[0][0]), int(keys[0][1]))
    return [] if got == (0, 0, 0) else [f"the limited plan's counters are {got}, not (0, 0, 0)"]


def max_active(order: Sequence[tuple[str, str]]) -> int:
    """The most limited flows active at once, in commit order (for the checks that the limit
    was reached)."""
    n = most = 0
    for _fid, what in order:
        n += 1 if what == "admitted" else -1
        most = max(most, n)
    return most
