"""A property test of `ferry.flow`'s public engine API: random plans, outcomes, data, ids, wakes,
cancels, closes and reopens on a real SQLite file, checked against a model of what each flow
must do.

How it runs
-----------
A `RuleBasedStateMachine` (`FlowMachine`): each example draws a few plans (1-4 steps, some with
compensations, random `attempts`) whose steps follow a *script*: what attempt 1, 2, 3 of the
step does (return an outcome, well-formed or malformed, after changing ``ctx.data`` to a good or
a bad value; raise; or never return). Rules start flows (good and bad input, in one concurrent
batch), wake them (one concurrent batch), publish an event (a wake, then a start), cancel them,
resume them, move time past the parks' deadlines, and close and reopen the engine.

The engine lives in one `trio.run` per example, in a thread of its own (`_TrioThread`): a rule
runs its calls there with `trio.from_thread.run` and waits until every flow has come to rest
(the revision, state and step runs the model predicts). The run's clock is a `MockClock`: it
stands still between rules, and during a rule it jumps once no task has run for `_IDLE` real
seconds, but at most `_TICK` at a time (a ticking task): a store that runs its transactions in
a worker thread leaves every task blocked meanwhile, and a free jump would reach a park's
timeout (`_BIG`, about 30 years), which only the `advance` rule may reach, on purpose.
Docs/adr/0070 says why.

The oracle
----------
- The engine never raises out of its ``async with`` for a flow's own problem (a crash fails the
  rule that saw it, with the engine's exception as the cause).
- Bad input at a call (not JSON, a lone surrogate, too deep, too big, a wrong type, an empty or
  unencodable id) raises `TypeError`/`ValueError` at that call and stores nothing; the good calls
  of the same concurrent batch go through.
- Every flow comes to rest where the model says: the model runs each flow alone, from the
  contract (a malformed outcome or data fails the flow alone: it compensates and ends FAILED
  with an error naming the step), so a flow's outcome is what it would be alone. Its steps run
  in the order, with the attempts, `ctx.wake` and `ctx.timed_out` the model predicts, its
  `revision` grows by one per write, its data is the model's.
- At the end (`teardown`): every flow is COMPLETED, FAILED, BLOCKED or PARKED (with a deadline
  if and only if its park had a timeout), except the ones whose step never returns; no step's
  outcome (nor a compensation) is recorded twice in its history; attempts of a (flow, step)
  count 1, 2, 3, ... without repeats; no idempotency key is shared by two (flow, step, step or
  compensation).

The quick profile runs in `make test`; `test_flow_properties_long` (``-m long``) digs deeper.
`tests/flow/test_properties_planted.py` shows that the oracle catches planted bugs.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ferry import flow

T = TypeVar("T")

_TICK = 0.05  # the most the mock clock jumps at a time during a rule (virtual seconds)
_IDLE = 0.0005  # real seconds of no task running after which the clock jumps (during a rule)
_POLL = 0.05  # how often a rule reads the flows while they come to rest (virtual seconds)
_REST_BUDGET = 60.0  # virtual seconds a rule waits for its flows to move on (`_rest`)
_BIG = 1e9  # a park timeout that only the `advance` rule reaches
_ADVANCE = 1.5e9  # what `advance` adds to the clock: past every `_BIG` park of this open


# ------------------------------------------------------------------------------------ scripts

# What a step returns, by name: (make it, what it means). The meaning is the model's: ("continue",),
# ("complete",), ("park", timeout, on_timeout), ("fail", reason), or ("bad",) for anything the
# contract calls malformed.


async def _never_awaited() -> None:  # pragma: no cover - a coroutine returned, never run
    pass


OUTCOMES: dict[str, tuple[Callable[[], object], tuple[Any, ...]]] = {
    "none": (lambda: None, ("continue",)),
    "continue": (lambda: flow.CONTINUE, ("continue",)),
    "complete": (lambda: flow.COMPLETE, ("complete",)),
    "park": (lambda: flow.park(), ("park", None, "compensate")),
    "park-continue": (lambda: flow.park(on_timeout="continue"), ("park", None, "continue")),
    "park-0": (lambda: flow.park(0), ("park", 0.0, "compensate")),
    "park-0-continue": (lambda: flow.park(0, "continue"), ("park", 0.0, "continue")),
    "park-big": (lambda: flow.park(_BIG), ("park", _BIG, "compensate")),
    "park-big-continue": (lambda: flow.park(_BIG, "continue"), ("park", _BIG, "continue")),
    "fail": (lambda: flow.fail("out of stock"), ("fail", "out of stock")),
    "fail-odd": (lambda: flow.fail("why?\n/ é"), ("fail", "why?\n/ é")),
    # malformed
    "Park('60')": (lambda: flow.Park("60", "continue"), ("bad",)),  # type: ignore[arg-type]
    "Park(-1)": (lambda: flow.Park(-1, "continue"), ("bad",)),
    "Park(nan)": (lambda: flow.Park(math.nan, "compensate"), ("bad",)),
    "Park(inf)": (lambda: flow.Park(math.inf, "continue"), ("bad",)),
    "Park(True)": (lambda: flow.Park(True, "continue"), ("bad",)),
    "Park(on_timeout=?)": (lambda: flow.Park(None, "explode"), ("bad",)),  # type: ignore[arg-type]
    "Fail(exception)": (lambda: flow.Fail(RuntimeError("x")), ("bad",)),  # type: ignore[arg-type]
    "Fail(None)": (lambda: flow.Fail(None), ("bad",)),  # type: ignore[arg-type]
    "42": (lambda: 42, ("bad",)),
    "'done'": (lambda: "done", ("bad",)),
    "flow.park": (lambda: flow.park, ("bad",)),
    "a coroutine": (_never_awaited, ("bad",)),
}
GOOD_OUTCOMES = [k for k, (_, meaning) in OUTCOMES.items() if meaning[0] != "bad"]
BAD_OUTCOMES = [k for k, (_, meaning) in OUTCOMES.items() if meaning[0] == "bad"]


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


# Values a step (or a start, or a wake) may give that cannot be stored; each is built afresh.
BAD_VALUES: dict[str, Callable[[], object]] = {
    "deep-100": lambda: _nested(100),
    "deep-5000": lambda: _nested(5000),
    "big": lambda: "x" * (1 << 20),
    "lone-surrogate": lambda: "caf\udce9",
    "set": lambda: {1, 2},
    "tuple": lambda: (1, 2),
    "nan": lambda: math.nan,
    "int-key": lambda: {1: "a"},
    "bytes": lambda: b"\xff",
}


@attrs.frozen
class Act:
    """What one attempt of a step does: ``hang`` (never returns), ``raise``, or ``return`` the
    outcome named `outcome` after setting ``ctx.data["s<index>"]`` as `change` says (None: no
    change; "good": `value`, a JSON value, with the attempt number; else the `BAD_VALUES` of
    that name)."""

    kind: str
    outcome: str = "none"
    change: str | None = None
    value: Any = None


@attrs.frozen
class CompAct:
    """What one attempt of a compensation does: ``ok`` (after a good data change), ``raise`` or
    ``hang``."""

    kind: str


@attrs.frozen
class StepSpec:
    name: str
    attempts: int
    script: tuple[Act, ...]  # attempt k follows script[k - 1]; the last one from then on
    comp: tuple[CompAct, ...] | None

    def act(self, attempt: int) -> Act:
        return self.script[min(attempt, len(self.script)) - 1]

    def comp_act(self, attempt: int) -> CompAct:
        assert self.comp is not None
        return self.comp[min(attempt, len(self.comp)) - 1]


@attrs.frozen
class PlanSpec:
    name: str
    steps: tuple[StepSpec, ...]


def _good_value(attempt: int, value: Any = "é\n/ü") -> dict[str, Any]:
    return {"attempt": attempt, "value": value}


# -------------------------------------------------------------------------------- what ran


@attrs.frozen(kw_only=True)
class Run:
    """One run of a step's or compensation's body, as the body saw it."""

    flow_id: str
    step_index: int
    step: str
    compensation: bool
    attempt: int
    wake: Any
    timed_out: bool
    key: str

    def seen(self) -> tuple[Any, ...]:
        """What the model predicts of it (the key is checked apart: only its uniqueness is
        part of the contract)."""
        return (self.step_index, self.step, self.compensation, self.attempt, self.wake,
                self.timed_out)  # fmt: skip


def _run_of(ctx: flow.Context, *, compensation: bool) -> Run:
    return Run(
        flow_id=ctx.flow_id,
        step_index=ctx.step_index,
        step=ctx.step,
        compensation=compensation,
        attempt=ctx.attempt,
        wake=ctx.wake,
        timed_out=ctx.timed_out,
        key=ctx.idempotency_key,
    )


def _build_plan(spec: PlanSpec, runs: list[Run]) -> flow.Plan:
    """The `flow.Plan` of `spec`, whose bodies append a `Run` to `runs` and follow the script."""
    plan = flow.Plan(spec.name)
    for index, s in enumerate(spec.steps):

        async def body(ctx: flow.Context, s: StepSpec = s, index: int = index) -> object:
            runs.append(_run_of(ctx, compensation=False))
            act = s.act(ctx.attempt)
            if act.kind == "hang":
                await trio.sleep_forever()
            if act.kind == "raise":
                raise RuntimeError(f"planned failure of step {s.name!r}")
            if act.change == "good":
                ctx.data[f"s{index}"] = _good_value(ctx.attempt, act.value)
            elif act.change is not None:
                ctx.data[f"s{index}"] = BAD_VALUES[act.change]()
            await trio.lowlevel.checkpoint()
            return OUTCOMES[act.outcome][0]()

        async def compensate(ctx: flow.Context, s: StepSpec = s, index: int = index) -> None:
            runs.append(_run_of(ctx, compensation=True))
            act = s.comp_act(ctx.attempt)
            if act.kind == "hang":
                await trio.sleep_forever()
            if act.kind == "raise":
                raise RuntimeError(f"planned failure of the compensation of {s.name!r}")
            ctx.data[f"c{index}"] = _good_value(ctx.attempt)

        plan.step(name=s.name, attempts=s.attempts, compensate=compensate if s.comp else None)(body)
    return plan


# ---------------------------------------------------------------------------------- the model

_RUNNING, _PARKED, _COMPENSATING = flow.State.RUNNING, flow.State.PARKED, flow.State.COMPENSATING
_COMPLETED, _FAILED, _BLOCKED = flow.State.COMPLETED, flow.State.FAILED, flow.State.BLOCKED
_TERMINAL = (_COMPLETED, _FAILED)


@attrs.define
class MFlow:
    """The model of one flow: where the contract says it is."""

    flow_id: str
    plan: PlanSpec
    start_text: str  # canonical start data (the idempotent start compares it)
    data: dict[str, Any]
    state: flow.State = _RUNNING
    index: int = 0
    attempt: int = 1
    # Runs of the current body that raised since this engine began driving it: `attempts` of
    # them fail the step (or block the compensation). A run that a close interrupted did not
    # raise, and each engine starts counting again (the engine's rule; the contract does not
    # say whether raises before a reopen count).
    raises: int = 0
    revision: int = 1
    stack: list[int] = attrs.field(factory=list)
    wake: Any = None
    timed_out: bool = False
    deadline: float | None = None  # model time (see `Model.now`)
    has_timeout: bool = False
    on_timeout: str | None = None
    error: tuple[str, str] | None = None  # ("is", text) or ("names", step name)
    blocked_from: flow.State | None = None
    hung: bool = False  # its current step or compensation never returns (until a close)
    queued: list[tuple[str, Any]] = attrs.field(factory=list)
    seen: set[str] = attrs.field(factory=set)
    stale: set[str] = attrs.field(factory=set)
    runs: list[tuple[Any, ...]] = attrs.field(factory=list)  # `Run.seen()`, in order

    @property
    def step(self) -> StepSpec:
        return self.plan.steps[self.index]


def _text(data: object) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class Model:
    """Every flow, run alone by the contract. `now` is the engine's wall clock in seconds since
    the engine opened (a reopen starts it again near 0: durable times come from the wall clock
    at open plus the trio clock since, and the trio clock jumps here only by `_ADVANCE`; the
    model's decisions never come within `_BIG / 2` of a deadline)."""

    def __init__(self) -> None:
        self.flows: dict[str, MFlow] = {}
        self.now = 0.0

    # --- a flow's own course

    def settle(self, f: MFlow) -> None:
        """Run `f` until it rests: parked, hung, ended or blocked."""
        while not f.hung:
            if f.state is _RUNNING:
                self._run_step(f)
            elif f.state is _COMPENSATING:
                self._run_compensation(f)
            elif f.state is _PARKED and f.deadline is not None and f.deadline <= self.now:
                self.time_out(f)
            else:
                return

    def _record(self, f: MFlow, compensation: bool) -> None:
        f.runs.append(
            (f.index, f.step.name, compensation, f.attempt,
             None if compensation else f.wake, False if compensation else f.timed_out)
        )  # fmt: skip

    def _run_step(self, f: MFlow) -> None:
        s = f.step
        self._record(f, False)
        act = s.act(f.attempt)
        if act.kind == "hang":
            f.hung = True
            return
        if act.kind == "raise":
            f.raises += 1
            if f.raises < s.attempts:
                f.attempt += 1
                f.revision += 1
                return
            self._step_failed(f)
            return
        meaning = OUTCOMES[act.outcome][1]
        if meaning[0] == "bad" or act.change not in (None, "good"):
            self._step_failed(f)
            return
        f.revision += 1
        if act.change == "good":
            f.data[f"s{f.index}"] = _good_value(f.attempt, act.value)
        kind = meaning[0]
        if kind == "continue":
            self._push(f)
            self._advance(f, None, False)
        elif kind == "complete":
            self._end(f, _COMPLETED)
        elif kind == "park":
            self._push(f)
            _, timeout, on_timeout = meaning
            if f.queued:
                _message_id, payload = f.queued.pop(0)
                self._advance(f, payload, False)
                return
            f.state = _PARKED
            f.wake, f.timed_out = None, False
            f.has_timeout = timeout is not None
            f.deadline = None if timeout is None else self.now + timeout
            f.on_timeout = on_timeout
        else:
            assert kind == "fail"
            self._compensate(f, ("is", meaning[1]))

    def _step_failed(self, f: MFlow) -> None:
        f.revision += 1
        self._compensate(f, ("names", f.step.name))

    def _run_compensation(self, f: MFlow) -> None:
        s = f.step
        self._record(f, True)
        act = s.comp_act(f.attempt)
        if act.kind == "hang":
            f.hung = True
            return
        f.revision += 1
        if act.kind == "raise":
            f.raises += 1
            if f.raises < s.attempts:
                f.attempt += 1
                return
            f.state, f.blocked_from = _BLOCKED, _COMPENSATING
            return
        f.data[f"c{f.index}"] = _good_value(f.attempt)
        f.stack.pop()
        assert f.error is not None
        self._compensate(f, f.error)

    def _push(self, f: MFlow) -> None:
        if f.step.comp is not None:
            f.stack.append(f.index)

    def _advance(self, f: MFlow, wake: Any, timed_out: bool) -> None:
        """Past the current step (in the same write): the next step, or completed."""
        f.deadline, f.has_timeout, f.on_timeout = None, False, None
        if f.index + 1 >= len(f.plan.steps):
            self._end(f, _COMPLETED)
            return
        f.state, f.index, f.attempt, f.raises = _RUNNING, f.index + 1, 1, 0
        f.wake, f.timed_out = wake, timed_out

    def _compensate(self, f: MFlow, error: tuple[str, str]) -> None:
        f.error = error
        f.wake, f.timed_out = None, False
        f.deadline, f.has_timeout, f.on_timeout = None, False, None
        if f.stack:
            f.state, f.index, f.attempt, f.raises = _COMPENSATING, f.stack[-1], 1, 0
        else:
            self._end(f, _FAILED)

    def _end(self, f: MFlow, state: flow.State) -> None:
        f.state = state
        f.stack = []
        f.wake, f.timed_out = None, False
        f.deadline, f.has_timeout, f.on_timeout = None, False, None

    # --- from outside

    def time_out(self, f: MFlow) -> None:
        f.revision += 1
        if f.on_timeout == "continue":
            self._advance(f, None, True)
        else:
            self._compensate(f, ("names", f.step.name))

    def wake(self, fid: str, message_id: str | None, payload: Any) -> set[flow.Delivery]:
        """What the wake may answer (a set: a repeated id of a wake answered STALE may be
        answered STALE or DUPLICATE); the flow moves on as the first answer says."""
        f = self.flows.get(fid)
        if f is None:
            return {flow.Delivery.UNKNOWN}
        if message_id is not None and message_id in f.seen:
            return {flow.Delivery.DUPLICATE}
        if f.state in _TERMINAL or f.state is _COMPENSATING:
            if message_id is None:
                return {flow.Delivery.STALE}
            if message_id in f.stale:
                return {flow.Delivery.STALE, flow.Delivery.DUPLICATE}
            f.stale.add(message_id)
            return {flow.Delivery.STALE}
        if message_id is not None:
            f.seen.add(message_id)
        if f.state is _PARKED:
            f.revision += 1
            self._advance(f, payload, False)
            self.settle(f)
            return {flow.Delivery.RESUMED}
        f.queued.append((message_id or "", payload))
        return {flow.Delivery.QUEUED}

    def cancel(self, fid: str, reason: str) -> bool:
        f = self.flows.get(fid)
        if f is None or f.state not in (_RUNNING, _PARKED):
            return False
        f.hung = False
        f.revision += 1
        self._compensate(f, ("is", reason))
        self.settle(f)
        return True

    def resume(self, fid: str) -> bool:
        f = self.flows.get(fid)
        if f is None or f.state is not _BLOCKED:
            return False
        assert f.blocked_from is _COMPENSATING
        f.state, f.blocked_from = _COMPENSATING, None
        f.attempt += 1
        f.raises = 0
        f.revision += 1
        self.settle(f)
        return True

    def advance(self) -> None:
        self.now += _ADVANCE
        for f in self.flows.values():
            self.settle(f)

    def reopen(self) -> None:
        """A close cancels every hung step or compensation; the next open runs it again as
        attempt + 1 (one write each), with a new count of raises, and its wall clock starts
        again near 0."""
        self.now = 0.0
        for f in self.flows.values():
            if f.hung:
                f.hung = False
                f.attempt += 1
                f.raises = 0
                f.revision += 1
                self.settle(f)


# ------------------------------------------------------------------------------ the trio side


class _TrioThread:
    """One `trio.run` (with a `MockClock`) in a thread of its own, for one example.

    `run(afn, *args)` runs ``await afn(*args)`` there and returns its result (or raises its
    exception). While it runs the clock jumps (``autojump_threshold=_IDLE``), at most `_TICK` at a
    time; between calls it stands still.
    """

    def __init__(self) -> None:
        self.clock = trio.testing.MockClock(autojump_threshold=math.inf)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="flow-properties", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            trio.run(self._amain, clock=self.clock)
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    async def _amain(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self._tick)
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    async def _tick(self) -> None:
        while True:  # noqa: ASYNC110 - a tick that bounds the clock's jumps, not a wait
            await trio.sleep(_TICK)

    async def _ticking(self, afn: Callable[..., Awaitable[T]], args: Sequence[Any]) -> T:
        self.clock.autojump_threshold = _IDLE
        try:
            return await afn(*args)
        finally:
            self.clock.autojump_threshold = math.inf

    def run(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(self._ticking, afn, args, trio_token=self.token)

    def close(self) -> None:
        if self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join()
        if self._error is not None:
            raise self._error


class _Host:
    """Holds one open engine in the trio thread's nursery until `close`; records what the engine
    raised out of its block (`crash`)."""

    def __init__(self) -> None:
        self.engine: flow.Engine | None = None
        self.crash: BaseException | None = None
        self._close = trio.Event()
        self.done = trio.Event()

    async def serve(self, path: str, plans: list[flow.Plan], *, task_status: Any) -> None:
        started = False
        try:
            # retain=None: finished flows stay (the `advance` rule jumps decades ahead, past the
            # default retention, and the model keeps every flow)
            async with flow.open_engine(path, plans=plans, retain=None) as engine:
                self.engine = engine
                task_status.started()
                started = True
                await self._close.wait()
        except trio.Cancelled:
            raise
        except BaseException as exc:
            self.crash = exc
        finally:
            self.engine = None
            self.done.set()
            if not started:
                task_status.started()

    async def close(self) -> None:
        self._close.set()
        await self.done.wait()


# ------------------------------------------------------------------------------- strategies

FLOW_IDS = ["a", "a/0", "o-1", "o-1/0/pay", "line\nbreak", "é/ü", "🚚", "0"]
MESSAGE_IDS = ["m1", "m/2", "m\n3", "é"]
STEP_NAMES = ["1", "compensate", "pay", "charge", "0", "é", "x\ny", "🚚"]
PLAN_NAMES = ["order", "pay/0", "é\nü"]
BAD_IDS: list[object] = ["", 7, b"a", "bad\udc80id"]
BAD_MESSAGE_IDS: list[object] = ["", 5, "m\udc80"]
# Ids are any text but NUL, which the contract leaves open (PostgreSQL's text refuses it).
_ID_CHARS = st.characters(codec="utf-8", exclude_characters="\x00")


@functools.cache
def _json_leaf() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53), st.text(max_size=4))


