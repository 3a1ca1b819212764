"""Integration tests of the trio shell: every option, outcome, cancellation case and close.

All deterministic: MockClock(autojump_threshold=0) (pytest-trio's `autojump_clock`
fixture) and `wait_all_tasks_blocked`; no real sleeps.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict
from typing import Any

import pytest
import trio
import trio.testing

import ferry
import stm
from tests.ferry.test_scenarios import conserved


class Recorder:
    """A batch call that records every call and can be told to fail, hang or be slow."""

    def __init__(self, *, delay: float = 0.0) -> None:
        self.calls: list[tuple[Any, list[Any]]] = []
        self.delay = delay
        self.fail_on: set[Any] = set()
        self.in_flight: Counter[Any] = Counter()
        self.max_in_flight_per_key = 0
        self.max_in_flight = 0
        self.gate: trio.Event | None = None

    async def per_key(self, key: Any, xs: list[Any]) -> list[Any]:
        self.calls.append((key, list(xs)))
        self.in_flight[key] += 1
        self.max_in_flight_per_key = max(self.max_in_flight_per_key, self.in_flight[key])
        self.max_in_flight = max(self.max_in_flight, sum(self.in_flight.values()))
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.delay:
                await trio.sleep(self.delay)
            else:
                await trio.lowlevel.checkpoint()
            if any(x in self.fail_on for x in xs):
                raise RuntimeError(f"boom {xs}")
            return [("ok", x) for x in xs]
        finally:
            self.in_flight[key] -= 1

    async def plain(self, xs: list[Any]) -> list[Any]:
        return await self.per_key(None, xs)


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


# ------------------------------------------------------------------------------------ options


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_batch_size", 0),
        ("max_batch_size", 1.5),
        ("max_batch_size", True),
        ("max_batch_delay", -1),
        ("max_batch_delay", math.nan),
        ("max_batch_delay", math.inf),
        ("max_in_flight_batches", 0),
        ("max_queueing", -1),
        ("max_queueing", 0),
    ],
)
async def test_plain_options_are_checked_at_open(option: str, value: Any) -> None:
    rec = Recorder()
    with pytest.raises(ValueError, match=option):
        async with ferry.open_ferry(rec.plain, **{option: value}):
            pass  # pragma: no cover


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_batch_weight", 0),
        ("max_batch_weight", -1.0),
        ("max_queued_weight", math.nan),
        ("max_queued_weight", 0),
        ("max_in_flight_calls", 0),
        ("max_in_flight_calls", 2.5),
        ("max_in_flight_calls", -math.inf),
        ("direct_calls", 1),
        ("rank", 3),
        ("weight", "heavy"),
        ("key", None),
    ],
)
async def test_per_key_options_are_checked_at_open(option: str, value: Any) -> None:
    rec = Recorder()
    kwargs: dict[str, Any] = {"key": lambda x: x}
    kwargs[option] = value
    with pytest.raises(ValueError, match=option):
        async with ferry.open_per_key_ferry(rec.per_key, **kwargs):
            pass  # pragma: no cover


@pytest.mark.parametrize(
    "options",
    [{"max_queueing": 0, "direct_calls": False}, {"max_queueing": 0, "max_batch_delay": 0.5}],
)
async def test_a_per_key_room_of_zero_needs_direct_calls(options: dict[str, Any]) -> None:
    rec = Recorder()
    with pytest.raises(ValueError, match="max_queueing=0"):
        async with ferry.open_per_key_ferry(rec.per_key, key=lambda x: x[0], **options):
            pass  # pragma: no cover


async def test_a_per_key_room_of_zero_means_direct_calls_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    rec.gate = trio.Event()
    async with (
        ferry.open_per_key_ferry(rec.per_key, key=lambda x: x[0], max_queueing=0) as f,
        trio.open_nursery() as n,
    ):
        n.start_soon(f, ("a", 1))  # an idle key: a direct call, which holds the key
        await settle()
        with pytest.raises(ferry.Rejected):
            await f(("a", 2))  # a busy key would have to wait: there is no room
        rec.gate.set()
    assert rec.calls == [("a", [("a", 1)])]
    s = f.statistics()
    assert (s.direct_calls, s.rejected, s.batches) == (1, 1, 0)


# ------------------------------------------------------------------------------- plain ferry


async def test_plain_batches_concurrent_callers(autojump_clock: trio.testing.MockClock) -> None:
    rec = Recorder()
    results: dict[int, Any] = {}
    async with ferry.open_ferry(rec.plain, max_batch_size=4, max_in_flight_batches=1) as f:

        async def one(i: int) -> None:
            results[i] = await f(i)

        async with trio.open_nursery() as n:
            for i in range(10):
                n.start_soon(one, i)
    assert results == {i: ("ok", i) for i in range(10)}
    sizes = [len(xs) for _, xs in rec.calls]
    assert sum(sizes) == 10
    assert max(sizes) == 4
    assert len(rec.calls) <= 4  # batched, not one call each
    s = f.statistics()
    assert (s.submitted, s.admitted, s.inputs_sent) == (10, 10, 10)
    assert s.batches == len(rec.calls)
    assert sum(size * n for size, n in s.batch_sizes.items()) == 10
    assert (s.queued, s.busy, s.lanes, s.direct_calls) == (0, 0, 0, 0)


async def test_plain_runs_several_batches_at_once(autojump_clock: trio.testing.MockClock) -> None:
    rec = Recorder(delay=1.0)
    async with ferry.open_ferry(rec.plain, max_batch_size=2, max_in_flight_batches=3) as f:
        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(f, i)
    assert rec.max_in_flight == 3


async def test_delay_holds_a_partial_batch_until_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    sent_at: list[float] = []

    async def call(xs: list[int]) -> list[int]:
        sent_at.append(trio.current_time())
        return xs

    async with ferry.open_ferry(call, max_batch_size=3, max_batch_delay=5.0) as f:
        start = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(f, 1)
            await trio.sleep(2.0)
            n.start_soon(f, 2)
        assert sent_at == [start + 5.0]  # the oldest input's submission + delay
        async with trio.open_nursery() as n:
            for i in range(3):  # a full batch goes at once
                n.start_soon(f, i)
        assert sent_at[-1] == start + 5.0
    del rec


async def test_rejected_when_room_is_full_and_nothing_is_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    rec.gate = trio.Event()
    outcomes: dict[int, Any] = {}
    async with ferry.open_ferry(
        rec.plain, max_batch_size=1, max_in_flight_batches=1, max_queueing=2
    ) as f:

        async def one(i: int) -> None:
            try:
                outcomes[i] = await f(i)
            except ferry.Rejected as exc:
                outcomes[i] = exc

        async with trio.open_nursery() as n:
            n.start_soon(one, 0)
            await settle()  # 0 is in flight, holding the only worker
            for i in (1, 2, 3):
                n.start_soon(one, i)
                await settle()
            rec.gate.set()
    assert isinstance(outcomes[3], ferry.Rejected)
    assert [outcomes[i] for i in (0, 1, 2)] == [("ok", 0), ("ok", 1), ("ok", 2)]
    assert all(xs != [3] for _, xs in rec.calls)
    assert f.statistics().rejected == 1


async def test_failed_batch_gives_each_caller_failed_with_cause_and_ferry_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    rec.fail_on = {1}
    errors: list[BaseException] = []
    async with ferry.open_ferry(rec.plain, max_batch_size=10, max_batch_delay=1.0) as f:

        async def one(i: int) -> None:
            try:
                await f(i)
            except ferry.Failed as exc:
                errors.append(exc)

        async with trio.open_nursery() as n:
            for i in range(3):
                n.start_soon(one, i)
        assert len(errors) == 3
        assert len({id(e) for e in errors}) == 3  # each caller its own exception
        assert all(isinstance(e.__cause__, RuntimeError) for e in errors)
        assert isinstance(errors[0], ferry.FerryError)
        assert await f(7) == ("ok", 7)  # not poisoned
        assert f.statistics().failed_batches == 1


@pytest.mark.parametrize(
    "output",
    [lambda xs: xs[:-1], lambda xs: 42, lambda xs: "abc"],
    ids=["short", "not-a-sequence", "a-string"],
)
async def test_malformed_output_is_a_batch_contract_error(
    autojump_clock: trio.testing.MockClock, output: Any
) -> None:
    async def call(xs: list[int]) -> Any:
        return output(xs)

    async with ferry.open_ferry(call, max_batch_size=3, max_batch_delay=1.0) as f:
        with pytest.RaisesGroup(ferry.BatchContractError, ferry.BatchContractError):
            async with trio.open_nursery() as n:
                n.start_soon(f, 1)
                n.start_soon(f, 2)


async def test_extract_maps_output_to_each_caller_and_its_errors_are_contract_errors(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def call(xs: list[int]) -> dict[int, str]:
        return {x: f"v{x}" for x in xs if x != 3}

    async with ferry.open_ferry(
        call, max_batch_size=5, max_batch_delay=1.0, extract=lambda out, x: out[x]
    ) as f:
        got: dict[int, Any] = {}

        async def one(i: int) -> None:
            try:
                got[i] = await f(i)
            except ferry.BatchContractError as exc:
                got[i] = exc

        async with trio.open_nursery() as n:
            for i in (1, 2, 3):
                n.start_soon(one, i)
    assert got[1] == "v1" and got[2] == "v2"
    assert isinstance(got[3], ferry.BatchContractError)
    assert isinstance(got[3].__cause__, KeyError)


async def test_input_error_in_a_slot_is_raised_to_that_caller_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def call(xs: list[int]) -> list[Any]:
        return [ferry.IdReused(f"id {x} reused") if x == 2 else x for x in xs]

    async with ferry.open_ferry(call, max_batch_size=3, max_batch_delay=1.0) as f:
        got: dict[int, Any] = {}

        async def one(i: int) -> None:
            try:
                got[i] = await f(i)
            except ferry.InputError as exc:
                got[i] = exc

        async with trio.open_nursery() as n:
            for i in (1, 2, 3):
                n.start_soon(one, i)
    assert got[1] == 1 and got[3] == 3
    assert isinstance(got[2], ferry.IdReused)


# ------------------------------------------------------------------------------ cancellation


async def test_cancelled_while_waiting_is_dropped_and_never_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    async with ferry.open_ferry(rec.plain, max_batch_size=10, max_batch_delay=10.0) as f:
        async with trio.open_nursery() as n:
            cs = trio.CancelScope()
            n.start_soon(f, 1)

            async def doomed() -> None:
                with cs:
                    await f(2)

            n.start_soon(doomed)
            await settle()
            assert f.statistics().queued == 2
            cs.cancel()
            await settle()
            assert f.statistics().queued == 1
            assert f.statistics().dropped == 1
    assert rec.calls == [(None, [1])]
    assert stm.statistics().waiters == 0


async def test_cancelled_while_in_flight_stops_waiting_and_batch_runs_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder(delay=5.0)
    got: list[Any] = []
    async with ferry.open_ferry(rec.plain, max_batch_size=2, max_batch_delay=1.0) as f:
        async with trio.open_nursery() as n:

            async def keeper() -> None:
                got.append(await f(1))

            async def quitter() -> None:
                with trio.move_on_after(3.0):  # the batch leaves at 1.0 and ends at 6.0
                    await f(2)
                got.append("quit")

            n.start_soon(keeper)
            n.start_soon(quitter)
    assert got == ["quit", ("ok", 1)]
    assert [sorted(xs) for _, xs in rec.calls] == [[1, 2]]


async def test_await_is_a_checkpoint_on_every_path(autojump_clock: trio.testing.MockClock) -> None:
    async def call(xs: list[int]) -> list[int]:
        return xs

    async with (
        ferry.open_ferry(call, max_queueing=1, max_batch_delay=10.0) as f,
        trio.open_nursery() as n,
    ):
        n.start_soon(f, 1)
        await settle()  # 1 waits for company: the room is full
        with trio.testing.assert_checkpoints(), pytest.raises(ferry.Rejected):
            await f(2)
    with trio.testing.assert_checkpoints(), pytest.raises(ferry.Closed):
        await f(1)
    async with ferry.open_ferry(call) as f:
        with trio.testing.assert_checkpoints():
            assert await f(1) == 1

    async def keyed(key: int, xs: list[int]) -> list[int]:
        return xs

    async with ferry.open_per_key_ferry(keyed, key=lambda x: x) as g:
        with trio.testing.assert_checkpoints():
            assert await g(1) == 1  # a direct call


async def test_cancelled_before_admission_admits_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    async with ferry.open_ferry(rec.plain) as f:
        with trio.CancelScope() as cs:
            cs.cancel()
            await f(1)
        assert f.statistics().submitted == 0
    assert rec.calls == []


# ------------------------------------------------------------------------------------- close


async def test_close_answers_waiting_and_in_flight_callers_with_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    rec.gate = trio.Event()  # never set: the call hangs
    got: dict[int, Any] = {}

    async def one(f: ferry.Ferry[int, Any], i: int) -> None:
        try:
            got[i] = await f(i)
        except ferry.Closed as exc:
            got[i] = exc

    async with (
        trio.open_nursery() as n,
        ferry.open_ferry(
            rec.plain, max_batch_size=1, max_in_flight_batches=1, max_batch_delay=0
        ) as f,
    ):
        for i in range(3):
            n.start_soon(one, f, i)
        await settle()
        assert f.statistics().busy == 1 and f.statistics().queued == 2
    assert all(isinstance(v, ferry.Closed) for v in got.values()) and len(got) == 3
    assert isinstance(got[0], trio.ClosedResourceError)
    s = f.statistics()
    assert (s.queued, s.busy, s.lanes) == (0, 0, 0)
    assert stm.statistics().waiters == 0
    with pytest.raises(ferry.Closed):
        await f(9)


async def test_closing_scope_cancelled_from_outside_still_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    rec.gate = trio.Event()
    got: list[Any] = []

    async def one(f: ferry.Ferry[int, Any], i: int) -> None:
        try:
            await f(i)
        except ferry.Closed as exc:
            got.append(exc)

    async with trio.open_nursery() as n:
        with trio.move_on_after(5.0):
            async with ferry.open_ferry(rec.plain, max_batch_size=1, max_in_flight_batches=1) as f:
                n.start_soon(one, f, 1)
                n.start_soon(one, f, 2)
                await trio.sleep_forever()
    assert len(got) == 2


async def test_failure_in_the_block_closes_the_ferry_and_propagates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    with pytest.raises(KeyError):
        async with ferry.open_ferry(rec.plain) as f:
            raise KeyError("user bug")
    with pytest.raises(ferry.Closed):
        await f(1)


# ----------------------------------------------------------------------------- per-key ferry


async def test_one_call_in_flight_per_key_and_keys_run_in_parallel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder(delay=1.0)
    async with (
        ferry.open_per_key_ferry(
            rec.per_key, key=lambda x: x[0], max_batch_size=2, max_in_flight_batches=4
        ) as f,
        trio.open_nursery() as n,
    ):
        for k in "abc":
            for i in range(5):
                n.start_soon(f, (k, i))
    assert rec.max_in_flight_per_key == 1
    assert rec.max_in_flight >= 2
    by_key: dict[str, list[int]] = defaultdict(list)
    for key, xs in rec.calls:
        by_key[key].extend(i for _, i in xs)
    assert {k: sorted(v) for k, v in by_key.items()} == {k: list(range(5)) for k in "abc"}


async def test_rank_orders_inputs_within_a_lane(autojump_clock: trio.testing.MockClock) -> None:
    rec = Recorder()
    async with (
        ferry.open_per_key_ferry(
            rec.per_key,
            key=lambda x: "k",
            rank=lambda x: -x,
            max_batch_size=10,
            max_batch_delay=1.0,
            direct_calls=False,
        ) as f,
        trio.open_nursery() as n,
    ):
        for i in (3, 1, 4, 1, 5):
            n.start_soon(f, i)
            await settle()
    assert rec.calls == [("k", [5, 4, 3, 1, 1])]


async def test_weights_split_batches_and_a_heavy_input_goes_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    async with (
        ferry.open_per_key_ferry(
            rec.per_key,
            key=lambda x: "k",
            weight=lambda x: x,
            max_batch_weight=5,
            max_batch_delay=1.0,
            max_in_flight_batches=1,
            direct_calls=False,
        ) as f,
        trio.open_nursery() as n,
    ):
        for w in (2, 2, 2, 9, 1):
            n.start_soon(f, w)
            await settle()
    assert [xs for _, xs in rec.calls] == [[2, 2], [2], [9], [1]]


async def test_queued_weight_rejects_and_bad_weights_are_refused_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    rec.gate = trio.Event()
    async with ferry.open_per_key_ferry(
        rec.per_key,
        key=lambda x: x[0],
        weight=lambda x: x[1],
        max_queued_weight=5,
        max_batch_delay=10.0,
    ) as f:
        async with trio.open_nursery() as n:
            n.start_soon(f, ("a", 4))
            await settle()
            with pytest.raises(ferry.Rejected):
                await f(("b", 2))
            for bad, exc in [
                (-1, ValueError),
                (math.nan, ValueError),
                (math.inf, ValueError),
                (6, ValueError),
                ("1", TypeError),
            ]:
                with pytest.raises(exc, match="weight"):
                    await f(("c", bad))
            rec.gate.set()
        s = f.statistics()
        assert s.submitted == 2 and s.rejected == 1


async def test_key_errors_are_raised_at_once_and_nothing_is_admitted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()

    def key(x: Any) -> Any:
        if x == "boom":
            raise LookupError("no key for boom")
        return x

    async with ferry.open_per_key_ferry(rec.per_key, key=key) as f:
        with pytest.raises(TypeError, match="hashable"):
            await f([1, 2])
        with pytest.raises(LookupError, match="boom"):
            await f("boom")
        assert f.statistics().submitted == 0
    assert rec.calls == []


async def test_ready_keys_are_served_first_come_first_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder(delay=1.0)
    async with (
        ferry.open_per_key_ferry(
            rec.per_key,
            key=lambda x: x[0],
            max_in_flight_batches=1,
            max_batch_size=1,
            direct_calls=False,
        ) as f,
        trio.open_nursery() as n,
    ):
        for k in "abcd":
            n.start_soon(f, (k, 1))
            await settle()
        n.start_soon(f, ("a", 2))  # a is busy/ready again: it goes to the back of the line
        await settle()
    assert [key for key, _ in rec.calls] == ["a", "b", "c", "d", "a"]


# ------------------------------------------------------------------------------ direct calls


async def test_with_unbounded_direct_calls_an_idle_key_is_served_while_every_worker_is_busy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first design's behaviour, kept with `max_in_flight_calls=math.inf`."""
    hold_a1, hold_a2 = trio.Event(), trio.Event()

    async def call(key: str, xs: list[Any]) -> list[Any]:
        if xs == [("a", 1)]:
            await hold_a1.wait()
        if xs == [("a", 2)]:
            await hold_a2.wait()
        await trio.lowlevel.checkpoint()
        return xs

    async with (
        ferry.open_per_key_ferry(
            call, key=lambda x: x[0], max_in_flight_batches=1, max_in_flight_calls=math.inf
        ) as f,
        trio.open_nursery() as n,
    ):
        n.start_soon(f, ("a", 1))  # idle key: a direct call
        await settle()
        n.start_soon(f, ("a", 2))  # key busy: waits in its lane
        await settle()
        hold_a1.set()
        await settle()  # the only worker took ("a", 2) and hangs
        s = f.statistics()
        assert (s.direct_calls, s.batches, s.busy) == (1, 1, 1)
        assert await f(("fast", 1)) == ("fast", 1)
        assert f.statistics().direct_calls == 2
        hold_a2.set()


