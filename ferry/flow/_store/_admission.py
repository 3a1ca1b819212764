"""Flow control's store half (docs/adr/0141, 0147): the budget rows, the admission window, the
queue's indexes, and the synchronous functions over a `Tx` that the runtime calls inside the
transaction that moves a flow (SPEC 5.8). The pure rule is `_model._admission`.

Tables (`ddl`, `flow_indexes` and `FLOW_COLUMNS`, made by `_schema.create_schema`):

- ``flow_budgets(plan PK, active, seq, turn, in_window, limits)``: one row per limited plan
  (`register`). `active` counts its flows in a slot state (`_admission.holds_slot`), `seq`
  numbers the queue's inserts, `turn` is the fair-queue clock (the latest admission's turn),
  `in_window` the rows of ``flow_admissions`` (the admissions not yet pruned from the window).
- ``flow_keys(plan, queue_key, active, queued, head_priority, head_turn, head_seq, open, PK
  (plan, queue_key))``: one row per key with an active or queued flow (a plan without a key
  function has the one key ``''``, with no per-key limit), deleted by the transaction that
  empties it; its head is its first due queued flow in `_admission.order`; `open` (1 or 0): a
  due head and room under ``per_key``. Index ``(plan, head_priority, head_turn, head_seq) WHERE
  open = 1``: the next flow to admit is the first open key's head (`_admission.first_by_heads`).
- ``flow_admissions(plan, at)``, index ``(plan, at)``: the admission times of the sliding window.
- On ``flow_flows``, added by ``ALTER TABLE`` (nullable: a flow of a plan without limits has
  none): ``queue_key, priority, turn, seq, not_before, due``. `seq` is also the flow's claim on
  its plan's counters: set at `enqueue`, cleared when the flow leaves them (`release`,
  `unqueue`), so that no slot is given back twice. Partial indexes over the queued flows: a
  key's due queue ``(plan, queue_key, priority, turn, seq)``, a key's turns ``(plan,
  queue_key, turn)`` (`_admission.turn_for`'s last queued turn), the delayed ones ``(plan,
  not_before)`` (the timer).

Every function that changes a plan's counters locks its budget row (``FOR UPDATE``) after the
flow rows its caller has written and before any key row, and holds it to the commit (ADR
0141's one lock order); the only flow row it touches that the caller did not lock is a queued
head, taken with ``SKIP LOCKED`` (a head locked by another transaction passes its key over for
this call). On SQLite the one writer holds the whole file and both clauses are empty.

Cost per admitted flow: a probe of the open keys' index, a probe of the head (by its whole
index entry), the flow's write and its history row, a probe for the key's next head and the key
row's write, and (with a rate) a probe for the window's last time and its insert; the budget's
lock and write once per transaction. An end adds its claim, its key's counts and row; a start
its key's last turn, its queue columns, its key's counts and row. Each is an index probe or a
one-row write whatever the queue's length (the tests compare them, and their plans, at 1,000
and 100,000 queued). A batch's forms (`Budgets`, `_straight_in`, `_admission_batch`): ADR
0182 (their shared statements: `_rows`). Plans without limits never call here.

No trio, no clock: `now` is the caller's (on a fleet, the lease clock, `Dialect.clock`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final, final

import attrs

from ferry.projected import Tx

from .._model import _admission, _limits
from .._model._admission import BudgetError, Usage, Waiting
from .._model._limits import Limits, StartOptions
from . import _dialect
from ._budgets import BUDGETS as BUDGETS  # one of its tables, named with the others
from ._budgets import Budget, Budgets, get, lock, put, write_one
from ._rows import ADMITTED, STRAIGHT_IN, admitted_detail, any_open
from ._rows import KEYS as KEYS  # its tables and states, named with the others
from ._rows import QUEUED as QUEUED
from ._sql import FLOWS, STATES

ADMISSIONS: Final = "flow_admissions"

#: The flows table's queue columns (in `_schema.ddl`, and added to an older store).
FLOW_COLUMNS: Final = (
    ("queue_key", "TEXT"),
    ("priority", "BIGINT"),
    ("turn", "BIGINT"),
    ("seq", "BIGINT"),
    ("not_before", "DOUBLE PRECISION"),
    ("due", "INTEGER"),
)
#: The key of every flow of a plan without a key function.
NO_KEY: Final = ""


def _holds(state: str | None) -> bool:
    """Does a flow whose row says `state` hold a slot (`_admission.holds_slot`)?"""
    return state is not None and _admission.holds_slot(STATES.get(state, state))


def ddl() -> list[str]:
    """The tables and indexes of flow control, each idempotent (both dialects: the flows'
    added columns are `FLOW_COLUMNS`, their indexes `flow_indexes`)."""
    return [
        f"""CREATE TABLE IF NOT EXISTS {BUDGETS} (
            plan TEXT PRIMARY KEY,
            active BIGINT NOT NULL,
            seq BIGINT NOT NULL,
            turn BIGINT NOT NULL,
            in_window BIGINT NOT NULL,
            limits TEXT NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS {KEYS} (
            plan TEXT NOT NULL,
            queue_key TEXT NOT NULL,
            active BIGINT NOT NULL,
            queued BIGINT NOT NULL,
            head_priority BIGINT,
            head_turn BIGINT,
            head_seq BIGINT,
            open INTEGER NOT NULL,
            PRIMARY KEY (plan, queue_key))""",
        f"CREATE INDEX IF NOT EXISTS {KEYS}_open ON {KEYS}"
        " (plan, head_priority, head_turn, head_seq) WHERE open = 1",
        f"""CREATE TABLE IF NOT EXISTS {ADMISSIONS} (
            plan TEXT NOT NULL,
            at DOUBLE PRECISION NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ADMISSIONS}_at ON {ADMISSIONS} (plan, at)",
    ]


