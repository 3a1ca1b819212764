"""TQueue, TBQueue, TMVar, TSemaphore and TMap: each operation, blocking and waking, composition
with `or_else`, and a producer/consumer run across trio tasks and threads with exact totals."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

import stm
from stm import (
    TBQueue,
    TMap,
    TMVar,
    TQueue,
    TSemaphore,
    TVar,
    atomically,
    atomically_nowait,
    atomically_sync,
    or_else,
)

nowait = atomically_nowait


@pytest.mark.parametrize("name", ["TQueue", "TBQueue", "TMVar", "TSemaphore", "TMap"])
def test_public_with_public_module(name: str) -> None:
    assert getattr(stm, name).__module__ == "stm"


def test_outside_a_transaction_the_error_names_the_structure_operation() -> None:
    """Not the TVar (or stm function) the operation uses inside, which the user never touched;
    and for a structure operation nested in another (TBQueue.get uses TQueue.get), the outer one.
    """
    q: TQueue[int] = TQueue()
    bq: TBQueue[int] = TBQueue(1)
    cases: list[tuple[Callable[[], object], str, str]] = [
        (lambda: q.put(1), "TQueue.put()", "tqueue.put"),
        (q.get, "TQueue.get()", "tqueue.get"),
        (q.get_nowait, "TQueue.get_nowait()", "tqueue.get_nowait"),  # or_else inside
        (lambda: len(q), "len() of a TQueue", "atomically(len, tqueue)"),
        (bq.get, "TBQueue.get()", "tbqueue.get"),
        (lambda: bq.put_nowait(1), "TBQueue.put_nowait()", "tbqueue.put_nowait"),
        (TMVar[int]().take, "TMVar.take()", "tmvar.take"),
        (TSemaphore(1).acquire, "TSemaphore.acquire()", "tsemaphore.acquire"),
        (TMap[str, int]().items, "TMap.items()", "tmap.items"),
        (lambda: "k" in TMap[str, int](), "`in` on a TMap", "key in tmap"),
    ]
    for op, names, example in cases:
        with pytest.raises(stm.NoTransactionError) as info:
            op()
        message = str(info.value)
        assert message.startswith(names) and "outside a transaction" in message, message
        assert example in message and "TVar" not in message and "peek" not in message, message


# --- TQueue ------------------------------------------------------------------------------------


def test_tqueue_is_fifo_across_both_ends() -> None:
    q = TQueue([1, 2])
    nowait(q.put, 3)
    assert nowait(len, q) == 3
    assert nowait(q.peek) == 1
    assert nowait(q.get) == 1
    nowait(q.put, 4)  # read end still holds 2; write end holds 3, 4
    assert [nowait(q.get) for _ in range(3)] == [2, 3, 4]
    assert nowait(len, q) == 0
    with pytest.raises(trio.WouldBlock):
        nowait(q.get)
    with pytest.raises(trio.WouldBlock):
        nowait(q.peek)
    with pytest.raises(trio.WouldBlock):
        nowait(q.get_nowait)
    nowait(q.put, 5)
    assert nowait(q.peek) == 5  # peek from the write end leaves it there
    assert nowait(len, q) == 1
    assert nowait(q.get_nowait) == 5


def test_tqueue_operations_compose_into_one_transaction() -> None:
    q = TQueue(range(5))

    def move_two_and_fail() -> None:
        q.put(q.get())
        q.put(q.get())
        raise ValueError("changed my mind")

    with pytest.raises(ValueError):
        nowait(move_two_and_fail)
    assert [nowait(q.get) for _ in range(5)] == [0, 1, 2, 3, 4]  # nothing moved

    def take_all() -> list[int]:
        return [q.get() for _ in range(len(q))]

    def put_three() -> None:
        for i in range(3):
            q.put(i)

    nowait(put_three)
    assert nowait(take_all) == [0, 1, 2]


async def test_tqueue_get_blocks_until_a_put() -> None:
    q: TQueue[str] = TQueue()
    got: list[str] = []

    async def consumer() -> None:
        got.append(await atomically(q.get))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [] and stm.statistics().waiters == 2  # the read end and the write end
        await atomically(q.put, "x")
    assert got == ["x"]


async def test_nowait_forms_raise_instead_of_retrying_and_write_nothing() -> None:
    """A `_nowait` operation raises `trio.WouldBlock` where its twin would retry: under `await
    atomically` it does not park, and inside a bigger transaction the caller can catch it and
    carry on, with the rest of the transaction intact. None is an item like any other."""
    q: TQueue[int | None] = TQueue([None])
    full: TBQueue[int] = TBQueue(1)
    nowait(full.put, 0)
    box: TMVar[int] = TMVar()
    sem = TSemaphore(1)
    log = TVar(0)
    assert nowait(q.get_nowait) is None  # an item, not "empty"
    ops: list[Callable[[], object]] = [
        q.get_nowait,
        lambda: full.put_nowait(1),
        box.take_nowait,
        lambda: sem.acquire_nowait(2),
    ]
    for op in ops:
        with trio.testing.assert_checkpoints(), pytest.raises(trio.WouldBlock):
            await atomically(op)  # never parks

        def carry_on(op: Callable[[], object] = op) -> str:
            log.set(log.get() + 1)
            try:
                op()
            except trio.WouldBlock:
                return "went without"
            return "got it"  # pragma: no cover

        assert nowait(carry_on) == "went without"
    assert log.peek() == len(ops)  # the transactions committed their other writes
    assert nowait(len, q) == 0 and nowait(len, full) == 1 and nowait(box.is_empty)
    assert nowait(sem.available) == 1
    nowait(sem.acquire_nowait)
    assert nowait(sem.available) == 0
    with pytest.raises(ValueError):
        nowait(sem.acquire_nowait, 0)


# --- TBQueue -----------------------------------------------------------------------------------


def test_tbqueue_capacity_and_fifo() -> None:
    with pytest.raises(ValueError):
        TBQueue[int](0)
    q: TBQueue[int] = TBQueue(2)
    assert q.capacity == 2
    nowait(q.put, 1)
    nowait(q.put, 2)
    with pytest.raises(trio.WouldBlock):
        nowait(q.put, 3)
    with pytest.raises(trio.WouldBlock):
        nowait(q.put_nowait, 3)
    assert nowait(len, q) == 2
    assert nowait(q.peek) == 1
    assert nowait(q.get) == 1
    nowait(q.put_nowait, 3)  # takes back the slot `get` freed
    assert [nowait(q.get), nowait(q.get)] == [2, 3]
    with pytest.raises(trio.WouldBlock):
        nowait(q.get_nowait)
    for round_ in range(5):  # the room/freed accounting keeps exactly `capacity` slots
        nowait(q.put, round_)
        nowait(q.put, round_)
        with pytest.raises(trio.WouldBlock):
            nowait(q.put_nowait, 99)
        assert nowait(q.get) == round_ and nowait(q.get) == round_


async def test_tbqueue_put_blocks_when_full_and_a_get_unblocks_it() -> None:
    q: TBQueue[int] = TBQueue(2)
    other: TBQueue[int] = TBQueue(2)
    nowait(q.put, 1)
    nowait(q.put, 2)
    done: list[int] = []

    async def producer() -> None:
        await atomically(q.put, 3)
        done.append(3)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        await trio.testing.wait_all_tasks_blocked()
        assert done == []
        await atomically(other.put, 7)  # another queue: the producer stays blocked
        await trio.testing.wait_all_tasks_blocked()
        assert done == []
        assert await atomically(q.get) == 1
    assert done == [3]
    assert [nowait(q.get), nowait(q.get)] == [2, 3]


# --- or_else over two queues -------------------------------------------------------------------


async def test_or_else_takes_from_whichever_queue_has_an_item() -> None:
    urgent: TQueue[str] = TQueue()
    normal: TQueue[str] = TQueue()

    def next_job() -> tuple[str, str]:
        return or_else(lambda: ("urgent", urgent.get()), lambda: ("normal", normal.get()))

    got: list[tuple[str, str]] = []

    async def worker(n: int) -> None:
        for _ in range(n):
            got.append(await atomically(next_job))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert stm.statistics().waiters == 4  # both ends of both queues
        await atomically(normal.put, "a")  # wakes the worker blocked on both queues
    assert got == [("normal", "a")]

    nowait(normal.put, "b")
    nowait(urgent.put, "c")
    await worker(2)  # the first alternative wins while it has something
    assert got[1:] == [("urgent", "c"), ("normal", "b")]


# --- TMVar -------------------------------------------------------------------------------------


async def test_tmvar_take_put_read() -> None:
    box: TMVar[int | None] = TMVar()
    assert nowait(box.is_empty)
    with pytest.raises(trio.WouldBlock):
        nowait(box.take)
    with pytest.raises(trio.WouldBlock):
        nowait(box.read)
    with pytest.raises(trio.WouldBlock):
        nowait(box.take_nowait)
    nowait(box.put, None)  # None is a value like any other
    assert not nowait(box.is_empty)
    with pytest.raises(trio.WouldBlock):
        nowait(box.put_nowait, 1)
    with pytest.raises(trio.WouldBlock):
        nowait(box.put, 1)
    assert nowait(box.read) is None
    assert nowait(box.take_nowait) is None
    nowait(box.put_nowait, 2)
    assert nowait(box.take_nowait) == 2
    assert nowait(TMVar(5).read) == 5


async def test_tmvar_hands_values_over_between_tasks() -> None:
    box: TMVar[int] = TMVar()
    got: list[int] = []

    async def taker() -> None:
        for _ in range(3):
            got.append(await atomically(box.take))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(taker)
        for i in range(3):
            await atomically(box.put, i)  # blocks while the box is still full
    assert got == [0, 1, 2]
    assert nowait(box.is_empty)


# --- TSemaphore --------------------------------------------------------------------------------


async def test_tsemaphore_acquire_n_waits_for_n_units() -> None:
    with pytest.raises(ValueError):
        TSemaphore(-1)
    sem = TSemaphore(2)
    with pytest.raises(ValueError):
        nowait(sem.acquire, 0)
    with pytest.raises(ValueError):
        nowait(sem.release, 0)
    nowait(sem.acquire)
    assert nowait(sem.available) == 1
    with pytest.raises(trio.WouldBlock):
        nowait(sem.acquire, 2)
    done: list[str] = []

    async def big() -> None:
        await atomically(sem.acquire, 3)
        done.append("big")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(big)
        await trio.testing.wait_all_tasks_blocked()
        await atomically(sem.release)  # 2 free: not enough yet
        await trio.testing.wait_all_tasks_blocked()
        assert done == []
        await atomically(sem.release)  # 3 free
    assert done == ["big"]
    assert nowait(sem.available) == 0


async def test_tsemaphore_bounds_concurrency() -> None:
    sem = TSemaphore(3)
    inside = TVar(0)
    gate = trio.Event()

    def enter() -> None:
        sem.acquire()
        inside.set(inside.get() + 1)

    def leave() -> None:
        inside.set(inside.get() - 1)
        sem.release()

    async def job() -> None:
        await atomically(enter)
        await gate.wait()
        await atomically(leave)

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(job)
        await trio.testing.wait_all_tasks_blocked()
        assert inside.peek() == 3 and nowait(sem.available) == 0  # two are waiting
        gate.set()
    assert inside.peek() == 0 and nowait(sem.available) == 3


# --- TMap --------------------------------------------------------------------------------------


async def test_tmap_operations() -> None:
    m: TMap[str, int] = TMap({"a": 1})
    assert nowait(m.get, "a") == 1
    assert nowait(m.get, "b") is None
    assert nowait(m.get, "b", 0) == 0
    nowait(m.set, "b", 2)
    assert nowait(lambda: ("b" in m, "z" in m, len(m))) == (True, False, 2)
    assert sorted(nowait(m.items)) == [("a", 1), ("b", 2)]
    snap = nowait(m.snapshot)
    assert nowait(m.delete, "a") is True
    assert nowait(m.delete, "a") is False
    assert dict(snap) == {"a": 1, "b": 2}  # a snapshot is immutable
    assert nowait(m.items) == [("b", 2)]

    def set_then_fail() -> None:
        m.set("c", 3)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        nowait(set_then_fail)
    assert "c" not in nowait(m.snapshot)


async def test_tmap_wait_for_a_key() -> None:
    m: TMap[str, int] = TMap()

    def wait_for(key: str) -> int:
        stm.check(key in m)
        value = m.get(key, 0)
        m.delete(key)
        return value

    got: list[int] = []

    async def waiter() -> None:
        got.append(await atomically(wait_for, "k"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        await atomically(m.set, "other", 1)  # wakes it; it reruns and waits again
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        await atomically(m.set, "k", 42)
    assert got == [42]
    assert nowait(m.items) == [("other", 1)]


# --- producers and consumers across trio tasks and threads --------------------------------------

PER_PRODUCER = 1000


def check_delivery(producers: list[str], consumed: list[list[tuple[str, int]]]) -> None:
    """Every item delivered exactly once, and each consumer saw each producer's items in order."""
    everything = sorted(item for items in consumed for item in items)
    assert everything == sorted((p, i) for p in producers for i in range(PER_PRODUCER))
    for items in consumed:
        for p in producers:
            seq = [i for q, i in items if q == p]
            assert seq == sorted(seq), f"{p}'s items out of order"


