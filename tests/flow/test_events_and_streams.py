"""Events and streams out of a running flow (SPEC 5.10), through the public API: `ctx.set_event`
and `ctx.emit` saved with the step's outcome, checked at the call, bounded with the outcome;
`get_event`, `get_events` and `stream`, woken by the engine's commit and sharing one read per
write (counted at the store's `Feeds.reads`); retention deletes them with their flow. On
SQLite under a MockClock; the same writes on PostgreSQL.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

from ferry import flow
from ferry.flow._model import _signals
from ferry.flow._store import _signals as stored
from ferry.projected import Store


def gated_plan(gates: dict[str, trio.Event], name: str = "progress") -> flow.Plan:
    """Three steps: each emits its name and sets ``"at"``; the second waits for a gate."""
    plan = flow.Plan(name)

    @plan.step
    async def one(ctx: flow.Context) -> None:
        ctx.emit("one")
        ctx.emit({"n": 1})
        ctx.set_event("at", 1)

    @plan.step
    async def two(ctx: flow.Context) -> None:
        await gates.setdefault(ctx.flow_id, trio.Event()).wait()
        ctx.emit("two")
        ctx.set_event("at", 2)
        ctx.set_event("paid", True)

    @plan.step
    async def three(ctx: flow.Context) -> None:
        ctx.emit("three")

    return plan


async def _all(engine: Any, fid: str, after: int = 0) -> list[tuple[int, Any]]:
    return [item async for item in engine.stream(fid, after=after)]


async def test_a_stream_and_events_follow_a_running_flow(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    gates: dict[str, trio.Event] = {}
    plan = gated_plan(gates)
    async with flow.open_engine(tmp_path / "f.db", plans=[plan]) as engine:
        fid = await engine.start(plan, flow_id="o-1")
        assert await engine.get_event(fid, "at") == 1
        got: list[tuple[int, Any]] = []
        async with trio.open_nursery() as nursery:

            async def follow() -> None:
                got.extend(await _all(engine, fid))

            nursery.start_soon(follow)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            assert await engine.get_events(fid) == {"at": 1}
            with pytest.raises(trio.TooSlowError):
                await engine.get_event(fid, "paid", timeout=5)
            gates[fid].set()
            assert await engine.get_event(fid, "paid", timeout=5) is True
        assert got == [(1, "one"), (2, {"n": 1}), (3, "two"), (4, "three")]
        assert await engine.get_events(fid) == {"at": 2, "paid": True}
        # A reader that joins late or resumes from an offset gets exactly the rest.
        assert await _all(engine, fid, after=2) == [(3, "two"), (4, "three")]
        assert await _all(engine, fid, after=4) == []
        with pytest.raises(LookupError, match="without setting event 'never'"):
            await engine.get_event(fid, "never")
        with pytest.raises(flow.UnknownFlow):
            await engine.get_event("nobody", "at")
        with pytest.raises(flow.UnknownFlow):
            await _all(engine, "nobody")


async def test_a_step_that_raises_records_nothing_and_its_retry_emits_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    plan = flow.Plan("flaky")
    runs: list[int] = []

    @plan.step(attempts=3)
    async def work(ctx: flow.Context) -> None:
        runs.append(ctx.attempt)
        ctx.emit(f"attempt {ctx.attempt}")
        ctx.set_event("last", ctx.attempt)
        if ctx.attempt < 3:
            raise RuntimeError("not yet")

    async with flow.open_engine(tmp_path / "f.db", plans=[plan]) as engine:
        fid = await engine.start(plan)
        assert (await engine.wait(fid)).state is flow.State.COMPLETED
        assert runs == [1, 2, 3]
        assert await _all(engine, fid) == [(1, "attempt 3")]
        assert await engine.get_events(fid) == {"last": 3}


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda ctx: ctx.set_event(3, 1), TypeError, "key must be a str"),
        (lambda ctx: ctx.set_event("", 1), ValueError, "must not be empty"),
        (lambda ctx: ctx.set_event("k" * 300, 1), ValueError, "more than 256"),
        (lambda ctx: ctx.set_event("\udc80", 1), ValueError, "cannot be stored"),
        (lambda ctx: ctx.set_event("k", {1, 2}), TypeError, "must be JSON"),
        (lambda ctx: ctx.emit(float("nan")), TypeError, "must be JSON"),
        (lambda ctx: ctx.emit(b"bytes"), TypeError, "ctx.emit's value must be JSON"),
        (lambda ctx: ctx.emit("\udc80"), ValueError, "lone surrogate"),
    ],
)
async def test_bad_arguments_are_refused_at_the_call_and_nothing_is_recorded(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, call: Any, error: Any, match: str
) -> None:
    plan = flow.Plan("bad")
    raised: list[BaseException] = []

    @plan.step
    async def work(ctx: flow.Context) -> None:
        ctx.emit("before")
        try:
            call(ctx)
        except (TypeError, ValueError) as exc:
            raised.append(exc)
        ctx.emit("after")

    async with flow.open_engine(tmp_path / "f.db", plans=[plan]) as engine:
        fid = await engine.start(plan)
        assert (await engine.wait(fid)).state is flow.State.COMPLETED
        assert len(raised) == 1
        assert isinstance(raised[0], error)
        assert match in str(raised[0])
        assert await _all(engine, fid) == [(1, "before"), (2, "after")]
        assert await engine.get_events(fid) == {}


async def test_values_of_every_kind_keep_their_order_and_their_text(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """ASCII strs are kept as given until the step ends (docs/adr/0181), the others as JSON text
    at the call: mixed, they come back in the order emitted, each as it was (escapes too)."""
    plan = flow.Plan("kinds")
    given: list[Any] = [
        "plain",
        'quote " and \\ backslash',
        "line\nbreak\ttab\x01",
        {"n": 1, "l": [1, 2.5, None, True]},
        "after a dict",
        "é and 日本",
        7,
        "last",
    ]

    @plan.step
    async def work(ctx: flow.Context) -> None:
        mutable = {"k": "before"}
        ctx.emit(given[0])
        ctx.emit(given[1])
        ctx.emit(given[2])
        ctx.emit(mutable)
        mutable["k"] = "changed after the emit"
        for value in given[4:]:
            ctx.emit(value)

    @plan.step
    async def only_ascii(ctx: flow.Context) -> None:
        for n in range(3):
            ctx.emit(f'n="{n}"\n')

    given[3] = {"k": "before"}
    async with flow.open_engine(tmp_path / "f.db", plans=[plan]) as engine:
        fid = await engine.start(plan)
        assert (await engine.wait(fid)).state is flow.State.COMPLETED
        got = await _all(engine, fid)
    assert got == list(enumerate([*given, *(f'n="{n}"\n' for n in range(3))], 1))


async def test_a_value_too_large_or_a_stream_too_long_fails_the_flow_not_retried(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_signals, "MAX_STREAM", 5)
    plan = flow.Plan("big")
    runs: list[str] = []

    @plan.step(attempts=3)
    async def first(ctx: flow.Context) -> None:
        runs.append(ctx.flow_id)
        if ctx.data["what"] == "large":
            ctx.emit("x" * 2000)
        elif ctx.data["what"] == "event":
            ctx.set_event("k", "x" * 2000)
        else:
            for n in range(4):
                ctx.emit(n)

    @plan.step
    async def second(ctx: flow.Context) -> None:
        for n in range(2):
            ctx.emit(n)

    async with flow.open_engine(tmp_path / "f.db", plans=[plan], max_data_bytes=1000) as engine:
        for what, problem in [
            ("large", "emitted a value of 2002 bytes"),
            ("event", "set event 'k' to 2002 bytes"),
            ("long", "emitted 2 values to a stream of 4: a flow's stream holds at most 5"),
        ]:
            fid = await engine.start(plan, flow_id=what, data={"what": what})
            snap = await engine.wait(fid)
            assert snap.state is flow.State.FAILED
            assert snap.error is not None and problem in snap.error, snap.error
            assert "not retried" in snap.error
        assert runs == ["large", "event", "long"]
        assert await _all(engine, "long") == [(1, 0), (2, 1), (3, 2), (4, 3)]
        assert await _all(engine, "large") == []


async def test_many_readers_of_one_flow_share_one_read_per_write(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    plan = flow.Plan("ticks")
    gates = [trio.Event() for _ in range(5)]
    for i in range(5):

        async def tick(ctx: flow.Context, i: int = i) -> None:
            await gates[i].wait()
            ctx.emit(i)
            ctx.set_event("i", i)

        plan.step(name=f"tick{i}")(tick)
    readers = 50
    async with flow.open_engine(tmp_path / "f.db", plans=[plan]) as engine:
        feeds = engine._parts.feeds
        fid = await engine.start(plan)
        results: list[list[tuple[int, Any]]] = []
        async with trio.open_nursery() as nursery:

            async def follow() -> None:
                results.append(await _all(engine, fid))

            for _ in range(readers):
                nursery.start_soon(follow)
            await trio.testing.wait_all_tasks_blocked()
            first = feeds.reads
            assert first == 1  # the first read, for all of them
            for i in range(5):
                gates[i].set()
                await trio.testing.wait_all_tasks_blocked()
        assert results == [[(i + 1, i) for i in range(5)]] * readers
        # One read per write of the flow (5 steps, and the last write completes it), not per
        # reader: at most one more for a write that landed during a read.
        assert feeds.reads - first <= 2 * 5


async def test_a_cancelled_reader_leaves_nothing_behind(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    gates: dict[str, trio.Event] = {}
    plan = gated_plan(gates)
    async with flow.open_engine(tmp_path / "f.db", plans=[plan]) as engine:
        fid = await engine.start(plan)
        assert await engine.get_event(fid, "at") == 1
        with trio.move_on_after(1):
            await _all(engine, fid)
        with trio.move_on_after(1):
            await engine.get_event(fid, "paid")
        await trio.lowlevel.checkpoint()  # trio lets go of the outcome it last sent
        gc.collect()
        assert len(engine._parts.feeds._feeds) == 0
        gates[fid].set()
        assert (await engine.wait(fid)).state is flow.State.COMPLETED


async def test_every_reader_is_a_checkpoint(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    plan = gated_plan({})
    async with flow.open_engine(tmp_path / "f.db", plans=[plan]) as engine:
        fid = await engine.start(plan)
        await engine.get_event(fid, "at")
        with trio.testing.assert_checkpoints():
            await engine.get_event(fid, "at")
        with trio.testing.assert_checkpoints():
            await engine.get_events(fid)
        iterator = engine.stream(fid)
        with trio.testing.assert_checkpoints():
            await iterator.__anext__()


async def test_bad_reader_arguments_are_refused_at_the_call(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    plan = gated_plan({})
    async with flow.open_engine(tmp_path / "f.db", plans=[plan]) as engine:
        with pytest.raises(TypeError, match="after must be an int"):
            engine.stream("x", after="3")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="after must be >= 0"):
            engine.stream("x", after=-1)
        with pytest.raises(TypeError, match="key must be a str"):
            await engine.get_event("x", 3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            await engine.get_event("x", "k", timeout=-1)


async def test_the_engine_closing_ends_its_readers(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    gates: dict[str, trio.Event] = {}
    plan = gated_plan(gates)
    errors: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        async with flow.open_engine(tmp_path / "f.db", plans=[plan]) as engine:
            fid = await engine.start(plan)
            await engine.get_event(fid, "at")

            async def follow() -> None:
                try:
                    await _all(engine, fid)
                except flow.FlowError as exc:  # pragma: no cover - not this one
                    errors.append(exc)
                except Exception as exc:
                    errors.append(exc)

            nursery.start_soon(follow)
            await trio.testing.wait_all_tasks_blocked()
    assert len(errors) == 1 and type(errors[0]).__name__ == "Closed"


async def test_events_and_streams_are_written_and_purged_on_both_stores(make_store: Any) -> None:
    store: Store = make_store()
    plan = gated_plan({}, name="both")
    gates: dict[str, trio.Event] = {}
    plan = gated_plan(gates, name="both")
    async with flow.open_engine(store, plans=[plan]) as engine:
        fid = await engine.start(plan, flow_id="p-1")
        gates.setdefault(fid, trio.Event()).set()
        assert [v async for v in engine.stream(fid)][-1] == (4, "three")
        assert await engine.get_events(fid) == {"at": 2, "paid": True}
    from ferry.flow._store import _purge

    async def count(tx: Any) -> Any:
        raise AssertionError

    def rows(tx: Any) -> tuple[int, dict[str, str]]:
        return stored.length(tx, "p-1"), stored.events_of(tx, "p-1")

    assert await store.transact(rows) == (4, {"at": "2", "paid": "true"})
    deleted = await store.transact(lambda tx: _purge.purge_batch(tx, 1e12))
    assert deleted == ["p-1"]
    assert await store.transact(rows) == (0, {})


async def test_a_rerun_after_a_close_emits_once_and_offsets_go_on(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A step running when its engine closed runs again at the next open (attempt 2): what its
    first run emitted was never stored, and the stream goes on from the length in the store."""
    plan = flow.Plan("rerun")
    attempts: list[int] = []

    @plan.step
    async def first(ctx: flow.Context) -> None:
        ctx.emit("a")
        ctx.emit("b")

    @plan.step
    async def second(ctx: flow.Context) -> None:
        attempts.append(ctx.attempt)
        ctx.emit(f"second, attempt {ctx.attempt}")
        ctx.set_event("second", ctx.attempt)
        if ctx.attempt == 1:
            await trio.sleep_forever()

    path = tmp_path / "f.db"
    async with flow.open_engine(path, plans=[plan]) as engine:
        fid = await engine.start(plan)
        await trio.testing.wait_all_tasks_blocked()
        assert await engine.get_events(fid) == {}
    async with flow.open_engine(path, plans=[plan]) as engine:
        assert (await engine.wait(fid)).state is flow.State.COMPLETED
        assert await _all(engine, fid) == [(1, "a"), (2, "b"), (3, "second, attempt 2")]
        assert await engine.get_events(fid) == {"second": 2}
    assert attempts == [1, 2]


