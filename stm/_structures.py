"""Transactional structures built from stm's public API alone: TQueue, TBQueue, TMVar, TSemaphore
and TMap.

Each one is a worked example of composition. Its operations are plain synchronous functions that
read and write TVars, so they run inside any transaction, combine with each other and with
`or_else`, and block by retrying (through `check`): a structure has no lock, no condition and no
waiter list of its own. Waiting is the transaction's `retry`; waking is whichever commit changes a
TVar the blocked attempt read. Every operation must be called inside a transaction, for example
`await stm.atomically(queue.get)` or `stm.atomically_nowait(queue.put, item)`, or from a
transaction function that does several things at once; outside one it raises
`NoTransactionError`. The operations that wait take an optional `deadline` (on the runner's
clock, as for `stm.retry`): once it has passed they raise `trio.TooSlowError` instead of waiting
(`stm.check(..., deadline=...)`), which is also the only timeout a thread in `atomically_sync`
has. Each of them but the peeks has a `_nowait` twin, in trio's convention (`get_nowait`,
`put_nowait`, `take_nowait`, `acquire_nowait`): it raises `trio.WouldBlock`, having written
nothing, where the operation would retry, so a transaction can carry on without it. The values
held in the TVars are pyrsistent structures or tuples, never mutated, so an attempt that reruns
starts again from its snapshot.

Design notes:

- TQueue keeps two TVars: a read end (a PVector and the index of its head) and a write end (a
  PVector that `put` appends to). `put` touches only the write end and `get` only the read end,
  until the read end runs dry and `get` takes the whole write end over, so producers and
  consumers in different threads rarely make each other rerun. A PVector and a head index rather
  than a pdeque: a transaction rerun on an old version of a pdeque costs O(n). Items already taken
  stay referenced by the read end's vector until it is used up.
- TBQueue is a TQueue plus its capacity split the same way: `put` spends `_room` (write side),
  `get` counts the slots it frees in `_freed` (read side), and `put` reads `_freed` only once
  `_room` is spent, to take those slots back. Invariant: room + freed + len == capacity.
- TMVar is one TVar holding `()` (empty) or `(value,)` (full), so that None can be stored.
- TSemaphore is one TVar holding the number of free units.
- TMap is one TVar holding a PMap; its docstring says why not one TVar per key.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Generic, Literal, NoReturn, TypeVar, final, overload

import trio
from pyrsistent import pmap, pvector
from pyrsistent.typing import PMap, PVector

from ._atomically import check, or_else
from ._tvar import TVar

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


class _Missing(enum.Enum):
    MISSING = enum.auto()


_MISSING: Literal[_Missing.MISSING] = _Missing.MISSING


def _would_block() -> NoReturn:
    raise trio.WouldBlock


def _at_least_one(n: int, what: str) -> None:
    if n < 1:
        raise ValueError(f"{what} must be at least 1, got {n!r}")


@final
class TQueue(Generic[T]):
    """An unbounded FIFO queue. Call every operation inside a transaction.

    `len(queue)` is the number of items; `await stm.atomically(len, queue)` reads it from outside.
    """

    __slots__ = ("_read", "_write")

    def __init__(self, items: Iterable[T] = ()) -> None:
        # The read end: items and the index of the next one to take (items before it are gone).
        self._read: TVar[tuple[PVector[T], int]] = TVar((pvector(items), 0))
        # The write end: items put since the read end last took it over, oldest first.
        self._write: TVar[PVector[T]] = TVar(pvector())

    def put(self, item: T) -> None:
        """Add `item` at the back. Never retries. O(1) amortized (a PVector append)."""
        self._write.set(self._write.get().append(item))

    def get(self, *, deadline: float | None = None) -> T:
        """Remove and return the oldest item; retries while the queue is empty. O(1) amortized.

        Once `deadline` has passed with the queue still empty, raises `trio.TooSlowError`.
        """
        items, head = self._read.get()
        if head == len(items):  # the read end is used up: take the write end over, O(1)
            items, head = self._write.get(), 0
            check(items, deadline=deadline)
            self._write.set(pvector())
        self._read.set((items, head + 1))
        return items[head]

    def get_nowait(self) -> T:
        """`get`, but raises `trio.WouldBlock` (having written nothing) instead of retrying when
        the queue is empty. O(1) amortized.
        """
        return or_else(self.get, _would_block)

    def peek(self, *, deadline: float | None = None) -> T:
        """The oldest item, left in place; retries while the queue is empty. O(1).

        Once `deadline` has passed with the queue still empty, raises `trio.TooSlowError`.
        """
        items, head = self._read.get()
        if head < len(items):
            return items[head]
        back = self._write.get()
        check(back, deadline=deadline)
        return back[0]

    def __len__(self) -> int:
        """The number of items. Reads both ends, so it conflicts with both `put` and `get`."""
        items, head = self._read.get()
        return len(items) - head + len(self._write.get())


@final
class TBQueue(Generic[T]):
    """A bounded FIFO queue: `put` retries while it holds `capacity` items.

    Call every operation inside a transaction. Raises `ValueError` if `capacity < 1`.
    """

    __slots__ = ("_freed", "_queue", "_room", "capacity")

    capacity: int

    def __init__(self, capacity: int) -> None:
        _at_least_one(capacity, "capacity")
        self.capacity = capacity
        self._queue: TQueue[T] = TQueue()
        self._room = TVar(capacity)  # free slots `put` may fill without looking at `_freed`
        self._freed = TVar(0)  # slots `get` emptied since `put` last took them back

    def put(self, item: T, *, deadline: float | None = None) -> None:
        """Add `item` at the back; retries while the queue is full. O(1) amortized.

        Once `deadline` has passed with the queue still full, raises `trio.TooSlowError`.
        """
        room = self._room.get()
        if room == 0:
            room = self._freed.get()
            check(room, deadline=deadline)
            self._freed.set(0)
        self._room.set(room - 1)
        self._queue.put(item)

    def get(self, *, deadline: float | None = None) -> T:
        """Remove and return the oldest item; retries while the queue is empty. O(1) amortized.

        Once `deadline` has passed with the queue still empty, raises `trio.TooSlowError`.
        """
        item = self._queue.get(deadline=deadline)
        self._freed.set(self._freed.get() + 1)
        return item

    def get_nowait(self) -> T:
        """`get`, but raises `trio.WouldBlock` (having written nothing) instead of retrying when
        the queue is empty. O(1) amortized.
        """
        return or_else(self.get, _would_block)

    def put_nowait(self, item: T) -> None:
        """`put`, but raises `trio.WouldBlock` (having written nothing) instead of retrying when
        the queue is full. O(1) amortized.
        """
        or_else(lambda: self.put(item), _would_block)

    def peek(self, *, deadline: float | None = None) -> T:
        """The oldest item, left in place; retries while the queue is empty. O(1).

        Once `deadline` has passed with the queue still empty, raises `trio.TooSlowError`.
        """
        return self._queue.peek(deadline=deadline)

    def __len__(self) -> int:
        """The number of items (at most `capacity`)."""
        return len(self._queue)


@final
class TMVar(Generic[T]):
    """A box that is either empty or holds one value: `TMVar()` is empty, `TMVar(v)` full.

    Call every operation inside a transaction. Each is O(1).
    """

    __slots__ = ("_box",)

    @overload
    def __init__(self) -> None: ...
    @overload
    def __init__(self, value: T) -> None: ...
    def __init__(self, value: T | Literal[_Missing.MISSING] = _MISSING) -> None:
        self._box: TVar[tuple[T, ...]] = TVar(() if value is _MISSING else (value,))

    def take(self, *, deadline: float | None = None) -> T:
        """Empty the box and return its value; retries while it is empty.

        Once `deadline` has passed with the box still empty, raises `trio.TooSlowError`.
        """
        box = self._box.get()
        check(box, deadline=deadline)
        self._box.set(())
        return box[0]

    def put(self, value: T, *, deadline: float | None = None) -> None:
        """Fill the box with `value`; retries while it is full.

        Once `deadline` has passed with the box still full, raises `trio.TooSlowError`.
        """
        check(not self._box.get(), deadline=deadline)
        self._box.set((value,))

    def read(self, *, deadline: float | None = None) -> T:
        """The value, left in place; retries while the box is empty.

        Once `deadline` has passed with the box still empty, raises `trio.TooSlowError`.
        """
        box = self._box.get()
        check(box, deadline=deadline)
        return box[0]

    def take_nowait(self) -> T:
        """`take`, but raises `trio.WouldBlock` (having changed nothing) when the box is empty."""
        box = self._box.get()
        if not box:
            raise trio.WouldBlock
        self._box.set(())
        return box[0]

    def put_nowait(self, value: T) -> None:
        """`put`, but raises `trio.WouldBlock` (having changed nothing) when the box is full."""
        if self._box.get():
            raise trio.WouldBlock
        self._box.set((value,))

    def is_empty(self) -> bool:
        """True if the box is empty. Never retries."""
        return not self._box.get()


@final
class TSemaphore:
    """A counting semaphore: `acquire(n)` retries until `n` units are free at once.

    Call every operation inside a transaction. Each is O(1). No fairness: while a large `acquire`
    waits, smaller ones may keep overtaking it. Raises `ValueError` if `value < 0`.
    """

    __slots__ = ("_value",)

    def __init__(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"a semaphore starts with 0 or more units, got {value!r}")
        self._value = TVar(value)

    def acquire(self, n: int = 1, *, deadline: float | None = None) -> None:
        """Take `n` units; retries until that many are free. `ValueError` if `n < 1`.

        Once `deadline` has passed with fewer than `n` free, raises `trio.TooSlowError`.
        """
        _at_least_one(n, "n")
        free = self._value.get()
        check(free >= n, deadline=deadline)
        self._value.set(free - n)

    def acquire_nowait(self, n: int = 1) -> None:
        """`acquire`, but raises `trio.WouldBlock` (having taken nothing) when fewer than `n` units
        are free. `ValueError` if `n < 1`.
        """
        _at_least_one(n, "n")
        free = self._value.get()
        if free < n:
            raise trio.WouldBlock
        self._value.set(free - n)

    def release(self, n: int = 1) -> None:
        """Give `n` units back. Never retries. `ValueError` if `n < 1`."""
        _at_least_one(n, "n")
        self._value.set(self._value.get() + n)

    def available(self) -> int:
        """The number of free units. Never retries."""
        return self._value.get()


@final
class TMap(Generic[K, V]):
    """A transactional map. Call every operation inside a transaction.

    `key in tmap` tests membership and `len(tmap)` counts the keys; to wait for a key, write
    `stm.check(key in tmap)`. Lookups and updates are O(log n) (a PMap); `items` is O(n),
    `snapshot` O(1).

    The whole map is one PMap in one TVar, not a TVar per key: so it is a single immutable value,
    `len`, `items` and `snapshot` are consistent for free, there is no key set to keep in step
    with per-key TVars, and a deleted key leaves nothing behind. The price is paid at the TVar's
    granularity:

    - Conflicts: a transaction that writes the map and one that reads or writes it overlap on the
      one TVar even when their keys differ, so the one that commits second reruns. Attempts in
      one trio loop never overlap (each runs to its end without a checkpoint), so there this
      never happens; it does between threads, or loops in threads, working on the map at once.
    - Wake-ups: a transaction blocked on one key (`check(key in tmap)`) is woken by every commit
      that writes the map, whatever key it changed, and reruns to find out, also within one
      trio loop. With many waiters on a busy map, prefer a TVar (or a TMVar) per awaited key.
    """

    __slots__ = ("_map",)

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        self._map: TVar[PMap[K, V]] = TVar(pmap(dict(items)))

    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: V) -> V: ...
    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of `key`, or `default` if it is absent. Never retries."""
        return self._map.get().get(key, default)

    def set(self, key: K, value: V) -> None:
        """Map `key` to `value`."""
        self._map.set(self._map.get().set(key, value))

    def delete(self, key: K) -> bool:
        """Remove `key`. True if it was there; False (and nothing written) if not."""
        current = self._map.get()
        if key not in current:
            return False
        self._map.set(current.remove(key))
        return True

    def items(self) -> list[tuple[K, V]]:
        """The (key, value) pairs, in no particular order. O(n)."""
        return list(self._map.get().items())

    def snapshot(self) -> PMap[K, V]:
        """The whole map as an immutable PMap. O(1)."""
        return self._map.get()

    def __contains__(self, key: object) -> bool:
        return key in self._map.get()

    def __len__(self) -> int:
        return len(self._map.get())