async def test_second_input_waits_for_the_direct_call_to_end_even_with_slow_cleanup(
    autojump_clock: trio.testing.MockClock,
) -> None:
    order: list[str] = []
    in_flight = 0

    async def call(key: str, xs: list[Any]) -> list[Any]:
        nonlocal in_flight
        in_flight += 1
        assert in_flight == 1, "two calls in flight for one key"
        try:
            order.append(f"start {xs}")
            await trio.sleep(1.0)
            return xs
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(5.0)  # slow cleanup
            order.append(f"end {xs}")
            in_flight -= 1

    async with ferry.open_per_key_ferry(call, key=lambda x: "k") as f, trio.open_nursery() as n:
        n.start_soon(f, 1)
        await settle()
        assert f.statistics().direct_calls == 1
        n.start_soon(f, 2)
    assert order == ["start [1]", "end [1]", "start [2]", "end [2]"]


async def test_direct_call_is_cancelled_with_its_caller_and_key_released_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[str] = []

    async def call(key: str, xs: list[Any]) -> list[Any]:
        try:
            await trio.sleep_forever()
        finally:
            seen.append("cancelled")
        raise AssertionError("unreachable")  # pragma: no cover

    async with ferry.open_per_key_ferry(call, key=lambda x: "k") as f:
        with trio.move_on_after(1.0):
            await f(1)
        assert seen == ["cancelled"]
        s = f.statistics()
        assert (s.busy, s.lanes) == (0, 0)