def test_checker_catches_planted_bugs() -> None:
    good = [[("a", i) for i in range(PER_PRODUCER)]]
    check_delivery(["a"], good)
    lost = [good[0][1:]]
    duplicated = [[*good[0], ("a", 5)]]
    swapped = [[good[0][1], good[0][0], *good[0][2:]]]
    for bad in (lost, duplicated, swapped):
        with pytest.raises(AssertionError):
            check_delivery(["a"], bad)


@pytest.mark.parametrize("make", [TQueue, lambda: TBQueue(4)], ids=["TQueue", "TBQueue"])
async def test_producers_and_consumers_in_tasks_and_threads(make) -> None:
    q = make()
    producers = ["task0", "task1", "thread"]
    remaining = TVar(len(producers) * PER_PRODUCER)

    def take_one() -> tuple[str, int] | None:
        if remaining.get() == 0:
            return None  # everything has been taken: stop
        remaining.set(remaining.get() - 1)
        item: tuple[str, int] = q.get()
        return item

    consumed: list[list[tuple[str, int]]] = [[], [], []]

    async def task_producer(name: str) -> None:
        for i in range(PER_PRODUCER):
            await atomically(q.put, (name, i))

    def thread_producer() -> None:
        for i in range(PER_PRODUCER):
            atomically_sync(q.put, ("thread", i))

    async def task_consumer(out: list[tuple[str, int]]) -> None:
        while (item := await atomically(take_one)) is not None:
            out.append(item)

    def thread_consumer(out: list[tuple[str, int]]) -> None:
        while (item := atomically_sync(take_one)) is not None:
            out.append(item)

    async def in_thread(fn: Callable[..., None], *args: object) -> None:
        await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)

    with trio.fail_after(20):  # a lost wake-up would hang: fail instead
        async with trio.open_nursery() as nursery:
            nursery.start_soon(task_consumer, consumed[0])
            nursery.start_soon(task_consumer, consumed[1])
            nursery.start_soon(in_thread, thread_consumer, consumed[2])
            nursery.start_soon(task_producer, "task0")
            nursery.start_soon(task_producer, "task1")
            nursery.start_soon(in_thread, thread_producer)
    check_delivery(producers, consumed)
    assert nowait(len, q) == 0
