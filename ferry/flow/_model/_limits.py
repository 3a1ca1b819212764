"""Flow control's values and their checks: `Limits`, `Rate` and the start options (SPEC 5.8).

What this module is, this round: the definitions and every check of bad input, pure and at the
call (docs/adr/0141). It is NOT exported by `ferry.flow` and `Plan` takes no ``limits=`` yet:
the engine cannot enforce a limit until the store keeps the queue (the state ``QUEUED``, the
plan's budget row, the admission times), so a public name now would be a stub that promises what
nothing holds. The next round wires these into `Plan`, `Engine.start` and the store; the pure
admission rule they feed is `_admission`.

- `Rate(count, per)`: at most `count` flows of the plan become active in any window of `per`
  seconds. `count` is a whole number in 1..`MAX_RATE_COUNT` (the store keeps one admission time
  per flow admitted within the window), `per` a finite number of seconds > 0.
- `Limits(concurrency=, key=, per_key=, rate=)`, all keyword-only: `concurrency` and `per_key`
  whole numbers >= 1 (at most `MAX_COUNT`: stored as BIGINT), `key` a plain function of the
  flow's start data returning its key (a str), `per_key` only with a `key`. A `Limits` that limits
  nothing (none of `concurrency`, `per_key`, `rate`) is refused: give ``limits=None``. A `key`
  without `per_key` is allowed: it groups the queue so that its order is fair across keys.
- `start_options(...)`: ``priority`` (an int, lower first, stored as BIGINT), ``delay`` (seconds
  from now) xor ``at`` (a wall-clock time in seconds), both finite numbers; the flow's key, from
  the plan's `key` function called on the start data at the call: a function that raises is a
  `ValueError` naming the plan (the exception chained), one that returns a non-str a `TypeError`;
  a key must be storable text (`_checks.text_problem`) of at most `MAX_KEY_BYTES` in UTF-8 (it is
  part of an index entry: PostgreSQL refuses a B-tree entry over about 2.7 kB).
- `same_as_registered`: engines of one store that register one (plan, version) with different
  limits (`stored`: the key function as whether there is one; code is not compared): the later
  one's `ValueError` names both.

A bool is never a number here (``True`` is an ``int`` to Python, a mistake to a reader), nor is a
whole number too large for a float a time (`_checks.finite`). Cost: O(1) per check, plus the key
function's own call and an O(len(key)) look at its text.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Final, final

import attrs

from ._checks import describe, finite, shown_number, text_problem
from ._types import Json

#: Counts are stored as BIGINT (``concurrency``, ``per_key``, ``priority``).
MAX_COUNT = 2**63 - 1
MIN_PRIORITY = -(2**63)
#: A rate's count: the window keeps one admission time per flow admitted within it.
MAX_RATE_COUNT = 1_000_000
#: A key is part of an index entry (plan, key, ...): bounded well below PostgreSQL's ~2.7 kB.
MAX_KEY_BYTES = 512

KeyFn = Callable[[Json], str]


def _whole(value: object, name: str, low: int, high: int = MAX_COUNT) -> int:
    """`value`, a whole number (an int, not a bool) in low..high; `TypeError`/`ValueError`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number (an int), got {describe(value, 200)}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {shown_number(value)}")
    return int(value)