async def test_direct_call_is_cancelled_by_close_and_caller_gets_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    got: list[Any] = []

    async def call(key: str, xs: list[Any]) -> list[Any]:
        await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    async def one(f: ferry.PerKeyFerry[int, Any]) -> None:
        try:
            await f(1)
        except ferry.Closed as exc:
            got.append(exc)

    async with trio.open_nursery() as n, ferry.open_per_key_ferry(call, key=lambda x: "k") as f:
        n.start_soon(one, f)
        await settle()
        assert f.statistics().busy == 1
    assert len(got) == 1
    assert f.statistics().busy == 0


async def test_direct_call_failure_is_failed_with_cause(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def call(key: str, xs: list[Any]) -> list[Any]:
        raise OSError("remote down")

    async with ferry.open_per_key_ferry(call, key=lambda x: "k") as f:
        with pytest.raises(ferry.Failed) as info:
            await f(1)
        assert isinstance(info.value.__cause__, OSError)
        assert f.statistics().failed_batches == 1


# -------------------------------------------------------------------------------- statistics


def test_statistics_has_exactly_the_documented_fields() -> None:
    import attrs

    names = [a.name for a in attrs.fields(ferry.FerryStatistics)]
    assert names == [
        "queued",
        "queued_weight",
        "busy",
        "lanes",
        "ready",
        "waiting",
        "submitted",
        "admitted",
        "rejected",
        "after_close",
        "direct_calls",
        "batches",
        "inputs_sent",
        "failed_batches",
        "dropped",
        "drained",
        "batch_sizes",
    ]


def test_every_counter_of_the_room_is_reported_under_its_own_name() -> None:
    import attrs

    from ferry import _lanes

    names = [a.name for a in attrs.fields(ferry.FerryStatistics)]
    gauges = ["queued", "queued_weight", "busy", "lanes", "ready", "waiting", "batch_sizes"]
    assert sorted(_lanes.COUNTERS) == sorted(n for n in names if n not in gauges)


async def test_stats_gauges_for_per_key_lanes(autojump_clock: trio.testing.MockClock) -> None:
    rec = Recorder()
    rec.gate = trio.Event()
    async with (
        ferry.open_per_key_ferry(
            rec.per_key,
            key=lambda x: x[0],
            weight=lambda x: 2.5,
            max_batch_size=2,
            max_batch_delay=10.0,
            max_in_flight_batches=1,
            direct_calls=False,
        ) as f,
        trio.open_nursery() as n,
    ):
        n.start_soon(f, ("a", 1))
        n.start_soon(f, ("a", 2))  # full: ready, taken, hangs on the gate
        n.start_soon(f, ("b", 1))  # partial: waiting
        n.start_soon(f, ("c", 1))
        n.start_soon(f, ("c", 2))  # full, but the only worker is busy: ready
        await settle()
        s = f.statistics()
        assert (s.lanes, s.busy, s.ready, s.waiting) == (3, 1, 1, 1)
        assert (s.queued, s.queued_weight) == (3, 7.5)
        rec.gate.set()


async def test_bad_ranks_are_refused_clearly_and_nothing_is_admitted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    async with ferry.open_per_key_ferry(
        rec.per_key, key=lambda x: "k", rank=lambda x: x, max_batch_delay=5.0
    ) as f:
        async with trio.open_nursery() as n:
            n.start_soon(f, 1)
            await settle()
            with pytest.raises(TypeError, match="does not compare"):
                await f("one")
            with pytest.raises(TypeError, match="rank"):
                await f(None)
            assert f.statistics().queued == 1
    assert rec.calls == [("k", [1])]


class StepCounter(trio.abc.Instrument):
    """Counts how many times each task ran (one step = from a resume to the next park)."""

    def __init__(self) -> None:
        self.steps: Counter[str] = Counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name] += 1


