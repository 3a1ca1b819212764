"""`TVar`: a transactional variable. Its whole state is one `(version, value)` tuple."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar, final

from . import _txn
from ._txn import no_transaction_error

if TYPE_CHECKING:
    from ._txn import Waiter

T = TypeVar("T")

_here = _txn.here
_PEEK = ", or read the last committed value with TVar.peek()"


@final
class TVar(Generic[T]):
    """A transactional variable holding a value of type `T`.

    `get`, `set` and `modify` work only inside a transaction (else `NoTransactionError`);
    `peek` reads the last committed value from anywhere. Each is O(1) and never blocks.
    """

    __slots__ = ("_state", "_waiters")

    # `_state` is replaced whole under the commit lock and read lock-free as one reference load.
    _state: tuple[int, T]
    # Waiters blocked on this TVar (an insertion-ordered set); changed only under the lock.
    _waiters: dict[Waiter, None] | None

    def __init__(self, value: T) -> None:
        self._state = (0, value)
        self._waiters = None

    def get(self) -> T:
        """The value in this transaction's snapshot (or its own earlier write)."""
        txn = _here.txn
        if txn is None:
            raise no_transaction_error("TVar.get()", _PEEK)
        writes = txn.writes
        if writes and self in writes:
            return writes[self]  # type: ignore[no-any-return]
        st = self._state
        if st[0] > txn.rv:
            st = txn.extend(self)
        txn.reads[self] = st
        return st[1]

    def set(self, value: T) -> None:
        """Write `value`; other transactions see it only once this one commits."""
        txn = _here.txn
        if txn is None:
            raise no_transaction_error(
                "TVar.set()", " (for example `stm.atomically_nowait(tvar.set, value)`)"
            )
        txn.writes[self] = value

    def modify(self, fn: Callable[[T], T]) -> None:
        """`set(fn(get()))`."""
        txn = _here.txn
        if txn is None:
            raise no_transaction_error(
                "TVar.modify()", " (for example `stm.atomically_nowait(tvar.modify, fn)`)"
            )
        self.set(fn(self.get()))

    def peek(self) -> T:
        """The last committed value. No transaction needed; O(1), lock-free, never blocks."""
        return self._state[1]

    def __repr__(self) -> str:
        version, value = self._state
        waiters = self._waiters
        return (
            f"<stm.TVar value={value!r} version={version} "
            f"waiters={len(waiters) if waiters else 0} at {id(self):#x}>"
        )
