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
- Waiters register under the same lock after checking that nothing they read has changed
  (nothing to check if the clock still equals `rv`), so a commit either happened before (the
  check sees it and the attempt reruns at once) or after (the commit sees the waiter). No wake-up
  is lost, and a commit only touches waiters of TVars it wrote: it detaches each written TVar's
  waiter set whole and wakes those waiters after releasing the lock.
- Ctrl-C: `_install` (the one place TVar states change) and both commits around it are
  KeyboardInterrupt-protected under trio, and so is a park's registration (`_atomically._park`),
  so a Ctrl-C never leaves a commit half done, a fired waiter unwoken or a waiter behind
  (docs/adr/0013-ctrl-c-and-the-commit.md).
- Starvation: after `MAX_CONFLICTS` conflict reruns an attempt runs irrevocably: it holds `_lock`
  while `fn` runs, so no commit can invalidate it.

All shared mutable state (TVar states, waiter sets, the clock, the waiter count) changes under
`_lock`. The lock-free paths only load references. The statistics counters other than the waiter
count are bumped without the lock on some paths and may undercount when threads race.

Open question: one global lock serializes writing commits across threads. Per-TVar locks in
address order would let disjoint commits proceed in parallel, at a higher cost per commit.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Collection
from types import CoroutineType, FrameType
from typing import TYPE_CHECKING, Any, Final, TypeVar

import trio

from ._errors import NestedTransactionError, NoTransactionError

if TYPE_CHECKING:
    from ._tvar import TVar

V = TypeVar("V")
R = TypeVar("R")
A = TypeVar("A")

MAX_CONFLICTS: Final = 8
"""Conflict reruns after which an attempt runs irrevocably (holding the commit lock)."""

_lock = threading.Lock()
# Bound methods, used as `_acquire(); try: ... finally: _release()` on the hot paths: about half
# the cost of a `with _lock:` block on CPython 3.11.
_acquire: Final = _lock.acquire
_release: Final = _lock.release
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


# The running attempt of this thread. An attempt is synchronous, so a thread runs at most one at a
# time and per-thread storage is enough for trio tasks too. A threading.local rather than a
# ContextVar: reading it costs about 30 ns against 7, but setting it costs about 35 ns against 75
# (a ContextVar set builds a new context mapping and a token), and every attempt sets it twice
# while a typical transaction reads it two to four times. Nor does it follow a context copied into
# another thread (`trio.to_thread`), where a ContextVar would carry the transaction along.
class _Here(threading.local):
    txn: Txn | None = None


here: Final = _Here()


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


def current(what: str) -> Txn:
    """The running attempt of this thread; `NoTransactionError` naming `what` if there is none."""
    txn = here.txn
    if txn is None:
        raise no_transaction_error(what)
    return txn


_RUNNERS: Final = "stm.atomically / atomically_sync / atomically_nowait"


def no_transaction_error(what: str, hint: str = "") -> NoTransactionError:
    """The `NoTransactionError` for `what` (say "TVar.get()") called outside a transaction.

    If the call came through one of stm's structures (`len(queue)` outside a transaction), the
    message names the structure's operation the user called, the outermost one, instead of the
    TVar or function it used inside. Error path only: it walks the caller's frames.
    """
    frame: FrameType | None = sys._getframe(1)
    operation = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == "stm._structures":
            operation = frame.f_code.co_qualname.partition(".<locals>")[0]
        elif not module.startswith("stm._"):
            break
        frame = frame.f_back
    if operation is not None:
        kind, _, method = operation.partition(".")
        name = kind.lower()
        if method == "__len__":
            what = f"len() of a {kind} was taken"
            hint = f" (for example `await stm.atomically(len, {name})`)"
        elif method == "__contains__":
            what = f"`in` on a {kind} was tested"
            hint = f" (for example `stm.atomically_nowait(lambda: key in {name})`)"
        else:
            what = f"{kind}.{method}() was called"
            hint = f" (for example `await stm.atomically({name}.{method})`)"
    else:
        what += " was called"
    return NoTransactionError(
        f"{what} outside a transaction: call it inside the function given to {_RUNNERS}{hint}"
    )


def check_not_nested() -> None:
    if here.txn is not None:
        raise NestedTransactionError(
            "atomically was called inside a transaction: call the inner transaction's function "
            "directly instead, so both run as one transaction"
        )


