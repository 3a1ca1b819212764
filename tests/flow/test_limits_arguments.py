"""Flow control's values refuse every bad value at the definition or the call, naming it.

`Limits`, `Rate` and the start options (`priority`, `delay` xor `at`, the key a plan's key
function gives) are pure (`ferry.flow._model._limits`, docs/adr/0141): each bad value is a
`TypeError` (not the kind of thing asked for) or a `ValueError` (the right kind, out of range),
with the argument's name in the message; a bool is not a number, nan and inf are not times, a key
must be storable text. Each test here fails if its check is taken out of `_limits`.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import pytest

from ferry.flow._model import _limits as lim
from ferry.flow._model._limits import Limits, Rate


def _key(data: Any) -> str:
    return str(data["user"])


# ---- Rate -------------------------------------------------------------------------------------


def test_a_rate_holds_its_count_and_window() -> None:
    rate = Rate(100, per=60)
    assert (rate.count, rate.per) == (100, 60.0)
    assert isinstance(rate.per, float)
    assert Rate(1, 0.001) == Rate(1, per=0.001)


@pytest.mark.parametrize(
    ("count", "per", "error", "words"),
    [
        (True, 60, TypeError, "Rate count must be a whole number"),
        (1.0, 60, TypeError, "Rate count must be a whole number"),
        ("5", 60, TypeError, "Rate count must be a whole number"),
        (0, 60, ValueError, "Rate count must be in 1..1000000"),
        (-3, 60, ValueError, "Rate count must be in 1..1000000"),
        (lim.MAX_RATE_COUNT + 1, 60, ValueError, "Rate count must be in 1..1000000"),
        (10, True, TypeError, "Rate per must be a number of seconds"),
        (10, "60", TypeError, "Rate per must be a number of seconds"),
        (10, None, TypeError, "Rate per must be a number of seconds"),
        (10, math.nan, ValueError, "Rate per must be a finite number"),
        (10, math.inf, ValueError, "Rate per must be a finite number"),
        (10, 10**400, ValueError, "Rate per must be a finite number"),
        (10, 0, ValueError, "Rate per must be more than 0 seconds"),
        (10, -1.5, ValueError, "Rate per must be more than 0 seconds"),
    ],
)
def test_a_bad_rate_is_refused_naming_what(
    count: Any, per: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        Rate(count, per=per)


# ---- Limits -----------------------------------------------------------------------------------


def test_limits_hold_what_they_are_given() -> None:
    limits = Limits(concurrency=50, key=_key, per_key=1, rate=Rate(100, per=60.0))
    assert (limits.concurrency, limits.key, limits.per_key) == (50, _key, 1)
    assert limits.stored() == {"concurrency": 50, "key": True, "per_key": 1, "rate": [100, 60.0]}
    assert Limits(concurrency=3).stored() == {
        "concurrency": 3,
        "key": False,
        "per_key": None,
        "rate": None,
    }
    # A key alone groups the queue for fairness under another limit.
    assert Limits(concurrency=2, key=_key).per_key is None


def test_limits_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Limits(5)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"concurrency": 0}, ValueError, "Limits concurrency must be in 1.."),
        ({"concurrency": -1}, ValueError, "Limits concurrency must be in 1.."),
        ({"concurrency": 2**63}, ValueError, "Limits concurrency must be in 1.."),
        ({"concurrency": True}, TypeError, "Limits concurrency must be a whole number"),
        ({"concurrency": 5.0}, TypeError, "Limits concurrency must be a whole number"),
        ({"concurrency": "5"}, TypeError, "Limits concurrency must be a whole number"),
        ({"key": _key, "per_key": 0}, ValueError, "Limits per_key must be in 1.."),
        ({"key": _key, "per_key": False}, TypeError, "Limits per_key must be a whole number"),
        ({"per_key": 1}, ValueError, "per_key=1 needs a key function"),
        ({"per_key": 1, "concurrency": 4}, ValueError, "per_key=1 needs a key function"),
        ({"key": "user", "per_key": 1}, TypeError, "Limits key must be a function"),
        ({"key": _key}, ValueError, r"Limits\(\) limits nothing"),
        ({}, ValueError, r"Limits\(\) limits nothing"),
        ({"rate": (100, 60)}, TypeError, r"Limits rate must be a flow.Rate"),
        ({"rate": 100}, TypeError, r"Limits rate must be a flow.Rate"),
    ],
)
def test_bad_limits_are_refused_naming_what(
    kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        Limits(**kwargs)


def test_an_async_key_function_is_refused_at_the_definition() -> None:
    async def key(data: Any) -> str:
        return "k"

    with pytest.raises(TypeError, match="Limits key must be a plain function"):
        Limits(key=key, per_key=1)  # type: ignore[arg-type]


# ---- start options ----------------------------------------------------------------------------


def test_start_options_give_the_priority_the_time_and_the_key() -> None:
    limits = Limits(key=_key, per_key=1)
    options = lim.start_options(limits, "email", {"user": "u1"}, priority=-2, delay=5, now=100.0)
    assert options == lim.StartOptions(priority=-2, not_before=105.0, key="u1")
    at = lim.start_options(limits, "email", {"user": "u1"}, at=50, now=100.0)
    assert at.not_before == 50.0  # a time passed: at once, when it is admitted
    plain = lim.start_options(None, "email", {"user": "u1"}, now=100.0)
    assert plain == lim.StartOptions(priority=0, not_before=None, key=None)
    assert lim.start_options(limits, "p", {"user": "u"}, delay=0, now=7.0).not_before == 7.0
    assert lim.start_priority(-(2**63)) == -(2**63)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"priority": True}, TypeError, "priority must be a whole number"),
        ({"priority": 1.0}, TypeError, "priority must be a whole number"),
        ({"priority": None}, TypeError, "priority must be a whole number"),
        ({"priority": 2**63}, ValueError, "priority must be in"),
        ({"priority": -(2**63) - 1}, ValueError, "priority must be in"),
        ({"delay": 5, "at": 10.0}, ValueError, "give delay= or at=, not both"),
        ({"delay": 0, "at": 0}, ValueError, "give delay= or at=, not both"),
        ({"delay": True}, TypeError, "delay must be a number of seconds"),
        ({"delay": "5"}, TypeError, "delay must be a number of seconds"),
        ({"delay": math.nan}, ValueError, "delay must be a finite number"),
        ({"delay": math.inf}, ValueError, "delay must be a finite number"),
        ({"delay": -math.inf}, ValueError, "delay must be a finite number"),
        ({"delay": -1}, ValueError, "delay must be 0 seconds or more"),
        ({"at": False}, TypeError, "at must be a number of seconds"),
        ({"at": "tomorrow"}, TypeError, r"at must be a number of seconds.*timestamp"),
        ({"at": math.nan}, ValueError, "at must be a finite number"),
        ({"at": 10**400}, ValueError, "at must be a finite number"),
    ],
)
def test_bad_start_options_are_refused_naming_what(
    kwargs: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        lim.start_options(None, "email", {"user": "u1"}, now=1e9, **kwargs)


def test_a_delay_past_any_time_is_refused() -> None:
    with pytest.raises(ValueError, match=r"delay=1e\+308 puts the start past any time"):
        lim.start_options(None, "email", {}, delay=1e308, now=1e308)


def test_a_key_function_that_raises_is_a_value_error_naming_the_plan() -> None:
    limits = Limits(key=_key, per_key=1)
    with pytest.raises(ValueError, match="the key function of plan 'email' raised KeyError") as e:
        lim.start_options(limits, "email", {"name": "u1"}, now=0.0)
    assert isinstance(e.value.__cause__, KeyError)


class _Tier(str, enum.Enum):  # noqa: UP042 (its str() is "_Tier.GOLD": the case to check)
    GOLD = "gold"


@pytest.mark.parametrize(
    ("returned", "error", "words"),
    [
        (None, TypeError, "must return a str, got None"),
        (7, TypeError, "must return a str, got 7"),
        (b"u1", TypeError, "must return a str, got b'u1'"),
        ("\udc80", ValueError, "cannot be stored: it holds '\\\\udc80'"),
        ("a\x00b", ValueError, "cannot be stored: it holds a NUL"),
        ("é" * 257, ValueError, "is 514 bytes of UTF-8, more than 512"),
    ],
)
def test_a_bad_key_is_refused_at_the_start(
    returned: object, error: type[Exception], words: str
) -> None:
    limits = Limits(key=lambda data: returned, per_key=1)  # type: ignore[arg-type,return-value]
    with pytest.raises(error, match=words):
        lim.start_options(limits, "email", {}, now=0.0)


def test_a_key_at_its_size_and_a_str_subclass_are_taken_as_text() -> None:
    assert lim.flow_key(Limits(key=lambda d: "é" * 256, per_key=1), "p", {}) == "é" * 256
    key = lim.flow_key(Limits(key=lambda d: _Tier.GOLD, per_key=1), "p", {})
    assert key == "gold" and type(key) is str


def test_a_key_function_returning_an_awaitable_is_refused_and_not_left_unawaited() -> None:
    async def later() -> str:
        return "k"

    made: list[Any] = []

    def key(data: Any) -> Any:
        made.append(later())
        return made[-1]

    with pytest.raises(TypeError, match="returned an awaitable"):
        lim.flow_key(Limits(key=key, per_key=1), "p", {})
    assert made[0].cr_frame is None  # closed: no "never awaited" warning


# ---- one plan version, one set of limits ------------------------------------------------------


def test_a_plan_version_registered_with_other_limits_is_refused_naming_both() -> None:
    ours = Limits(concurrency=50, key=_key, per_key=1)
    registered = lim.stored(Limits(concurrency=50, key=lambda d: "other", per_key=1))
    lim.same_as_registered("email", 1, ours, registered, "engine 'a'")  # code is not compared
    lim.same_as_registered("email", 1, None, None, "engine 'a'")
    with pytest.raises(ValueError) as e:
        lim.same_as_registered("email", 2, ours, lim.stored(Limits(concurrency=10)), "engine 'b'")
    message = str(e.value)
    assert message.startswith("plan 'email' version 2 is registered by engine 'b' with limits")
    assert "'concurrency': 10" in message and "'concurrency': 50" in message
    with pytest.raises(ValueError, match="registered by engine 'b' with limits None"):
        lim.same_as_registered("email", 2, ours, None, "engine 'b'")
    with pytest.raises(ValueError, match="and this engine has None"):
        lim.same_as_registered("email", 2, None, registered, "engine 'b'")
    rated = lim.stored(Limits(rate=Rate(10, per=1)))
    with pytest.raises(ValueError, match=r"'rate': \[10, 2\.0\]"):
        lim.same_as_registered("email", 2, Limits(rate=Rate(10, per=2)), rated, "engine 'b'")
