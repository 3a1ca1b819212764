"""The fleet's model check (one flow, two engines with leases): its bounds, its planted bugs, the
engine's findings, and the fidelity of its store to the real one (ADR 0052)."""

from __future__ import annotations

import attrs
import pytest

from ferry.flow import _store as store
from tests.model.configs import FLEET_DEFAULT, FLEET_EDGES, FLEET_SLOW
from tests.model.fleet import NAMES, FleetChecker, FleetProtocol
from tests.model.flow import FlowConfig, S, Write
from tests.model.planted_fleet import (
    BlocksForAVersionAnotherEngineHas,
    CancelTakesTheFlow,
    ClaimIgnoresTheLiveIncarnation,
    FleetTimerWithoutRevisionCheck,
    FleetWriteWithoutRevisionCheck,
    ReleaseOfAnotherOwnersFlow,
    RenewalTrustsWithoutRereading,
    RetakenFlowReleased,
    RunnerIgnoresItsLease,
    TakeoverKeepsTheAttempt,
    TakeoverWithoutOrphanCheck,
    TakeoverWithoutRevisionCheck,
)
from tests.model.test_flow_model import StoreMirror, _agree

EITHER, CANCEL, FROZEN, OUTAGE = FLEET_DEFAULT
SAME_NAME, VERSIONS = FLEET_EDGES

# What each default bound must reach, so that no property is vacuous.
REACHED = {
    *("step", "parked", "woken", "timed_out", "compensated", "completed", "failed"),
    *("end COMPLETED", "end FAILED", "timer fires", "timer finds nothing"),
    *("takeover", "takeover refused"),
}
EXTRA = {
    EITHER.name: {"wake QUEUED", "wake RESUMED", "wake STALE", "queued wake taken"},
    CANCEL.name: {"cancel True", "cancel False", "cancelled", "not ours", "write refused"},
    FROZEN.name: {"freeze", "lapse hits a run", "let go", "release", "write refused"},
    OUTAGE.name: {"let go", "release", "takeover answer lost", "adopt", "let go, then ours again"},
    SAME_NAME.name: {"claim refused", "claim takes the name", "freeze", "takeover"},
    VERSIONS.name: {"wake RESUMED", "wake QUEUED", "cancel True", "takeover", "timer fires"},
}
WAKELESS = {"end COMPLETED", "completed", "woken"}  # without a wake, the park times out
REACHED_BY = {
    c.name: REACHED - (WAKELESS if not c.wakes else set()) for c in FLEET_DEFAULT + FLEET_EDGES
}
REACHED_BY[SAME_NAME.name] -= {"takeover refused"}  # one runner at a time under one name


def _run(config: FlowConfig, protocol: FleetProtocol) -> FleetChecker:
    checker = FleetChecker(config, protocol)
    report = checker.run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    missing = (REACHED_BY.get(config.name, set()) | EXTRA.get(config.name, set())) - (
        checker.coverage
    )
    assert not missing, f"the bound never reaches {sorted(missing)}"
    return checker


@pytest.mark.parametrize("config", FLEET_DEFAULT, ids=lambda c: c.name)
def test_fleet_model_check(config: FlowConfig) -> None:
    """The engine as it is: wakes, the timeout, a cancel and crashes through either engine; a
    frozen owner; renewals that fail and a takeover whose answer is lost."""
    _run(config, FleetProtocol())


@pytest.mark.parametrize("config", FLEET_EDGES, ids=lambda c: c.name)
def test_fleet_model_check_of_incarnations_and_versions(config: FlowConfig) -> None:
    """Issue 16: a second opening under engine 0's name (refused while engine 0 is up with its
    lease; allowed once it crashed or its lease lapsed, which supersedes it), and an engine
    without the flow's version (it leaves the flow to engine 0 while that one is live)."""
    _run(config, FleetProtocol())


def test_catches_a_second_incarnation_that_is_not_refused() -> None:
    found = FleetChecker(SAME_NAME, ClaimIgnoresTheLiveIncarnation()).find()
    print(f"\n{found}")
    assert found.message.endswith("two at once")
    assert any("engine 1 opens as e0" in step for step in found.trace)
    assert not any("freezes" in step or "crash" in step for step in found.trace)


def test_catches_an_engine_that_blocks_a_version_another_engine_has() -> None:
    found = FleetChecker(VERSIONS, BlocksForAVersionAnotherEngineHas()).find()
    print(f"\n{found}")
    assert "blocked for a missing version while engine [0] has it" in found.message
    assert "(engine 1)" in found.trace[-1]