def flow_indexes() -> list[str]:
    return [
        f"CREATE INDEX IF NOT EXISTS {FLOWS}_queue ON {FLOWS}"
        f" (plan, queue_key, priority, turn, seq) WHERE state = '{QUEUED}' AND due = 1",
        f"CREATE INDEX IF NOT EXISTS {FLOWS}_queue_turns ON {FLOWS}"
        f" (plan, queue_key, turn) WHERE state = '{QUEUED}'",
        f"CREATE INDEX IF NOT EXISTS {FLOWS}_delayed ON {FLOWS}"
        f" (plan, not_before) WHERE state = '{QUEUED}' AND due = 0",
    ]


@final
@attrs.frozen
class Admitted:
    """A queued flow that an admission moved to `state` (held by the admission's engine), at
    `revision`, with its key (None for a plan without a key function)."""

    flow_id: str
    key: str | None
    state: str
    revision: int


def register(tx: Tx, plan: str, limits: Limits) -> None:
    """The plan's budget row, made if missing (counts 0), with `limits` as stored
    (`Limits.stored`: what an operator reads; every call is given the limits it admits by)."""
    text = json.dumps(limits.stored(), sort_keys=True)
    tx.execute(
        f"INSERT INTO {BUDGETS} (plan, active, seq, turn, in_window, limits)"
        " VALUES (?, 0, 0, 0, 0, ?) ON CONFLICT (plan) DO UPDATE SET limits = excluded.limits",
        (plan, text),
    )


def limits_of(tx: Tx, plan: str) -> Limits:
    """The limits the plan's budget row holds (`register`'s, as `Limits.stored` gave them: the
    key function a stand-in, `_limits.from_stored`). `ValueError` if it has no budget row."""
    rows = tx.execute(f"SELECT limits FROM {BUDGETS} WHERE plan = ?", (plan,))
    if not rows:
        raise ValueError(f"plan {plan!r} has no budget row: register it with its limits first")
    return _limits.from_stored(json.loads(rows[0][0]))