async def test_an_admitted_caller_parks_once_for_its_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    counter = StepCounter()
    async with ferry.open_ferry(rec.plain, max_batch_delay=1.0) as f:

        async def caller() -> None:
            assert await f(1) == ("ok", 1)

        trio.lowlevel.add_instrument(counter)
        try:
            async with trio.open_nursery() as n:
                n.start_soon(caller, name="the caller")
        finally:
            trio.lowlevel.remove_instrument(counter)
    # One step runs it up to its park (admission included), one delivers the answer.
    assert counter.steps["the caller"] == 2


async def test_a_direct_call_that_never_yields_is_still_a_checkpoint_on_every_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def call(key: int, xs: list[int]) -> list[Any]:
        if key == 1:
            raise OSError("refused without waiting")
        if key == 2:
            return [ferry.IdReused("id 2 was used for other content")]
        return list(xs)

    async with ferry.open_per_key_ferry(call, key=lambda x: x) as f:
        with trio.testing.assert_checkpoints():
            assert await f(0) == 0
        with trio.testing.assert_checkpoints(), pytest.raises(ferry.Failed):
            await f(1)
        with trio.testing.assert_checkpoints(), pytest.raises(ferry.IdReused):
            await f(2)
        assert f.statistics().direct_calls == 3


# ------------------------------------------------------------------- what `call` must be


