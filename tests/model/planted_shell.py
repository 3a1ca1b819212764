"""Shell protocols with one planted bug each: the shell model check must catch every one."""

from __future__ import annotations

from typing import Any

from ferry import _lanes as core
from ferry._lanes import Lanes
from tests.model.shell import ShellProtocol


class ReleaseForgetsToRing(ShellProtocol):
    """(a) `Room.release` does not ring when the released lane goes back to READY."""

    def release_rings(self, old: Lanes[Any, Any], new: Lanes[Any, Any]) -> bool:
        d_new, d_old = core.next_deadline(new), core.next_deadline(old)
        return d_new is not None and (d_old is None or d_new < d_old)


class AdmitRingsOnlyForReady(ShellProtocol):
    """(b) `Room.admit` rings for a lane that became READY, not for a new earliest deadline."""

    def admit_rings(self, old: Lanes[Any, Any], new: Lanes[Any, Any]) -> bool:
        return new.n_ready > old.n_ready


class BellReadAfterCheckpoint(ShellProtocol):
    """(c) The worker reads the bell after a checkpoint that follows its failed take."""

    peek_without_checkpoint = False


class AbortKeepsInput(ShellProtocol):
    """(d) The caller's abort stops waiting but leaves its input in the room."""

    abort_drops_input = False


class AnswerIgnoresTask(ShellProtocol):
    """(e) A worker answers every entry of its batch, even a caller that stopped waiting."""

    answer_checks_task = False


class CancelledWorkerForgetsCallers(ShellProtocol):
    """(f) A worker cancelled by close releases its lane but does not answer its callers."""

    cancelled_worker_answers = False


class CloseWaitsBeforeCancellingDirectCalls(ShellProtocol):
    """(g) Close waits for `busy == 0` before it cancels the direct calls' scopes."""

    close_cancels_direct_calls = False


class ReleaseIgnoresTheBound(ShellProtocol):
    """(h) A call's end that brings `busy` back under the bound rings only by the old rule (a lane
    became ready, or an earlier deadline): workers the bound held back are never told."""

    def release_rings(self, old: Lanes[Any, Any], new: Lanes[Any, Any]) -> bool:
        if new.n_ready > old.n_ready and new.busy < new.limits.max_in_flight:
            return True
        d_new, d_old = core.next_deadline(new), core.next_deadline(old)
        return d_new is not None and (d_old is None or d_new < d_old)


class TakeNeverRings(ShellProtocol):
    """Not a bug in these bounds: `Room.take`'s ring is an optimisation (see the tests)."""

    def take_rings(self, new: Lanes[Any, Any]) -> bool:
        return False