def attempt(fn: Callable[..., Any], args: tuple[Any, ...], irrevocable: bool) -> Txn:
    """Run `fn(*args)` once as a transaction attempt, and commit it if it wants to.

    Returns the attempt with `status` COMMITTED (and `result`), RETRY or CONFLICT. Exceptions
    raised by `fn` propagate only if the attempt's reads are still current; otherwise CONFLICT.
    KeyboardInterrupt and SystemExit always propagate (nothing written): a Ctrl-C that lands in
    `fn` is not the product of an inconsistent read, and taking it for a conflict would lose it.
    Never blocks except on the commit lock (held only for short commits, or while an
    irrevocable attempt runs).
    """
    global _n_read_only, _n_conflicts, _n_retries
    if irrevocable:
        return _attempt_irrevocable(fn, args)
    txn = Txn(_clock)
    here.txn = txn
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
    except Exception:  # not KeyboardInterrupt, SystemExit: a Ctrl-C in `fn` is never a conflict
        if txn.doomed is not None or not txn.still_valid():
            txn.status = CONFLICT
            _n_conflicts += 1
            return txn
        raise
    finally:
        here.txn = None
    if type(result) is CoroutineType:  # (CoroutineType cannot be subclassed)
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
    """Validate and install a writing attempt; wake the waiters of what it wrote. Short, sync.

    KeyboardInterrupt-protected under trio from taking the lock to the last wake-up, so a Ctrl-C
    cannot leave a commit half done or a fired waiter unwoken (trio delivers it afterwards).
    """
    _acquire()
    try:
        if _clock != txn.rv and not _UNSAFE_SKIP_VALIDATION:
            for tv, st in txn.reads.items():
                if tv._state is not st:
                    return False
        woken = _install(txn.writes)
    finally:
        _release()
    if woken is not None:
        _wake(woken)
    return True


@trio.lowlevel.enable_ki_protection
def _install(writes: dict[TVar[Any], Any]) -> list[dict[Waiter, None]] | None:
    """Under `_lock`: stamp `writes` with the next clock value, publish it, detach their waiters.

    The one install of both commit paths. Returns the detached waiter sets for `_wake`, or None.
    KeyboardInterrupt-protected under trio: the values and the clock change together or not at
    all. Cost: O(writes + waiters of the written TVars).
    """
    global _clock, _n_commits
    woken: list[dict[Waiter, None]] | None = None
    new = _clock + 1
    for tv in writes:
        tv._state = (new, writes[tv])
        if tv._waiters:
            woken = _detach(tv, woken)
    _clock = new
    _n_commits += 1
    return woken


@trio.lowlevel.enable_ki_protection
def _commit_irrevocable(writes: dict[TVar[Any], Any]) -> None:
    """The irrevocable attempt's commit, under the `_lock` it holds (nothing to validate).

    It wakes the waiters before the lock is released, so that no KeyboardInterrupt can land
    between the install and the wake-ups: the caller's `with _lock` releases the lock whatever
    happens after this returns.
    """
    woken = _install(writes)
    if woken is not None:
        _wake(woken)


def _attempt_irrevocable(fn: Callable[..., Any], args: tuple[Any, ...]) -> Txn:
    """Run `fn` holding the commit lock: nothing can commit meanwhile, so it cannot conflict.

    `fn` runs without KeyboardInterrupt protection (as in any attempt); a Ctrl-C in it ends the
    attempt with nothing written. The commit itself is `_commit_irrevocable`, protected.
    """
    global _n_read_only, _n_retries, _n_irrevocable
    with _lock:
        _n_irrevocable += 1
        txn = Txn(_clock)
        here.txn = txn
        try:
            result = fn(*args)
        except Retry:
            txn.status = RETRY
            _n_retries += 1
            return txn
        finally:
            here.txn = None
        if txn.doomed is not None:
            # Only a swallowed Retry can get here: nothing can conflict while we hold the lock.
            txn.status = RETRY
            _n_retries += 1
            return txn
        if isinstance(result, CoroutineType):
            raise _coroutine_error(result)
        if txn.writes:
            _commit_irrevocable(txn.writes)
        else:
            _n_read_only += 1
        txn.status = COMMITTED
        txn.result = result
    return txn