def _seconds(value: object, name: str, *, hint: str = "") -> float:
    """`value`, a finite number of seconds (int or float, not a bool); as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {describe(value, 200)}{hint}")
    if not finite(value):
        raise ValueError(f"{name} must be a finite number of seconds, got {shown_number(value)}")
    return float(value)


@final
@attrs.frozen(init=False)
class Rate:
    """At most `count` flows of a plan become active in any window of `per` seconds (a sliding
    window: not a bucket that refills in between). ``Rate(100, per=60.0)``."""

    count: int
    per: float

    def __init__(self, count: int, per: float) -> None:
        count = _whole(count, "Rate count", 1, MAX_RATE_COUNT)
        seconds = _seconds(per, "Rate per")
        if seconds <= 0:
            raise ValueError(f"Rate per must be more than 0 seconds, got {shown_number(per)}")
        self.__attrs_init__(count, seconds)


def _check_key_fn(key: object) -> None:
    if not callable(key):
        raise TypeError(
            f"Limits key must be a function of the start data returning a str, got"
            f" {describe(key, 200)}"
        )
    if inspect.iscoroutinefunction(key) or inspect.isasyncgenfunction(key):
        raise TypeError(
            f"Limits key must be a plain function (it is called at start, not awaited), got"
            f" {describe(key, 200)}"
        )


@final
@attrs.frozen(init=False)
class Limits:
    """How many flows of a plan may be active at once, in all and per key, and how fast they may
    start. Keyword-only; every bad value is refused here, at the definition."""

    concurrency: int | None
    key: KeyFn | None = attrs.field(eq=False)  # a function: compared by `stored`, not identity
    per_key: int | None
    rate: Rate | None

    def __init__(
        self,
        *,
        concurrency: int | None = None,
        key: KeyFn | None = None,
        per_key: int | None = None,
        rate: Rate | None = None,
    ) -> None:
        if concurrency is not None:
            concurrency = _whole(concurrency, "Limits concurrency", 1)
        if key is not None:
            _check_key_fn(key)
        if per_key is not None:
            per_key = _whole(per_key, "Limits per_key", 1)
            if key is None:
                raise ValueError(
                    f"Limits per_key={per_key} needs a key function (key=lambda data: ...):"
                    " without one there is no key to count per"
                )
        if rate is not None and not isinstance(rate, Rate):
            raise TypeError(
                f"Limits rate must be a flow.Rate(count, per=seconds), got {describe(rate, 200)}"
            )
        if concurrency is None and per_key is None and rate is None:
            raise ValueError(
                "Limits() limits nothing: give concurrency=, per_key= (with key=) or rate=, or"
                " leave the plan's limits=None"
            )
        self.__attrs_init__(concurrency, key, per_key, rate)

    def stored(self) -> dict[str, Json]:
        """What engines of one fleet compare (the key function as whether there is one: code is
        not compared): JSON, in a fixed order."""
        rate = None if self.rate is None else [self.rate.count, self.rate.per]
        return {
            "concurrency": self.concurrency,
            "key": self.key is not None,
            "per_key": self.per_key,
            "rate": rate,
        }


@final
@attrs.frozen
class StartOptions:
    """A start's checked options: its `priority`, its `not_before` (a wall-clock time, or None:
    at once) and its `key` (None for a plan without a key function)."""

    priority: int
    not_before: float | None
    key: str | None


def start_priority(value: object) -> int:
    """A start's priority: a whole number (lower first), stored as BIGINT."""
    return _whole(value, "priority", MIN_PRIORITY)


_AT_HINT = " (a wall-clock time as time.time() gives it; for a datetime, give its .timestamp())"


def not_before(delay: object, at: object, now: float) -> float | None:
    """When a flow started at `now` may run: ``now + delay``, `at`, or None (at once). Both
    given is a `ValueError`; a delay < 0 too (an `at` in the past is at once)."""
    if delay is not None and at is not None:
        raise ValueError(
            f"give delay= or at=, not both (got delay={describe(delay, 60)}, at={describe(at, 60)})"
        )
    if delay is not None:
        seconds = _seconds(delay, "delay")
        if seconds < 0:
            raise ValueError(f"delay must be 0 seconds or more, got {shown_number(delay)}")
        when = now + seconds
        if not finite(when):
            raise ValueError(f"delay={shown_number(delay)} puts the start past any time")
        return when
    if at is not None:
        return _seconds(at, "at", hint=_AT_HINT)
    return None


def flow_key(limits: Limits | None, plan: str, data: Json) -> str | None:
    """The key of a flow of plan `plan` started with `data`: its `Limits.key` called once, its
    answer checked; None if the plan has no key function."""
    fn = None if limits is None else limits.key
    if fn is None:
        return None
    try:
        value: Any = fn(data)
    except Exception as exc:
        raise ValueError(
            f"the key function of plan {plan!r} raised {describe(exc, 300)} for this start's data:"
            " every flow of a plan with a key needs one (make the function total, or give the"
            " data it reads)"
        ) from exc
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()  # never to be awaited: no "never awaited" warning
        raise TypeError(
            f"the key function of plan {plan!r} returned an awaitable: it must be a plain"
            " function returning a str"
        )
    if not isinstance(value, str):
        raise TypeError(
            f"the key function of plan {plan!r} must return a str, got {describe(value, 200)}"
        )
    key = str.__str__(value)  # a str subclass (an enum's member) as its text
    problem = text_problem(key)
    if problem is not None:
        raise ValueError(
            f"the key {describe(key, 200)} of plan {plan!r} cannot be stored: {problem}"
        )
    size = len(key.encode("utf-8"))
    if size > MAX_KEY_BYTES:
        raise ValueError(
            f"the key of plan {plan!r} is {size} bytes of UTF-8, more than {MAX_KEY_BYTES}: keys"
            f" are index entries (give a short id, or a hash of a long one): {describe(key, 80)}"
        )
    return key


