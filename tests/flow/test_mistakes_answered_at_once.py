"""`ferry.flow` as a newcomer meets it: each mistake is answered at once, in one clear line that
says what was wrong and what to do, and leaves nothing behind (no file, no row).

Engine tests open engines on a path, as a newcomer does, under `MockClock(autojump_threshold=0)`
(the SQLite store then runs on the trio thread); the path tests use real paths in a temporary
directory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import ferry
from ferry import flow
from ferry.flow._store import _store
from ferry.projected import SqliteStore


@pytest.fixture
def store(tmp_path: Path) -> str:
    """The path of the engine's SQLite file, as a user gives it."""
    return str(tmp_path / "flows.db")


async def _noop(ctx: flow.Context) -> None:
    pass


async def _park(ctx: flow.Context) -> flow.Outcome:
    return flow.park()


def plan_of(*steps: Any, name: str = "p") -> flow.Plan:
    plan = flow.Plan(name)
    for i, fn in enumerate(steps):
        plan.step(name=f"s{i}")(fn)
    return plan


async def read(path: str, fn: Callable[[Any], Any]) -> Any:
    """``fn(tx)`` in a transaction of a store of `path` (a tool's, not an engine: no lock)."""
    async with SqliteStore(path) as tool:
        return await tool.transact(fn)


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@asynccontextmanager
async def engine_on(store: Any, *plans: flow.Plan, **options: Any) -> AsyncIterator[flow.Engine]:
    async with flow.open_engine(store, plans=list(plans), **options) as engine:
        yield engine


async def refused(error: type[BaseException], store: Any, *plans: flow.Plan, **options: Any) -> str:
    """The message of the `error` that opening an engine raised (one line)."""
    with pytest.raises(error) as caught:
        async with engine_on(store, *plans, **options):
            pass
    message = str(caught.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------ opening a file


async def test_a_path_in_a_missing_directory_names_the_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    message = await refused(FileNotFoundError, str(missing / "x.db"), plan_of(_noop))
    assert f"no such directory: {str(missing)!r}" in message
    assert repr(str(missing / "x.db")) in message and "engine-lock" not in message
    assert files(tmp_path) == []


async def test_a_directory_or_a_file_that_is_not_sqlite_is_refused_and_left_alone(
    tmp_path: Path,
) -> None:
    message = await refused(ValueError, str(tmp_path), plan_of(_noop))
    assert f"{str(tmp_path)!r} is a directory" in message
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database\n")
    message = await refused(ValueError, str(notes), plan_of(_noop))
    assert f"{str(notes)!r} is not an SQLite database" in message
    assert files(tmp_path) == ["notes.txt"]  # no lock file either
    assert f"{tmp_path.name}.engine-lock" not in files(tmp_path.parent)


async def test_open_engine_without_async_with_says_how_to_open_it(
    store: str,
) -> None:
    opening = flow.open_engine(store, plans=[plan_of(_noop)])
    with pytest.raises(TypeError, match=r"async with flow\.open_engine\(store, plans=\[\.\.\.\]\)"):
        await opening  # type: ignore[misc]
    with pytest.raises(AttributeError, match=r"not the engine.*'\.start' was asked"):
        opening.start  # type: ignore[attr-defined]  # noqa: B018
    assert files(Path(store).parent) == []  # nothing was opened, nor created
    async with opening as engine:  # the same object still opens the engine
        assert isinstance(engine, flow.Engine)


# ----------------------------------------------------------------------------------- the plans


async def test_a_serving_engine_without_plans_is_refused_an_operators_engine_is_not(
    store: str, autojump_clock: Any
) -> None:
    message = await refused(ValueError, store)
    assert "no plans" in message and "serve=False" in message
    assert files(Path(store).parent) == []  # nothing was opened, nor created
    async with engine_on(store, plan_of(_park)) as engine:
        fid = await engine.start(engine._plans[("p", 1)])
        await trio.testing.wait_all_tasks_blocked()  # parked
    async with engine_on(store, serve=False) as ops:  # an operator's engine needs none
        assert await ops.wake(fid, "go") is flow.Delivery.RESUMED


async def test_plans_that_are_not_a_list_of_plans_say_how_to_give_them(
    store: str,
) -> None:
    plan = plan_of(_noop)
    with pytest.raises(TypeError, match=r"plans=\[p\]"):
        async with flow.open_engine(store, plans=plan):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match=r"plans must be a list of flow\.Plan, got 'p'"):
        async with flow.open_engine(store, plans="p"):  # type: ignore[arg-type]
            pass


