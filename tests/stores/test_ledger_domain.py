"""The ledger domain: pure decisions, and the oracle `verify` catching planted corruption."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from examples import ledger_domain as ledger
from examples.ledger_domain import deposit, transfer, withdraw
from ferry.projected import Decision, Posting, ProjectedWrite, SqliteStore, Tx


def test_decide_is_pure_and_refuses_overdrafts() -> None:
    state = {"balance": 10}
    refused = ledger.decide(state, ledger.op_content(withdraw("w", "A", 11)))
    assert refused == Decision(
        {"ok": False, "reason": "insufficient funds", "balance": 10}, {"balance": 10}
    )
    moved = ledger.decide(state, ledger.op_content(transfer("t", "A", "B", 4)))
    assert moved == Decision(
        {"ok": True, "balance": 6}, {"balance": 6}, (Posting("B", {"amount": 4, "from": "A"}),)
    )
    assert state == {"balance": 10}
    assert ledger.receive({"balance": 1}, {"amount": 2, "from": "A"}).state == {"balance": 3}


def test_amount_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        deposit("d", "A", 0)


async def populated(tmp_path: Path) -> ProjectedWrite[ledger.Op]:
    pw = ledger.make_write(SqliteStore(tmp_path / "l.db", synchronous="OFF"))
    await pw("A", [deposit("d1", "A", 100), transfer("t1", "A", "B", 30)])
    await pw("B", [withdraw("w1", "B", 10)])
    await pw("A", [transfer("t2", "A", "C", 5)])
    assert await ledger.verify(pw) == []
    return pw


def sql(statement: str) -> Callable[[Tx], None]:
    def run(tx: Tx) -> None:
        tx.execute(statement)

    return run


PLANTED = {
    "view balance": "UPDATE ledger_balances SET balance = balance + 1 WHERE account = 'A'",
    "seq gap": "UPDATE ferry_journal SET seq = 7 WHERE rid = 't2'",
    "stored answer": 'UPDATE ferry_journal SET answer = \'{"ok":true,"balance":1}\''
    " WHERE rid = 'd1'",
    "stored state": "UPDATE ferry_keys SET state = '{\"balance\":0}' WHERE key = 'A'",
    "lost posting": "DELETE FROM ferry_inbox WHERE posting_id = 't2/0'",
    "double ingest": "UPDATE ferry_inbox SET ingested = 0 WHERE posting_id = 't1/0'",
    "projected offset": "UPDATE ferry_keys SET projected_seq = 1 WHERE key = 'B'",
    "lost record": "DELETE FROM ferry_journal WHERE rid = 'w1'",
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
async def test_verify_catches_planted_corruption(tmp_path: Path, bug: str) -> None:
    pw = await populated(tmp_path)
    await pw.store.transact(sql(PLANTED[bug]))
    assert await ledger.verify(pw) != []
    await pw.store.aclose()


async def test_verify_catches_a_projection_that_applies_twice(tmp_path: Path) -> None:
    def twice(view: Tx, key: str, records: object) -> None:
        ledger.project(view, key, records)  # type: ignore[arg-type]
        ledger.project(view, key, records)  # type: ignore[arg-type]

    pw = ledger.make_write(SqliteStore(tmp_path / "l.db"), project=twice)
    await pw("A", [deposit("d1", "A", 5)])
    assert await ledger.verify(pw) != []
    await pw.store.aclose()
