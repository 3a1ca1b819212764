"""Errors `stm` raises for misuse. Each says what went wrong and what to do instead."""

from __future__ import annotations

from typing import final


@final
class NoTransactionError(RuntimeError):
    """A TVar operation, `retry`, `check`, `or_else`, `after_commit` or an operation of one of
    the structures (`TQueue`, ...) ran outside a transaction.

    They only make sense inside the function given to `atomically`, `atomically_sync` or
    `atomically_nowait`. The message names the operation that was called (for a structure, its
    own operation, not the TVars it uses). `TVar.peek()` reads without a transaction.
    """


@final
class NestedTransactionError(RuntimeError):
    """`atomically`, `atomically_sync` or `atomically_nowait` was called inside a transaction.

    Transactions compose by calling the inner function directly, not by nesting `atomically`.
    """


@final
class RetryWouldHangError(RuntimeError):
    """A transaction retried after reading no TVar and without a deadline: nothing could wake it."""