@functools.cache
def _json_value() -> st.SearchStrategy[Any]:
    return st.recursive(
        _json_leaf(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
        ),
        max_leaves=6,
    )


@functools.cache
def _json_object() -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.text(max_size=3), _json_value(), max_size=3)


@functools.cache
def _acts() -> st.SearchStrategy[Act]:
    good = st.builds(
        Act,
        st.just("return"),
        st.sampled_from(GOOD_OUTCOMES),
        st.sampled_from([None, "good"]),
        _json_value(),
    )
    bad_outcome = st.builds(
        Act, st.just("return"), st.sampled_from(BAD_OUTCOMES), st.sampled_from([None, "good"])
    )
    bad_data = st.builds(
        Act, st.just("return"), st.sampled_from(GOOD_OUTCOMES), st.sampled_from(list(BAD_VALUES))
    )
    return st.one_of(good, bad_outcome, bad_data, st.just(Act("raise")), st.just(Act("hang")))


@functools.cache
def _comp_acts() -> st.SearchStrategy[CompAct]:
    return st.sampled_from([CompAct("ok"), CompAct("ok"), CompAct("raise"), CompAct("hang")])


@st.composite
def _plan_specs(draw: st.DrawFn, name: str) -> PlanSpec:
    names = draw(st.lists(st.sampled_from(STEP_NAMES), min_size=1, max_size=4, unique=True))
    steps = []
    for step_name in names:
        attempts = draw(st.integers(1, 3))
        script = tuple(draw(st.lists(_acts(), min_size=1, max_size=3)))
        comp = draw(st.none() | st.lists(_comp_acts(), min_size=1, max_size=3).map(tuple))
        steps.append(StepSpec(step_name, attempts, script, comp))
    return PlanSpec(name, tuple(steps))


