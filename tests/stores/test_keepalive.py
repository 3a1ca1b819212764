"""Every connection to PostgreSQL asks the kernel to watch it (docs/adr/0106): a peer that
vanished without a word is noticed within about a minute, not after the system's hours.

The options are read back from the sockets themselves (``getsockopt``), for the store's
connections and for a fleet engine's lease and wait-listener connections."""

from __future__ import annotations

import ast
import os
import socket
from pathlib import Path

import trio

import stm
from ferry import flow
from ferry.flow._fleet._mode import Fleet
from ferry.projected import PostgresStore
from ferry.projected._postgres import KEEPALIVE, connect
from tests import pg

ROOT = Path(__file__).resolve().parents[2]


def watched(fd: int) -> tuple[int, int, int, int, int]:
    """The keepalive options of the TCP socket `fd`: on, idle s, interval s, count, user
    timeout ms."""
    s = socket.socket(fileno=os.dup(fd))
    try:
        return (
            s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        )
    finally:
        s.close()


def to_server(port: int) -> list[int]:
    """This process's open TCP sockets connected to `port` on 127.0.0.1."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # not a socket
        try:
            tcp = s.family == socket.AF_INET and s.type == socket.SOCK_STREAM
            if tcp and s.getpeername() == ("127.0.0.1", port):
                found.append(fd)
        except OSError:
            pass  # a socket that is not connected: not ours to check
        finally:
            s.close()
    return found


DEFAULTS = (1, 30, 10, 3, 60_000)


def test_a_connection_is_watched_unless_its_dsn_says_otherwise(pg_server: pg.PgServer) -> None:
    with connect(pg_server.dsn) as conn:
        assert watched(conn.fileno()) == DEFAULTS
    with connect(f"{pg_server.dsn} keepalives_idle=7 tcp_user_timeout=5000") as conn:
        assert watched(conn.fileno()) == (1, 7, 10, 3, 5000)
    with connect(pg_server.dsn, keepalives_count=9) as conn:  # an argument wins too
        assert watched(conn.fileno())[3] == 9
    assert set(KEEPALIVE) == {
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
    }


async def test_every_connection_of_a_fleet_engine_is_watched(pg_server: pg.PgServer) -> None:
    plan = flow.Plan("held")
    gate = trio.Event()

    @plan.step
    async def hold(ctx: flow.Context) -> None:
        await gate.wait()

    dsn = pg_server.fresh_schema_dsn()
    before = set(to_server(pg_server.port))
    async with (
        PostgresStore(dsn, connections=2) as store_a,
        flow.open_engine(store_a, [plan], owner="a", lease=2.0) as a,
        PostgresStore(dsn, connections=2) as store_b,
        flow.open_engine(store_b, [plan], owner="b", lease=2.0) as b,
    ):
        fid = await a.start(plan)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.wait, fid)  # a flow another engine runs: b listens
            await trio.testing.wait_all_tasks_blocked()
            listening = b._waiters._listening
            await stm.atomically(lambda: None if listening.get() else stm.retry())
            for engine in (a, b):  # the lease threads connect at their first renewal
                mode = engine._parts.mode
                assert isinstance(mode, Fleet)
                keeper = mode.lease._keeper
                assert keeper is not None
                with trio.fail_after(30):
                    while keeper.renewals == 0:  # noqa: ASYNC110 - a thread's counter
                        await trio.sleep(0.05)
            fds = [fd for fd in to_server(pg_server.port) if fd not in before]
            # each engine's pool and lease connections, and b's listener connection
            assert len(fds) >= 5
            lease_ms = max(1000, round(1000 * 2.0))  # the engines' lease
            timeouts = []
            for fd in fds:
                options = watched(fd)
                assert options[:4] == DEFAULTS[:4], fd
                timeouts.append(options[4])
            # the lease connections give up after a lease, the others after a minute
            assert set(timeouts) == {DEFAULTS[4], lease_ms}, timeouts
            gate.set()
            await a.wait(fid, timeout=30)


def test_the_package_connects_to_postgresql_in_one_place() -> None:
    """`psycopg.connect` is called only by `_postgres.connect`: no connection goes unwatched."""
    calls = []
    for path in (ROOT / "ferry").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "connect"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "psycopg"
            ):
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == ["ferry/projected/_postgres.py:" + calls[0].split(":")[1]], calls
    assert len(calls) == 1