def limits_or_time(tx: Tx, plan: str) -> Limits:
    """`limits_of`, for a start that enqueues: a plan with no budget row (no version with
    limits) is given one that limits nothing (`_limits.ONLY_TIME`: its queue keeps a delayed
    start's time, docs/adr/0180), in this transaction. An engine with limits for the plan
    replaces them at its open (`register`)."""
    rows = tx.execute(f"SELECT limits FROM {BUDGETS} WHERE plan = ?", (plan,))
    if rows:
        return _limits.from_stored(json.loads(rows[0][0]))
    text = json.dumps(_limits.ONLY_TIME.stored(), sort_keys=True)
    tx.execute(
        f"INSERT INTO {BUDGETS} (plan, active, seq, turn, in_window, limits)"
        " VALUES (?, 0, 0, 0, 0, ?) ON CONFLICT (plan) DO NOTHING",
        (plan, text),
    )
    return limits_of(tx, plan)


def budget_plans(tx: Tx) -> list[str]:
    """The plans with a budget row (a queue), in plan order."""
    return [str(r[0]) for r in tx.execute(f"SELECT plan FROM {BUDGETS} ORDER BY plan")]


def registered(tx: Tx) -> dict[str, Limits]:
    """Every limited plan of the store and the limits its budget row holds, by plan."""
    rows = tx.execute(f"SELECT plan, limits FROM {BUDGETS} ORDER BY plan")
    return {str(p): _limits.from_stored(json.loads(t)) for p, t in rows}


def _key_of(limits: Limits, key: str) -> str | None:
    """The rule's key of a stored queue key (None: the plan has no key function)."""
    return None if limits.key is None else key


def _head(tx: Tx, plan: str, key: str) -> tuple[int, int, int] | None:
    """The key's first due queued flow in `_admission.order` (its queue index's first entry)."""
    rows = tx.execute(
        f"SELECT priority, turn, seq FROM {FLOWS} WHERE plan = ? AND queue_key = ?"
        f" AND state = '{QUEUED}' AND due = 1 ORDER BY priority, turn, seq LIMIT 1",
        (plan, key),
    )
    return None if not rows else (int(rows[0][0]), int(rows[0][1]), int(rows[0][2]))


def _last_turn(tx: Tx, plan: str, key: str) -> int | None:
    rows = tx.execute(
        f"SELECT MAX(turn) FROM {FLOWS} WHERE plan = ? AND queue_key = ? AND state = '{QUEUED}'",
        (plan, key),
    )
    return None if not rows or rows[0][0] is None else int(rows[0][0])


def _key_counts(tx: Tx, plan: str, key: str) -> tuple[int, int] | None:
    rows = tx.execute(
        f"SELECT active, queued FROM {KEYS} WHERE plan = ? AND queue_key = ?", (plan, key)
    )
    return None if not rows else (int(rows[0][0]), int(rows[0][1]))


def _write_key(tx: Tx, limits: Limits, plan: str, key: str, active: int, queued: int) -> None:
    """The key row with these counts and its head looked up again; deleted when both are 0."""
    if active < 0 or queued < 0:
        raise BudgetError(f"plan {plan!r} key {key!r}: {active} active, {queued} queued")
    if active == 0 and queued == 0:
        tx.execute(f"DELETE FROM {KEYS} WHERE plan = ? AND queue_key = ?", (plan, key))
        return
    head = _head(tx, plan, key) if queued else None
    room = limits.per_key is None or active < limits.per_key
    p, t, s = head if head is not None else (None, None, None)
    tx.execute(
        f"INSERT INTO {KEYS} (plan, queue_key, active, queued, head_priority, head_turn,"
        " head_seq, open) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (plan, queue_key) DO UPDATE"
        " SET active = excluded.active, queued = excluded.queued,"
        " head_priority = excluded.head_priority, head_turn = excluded.head_turn,"
        " head_seq = excluded.head_seq, open = excluded.open",
        (plan, key, active, queued, p, t, s, int(head is not None and room)),
    )


def _room(limits: Limits, b: Budget) -> bool:
    """Room under the plan's own limits (`_admission.first_by_heads`'s first two checks)."""
    if limits.concurrency is not None and b.active >= limits.concurrency:
        return False
    return limits.rate is None or b.in_window < limits.rate.count