@functools.cache
def _flow_ids() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(FLOW_IDS), st.text(_ID_CHARS, min_size=1, max_size=6))


@attrs.frozen
class StartCall:
    plan: int  # an index into the machine's plans; -1: a plan the engine was not given
    flow_id: object  # None: the engine picks one
    data: object
    good: bool  # is this input the contract accepts (then `plan` >= 0 too)?


@functools.cache
@st.composite
def _start_calls(draw: st.DrawFn, n_plans: int) -> StartCall:
    plan = draw(st.integers(0, n_plans - 1))
    kind = draw(st.sampled_from(["good", "good", "good", "no-data", "bad-data", "bad-id", "plan"]))
    if kind == "bad-id":
        return StartCall(plan, draw(st.sampled_from(BAD_IDS)), {}, False)
    flow_id = draw(st.none() | _flow_ids())
    if kind == "no-data":
        return StartCall(plan, flow_id, None, True)
    if kind == "bad-data":
        bad = draw(st.sampled_from([*BAD_VALUES, "not-a-dict"]))
        data = [1] if bad == "not-a-dict" else {"k": BAD_VALUES[bad]()}
        return StartCall(plan, flow_id, data, False)
    data = draw(_json_object())
    return StartCall(-1 if kind == "plan" else plan, flow_id, data, kind != "plan")


