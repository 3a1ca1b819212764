"""Checked by mypy (`make lint`), not run: a user's `await f(x)` gets the right result type."""

from __future__ import annotations

from typing import assert_type

import ferry


async def lookup(ids: list[int]) -> list[str]:
    return [str(i) for i in ids]


async def lookup_by_key(key: str, ids: list[int]) -> list[bytes]:
    return [b"" for _ in ids]


async def scores(ids: list[int]) -> dict[int, float]:
    return {i: 0.5 for i in ids}


def pick(out: dict[int, float], x: int) -> float:
    return out[x]


async def users_of_plain_ferry() -> None:
    async with ferry.open_ferry(lookup, max_batch_size=10) as f:
        assert_type(f, ferry.Ferry[int, str])
        assert_type(await f(1), str)
    async with ferry.open_ferry(scores, extract=pick) as g:
        assert_type(await g(2), float)


async def users_of_per_key_ferry() -> None:
    async with ferry.open_per_key_ferry(lookup_by_key, key=lambda x: str(x % 3)) as f:
        assert_type(f, ferry.PerKeyFerry[int, bytes])
        assert_type(await f(1), bytes)
        assert_type(f.statistics(), ferry.FerryStatistics)