async def test_a_call_that_is_not_async_is_refused_at_open() -> None:
    def plain_def(xs: list[int]) -> list[int]:
        return xs

    def keyed_def(key: int, xs: list[int]) -> list[int]:
        return xs

    async def agen(xs: list[int]) -> Any:
        yield xs

    for call in (plain_def, lambda xs: xs, functools.partial(plain_def), agen):
        with pytest.raises(TypeError, match="async def"):
            async with ferry.open_ferry(call):  # type: ignore[arg-type]
                pass  # pragma: no cover
    for keyed in (keyed_def, lambda k, xs: xs):
        with pytest.raises(TypeError, match="async def"):
            async with ferry.open_per_key_ferry(keyed, key=lambda x: x):  # type: ignore[arg-type]
                pass  # pragma: no cover


class _AsyncCallable:
    async def __call__(self, xs: list[int]) -> list[int]:
        await trio.lowlevel.checkpoint()
        return xs

    async def method(self, xs: list[int]) -> list[int]:
        return await self(xs)


async def test_every_kind_of_async_callable_is_accepted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def scale(factor: int, xs: list[int]) -> list[int]:
        return [factor * x for x in xs]

    obj = _AsyncCallable()
    for call, expected in (
        (obj, 3),
        (obj.method, 3),
        (functools.partial(scale, 2), 6),
    ):
        async with ferry.open_ferry(call) as f:
            assert await f(3) == expected


