"""Fleet protocols with one planted bug each: the fleet model check must catch every one."""

from __future__ import annotations

import attrs

from ferry.flow._machine import Flow, Transition
from tests.model.fleet import FleetProtocol


class FleetEngine(FleetProtocol):
    """The fleet engine with the candidate fixes of the model's two findings (ADR 0052): a
    renewal after the lease lapsed re-reads the flow before the engine trusts it again, and a
    flow that comes back to the engine that let it go is not released by its next renewal. The
    planted bugs below are planted on this one, so that each is the only fault."""

    renewal_rereads = True
    retaken_not_released = True


class TakeoverWithoutRevisionCheck(FleetEngine):
    """(1) The takeover's UPDATE does not compare the revision its scan read: it overwrites
    whatever the owner wrote since with the row as the scan saw it."""

    takeover_cas = False


class TakeoverWithoutOrphanCheck(FleetEngine):
    """(2) The takeover compares the revision but not that the flow is still nobody's: an owner
    that renewed its lease since the scan (a renewal writes no flow row) loses the flow it runs."""

    takeover_checks_orphan = False


class RunnerIgnoresItsLease(FleetEngine):
    """(3) A runner starts a body without looking at its lease: an engine whose renewals fail
    runs on after another engine took its flow over."""

    runner_checks_lease = False


class CancelTakesTheFlow(FleetEngine):
    """(4) An outside request leaves the flow with the engine that made it, even when another
    engine holds it: a cancel through engine 1 starts the compensation there while engine 0
    still runs the step."""

    outside_respects_owner = False


class FleetWriteWithoutRevisionCheck(FleetEngine):
    """(5) The runner's UPDATE does not compare the revision: a frozen owner's write lands on a
    flow taken over meanwhile."""

    runner_cas = False


class FleetTimerWithoutRevisionCheck(FleetEngine):
    """(6) A timer fires from the row it armed without a compare: across the fleet, the park
    times out once per engine."""

    timer_checks_revision = False


class TakeoverKeepsTheAttempt(FleetEngine):
    """(7) A takeover keeps the attempt number: the run it starts claims the number of a run
    the old owner may have made."""

    def take_over(self, flow: Flow, owner: str, now: float) -> Transition:
        t = super().take_over(flow, owner, now)
        return attrs.evolve(t, flow=attrs.evolve(t.flow, attempt=flow.attempt))


class ReleaseOfAnotherOwnersFlow(FleetEngine):
    """(8) The release in a renewal does not check the owner: an engine that let a flow go
    releases it again after another engine took it over, and a third takeover runs it twice."""

    release_checks_owner = False
