"""Transactions: read and write logs, the version clock, validation, commit and waiter bookkeeping.

Design (TL2 with snapshot extension; see docs/adr/0001-stm-commit-protocol.md):

- One global version clock `_clock`. Every TVar holds ONE attribute `_state = (version, value)`,
  replaced whole, never mutated, so a lock-free read is a single reference load and the pair can
  never be torn, with or without a GIL.
- An attempt samples `rv = _clock` when it starts. Reading a TVar whose version is `<= rv` gives
  the value it had at time `rv`. A newer version means somebody committed since: the attempt
  samples the clock again and checks that everything it read is still the same tuple (identity);
  if so its snapshot moves forward, if not it is doomed and reruns. So every attempt always sees
  one consistent snapshot (opacity), even one that is about to fail.
- A writing commit takes the global `_lock`, checks that every tuple it read is still installed
  (skipped when the clock has not moved since `rv`), installs new tuples stamped `_clock + 1`,
  publishes the clock last, takes the waiters of the written TVars off every TVar they wait on,
  releases the lock and only then wakes them. A read-only attempt never takes the lock: its
  snapshot is its serialization point.
- Waiters register under the same lock after checking that nothing they read has changed, so a
  commit either happened before (the check sees it and the attempt reruns at once) or after (the
  commit sees the waiter). No wake-up is lost, and a commit only touches waiters of TVars it wrote.
- Starvation: after `MAX_CONFLICTS` conflict reruns an attempt runs irrevocably: it holds `_lock`
  while `fn` runs, so no commit can invalidate it.

All shared mutable state (TVar states, waiter sets, the clock, the waiter count) changes under
`_lock`. The lock-free paths only load references. The statistics counters other than the waiter
count are bumped without the lock on some paths and may undercount when threads race.

Open question: one global lock serializes writing commits across threads. Per-TVar locks in
address order would let disjoint commits proceed in parallel, at a higher cost per commit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from types import CoroutineType
from typing import TYPE_CHECKING, Any, Final

import trio

if TYPE_CHECKING:
    from ._tvar import TVar

MAX_CONFLICTS: Final = 8
"""Conflict reruns after which an attempt runs irrevocably (holding the commit lock)."""

_lock = threading.Lock()
_clock: int = 0

# Statistics. `_n_waiters` and `_n_commits` only change under `_lock` (exact); the others may
# be bumped without it and can undercount under threads.
_n_commits = 0
_n_read_only = 0
_n_conflicts = 0
_n_retries = 0
_n_wakeups = 0
_n_irrevocable = 0
_n_waiters = 0

# Test-only: commit without validating the read set. Planted-bug tests flip it.
_UNSAFE_SKIP_VALIDATION = False

# Attempt outcomes.
COMMITTED: Final = 0
RETRY: Final = 1
CONFLICT: Final = 2


# The running attempt of this thread (or trio task). A ContextVar rather than a threading.local:
# `get()` is a cached C lookup, the cheapest ambient read there is, and TVar.get pays it.
_current: Final[ContextVar[Txn | None]] = ContextVar("stm.current_transaction", default=None)
current_or_none: Final = _current.get
_set_current: Final = _current.set
_get_ident = threading.get_ident
_current_task = trio.lowlevel.current_task
_current_trio_token = trio.lowlevel.current_trio_token
_reschedule = trio.lowlevel.reschedule


class Retry(BaseException):
    """Internal: `retry()` abandons the attempt. A BaseException so `except Exception` in user
    code does not swallow it (and if user code swallows it anyway, `Txn.doomed` remembers)."""


class Conflict(BaseException):
    """Internal: the attempt's snapshot could not be extended; it must rerun."""


def _coroutine_error(result: CoroutineType[Any, Any, Any]) -> TypeError:
    name = getattr(result, "__qualname__", repr(result))
    result.close()
    return TypeError(
        f"the transaction function returned a coroutine ({name}): it must be a plain synchronous "
        "function. An async function cannot be rerun safely; do the awaiting outside the "
        "transaction and pass the results in."
    )