async def test_a_call_that_returns_no_awaitable_is_a_batch_contract_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A callable object (not refused at open) whose call returns a plain value."""

    class SyncInDisguise:
        def __call__(self, *args: Any) -> Any:
            return [("not awaited", args)]

    async with ferry.open_ferry(SyncInDisguise(), max_batch_delay=1.0) as f:
        with pytest.raises(ferry.BatchContractError, match="not an awaitable") as info:
            await f(1)
        assert "async def" in str(info.value)
        s = f.statistics()
        assert s.batches == 1 and s.failed_batches == 0
    async with ferry.open_per_key_ferry(SyncInDisguise(), key=lambda x: x) as g:
        with pytest.raises(ferry.BatchContractError, match="not an awaitable"):
            await g(1)  # a direct call
        assert g.statistics().busy == 0


async def test_failed_names_the_key_only_for_a_per_key_ferry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def plain(xs: list[int]) -> list[int]:
        raise OSError("backend down")

    async def keyed(key: str, xs: list[int]) -> list[int]:
        raise OSError("backend down")

    async with ferry.open_ferry(plain) as f:
        with pytest.raises(ferry.Failed) as info:
            await f(1)
    assert "key" not in str(info.value) and "backend down" in str(info.value)
    async with ferry.open_per_key_ferry(keyed, key=lambda x: "acct-7") as g:
        with pytest.raises(ferry.Failed, match="for key 'acct-7'"):
            await g(1)


async def test_statistics_is_the_name_and_stats_a_deprecated_alias(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def call(xs: list[int]) -> list[int]:
        return xs

    async def keyed(key: int, xs: list[int]) -> list[int]:
        return xs

    async with ferry.open_ferry(call) as f, ferry.open_per_key_ferry(keyed, key=lambda x: x) as g:
        await f(1)
        await g(1)
        for fy in (f, g):
            s = fy.statistics()
            with pytest.warns(DeprecationWarning, match=r"statistics\(\)"):
                assert fy.stats() == s


async def test_batch_sizes_cannot_be_changed_through_a_snapshot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def call(xs: list[int]) -> list[int]:
        return xs

    async with ferry.open_ferry(call) as f:
        await f(1)
        s = f.statistics()
        with pytest.raises(TypeError):
            s.batch_sizes[1] = 99  # type: ignore[index]
        assert f.statistics().batch_sizes == {1: 1}


async def test_every_outcome_is_counted_once_and_the_counts_are_conserved(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    rec.gate = trio.Event()  # never set: the direct call holds key a until close
    outcomes: list[str] = []

    async def one(x: tuple[str, int]) -> None:
        try:
            await f(x)
            outcomes.append("result")
        except ferry.Closed:
            outcomes.append("closed")

    async with trio.open_nursery() as n:
        async with ferry.open_per_key_ferry(
            rec.per_key, key=lambda x: x[0], max_queueing=3, max_in_flight_batches=1
        ) as f:
            n.start_soon(one, ("a", 1))  # a direct call
            await settle()
            for i in (2, 3):
                n.start_soon(one, ("a", i))  # wait for the key
            await settle()
            with trio.move_on_after(1.0):
                await f(("a", 4))  # waits, then its caller gives up: dropped
            n.start_soon(one, ("a", 5))
            await settle()
            with pytest.raises(ferry.Rejected):
                await f(("a", 6))  # the room holds 3: full
            s = f.statistics()
            conserved(s)
            assert (s.submitted, s.direct_calls, s.admitted, s.rejected) == (6, 1, 4, 1)
            assert (s.queued, s.dropped) == (3, 1)
    # Close cancelled the direct call and drained the three inputs still waiting.
    s = f.statistics()
    conserved(s)
    assert (s.drained, s.queued, s.after_close, s.busy) == (3, 0, 0, 0)
    assert sorted(outcomes) == ["closed"] * 4
    with pytest.raises(ferry.Closed):
        await f(("c", 1))
    s = f.statistics()
    conserved(s)
    assert s.after_close == 1


# ------------------------------------------------------------------- the wrong run or thread


async def _echo(xs: list[int]) -> list[int]:
    await trio.lowlevel.checkpoint()
    return xs


async def _echo_key(key: int, xs: list[int]) -> list[int]:
    await trio.lowlevel.checkpoint()
    return xs


async def test_a_ferry_called_from_another_trio_run_raises_instead_of_hanging() -> None:
    async with (
        ferry.open_ferry(_echo) as f,
        ferry.open_per_key_ferry(_echo_key, key=lambda x: x) as g,
    ):
        for fy in (f, g):

            def other_run(fy: Any = fy) -> None:
                async def main() -> None:
                    with trio.fail_after(10):  # only a guard: without the check, this hangs
                        await fy(1)

                trio.run(main)

            with pytest.raises(RuntimeError, match="another trio run") as info:
                await trio.to_thread.run_sync(other_run)
            assert str(info.value) == (
                "a ferry was called from a task of another trio run: a ferry belongs to the trio"
                " run that opened it, and only that run's tasks may call it. From another"
                " thread, call it in its run: trio.from_thread.run(f, x, trio_token=token), with"
                " the token of that run (trio.lowlevel.current_trio_token() there)"
            )
            assert await fy(2) == 2  # the ferry is unharmed and serves its own run
            assert fy.statistics().submitted == 1


async def test_a_ferry_called_from_a_thread_outside_trio_says_so() -> None:
    import asyncio

    async with ferry.open_ferry(_echo) as f:
        with pytest.raises(RuntimeError, match="outside any trio run") as info:
            await trio.to_thread.run_sync(asyncio.run, f(1))
        assert str(info.value).startswith(
            "a ferry was called outside any trio run (a plain thread): a ferry belongs to the"
            " trio run that opened it"
        )
        assert "trio.from_thread.run(f, x, trio_token=token)" in str(info.value)
        token = trio.lowlevel.current_trio_token()
        # The way to call it from a thread: into the ferry's own run.
        assert await trio.to_thread.run_sync(lambda: trio.from_thread.run(f, 3, trio_token=token))
        assert f.statistics().submitted == 1


# ---------------------------------------------------------------------- a call that hangs


async def _closed_into(got: list[Any], f: ferry.Ferry[int, Any]) -> None:
    """Call `f(1)`, which must end in `Closed`, and keep the exception in `got`."""
    try:
        await f(1)
    except ferry.Closed as exc:
        got.append(exc)


async def _hang(*args: Any) -> list[Any]:
    await trio.sleep_forever()
    raise AssertionError("unreachable")  # pragma: no cover


@pytest.mark.parametrize("value", [0, -1.0, math.nan, "60"])
async def test_call_timeout_is_checked_at_open(value: Any) -> None:
    with pytest.raises(ValueError, match="call_timeout"):
        async with ferry.open_ferry(_echo, call_timeout=value):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="call_timeout"):
        async with ferry.open_per_key_ferry(_echo_key, key=lambda x: x, call_timeout=value):
            pass  # pragma: no cover


async def test_a_batch_call_that_hangs_fails_its_callers_after_the_default_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    got: list[BaseException] = []

    async def one(f: ferry.Ferry[int, Any], i: int) -> None:
        try:
            await f(i)
        except ferry.Failed as exc:
            got.append(exc)

    async with ferry.open_ferry(_hang, max_batch_delay=1.0) as f:
        start = trio.current_time()
        with trio.fail_after(1000):  # a guard: without a timeout, the callers wait for ever
            async with trio.open_nursery() as n:
                for i in range(3):
                    n.start_soon(one, f, i)
        assert trio.current_time() == start + 1.0 + 60.0  # the delay, then the default timeout
        s = f.statistics()
        assert (s.batches, s.failed_batches, s.busy) == (1, 1, 0)
    assert len(got) == 3
    assert all(isinstance(e.__cause__, trio.TooSlowError) for e in got)
    assert "call_timeout" in str(got[0])


async def test_a_call_that_hangs_holds_the_key_until_it_has_unwound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    in_flight = 0
    order: list[str] = []

    async def call(key: str, xs: list[int]) -> list[int]:
        nonlocal in_flight
        in_flight += 1
        assert in_flight == 1, "two calls in flight for one key"
        try:
            if xs == [1]:
                await trio.sleep_forever()
            return xs
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(2.0)  # slow cleanup after the timeout
            order.append(f"end {xs}")
            in_flight -= 1

    with trio.fail_after(1000):  # a guard: without a timeout, this never ends
        await _hold_the_key(call, order)
    assert order == ["end [1]", "end [2]"]


async def _hold_the_key(call: Any, order: list[str]) -> None:
    async with (
        ferry.open_per_key_ferry(call, key=lambda x: "k", call_timeout=5.0) as f,
        trio.open_nursery() as n,
    ):
        start = trio.current_time()

        async def first() -> None:
            with pytest.raises(ferry.Failed) as info:
                await f(1)  # a direct call
            assert isinstance(info.value.__cause__, trio.TooSlowError)
            assert trio.current_time() == start + 7.0

        n.start_soon(first)
        await settle()
        assert await f(2) == 2  # waits in the lane until the direct call is over
        assert f.statistics().failed_batches == 1


async def test_with_an_infinite_call_timeout_a_hanging_call_is_ended_by_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    got: list[Any] = []
    async with trio.open_nursery() as n:
        with trio.move_on_after(1000.0):
            async with ferry.open_ferry(_hang, call_timeout=math.inf) as f:
                n.start_soon(_closed_into, got, f)
                await trio.sleep_forever()
    assert len(got) == 1 and trio.current_time() == 1000.0


async def test_a_worker_that_fails_while_the_block_raises_loses_neither_exception(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def call(xs: list[int]) -> list[int]:
        try:
            await trio.sleep_forever()
        finally:
            raise KeyboardInterrupt  # say, a Ctrl-C that lands while the call is cancelled
        raise AssertionError("unreachable")  # pragma: no cover

    got: list[Any] = []
    async with trio.open_nursery() as n:
        with pytest.raises(BaseExceptionGroup) as info:
            async with ferry.open_ferry(call) as f:
                n.start_soon(_closed_into, got, f)
                await settle()  # the call is in flight
                raise ValueError("the block's own error")
    assert info.value.subgroup(ValueError) is not None, info.value
    assert info.value.subgroup(KeyboardInterrupt) is not None, info.value
    assert len(got) == 1  # its caller was answered
    s = f.statistics()
    assert (s.busy, s.lanes, s.queued) == (0, 0, 0)


async def test_an_exception_from_the_block_alone_comes_out_as_it_was_raised() -> None:
    with pytest.raises(KeyError):
        async with ferry.open_ferry(_echo):
            raise KeyError("user bug")


# ------------------------------------------------------------------------------ memory per caller


async def _tracked_per_waiting_caller(open_it: Any, n: int = 4000) -> float:
    """GC-tracked objects that one more caller parked in a ferry holds (its task included)."""
    import gc

    async with open_it() as f, trio.open_nursery() as n_:
        n_.start_soon(f, -1)
        await settle()
        gc.collect()
        before = len(gc.get_objects())
        for i in range(n):
            n_.start_soon(f, i)
        await settle()
        gc.collect()
        per = (len(gc.get_objects()) - before) / n
        n_.cancel_scope.cancel()
    return per


async def test_a_waiting_caller_holds_no_more_gc_tracked_objects_than_before() -> None:
    """10 per caller parked by `start_soon(f, x)` (a bare trio task alone holds 9; 11 before the
    ferry's `__call__` returned the shell's coroutine instead of awaiting it), and 16 with a key
    of its own before the lanes map was an `immutables.Map`. A careless design doubles the cost
    of every gen-0 collection at 100k waiting callers, so this must not grow."""
    many: dict[str, Any] = {"max_batch_delay": 1e6, "max_batch_size": 10**9, "max_queueing": 10**9}
    plain = await _tracked_per_waiting_caller(lambda: ferry.open_ferry(_echo, **many))
    one_key = await _tracked_per_waiting_caller(
        lambda: ferry.open_per_key_ferry(_echo_key, key=lambda x: 0, **many)
    )
    own_keys = await _tracked_per_waiting_caller(
        lambda: ferry.open_per_key_ferry(_echo_key, key=lambda x: x, **many)
    )
    assert plain <= 10.05 and one_key <= 10.05, (plain, one_key)
    assert own_keys <= 14.0, own_keys  # plus a lane, its tail tuple, its map and queue slots


# --------------------------------------------------------------- direct calls under load


async def test_calls_in_flight_never_exceed_the_bound_under_thousands_of_idle_keys(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bounds: list[tuple[int, dict[str, Any]]] = [(4, {}), (7, {"max_in_flight_calls": 7})]
    for bound, options in bounds:
        rec = Recorder(delay=1.0)
        async with (
            ferry.open_per_key_ferry(rec.per_key, key=lambda x: x, **options) as f,
            trio.open_nursery() as n,
        ):
            for i in range(3000):  # every key idle when its input arrives
                n.start_soon(f, i)
        assert rec.max_in_flight == bound  # reached, never exceeded
        s = f.statistics()
        assert 0 < s.direct_calls < 3000 and s.batches > 0  # the rest went in batches
        assert s.direct_calls + s.inputs_sent == 3000 == sum(len(xs) for _, xs in rec.calls)


async def test_an_infinite_bound_sends_every_idle_key_directly_as_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder(delay=1.0)
    async with (
        ferry.open_per_key_ferry(rec.per_key, key=lambda x: x, max_in_flight_calls=math.inf) as f,
        trio.open_nursery() as n,
    ):
        for i in range(3000):
            n.start_soon(f, i)
    assert f.statistics().direct_calls == 3000 and rec.max_in_flight == 3000


async def test_an_idle_key_on_a_quiet_ferry_still_gets_a_direct_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    callers: list[Any] = []

    async def call(key: str, xs: list[Any]) -> list[Any]:
        callers.append(trio.lowlevel.current_task())
        await trio.lowlevel.checkpoint()
        return xs

    async with ferry.open_per_key_ferry(call, key=lambda x: x[0]) as f:
        for i in range(3):  # one after the other: the ferry is quiet each time
            start = trio.current_time()
            assert await f(("a", i)) == ("a", i)
            assert trio.current_time() == start  # no wait for a worker
        assert callers == [trio.lowlevel.current_task()] * 3  # sent by the caller itself
        s = f.statistics()
        assert (s.direct_calls, s.batches) == (3, 0)


async def test_an_idle_key_on_a_loaded_ferry_waits_for_a_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = Recorder()
    rec.gate = trio.Event()
    async with (
        ferry.open_per_key_ferry(rec.per_key, key=lambda x: x[0], max_in_flight_batches=2) as f,
        trio.open_nursery() as n,
    ):
        for k in "ab":  # two direct calls hold both call slots
            n.start_soon(f, (k, 1))
            await settle()
        n.start_soon(f, ("c", 1))  # idle key, but no slot: it waits, ready, for a worker
        await settle()
        n.start_soon(f, ("c", 2))  # and company joins it
        await settle()
        s = f.statistics()
        assert (s.direct_calls, s.busy, s.queued, s.ready) == (2, 2, 2, 1)
        rec.gate.set()
    assert ("c", [("c", 1), ("c", 2)]) in rec.calls  # one batch, taken when a slot came free
    assert f.statistics().batches == 1


async def test_a_direct_call_that_yields_adds_no_schedule_point_of_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The call's own checkpoint is the checkpoint of `await f(x)`: the caller's task runs one
    step up to it and one after, as if it had awaited the call itself (ADR 0032). A call that
    never yields still gets one (test above)."""

    async def call(key: int, xs: list[int]) -> list[int]:
        await trio.lowlevel.checkpoint()
        return xs

    counter = StepCounter()
    async with ferry.open_per_key_ferry(call, key=lambda x: x) as f:

        async def caller() -> None:
            with trio.testing.assert_checkpoints():
                assert await f(1) == 1

        async def bare() -> None:
            assert await call(1, [1]) == [1]

        trio.lowlevel.add_instrument(counter)
        try:
            async with trio.open_nursery() as n:
                n.start_soon(caller, name="through the ferry")
                n.start_soon(bare, name="the call alone")
        finally:
            trio.lowlevel.remove_instrument(counter)
        assert f.statistics().direct_calls == 1
    assert counter.steps["through the ferry"] == counter.steps["the call alone"] == 2


