"""The oracle's client-side checks: acknowledged inputs in the journal exactly once with the
answer the client got, and a fully caught-up view; each catches a planted fault."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from examples import ledger_domain as ledger
from examples.ledger_domain import deposit, transfer, withdraw
from ferry.projected import ProjectedWrite, SqliteStore, Tx


async def journal(tmp_path: Path) -> tuple[ProjectedWrite[ledger.Op], dict[str, Any]]:
    pw = ledger.make_write(SqliteStore(tmp_path / "l.db", synchronous="OFF"))
    ops = [deposit("d1", "A", 100), transfer("t1", "A", "B", 30), withdraw("w1", "A", 500)]
    answers = await pw("A", ops)
    acked = {op.id: (op, answer) for op, answer in zip(ops, answers, strict=True)}
    await pw.sweep()
    assert await ledger.verify(pw, acknowledged=acked, caught_up=True) == []
    return pw, acked


def sql(statement: str) -> Any:
    def run(tx: Tx) -> None:
        tx.execute(statement)

    return run


async def test_an_acknowledged_input_missing_from_the_journal_is_found(tmp_path: Path) -> None:
    pw, acked = await journal(tmp_path)
    acked["ghost"] = (deposit("ghost", "A", 1), {"ok": True, "balance": 1})
    problems = await ledger.verify(pw, acknowledged=acked)
    assert problems == [
        "input 'ghost': acknowledged with {'ok': True, 'balance': 1}, not in the journal"
    ]
    await pw.store.aclose()


async def test_a_client_told_another_answer_is_found(tmp_path: Path) -> None:
    pw, acked = await journal(tmp_path)
    op, _ = acked["w1"]
    acked["w1"] = (op, {"ok": True, "balance": 0})
    problems = await ledger.verify(pw, acknowledged=acked)
    assert len(problems) == 1 and "client was told" in problems[0]
    await pw.store.aclose()


async def test_other_content_under_an_acknowledged_id_is_found(tmp_path: Path) -> None:
    pw, acked = await journal(tmp_path)
    _, answer = acked["d1"]
    acked["d1"] = (deposit("d1", "A", 99), answer)
    problems = await ledger.verify(pw, acknowledged=acked)
    assert len(problems) == 1 and "journal holds" in problems[0]
    await pw.store.aclose()


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        ("UPDATE ferry_keys SET projected_seq = 1 WHERE key = 'A'", "projected to seq 1 of 3"),
        ("UPDATE ferry_inbox SET ingested = 0", "not ingested"),
    ],
)
async def test_a_view_left_behind_is_found(tmp_path: Path, statement: str, expected: str) -> None:
    pw, acked = await journal(tmp_path)
    await pw.store.transact(sql(statement))
    problems = await ledger.verify(pw, acknowledged=acked, caught_up=True)
    assert any(expected in p for p in problems), problems
    await pw.store.aclose()


async def test_an_input_journaled_twice_is_found(tmp_path: Path) -> None:
    # The journal's primary key forbids a second record with one id, so the double is planted in
    # the snapshot the check reads: the check must count records per id across all keys.
    pw, acked = await journal(tmp_path)
    snap = await pw.snapshot()
    record = snap.records["A"][0]
    snap.records.setdefault("B", []).append(record)
    problems = ledger.check_acknowledged(snap, acked)
    assert problems == [f"input {record.id!r}: 2 journal records (keys/seqs [('A', 1), ('A', 1)])"]
    await pw.store.aclose()
