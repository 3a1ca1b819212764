"""The write path's shape: how many functions, modules and closures one wake and one step
outcome run through, on the trio side and on the store's thread, held under a bound.

Recorded with `sys.setprofile` (every Python call and coroutine resume) on one SQLite engine:
on the trio thread from the call of `Engine.wake` to its return (the runner slot is busy, so the
woken flow waits in line and nothing else runs), and from the return of a step's body to the call
of the next step's body; on the store's worker thread for the transaction's function (the store's
`transact` is wrapped to set the profile there, since trio's thread cache reuses its threads).
Counted: distinct functions (code objects) of the project's own packages (``ferry``, ``stm``),
the modules they are in, and the closures among them (functions made inside another function:
``<locals>`` in the qualified name, lambdas included). The figures are printed (``-s``); the bounds
are structure, not time: a closure made per write, or a new layer of calls on the path, fails
them.

Before ops became records (a transition, its arguments and who holds the flow after it, run
by one function on the store's side), a wake ran 4 closures (the request's ``call`` and ``apply``,
`with_holder`'s ``held``, `versioned`'s ``shape_of``) and these bounds failed.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing

from ferry import flow
from ferry.projected import SqliteStore

ROOT = Path(__file__).resolve().parents[2]
PROJECT = (str(ROOT / "ferry") + "/", str(ROOT / "stm") + "/")


@attrs.frozen
class Figures:
    """What one recorded path ran: per side, the distinct project functions, their modules,
    and the closures among them."""

    trio_functions: int
    trio_modules: int
    thread_functions: int
    thread_modules: int
    functions: int  # both sides, distinct
    modules: int
    trio_frames: int  # the deepest stack of project frames on the trio side
    thread_frames: int  # and on the store's thread (the transaction's, the pool's below it)
    frame_modules: int  # the modules of those two stacks
    closures: tuple[str, ...]

    @property
    def frames(self) -> int:
        return self.trio_frames + self.thread_frames

    def line(self, what: str) -> str:
        return (
            f"{what}: deepest stacks {self.frames} frames (trio {self.trio_frames}, store thread"
            f" {self.thread_frames}) in {self.frame_modules} modules; {self.functions} functions"
            f" in {self.modules} modules (trio side {self.trio_functions} in"
            f" {self.trio_modules}, store thread {self.thread_functions} in"
            f" {self.thread_modules}); {len(self.closures)} closures {list(self.closures)}"
        )


_COMPREHENSIONS = frozenset({"<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"})


def _project_stack(frame: Any) -> list[types.CodeType]:
    """The project's frames on the stack of `frame`, innermost first."""
    stack = []
    while frame is not None:
        if frame.f_code.co_filename.startswith(PROJECT):
            stack.append(frame.f_code)
        frame = frame.f_back
    return stack


class Recorder:
    """The project code a path calls, by side (`on` turns recording on and off)."""

    def __init__(self) -> None:
        self.on = False
        self.trio: set[types.CodeType] = set()
        self.thread: set[types.CodeType] = set()
        # The deepest stack of project frames seen on each side (innermost first).
        self.deepest_trio: list[types.CodeType] = []
        self.deepest_thread: list[types.CodeType] = []

    def profile(self, into: set[types.CodeType]) -> Callable[[Any, str, Any], None]:
        deepest = self.deepest_trio if into is self.trio else self.deepest_thread

        def record(frame: Any, event: str, _arg: Any) -> None:
            if event == "call" and self.on and frame.f_code.co_filename.startswith(PROJECT):
                into.add(frame.f_code)
                stack = _project_stack(frame)
                if len(stack) > len(deepest):
                    deepest[:] = stack

        return record

    def figures(self) -> Figures:
        every = self.trio | self.thread

        def modules(codes: set[types.CodeType]) -> int:
            return len({c.co_filename for c in codes})

        closures = sorted(
            f"{Path(c.co_filename).stem}.{c.co_qualname}"
            for c in every
            if "<locals>" in c.co_qualname and c.co_name not in _COMPREHENSIONS
        )
        chain = self.deepest_trio + self.deepest_thread
        return Figures(
            len(self.trio),
            modules(self.trio),
            len(self.thread),
            modules(self.thread),
            len(every),
            modules(every),
            len(self.deepest_trio),
            len(self.deepest_thread),
            len({c.co_filename for c in chain}),
            tuple(closures),
        )

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.trio.clear()
        self.thread.clear()
        self.deepest_trio.clear()
        self.deepest_thread.clear()
        sys.setprofile(self.profile(self.trio))
        self.on = True
        try:
            yield
        finally:
            self.on = False
            sys.setprofile(None)


def traced_store(path: Path, recorder: Recorder) -> SqliteStore:
    """An SQLite store whose transactions' functions run under `recorder` on the worker thread."""
    store = SqliteStore(str(path))
    transact = store.transact

    async def traced(fn: Callable[[Any], Any], **options: Any) -> Any:
        def under_profile(tx: Any) -> Any:
            sys.setprofile(recorder.profile(recorder.thread))
            try:
                return fn(tx)
            finally:
                sys.setprofile(None)

        return await transact(under_profile, **options)

    store.transact = traced  # type: ignore[method-assign]
    return store


