"""Fleet protocols with one planted bug each: the fleet model check must catch every one.

(0a) and (0b) are the engine as it was before ADR 0047: the model's two findings (ADR 0052)."""

from __future__ import annotations

import attrs

from ferry.flow._model._values import Flow, Transition
from tests.model.fleet import FleetProtocol


class RenewalTrustsWithoutRereading(FleetProtocol):
    """(0a) The engine before ADR 0047, the model's first finding: a renewal after the lease
    lapsed makes the engine trust the flow it has in memory, also one another engine took over
    meanwhile; its runner then runs a body beside the new owner's."""

    renewal_rereads = False


class RetakenFlowReleased(FleetProtocol):
    """(0b) The engine before ADR 0047, the model's second finding: a flow let go stays marked
    for release when a write gives it back to its engine (a timer, a wake, a cancel through
    it), and the release is not tied to the revision let go: the next renewal releases the
    flow while the engine runs it, and another engine takes it over."""

    retaken_not_released = False
    release_checks_revision = False


class TakeoverWithoutRevisionCheck(FleetProtocol):
    """(1) The takeover's UPDATE does not compare the revision its scan read: it overwrites
    whatever the owner wrote since with the row as the scan saw it."""

    takeover_cas = False


class TakeoverWithoutOrphanCheck(FleetProtocol):
    """(2) The takeover compares the revision but not that the flow is still nobody's: an owner
    that renewed its lease since the scan (a renewal writes no flow row) loses the flow it runs."""

    takeover_checks_orphan = False


class TakeoverByTheHostClock(FleetProtocol):
    """(12) The engine before ADR 0110: lease times are compared with the host's clock, in the
    scan and in the takeover's check (``lapsed_at``), so an engine whose clock is ahead by more
    than a lease sees every live lease as lapsed and takes over the flows their engines run."""

    leases_by_database_clock = False


class RunnerIgnoresItsLease(FleetProtocol):
    """(3) A runner starts a body without looking at its lease: an engine whose renewals fail
    runs on after another engine took its flow over."""

    runner_checks_lease = False


class CancelTakesTheFlow(FleetProtocol):
    """(4) An outside request leaves the flow with the engine that made it, even when another
    engine holds it: a cancel through engine 1 starts the compensation there while engine 0
    still runs the step."""

    outside_respects_owner = False


class FleetWriteWithoutRevisionCheck(FleetProtocol):
    """(5) The runner's UPDATE does not compare the revision: a frozen owner's write lands on a
    flow taken over meanwhile."""

    runner_cas = False


class FleetTimerWithoutRevisionCheck(FleetProtocol):
    """(6) A timer fires from the row it armed without a compare: across the fleet, the park
    times out once per engine."""

    timer_checks_revision = False


class TakeoverKeepsTheAttempt(FleetProtocol):
    """(7) A takeover keeps the attempt number: the run it starts claims the number of a run
    the old owner may have made."""

    def take_over(self, flow: Flow, owner: str, now: float) -> Transition:
        t = super().take_over(flow, owner, now)
        return attrs.evolve(t, flow=attrs.evolve(t.flow, attempt=flow.attempt))


class ReleaseOfAnotherOwnersFlow(FleetProtocol):
    """(8) The release in a renewal checks neither the owner nor the revision let go (either
    check alone stops this): an engine that let a flow go releases it again after another
    engine took it over, and a third takeover runs it twice."""

    release_checks_owner = False
    release_checks_revision = False


class ClaimIgnoresTheLiveIncarnation(FleetProtocol):
    """(9) The engine before ADR 0071: opening under an owner name that a live engine holds is
    not refused, and both incarnations renew the name's one lease row: the second resumes the
    flow held under the name (attempt + 1) while the first still runs it."""

    claim_checks_incarnation = False


class BlocksForAVersionAnotherEngineHas(FleetProtocol):
    """(10) The engine before ADR 0074: an engine without the flow's plan version blocks the
    flow when a wake, a cancel or a timer reaches it, although another live engine has the
    version and would run it."""

    fleet_versions = False


class RenewsWhileTheLoopIsBlocked(FleetProtocol):
    """(11) The engine before ADR 0112: the lease thread renews whether or not the trio loop
    runs, so a loop blocked for good (a step's `time.sleep`, a full pipe) holds its flow for
    ever while another engine stands by."""

    renews_only_while_the_loop_runs = False
