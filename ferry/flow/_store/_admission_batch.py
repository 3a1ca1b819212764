"""A batch's ends and starts of one limited plan, settled together (docs/adr/0182): the calls
`_queue.settle` would make one by one for each, in a fixed number of statements a batch, not
a few a flow. Built from `_admission`'s own steps (the same checks, counts and lock order:
the flow rows the writer wrote, then the budget row, then the key rows), so that what is
written is what the single calls write.

- `release_many`: the ends' claims cleared in one statement (each must have held one), each
  key's counts written once, one admission for the room they give back.
- `start_many`: due starts admitted as they are queued when nothing stands before any of them
  (their keys have nobody queued and room for all of them, the plan room for all, no open
  key, no rate): their queue columns and ``RUNNING`` in one many-row statement, their history
  rows in another, each key's counts once; else None and nothing written (the caller takes
  them one by one).

Synchronous, inside the batch's transaction: no trio, no clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs

from ferry.projected import Tx

from .._model._admission import BudgetError
from .._model._limits import Limits, StartOptions
from . import _dialect
from ._admission import (
    NO_KEY,
    Admitted,
    _admit,
    _holds,
    _key_counts,
    _key_of,
    _write_key,
)
from ._budgets import Budgets, get, put
from ._rows import ADMITTED, QUEUED, STRAIGHT_IN, admitted_detail, any_open
from ._sql import FLOWS

#: Flow ids a statement names, at most.
_PART = 500


def release_many(
    tx: Tx,
    plan: str,
    limits: Limits,
    flow_ids: Sequence[str],
    now: float,
    owner: str,
    budgets: Budgets,
) -> list[Admitted]:
    """`_admission.release` for each of `flow_ids` (written out of their slot states by the
    batch), in one admission: the flows it lets go, in order. `BudgetError` as there."""
    d = _dialect.of(tx)
    left: dict[str, tuple[str, str]] = {}
    for lo in range(0, len(flow_ids), _PART):
        part = flow_ids[lo : lo + _PART]
        rows = tx.execute(
            f"UPDATE {FLOWS} SET seq = NULL WHERE {d.in_list('flow_id', len(part))}"
            " AND plan = ? AND seq IS NOT NULL RETURNING flow_id, queue_key, state",
            [*d.list_params(part), plan],
        )
        left.update({str(r[0]): (str(r[1]), str(r[2])) for r in rows})
    for fid in flow_ids:
        if fid not in left:
            raise BudgetError(f"flow {fid!r} of plan {plan!r} holds nothing of its budget")
        state = left[fid][1]
        if _holds(state) or state == QUEUED:
            raise BudgetError(f"flow {fid!r} is {state}: it gives back no slot")
    read = get(tx, d, plan, budgets)
    n = len(flow_ids)
    if read.active < n:
        raise BudgetError(f"plan {plan!r}: {n} slots released while {read.active} are held")
    by_key = Counter(key for key, _state in left.values())
    for key in sorted(by_key):
        counts = _key_counts(tx, plan, key)
        if counts is None or counts[0] < by_key[key]:
            raise BudgetError(
                f"plan {plan!r} key {key!r}: {by_key[key]} slots released while"
                f" {0 if counts is None else counts[0]} are held"
            )
        _write_key(tx, limits, plan, key, counts[0] - by_key[key], counts[1])
    taken, b = _admit(tx, d, limits, plan, attrs.evolve(read, active=read.active - n), now, owner)
    put(tx, plan, read, b, budgets)
    return taken


def start_many(
    tx: Tx,
    plan: str,
    limits: Limits,
    starts: Sequence[tuple[str, StartOptions, int]],
    now: float,
    owner: str,
    budgets: Budgets,
) -> list[Admitted] | None:
    """Each of `starts` (flow id, checked options, the revision the writer wrote it ``QUEUED``
    at; each due) admitted as it is queued, in order; None, with nothing written, unless
    nothing stands before any of them."""
    if limits.rate is not None:
        return None
    d = _dialect.of(tx)
    read = get(tx, d, plan, budgets)
    if limits.concurrency is not None and read.active + len(starts) > limits.concurrency:
        return None
    keys = Counter(NO_KEY if o.key is None else o.key for _f, o, _r in starts)
    counts: dict[str, int] = {}
    for key in sorted(keys):
        active, queued = _key_counts(tx, plan, key) or (0, 0)
        if queued or (limits.per_key is not None and active + keys[key] > limits.per_key):
            return None
        counts[key] = active
    if any_open(tx, plan):
        return None
    # Nobody queued in their keys: each start's turn is the budget's (`enqueue`'s), its seq
    # the next; the admission keeps the budget's turn.
    who = owner or None
    rows = []
    taken = []
    for i, (fid, o, revision) in enumerate(starts, 1):
        key = NO_KEY if o.key is None else o.key
        rows.append((key, o.priority, read.turn, read.seq + i, o.not_before, who, now, fid, plan))
        taken.append(Admitted(fid, _key_of(limits, key), "RUNNING", revision + 1))
    tx.executemany(STRAIGHT_IN, rows)
    ids = [a.flow_id for a in taken]
    moved = 0
    for lo in range(0, len(ids), _PART):
        part = ids[lo : lo + _PART]
        moved += int(
            tx.execute(
                f"SELECT COUNT(*) FROM {FLOWS} WHERE {d.in_list('flow_id', len(part))}"
                " AND state = 'RUNNING' AND seq IS NOT NULL",
                d.list_params(part),
            )[0][0]
        )
    if moved != len(ids):  # a row that was not a fresh queued start: the batch is refused
        raise BudgetError(f"plan {plan!r}: {len(ids) - moved} of {len(ids)} starts not queued")
    detail = admitted_detail(owner, "RUNNING")
    tx.executemany(ADMITTED, [(a.flow_id, a.revision, now, detail) for a in taken])
    for key in sorted(keys):
        _write_key(tx, limits, plan, key, counts[key] + keys[key], 0)
    n = len(starts)
    put(tx, plan, read, attrs.evolve(read, active=read.active + n, seq=read.seq + n), budgets)
    return taken