def _prune(tx: Tx, limits: Limits, plan: str, b: Budget, now: float) -> Budget:
    """`b` with the admissions that left the window by `now` deleted (`_admission.prune`:
    kept are those at ``t > now - per``); each is deleted once, so amortised O(1)."""
    if limits.rate is None or b.in_window == 0:
        return b
    gone = tx.execute(
        f"DELETE FROM {ADMISSIONS} WHERE plan = ? AND at <= ? RETURNING 1",
        (plan, now - limits.rate.per),
    )
    return attrs.evolve(b, in_window=b.in_window - len(gone))


def _admit(
    tx: Tx, d: _dialect.Dialect, limits: Limits, plan: str, b: Budget, now: float, owner: str
) -> tuple[list[Admitted], Budget]:
    """While the plan has room: the first open key's head, unless another transaction holds
    its row (then that key is passed over in this call), written active."""
    b = _prune(tx, limits, plan, b, now)
    taken: list[Admitted] = []
    passed: list[str] = []
    while _room(limits, b):
        rows = tx.execute(
            f"SELECT queue_key, head_priority, head_turn, head_seq, active, queued FROM {KEYS}"
            " WHERE plan = ? AND open = 1 ORDER BY head_priority, head_turn, head_seq LIMIT ?",
            (plan, len(passed) + 1),
        )
        row = next((r for r in rows if r[0] not in passed), None)
        if row is None:
            break
        key, priority, turn, seq, active, queued = row
        flow = tx.execute(
            f"SELECT flow_id, blocked_from, revision FROM {FLOWS} WHERE plan = ? AND queue_key = ?"
            f" AND state = '{QUEUED}' AND due = 1 AND priority = ? AND turn = ? AND seq = ?"
            f"{d.skip_locked}",
            (plan, key, priority, turn, seq),
        )
        if not flow:
            passed.append(key)
            continue
        flow_id, blocked_from, revision = flow[0]
        # A resumed flow goes back to the state it was blocked in (ADR 0141), else it starts.
        state = blocked_from if _holds(blocked_from) else "RUNNING"
        revision = int(revision) + 1
        tx.execute(
            f"UPDATE {FLOWS} SET state = ?, blocked_from = NULL, owner = ?, lease_until = NULL,"
            " revision = ?, updated_at = ? WHERE flow_id = ?",
            (state, owner or None, revision, now, flow_id),
        )
        tx.execute(ADMITTED, (flow_id, revision, now, admitted_detail(owner, state)))
        _write_key(tx, limits, plan, key, int(active) + 1, int(queued) - 1)
        window = b.in_window
        if limits.rate is not None:
            # Never before the window's last time: engines' clocks cannot widen the window.
            last = tx.execute(f"SELECT MAX(at) FROM {ADMISSIONS} WHERE plan = ?", (plan,))
            at = now if last[0][0] is None else max(now, float(last[0][0]))
            tx.execute(f"INSERT INTO {ADMISSIONS} (plan, at) VALUES (?, ?)", (plan, at))
            window += 1
        b = Budget(b.active + 1, b.seq, max(b.turn, int(turn)), window)
        taken.append(Admitted(flow_id, _key_of(limits, key), state, revision))
    return taken, b


def admit(
    tx: Tx, plan: str, limits: Limits, now: float, owner: str, budgets: Budgets | None = None
) -> list[Admitted]:
    """Admit what the plan has room for now (at open, on a notification, after a lapse): the
    admitted flows, in order, held by `owner` ('' for none: an operator's engine). With
    `budgets`, the budget row is its (and written by its `write`), here and below."""
    d = _dialect.of(tx)
    b = get(tx, d, plan, budgets)
    taken, after = _admit(tx, d, limits, plan, b, now, owner)
    put(tx, plan, b, after, budgets)
    return taken