@attrs.frozen
class WakeCall:
    flow_id: object
    payload: object
    message_id: object
    good: bool


@st.composite
def _wake_calls(draw: st.DrawFn, known: Sequence[str]) -> WakeCall:
    ids = st.sampled_from(known) | _flow_ids() if known else _flow_ids()
    kind = draw(st.sampled_from(["good", "good", "good", "bad-payload", "bad-mid", "bad-id"]))
    flow_id = draw(ids)
    payload = draw(_json_value())
    message_id = draw(
        st.none() | st.sampled_from(MESSAGE_IDS) | st.text(_ID_CHARS, min_size=1, max_size=3)
    )
    if kind == "bad-payload":
        return WakeCall(flow_id, BAD_VALUES[draw(st.sampled_from(list(BAD_VALUES)))](),
                        message_id, False)  # fmt: skip
    if kind == "bad-mid":
        return WakeCall(flow_id, payload, draw(st.sampled_from(BAD_MESSAGE_IDS)), False)
    if kind == "bad-id":
        return WakeCall(draw(st.sampled_from(BAD_IDS)), payload, message_id, False)
    return WakeCall(flow_id, payload, message_id, True)


def _is_good(call: StartCall | WakeCall) -> bool:
    return call.good


def _id_of(call: StartCall | WakeCall) -> object:
    """Calls of one batch name distinct flows (their order would decide which one wins)."""
    return call.flow_id if isinstance(call.flow_id, str) else id(call)


