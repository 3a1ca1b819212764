"""The property test's oracle catches planted bugs (tests/flow/test_properties.py).

Each planted test runs one fixed scenario of the property test's state machine (as an
``@example`` would) with one function of the engine monkeypatched back to an old or wrong
behaviour, and expects the oracle's check that names the problem to fail. The same scenarios
pass on the engine as it is (in test_properties.py, or here).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import attrs
import pytest

from ferry.flow._model import _checks, _machine
from ferry.flow._model._values import Flow, Transition
from ferry.projected import canonical_json

from . import test_properties as props
from .test_properties import (
    Act,
    CompAct,
    PlanSpec,
    PropertyFailure,
    StartCall,
    StepSpec,
    run_scenario,
)

# A step that raises once, then goes on: its second run must be attempt 2.
RETRIED = PlanSpec(
    "order",
    (
        StepSpec("reserve", 1, (Act("return", "none", "good", {"sku": "A1"}),), (CompAct("ok"),)),
        StepSpec("pay", 2, (Act("raise"), Act("return", "complete", "good")), None),
    ),
)


def run_retried() -> None:
    run_scenario([RETRIED], lambda m: m.do_start([StartCall(0, "o-1", {"sku": "A1"}, True)]))


def test_a_retried_step_passes_the_oracle() -> None:
    run_retried()


def test_the_oracle_catches_a_retry_that_repeats_its_attempt_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real: Callable[..., Transition] = _machine.next_attempt

    def same_attempt(flow: Flow, now: float, *failure: object) -> Transition:
        t = real(flow, now, *failure)
        return attrs.evolve(t, flow=attrs.evolve(t.flow, attempt=flow.attempt))

    monkeypatch.setattr(_machine, "next_attempt", same_attempt)
    with pytest.raises(PropertyFailure, match=r"not where it would be alone: .*'runs'"):
        run_retried()


def _old_json_text(value: object, what: str, *, max_bytes: int | None = None) -> str:
    """The earlier JSON check: JSON text with ``ensure_ascii=False`` and a round trip,
    which lets a lone surrogate through (and any depth, and any size)."""
    try:
        text = canonical_json(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be JSON: {exc}") from None
    if json.loads(text) != value:
        raise TypeError(f"{what} must be JSON and survive a round trip unchanged")
    return text


def test_the_oracle_catches_the_old_json_check_letting_a_lone_surrogate_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_checks, "json_text", _old_json_text)
    with pytest.raises(PropertyFailure, match="bad input must raise TypeError/ValueError"):
        props.test_bad_start_data_is_refused_at_its_call_alone("lone-surrogate")


def _old_idempotency_key(flow_id: str, step_index: int, step: str, *, compensation: bool) -> str:
    """The earlier key: a compensation's key is its step's key + "/compensate"."""
    key = f"{flow_id}/{step_index}/{step}"
    return f"{key}/compensate" if compensation else key


def test_the_oracle_catches_the_old_compensation_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checks, "idempotency_key", _old_idempotency_key)
    with pytest.raises(PropertyFailure, match="idempotency keys shared"):
        props.test_a_compensation_key_is_no_other_flows_step_key()


def test_the_oracle_catches_a_park_check_that_lets_odd_timeouts_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_checks, "checked_outcome", lambda outcome: outcome)
    with pytest.raises(PropertyFailure, match="not where it would be alone"):
        props.test_a_malformed_outcome_fails_its_flow_alone("Park(-1)")