# ------------------------------------------------------------------------------- another run


async def test_every_engine_call_from_another_run_or_thread_names_the_engine_and_the_way(
    store: str,
) -> None:
    plan = plan_of(_park)
    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan, flow_id="f")
        # Parked in the store (all tasks blocked is not enough: the park's write may still be
        # in the store's thread, and the count below would change under the test).
        while engine.statistics().parked < 1:
            await trio.testing.wait_all_tasks_blocked(cushion=0.001)
        before = await read(store, _store.count_states)
        assert before == {flow.State.PARKED: 1}
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "start": partial(engine.start, plan),
            "wake": partial(engine.wake, fid, "x"),
            "publish": partial(engine.publish, "e", {}),
            "wait": partial(engine.wait, fid, timeout=0),
            "get": partial(engine.get, fid),
            "cancel": partial(engine.cancel, fid),
            "resume": partial(engine.resume, fid),
            "history": partial(engine.history, fid),
        }
        errors: dict[str, BaseException] = {}

        async def in_another_run() -> None:
            for name, call in calls.items():
                try:
                    await call()
                except BaseException as exc:
                    errors[name] = exc

        def in_a_thread() -> None:
            trio.run(in_another_run)
            for name, sync in (
                ("on", partial(engine.on, "e", print)),
                ("statistics", engine.statistics),
            ):
                try:
                    sync()
                except BaseException as exc:
                    errors[name] = exc

        await trio.to_thread.run_sync(in_a_thread)
        assert set(errors) == {*calls, "on", "statistics"}
        for name, error in errors.items():
            assert type(error) is RuntimeError
            text = str(error)
            assert text.startswith(f"flow.Engine.{name} was called "), text
            assert "ferry was called" not in text and "trio_token" in text
        assert "from a task of another trio run" in str(errors["wake"])
        assert "outside any trio run" in str(errors["on"])
        assert "trio.from_thread.run_sync(engine.on" in str(errors["on"])
        # nothing happened: no flow, no wake, no mapper
        assert await read(store, _store.count_states) == before
        assert await engine.publish("e", {}) == []
        assert (await engine.get(fid)).state is flow.State.PARKED  # type: ignore[union-attr]
        assert engine.statistics().wakes[flow.Delivery.QUEUED] == 0
    engine.statistics()  # readable from anywhere once closed


async def test_calls_after_close_say_the_block_has_ended(store: str) -> None:
    async with engine_on(store, plan_of(_noop)) as engine:
        pass
    with pytest.raises(ferry.Closed, match=r"Engine.get: .*block has ended"):
        await engine.get("f")


# -------------------------------------------------------------------------------------- wait


async def test_a_wait_that_times_out_says_where_the_flow_still_is(
    store: str, autojump_clock: Any
) -> None:
    flaky_runs = 0

    async def flaky(ctx: flow.Context) -> None:
        nonlocal flaky_runs
        flaky_runs += 1
        raise ConnectionError("down")

    async def parks_for_an_hour(ctx: flow.Context) -> flow.Outcome:
        return flow.park(timeout=3600)

    plan = plan_of(_park)
    timed = plan_of(parks_for_an_hour, name="timed")
    retried = plan_of(flaky, name="retried")
    async with engine_on(store, plan, timed, retried) as engine:
        for p, fid in ((plan, "a"), (timed, "b"), (retried, "c")):
            await engine.start(p, flow_id=fid)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.TooSlowError) as running:
            await engine.wait("c", timeout=0.15)  # its second attempt waits out its backoff
        assert (
            str(running.value) == "flow 'c' is still RUNNING at step 's0' (attempt 2) after 0.15 s"
        )
        with pytest.raises(trio.TooSlowError) as parked:
            await engine.wait("a", timeout=0.1)
        assert str(parked.value) == (
            "flow 'a' is still PARKED at step 's0' (a parked flow goes on when it is woken:"
            " Engine.wake) after 0.1 s"
        )
        with pytest.raises(trio.TooSlowError, match=r"or when its park times out\) after 2 s"):
            await engine.wait("b", timeout=2)


# ------------------------------------------------------------------------------ defining steps