@trio.lowlevel.enable_ki_protection
def update(tvar: TVar[V], bell: TVar[int], fn: Callable[[V, A], tuple[V, R, bool]], args: A) -> R:
    """Internal: one transaction on the single TVar `tvar` (and maybe its doorbell), cheaply.

    `fn(value, args)` must be a pure function of `tvar`'s committed value: it reads no TVar and
    writes none, and returns `(new, result, ring)`. The transaction installs `new` (unless it is
    `value` itself and `ring` is false: then it is read-only) and, if `ring`, adds 1 to `bell`
    in the same commit; it returns `result`. An exception from `fn` propagates, nothing written.
    (`args` is one value, say a tuple, rather than `*args`: packing and unpacking varargs twice
    cost more than the rest of this function.)

    The same protocol as `attempt` + `_commit` (ADR 0001), specialized: the read set is the one
    tuple `st` loaded from `tvar`, so every attempt sees a consistent snapshot and validation is
    `tvar._state is st` under the lock. `bell` is read and written only under the lock, where no
    commit can interleave. No `Txn`, no read or write dict, no thread-local. After
    `MAX_CONFLICTS` lost validations `fn` runs holding the lock (it cannot lose again).
    Waiters on `tvar` or `bell` are woken as any commit wakes them. KeyboardInterrupt-protected
    like `_commit` (ADR 0013). Never call it inside a transaction (it would commit on its own).
    Never blocks except on the commit lock. Cost: `fn`, one lock round, one tuple per write.
    """
    global _clock, _n_commits, _n_read_only, _n_conflicts, _n_irrevocable
    conflicts = 0
    while conflicts < MAX_CONFLICTS:
        st = tvar._state
        old = st[1]
        new, result, ring = fn(old, args)
        if new is old and not ring:
            _n_read_only += 1
            return result
        _acquire()
        if tvar._state is st or _UNSAFE_SKIP_VALIDATION:
            break
        _release()
        _n_conflicts += 1
        conflicts += 1
    else:
        _acquire()
        _n_irrevocable += 1
        try:
            old = tvar._state[1]
            new, result, ring = fn(old, args)
        except BaseException:
            _release()
            raise
        if new is old and not ring:
            _release()
            _n_read_only += 1
            return result
    try:
        version = _clock + 1
        tvar._state = (version, new)
        woken = _detach(tvar, None) if tvar._waiters else None
        if ring:
            bell._state = (version, bell._state[1] + 1)
            if bell._waiters:
                woken = _detach(bell, woken)
        _clock = version
        _n_commits += 1
    finally:
        _release()
    if woken is not None:
        _wake(woken)
    return result


def run_effects(effects: list[tuple[Callable[..., object], tuple[Any, ...]]]) -> None:
    for fn, args in effects:
        fn(*args)


# --- waiters ---------------------------------------------------------------------------------
#
# Each TVar holds the waiters blocked on it in `_waiters`, an insertion-ordered dict used as a
# set, or None. A commit that writes a TVar detaches that whole dict (one store, under `_lock`),
# takes each of its waiters off the other TVars it waits on (nothing to do for the common waiter
# on one TVar), and wakes the waiters of the detached dicts once the lock is released. No list
# of waiters is built and no waiter is removed one by one from the TVar that was written.


class Waiter:
    """A blocked transaction, registered on every TVar its last attempt read.

    Invariant (under `_lock`): while `fired` is False the waiter is a key of the `_waiters` dict
    of every TVar in `tvars`. `fired` becomes True when a commit detaches it (then exactly one
    `wake` follows, outside the lock) or when `unregister` takes it off; after that no TVar holds
    it. Once its wait is over a waiter may be registered again (`register` resets it).
    """

    __slots__ = ("fired", "tvars")

    tvars: Collection[TVar[Any]]
    fired: bool

    def wake(self) -> None:
        """Resume the blocked transaction. Called once per firing, by the committing thread."""
        raise NotImplementedError