async def _settled(engine: flow.Engine, fid: str, state: flow.State) -> None:
    while (snap := await engine.get(fid)) is None or snap.state is not state:
        await trio.testing.wait_all_tasks_blocked()


async def _wake_path(tmp_path: Path) -> Figures:
    recorder = Recorder()
    parking = flow.Plan("parking", version=1)
    busy = flow.Plan("busy", version=1)
    started, release = trio.Event(), trio.Event()

    @parking.step
    async def wait_for_it(ctx: flow.Context) -> flow.Park:
        return flow.park()

    @parking.step
    async def then(ctx: flow.Context) -> None:
        pass

    @busy.step
    async def occupy(ctx: flow.Context) -> None:
        started.set()
        await release.wait()

    store = traced_store(tmp_path / "wake.db", recorder)
    try:
        async with flow.open_engine(store, plans=[parking, busy], max_running=1) as engine:
            await engine.start(parking, flow_id="p-1")
            await _settled(engine, "p-1", flow.State.PARKED)
            await engine.start(busy, flow_id="b-1")
            await started.wait()  # the one runner slot is taken: the woken flow waits in line
            await trio.testing.wait_all_tasks_blocked()
            with recorder.recording():
                delivery = await engine.wake("p-1", {"ok": 1}, message_id="m-1")
            assert delivery is flow.Delivery.RESUMED
            release.set()
            await engine.wait("p-1")
    finally:
        await store.aclose()
    return recorder.figures()


async def _outcome_path(tmp_path: Path) -> Figures:
    recorder = Recorder()
    plan = flow.Plan("two", version=1)
    entered, go, done = trio.Event(), trio.Event(), trio.Event()

    @plan.step
    async def first(ctx: flow.Context) -> None:
        entered.set()
        await go.wait()
        ctx.data["first"] = True
        recorder.on = True  # from the body's return ...
        sys.setprofile(recorder.profile(recorder.trio))

    @plan.step
    async def second(ctx: flow.Context) -> None:
        recorder.on = False  # ... to the next body's call
        sys.setprofile(None)

    store = traced_store(tmp_path / "outcome.db", recorder)
    try:
        async with flow.open_engine(store, plans=[plan]) as engine:

            async def waiting() -> None:
                snap = await engine.wait("s-1")
                assert snap.state is flow.State.COMPLETED
                done.set()

            await engine.start(plan, flow_id="s-1")
            await entered.wait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiting)
                # Nothing else moves while the step's outcome is written (the open's own
                # rounds are done, the wait waits).
                await trio.testing.wait_all_tasks_blocked()
                go.set()
                await done.wait()
    finally:
        recorder.on = False  # never left on past this test, whatever happened
        sys.setprofile(None)
        await store.aclose()
    return recorder.figures()


#: Closures on the path that are not the write path's own: the batch writer's sort key, the
#: pool's answer to the trio side (``ferry.projected``), the parts' hand-off to the runner.
ELSEWHERE = frozenset(
    {
        "_batch.write_batch.<locals>.<lambda>",
        "_pool.ConnectionPool.transact.<locals>.back",
        "_parts.Parts.__init__.<locals>.runnable",
    }
)


async def test_a_wake_runs_no_closure_and_few_frames(tmp_path: Path) -> None:
    """Before: 23 frames deep (14 on the trio side, 9 on the store's thread) in 12 modules,
    about 139 functions, 5 closures of the write path; after: 21 (13, 8) in 12 to 13, 134 to
    147 functions (the store in files by job has a few more), none. Since the queues, schedules
    and streams joined the batch: 157 to 164 functions, by whether the trio side waits for the
    store's thread's answer or finds it there (7 of trio's own), and 62 to 66 on that thread."""
    figures = await _wake_path(tmp_path)
    print("\n" + figures.line("one wake"))
    assert set(figures.closures) <= ELSEWHERE, figures
    assert figures.frames <= 21, figures
    assert figures.functions <= 168, figures


async def test_a_step_outcome_runs_no_closure_and_few_frames(tmp_path: Path) -> None:
    """Before: 20 frames deep (12, 8) in 11 modules, 123 to 129 functions, 1 closure of the write
    path (and a `_Held` object called on the store's thread); after: 19 (12, 7) in 11 to 12, 118
    to 131, none. Since the queues, schedules and streams joined the batch: 138 to 149, the
    trio side 91 to 101 by whether it waits for the store's thread's answer or finds it there
    (as the wake's, above)."""
    figures = await _outcome_path(tmp_path)
    print("\n" + figures.line("one step outcome"))
    assert set(figures.closures) <= ELSEWHERE, figures
    assert figures.frames <= 19, figures
    assert figures.functions <= 152, figures
