"""The property test's oracle catches planted bugs (tests/flow/test_properties.py).

Each planted test runs one fixed scenario of the property test's state machine (as an
``@example`` would) twice: on the engine as it is, where every check passes, and with one
function of the engine monkeypatched back to a wrong behaviour, where the oracle must fail
with the message that names the problem.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import attrs
import pytest

from ferry.flow import _machine

from .test_properties import (
    Act,
    CompAct,
    FlowMachine,
    PlanSpec,
    PropertyFailure,
    StartCall,
    StepSpec,
)


@contextmanager
def machine_with(*plans: PlanSpec) -> Iterator[FlowMachine]:
    """The property test's machine, open on a fresh file with `plans`; closed at the end."""
    machine = FlowMachine()
    try:
        machine.open_with(list(plans))
        yield machine
    finally:
        machine.failed = True  # the checks ran (or failed) in the test: only close
        machine.teardown()


# A step that raises once, then goes on: its second run must be attempt 2.
RETRIED = PlanSpec(
    "order",
    (
        StepSpec("reserve", 1, (Act("return", "none", "good"),), (CompAct("ok"),)),
        StepSpec("pay", 2, (Act("raise"), Act("return", "complete", "good")), None),
    ),
)


def run_retried() -> None:
    with machine_with(RETRIED) as machine:
        machine.do_start([StartCall(0, "o-1", {"sku": "A1"}, True)])
        machine.check_end()


def test_a_retried_step_passes_the_oracle() -> None:
    run_retried()


def test_the_oracle_catches_a_retry_that_repeats_its_attempt_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real: Callable[..., _machine.Transition] = _machine.next_attempt

    def same_attempt(flow: _machine.Flow, now: float) -> _machine.Transition:
        t = real(flow, now)
        return attrs.evolve(t, flow=attrs.evolve(t.flow, attempt=flow.attempt))

    monkeypatch.setattr(_machine, "next_attempt", same_attempt)
    with pytest.raises(PropertyFailure, match=r"not where it would be alone: .*'runs'"):
        run_retried()