def test_the_schedule_point_count_is_read_from_trio_or_not_at_all() -> None:
    from ferry._schedule_points import reader

    read = reader()
    assert read is not None  # the trio we test with keeps the count

    async def main() -> None:
        task = trio.lowlevel.current_task()
        before = read(task)
        await trio.lowlevel.checkpoint()
        assert read(task) == before + 1

    trio.run(main)

    class TaskWithoutTheCount:
        __slots__ = ("name",)

    class TaskWithAPlainAttribute:
        _schedule_points = 0  # not trio's slot: not trusted

    assert reader(TaskWithoutTheCount) is None
    assert reader(TaskWithAPlainAttribute) is None


@pytest.mark.parametrize("yields", [False, True])
async def test_without_trios_count_every_direct_call_adds_its_schedule_point(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, yields: bool
) -> None:
    """The fallback for a trio that keeps no count (as `reader` answers for such a trio): a
    direct call is still a checkpoint on every outcome, and one that yields costs the caller's
    task one step more than the call alone (the schedule point added after it)."""
    import ferry._shell

    monkeypatch.setattr(ferry._shell, "_schedule_points", None)

    async def call(key: int, xs: list[int]) -> list[Any]:
        if yields:
            await trio.lowlevel.checkpoint()
        if key == 1:
            raise OSError("refused")
        return list(xs)

    counter = StepCounter()
    async with ferry.open_per_key_ferry(call, key=lambda x: x) as f:
        with trio.testing.assert_checkpoints():
            assert await f(0) == 0
        with trio.testing.assert_checkpoints(), pytest.raises(ferry.Failed):
            await f(1)

        async def caller() -> None:
            assert await f(2) == 2

        async def bare() -> None:
            assert await call(2, [2]) == [2]

        trio.lowlevel.add_instrument(counter)
        try:
            async with trio.open_nursery() as n:
                n.start_soon(caller, name="through the ferry")
                n.start_soon(bare, name="the call alone")
        finally:
            trio.lowlevel.remove_instrument(counter)
        assert f.statistics().direct_calls == 3
    alone = counter.steps["the call alone"]
    assert alone == (2 if yields else 1)
    assert counter.steps["through the ferry"] == alone + 1