@pytest.mark.long
@pytest.mark.parametrize("config", FLEET_SLOW, ids=lambda c: c.name)
def test_fleet_model_check_larger_bounds(config: FlowConfig) -> None:
    report = FleetChecker(config, FleetProtocol()).run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")
    assert report.states > 30_000  # larger than every default bound


# ---- the model's findings (ADR 0052), fixed in the engine (ADR 0047): planted back, caught ------


def test_catches_a_renewal_after_a_lapse_that_trusts_a_flow_taken_over() -> None:
    """The first finding: the engine before ADR 0047 (its renewal does not re-read what it
    runs), with the second finding's fix in: the shortest trace is the finding's 7 steps."""
    found = FleetChecker(FROZEN, RenewalTrustsWithoutRereading()).find()
    print(f"\n{found}")
    assert found.message == "engine 0 runs a body of a flow engine 1 holds: two at once"
    assert found.trace == [
        "engine 0 freezes",
        "engine 0's lease lapses while it is frozen",
        "engine 0 thaws",
        "engine 1's scan reads RUNNING 'reserve' attempt 1 (engine 0, whose lease lapsed):"
        " nobody's",
        "engine 1 takes over revision 1: revision 2, RUNNING 'reserve' attempt 2",
        "engine 0 renews its lease (it had lapsed)",
        "engine 0 runs step 'reserve', attempt 1  <-- fails here",
    ]


def test_catches_a_release_of_a_flow_taken_back() -> None:
    """The second finding: the engine before ADR 0047 (a flow given back to the engine that let
    it go stays marked for release, at any revision), with the first finding's fix in."""
    found = FleetChecker(OUTAGE, RetakenFlowReleased()).find()
    print(f"\n{found}")
    assert found.message.endswith("two at once")
    assert len(found.trace) == 11
    steps = "\n".join(found.trace)
    assert "engine 0 cannot renew: lets the flow go" in steps
    assert "engine 0's timer for revision 3 fires" in steps
    assert "engine 0 renews its lease, releasing the flow it let go" in steps
    assert "engine 1 takes over" in found.trace[-2]


@pytest.mark.parametrize(
    "flags",
    [{"retaken_not_released": False}, {"release_checks_revision": False}],
    ids=["release-at-the-revision-only", "forget-when-retaken-only"],
)
def test_either_half_of_the_second_fix_is_enough(flags: dict[str, bool]) -> None:
    """The engine has both (ADR 0047): a flow given back is no longer marked for release, and a
    release is made only at the revision let go (which also covers a renewal in flight when the
    flow comes back, which the model, whose renewal is one step, cannot show)."""
    protocol = FleetProtocol()
    for name, value in flags.items():
        setattr(protocol, name, value)
    _run(OUTAGE, protocol)


# ---- planted bugs: each is caught with a shortest trace ------------------------------------------


def test_catches_a_takeover_without_compare_and_set() -> None:
    """The takeover overwrites a write the frozen owner made after the scan read the row."""
    found = FleetChecker(FROZEN, TakeoverWithoutRevisionCheck()).find()
    assert found.message == "step 'reserve' ran again after its outcome was recorded"
    assert len(found.trace) == 8
    assert "engine 1's scan reads RUNNING 'reserve'" in found.trace[4]
    assert found.trace[5].startswith("engine 0 writes step 'reserve' continue: revision 2")
    assert found.trace[6].startswith("engine 1 takes over revision 1: revision 3")


def test_catches_a_takeover_that_checks_the_revision_but_not_the_lease() -> None:
    found = FleetChecker(FROZEN, TakeoverWithoutOrphanCheck()).find()
    assert found.message == "engine 1 took over a flow engine 0 holds"
    assert "engine 0 renews its lease (it had lapsed)" in found.trace


def test_catches_a_runner_that_ignores_its_lease() -> None:
    found = FleetChecker(FROZEN, RunnerIgnoresItsLease()).find()
    assert found.message == "engine 0 runs a body of a flow engine 1 holds: two at once"
    assert "renews" not in "\n".join(found.trace)  # unlike the finding, without any renewal


