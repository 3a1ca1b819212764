"""The public face of ferry: `open_ferry`, `open_per_key_ferry`, and the ferries they make.

Options are checked here; everything else is the shell's (`ferry._shell`, the tasks) and the
room's (`ferry._room`, the state and its transactions, over the pure core `ferry._lanes`).
A ferry belongs to the trio run that opened it: call it only from tasks of that run.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Awaitable, Callable, Hashable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar, final, overload

from . import _lanes
from ._shell import Shell
from ._stats import FerryStatistics

I = TypeVar("I")  # noqa: E741  (input)
O = TypeVar("O")  # noqa: E741  (output of the batch call)
R = TypeVar("R")  # result of one caller
K = TypeVar("K")

_PLAIN_KEY = None  # the plain ferry's one room is a single lane under this key

#: Seconds a batch call or a direct call may run before it is cancelled and its callers get
#: `Failed` (cause: `trio.TooSlowError`). Far above any call that works; see ADR 0015.
DEFAULT_CALL_TIMEOUT = 60.0


# ---------------------------------------------------------------------------- option checking


def _check_int(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value!r}")
    return value


def _check_real(name: str, value: object, *, positive: bool, finite: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v) or v < 0 or (positive and v == 0) or (finite and math.isinf(v)):
        need = "> 0" if positive else ">= 0"
        kind = "finite number" if finite else "number"
        raise ValueError(f"{name} must be a {kind} {need}, got {value!r}")
    return v


def _check_bound(value: object, workers: int) -> float:
    if value is None:
        return workers
    if value == math.inf:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            "max_in_flight_calls must be an int >= 1, math.inf (direct calls not bounded), or "
            f"None (the default: max_in_flight_batches), got {value!r}"
        )
    return value


def _check_callable(name: str, value: object) -> None:
    if not callable(value):
        raise ValueError(f"{name} must be callable, got {value!r}")


def _check_async(call: object) -> None:
    """Refuse a `call` that is surely not async: a plain function, lambda or builtin.

    Unwraps `functools.partial` and bound methods. A callable object is accepted as it is (its
    `__call__` may return an awaitable); what it returns is checked at each call instead.
    """
    _check_callable("call", call)
    fn: Any = call
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.ismethod(fn):
        fn = fn.__func__
    if not (inspect.isfunction(fn) or inspect.isbuiltin(fn)) or inspect.iscoroutinefunction(fn):
        return
    what = "an async generator function" if inspect.isasyncgenfunction(fn) else "not async"
    raise TypeError(
        f"call must be an async function (async def), but {call!r} is {what}: the ferry awaits "
        "call(...) for every batch. Wrap a function that returns an awaitable in an async def "
        "that awaits it."
    )


def _stats_deprecated() -> None:
    warnings.warn(
        "stats() is deprecated and will be removed in the next release: call statistics(), "
        "the name trio and stm.statistics() use",
        DeprecationWarning,
        stacklevel=3,
    )


# ------------------------------------------------------------------------------- the plain ferry


@final
class Ferry(Generic[I, R]):
    """A plain ferry: `await f(x)` from many tasks becomes a few `call(inputs)` calls.

    Made by `open_ferry`; has no public constructor.
    """

    __slots__ = ("_shell",)

    def __init__(self, shell: Shell) -> None:
        self._shell = shell

    async def __call__(self, x: I, /) -> R:
        """Submit `x` and wait for its result. Always a checkpoint.

        Raises `Rejected` (room full), `Failed` (the batch call raised or ran past
        `call_timeout`), `BatchContractError` (malformed output), `Closed` (the ferry closed), or
        `trio.Cancelled` (the caller's scope); `RuntimeError` if called from outside the trio run
        that opened the ferry.
        """
        result: R = await self._shell.submit(x, _PLAIN_KEY, 1.0, None)
        return result

    def statistics(self) -> FerryStatistics:
        """A snapshot of the waiting room and the counters; one TVar peek, no checkpoint."""
        return self._shell.statistics()

    def stats(self) -> FerryStatistics:
        """Deprecated alias of `statistics()`, kept for one release."""
        _stats_deprecated()
        return self._shell.statistics()

    def __repr__(self) -> str:
        s = self._shell.statistics()
        return f"<ferry.Ferry queued={s.queued} busy={s.busy} batches={s.batches}>"


@overload
def open_ferry(
    call: Callable[[list[I]], Awaitable[Sequence[R]]],
    *,
    max_batch_size: int = ...,
    max_batch_delay: float = ...,
    max_in_flight_batches: int = ...,
    call_timeout: float = ...,
    max_queueing: int = ...,
    extract: None = None,
) -> AbstractAsyncContextManager[Ferry[I, R]]: ...


@overload
def open_ferry(
    call: Callable[[list[I]], Awaitable[O]],
    *,
    max_batch_size: int = ...,
    max_batch_delay: float = ...,
    max_in_flight_batches: int = ...,
    call_timeout: float = ...,
    max_queueing: int = ...,
    extract: Callable[[O, I], R],
) -> AbstractAsyncContextManager[Ferry[I, R]]: ...


def open_ferry(
    call: Callable[[list[Any]], Awaitable[Any]],
    *,
    max_batch_size: int = 100,
    max_batch_delay: float = 0.0,
    max_in_flight_batches: int = 4,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    max_queueing: int = 10_000,
    extract: Callable[[Any, Any], Any] | None = None,
) -> AbstractAsyncContextManager[Ferry[Any, Any]]:
    """Open a plain ferry over `call(inputs) -> outputs` for the duration of an `async with`.

    `call` must be async (`TypeError` otherwise). Options are checked here (`ValueError` naming
    the option); each call is cancelled after `call_timeout` seconds (ADR 0015). Leaving the
    block closes the ferry: callers still waiting get `Closed`, workers are cancelled, nothing
    outlives the block.
    """
    _check_async(call)
    if extract is not None:
        _check_callable("extract", extract)
    limits = _lanes.Limits(
        max_batch_size=_check_int("max_batch_size", max_batch_size, 1),
        max_batch_delay=_check_real(
            "max_batch_delay", max_batch_delay, positive=False, finite=True
        ),
        max_queueing=_check_int("max_queueing", max_queueing, 1),
        direct_calls=False,
        one_in_flight=False,
    )
    workers = _check_int("max_in_flight_batches", max_in_flight_batches, 1)
    timeout = _check_real("call_timeout", call_timeout, positive=True, finite=False)
    shell = Shell(call, extract, limits, workers, timeout, plain=True)
    return shell.lifetime(Ferry(shell))


# ----------------------------------------------------------------------------- the per-key ferry


@final
class PerKeyFerry(Generic[I, R]):
    """A per-key ferry: one call in flight per key, batches taken fairly across keys.

    Made by `open_per_key_ferry`; has no public constructor.
    """

    __slots__ = ("_key", "_max_weight", "_rank", "_shell", "_weight")

    def __init__(
        self,
        shell: Shell,
        key: Callable[[I], Hashable],
        rank: Callable[[I], Any] | None,
        weight: Callable[[I], float] | None,
        max_weight: float,
    ) -> None:
        self._shell = shell
        self._key = key
        self._rank = rank
        self._weight = weight
        self._max_weight = max_weight

    async def __call__(self, x: I, /) -> R:
        """Submit `x` to its key's lane and wait for its result. Always a checkpoint.

        `key(x)`, `rank(x)` and `weight(x)` run first: if one raises, or gives a bad value
        (`TypeError`: unhashable key or non-numeric weight; `ValueError`: negative, NaN or
        infinite weight, or one above `max_queued_weight`), the caller gets that at once and
        nothing is admitted. Then: the result, `Rejected`, `Failed`, `BatchContractError`,
        `Closed`, or `trio.Cancelled` (docs/errors-and-lifecycle.md); `RuntimeError` if called
        from outside the trio run that opened the ferry.
        """
        key = self._key(x)
        try:
            hash(key)
        except TypeError:
            raise TypeError(
                f"key(x) must return a hashable value; got {type(key).__name__} for {x!r}"
            ) from None
        rank = None
        if self._rank is not None:
            rank = self._rank(x)
            if rank is None:
                raise TypeError(f"rank(x) returned None for {x!r}; return a comparable value")
        w = 1.0 if self._weight is None else self._checked_weight(x)
        result: R = await self._shell.submit(x, key, w, rank)
        return result

    def _checked_weight(self, x: I) -> float:
        assert self._weight is not None
        w = self._weight(x)
        if isinstance(w, bool) or not isinstance(w, int | float):
            raise TypeError(f"weight(x) must return a number; got {type(w).__name__} for {x!r}")
        w = float(w)
        if not (0.0 <= w < math.inf):
            raise ValueError(f"weight(x) must be a finite number >= 0; got {w!r} for {x!r}")
        if w > self._max_weight:
            raise ValueError(
                f"weight(x) is {w!r}, above max_queued_weight={self._max_weight!r}: "
                f"it could never be admitted ({x!r})"
            )
        return w

    def statistics(self) -> FerryStatistics:
        """A snapshot of the lanes and the counters; one TVar peek, no checkpoint."""
        return self._shell.statistics()

    def stats(self) -> FerryStatistics:
        """Deprecated alias of `statistics()`, kept for one release."""
        _stats_deprecated()
        return self._shell.statistics()

    def __repr__(self) -> str:
        s = self._shell.statistics()
        return (
            f"<ferry.PerKeyFerry lanes={s.lanes} queued={s.queued} busy={s.busy} "
            f"batches={s.batches}>"
        )


@overload
def open_per_key_ferry(
    call: Callable[[K, list[I]], Awaitable[Sequence[R]]],
    *,
    key: Callable[[I], K],
    rank: Callable[[I], Any] | None = ...,
    weight: Callable[[I], float] | None = ...,
    max_batch_size: int = ...,
    max_batch_weight: float = ...,
    max_batch_delay: float = ...,
    max_in_flight_batches: int = ...,
    call_timeout: float = ...,
    max_queueing: int = ...,
    max_queued_weight: float = ...,
    direct_calls: bool = ...,
    max_in_flight_calls: float | None = ...,
    extract: None = None,
) -> AbstractAsyncContextManager[PerKeyFerry[I, R]]: ...


@overload
def open_per_key_ferry(
    call: Callable[[K, list[I]], Awaitable[O]],
    *,
    key: Callable[[I], K],
    rank: Callable[[I], Any] | None = ...,
    weight: Callable[[I], float] | None = ...,
    max_batch_size: int = ...,
    max_batch_weight: float = ...,
    max_batch_delay: float = ...,
    max_in_flight_batches: int = ...,
    call_timeout: float = ...,
    max_queueing: int = ...,
    max_queued_weight: float = ...,
    direct_calls: bool = ...,
    max_in_flight_calls: float | None = ...,
    extract: Callable[[O, I], R],
) -> AbstractAsyncContextManager[PerKeyFerry[I, R]]: ...


def open_per_key_ferry(
    call: Callable[[Any, list[Any]], Awaitable[Any]],
    *,
    key: Callable[[Any], Any],
    rank: Callable[[Any], Any] | None = None,
    weight: Callable[[Any], float] | None = None,
    max_batch_size: int = 100,
    max_batch_weight: float = math.inf,
    max_batch_delay: float = 0.0,
    max_in_flight_batches: int = 4,
    call_timeout: float = DEFAULT_CALL_TIMEOUT,
    max_queueing: int = 10_000,
    max_queued_weight: float = math.inf,
    direct_calls: bool = True,
    max_in_flight_calls: float | None = None,
    extract: Callable[[Any, Any], Any] | None = None,
) -> AbstractAsyncContextManager[PerKeyFerry[Any, Any]]:
    """Open a per-key ferry over `call(key, inputs) -> outputs` for an `async with` block.

    At most one call is in flight per key; keys with inputs ready are served first come, first
    served. At most `max_in_flight_calls` calls are in flight at once, batched or direct (default:
    `max_in_flight_batches`; `math.inf`: direct calls are not bounded); an input for an idle key
    is sent at once by its caller only while fewer calls are in flight or ready to go (ADR 0031).
    `call` must be async (`TypeError` otherwise). Options are checked here (`ValueError` naming
    the option); each call is cancelled after `call_timeout` seconds (ADR 0015).
    """
    _check_async(call)
    _check_callable("key", key)
    for name, fn in (("rank", rank), ("weight", weight), ("extract", extract)):
        if fn is not None:
            _check_callable(name, fn)
    if not isinstance(direct_calls, bool):
        raise ValueError(f"direct_calls must be a bool, got {direct_calls!r}")
    max_queued_weight = _check_real(
        "max_queued_weight", max_queued_weight, positive=True, finite=False
    )
    max_queueing = _check_int("max_queueing", max_queueing, 0)
    max_batch_delay = _check_real("max_batch_delay", max_batch_delay, positive=False, finite=True)
    if max_queueing == 0 and not (direct_calls and max_batch_delay == 0):
        raise ValueError(
            "max_queueing=0 leaves no room to wait in: with direct calls on and zero delay it "
            "means 'direct calls only' (a call for a busy key is rejected); otherwise every call "
            "would be rejected. Give max_queueing >= 1."
        )
    workers = _check_int("max_in_flight_batches", max_in_flight_batches, 1)
    bound = _check_bound(max_in_flight_calls, workers)
    limits = _lanes.Limits(
        max_in_flight=bound,
        max_batch_size=_check_int("max_batch_size", max_batch_size, 1),
        max_batch_weight=_check_real(
            "max_batch_weight", max_batch_weight, positive=True, finite=False
        ),
        max_batch_delay=max_batch_delay,
        max_queueing=max_queueing,
        max_queued_weight=max_queued_weight,
        direct_calls=direct_calls,
        one_in_flight=True,
    )
    timeout = _check_real("call_timeout", call_timeout, positive=True, finite=False)
    shell = Shell(call, extract, limits, workers, timeout, plain=False)
    return shell.lifetime(PerKeyFerry(shell, key, rank, weight, max_queued_weight))
