"""What operators see of flow control (SPEC 5.8, docs/adr/0169): each limited plan's limits and
usage (`plan_queues`), and why a queued flow waits (`waiting`). Reads only: nothing locked, no
counter written; the inspector's ``stats`` and ``show``, the dashboard's overview and flow page.

Cost: per limited plan, its budget row, one pass over its key rows (the queued count and the
busy keys: O(keys)) and, with a rate, the window's admissions (at most the rate's count); per
queued flow shown, `_admission.waits_for`'s few probes.
"""

from __future__ import annotations

import json
from typing import Final, final

import attrs

from ferry.projected import Tx

from .._model import _admission as adm
from .._model._types import Json, State
from .._model._values import Flow
from . import _admission, _dialect
from ._admission import ADMISSIONS, BUDGETS, KEYS

__all__ = ["PlanQueue", "Waits", "limits_text", "plan_queues", "waiting"]


@final
@attrs.frozen
class PlanQueue:
    """A limited plan's flow control now: its `limits` (as stored: `Limits.stored`), its flows
    `active` (holding a slot) and `queued`, the keys with a flow active (`busy_keys`), and the
    flows admitted within its rate's window (`in_window`; None without a rate)."""

    plan: str
    limits: dict[str, Json]
    active: int
    queued: int
    busy_keys: int
    in_window: int | None

    def json(self) -> dict[str, Json]:
        return {
            "plan": self.plan,
            "limits": self.limits,
            "active": self.active,
            "queued": self.queued,
            "busy_keys": self.busy_keys,
            "in_window": self.in_window,
        }


def limits_text(limits: dict[str, Json]) -> str:
    """`limits` (as stored) as an operator reads them: ``concurrency 50, per key 1, rate 100 per
    60 s`` (a key function: ``per key`` or ``keyed``)."""
    parts = []
    if limits.get("concurrency") is not None:
        parts.append(f"concurrency {limits['concurrency']}")
    if limits.get("per_key") is not None:
        parts.append(f"per key {limits['per_key']}")
    elif limits.get("key"):
        parts.append("keyed")
    rate = limits.get("rate")
    if isinstance(rate, list) and len(rate) == 2:
        parts.append(f"rate {rate[0]} per {rate[1]:g} s")
    return ", ".join(parts) or "-"


def plan_queues(tx: Tx, now: float) -> list[PlanQueue]:
    """Every limited plan of the store (a budget row: an engine registered it), by name; none
    in a store no engine of this version has opened yet (no budget table)."""
    if not tx.execute(_dialect.of(tx).table_exists, (BUDGETS,))[0][0]:
        return []
    out = []
    for plan, active, text in tx.execute(
        f"SELECT plan, active, limits FROM {BUDGETS} ORDER BY plan"
    ):
        limits = json.loads(text)
        keys = tx.execute(
            f"SELECT COALESCE(SUM(queued), 0),"
            f" COALESCE(SUM(CASE WHEN active > 0 THEN 1 ELSE 0 END), 0)"
            f" FROM {KEYS} WHERE plan = ? AND queue_key <> ''",
            (plan,),
        )
        unkeyed = tx.execute(
            f"SELECT COALESCE(SUM(queued), 0) FROM {KEYS} WHERE plan = ? AND queue_key = ''",
            (plan,),
        )
        rate = limits.get("rate")
        in_window = None
        if isinstance(rate, list) and len(rate) == 2:
            in_window = int(
                tx.execute(
                    f"SELECT COUNT(*) FROM {ADMISSIONS} WHERE plan = ? AND at > ?",
                    (plan, now - float(rate[1])),
                )[0][0]
            )
        out.append(
            PlanQueue(
                plan=str(plan),
                limits=limits,
                active=int(active),
                queued=int(keys[0][0]) + int(unkeyed[0][0]),
                busy_keys=int(keys[0][1]),
                in_window=in_window,
            )
        )
    return out


@final
@attrs.frozen
class Waits:
    """Why a queued flow waits: `reasons`, each that holds it now, in the rule's order
    (``"time"``, ``"concurrency"``, ``"per_key"``, ``"rate"``; ``"turn"`` alone: nothing holds
    it but the flows ahead of it), and a sentence of them."""

    reasons: tuple[str, ...]
    text: str

    def json(self) -> dict[str, Json]:
        return {"reasons": list(self.reasons), "text": self.text}


_TURN: Final = "turn"


def waiting(tx: Tx, flow: Flow, now: float) -> Waits | None:
    """Why `flow` (its row as read in `tx`) waits in its plan's queue at `now`: every limit
    that holds it (as `_admission.waits_for` judges each) or its time; None if it is not queued
    (or its plan has no budget row: no engine registered its limits)."""
    if flow.state is not State.QUEUED or flow.queue_key is None:
        return None
    budget = tx.execute(f"SELECT active FROM {BUDGETS} WHERE plan = ?", (flow.plan,))
    if not budget:
        return None
    limits = _admission.limits_of(tx, flow.plan)
    active = int(budget[0][0])
    found: list[tuple[str, str]] = []
    if flow.not_before is not None and flow.not_before > now:
        found.append((adm.TIME, "its start time (a delayed start)"))
    if limits.concurrency is not None and active >= limits.concurrency:
        found.append(
            (adm.CONCURRENCY, f"the plan's concurrency: {active} of {limits.concurrency} active")
        )
    if limits.per_key is not None:
        rows = tx.execute(
            f"SELECT active FROM {KEYS} WHERE plan = ? AND queue_key = ?",
            (flow.plan, flow.queue_key),
        )
        of_key = int(rows[0][0]) if rows else 0
        if of_key >= limits.per_key:
            found.append(
                (adm.PER_KEY, f"its key {flow.queue_key!r}: {of_key} of {limits.per_key} active")
            )
    rate = limits.rate
    if rate is not None:
        n = tx.execute(
            f"SELECT COUNT(*) FROM {ADMISSIONS} WHERE plan = ? AND at > ?",
            (flow.plan, now - rate.per),
        )[0][0]
        if int(n) >= rate.count:
            found.append(
                (adm.RATE, f"the plan's rate: {n} of {rate.count} started in {rate.per:g} s")
            )
    if not found:
        found.append(
            (_TURN, "its turn: flows ahead of it in the plan's queue (priority, then age)")
        )
    return Waits(tuple(r for r, _t in found), "; ".join(t for _r, t in found))
