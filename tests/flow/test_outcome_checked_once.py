"""A park's and a fail's values are checked by one function (`_checks.checked_outcome`), at
both doors: `park()`/`fail()` raise its error at the call, and a `Park`/`Fail` built by hand
and returned by a step is refused by the same check, with the same words, when its outcome is
recorded. A fail's reason that cannot be stored (a lone surrogate, a NUL) is refused at
`fail()` too, where before only the recorded path refused it (`fail("\\udc80")` returned a
`Fail`), so the first test fails without the one check.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import pytest

from ferry import flow
from ferry.flow._model import _checks
from ferry.flow._model._types import MisusedOutcome

BAD: Any = {"text": "soon", "later": "later", "number": 42, "nan": float("nan")}

#: (the call, the same values built by hand, the error's type)
CASES: list[tuple[Callable[[], object], object, type[Exception]]] = [
    (lambda: flow.park(timeout=BAD["text"]), flow.Park(BAD["text"], "compensate"), TypeError),
    (lambda: flow.park(timeout=True), flow.Park(True, "compensate"), TypeError),
    (lambda: flow.park(timeout=-1.0), flow.Park(-1.0, "compensate"), ValueError),
    (lambda: flow.park(timeout=BAD["nan"]), flow.Park(BAD["nan"], "compensate"), ValueError),
    (lambda: flow.park(timeout=10**400), flow.Park(10**400, "compensate"), ValueError),
    (lambda: flow.park(on_timeout=BAD["later"]), flow.Park(None, BAD["later"]), ValueError),
    (lambda: flow.fail(BAD["number"]), flow.Fail(BAD["number"]), TypeError),
    (lambda: flow.fail("bad \udc80"), flow.Fail("bad \udc80"), ValueError),
    (lambda: flow.fail("nul \x00"), flow.Fail("nul \x00"), ValueError),
]


@pytest.mark.parametrize(
    ("call", "built", "kind"),
    CASES,
    ids=[
        "timeout a str",
        "timeout a bool",
        "timeout < 0",
        "timeout nan",
        "timeout too big",
        "on_timeout unknown",
        "reason a number",
        "reason a surrogate",
        "reason a NUL",
    ],
)
def test_a_bad_park_or_fail_is_refused_with_the_same_words_at_the_call_and_when_returned(
    call: Callable[[], object], built: object, kind: type[Exception]
) -> None:
    with pytest.raises(kind) as raised:
        call()
    assert isinstance(raised.value, MisusedOutcome)  # the runner fails the flow at once
    said = _checks.outcome(built)
    assert isinstance(said, str)
    assert said.endswith(f": {raised.value}"), said


def test_good_values_pass_both_doors_the_same() -> None:
    for made, built in [
        (flow.park(), flow.Park(None, "compensate")),
        (flow.park(timeout=5, on_timeout="continue"), flow.Park(5.0, "continue")),
        (flow.park(timeout=datetime.timedelta(minutes=1)), flow.Park(60.0, "compensate")),
        (flow.fail("card declined"), flow.Fail("card declined")),
    ]:
        assert made == built
        assert _checks.outcome(built) == made
    # a whole number of seconds built by hand is recorded as the float park() makes of it
    assert _checks.outcome(flow.Park(5, "compensate")) == flow.park(timeout=5)