def _storable(flow_id: object) -> bool:
    """Can the engine be asked about this id (a non-empty str that UTF-8 can encode)?"""
    if not isinstance(flow_id, str) or not flow_id:
        return False
    try:
        flow_id.encode()
    except UnicodeEncodeError:
        return False
    return True


# ---------------------------------------------------------------------------- the machine


class PropertyFailure(AssertionError):
    """The engine broke the contract (the message says where)."""


def _has_flows(machine: FlowMachine) -> bool:
    return bool(machine.model.flows)


class FlowMachine(RuleBasedStateMachine):
    """The engine on a fresh SQLite file against `Model` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="flow-props-")
        self.path = os.path.join(self.dir, "flows.db")
        self.trio = _TrioThread()
        self.model = Model()
        self.runs: list[Run] = []
        self.plans: list[flow.Plan] = []
        self.specs: list[PlanSpec] = []
        self.stray: flow.Plan | None = None
        self.host: _Host | None = None
        self.failed = False  # a rule failed: the teardown only closes
        self.ended = False  # the end-of-example checks ran

    # --- the calls

    @initialize(data=st.data())
    def open_engine(self, data: st.DataObject) -> None:
        names = data.draw(st.lists(st.sampled_from(PLAN_NAMES), min_size=1, max_size=2,
                                   unique=True))  # fmt: skip
        self.open_with([data.draw(_plan_specs(name)) for name in names])

    def open_with(self, specs: list[PlanSpec]) -> None:
        """Open the engine with plans built from `specs` (the setup, also for planted tests)."""
        self.specs = specs
        self.plans = [_build_plan(spec, self.runs) for spec in specs]
        stray = flow.Plan("stray")
        stray.step(name="s")(_stray_step)
        self.stray = stray
        self._call(self._open)

    async def _open(self) -> None:
        self.host = _Host()
        await self.trio.nursery.start(self.host.serve, self.path, self.plans)
        self._check_alive("opening the engine")
        engine = self._engine("opening the engine")
        engine.on("event", self._wake_mapper)
        engine.on("event", self._start_mapper)

    def _wake_mapper(self, event: dict[str, Any]) -> flow.Wake:
        return flow.Wake(**event["wake"])

    def _start_mapper(self, event: dict[str, Any]) -> flow.Start:
        start = event["start"]
        return flow.Start(self.plans[start["plan"]], start["flow_id"], start["data"])

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        calls = data.draw(
            st.lists(_start_calls(len(self.plans)), min_size=1, max_size=4, unique_by=_id_of)
        )
        self.do_start(calls)

    def do_start(self, calls: Sequence[StartCall]) -> None:
        """Start `calls` at once (one concurrent batch) and check each answer and the flows."""
        self._call(self._start, list(calls))

    async def _start(self, calls: list[StartCall]) -> None:
        engine = self._engine("start")
        answers: list[object] = [None] * len(calls)

        async def one(i: int, call: StartCall) -> None:
            plan = self.stray if call.plan < 0 else self.plans[call.plan]
            try:
                answers[i] = await engine.start(plan, flow_id=call.flow_id, data=call.data)  # type: ignore[arg-type]
            except Exception as exc:
                answers[i] = exc

        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(one, i, call)
        self._check_alive("start")
        touched: list[str] = []
        for call, answer in zip(calls, answers, strict=True):
            where = f"start(plan={call.plan}, flow_id={call.flow_id!r}, data={_short(call.data)})"
            if not call.good:
                if not isinstance(answer, TypeError | ValueError):
                    raise PropertyFailure(
                        f"{where}: bad input must raise TypeError/ValueError at the call, got"
                        f" {answer!r}"
                    ) from (answer if isinstance(answer, BaseException) else None)
                if _storable(call.flow_id) and call.flow_id not in self.model.flows:
                    stored = await engine.get(call.flow_id)  # type: ignore[arg-type]
                    if stored is not None:
                        raise PropertyFailure(f"{where} was refused but stored {stored!r}")
                continue
            spec = self.specs[call.plan]
            data = {} if call.data is None else call.data
            existing = self.model.flows.get(call.flow_id) if isinstance(call.flow_id, str) else None
            if existing is not None:
                same = existing.plan is spec and existing.start_text == _text(data)
                if same and answer != call.flow_id:
                    raise PropertyFailure(f"{where}: the same start again must return the id,"
                                          f" got {answer!r}")  # fmt: skip
                if not same and not isinstance(answer, flow.IdReused):
                    raise PropertyFailure(
                        f"{where}: the id names another flow, IdReused expected, got {answer!r}"
                    )
                continue
            if not isinstance(answer, str) or (call.flow_id is not None and answer != call.flow_id):
                raise PropertyFailure(
                    f"{where} must start the flow and return its id, got {answer!r}"
                ) from (answer if isinstance(answer, BaseException) else None)
            f = MFlow(answer, spec, _text(data), json.loads(_text(data)))
            self.model.flows[answer] = f
            self.model.settle(f)
            touched.append(answer)
        await self._rest(touched)

    @precondition(_has_flows)
    @rule(data=st.data())
    def wake(self, data: st.DataObject) -> None:
        calls = data.draw(
            st.lists(_wake_calls(tuple(self.model.flows)), min_size=1, max_size=3, unique_by=_id_of)
        )
        self.do_wake(calls)

    def do_wake(self, calls: Sequence[WakeCall]) -> None:
        """Wake `calls` at once (one concurrent batch, distinct flows) and check everything."""
        self._call(self._wake, list(calls))

    async def _wake(self, calls: list[WakeCall]) -> None:
        engine = self._engine("wake")
        before = {fid: f.revision for fid, f in self.model.flows.items()}
        answers: list[object] = [None] * len(calls)

        async def one(i: int, call: WakeCall) -> None:
            try:
                answers[i] = await engine.wake(
                    call.flow_id,  # type: ignore[arg-type]
                    call.payload,
                    message_id=call.message_id,  # type: ignore[arg-type]
                )
            except Exception as exc:
                answers[i] = exc

        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(one, i, call)
        self._check_alive("wake")
        touched = []
        for call, answer in zip(calls, answers, strict=True):
            where = (
                f"wake({call.flow_id!r}, {_short(call.payload)}, message_id={call.message_id!r})"
            )
            if not call.good:
                if not isinstance(answer, TypeError | ValueError):
                    raise PropertyFailure(
                        f"{where}: bad input must raise TypeError/ValueError at the call, got"
                        f" {answer!r}"
                    ) from (answer if isinstance(answer, BaseException) else None)
                continue
            assert isinstance(call.flow_id, str)
            expected = self.model.wake(call.flow_id, call.message_id, call.payload)  # type: ignore[arg-type]
            if answer not in expected:
                raise PropertyFailure(
                    f"{where}: expected {' or '.join(sorted(map(repr, expected)))}, got"
                    f" {answer!r} (the flow was {self._where(call.flow_id)})"
                ) from (answer if isinstance(answer, BaseException) else None)
            touched.append(call.flow_id)
        await self._rest([*touched, *(fid for fid in before if fid not in touched)])

    @precondition(_has_flows)
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        """An event whose two mappers decide a wake, then a start (which may reuse an id)."""
        wake = data.draw(_wake_calls(tuple(self.model.flows)).filter(_is_good))
        start = data.draw(
            _start_calls(len(self.plans)).filter(
                lambda c: c.good and c.flow_id is not None and c.flow_id != wake.flow_id
            )
        )
        self.do_publish(wake, start)

    def do_publish(self, wake: WakeCall, start: StartCall) -> None:
        self._call(self._publish, wake, start)

    async def _publish(self, wake: WakeCall, start: StartCall) -> None:
        engine = self._engine("publish")
        event = {
            "wake": {
                "flow_id": wake.flow_id,
                "payload": wake.payload,
                "message_id": wake.message_id,
            },
            "start": {"plan": start.plan, "flow_id": start.flow_id, "data": start.data},
        }
        try:
            answer: object = await engine.publish("event", event)
        except Exception as exc:
            answer = exc
        self._check_alive("publish")
        where = f"publish({_short(event, 400)})"
        assert isinstance(wake.flow_id, str) and isinstance(start.flow_id, str)
        spec = self.specs[start.plan]
        data = {} if start.data is None else start.data
        existing = self.model.flows.get(start.flow_id)
        if existing is not None and (
            existing.plan is not spec or existing.start_text != _text(data)
        ):
            if not isinstance(answer, flow.IdReused):
                raise PropertyFailure(f"{where}: the start reuses an id, IdReused expected, got"
                                      f" {answer!r}")  # fmt: skip
            await self._rest([wake.flow_id])  # all or nothing: the wake was not applied either
            return
        state = self._where(wake.flow_id)
        delivery = self.model.wake(wake.flow_id, wake.message_id, wake.payload)  # type: ignore[arg-type]
        if existing is None:
            f = MFlow(start.flow_id, spec, _text(data), json.loads(_text(data)))
            self.model.flows[start.flow_id] = f
            self.model.settle(f)
        if (
            not isinstance(answer, list)
            or len(answer) != 2
            or answer[0] not in delivery
            or answer[1] != start.flow_id
        ):
            raise PropertyFailure(
                f"{where}: expected [{' or '.join(sorted(map(repr, delivery)))},"
                f" {start.flow_id!r}], got {answer!r} (the woken flow was {state})"
            ) from (answer if isinstance(answer, BaseException) else None)
        await self._rest([wake.flow_id, start.flow_id])

    @precondition(_has_flows)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        known = sorted(self.model.flows)
        fid = data.draw(st.sampled_from(known) | _flow_ids() if known else _flow_ids())
        reason = data.draw(st.sampled_from(["cancelled", "by operator\n/é", 5]))
        self.do_cancel(fid, reason)

    def do_cancel(self, fid: str, reason: object) -> None:
        self._call(self._cancel, fid, reason)

    async def _cancel(self, fid: str, reason: object) -> None:
        engine = self._engine("cancel")
        try:
            answer: object = await engine.cancel(fid, reason)  # type: ignore[arg-type]
        except Exception as exc:
            answer = exc
        self._check_alive("cancel")
        where = f"cancel({fid!r}, {reason!r})"
        if not isinstance(reason, str):
            if not isinstance(answer, TypeError):
                raise PropertyFailure(f"{where}: expected TypeError, got {answer!r}")
            await self._rest([])
            return
        state = self._where(fid)
        expected = self.model.cancel(fid, reason)
        if answer is not expected:
            raise PropertyFailure(f"{where}: expected {expected}, got {answer!r} (the flow was"
                                  f" {state})")  # fmt: skip
        await self._rest([fid] if fid in self.model.flows else [])

    @precondition(_has_flows)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        known = sorted(self.model.flows)
        self.do_resume(data.draw(st.sampled_from(known) | _flow_ids() if known else _flow_ids()))

    def do_resume(self, fid: str) -> None:
        self._call(self._resume, fid)

    async def _resume(self, fid: str) -> None:
        engine = self._engine("resume")
        try:
            answer: object = await engine.resume(fid)
        except Exception as exc:
            answer = exc
        self._check_alive("resume")
        state = self._where(fid)
        expected = self.model.resume(fid)
        if answer is not expected:
            raise PropertyFailure(
                f"resume({fid!r}): expected {expected}, got {answer!r} (the flow was {state})"
            )
        await self._rest([fid] if fid in self.model.flows else [])

    @precondition(_has_flows)
    @rule()
    def advance(self) -> None:
        """Time passes beyond every park this engine armed with a timeout."""
        self._call(self._advance)

    async def _advance(self) -> None:
        self._engine("advance")
        self.trio.clock.jump(_ADVANCE)
        self.model.advance()
        await self._rest(list(self.model.flows))

    @precondition(_has_flows)
    @rule()
    def reopen(self) -> None:
        """Close the engine (its hung steps are cancelled) and open it again on the file."""
        self._call(self._reopen)

    async def _reopen(self) -> None:
        self._engine("close")
        assert self.host is not None
        await self.host.close()
        self._check_alive("closing the engine")
        self.model.reopen()
        await self._open()
        await self._rest(list(self.model.flows))

    # --- coming to rest, and the checks

    def _call(self, afn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run a rule's calls in the trio thread; a failure marks the example as failed (its
        teardown then only closes)."""
        try:
            self.trio.run(self._crash_first, afn, args)
        except BaseException:
            self.failed = True
            raise

    async def _crash_first(self, afn: Callable[..., Awaitable[None]], args: Sequence[Any]) -> None:
        """``await afn(*args)``; if it fails because the engine raised out of its block
        meanwhile (a call then raises `ferry.Closed`), report that instead."""
        try:
            await afn(*args)
        except Exception:
            if self.host is not None and self.host.crash is None:
                with trio.move_on_after(1.0):
                    await self.host.done.wait()
            self._check_alive("a call")
            raise

    def _engine(self, what: str) -> flow.Engine:
        self._check_alive(what)
        if self.host is None or self.host.engine is None:
            raise PropertyFailure(f"the engine is not open (at {what})")
        return self.host.engine

    def _check_alive(self, what: str) -> None:
        crash = self.host.crash if self.host is not None else None
        if crash is not None:
            raise PropertyFailure(
                f"the engine raised {crash!r} out of its async with (seen at {what}): a flow's"
                " own problem must stay its own"
            ) from crash

    def _where(self, fid: object) -> str:
        f = self.model.flows.get(fid) if isinstance(fid, str) else None
        if f is None:
            return "unknown"
        return f"{f.state.name} at step {f.index} ({f.step.name!r}), attempt {f.attempt}"

    async def _rest(self, first: Sequence[str]) -> None:
        """Wait (virtual time) until every flow is where the model says, then check each;
        `first`: the flows this rule moved, checked first (their failures read better).

        A flow that stops short of the model (stuck, or retried for ever) is given
        `_REST_BUDGET` of virtual time after the last change seen in any flow (a write or a
        run), so that a slow store (a loaded machine) is never taken for a stuck flow."""
        engine = self._engine("rest")
        order = [
            fid for fid in dict.fromkeys([*first, *self.model.flows]) if fid in self.model.flows
        ]
        waiting = set(order)
        seen: dict[str, int] = {}
        runs = len(self.runs)
        give_up = trio.current_time() + _REST_BUDGET
        while waiting and trio.current_time() < give_up:
            for fid in list(waiting):
                snap = await engine.get(fid)
                f = self.model.flows[fid]
                ran = sum(1 for r in self.runs if r.flow_id == fid)
                if snap is None or snap.revision > f.revision or ran > len(f.runs):
                    waiting.clear()  # it went past the model: `_check` says how
                    break
                if snap.revision == f.revision and ran == len(f.runs):
                    waiting.discard(fid)
                if seen.get(fid) != snap.revision or runs != len(self.runs):
                    seen[fid], runs = snap.revision, len(self.runs)
                    give_up = trio.current_time() + _REST_BUDGET
                self._check_alive("rest")
            if waiting:
                await trio.sleep(_POLL)
        self._check_alive("rest")
        for fid in order:
            await self._check(engine, fid)

    async def _check(self, engine: flow.Engine, fid: str) -> None:
        f = self.model.flows[fid]
        snap = await engine.get(fid)
        runs = [r.seen() for r in self.runs if r.flow_id == fid]
        expected = {
            "state": f.state,
            "step_index": f.index,
            "revision": f.revision,
            "runs": f.runs,
            "data": f.data,
            "deadline": f.has_timeout if f.state is _PARKED else None,
        }
        actual = None
        if snap is not None:
            actual = {
                "state": snap.state,
                "step_index": snap.step_index,
                "revision": snap.revision,
                "runs": runs,
                "data": snap.data,
                "deadline": (snap.park_deadline is not None) if snap.state is _PARKED else None,
            }
        if f.state in _TERMINAL:
            expected.pop("step_index")
            if actual is not None:
                actual.pop("step_index")
        if actual != expected:
            diff = (
                {k: (v, actual.get(k)) for k, v in expected.items() if actual.get(k) != v}
                if actual is not None
                else "no such flow"
            )
            raise PropertyFailure(
                f"flow {fid!r} of plan {f.plan.name!r} is not where it would be alone:"
                f" {_short(diff, 2000)} (expected, actual); steps {f.plan.steps}"
            )
        assert snap is not None
        if f.state is _FAILED and f.error is not None:
            how, text = f.error
            if how == "is" and snap.error != text:
                raise PropertyFailure(f"flow {fid!r} failed with {snap.error!r}, not {text!r}")
            if how == "names" and not _names(snap.error, text):
                raise PropertyFailure(
                    f"flow {fid!r} failed with {snap.error!r}, which does not name its step"
                    f" {text!r}"
                )

    def check_end(self) -> None:
        """The end-of-example checks (`_finish`), once; the teardown runs them if no rule
        failed."""
        if not self.ended:
            self.ended = True
            self._call(self._finish)

    def teardown(self) -> None:
        try:
            if not self.failed and self.host is not None and self.host.engine is not None:
                self.check_end()
        finally:
            try:
                if self.host is not None and self.host.engine is not None:
                    self.trio.run(self.host.close)
                self.trio.close()
            finally:
                shutil.rmtree(self.dir, ignore_errors=True)

    async def _finish(self) -> None:
        """The end of an example: hung steps are cancelled, then every flow must be at rest,
        its history must show each outcome once, and keys must be unique."""
        engine = self._engine("the end")
        hung = [f.flow_id for f in self.model.flows.values() if f.hung and f.state is _RUNNING]
        for fid in hung:
            if await engine.cancel(fid, "the end") is not True:
                raise PropertyFailure(f"cancel({fid!r}) of a running flow did not cancel it")
            self.model.cancel(fid, "the end")
        await self._rest(hung)
        for fid, f in self.model.flows.items():
            snap = await engine.get(fid)
            assert snap is not None
            if not f.hung and snap.state not in (_COMPLETED, _FAILED, _BLOCKED, _PARKED):
                raise PropertyFailure(f"flow {fid!r} did not come to rest: {snap!r}")
            history = await engine.history(fid)
            outcomes = Counter(e.step for e in history if e.kind == "step")
            compensations = Counter(e.step for e in history if e.kind == "compensated")
            twice = [
                (kind, step, n)
                for kind, counts in (("step", outcomes), ("compensation", compensations))
                for step, n in counts.items()
                if n > 1
            ]
            if twice:
                raise PropertyFailure(f"flow {fid!r} recorded an outcome twice: {twice}")
            # A retry's write (attempt + 1) records no event: the history may end before the
            # row's revision, never after it, and goes forward.
            revisions = [e.revision for e in history]
            if (
                revisions[:1] != [1]
                or revisions != sorted(revisions)
                or revisions[-1] > snap.revision
            ):
                raise PropertyFailure(
                    f"flow {fid!r}: its history's revisions {revisions} do not go from 1 up to"
                    f" at most its row's {snap.revision}"
                )
        self._check_runs()

    def _check_runs(self) -> None:
        """Attempts count 1, 2, 3 per (flow, step, step or compensation); one key each."""
        attempts: dict[tuple[str, int, bool], list[int]] = {}
        keys: dict[str, set[tuple[str, int, str, bool]]] = {}
        for r in self.runs:
            attempts.setdefault((r.flow_id, r.step_index, r.compensation), []).append(r.attempt)
            keys.setdefault(r.key, set()).add((r.flow_id, r.step_index, r.step, r.compensation))
        for (fid, index, comp), seen in attempts.items():
            # a body runs again only as a retry or a re-run after a close (no plan goes back to
            # an earlier step), so its attempts are 1, 2, 3, ...
            if seen != list(range(1, len(seen) + 1)):
                what = "compensation" if comp else "step"
                raise PropertyFailure(
                    f"flow {fid!r}, {what} {index}: attempts {seen}, not 1, 2, 3, ..."
                )
        shared = {k: v for k, v in keys.items() if len(v) > 1}
        if shared:
            raise PropertyFailure(f"idempotency keys shared by different steps: {shared}")