def test_step_misuse_is_refused_at_definition_with_the_fix() -> None:
    plan = flow.Plan("p")
    with pytest.raises(
        TypeError, match=r"a step's name is given by keyword, @plan.step\(name='a'\)"
    ):
        plan.step("a")  # type: ignore[call-overload]

    async def no_ctx() -> None:
        pass

    async def two(ctx: flow.Context, extra: int) -> None:
        pass

    for fn in (no_ctx, two):
        with pytest.raises(TypeError, match=r"must take one argument, the flow\.Context"):
            plan.step(fn)  # type: ignore[type-var]
        with pytest.raises(TypeError, match=r"compensate must take one argument"):
            plan.step(compensate=fn)  # type: ignore[arg-type]

    async def flexible(ctx: flow.Context, extra: int = 0, *more: int) -> None:
        pass

    plan.step(flexible)
    plan.step(name="kw")(partial(flexible, extra=1))
    assert [s.name for s in plan.steps] == ["flexible", "kw"]


async def _returns_park(ctx: flow.Context) -> Any:
    return flow.park


async def _returns_fail(ctx: flow.Context) -> Any:
    return flow.fail


async def _returns_a_coroutine(ctx: flow.Context) -> Any:
    return _noop(ctx)


@pytest.mark.parametrize(
    ("step", "hint"),
    [
        (_returns_park, "call it, return flow.park(...)"),
        (_returns_fail, "call it, return flow.fail(...)"),
        (_returns_a_coroutine, "an await is missing"),
    ],
)
async def test_a_step_that_returns_a_near_miss_fails_with_the_fix(
    store: str, autojump_clock: Any, step: Any, hint: str
) -> None:
    plan = plan_of(step)
    async with engine_on(store, plan) as engine:
        snap = await engine.wait(await engine.start(plan), timeout=60)
    assert snap.state is flow.State.FAILED
    assert snap.error is not None and snap.error.startswith("step 's0' returned ")
    assert snap.error.endswith(hint)


# ---------------------------------------------------------------------- plans, choreography


async def test_a_plan_built_twice_is_named_as_such(store: str, autojump_clock: Any) -> None:
    async with engine_on(store, plan_of(_noop)) as engine:
        with pytest.raises(flow.UnknownPlan, match="is not the object given to open_engine"):
            await engine.start(plan_of(_noop))
        with pytest.raises(flow.UnknownPlan, match="was not given to open_engine"):
            await engine.start(plan_of(_noop, name="other"))
        assert await read(store, _store.count_states) == {}


async def test_a_mapper_mistake_names_the_mapper_and_the_event_type(
    store: str, autojump_clock: Any
) -> None:
    plan = plan_of(_park)
    async with engine_on(store, plan) as engine:
        with pytest.raises(TypeError, match=r"mapper must take one argument, the event"):
            engine.on("e", lambda: None)  # type: ignore[arg-type,misc]

        def bad_id(event: Any) -> flow.Wake:
            return flow.Wake(event["order"])

        engine.on("paid", bad_id)
        with pytest.raises(TypeError) as caught:
            await engine.publish("paid", {"order": 42})
        assert str(caught.value).startswith(f"mapper {bad_id!r} for 'paid' returned Wake(")
        assert "flow_id must be a str, got 42; nothing was applied" in str(caught.value)
        other = plan_of(_noop)
        engine.on("placed", lambda e: flow.Start(other, flow_id="x"))
        with pytest.raises(flow.UnknownPlan, match=r"for 'placed' returned Start.*not the object"):
            await engine.publish("placed", {})
        assert await read(store, _store.count_states) == {}


async def test_a_step_that_sets_a_read_only_field_of_its_context_is_told_which(
    store: str, autojump_clock: Any
) -> None:
    async def sets_wake(ctx: flow.Context) -> None:
        ctx.wake = {"paid": True}

    plan = plan_of(sets_wake)
    async with engine_on(store, plan) as engine:
        snap = await engine.wait(await engine.start(plan), timeout=60)
    assert snap.error is not None
    assert "ctx.wake is read-only: a step may change only ctx.data" in snap.error


async def test_an_empty_message_id_is_refused_before_it_swallows_later_wakes(
    store: str, autojump_clock: Any
) -> None:
    plan = plan_of(_park, _park)
    async with engine_on(store, plan) as engine:
        fid = await engine.start(plan)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ValueError, match="message_id must not be empty"):
            await engine.wake(fid, "paid", message_id="")
        engine.on("paid", lambda e: flow.Wake(fid, e, message_id=e.get("id", "")))
        with pytest.raises(
            ValueError, match=r"returned Wake\(.*Wake\.message_id must not be empty"
        ):
            await engine.publish("paid", {})
        assert (await engine.get(fid)).revision == 2  # type: ignore[union-attr]  # not woken
        assert await engine.wake(fid, "paid") is flow.Delivery.RESUMED
