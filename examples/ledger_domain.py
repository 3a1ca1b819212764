"""A small ledger on `ferry.projected.ProjectedWrite`: accounts, deposits, withdrawals, transfers.

Keyed by the account an operation debits (a transfer A -> B is a write to A). A withdrawal or a
transfer above the balance is refused on its merits: the refusal is the stored answer, returned
again on every retry. A transfer's credit reaches B as a posting, ingested by B's next journal
transaction (or a sweep); from then on it is spendable.

The view is one table, ``ledger_balances(account, balance, applied)``: `applied` counts the
records projected into the row, so `verify` can compare the row with the fold of exactly that
journal prefix. `verify` is the oracle the demo and the fleet test reuse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from ferry.projected import (
    Decision,
    JournalSnapshot,
    Json,
    Posting,
    ProjectedWrite,
    Record,
    Store,
    Tx,
)

Kind = Literal["deposit", "withdraw", "transfer"]
INITIAL: Json = {"balance": 0}
VIEW = "ledger_balances"


@attrs.frozen
class Op:
    """One ledger operation. `id` is the client's idempotency id."""

    id: str
    kind: Kind
    account: str
    amount: int = attrs.field()
    to: str | None = None

    @amount.validator
    def _positive(self, _: object, value: int) -> None:
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"amount must be a positive int, got {value!r}")


def deposit(id: str, account: str, amount: int) -> Op:
    return Op(id, "deposit", account, amount)


def withdraw(id: str, account: str, amount: int) -> Op:
    return Op(id, "withdraw", account, amount)


def transfer(id: str, source: str, dest: str, amount: int) -> Op:
    return Op(id, "transfer", source, amount, dest)


def op_key(op: Op) -> str:
    return op.account


def op_id(op: Op) -> str:
    return op.id


def op_content(op: Op) -> Json:
    return {"kind": op.kind, "account": op.account, "amount": op.amount, "to": op.to}


def decide(state: Json, content: Json) -> Decision:
    """Pure: the answer and new state for one operation on its account's state."""
    balance: int = state["balance"]
    kind, amount = content["kind"], content["amount"]
    if kind == "deposit":
        return Decision({"ok": True, "balance": balance + amount}, {"balance": balance + amount})
    if amount > balance:
        return Decision({"ok": False, "reason": "insufficient funds", "balance": balance}, state)
    after = {"balance": balance - amount}
    if kind == "withdraw":
        return Decision({"ok": True, "balance": balance - amount}, after)
    credit = Posting(content["to"], {"amount": amount, "from": content["account"]})
    return Decision({"ok": True, "balance": balance - amount}, after, (credit,))


def receive(state: Json, payload: Json) -> Decision:
    """Pure: a credit from a transfer arrives."""
    balance = state["balance"] + payload["amount"]
    return Decision({"credited": payload["amount"], "balance": balance}, {"balance": balance})


def delta(record: Record) -> int:
    """How much a journal record moves its account's balance."""
    if record.kind == "posting":
        amount: int = record.content["amount"]
        return amount
    if not record.answer["ok"]:
        return 0
    sign = 1 if record.content["kind"] == "deposit" else -1
    return sign * int(record.content["amount"])


def setup(view: Tx) -> None:
    view.execute(
        f"CREATE TABLE IF NOT EXISTS {VIEW} ("
        " account TEXT PRIMARY KEY, balance BIGINT NOT NULL, applied BIGINT NOT NULL)"
    )


def project(view: Tx, key: str, records: Sequence[Record]) -> None:
    """Apply records to the account's row: one upsert for the whole run of records."""
    view.execute(
        f"INSERT INTO {VIEW} (account, balance, applied) VALUES (?, ?, ?)"
        f" ON CONFLICT (account) DO UPDATE SET balance = {VIEW}.balance + excluded.balance,"
        f" applied = {VIEW}.applied + excluded.applied",
        (key, sum(delta(r) for r in records), len(records)),
    )


def make_write(store: Store, **options: Any) -> ProjectedWrite[Op]:
    """The ledger's `ProjectedWrite` on `store`; `options` go to its constructor."""
    kwargs: dict[str, Any] = {
        "input_id": op_id,
        "content": op_content,
        "decide": decide,
        "receive": receive,
        "project": project,
        "initial": INITIAL,
        "setup": setup,
        **options,
    }
    return ProjectedWrite(store, **kwargs)


def _read_view(view: Tx) -> dict[str, tuple[int, int]]:
    return {a: (b, n) for a, b, n in view.execute(f"SELECT account, balance, applied FROM {VIEW}")}