class Txn:
    """One attempt of a transaction.

    Invariants: `reads` maps each TVar read from the shared state to the exact `_state` tuple seen;
    every tuple there has version `<= rv`, and all of them were installed together at time `rv`.
    `writes` maps TVars to their new values (a TVar read after this attempt wrote it is served
    from here and not logged in `reads`). `deadline` is the earliest retry deadline given, if any.
    """

    __slots__ = (
        "deadline",
        "doomed",
        "effects",
        "reads",
        "result",
        "rv",
        "status",
        "writes",
    )

    rv: int
    reads: dict[TVar[Any], tuple[int, Any]]
    writes: dict[TVar[Any], Any]
    effects: list[tuple[Callable[..., object], tuple[Any, ...]]] | None
    deadline: float | None
    doomed: int | None
    status: int
    result: Any

    def __init__(self, rv: int) -> None:
        self.rv = rv
        self.reads = {}
        self.writes = {}
        self.effects = None
        self.deadline = None
        self.doomed = None

    def extend(self, tvar: TVar[Any]) -> tuple[int, Any]:
        """Move the snapshot forward to read `tvar`, or raise `Conflict` if it cannot.

        Cost: O(reads so far). Never takes the lock.
        """
        for _ in range(4):
            now = _clock
            for tv, st in self.reads.items():
                if tv._state is not st:
                    self.doomed = CONFLICT
                    raise Conflict
            self.rv = now
            st = tvar._state
            if st[0] <= now:
                return st
        self.doomed = CONFLICT
        raise Conflict

    def still_valid(self) -> bool:
        """True if every TVar read still holds the tuple this attempt saw. Lock-free."""
        return all(tv._state is st for tv, st in self.reads.items())


def current() -> Txn:
    txn = current_or_none()
    if txn is None:
        from ._errors import NoTransactionError

        raise NoTransactionError(
            "no transaction is running: call this inside the function given to "
            "stm.atomically / atomically_sync / atomically_nowait"
        )
    return txn


def check_not_nested() -> None:
    if current_or_none() is not None:
        from ._errors import NestedTransactionError

        raise NestedTransactionError(
            "atomically was called inside a transaction: call the inner transaction's function "
            "directly instead, so both run as one transaction"
        )


def attempt(fn: Callable[..., Any], args: tuple[Any, ...], irrevocable: bool) -> Txn:
    """Run `fn(*args)` once as a transaction attempt, and commit it if it wants to.

    Returns the attempt with `status` COMMITTED (and `result`), RETRY or CONFLICT. Exceptions
    raised by `fn` propagate only if the attempt's reads are still current; otherwise CONFLICT.
    Never blocks except on the commit lock (held only for short commits, or while an
    irrevocable attempt runs).
    """
    global _n_read_only, _n_conflicts, _n_retries
    if irrevocable:
        return _attempt_irrevocable(fn, args)
    txn = Txn(_clock)
    _set_current(txn)
    try:
        result = fn(*args)
    except Retry:
        txn.status = RETRY
        _n_retries += 1
        return txn
    except Conflict:
        txn.status = CONFLICT
        _n_conflicts += 1
        return txn
    except BaseException:
        if txn.doomed is not None or not txn.still_valid():
            txn.status = CONFLICT
            _n_conflicts += 1
            return txn
        raise
    finally:
        _set_current(None)
    if isinstance(result, CoroutineType):
        raise _coroutine_error(result)
    if txn.doomed is not None:
        txn.status = txn.doomed
        if txn.doomed == RETRY:
            _n_retries += 1
        else:
            _n_conflicts += 1
        return txn
    if not txn.writes:
        _n_read_only += 1
        txn.status = COMMITTED
        txn.result = result
        return txn
    if _commit(txn):
        txn.status = COMMITTED
        txn.result = result
    else:
        txn.status = CONFLICT
        _n_conflicts += 1
    return txn


@trio.lowlevel.enable_ki_protection
def _commit(txn: Txn) -> bool:
    """Validate and install a writing attempt; wake the waiters of what it wrote. Short, sync."""
    global _clock, _n_commits
    woken: list[Waiter] | None = None
    with _lock:
        if _clock != txn.rv and not _UNSAFE_SKIP_VALIDATION:
            for tv, st in txn.reads.items():
                if tv._state is not st:
                    return False
        new = _clock + 1
        writes = txn.writes
        for tv in writes:
            tv._state = (new, writes[tv])
            if tv._waiters:
                woken = _take_waiters(tv._waiters, woken)
        _clock = new
        _n_commits += 1
    if woken is not None:
        _wake(woken)
    return True


def _attempt_irrevocable(fn: Callable[..., Any], args: tuple[Any, ...]) -> Txn:
    """Run `fn` holding the commit lock: nothing can commit meanwhile, so it cannot conflict."""
    global _clock, _n_commits, _n_read_only, _n_retries, _n_irrevocable
    woken: list[Waiter] | None = None
    with _lock:
        _n_irrevocable += 1
        txn = Txn(_clock)
        _set_current(txn)
        try:
            result = fn(*args)
        except Retry:
            txn.status = RETRY
            _n_retries += 1
            return txn
        finally:
            _set_current(None)
        if txn.doomed is not None:
            # Only a swallowed Retry can get here: nothing can conflict while we hold the lock.
            txn.status = RETRY
            _n_retries += 1
            return txn
        if isinstance(result, CoroutineType):
            raise _coroutine_error(result)
        txn.status = COMMITTED
        txn.result = result
        if not txn.writes:
            _n_read_only += 1
            return txn
        new = _clock + 1
        for tv, value in txn.writes.items():
            tv._state = (new, value)
            if tv._waiters:
                woken = _take_waiters(tv._waiters, woken)
        _clock = new
        _n_commits += 1
    if woken is not None:
        _wake(woken)
    return txn