def enqueue(
    tx: Tx,
    plan: str,
    limits: Limits,
    flow_id: str,
    options: StartOptions,
    now: float,
    owner: str,
    budgets: Budgets | None = None,
) -> list[Admitted]:
    """Queue the flow `flow_id`, whose row the caller has just written in state ``QUEUED``
    (a start, or a resume: a resumed flow keeps its ``blocked_from``), with its checked start
    `options`, and admit what may go now (it, perhaps). `ValueError` if the row is not a queued
    flow of `plan` or its key does not fit the limits."""
    if (options.key is None) != (limits.key is None):
        raise ValueError(
            f"plan {plan!r}: a start's key {options.key!r} does not fit limits whose key"
            f" function is {'set' if limits.key else 'not set'}"
        )
    d = _dialect.of(tx)
    read = get(tx, d, plan, budgets)
    key = NO_KEY if options.key is None else options.key
    last = None if limits.key is None else _last_turn(tx, plan, key)
    turn = read.turn if last is None else max(read.turn, last + 1)
    due = options.not_before is None or options.not_before <= now
    b = attrs.evolve(read, seq=read.seq + 1)
    counts = _key_counts(tx, plan, key) or (0, 0)
    straight = due and _straight_in(
        tx, limits, plan, key, counts, b, flow_id, options, turn, now, owner
    )
    if isinstance(straight, Admitted):
        put(tx, plan, read, attrs.evolve(b, active=b.active + 1, turn=max(b.turn, turn)), budgets)
        return [straight]
    written = tx.execute(
        f"UPDATE {FLOWS} SET queue_key = ?, priority = ?, turn = ?, seq = ?, not_before = ?,"
        f" due = ? WHERE flow_id = ? AND plan = ? AND state = '{QUEUED}' AND seq IS NULL"
        " RETURNING flow_id",
        (key, options.priority, turn, b.seq, options.not_before, int(due), flow_id, plan),
    )
    if not written:
        raise ValueError(f"flow {flow_id!r} is not a flow of plan {plan!r} written QUEUED")
    active, queued = counts
    _write_key(tx, limits, plan, key, active, queued + 1)
    taken, b = _admit(tx, d, limits, plan, b, now, owner)
    put(tx, plan, read, b, budgets)
    return taken


def _straight_in(
    tx: Tx,
    limits: Limits,
    plan: str,
    key: str,
    counts: tuple[int, int],
    b: Budget,
    flow_id: str,
    options: StartOptions,
    turn: int,
    now: float,
    owner: str,
) -> Admitted | None:
    """A due start admitted as it is queued, if nothing stands before it (its key has nobody
    queued and room, the plan room and no open key; no rate): what `enqueue` then `_admit`
    would write, in fewer statements. None (nothing written) if anything stands before it."""
    active, queued = counts
    if (
        queued
        or limits.rate is not None
        or (limits.per_key is not None and active >= limits.per_key)
    ):
        return None
    if not _room(limits, b) or any_open(tx, plan):
        return None
    rows = tx.execute(
        STRAIGHT_IN + " RETURNING revision",
        (key, options.priority, turn, b.seq, options.not_before, owner or None, now, flow_id, plan),
    )
    if not rows:
        return None
    revision = int(rows[0][0])
    tx.execute(ADMITTED, (flow_id, revision, now, admitted_detail(owner, "RUNNING")))
    _write_key(tx, limits, plan, key, active + 1, 0)
    return Admitted(flow_id, _key_of(limits, key), "RUNNING", revision)


def _leave(tx: Tx, plan: str, flow_id: str) -> tuple[str, str]:
    """Clear the flow's claim on its plan's counters (its `seq`): its key and state."""
    rows = tx.execute(
        f"UPDATE {FLOWS} SET seq = NULL WHERE flow_id = ? AND plan = ? AND seq IS NOT NULL"
        " RETURNING queue_key, state",
        (flow_id, plan),
    )
    if not rows:
        raise BudgetError(f"flow {flow_id!r} of plan {plan!r} holds nothing of its budget")
    return str(rows[0][0]), str(rows[0][1])