async def verify(
    pw: ProjectedWrite[Op],
    *,
    acknowledged: Mapping[str, tuple[Op, Json]] | None = None,
    caught_up: bool = False,
) -> list[str]:
    """The ledger oracle: problems found, empty when everything is exact.

    The journal audit (seqs 1..n per key, stored answers and states equal a replay of `decide`
    and `receive`, postings ingested exactly once), then the view: every account's row equals the
    fold of its journal up to its projected offset; no balance is negative; money is conserved
    (deposits - withdrawals = balances + credits still in the inbox). With `acknowledged`
    (input id -> (op, answer the client got)), also `check_acknowledged`; with `caught_up`
    (after a final `sweep()`), also `check_caught_up`. Reads the store three times: call it
    when nothing else writes.
    """
    problems = await pw.audit()
    snap = await pw.snapshot()
    view = await pw.store.transact(_read_view)
    deposited = 0
    held = 0
    for key, row in snap.keys.items():
        records = snap.records.get(key, [])
        prefix = [r for r in records if r.seq <= row.projected_seq]
        want = (sum(delta(r) for r in prefix), len(prefix))
        got = view.get(key, (0, 0))
        if got != want:
            problems.append(
                f"account {key!r}: view (balance, applied) = {got}, fold of the journal up to"
                f" seq {row.projected_seq} = {want}"
            )
        running = 0
        for r in records:
            running += delta(r)
            if running < 0:
                problems.append(f"account {key!r}: balance {running} after seq {r.seq}")
            if r.kind == "input" and r.content["kind"] == "deposit":
                deposited += delta(r)
            elif r.kind == "input":
                deposited += delta(r) if r.content["kind"] == "withdraw" else 0
        held += row.state["balance"]
    for key in set(view) - set(snap.keys):
        problems.append(f"account {key!r}: a view row but no journal")
    in_flight = sum(p.payload["amount"] for p in snap.inbox.values() if not p.ingested)
    if deposited != held + in_flight:
        problems.append(
            f"money not conserved: deposits - withdrawals = {deposited}, balances {held}"
            f" + credits in flight {in_flight}"
        )
    if acknowledged is not None:
        problems += check_acknowledged(snap, acknowledged)
    if caught_up:
        problems += check_caught_up(snap)
    return problems


def check_acknowledged(
    snap: JournalSnapshot, acknowledged: Mapping[str, tuple[Op, Json]]
) -> list[str]:
    """Every acknowledged input is in the journal exactly once, under its account, with its
    content and with the answer its client was given; no input id is in the journal twice.

    `acknowledged` maps an input id to (the op, the answer the client got: the stored answer or a
    `Committed`'s provisional one). Cost: O(journal + acknowledged).
    """
    problems: list[str] = []
    where: dict[str, list[Record]] = {}
    for records in snap.records.values():
        for r in records:
            if r.kind == "input":
                where.setdefault(r.id, []).append(r)
    for rid, found in where.items():
        if len(found) > 1:
            problems.append(
                f"input {rid!r}: {len(found)} journal records"
                f" (keys/seqs {[(r.key, r.seq) for r in found]})"
            )
    for rid, (op, answer) in acknowledged.items():
        found = where.get(rid, [])
        if not found:
            problems.append(f"input {rid!r}: acknowledged with {answer!r}, not in the journal")
            continue
        r = found[0]
        if r.key != op.account or r.content != op_content(op):
            problems.append(f"input {rid!r}: journal holds {r.key!r} {r.content!r}, sent {op!r}")
        if r.answer != answer:
            problems.append(f"input {rid!r}: client was told {answer!r}, journal says {r.answer!r}")
    return problems


def check_caught_up(snap: JournalSnapshot) -> list[str]:
    """After a final sweep: every key's view is projected to its last record and every posting
    is ingested. O(keys + inbox)."""
    problems = [
        f"account {key!r}: projected to seq {row.projected_seq} of {row.last_seq}"
        for key, row in snap.keys.items()
        if row.projected_seq != row.last_seq
    ]
    problems += [
        f"posting {pid!r}: not ingested" for pid, p in snap.inbox.items() if not p.ingested
    ]
    return problems


__all__ = [
    "INITIAL",
    "VIEW",
    "Op",
    "check_acknowledged",
    "check_caught_up",
    "decide",
    "delta",
    "deposit",
    "make_write",
    "op_content",
    "op_id",
    "op_key",
    "project",
    "receive",
    "setup",
    "transfer",
    "verify",
    "withdraw",
]
