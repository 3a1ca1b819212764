"""What a plan refuses at definition: step names that are empty or hold a slash (or cannot be
stored), versions outside a 32-bit int, a bool given as a version."""

from __future__ import annotations

import pytest

from ferry import flow


@pytest.mark.parametrize("name", ["", "pay/0/charge", "a/b", "x\udc80", "nul\x00"])
def test_a_step_name_that_is_empty_or_holds_a_slash_is_refused_at_definition(name: str) -> None:
    plan = flow.Plan("names", version=1)

    async def step(ctx: flow.Context) -> None:
        pass

    with pytest.raises(ValueError, match="name"):
        plan.step(name=name)(step)
    assert plan.steps == ()


@pytest.mark.parametrize("version", [0, -1, 2**31, 2**63])
def test_a_version_outside_a_32_bit_int_is_refused_at_the_plan(version: int) -> None:
    with pytest.raises(ValueError, match=r"1\.\.2147483647"):
        flow.Plan("versions", version=version)


def test_the_largest_version_is_a_version_and_a_bool_is_not() -> None:
    assert flow.Plan("versions", version=2**31 - 1).version == 2**31 - 1
    with pytest.raises(TypeError, match="int"):
        flow.Plan("versions", version=True)
