"""The store contract: one suite, run against SQLite and PostgreSQL (`make_store` fixture)."""

from __future__ import annotations

import random

import pytest
import trio

from examples import ledger_domain as ledger
from examples.ledger_domain import deposit, transfer, withdraw
from ferry._errors import Committed, IdReused
from ferry.projected import FenceConflict, ProjectedWrite, ProjectionBlocked

from ._helpers import CancellingStore, SwitchableProjection
from .conftest import StoreFactory


def balance_answer(balance: int) -> dict[str, object]:
    return {"ok": True, "balance": balance}


REFUSED = {"ok": False, "reason": "insufficient funds", "balance": 70}


async def journal_size(pw: ProjectedWrite[ledger.Op]) -> int:
    snap = await pw.snapshot()
    return sum(len(rs) for rs in snap.records.values())


async def test_append_and_project(make_store: StoreFactory) -> None:
    pw = ledger.make_write(make_store())
    answers = await pw(
        "A", [deposit("d1", "A", 100), withdraw("w1", "A", 30), withdraw("w2", "A", 500)]
    )
    assert answers == [balance_answer(100), balance_answer(70), REFUSED]
    assert await ledger.verify(pw) == []
    snap = await pw.snapshot()
    assert [r.seq for r in snap.records["A"]] == [1, 2, 3]
    assert snap.keys["A"].projected_seq == 3
    assert pw.statistics().written == 3


async def test_idempotent_replay_writes_nothing(make_store: StoreFactory) -> None:
    pw = ledger.make_write(make_store())
    batch = [deposit("d1", "A", 100), withdraw("w1", "A", 30)]
    first = await pw("A", batch)
    before = await pw.snapshot()
    # same batch again, a duplicate inside one batch, and a fresh "process" replaying
    assert await pw("A", batch) == first
    assert await pw("A", [batch[1], batch[1]]) == [first[1], first[1]]
    other = ledger.make_write(make_store())
    assert await other("A", batch) == first
    assert await pw.snapshot() == before
    assert pw.statistics().written == 2
    assert pw.statistics().replayed == 4
    assert await ledger.verify(pw) == []


async def test_id_reused_is_a_per_input_error(make_store: StoreFactory) -> None:
    pw = ledger.make_write(make_store())
    await pw("A", [deposit("d1", "A", 100)])
    answers = await pw("A", [deposit("d1", "A", 999), deposit("d2", "A", 5), deposit("d2", "A", 6)])
    assert isinstance(answers[0], IdReused)
    assert "d1" in str(answers[0])
    assert answers[1] == balance_answer(105)
    assert isinstance(answers[2], IdReused)
    # the same id under another key is reused too
    (other,) = await pw("B", [deposit("d1", "B", 100)])
    assert isinstance(other, IdReused)
    assert "'A'" in str(other)
    assert await journal_size(pw) == 2
    assert pw.statistics().id_reused == 3
    assert await ledger.verify(pw) == []


async def test_fence_conflict_fails_the_batch_and_the_retry_is_safe(
    make_store: StoreFactory,
) -> None:
    p1 = ledger.make_write(make_store())
    p2 = ledger.make_write(make_store())
    await p1("A", [deposit("d1", "A", 100)])
    await p2("A", [withdraw("w1", "A", 80)])
    size = await journal_size(p1)
    batch = [withdraw("w2", "A", 50)]
    with pytest.raises(FenceConflict, match="fence conflict on key 'A'"):
        await p1("A", batch)
    assert await journal_size(p1) == size
    assert p1.statistics().fence_conflicts == 1
    # the retry reloads the key: decided on the real balance (20), refused on its merits
    assert await p1("A", batch) == [{"ok": False, "reason": "insufficient funds", "balance": 20}]
    assert await ledger.verify(p1) == []


async def test_a_new_key_created_twice_conflicts(make_store: StoreFactory) -> None:
    p1 = ledger.make_write(make_store())
    p2 = ledger.make_write(make_store())
    await p1("A", [deposit("d1", "A", 1)])
    p1.forget()
    await p2("A", [deposit("d2", "A", 1)])
    assert await p1("A", [deposit("d3", "A", 1)]) == [balance_answer(3)]
    assert await ledger.verify(p1) == []


async def test_catch_up_projects_earlier_records_first(make_store: StoreFactory) -> None:
    proj = SwitchableProjection()
    pw = ledger.make_write(make_store(), project=proj, projection_backoff=0.0)
    proj.broken = RuntimeError("view down")
    first = await pw("A", [deposit("d1", "A", 100), withdraw("w1", "A", 10)])
    assert all(isinstance(a, Committed) for a in first)
    assert [a.provisional for a in first] == [balance_answer(100), balance_answer(90)]
    assert (await pw.snapshot()).keys["A"].projected_seq == 0
    proj.broken = None
    assert await pw("A", [deposit("d2", "A", 1)]) == [balance_answer(91)]
    assert proj.seen == [("A", 1), ("A", 2), ("A", 3)]
    assert await ledger.verify(pw) == []