@pytest.mark.parametrize("keyed", [False, True])
async def test_what_a_caller_sent_is_freed_with_its_answer_not_by_the_collector(
    keyed: bool,
) -> None:
    """A batched call leaves no reference cycle behind: once the caller has its answer and
    drops its input, the input is gone at once (reference counting), with the cyclic garbage
    collector off, and the worker keeps nothing of a batch while it sleeps. A cycle per call
    (the caller's entry and its place in the room holding each other) kept every input, and all
    it held, alive until the next collection."""
    import gc
    import weakref

    class Input:
        pass

    async def call(xs: list[Input]) -> list[int]:
        await trio.lowlevel.checkpoint()
        return [1 for _ in xs]

    async def keyed_call(key: Any, xs: list[Input]) -> list[int]:
        return await call(xs)

    refs: list[weakref.ref[Input]] = []

    async def one(f: Any) -> None:
        x = Input()
        refs.append(weakref.ref(x))
        assert await f(x) == 1

    opened = (
        ferry.open_per_key_ferry(keyed_call, key=lambda x: 0, max_batch_size=8)
        if keyed
        else ferry.open_ferry(call, max_batch_size=8, max_in_flight_batches=1)
    )
    gc.collect()
    gc.disable()
    try:
        async with opened as f:
            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(one, f)
            assert len(refs) == 20
            alive = [i for i, r in enumerate(refs) if r() is not None]
            assert alive == [], alive
    finally:
        gc.enable()


async def test_an_input_error_answer_is_freed_with_its_caller_not_by_the_collector() -> None:
    """A caller answered by an `InputError` in its slot gets it raised (the caller's entry is its
    answer: `_Entry.unwrap`, ADR 0105), and that raise leaves no reference cycle: once the
    caller drops the exception, it and the input are gone at once, with the collector off."""
    import gc
    import weakref

    class Input:
        pass

    errors: list[weakref.ref[ferry.InputError]] = []
    inputs: list[weakref.ref[Input]] = []

    async def call(xs: list[Input]) -> list[Any]:
        await trio.lowlevel.checkpoint()
        out: list[Any] = []
        for i, _ in enumerate(xs):
            error = ferry.IdReused(f"slot {i} refused")
            errors.append(weakref.ref(error))
            out.append(error)
        return out

    async def one(f: Any) -> None:
        x = Input()
        inputs.append(weakref.ref(x))
        with pytest.raises(ferry.IdReused, match="refused"):
            await f(x)

    gc.collect()
    gc.disable()
    try:
        async with ferry.open_ferry(call, max_batch_size=8, max_in_flight_batches=1) as f:
            async with trio.open_nursery() as nursery:
                for _ in range(12):
                    nursery.start_soon(one, f)
            assert len(errors) == len(inputs) == 12
            refs: list[weakref.ref[Any]] = [*errors, *inputs]
            alive = [r for r in refs if r() is not None]
            assert alive == [], alive
    finally:
        gc.enable()
