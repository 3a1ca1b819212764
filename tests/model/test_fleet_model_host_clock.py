"""The fleet's model check with a host clock ahead (ADR 0110): engine 1's clock is ahead of
engine 0's by more than a lease. Leases go by the database's clock, so that changes nothing: the
bound passes and reaches what the fleet's bounds reach (tests/model/test_fleet_model.py). The
planted bug of comparing leases with the host's clock is caught in two steps."""

from __future__ import annotations

from tests.model.configs import FLEET_CLOCK
from tests.model.fleet import FleetChecker, FleetProtocol
from tests.model.planted_fleet import TakeoverByTheHostClock

(SKEW,) = FLEET_CLOCK

# What the bound must reach, so that no property is vacuous: engine 0's crash leaves the flow to
# engine 1 (a takeover), or engine 0 comes back first (its recovery wins: a takeover refused).
REACHED = {
    *("step", "parked", "timed_out", "compensated", "failed", "end FAILED"),
    *("timer fires", "timer finds nothing", "takeover", "takeover refused", "restart RUNNING"),
}


def test_fleet_model_check_with_a_host_clock_ahead() -> None:
    """Engine 1's host clock is ahead by more than a lease: it takes over only what engine 0's
    crash left, since leases go by the database's clock."""
    checker = FleetChecker(SKEW, FleetProtocol())
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    assert not REACHED - checker.coverage, f"never reached: {sorted(REACHED - checker.coverage)}"


def test_catches_a_takeover_by_a_host_clock_that_is_ahead() -> None:
    """The engine before ADR 0110 (leases compared with the host's clock): engine 1, whose
    clock is ahead by more than a lease, takes over the flow engine 0 runs under a live lease,
    with no crash, freeze or lapse at all."""
    found = FleetChecker(SKEW, TakeoverByTheHostClock()).find()
    print(f"\n{found}")
    assert found.message == "engine 1 took over a flow engine 0 holds"
    assert found.trace[0].endswith("nobody's by its own clock, which is ahead")
    assert len(found.trace) == 2


def test_the_engine_decides_leases_on_the_databases_clock() -> None:
    assert FleetProtocol().leases_by_database_clock  # `_store.lease_clock` (ADR 0110)