class TrioWaiter(Waiter):
    """A trio task parked in `wait_task_rescheduled` on the loop running in thread `thread_id`.

    A commit in that thread reschedules `task` directly (see `_wake`); any other thread goes
    through `token.run_sync_soon`. The task is still parked when either runs: the abort_fn fails
    once the waiter has fired, so only this wake-up can resume it. `cancel_missed` records that
    it failed: the task was cancelled after the commit fired it, and must check for that itself.
    """

    __slots__ = ("cancel_missed", "task", "thread_id", "token")

    def __init__(self) -> None:
        self.task = _current_task()
        self.token = _current_trio_token()
        self.thread_id = _get_ident()
        self.cancel_missed = False

    def wake(self) -> None:
        self.token.run_sync_soon(_reschedule, self.task)

    def abort(self, _: object) -> trio.lowlevel.Abort:
        """The abort_fn of the park: unregister, unless a commit fired us (then it must fail)."""
        if unregister(self):
            return trio.lowlevel.Abort.SUCCEEDED
        self.cancel_missed = True
        return trio.lowlevel.Abort.FAILED  # the reschedule is on its way


class ThreadWaiter(Waiter):
    """A thread blocked in `atomically_sync`: it waits to acquire `gate`, which `wake` releases."""

    __slots__ = ("gate",)

    def __init__(self) -> None:
        self.fired = True  # not registered yet: `unregister` has nothing to do
        self.gate = threading.Lock()
        self.gate.acquire()

    def wake(self) -> None:
        self.gate.release()


def _detach(tv: TVar[Any], woken: list[dict[Waiter, None]] | None) -> list[dict[Waiter, None]]:
    """Under `_lock`: fire every waiter of `tv`, taking it off every TVar it waits on.

    Returns `woken` with `tv`'s detached waiter set appended, for `_wake` after the lock.
    Cost: O(waiters of `tv`) plus O(other TVars) for each waiter that waits on several.
    """
    global _n_waiters, _n_wakeups
    ws = tv._waiters
    assert ws is not None
    tv._waiters = None
    registrations = len(ws)
    for w in ws:
        w.fired = True
        tvars = w.tvars
        if len(tvars) > 1:
            # Its other TVars are still attached: had one been detached, `w` would have fired
            # then and been taken off `tv` too.
            for other in tvars:
                if other is not tv:
                    d = other._waiters
                    assert d is not None
                    del d[w]
            registrations += len(tvars) - 1
    _n_waiters -= registrations
    _n_wakeups += len(ws)
    if woken is None:
        return [ws]
    woken.append(ws)
    return woken


def _wake(woken: list[dict[Waiter, None]]) -> None:
    """Outside `_lock`: wake every waiter detached by a commit (each fired exactly once)."""
    me = _get_ident()
    for ws in woken:
        for w in ws:
            if type(w) is TrioWaiter and w.thread_id == me:
                _reschedule(w.task)  # on our own loop: no need to go through the token
            else:
                w.wake()


@trio.lowlevel.enable_ki_protection
def register(txn: Txn, waiter: Waiter) -> bool:
    """Register `waiter` on every TVar `txn` read, unless one of them changed since.

    Returns False (and registers nothing) if a read TVar changed: the caller reruns at once.
    Check and registration happen under `_lock`, so a commit is either seen by the check or
    sees the waiter. If the clock has not moved since the attempt's snapshot, nothing it read
    can have changed and the check is skipped. Cost: O(reads).
    """
    global _n_waiters, _n_wakeups
    reads = txn.reads
    _acquire()
    try:
        if _clock != txn.rv:
            for tv, st in reads.items():
                if tv._state is not st:
                    _n_wakeups += 1
                    return False
        for tv in reads:
            d = tv._waiters
            if d is None:
                tv._waiters = {waiter: None}
            else:
                d[waiter] = None
        waiter.tvars = reads
        waiter.fired = False
        _n_waiters += len(reads)
    finally:
        _release()
    return True


@trio.lowlevel.enable_ki_protection
def unregister(waiter: Waiter) -> bool:
    """Take `waiter` off its TVars. False if a commit already fired it (its wake is on the way)."""
    global _n_waiters
    _acquire()
    try:
        if waiter.fired:
            return False
        for tv in waiter.tvars:
            d = tv._waiters
            assert d is not None
            del d[waiter]
            if not d:
                tv._waiters = None
        _n_waiters -= len(waiter.tvars)
        waiter.fired = True
        return True
    finally:
        _release()


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