async def _stray_step(ctx: flow.Context) -> None:  # pragma: no cover - never registered
    pass


def _names(error: str | None, step: str) -> bool:
    return error is not None and any(
        form in error for form in (step, repr(step), json.dumps(step), ascii(step))
    )


def _short(value: object, limit: int = 200) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a value too deep for repr: say so
        text = f"<{type(value).__name__}: {exc!r}>"
    return text if len(text) <= limit else text[: limit - 20] + f"... ({len(text)} chars)"


# ---------------------------------------------------------------------------------- profiles

# A handful of seconds in `make test`; minutes under `-m long`.
QUICK = settings(
    max_examples=10,
    stateful_step_count=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LONG = settings(
    max_examples=200,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_flow_properties() -> None:
    run_state_machine_as_test(FlowMachine, settings=QUICK)


@pytest.mark.long
def test_flow_properties_long() -> None:
    run_state_machine_as_test(FlowMachine, settings=LONG)


# ------------------------------------------------------------------------ found on the search

# Scenarios the search found before the edge fixes (ADR 0060-0065), shrunk by hypothesis, kept as
# fixed examples of the machine (each a few rules; they run in well under a second when the
# engine is right).


def run_scenario(plans: Sequence[PlanSpec], *calls: Callable[[FlowMachine], None]) -> None:
    """Open the machine with `plans`, run `calls` on it, then the end-of-example checks."""
    machine = FlowMachine()
    try:
        machine.open_with(list(plans))
        for call in calls:
            call(machine)
        machine.check_end()
    finally:
        machine.failed = True  # checked above: the teardown only closes
        machine.teardown()


def _one_step(outcome: str = "none", change: str | None = None) -> PlanSpec:
    return PlanSpec("order", (StepSpec("1", 1, (Act("return", outcome, change),), None),))


def _start(*flow_ids: str, plan: int = 0, data: Any = None) -> Callable[[FlowMachine], None]:
    calls = [StartCall(plan, fid, {} if data is None else data, True) for fid in flow_ids]
    return lambda machine: machine.do_start(calls)


@pytest.mark.parametrize(
    "outcome",
    ["Park('60')", "Park(-1)", "Park(nan)", "Park(inf)", "Park(True)", "Park(on_timeout=?)",
     "Fail(exception)", "Fail(None)", "a coroutine"],
)  # fmt: skip
def test_a_malformed_outcome_fails_its_flow_alone(outcome: str) -> None:
    run_scenario([_one_step(outcome)], _start("a", "b"))


@pytest.mark.parametrize("value", ["deep-100", "deep-5000", "big", "lone-surrogate", "nan"])
def test_data_that_cannot_be_stored_fails_its_flow_alone(value: str) -> None:
    run_scenario([_one_step("none", value)], _start("a", "b"))


@pytest.mark.parametrize("value", ["deep-100", "deep-5000", "big", "lone-surrogate"])
def test_bad_start_data_is_refused_at_its_call_alone(value: str) -> None:
    bad = StartCall(0, "bad", {"k": BAD_VALUES[value]()}, False)
    run_scenario(
        [_one_step()],
        lambda m: m.do_start([StartCall(0, "a", {}, True), bad, StartCall(0, "b", {}, True)]),
    )


@pytest.mark.parametrize("value", ["deep-100", "deep-5000", "big", "lone-surrogate"])
def test_a_bad_wake_payload_is_refused_at_its_call_alone(value: str) -> None:
    waits = PlanSpec("order", (StepSpec("wait", 1, (Act("return", "park"),), None),))
    bad = WakeCall("a", BAD_VALUES[value](), "m1", False)
    run_scenario(
        [waits],
        _start("a"),
        lambda m: m.do_wake([bad, WakeCall("zzz", 1, None, True)]),
        lambda m: m.do_wake([WakeCall("a", {"ok": True}, "m1", True)]),
    )


def test_an_id_utf8_cannot_encode_is_refused_at_its_call() -> None:
    run_scenario(
        [_one_step()],
        _start("a"),
        lambda m: m.do_wake(
            [WakeCall("bad\udc80id", None, None, False), WakeCall("a", 1, "m", True)]
        ),
        lambda m: m.do_start([StartCall(0, "bad\udc80id", {}, False)]),
    )


def test_a_compensation_key_is_no_other_flows_step_key() -> None:
    keys = PlanSpec(
        "order",
        (
            StepSpec("1", 1, (Act("return"),), (CompAct("ok"),)),
            StepSpec("compensate", 1, (Act("return", "fail"),), None),
        ),
    )
    run_scenario([keys], _start("a", "a/0"))


def test_a_wake_to_a_compensating_flow_is_stale() -> None:
    stuck = PlanSpec(
        "order",
        (
            StepSpec("pay", 1, (Act("return"),), (CompAct("hang"),)),
            StepSpec("ship", 1, (Act("return", "fail"),), None),
        ),
    )
    run_scenario([stuck], _start("a"), lambda m: m.do_wake([WakeCall("a", {"x": 1}, "m1", True)]))


def test_publish_applies_nothing_when_its_start_reuses_an_id() -> None:
    waits = PlanSpec("order", (StepSpec("wait", 1, (Act("return", "park"),), None),))
    run_scenario(
        [waits],
        _start("x", "y"),
        lambda m: m.do_publish(
            WakeCall("x", {"ok": True}, "evt-1", True), StartCall(0, "y", {"k": 1}, True)
        ),
    )


def test_hung_steps_run_again_after_each_reopen_and_parks_time_out_on_advance() -> None:
    plan = PlanSpec(
        "order",
        (
            StepSpec("pay", 3, (Act("hang"), Act("hang"), Act("return", "park-big-continue")),
                     (CompAct("ok"),)),
            StepSpec("ship", 1, (Act("return", "park-big"),), (CompAct("ok"),)),
        ),
    )  # fmt: skip
    run_scenario(
        [plan],
        _start("h"),
        FlowMachine.reopen,
        FlowMachine.reopen,
        FlowMachine.advance,
        FlowMachine.reopen,
        FlowMachine.advance,
    )
