"""Two "processes" (two ProjectedWrite instances, each with its own store and cache) write one key
alternately. With fencing, every stale cache is caught and the retry is safe; without it (the
test-only switch), stale caches produce wrong data that the ledger oracle finds."""

from __future__ import annotations

from typing import Any

from examples import ledger_domain as ledger
from examples.ledger_domain import deposit, withdraw
from ferry.projected import FenceConflict

from .conftest import StoreFactory


async def alternate(make_store: StoreFactory, *, fencing: bool) -> tuple[int, list[str], list[Any]]:
    procs = [ledger.make_write(make_store(), fencing=fencing) for _ in range(2)]
    await procs[0]("A", [deposit("d0", "A", 100)])
    conflicts = 0
    answers = []
    for i in range(10):
        pw = procs[i % 2]
        batch = [withdraw(f"w{i}", "A", 15)]
        try:
            answers += await pw("A", batch)
        except FenceConflict:
            conflicts += 1
            answers += await pw("A", batch)  # the client's retry, same id and content
    return conflicts, await ledger.verify(procs[0]), answers


async def test_with_fencing_stale_writers_fail_and_retries_succeed(
    make_store: StoreFactory,
) -> None:
    conflicts, problems, answers = await alternate(make_store, fencing=True)
    assert problems == []
    assert conflicts == 8  # every switch after both processes have seen the key
    assert [a["ok"] for a in answers] == [True] * 6 + [False] * 4
    assert answers[5]["balance"] == 10


async def test_without_fencing_the_oracle_finds_wrong_data(make_store: StoreFactory) -> None:
    conflicts, problems, answers = await alternate(make_store, fencing=False)
    assert conflicts == 0
    assert [a["ok"] for a in answers].count(True) > 6  # money spent twice
    text = "\n".join(problems)
    assert "seqs not" in text and "duplicates" in text
    assert "replay decides" in text
