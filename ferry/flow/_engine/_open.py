"""Opening an engine: `open_engine`, its option checks, and the engine's lifetime for the
``async with`` block (the write ferry, the engine's tasks, and what it leaves at close).

An engine is made and run only here (`_opened`, `_lifetime`); its parts are started and stopped
through the methods of `_parts.Parts`, never by setting their state from outside.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, final

import attrs
import trio

from ferry import open_ferry
from ferry.projected import SqliteStore, Store

from .._fleet import _lease, _reach
from .._model import _checks
from .._model._errors import UnknownPlan
from .._model._plan import Plan
from .._runtime import _observe, _retention, _tracing
from .._runtime._config import Config
from .._store import _dialect, _schema
from .._store._cron import Schedule
from .._store._sqlite_file import EngineLock, check_path
from . import _observer, _served
from ._engine import Engine
from ._observer import Observer
from ._parts import Parts

_log = logging.getLogger("ferry.flow")

_BATCH_SIZE = 1000


def _registry(plans: object) -> dict[tuple[str, int], Plan]:
    if isinstance(plans, Plan):
        raise TypeError(f"plans must be a list of flow.Plan: plans=[{plans.name}], got {plans!r}")
    if not isinstance(plans, Iterable) or isinstance(plans, str | bytes):
        raise TypeError(f"plans must be a list of flow.Plan, got {plans!r}")
    registry: dict[tuple[str, int], Plan] = {}
    for plan in plans:
        if not isinstance(plan, Plan):
            raise TypeError(f"plans must hold flow.Plan objects, got {plan!r}")
        plan._close()  # raises ValueError for an empty plan
        key = (plan.name, plan.version)
        if key in registry and registry[key] is not plan:
            raise ValueError(f"two plans are named {plan.name!r} version {plan.version}")
        registry[key] = plan
    return registry


def open_engine(
    store: Store | str | os.PathLike[str],
    plans: Iterable[Plan],
    *,
    owner: str | None = None,
    max_running: int = 10_000,
    lease: float = 30.0,
    serve: bool = True,
    max_data_bytes: int = _checks.MAX_DATA_BYTES,
    retain: float | None = _retention.DEFAULT_RETAIN,
    tracer_provider: object | None = None,
    observers: Iterable[Observer] = (),
    schedules: Iterable[Schedule] = (),
) -> contextlib.AbstractAsyncContextManager[Engine]:
    """Open a flow engine on `store` for the duration of an ``async with``.

    `store`: a path (an SQLite file, created if missing -- except by an operator's engine, see
    `serve` -- and closed with the engine) or an open `SqliteStore`/`PostgresStore` (left
    open); a path that cannot be an engine's file (``":memory:"``, a ``file:`` URI, a
    directory, a file that is not SQLite) is a `ValueError` saying what to give instead.
    `plans`: the plans it runs (several versions of one plan may be given; at least one,
    unless ``serve=False``). At most `max_running` flows run at once, first come first served.
    `owner` names this engine in the rows it leases (default: a new uuid; printable, 1 to 200
    characters; on a fleet one live engine per name: `StoreLocked` while another holds it).
    `lease`: 0.5 s to 86,400 s. Creates the tables if missing, records its plans' shapes, takes
    the SQLite file's engine lock (`StoreLocked` if another engine holds the file), recovers.
    One SQLite file is served by one engine: at open every running and compensating flow runs
    again (attempt + 1) and every parked flow's timer is armed (overdue ones time out at once).

    On PostgreSQL engines form a fleet (docs/flow-fleet.md): each holds a lease of `lease`
    seconds, renewed every ``lease / 3``, and runs the running flows that name it; as often it
    takes over orphans (flows of its plan versions no live engine holds) and arms the timers of
    flows parked by any engine. At open it resumes the flows its `owner` name held, and
    closing ends its lease. An engine that could not renew in time lets its flows go
    (`FlowStatistics.lost`); every write is a compare-and-set on the flow's revision, so a slow
    or frozen engine never advances a flow another took over.

    `max_data_bytes` (default 1 MiB): the most UTF-8 JSON text a flow's data or a wake's
    payload may take. A step that leaves more, or returns a malformed outcome, fails its flow
    alone (it compensates and ends `FAILED` naming the step and the problem).
    Only the store's unavailability (a lock held elsewhere, a lost connection) is retried by
    the engine's own tasks, with a WARNING on the ``ferry.flow`` logger per retry; any other
    error in them ends the ``async with`` block with that exception (after the block's own).

    `retain` (seconds > 0, default 30 days; None keeps every flow): finished flows are
    deleted, with their history and mailbox, `retain` seconds after they ended (docs/adr/0085);
    a deleted flow's id is unknown from then on (`start` may use it again).

    `tracer_provider`: OpenTelemetry traces (the extra ``otel``, docs/operating.md): a span
    per `start` and per run of a step or compensation, one trace per flow. None (default): the
    application's global provider, if it set one; else traces are off and cost nothing.

    `observers`: `flow.Observer` objects told of every step attempt, every end, the open and
    the close (docs/operating.md, "Observers"). A serving engine also applies the requests of
    clients in other processes (`flow.connect`, docs/adr/0125); on SQLite it keeps a heartbeat.

    `schedules`: `flow.Schedule` objects the engine declares in the store at open (SPEC 5.9,
    docs/flow.md "Schedules"): a new one is stored, a changed one replaces the stored one (a
    paused one stays paused), one the list leaves out is left as it is (`Engine.unschedule`
    removes it). Any serving engine with a schedule's plan version fires it, each tick once.
    Checked at the call: a `Schedule` each (`TypeError`), names unique (`ValueError`), each
    plan the very object given in `plans` (`UnknownPlan`).

    `serve=False` opens an operator's engine (used by ``python -m ferry.flow``): it needs no
    plans, runs no step, leases nothing, arms no timer and does no recovery; what its `wake`,
    `cancel` and `resume` make runnable is left to the engines that serve the store (on
    SQLite, the next engine to open the file). It never creates a store: where there is no
    file it raises `FileNotFoundError` (docs/adr/0116).

    Bad plans and options are raised before anything is opened. Leaving the block closes the
    engine: running steps are cancelled (they run again, as attempt + 1, when an engine next
    takes them), parked flows stay parked, and later calls raise `ferry.Closed`.
    """
    given = locals()  # the arguments, by name: nothing else is bound yet
    return _Opening(_opened(**given, switches=_SWITCHES))


@attrs.frozen
class _Switches:
    """What only tests and benchmarks change (tests/switches.py opens engines with them):
    `group_commit=False` commits every write in its own transaction; `fleet` forces the fleet's
    leases on (or off) whatever the store; `scan_interval` overrides ``lease / 3``;
    `wall_clock` is the host's wall clock: of durable times and deadlines, and of leases on
    SQLite only (on PostgreSQL the database's clock decides leases, docs/adr/0110). (Fencing
    off, a planted bug, is tests/switches.py's own.)"""

    group_commit: bool = True
    wall_clock: Callable[[], float] = time.time
    fleet: bool | None = None
    scan_interval: float | None = None


_SWITCHES = _Switches()


_NOT_WITH = (
    "open_engine(...) is an async context manager, not the engine: open it with"
    " `async with flow.open_engine(store, plans=[...]) as engine:` and call the engine inside"
    " that block"
)


@final
class _Opening(contextlib.AbstractAsyncContextManager[Engine]):
    """What `open_engine` returns: the engine's context manager, which also answers the
    mistake of leaving out ``async with`` (awaiting it, or calling it as if it were the
    engine) with a `TypeError`/`AttributeError` that says how to open it."""

    def __init__(self, opened: contextlib.AbstractAsyncContextManager[Engine]) -> None:
        self._opened = opened

    async def __aenter__(self) -> Engine:
        return await self._opened.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._opened.__aexit__(exc_type, exc, tb)

    def __await__(self) -> Generator[Any, None, Engine]:
        raise TypeError(_NOT_WITH)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{_NOT_WITH} ('.{name}' was asked of the context manager)")


@asynccontextmanager
async def _opened(
    store: Store | str | os.PathLike[str],
    plans: Iterable[Plan],
    *,
    owner: str | None,
    max_running: int,
    lease: float,
    serve: bool,
    max_data_bytes: int,
    retain: float | None,
    tracer_provider: object | None,
    observers: Iterable[Observer],
    schedules: Iterable[Schedule],
    switches: _Switches,
) -> AsyncIterator[Engine]:
    """The body of `open_engine` (its docstring says what it promises)."""
    registry = _registry(plans)
    declared = _schedule_list(schedules, registry, serve)
    config = _config(
        registry,
        owner=owner,
        max_running=max_running,
        lease=lease,
        serve=serve,
        max_data_bytes=max_data_bytes,
        retain=retain,
        tracer_provider=tracer_provider,
        observers=observers,
        switches=switches,
    )
    db, lock = _store_of(store, serve)
    own_store = db is not store
    try:
        _reach.check_clock(db)
        try:
            await db.transact(_schema.create_schema)
        except Exception as exc:
            failed = _reach.unreachable(db, exc)
            if failed is None:
                raise
            raise failed from exc
        if switches.fleet is None:  # the mode, by the store: PostgreSQL's engines form a fleet
            config = attrs.evolve(config, fleet=_dialect.of(db).leases)
        config = attrs.evolve(config, schedules=declared)
        parts = Parts(db, registry, config)
        engine = Engine._create(db, registry, config, parts)
        async with _lifetime(engine, parts, config, db) as running:
            yield running
    finally:
        if own_store:
            with trio.CancelScope(shield=True):
                await db.aclose()
        if lock is not None:
            lock.release()


def _schedule_list(
    schedules: object, registry: dict[tuple[str, int], Plan], serve: bool
) -> tuple[Schedule, ...]:
    """`open_engine(schedules=...)` checked: a list of `flow.Schedule` (`TypeError`), names
    unique (`ValueError`), each of a plan given to this engine, that very object
    (`UnknownPlan`); an operator's engine declares none (`ValueError`)."""
    if isinstance(schedules, Schedule):
        raise TypeError(f"schedules must be a list of flow.Schedule: schedules=[{schedules!r}]")
    if not isinstance(schedules, Iterable) or isinstance(schedules, str | bytes):
        raise TypeError(f"schedules must be a list of flow.Schedule, got {schedules!r}")
    found: dict[str, Schedule] = {}
    for i, schedule in enumerate(schedules):
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedules[{i}] must be a flow.Schedule, got {schedule!r}")
        if schedule.name in found:
            raise ValueError(f"two schedules are named {schedule.name!r}: give each one once")
        plan = schedule.plan
        if registry.get((plan.name, plan.version)) is not plan:
            raise UnknownPlan(
                f"schedule {schedule.name!r} starts plan {plan.name!r} version {plan.version},"
                " which is not a plan given to this open_engine (give its Plan object in plans)"
            )
        found[schedule.name] = schedule
    if found and not serve:
        raise ValueError(
            "an operator's engine (serve=False) declares no schedules: give schedules=[...] to"
            " the engines that serve the store"
        )
    return tuple(found.values())


def _config(
    registry: dict[tuple[str, int], Plan],
    *,
    owner: str | None,
    max_running: int,
    lease: float,
    serve: bool,
    max_data_bytes: int,
    retain: float | None,
    tracer_provider: object | None,
    observers: Iterable[Observer],
    switches: _Switches,
) -> Config:
    """`open_engine`'s options checked (a `ValueError` or `TypeError` naming the one that is
    wrong, before anything is opened), as the one record the parts are built from. Its `fleet`
    is the test switch's; without one, `_opened` sets it by the store."""
    scan_interval = switches.scan_interval
    if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
        raise ValueError(f"max_running must be an int >= 1, got {max_running!r}")
    lease = _lease.check_lease(lease)
    if owner is not None:
        owner = _lease.check_owner(owner)
    if not isinstance(serve, bool):
        raise TypeError(f"serve must be a bool, got {serve!r}")
    if (
        isinstance(max_data_bytes, bool)
        or not isinstance(max_data_bytes, int)
        or max_data_bytes < 2  # "{}" must fit
    ):
        raise ValueError(f"max_data_bytes must be an int >= 2, got {max_data_bytes!r}")
    retain = _retention.check_retain(retain)
    bound = _observer.bind(observers)
    tracing = _tracing.tracing_for(tracer_provider)
    if tracing is not None:  # the end spans: the first observer
        bound = (_observe.Bound(tracing, flow_ended=tracing.flow_ended), *bound)
    if serve and not registry:
        raise ValueError(
            "open_engine got no plans: an engine that serves a store runs only the plans it is"
            " given, so this one could run no flow; give it plans=[...], or serve=False for an"
            " operator's engine (it wakes, cancels and resumes flows, and runs none)"
        )
    if scan_interval is not None and not (_checks.finite(scan_interval) and scan_interval > 0):
        raise ValueError(f"scan_interval must be a finite number > 0, got {scan_interval!r}")
    return Config(
        owner=owner if owner is not None else uuid.uuid4().hex,
        max_running=max_running,
        lease=lease,
        serve=serve,
        fleet=bool(switches.fleet),
        max_data=max_data_bytes,
        group_commit=switches.group_commit,
        scan_interval=lease / 3 if scan_interval is None else scan_interval,
        wall_clock=switches.wall_clock,
        retain=retain,
        tracing=tracing,
        observers=bound,
    )


def _store_of(
    store: Store | str | os.PathLike[str], serve: bool
) -> tuple[Store, EngineLock | None]:
    """The store an engine opens on (a path: an `SqliteStore` of its own, closed with the
    engine), and the SQLite file's engine lock, taken. An operator's engine acts on an existing
    store: it never creates the SQLite file (docs/adr/0116), nor does any engine on a store
    opened with create=False."""
    if isinstance(store, str | os.PathLike):
        lock = EngineLock.acquire(check_path(store), create=serve)
        return SqliteStore(lock.path, create=serve), lock
    if not callable(getattr(store, "transact", None)):
        raise TypeError(f"store must be a path or a SqliteStore/PostgresStore, got {store!r}")
    if isinstance(store, SqliteStore):
        return store, EngineLock.acquire(store.path, create=serve and store.create)
    return store, None


@asynccontextmanager
async def _lifetime(
    engine: Engine, parts: Parts, config: Config, store: Store
) -> AsyncIterator[Engine]:
    """Own the write ferry and the engine's tasks for the ``async with`` block."""
    body_error: BaseException | None = None
    engine_error: BaseException | None = None
    opened = False
    ferry_cm: contextlib.AbstractAsyncContextManager[Any]
    if config.group_commit:
        ferry_cm = open_ferry(
            parts.writes.batch,
            max_batch_size=_BATCH_SIZE,
            max_in_flight_batches=_dialect.of(store).batches_in_flight,
            max_queueing=1 << 40,
        )
    else:
        ferry_cm = contextlib.nullcontext(None)
    _observe.opened(parts.tally.observers, engine)
    try:
        async with ferry_cm as write_ferry:
            try:
                async with trio.open_nursery() as nursery:
                    parts.begin(write_ferry, nursery)
                    try:
                        recovered = trio.Event()
                        if config.serve:  # the clients' requests, and an SQLite heartbeat
                            await nursery.start(_served.serve, engine, recovered)
                        await parts.recover()
                        recovered.set()
                        _log_opened(parts, config, store)
                        opened = True
                        parts.start_tasks()
                        yield engine
                    except BaseException as exc:
                        body_error = exc  # re-raised below, not wrapped in an exception group
                    finally:
                        engine._close()
                        nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # A task of the engine raised (a bug, or an error that is not the store's
                # unavailability): the block ends with that exception, not a group of it (with
                # the block's own too, if it raised one: `_merged`).
                engine_error = _one_error(group)
                if engine_error is None:
                    raise _merged(body_error, group) from None
            with trio.CancelScope(shield=True), trio.move_on_after(config.lease / 3):
                # after a bug, touch no flow: they run again
                await parts.leave(touch_flows=engine_error is None)
    finally:
        engine._close()
        _log_closed(parts, config, engine_error or body_error, opened=opened)
        try:
            with trio.CancelScope(shield=True):
                await parts.end()
        finally:
            # its statistics are final now: a collector lets it go (those attached since too)
            _observe.closed(parts.tally.observers, engine)
    if engine_error is not None:
        raise _merged(body_error, engine_error)
    if body_error is not None:
        raise body_error


def _log_opened(parts: Parts, config: Config, store: Store) -> None:
    """INFO: the engine is open, and what it recovered."""
    s = parts.statistics()
    owner = config.owner
    shapes = parts.versions.shapes
    _log.info(
        "flow engine %r opened on %s (%s): %d flows recovered, %d parked, plans %s",
        owner,
        _where(store),
        "serving" if config.serve else "operator, runs nothing",
        s.recovered,
        s.parked,
        ", ".join(f"{name} v{version}" for name, version in sorted(shapes)) or "none",
        extra={"owner": owner, "recovered": s.recovered, "parked": s.parked},
    )


def _log_closed(parts: Parts, config: Config, error: BaseException | None, *, opened: bool) -> None:
    """INFO: the engine closed (what it left to the next engine), why it ended, or why it did
    not open (the whole error: it says what to do)."""
    s = parts.statistics()
    owner = config.owner
    running = s.running
    if not opened and error is not None:
        _log.info(
            "flow engine %r did not open: %s",
            owner,
            _checks.describe(error, 2000),
            extra={"owner": owner},
        )
        return
    if error is not None and not isinstance(error, trio.Cancelled | GeneratorExit):
        _log.info(
            "flow engine %r closed by %s; %d flows running left to the next engine",
            owner,
            _checks.describe(error, 200),
            running,
            extra={"owner": owner, "running": running},
        )
        return
    _log.info(
        "flow engine %r closed; %d flows running left to the next engine (steps run %d,"
        " completed %d, failed %d, blocked %d)",
        owner,
        running,
        s.steps_run,
        s.completed,
        s.failed,
        s.blocked,
        extra={"owner": owner, "running": running},
    )


def _merged(body_error: BaseException | None, engine_error: BaseException) -> BaseException:
    """What ends the block when a task of the engine failed: its error, or, if the block raised
    an error of its own too, both (neither may be lost); the block's `trio.Cancelled` is only
    the echo of the task's failure. As `ferry`'s `Shell.lifetime` does."""
    if body_error is None or isinstance(body_error, trio.Cancelled):
        return engine_error
    return BaseExceptionGroup(
        "the engine's block raised, and so did a task of the engine", [body_error, engine_error]
    )


def _where(store: Store) -> str:
    """The store, for a log line: an SQLite path, or the kind of store (no DSN: it may hold a
    password)."""
    path = getattr(store, "path", None)
    return f"SQLite file {path!r}" if isinstance(path, str) else type(store).__name__


def _one_error(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception of `group` that is not a `trio.Cancelled`, if there is one only."""
    _, rest = group.split(trio.Cancelled)
    if rest is None:
        return None
    leaves: list[BaseException] = []
    stack: list[BaseException] = [rest]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else None