def release(
    tx: Tx,
    plan: str,
    limits: Limits,
    flow_id: str,
    now: float,
    owner: str,
    budgets: Budgets | None = None,
) -> list[Admitted]:
    """Give back the slot of `flow_id`, which the caller has just written out of its slot
    state (ended, blocked), and admit the next queued flows in this transaction (held by
    `owner`). `BudgetError` if it holds none (never admitted, still active, released before)."""
    d = _dialect.of(tx)
    key, state = _leave(tx, plan, flow_id)
    if _holds(state) or state == QUEUED:
        raise BudgetError(f"flow {flow_id!r} is {state}: it gives back no slot")
    read = get(tx, d, plan, budgets)
    counts = _key_counts(tx, plan, key)
    if counts is None or counts[0] < 1 or read.active < 1:
        raise BudgetError(f"flow {flow_id!r} of plan {plan!r}: a slot released while none is held")
    _write_key(tx, limits, plan, key, counts[0] - 1, counts[1])
    taken, b = _admit(tx, d, limits, plan, attrs.evolve(read, active=read.active - 1), now, owner)
    put(tx, plan, read, b, budgets)
    return taken


def unqueue(
    tx: Tx,
    plan: str,
    limits: Limits,
    flow_id: str,
    now: float,
    owner: str,
    budgets: Budgets | None = None,
) -> list[Admitted]:
    """Take `flow_id` out of the queue: the caller has just written it out of ``QUEUED``
    without admitting it (a cancel: it ends ``FAILED``); admit what its leaving lets go (a head
    locked by its own transaction may have held its key back). `BudgetError` if not queued."""
    d = _dialect.of(tx)
    key, state = _leave(tx, plan, flow_id)
    if _holds(state) or state == QUEUED:
        raise BudgetError(f"flow {flow_id!r} is {state}: unqueue it once it has left the queue")
    b = get(tx, d, plan, budgets)
    counts = _key_counts(tx, plan, key)
    if counts is None or counts[1] < 1:
        raise BudgetError(f"flow {flow_id!r} of plan {plan!r}: unqueued while none is queued")
    _write_key(tx, limits, plan, key, counts[0], counts[1] - 1)
    taken, after = _admit(tx, d, limits, plan, b, now, owner)
    put(tx, plan, b, after, budgets)
    return taken


def came_due(tx: Tx, plan: str, limits: Limits, now: float, owner: str) -> list[Admitted]:
    """The timer's transaction: the delayed flows whose ``not_before`` has passed become due
    (their rows locked first, in flow id order, then the budget row), and what may go is
    admitted."""
    d = _dialect.of(tx)
    rows = tx.execute(
        f"SELECT flow_id, queue_key FROM {FLOWS} WHERE plan = ? AND state = '{QUEUED}'"
        f" AND due = 0 AND not_before <= ? ORDER BY flow_id{d.for_update}",
        (plan, now),
    )
    b = lock(tx, d, plan)
    ids = [r[0] for r in rows]
    for lo in range(0, len(ids), 500):
        part = ids[lo : lo + 500]
        tx.execute(
            f"UPDATE {FLOWS} SET due = 1 WHERE {d.in_list('flow_id', len(part))}",
            d.list_params(part),
        )
    for key in sorted({str(r[1]) for r in rows}):
        counts = _key_counts(tx, plan, key)
        if counts is None:
            raise BudgetError(f"plan {plan!r}: queued flows of key {key!r} with no key row")
        _write_key(tx, limits, plan, key, *counts)
    taken, after = _admit(tx, d, limits, plan, b, now, owner)
    if after != b:
        write_one(tx, plan, after)
    return taken


def _window(tx: Tx, limits: Limits, plan: str, now: float) -> tuple[float, ...]:
    if limits.rate is None:
        return ()
    rows = tx.execute(
        f"SELECT at FROM {ADMISSIONS} WHERE plan = ? AND at > ? ORDER BY at",
        (plan, now - limits.rate.per),
    )
    return tuple(float(r[0]) for r in rows)