def start_options(
    limits: Limits | None,
    plan: str,
    data: Json,
    *,
    priority: object = 0,
    delay: object = None,
    at: object = None,
    now: float,
) -> StartOptions:
    """Every start option checked at the call, in the order of the signature ``start(plan,
    data, priority=, delay=, at=)``: nothing is stored if one is bad."""
    return StartOptions(
        start_priority(priority), not_before(delay, at, now), flow_key(limits, plan, data)
    )


@final
@attrs.frozen
class Queue:
    """A start's queue options as given (`Engine.start(priority=, delay=, at=)`), unchecked."""

    priority: object = 0
    delay: object = None
    at: object = None


NO_QUEUE: Final = Queue()


def _only_time() -> Limits:
    made = object.__new__(Limits)
    made.__attrs_init__(None, None, None, None)
    return made


#: The budget of a plan without limits that was given a delayed start (docs/adr/0180): it
#: limits nothing and keeps the queue's times only; registered by that start's transaction.
ONLY_TIME: Final = _only_time()


def checked_start(
    limits: Limits | None, plan: str, data: Json, queue: Queue, now: float
) -> StartOptions:
    """`start_options` of a start of `plan` (with `limits`) given `queue` at `now`. A delayed
    start (`delay`, `at`) of a plan without limits waits in its plan's queue all the same, whose
    budget then limits nothing (`ONLY_TIME`, docs/adr/0180)."""
    return start_options(
        limits, plan, data, priority=queue.priority, delay=queue.delay, at=queue.at, now=now
    )


def stored(limits: Limits | None) -> dict[str, Json] | None:
    """What a store keeps of a plan version's limits (`Limits.stored`), None for none."""
    return None if limits is None else limits.stored()


def _stored_key(data: Json) -> str:
    """The key function of limits read back from a store (`from_stored`): the code is the
    engines' own, never stored, so a process without the plan cannot compute a key."""
    raise ValueError(
        "this process has the plan's limits as a store keeps them, not its key function: a key"
        " is computed by an engine that has the plan"
    )


def from_stored(value: Json) -> Limits:
    """The `Limits` that `Limits.stored` gave `value` (its key function a stand-in that
    raises: code is not stored). `ValueError` for a value `stored` cannot have made."""
    if not isinstance(value, dict):
        raise ValueError(f"stored limits must be an object, got {describe(value, 200)}")
    rate = value.get("rate")
    if rate is not None and not (isinstance(rate, list) and len(rate) == 2):
        raise ValueError(f"a stored rate must be [count, per], got {describe(rate, 200)}")
    concurrency, per_key = value.get("concurrency"), value.get("per_key")
    if concurrency is None and per_key is None and rate is None:
        return ONLY_TIME  # a plan without limits whose delayed starts made its queue
    return Limits(
        concurrency=concurrency if isinstance(concurrency, int) else None,
        key=_stored_key if value.get("key") else None,
        per_key=per_key if isinstance(per_key, int) else None,
        rate=None if rate is None else Rate(rate[0], per=rate[1]),
    )


def same_as_registered(
    plan: str, version: int, ours: Limits | None, theirs: Json, where: str
) -> None:
    """Refuse, naming both, a (plan, version) whose limits differ from those it was registered
    with (`theirs`, as `stored` gave them, by `where`: an engine's name): engines of one fleet
    must enforce one budget. A `ValueError`; nothing if they agree."""
    mine = stored(ours)
    if mine == theirs:
        return
    raise ValueError(
        f"plan {plan!r} version {version} is registered by {where} with limits {theirs}, and"
        f" this engine has {mine}: the engines of one store must give one plan version the same"
        " limits (change the version to change its limits)"
    )
