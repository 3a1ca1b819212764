"""A flow's data is checked with one walk that looks at a plain value's scalars without a call
each (`_model/_checks._walk`), and still refuses what it refused.

`test_a_flat_object_of_scalars_is_walked_without_isinstance` fails on the walk that asked
`isinstance` of every child that is not a dict or a list (an int, a bool, a str).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest

from ferry.flow._model import _checks


def test_a_flat_object_of_scalars_is_walked_without_isinstance() -> None:
    data = {"i": 7, "one": True, "name": "x", "ratio": 0.5, "none": None}
    asked: list[str] = []

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            asked.append(arg.__name__)

    sys.setprofile(count)
    try:
        shape = _checks._walk(data)
    finally:
        sys.setprofile(None)
    assert shape == 0  # plain JSON, not too deep
    assert "isinstance" not in asked
    text = _checks.json_object_text(data, "data")
    assert text == '{"i":7,"name":"x","none":null,"one":true,"ratio":0.5}'


@pytest.mark.parametrize(
    "value",
    [{"k": (1, 2)}, {"k": {1: "a"}}, {"k": [{"n": (1,)}]}, {"k": {1, 2}}],
    ids=["tuple", "non-str key", "nested tuple", "a set"],
)
def test_what_json_changes_or_cannot_carry_is_still_refused(value: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match="must be JSON"):
        _checks.json_object_text(value, "data")


def test_a_deep_value_among_scalars_is_still_refused() -> None:
    value: Any = 1
    for _ in range(_checks.MAX_DEPTH + 1):
        value = [True, value]
    with pytest.raises(ValueError, match="nested deeper"):
        _checks.json_object_text({"k": value}, "data")
