"""The exhaustive model check on the default bounds, and the planted bugs it must catch."""

from __future__ import annotations

import pytest

from tests.model.checker import Checker, Config, Counterexample, Protocol
from tests.model.configs import DEFAULT, SLOW
from tests.model.planted import (
    ClaimIgnoresTheBound,
    EarlyDirectRelease,
    RetakeBusy,
    SplitAdmission,
)

BOUND_DIRECT = next(c for c in DEFAULT if "at most 2 calls" in c.name)


# The lanes' own "per-key, delay 1, batches split by size" (10 s) runs under `-m long`: the
# shell's model checks the same configuration with the workers around the lanes (configs.py).
_TWIN_IN_SHELL = "per-key, delay 1, batches split by size"


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(c, id=c.name, marks=[pytest.mark.long] if c.name == _TWIN_IN_SHELL else [])
        for c in DEFAULT
    ],
)
def test_model_check(config: Config) -> None:
    report = Checker(config).run()
    assert report.states > 1000  # the bounds really branch
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")


@pytest.mark.long
@pytest.mark.parametrize("config", SLOW, ids=lambda c: c.name)
def test_model_check_larger_bounds(config: Config) -> None:
    report = Checker(config).run()
    print(f"\n{report.states} states, {report.transitions} steps, {report.seconds:.2f}s")


def _counterexample(config: Config, protocol: Protocol, **kw: bool) -> Counterexample:
    with pytest.raises(Counterexample) as info:
        Checker(config, protocol, **kw).run()
    print(f"\n{info.value}")
    return info.value


def test_catches_direct_call_released_before_it_ends() -> None:
    found = _counterexample(DEFAULT[0], EarlyDirectRelease())
    assert found.message == "2 calls in flight for key a"
    assert found.trace[-1] == "direct call 2 (a) starts"


@pytest.mark.parametrize("check_room", [True, False])
def test_catches_busy_lane_taken_again(check_room: bool) -> None:
    found = _counterexample(DEFAULT[2], RetakeBusy(), check_room=check_room)
    if check_room:
        assert "busy lane is queued" in found.message
    else:  # the actors' own property sees it too
        assert found.message == "2 calls in flight for key a"
        assert sum("takes a" in step for step in found.trace) == 2


def test_catches_admission_not_atomic_with_close() -> None:
    found = _counterexample(DEFAULT[2], SplitAdmission())
    assert "admitted after close" in found.message
    assert found.trace[:2] == ["look 0 (a): open", "close"]


def test_catches_direct_calls_beyond_the_bound() -> None:
    found = _counterexample(BOUND_DIRECT, ClaimIgnoresTheBound())
    assert found.message == "3 calls in flight, above 2"
    assert [step.split(" at ")[0] for step in found.trace] == [
        "admit 0 (a)",
        "admit 1 (b)",
        "admit 2 (c)",
    ]


def test_unplanted_protocol_flags_are_off() -> None:
    assert not Protocol.release_direct_at_start and not Protocol.split_admission