def waits_for(tx: Tx, plan: str, limits: Limits, flow_id: str, now: float) -> str | None:
    """Why the queued flow `flow_id` waits at `now` (`_admission.waits_for`: ``"time"``,
    ``"concurrency"``, ``"per_key"``, ``"rate"``), or None (nothing holds it but the flows
    ahead of it, or it is not queued). A read: nothing locked."""
    rows = tx.execute(
        f"SELECT queue_key, not_before, state FROM {FLOWS} WHERE flow_id = ? AND plan = ?",
        (flow_id, plan),
    )
    if not rows or rows[0][2] != QUEUED or rows[0][0] is None:
        return None
    key, not_before = str(rows[0][0]), rows[0][1]
    budget = tx.execute(f"SELECT active FROM {BUDGETS} WHERE plan = ?", (plan,))
    counts = _key_counts(tx, plan, key)
    of_key = 0 if counts is None else counts[0]
    rule_key = _key_of(limits, key)
    usage = Usage(
        active=int(budget[0][0]) if budget else 0,
        keys=((key, of_key),) if rule_key is not None and of_key else (),
        window=_window(tx, limits, plan, now),
    )
    waiting = Waiting(flow_id, 0, rule_key, not_before=not_before)
    return _admission.waits_for(limits, usage, waiting, now)


def next_wake(tx: Tx, plan: str, limits: Limits, now: float) -> float | None:
    """When time alone may let a queued flow of `plan` go (`_admission.next_wake`): the first
    ``not_before`` of a flow not yet due (at or before `now`: the timer is late, fire at once),
    or, the rate's window full, when its oldest admission leaves it; None if only a slot given
    back can (or nothing is queued). A read: nothing locked."""
    queued = tx.execute(
        f"SELECT 1 FROM {FLOWS} WHERE plan = ? AND state = '{QUEUED}' LIMIT 1", (plan,)
    )
    if not queued:
        return None
    times: list[float] = []
    delayed = tx.execute(
        f"SELECT MIN(not_before) FROM {FLOWS} WHERE plan = ? AND state = '{QUEUED}' AND due = 0",
        (plan,),
    )
    if delayed and delayed[0][0] is not None:
        times.append(float(delayed[0][0]))
    rate = limits.rate
    if rate is not None:
        window = _window(tx, limits, plan, now)
        if len(window) >= rate.count:
            times.append(window[len(window) - rate.count] + rate.per)
    return min(times, default=None)


def usage(tx: Tx, plan: str) -> tuple[Usage, int]:
    """The plan's counters as the rule's `Usage` (every key, the whole window) and its queued
    count, for checks and operators (O(keys + window)). A read."""
    budget = tx.execute(f"SELECT active, turn FROM {BUDGETS} WHERE plan = ?", (plan,))
    if not budget:
        return _admission.EMPTY, 0
    keys = tx.execute(
        f"SELECT queue_key, active, queued FROM {KEYS} WHERE plan = ? ORDER BY queue_key",
        (plan,),
    )
    times = tx.execute(f"SELECT at FROM {ADMISSIONS} WHERE plan = ? ORDER BY at", (plan,))
    counted = tuple((str(k), int(a)) for k, a, _q in keys if a and k != NO_KEY)
    return (
        Usage(int(budget[0][0]), counted, tuple(float(t[0]) for t in times), int(budget[0][1])),
        sum(int(q) for _k, _a, q in keys),
    )


def recount(tx: Tx, plan: str) -> dict[str, Any]:
    """The plan's active and queued flows counted from the flows' own states (what `usage`'s
    counters must equal: the check of ADR 0141), per key too. O(the plan's flows)."""
    slot = ", ".join(f"'{s.value}'" for s in sorted(_admission.SLOT_STATES, key=str))
    holds = f"state IN ({slot})"
    rows: Sequence[tuple[Any, ...]] = tx.execute(
        f"SELECT queue_key, {holds}, COUNT(*) FROM {FLOWS} WHERE plan = ? AND seq IS NOT NULL"
        f" AND ({holds} OR state = '{QUEUED}') GROUP BY queue_key, {holds}",
        (plan,),
    )
    active: dict[str, int] = {}
    queued: dict[str, int] = {}
    for key, holds, n in rows:
        into = active if holds else queued
        into[str(key)] = into.get(str(key), 0) + int(n)
    return {"active": active, "queued": queued}