async def test_row_failure_commits_that_row_and_blocks_later_ones(
    make_store: StoreFactory,
) -> None:
    proj = SwitchableProjection()
    pw = ledger.make_write(make_store(), project=proj)
    proj.bad_amounts = {13}
    answers = await pw(
        "A", [deposit("d1", "A", 100), deposit("d2", "A", 13), deposit("d3", "A", 1)]
    )
    assert answers[0] == balance_answer(100)
    assert isinstance(answers[1], Committed)
    assert answers[1].provisional == balance_answer(113)
    assert isinstance(answers[1].cause, ValueError)
    assert isinstance(answers[2], Committed)
    assert isinstance(answers[2].cause, ProjectionBlocked)
    assert answers[2].cause.__cause__ is answers[1].cause
    # the view holds exactly the projected prefix: the failed call was rolled back
    assert (await pw.snapshot()).keys["A"].projected_seq == 1
    assert await ledger.verify(pw) == []
    proj.bad_amounts = set()
    report = await pw.sweep()
    assert report.records_projected == 2
    assert await ledger.verify(pw) == []


async def test_projection_always_failing_then_sweep(make_store: StoreFactory) -> None:
    proj = SwitchableProjection()
    pw = ledger.make_write(make_store(), project=proj, projection_backoff=0.001)
    cause = RuntimeError("view down")
    proj.broken = cause
    answers = await pw("A", [deposit("d1", "A", 100)])
    assert answers == [Committed(balance_answer(100), cause)]
    assert answers[0].cause is cause
    assert proj.calls == 3  # bounded retries
    assert pw.statistics().projection_attempts_failed == 3
    assert (await pw.sweep()).failed_keys == 1
    proj.broken = None
    report = await pw.sweep()
    assert (report.keys, report.records_projected, report.failed_keys) == (1, 1, 0)
    assert await pw.sweep() == type(report)(0, 0, 0, 0)
    assert await pw("A", [deposit("d1", "A", 100)]) == [balance_answer(100)]
    assert await ledger.verify(pw) == []


async def test_sweeper_task(make_store: StoreFactory) -> None:
    proj = SwitchableProjection()
    pw = ledger.make_write(make_store(), project=proj, projection_attempts=1)
    proj.broken = RuntimeError("view down")
    await pw("A", [deposit("d1", "A", 5)])
    await pw("B", [deposit("d2", "B", 7)])
    proj.broken = None
    async with trio.open_nursery() as nursery:
        await nursery.start(pw.run_sweeper, 0.01)
        for _ in range(1000):
            if (await pw.snapshot()).keys["B"].projected_seq == 1:
                break
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert pw.statistics().sweeps >= 1
    assert (await pw.snapshot()).keys["A"].projected_seq == 1
    assert await ledger.verify(pw) == []


async def test_postings_cross_keys(make_store: StoreFactory) -> None:
    pw = ledger.make_write(make_store())
    await pw("A", [deposit("d1", "A", 100)])
    assert await pw("A", [transfer("t1", "A", "B", 60)]) == [balance_answer(40)]
    # B ingests the credit in its own next journal transaction: spendable at once
    assert await pw("B", [withdraw("w1", "B", 50)]) == [balance_answer(10)]
    # a credit to an idle key is ingested by the sweep
    await pw("A", [transfer("t2", "A", "C", 40)])
    report = await pw.sweep()
    assert report.postings_ingested == 1
    snap = await pw.snapshot()
    assert snap.keys["C"].state == {"balance": 40}
    assert [r.kind for r in snap.records["B"]] == ["posting", "input"]
    # a replayed transfer posts nothing new
    await pw("A", [transfer("t1", "A", "B", 60)])
    assert len((await pw.snapshot()).inbox) == 2
    assert await ledger.verify(pw) == []


@pytest.mark.parametrize("at", range(1, 11))
async def test_cancel_mid_commit_is_all_or_nothing(make_store: StoreFactory, at: int) -> None:
    store = CancellingStore(make_store())
    pw = ledger.make_write(store)
    await pw("A", [deposit("d0", "A", 100)])
    await pw("B", [deposit("d0b", "B", 1)])
    batch = [deposit("d1", "A", 1), transfer("t1", "A", "B", 2), withdraw("w1", "A", 3)]
    with trio.CancelScope() as scope:
        store.arm(at, scope)
        await pw("A", batch)
    store.arm(0, trio.CancelScope())
    snap = await pw.snapshot()
    ids = {r.id for r in snap.records["A"]}
    assert ids in ({"d0"}, {"d0", "d1", "t1", "w1"})
    assert snap.keys["A"].last_seq == len(ids)
    assert len(snap.inbox) == (1 if "t1" in ids else 0)
    assert await ledger.verify(pw) == []
    # the retry is safe whatever happened, and the store is still usable
    assert await pw("A", batch) == [balance_answer(101), balance_answer(99), balance_answer(96)]
    assert await pw("B", []) == []
    assert await ledger.verify(pw) == []


async def test_cancel_at_random_times_is_all_or_nothing(make_store: StoreFactory) -> None:
    pw = ledger.make_write(make_store())
    rnd = random.Random(7)
    outcomes = set()
    for trial in range(12):
        key = f"k{trial}"
        batch = [deposit(f"{key}-{i}", key, i + 1) for i in range(5)]
        with trio.move_on_after(rnd.uniform(0, 0.004)):
            await pw(key, batch)
        snap = await pw.snapshot()
        n = len(snap.records.get(key, []))
        assert n in (0, 5)
        outcomes.add(n)
        await pw(key, batch)
    assert await ledger.verify(pw) == []
