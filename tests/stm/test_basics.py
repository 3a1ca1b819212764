"""The API surface, outside and inside transactions, and every misuse error."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import attrs
import pytest
import trio

import stm
from stm import TVar, after_commit, atomically, atomically_nowait, atomically_sync, or_else, retry

PUBLIC = [
    "TVar",
    "atomically",
    "atomically_sync",
    "atomically_nowait",
    "retry",
    "check",
    "or_else",
    "after_commit",
    "statistics",
    "STMStatistics",
    "NoTransactionError",
    "NestedTransactionError",
    "RetryWouldHangError",
]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_have_public_module(name: str) -> None:
    assert getattr(stm, name).__module__ == "stm"


def test_tvar_peek_and_repr() -> None:
    tv = TVar([1])
    assert tv.peek() == [1]
    assert "value=[1]" in repr(tv)
    assert "version=0" in repr(tv)
    atomically_nowait(tv.set, [2])
    assert tv.peek() == [2]
    assert "version=" in repr(tv) and "version=0" not in repr(tv)


def test_tvar_is_slotted() -> None:
    tv = TVar(1)
    with pytest.raises(AttributeError):
        tv.other = 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "op",
    [
        lambda tv: tv.get(),
        lambda tv: tv.set(1),
        lambda tv: tv.modify(lambda v: v),
        lambda tv: retry(),
        lambda tv: stm.check(False),
        lambda tv: or_else(lambda: 1, lambda: 2),
        lambda tv: after_commit(print),
    ],
)
def test_outside_a_transaction(op) -> None:
    tv = TVar(0)
    with pytest.raises(stm.NoTransactionError, match=r"outside a transaction"):
        op(tv)
    assert issubclass(stm.NoTransactionError, RuntimeError)


def test_outside_a_transaction_the_error_names_the_call_and_a_fitting_remedy() -> None:
    tv = TVar(0)
    cases: list[tuple[Callable[[], object], str, str | None]] = [
        (tv.get, "TVar.get()", "TVar.peek()"),  # a read: peek() is an alternative
        (lambda: tv.set(1), "TVar.set()", None),  # a write: peek() is none
        (lambda: tv.modify(abs), "TVar.modify()", None),
        (retry, "stm.retry()", None),
        (lambda: stm.check(False), "stm.check()", None),
        (lambda: or_else(lambda: 1, lambda: 2), "stm.or_else()", None),
        (lambda: after_commit(print), "stm.after_commit()", None),
    ]
    for op, name, peek in cases:
        with pytest.raises(stm.NoTransactionError) as info:
            op()
        message = str(info.value)
        assert message.startswith(f"{name} was called outside a transaction"), message
        assert "atomically" in message
        assert ("peek" in message) == (peek is not None), message


def test_get_set_modify_and_read_own_writes() -> None:
    a, b = TVar(1), TVar(10)

    def txn() -> tuple[int, int, int]:
        a.set(a.get() + 1)
        b.modify(lambda v: v * 2)
        return a.get(), b.get(), a.peek()

    assert atomically_nowait(txn) == (2, 20, 1)
    assert (a.peek(), b.peek()) == (2, 20)


def test_exception_discards_writes_and_propagates(delta) -> None:
    tv = TVar(0)

    def boom() -> None:
        tv.set(5)
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        atomically_nowait(boom)
    with pytest.raises(ValueError, match="no"):
        atomically_sync(boom)
    assert tv.peek() == 0
    assert delta()["commits"] == 0


async def test_exception_propagates_from_atomically() -> None:
    tv = TVar(0)

    def boom() -> None:
        tv.set(5)
        raise KeyError("k")

    with trio.testing.assert_checkpoints(), pytest.raises(KeyError):
        await atomically(boom)
    assert tv.peek() == 0


async def test_async_function_is_a_type_error() -> None:
    async def fn() -> int:
        return 1

    gc.collect()
    with pytest.raises(TypeError, match="synchronous"):
        _ = atomically_nowait(fn)
    with pytest.raises(TypeError, match="synchronous"):
        _ = await trio.to_thread.run_sync(atomically_sync, fn)
    with pytest.raises(TypeError, match="synchronous"):
        _ = await atomically(fn)
    gc.collect()  # no "coroutine was never awaited" warning (filterwarnings=error)


def test_function_returning_a_coroutine_is_a_type_error() -> None:
    tv = TVar(0)

    async def later() -> None:
        pass

    def fn() -> object:
        tv.set(1)
        return later()

    with pytest.raises(TypeError, match="coroutine"):
        atomically_nowait(fn)
    assert tv.peek() == 0
    gc.collect()


def test_or_else_branch_returning_a_coroutine_is_a_type_error() -> None:
    async def later() -> None:
        pass

    with pytest.raises(TypeError, match="coroutine"):
        atomically_nowait(lambda: or_else(later, lambda: 1))
    gc.collect()


async def test_retry_with_nothing_read_would_hang() -> None:
    with pytest.raises(stm.RetryWouldHangError, match="deadline"):
        await trio.to_thread.run_sync(atomically_sync, retry)
    with pytest.raises(stm.RetryWouldHangError):
        await atomically(retry)
    tv = TVar(0)

    def own_write_only() -> None:
        tv.set(1)
        tv.get()  # served from the write log: not a read of shared state
        retry()

    with pytest.raises(stm.RetryWouldHangError):
        await atomically(own_write_only)
    assert issubclass(stm.RetryWouldHangError, RuntimeError)


def test_nowait_retry_is_would_block(delta) -> None:
    tv = TVar(0)

    def fn() -> None:
        tv.set(1)
        stm.check(tv.get() > 5 and False)

    with pytest.raises(trio.WouldBlock):
        atomically_nowait(fn)
    with pytest.raises(trio.WouldBlock):
        atomically_nowait(retry)
    assert tv.peek() == 0
    assert delta()["retries"] == 2


async def test_nested_transactions_are_an_error() -> None:
    tv = TVar(0)
    for inner in (atomically_nowait, atomically_sync):

        def outer(inner=inner) -> None:
            tv.set(1)
            inner(tv.set, 2)

        with pytest.raises(stm.NestedTransactionError, match="inside a transaction"):
            await trio.to_thread.run_sync(lambda: atomically_nowait(outer))
        # In a trio thread, atomically_sync refuses before it looks for a transaction.
        error = stm.NestedTransactionError if inner is atomically_nowait else RuntimeError
        with pytest.raises(error):
            await atomically(outer)
    assert tv.peek() == 0


def test_or_else_discards_writes_of_retrying_branch() -> None:
    a, b = TVar(0), TVar(0)
    log: list[str] = []

    def first() -> str:
        a.set(1)
        after_commit(log.append, "first")
        retry()

    def second() -> str:
        b.set(1)
        after_commit(log.append, "second")
        return "second"

    assert atomically_nowait(lambda: or_else(first, second)) == "second"
    assert (a.peek(), b.peek()) == (0, 1)
    assert log == ["second"]


def test_or_else_many_and_nested() -> None:
    tv = TVar(0)

    def fail() -> int:
        tv.set(99)
        retry()

    assert atomically_nowait(lambda: or_else(fail, fail, fail, lambda: tv.get())) == 0
    assert atomically_nowait(lambda: or_else(lambda: or_else(fail, fail), lambda: 7)) == 7
    with pytest.raises(trio.WouldBlock):
        atomically_nowait(lambda: or_else(fail, fail))
    assert tv.peek() == 0


def test_or_else_first_wins_keeps_its_writes() -> None:
    tv = TVar(0)

    def first() -> int:
        tv.set(1)
        return 1

    assert atomically_nowait(lambda: or_else(first, lambda: 2)) == 1
    assert tv.peek() == 1


def test_after_commit_runs_only_on_commit_in_order() -> None:
    tv = TVar(0)
    log: list[object] = []

    def ok() -> None:
        tv.set(1)
        after_commit(log.append, 1)
        after_commit(log.append, 2)
        assert log == []

    atomically_nowait(ok)
    assert log == [1, 2]

    def raises() -> None:
        after_commit(log.append, 3)
        raise ValueError

    with pytest.raises(ValueError):
        atomically_sync(raises)

    def retries() -> None:
        after_commit(log.append, 4)
        retry()

    with pytest.raises(trio.WouldBlock):
        atomically_nowait(retries)
    assert log == [1, 2]

    def read_only() -> None:
        tv.get()
        after_commit(log.append, 5)

    atomically_sync(read_only)
    assert log == [1, 2, 5]


def test_after_commit_effect_raising_propagates_commit_stands() -> None:
    tv = TVar(0)
    log: list[int] = []

    def fn() -> None:
        tv.set(1)
        after_commit(lambda: 1 / 0)
        after_commit(log.append, 1)

    with pytest.raises(ZeroDivisionError):
        atomically_nowait(fn)
    assert tv.peek() == 1
    assert log == []


def test_swallowed_retry_still_retries() -> None:
    tv = TVar(0)

    def sneaky() -> int:
        with contextlib.suppress(BaseException):
            retry()
        tv.set(1)
        return 1

    with pytest.raises(trio.WouldBlock):
        atomically_nowait(sneaky)
    assert tv.peek() == 0


def test_statistics_record(delta) -> None:
    s = stm.statistics()
    assert attrs.has(type(s))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        s.commits = 0  # type: ignore[misc]
    tv = TVar(0)
    atomically_nowait(tv.set, 1)
    atomically_nowait(tv.get)
    with pytest.raises(trio.WouldBlock):
        atomically_nowait(lambda: stm.check(tv.get() == 0))
    assert delta() == {
        "commits": 1,
        "read_only_commits": 1,
        "conflicts": 0,
        "retries": 1,
        "wakeups": 0,
        "irrevocable_runs": 0,
    }


def test_read_only_transaction_bumps_no_clock() -> None:
    from stm import _txn

    tv = TVar(0)
    before = _txn._clock
    atomically_nowait(tv.get)
    atomically_sync(lambda: [tv.get() for _ in range(3)])
    assert _txn._clock == before
    atomically_nowait(tv.set, 1)
    assert _txn._clock == before + 1