async def test_a_compensation_and_a_spawning_step_save_theirs_too(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    leaf = flow.Plan("leaf")

    @leaf.step
    async def leaf_work(ctx: flow.Context) -> None:
        ctx.emit("leaf")

    top = flow.Plan("top")

    async def undo(ctx: flow.Context) -> None:
        ctx.emit("undone")
        ctx.set_event("undone", True)

    @top.step(compensate=undo)
    async def fan_out(ctx: flow.Context) -> flow.Outcome:
        ctx.emit("spawning")
        ctx.set_event("children", 1)
        return flow.spawn([flow.Child(leaf, key="l")])

    @top.step
    async def after(ctx: flow.Context) -> flow.Outcome:
        ctx.emit("after")
        return flow.fail("and undo it")

    async with flow.open_engine(tmp_path / "f.db", plans=[top, leaf]) as engine:
        fid = await engine.start(top, flow_id="t")
        assert (await engine.wait(fid)).state is flow.State.FAILED
        assert await _all(engine, fid) == [(1, "spawning"), (2, "after"), (3, "undone")]
        assert await engine.get_events(fid) == {"children": 1, "undone": True}
        assert await _all(engine, "t/0/l") == [(1, "leaf")]


async def test_values_that_do_not_follow_the_stream_are_refused_never_stored_twice(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner whose count of the stream were wrong (planted: it reads the length as 0) has its
    write refused by the store's check; the flow fails with it, and the stream keeps each value
    once."""
    plan = flow.Plan("planted")

    @plan.step
    async def first(ctx: flow.Context) -> None:
        ctx.emit("a")
        ctx.emit("b")

    @plan.step
    async def second(ctx: flow.Context) -> None:
        ctx.emit("c")
        if ctx.attempt == 1:
            await trio.sleep_forever()

    path = tmp_path / "f.db"
    async with flow.open_engine(path, plans=[plan]) as engine:
        fid = await engine.start(plan)
        await trio.testing.wait_all_tasks_blocked()
    from ferry.flow._runtime import _emits

    class Wrong:
        @staticmethod
        def length(tx: Any, flow_id: str) -> int:
            return 0

    monkeypatch.setattr(_emits, "_stored", Wrong)
    async with flow.open_engine(path, plans=[plan]) as engine:
        snap = await engine.wait(fid)
        assert snap.state is flow.State.FAILED
        assert snap.error is not None and "do not follow its stream of 2" in snap.error
        assert await _all(engine, fid) == [(1, "a"), (2, "b")]
