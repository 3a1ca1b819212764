"""`Plan`: a named, versioned list of steps, each with an optional compensation.

Definition errors are raised where they are made: a step or compensation that is not an
``async def`` is a `TypeError`; a duplicate step name, a step name that is empty or holds ``/``
(so that an idempotency key names one flow and step), a version outside 1..2**31-1,
``attempts < 1`` and (at `open_engine`) an empty plan are `ValueError`s. A plan is closed once
an engine has it: adding a step to it then is an error, because flows in flight depend on its
exact list of steps (change the version instead).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, final, overload

import attrs

from ._checks import describe, text_problem
from ._limits import Limits
from ._types import Context
from ._values import Shape

StepFn = Callable[[Context], Awaitable[Any]]
CompensateFn = Callable[[Context], Awaitable[None]]
F = TypeVar("F", bound=StepFn)

MAX_VERSION = 2**31 - 1  # a version is stored as a 32-bit integer


@final
@attrs.frozen
class StepDef:
    """One step of a plan, as declared."""

    name: str
    fn: StepFn
    compensate: CompensateFn | None
    attempts: int


def _check_async(what: str, fn: object) -> None:
    """`fn` must be an ``async def`` that takes one argument, the `Context`."""
    if not callable(fn):
        raise TypeError(f"{what} must be an async function, got {fn!r}")
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{what} must be an async function (async def), got {fn!r}: steps and compensations"
            " are awaited by the engine"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: the engine's call will tell
        return
    try:
        signature.bind(None)
    except TypeError:
        raise TypeError(
            f"{what} must take one argument, the flow.Context (async def"
            f" {getattr(fn, '__name__', 'step')}(ctx: flow.Context)), got {fn!r} taking"
            f" {signature}"
        ) from None


@final
class Plan:
    """A business process: steps that run in declaration order.

    ``Plan(name, version=1, limits=None)``; `limits` (a `flow.Limits`) caps how many of its
    flows are active at once, in all and per key, and how fast they start (SPEC 5.8). Add
    steps with ``@plan.step`` or ``@plan.step(name=..., compensate=..., attempts=...)``. Give
    the plan to `open_engine`; several versions of one plan may be registered at once, and a
    flow always resumes on the version it started with.
    """

    __slots__ = ("_closed", "_shape", "_steps", "limits", "name", "version")

    def __init__(self, name: str, version: int = 1, limits: Limits | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError(f"a plan's name must be a str, got {name!r}")
        if not name:
            raise ValueError("a plan's name must not be empty")
        problem = text_problem(name)
        if problem is not None:
            raise ValueError(f"a plan's name cannot be stored: {problem}")
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"a plan's version must be an int, got {version!r}")
        if not 1 <= version <= MAX_VERSION:
            raise ValueError(
                f"a plan's version must be an int in 1..{MAX_VERSION} (2**31-1), got {version!r}"
            )
        if limits is not None and not isinstance(limits, Limits):
            raise TypeError(
                f"a plan's limits must be a flow.Limits(...) or None, got {describe(limits, 200)}"
            )
        self.name = name
        self.version = version
        self.limits = limits
        self._steps: tuple[StepDef, ...] = ()
        self._closed = False
        self._shape: Shape | None = None

    @property
    def steps(self) -> tuple[StepDef, ...]:
        """The steps, in order."""
        return self._steps

    @overload
    def step(self, fn: F, /) -> F: ...

    @overload
    def step(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        compensate: CompensateFn | None = None,
        attempts: int = 3,
    ) -> Callable[[F], F]: ...

    def step(
        self,
        fn: F | None = None,
        /,
        *,
        name: str | None = None,
        compensate: CompensateFn | None = None,
        attempts: int = 3,
    ) -> F | Callable[[F], F]:
        """Add a step (a decorator, bare or with keywords); returns the function unchanged.

        `name`: the step's name (default: the function's). `compensate`: an ``async def (ctx)``
        that undoes the step, or None. `attempts` (>= 1): how many times the step (and its
        compensation) is tried when it raises, with backoff from 0.1 s doubling, before it counts
        as failed. Raises `TypeError`/`ValueError` at once for a bad definition.
        """
        if isinstance(fn, str):
            raise TypeError(
                f"@plan.step({fn!r}): a step's name is given by keyword, @plan.step(name={fn!r})"
            )
        if isinstance(attempts, bool) or not isinstance(attempts, int):
            raise TypeError(f"attempts must be an int, got {attempts!r}")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts!r}")
        if compensate is not None:
            _check_async("compensate", compensate)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"a step's name must be a str, got {name!r}")

        def add(f: F) -> F:
            _check_async("a step", f)
            step_name = name if name is not None else getattr(f, "__name__", None)
            if not isinstance(step_name, str) or not step_name:
                raise ValueError(f"a step needs a name (name=...), got {step_name!r}")
            if "/" in step_name:
                raise ValueError(
                    f"a step's name must not hold '/', got {step_name!r}: the idempotency key"
                    " flow_id/step_index/step must name one flow and step only"
                )
            problem = text_problem(step_name)
            if problem is not None:
                raise ValueError(f"step name {step_name!r} cannot be stored: {problem}")
            if self._closed:
                raise ValueError(
                    f"plan {self.name!r} version {self.version} is already registered with an"
                    " engine: define every step before open_engine (or make a new version)"
                )
            if any(s.name == step_name for s in self._steps):
                raise ValueError(
                    f"plan {self.name!r} already has a step named {step_name!r}: step names"
                    " must be unique (name=...)"
                )
            self._steps += (StepDef(step_name, f, compensate, attempts),)
            return f

        if fn is not None:
            return add(fn)
        return add

    def _close(self) -> Shape:
        """Freeze the plan for an engine; raises `ValueError` if it has no step."""
        if not self._steps:
            raise ValueError(f"plan {self.name!r} version {self.version} has no steps")
        if self._shape is None:
            self._closed = True
            self._shape = Shape(
                name=self.name,
                version=self.version,
                steps=tuple(s.name for s in self._steps),
                compensable=tuple(s.compensate is not None for s in self._steps),
                attempts=tuple(s.attempts for s in self._steps),
                limits=self.limits,
            )
        return self._shape

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self._steps)
        return f"<flow.Plan {self.name!r} v{self.version}: {names}>"
