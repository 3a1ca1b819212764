"""Protocols with one planted bug each: the model check must catch every one of them."""

from __future__ import annotations

import math
from typing import Any

import attrs

from ferry import _lanes as core
from ferry._lanes import Admission, Batch, Item, Lanes
from tests.model.checker import Protocol


class EarlyDirectRelease(Protocol):
    """(1) A direct call's key is released when the call starts, not when it ends."""

    release_direct_at_start = True


class RetakeBusy(Protocol):
    """(2) `take` forgets the per-key guard: a busy lane stays queued and is taken again."""

    def take(
        self, state: Lanes[Any, Any], now: float
    ) -> tuple[Lanes[Any, Any], Batch[Any, Any] | None]:
        limits = state.limits
        unguarded = attrs.evolve(limits, one_in_flight=False)
        room, batch = core.take(core._evolve(state, {"limits": unguarded}), now)
        return core._evolve(room, {"limits": limits}), batch


class SplitAdmission(Protocol):
    """(3) Admission is not atomic with close: look at `closed`, then insert in another step."""

    split_admission = True


class ClaimIgnoresTheBound(Protocol):
    """(4) Admission claims an idle key for a direct call however many calls are in flight."""

    def admit(
        self, state: Lanes[Any, Any], key: str, i: int, weight: float, rank: Any, now: float
    ) -> tuple[Lanes[Any, Any], Admission, Item[Any] | None]:
        limits = state.limits
        unbounded = core._evolve(state, {"limits": attrs.evolve(limits, max_in_flight=math.inf)})
        room, outcome, item = core.admit(unbounded, key, i, weight=weight, rank=rank, now=now)
        return core._evolve(room, {"limits": limits}), outcome, item
