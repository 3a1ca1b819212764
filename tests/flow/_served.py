"""A service in a process of its own, for the tests of clients in other processes
(`tests/flow/test_client_from_another_process.py`).

``python -m tests.flow._served STORE OWNER`` (STORE: an SQLite path or a PostgreSQL DSN) opens
an engine serving the store with the plans below and a mapper of the ``paid`` event, prints
``ready`` once it is open, and closes cleanly when its stdin closes (or dies when killed).

`order`: ``pay`` parks until a wake, ``ship`` ends it; its compensation of ``pay`` is recorded;
each step emits a value and sets the event ``status``.
`stuck`: ``reserve`` whose compensation always raises, then ``charge`` that fails: the flow
ends ``BLOCKED`` (a compensation that can never succeed).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import trio

from ferry import flow
from ferry.projected import PostgresStore

ROOT = Path(__file__).resolve().parents[2]

order = flow.Plan("order", version=1)


async def _refund(ctx: flow.Context) -> None:
    ctx.data["refunded"] = True


@order.step(compensate=_refund)
async def pay(ctx: flow.Context) -> flow.Outcome:
    ctx.emit({"step": "pay"})
    ctx.set_event("status", "awaiting payment")
    return flow.park(timeout=3600)


@order.step
async def ship(ctx: flow.Context) -> None:
    ctx.data["shipped"] = ctx.wake
    ctx.emit({"step": "ship", "paid": ctx.wake})
    ctx.set_event("status", "shipped")


stuck = flow.Plan("stuck", version=1)


async def _release(ctx: flow.Context) -> None:
    raise ConnectionError("the stock service is gone for good")


@stuck.step(compensate=_release, attempts=1)
async def reserve(ctx: flow.Context) -> None:
    ctx.data["reserved"] = True


@stuck.step
async def charge(ctx: flow.Context) -> flow.Outcome:
    return flow.fail("card declined")


def _paid(event: object) -> flow.Wake | None:
    assert isinstance(event, dict)
    return flow.Wake(str(event["order"]), event, message_id=str(event["id"]))


async def _serve(store: object, owner: str) -> None:
    async with flow.open_engine(store, plans=[order, stuck], owner=owner) as engine:  # type: ignore[arg-type]
        engine.on("paid", _paid)
        if isinstance(store, str):  # its heartbeat is written by a thread: once it is there
            while not _beating(store, owner):  # noqa: ASYNC110 (another thread's write)
                await trio.sleep(0.005)
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


def _beating(path: str, owner: str) -> bool:
    conn = sqlite3.connect(path)
    try:
        return bool(conn.execute("SELECT 1 FROM flow_engines WHERE owner = ?", (owner,)).fetchall())
    finally:
        conn.close()


async def main(spec: str, owner: str) -> None:
    if "=" in spec or spec.startswith("postgres"):
        async with PostgresStore(spec) as store:
            await _serve(store, owner)
    else:
        await _serve(spec, owner)


def start(spec: str, owner: str = "svc") -> subprocess.Popen[str]:
    """A child serving `spec`, once it said ``ready`` (its stdin is its off switch)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.flow._served", spec, owner],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if line.strip() != "ready":
        kill(child)
        raise AssertionError(f"the service did not open: {line!r}")
    return child


def stop(child: subprocess.Popen[str]) -> None:
    """Close the child's engine cleanly (its stdin closes) and wait for it."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.close()
    try:
        assert child.wait(timeout=30) == 0
    finally:
        child.stdout.close()


def kill(child: subprocess.Popen[str]) -> None:
    """SIGKILL the child (its engine leaves everything as it was) and wait for it."""
    assert child.stdin is not None and child.stdout is not None
    child.kill()
    child.wait()
    child.stdin.close()
    child.stdout.close()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2])