def run_effects(effects: list[tuple[Callable[..., object], tuple[Any, ...]]]) -> None:
    for fn, args in effects:
        fn(*args)


# --- waiters ---------------------------------------------------------------------------------


class Waiter:
    """A blocked transaction, registered on every TVar its last attempt read.

    `fired` becomes True (under `_lock`) when a commit takes it off all its TVars; after that
    nothing else may touch its registrations, and exactly one `wake()` follows.
    """

    __slots__ = ("fired", "tvars")

    tvars: Iterable[TVar[Any]]
    fired: bool

    def __init__(self) -> None:
        self.tvars = ()
        self.fired = False

    def wake(self, thread_id: int) -> None:
        raise NotImplementedError


class TrioWaiter(Waiter):
    """A trio task parked in `wait_task_rescheduled`. `parked` is only touched on its loop."""

    __slots__ = ("parked", "task", "thread_id", "token")

    def __init__(self) -> None:
        self.tvars = ()
        self.fired = False
        self.task = _current_task()
        self.token = _current_trio_token()
        self.thread_id = _get_ident()
        self.parked = False

    def wake(self, thread_id: int) -> None:
        if thread_id == self.thread_id:
            self.wake_on_loop()
        else:
            self.token.run_sync_soon(self.wake_on_loop)

    def wake_on_loop(self) -> None:
        # The abort_fn may have run first and resumed the task itself: never reschedule twice.
        if self.parked:
            self.parked = False
            _reschedule(self.task)

    def abort(self, _: object) -> trio.lowlevel.Abort:
        """The abort_fn of the park: unregister, unless a commit fired us (then it must fail)."""
        if unregister(self):
            self.parked = False
            return trio.lowlevel.Abort.SUCCEEDED
        return trio.lowlevel.Abort.FAILED  # the reschedule is on its way


class ThreadWaiter(Waiter):
    """A thread blocked in `atomically_sync`: it waits to acquire `gate`, which `wake` releases."""

    __slots__ = ("gate",)

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Lock()
        self.gate.acquire()

    def wake(self, thread_id: int) -> None:
        self.gate.release()


def _take_waiters(ws: dict[Waiter, None], woken: list[Waiter] | None) -> list[Waiter]:
    """Under `_lock`: fire every waiter in `ws` and remove it from all the TVars it waits on."""
    global _n_waiters, _n_wakeups
    if woken is None:
        woken = []
    for w in list(ws):
        w.fired = True
        n = 0
        for tv in w.tvars:
            d = tv._waiters
            assert d is not None
            del d[w]
            n += 1
        _n_waiters -= n
        _n_wakeups += 1
        woken.append(w)
    return woken


def _wake(woken: list[Waiter]) -> None:
    me = _get_ident()
    for w in woken:
        if type(w) is TrioWaiter and w.thread_id == me:
            if w.parked:  # same loop: reschedule directly
                w.parked = False
                _reschedule(w.task)
        else:
            w.wake(me)


def register(txn: Txn, waiter: Waiter) -> bool:
    """Register `waiter` on every TVar `txn` read, unless one of them changed since.

    Returns False (and registers nothing) if a read TVar changed: the caller reruns at once.
    Check and registration happen under `_lock`, so a commit is either seen by the check or
    sees the waiter. Cost: O(reads).
    """
    global _n_waiters, _n_wakeups
    reads = txn.reads
    with _lock:
        for tv, st in reads.items():
            if tv._state is not st:
                _n_wakeups += 1
                return False
        for tv in reads:
            d = tv._waiters
            if d is None:
                d = tv._waiters = {}
            d[waiter] = None
        waiter.tvars = reads
        _n_waiters += len(reads)
    return True


def unregister(waiter: Waiter) -> bool:
    """Take `waiter` off its TVars. False if a commit already fired it (its wake is on the way)."""
    global _n_waiters
    with _lock:
        if waiter.fired:
            return False
        n = 0
        for tv in waiter.tvars:
            d = tv._waiters
            assert d is not None
            del d[waiter]
            n += 1
        _n_waiters -= n
        waiter.tvars = ()
        waiter.fired = True
        return True


def counters() -> tuple[int, int, int, int, int, int, int]:
    with _lock:
        return (
            _n_commits,
            _n_read_only,
            _n_conflicts,
            _n_retries,
            _n_wakeups,
            _n_irrevocable,
            _n_waiters,
        )
