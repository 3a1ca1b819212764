"""Whole scenarios against the real per-key ferry, each in its own `trio.run` with a MockClock.

hypothesis draws the options, the submissions (key, rank, weight, time), cancellations, calls that
fail, are slow or hang, and when the ferry closes. After each run the checks below must hold; the
same checker also runs at scale (10,000 callers over 100 keys).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import attrs
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

import ferry
import stm


@attrs.frozen
class Sub:
    """One caller: submits `ident` for `key` at `at`; may give up after `cancel_after`."""

    ident: int
    at: float
    key: int
    rank: int
    weight: int
    behaviour: str  # ok | fail | slow | hang
    cancel_after: float | None


@attrs.frozen
class Options:
    max_batch_size: int
    max_batch_weight: float
    max_batch_delay: float
    max_in_flight_batches: int
    max_queueing: int
    max_queued_weight: float
    direct_calls: bool
    ranked: bool
    call_timeout: float = math.inf
    max_in_flight_calls: float | None = None  # None: max_in_flight_batches

    @property
    def bound(self) -> float:
        if self.max_in_flight_calls is None:
            return self.max_in_flight_batches
        return self.max_in_flight_calls


@attrs.define
class Run:
    calls: list[tuple[int, list[Sub], float, float]] = attrs.Factory(list)
    outcomes: dict[int, list[Any]] = attrs.Factory(dict)
    in_flight: Counter[int] = attrs.Factory(Counter)
    violations: list[str] = attrs.Factory(list)
    final: ferry.FerryStatistics | None = None


async def scenario(opts: Options, subs: list[Sub], close_at: float) -> Run:
    run = Run()

    async def call(key: int, xs: list[Sub]) -> list[Any]:
        start = trio.current_time()
        run.in_flight[key] += 1
        if run.in_flight[key] > 1:
            run.violations.append(f"two calls in flight for key {key}")
        if run.in_flight.total() > opts.bound:
            run.violations.append(f"{run.in_flight.total()} calls in flight, above {opts.bound}")
        try:
            behaviours = {x.behaviour for x in xs}
            if "hang" in behaviours:
                await trio.sleep_forever()
            await trio.sleep(3.0 if "slow" in behaviours else 1.0)
            if "fail" in behaviours:
                raise RuntimeError(f"batch of {[x.ident for x in xs]} failed")
            return [("ok", x.ident) for x in xs]
        finally:
            run.in_flight[key] -= 1
            run.calls.append((key, list(xs), start, trio.current_time()))

    async def caller(f: ferry.PerKeyFerry[Sub, Any], sub: Sub) -> None:
        await trio.sleep_until(sub.at)
        before = f.statistics()
        conserved(before)
        got: list[Any] = run.outcomes.setdefault(sub.ident, [])
        try:
            with trio.CancelScope() as scope:
                if sub.cancel_after is not None:
                    scope.deadline = trio.current_time() + sub.cancel_after
                got.append(await f(sub))
            if scope.cancelled_caught:
                got.append("cancelled")
        except ferry.Rejected:
            got.append("rejected")
            full = before.queued >= opts.max_queueing or (
                before.queued_weight + sub.weight > opts.max_queued_weight
            )
            if not full:
                run.violations.append(f"{sub.ident} rejected with room: {before}")
        except ferry.Failed as exc:
            got.append("failed")
            assert isinstance(exc.__cause__, RuntimeError | trio.TooSlowError)
        except ferry.Closed:
            got.append("closed")

    # Everything ends by close_at plus the longest call; a scenario still running long after
    # that is stuck, which is a failure, not a hang of the test suite.
    with trio.move_on_after(close_at + 1000) as watchdog:
        await _run_callers(opts, subs, close_at, call, caller, run)
    if watchdog.cancelled_caught:
        run.violations.append("the scenario never finished: a caller or a call is stuck")
    return run


async def _run_callers(
    opts: Options, subs: list[Sub], close_at: float, call: Any, caller: Any, run: Run
) -> None:
    async with trio.open_nursery() as callers:
        async with ferry.open_per_key_ferry(
            call,
            key=lambda s: s.key,
            rank=(lambda s: s.rank) if opts.ranked else None,
            weight=lambda s: s.weight,
            max_batch_size=opts.max_batch_size,
            max_batch_weight=opts.max_batch_weight,
            max_batch_delay=opts.max_batch_delay,
            max_in_flight_batches=opts.max_in_flight_batches,
            max_queueing=opts.max_queueing,
            max_queued_weight=opts.max_queued_weight,
            direct_calls=opts.direct_calls,
            call_timeout=opts.call_timeout,
            max_in_flight_calls=opts.max_in_flight_calls,
        ) as f:
            for sub in subs:
                callers.start_soon(caller, f, sub)
            await trio.sleep_until(close_at)
        run.final = f.statistics()


def conserved(s: ferry.FerryStatistics) -> None:
    """The two conservation equations of docs/guide.md ("Watching it"), from public numbers."""
    ok = s.submitted == s.admitted + s.rejected + s.after_close + s.direct_calls
    assert ok, f"submitted calls not conserved: {s}"
    ok = s.admitted == s.queued + s.inputs_sent + s.dropped + s.drained
    assert ok, f"admitted inputs not conserved: {s}"
    assert sum(s.batch_sizes.values()) == s.batches, s
    assert sum(size * n for size, n in s.batch_sizes.items()) == s.inputs_sent, s


def check(opts: Options, subs: list[Sub], run: Run) -> None:
    assert not run.violations, run.violations
    # Every caller got exactly one outcome.
    assert sorted(run.outcomes) == sorted(s.ident for s in subs)
    for ident, got in run.outcomes.items():
        assert len(got) == 1, (ident, got)
    by_ident = {s.ident: s for s in subs}
    sent = Counter(x.ident for _, xs, _, _ in run.calls for x in xs)
    # Nothing sent twice; nothing sent for a rejected input; results match what was sent.
    assert all(n == 1 for n in sent.values()), sent
    for ident, (got,) in run.outcomes.items():
        if got == "rejected":
            assert ident not in sent
        if isinstance(got, tuple):
            assert got == ("ok", ident) and ident in sent
    for key, xs, _, _ in run.calls:
        assert all(x.key == key for x in xs)
        assert 1 <= len(xs) <= opts.max_batch_size
        if len(xs) > 1:
            assert sum(x.weight for x in xs) <= opts.max_batch_weight
        if opts.ranked:  # a batch is a prefix of the lane: ascending rank, ties by arrival
            order = [(x.rank, x.at, x.ident) for x in xs]
            assert [r for r, _, _ in order] == sorted(r for r, _, _ in order), order
    # After close nothing is left: no lane, no call, no waiter.
    final = run.final
    assert final is not None
    conserved(final)
    kinds = Counter(g if isinstance(g, str) else "ok" for (g,) in run.outcomes.values())
    assert final.submitted <= len(subs)
    assert kinds["closed"] >= final.drained + final.after_close
    assert kinds["cancelled"] >= final.dropped
    assert (final.lanes, final.busy, final.queued, final.queued_weight) == (0, 0, 0, 0)
    assert final.rejected == sum(1 for (g,) in run.outcomes.values() if g == "rejected")
    assert final.inputs_sent + final.direct_calls >= len(sent)
    assert stm.statistics().waiters == 0
    del by_ident


def run_scenario(opts: Options, subs: list[Sub], close_at: float) -> Run:
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(scenario, opts, subs, close_at, clock=clock)


options = st.builds(
    Options,
    max_batch_size=st.integers(1, 4),
    max_batch_weight=st.sampled_from([math.inf, 3.0]),
    max_batch_delay=st.sampled_from([0.0, 0.0, 2.0]),
    max_in_flight_batches=st.integers(1, 3),
    max_queueing=st.integers(1, 8),
    max_queued_weight=st.sampled_from([math.inf, 6.0]),
    direct_calls=st.booleans(),
    ranked=st.booleans(),
    call_timeout=st.sampled_from([math.inf, 60.0, 2.5]),
    max_in_flight_calls=st.sampled_from([None, None, 1, 2, math.inf]),
)


@st.composite
def submissions(draw: st.DrawFn) -> list[Sub]:
    n = draw(st.integers(1, 14))
    return [
        Sub(
            ident=i,
            at=draw(st.integers(0, 12)) / 2,
            key=draw(st.integers(0, 2)),
            rank=draw(st.integers(0, 3)),
            weight=draw(st.integers(0, 3)),
            behaviour=draw(st.sampled_from(["ok", "ok", "ok", "fail", "slow", "hang"])),
            cancel_after=draw(st.none() | st.sampled_from([0.0, 0.5, 1.5, 4.0])),
        )
        for i in range(n)
    ]


@given(opts=options, subs=submissions(), close_at=st.integers(0, 30))
def test_every_scenario_keeps_every_promise(opts: Options, subs: list[Sub], close_at: int) -> None:
    check(opts, subs, run_scenario(opts, subs, float(close_at)))


def test_at_scale_ten_thousand_callers_over_a_hundred_keys() -> None:
    rnd = random.Random(20261130)
    opts = Options(
        max_batch_size=20,
        max_batch_weight=math.inf,
        max_batch_delay=0.5,
        max_in_flight_batches=8,
        max_queueing=4_000,
        max_queued_weight=math.inf,
        direct_calls=True,
        ranked=False,
        call_timeout=4.0,  # slow calls (3 s) finish; hanging ones fail
    )
    subs = [
        Sub(
            ident=i,
            at=rnd.randrange(0, 400) / 10,
            key=rnd.randrange(100),
            rank=0,
            weight=1,
            behaviour=rnd.choices(["ok", "fail", "slow", "hang"], [90, 4, 5, 1])[0],
            cancel_after=rnd.choice([None] * 8 + [0.0, 0.3, 1.0, 5.0]),
        )
        for i in range(10_000)
    ]
    run = run_scenario(opts, subs, close_at=rnd.randrange(200, 400) / 10)
    check(opts, subs, run)
    kinds = Counter(g if isinstance(g, str) else "ok" for (g,) in run.outcomes.values())
    # The scenario really exercised every outcome.
    assert {"ok", "failed", "cancelled", "closed"} <= set(kinds), kinds