def test_catches_a_cancel_that_takes_the_flow_from_its_runner() -> None:
    found = FleetChecker(CANCEL, CancelTakesTheFlow()).find()
    assert found.message == "engine 0 runs a body of a flow engine 1 holds: two at once"
    assert len(found.trace) == 4
    assert found.trace[2].startswith("cancel (engine 1) while RUNNING 'charge'")
    assert found.trace[3].startswith("engine 0 runs step 'charge'")  # beside the compensation


def test_catches_a_frozen_owner_that_writes_over_a_takeover() -> None:
    found = FleetChecker(FROZEN, FleetWriteWithoutRevisionCheck()).find()
    assert found.message.startswith("engine 0 (its lease lapsed during the run) recorded")
    assert "engine 0 thaws" in found.trace


def test_catches_a_timeout_that_fires_once_per_engine() -> None:
    # With a wake, the one-engine failure comes first (a timeout after the wake): none here.
    found = FleetChecker(OUTAGE, FleetTimerWithoutRevisionCheck()).find()
    assert found.message == "a timeout fired for a park that is timed_out"
    fired = [step.split("'s timer")[0][-8:] for step in found.trace if "timer for" in step]
    assert sorted(fired) == ["engine 0", "engine 1"]


def test_catches_a_takeover_that_keeps_the_attempt() -> None:
    found = FleetChecker(FROZEN, TakeoverKeepsTheAttempt()).find()
    assert found.message == "step 'reserve' ran as attempt 1 again (attempts never repeat)"
    assert len(found.trace) == 6


def test_catches_a_release_of_a_flow_another_engine_took_over() -> None:
    found = FleetChecker(OUTAGE, ReleaseOfAnotherOwnersFlow()).find()
    assert found.message == "engine 1 runs a body of a flow engine 0 holds: two at once"
    assert "engine 0 renews its lease (it had lapsed), releasing the flow it let go" in (
        found.trace
    )
    assert len(found.trace) == 8


def test_fleet_protocol_flags_are_the_engine_s() -> None:
    p = FleetProtocol()
    assert p.takeover_cas and p.takeover_checks_orphan and p.runner_checks_lease
    assert p.outside_respects_owner and p.renewal_releases and p.release_checks_owner
    assert p.release_checks_revision  # `_store.release` (ADR 0047)
    assert p.renewal_rereads and p.retaken_not_released  # the findings, fixed (ADR 0047)


# ---- fidelity: takeovers and releases as the real store makes them ------------------------------


class FleetStoreMirror(StoreMirror, FleetChecker):
    """`StoreMirror` for the fleet: every write (takeovers with their check that the flow is
    nobody's, against the engine leases in ``flow_engines``) and every renewal's release also
    goes to the real store on SQLite, which must agree."""

    renewals = 0

    def _drifted(self, w: Write) -> Write:
        """The write as a drifting model makes it: a takeover without the orphan check."""
        return attrs.evolve(w, orphan=False) if w.orphan else w

    def _renew(self, m: S, e: int) -> tuple[str, S]:
        label, after = super()._renew(m, e)
        tx, engine = self.tx, m.engines[e]
        tx.execute("BEGIN")
        try:
            self._load(m)
            released = engine.released and self.protocol.renewal_releases
            let_go = [("f", engine.released)] if released else []
            # The model marks a release as made a moment before now (see `_renew`).
            store.renew(tx, NAMES[e], m.now + 100.0, m.now - 1.0, let_go=let_go)
            _agree("the row after a renewal", store.load(tx, "f"), after.row)
            held = {owner: until > m.now for owner, until, _s, _n in store.load_engines(tx)}
            _agree("the engine leases", held[NAMES[e]], after.leases[e])
        finally:
            tx.execute("ROLLBACK")
        self.renewals += 1
        return label, after


def test_the_fleet_model_store_behaves_as_the_real_store() -> None:
    mirror = FleetStoreMirror(OUTAGE)
    report = mirror.run()
    print(f"\n{report.states} states, {mirror.writes} writes, {mirror.renewals} renewals mirrored")
    assert mirror.writes > 1000 and mirror.renewals > 50
    assert {"takeover", "takeover refused", "release", "adopt"} <= mirror.coverage


def test_the_fleet_store_mirror_sees_a_model_without_the_orphan_check() -> None:
    mirror = FleetStoreMirror(FROZEN, drift=True)
    found = mirror.find()
    # The real store refuses the takeover (`Conflict`): the owner renewed since the scan.
    assert found.message.startswith("the store and the model disagree on the transition: Conf")
    assert found.trace[-1] == "engine 0 renews its lease (it had lapsed)"
