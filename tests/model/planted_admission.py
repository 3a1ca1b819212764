"""Admission protocols with one planted bug each: the admission model check must catch each."""

from __future__ import annotations

from typing import Any

from ferry.flow._model import _admission as adm
from ferry.flow._model._admission import Usage
from ferry.flow._model._limits import Limits
from ferry.flow._model._types import State
from tests.model.admission import AdmissionProtocol


class BlockKeepsItsSlot(AdmissionProtocol):
    """(1) A slot not given back on one path: the write that blocks a flow keeps its slot (its
    release written per path, and this path forgot it); the resume takes one more."""

    def apply(
        self, limits: Limits, usage: Usage, key: str | None, before: Any, after: Any, now: float
    ) -> Usage:
        if after is State.BLOCKED:
            return usage
        return super().apply(limits, usage, key, before, after, now)


class AdmissionFromACopy(AdmissionProtocol):
    """(2) Two engines admit into one slot: each admission reads the budget without holding
    the plan's budget row, picks queued flows skipping the rows another admission has locked
    (``FOR UPDATE SKIP LOCKED`` alone), and writes the budget from its copy."""

    admission_from_a_copy = True


class CompensationEndAdmitsNothing(AdmissionProtocol):
    """(3) A queued flow never admitted while a slot is free: the end of a cancelled flow's
    compensation gives its slot back but does not admit in its transaction, and nothing else
    will (no poll: a slot given back is the only wake)."""

    def admits_after(self, before: Any, after: Any) -> bool:
        if before is State.COMPENSATING and after is State.FAILED:
            return False
        return super().admits_after(before, after)


class ParkGivesItsSlotBack(AdmissionProtocol):
    """(4) The rule's idea of a slot is wrong: a parked flow gives its slot back (per-key limits
    would no longer serialise whole flows), and the wake takes one again."""

    def apply(
        self, limits: Limits, usage: Usage, key: str | None, before: Any, after: Any, now: float
    ) -> Usage:
        def held(state: Any) -> bool:
            return state in (State.RUNNING, State.COMPENSATING)

        change = int(held(after)) - int(held(before))
        if change > 0:
            return adm.take(limits, usage, key, now)
        if change < 0:
            return adm.release(usage, key)
        return usage


class LockedRowNotifiesNothing(AdmissionProtocol):
    """(5) A transaction that locked a queued flow's row (a wake for it) commits without the
    plan's notification: an admission that skipped the row meanwhile was the only one."""

    notifies_after_a_lock = False


class NoScanAfterALapse(AdmissionProtocol):
    """(6) An engine's lapse wakes no admission: its transaction that locked a queued flow's row
    rolled back, sending nothing, and the admission that skipped the row was the only one."""

    scans_after_a_lapse = False
