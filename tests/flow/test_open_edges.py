"""The edges at `open_engine` and in the inspector, through the public API.

- One engine per SQLite file, whatever the path (a symlink, a hard link, a relative path, an
  open `SqliteStore`); no side file; a killed process releases the lock; the lock never drops
  the POSIX locks of the SQLite connections of its process.
- ``:memory:``, a URI, a directory, an empty path: a `ValueError` saying what to pass, nothing
  created; the inspector says the same, from the same check.
- The inspector reads in read transactions (no write lock), reports no orphans on SQLite, and
  shows ids holding control characters escaped.
- Testing a saga with a mock clock, as docs/flow.md says to (`test_the_docs_saga_test`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from ferry import flow
from ferry.flow._ops import _inspect, _inspect_read
from ferry.flow._store import _sqlite_file
from ferry.projected import PostgresStore, SqliteStore
from tests import pg

ROOT = Path(__file__).resolve().parents[2]


def plan_of(*steps: Any, name: str = "p") -> flow.Plan:
    plan = flow.Plan(name)
    for i, fn in enumerate(steps):
        plan.step(name=f"s{i}")(fn)
    return plan


async def _noop(ctx: flow.Context) -> None:
    pass


@asynccontextmanager
async def engine_on(store: Any, *plans: flow.Plan) -> AsyncIterator[flow.Engine]:
    async with flow.open_engine(store, plans=list(plans)) as engine:
        yield engine


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def inspect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = _inspect.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def inspect_in_thread(*argv: str) -> tuple[int, str, str]:
    """The inspector as an operator runs it next to a live engine (its own trio run, on a thread
    of this process), its output captured."""

    def run() -> tuple[int, str, str]:
        import contextlib
        import io

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = _inspect.main(list(argv))
        return code, out.getvalue(), err.getvalue()

    return await trio.to_thread.run_sync(run)


# ------------------------------------------------------------------ one engine per file (item 1)


async def test_the_engine_lock_belongs_to_the_file_whatever_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    db = tmp_path / "flows.db"
    (tmp_path / "link.db").symlink_to(db)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    plan = plan_of(_noop)
    async with engine_on(str(db), plan) as engine:
        os.link(db, tmp_path / "hard.db")
        for other in (tmp_path / "link.db", tmp_path / "hard.db", Path("..") / "flows.db"):
            with pytest.raises(flow.StoreLocked, match="another flow engine is serving"):
                async with engine_on(str(other), plan_of(_noop)):
                    pass
        async with SqliteStore(tmp_path / "link.db") as store:
            with pytest.raises(flow.StoreLocked, match="whatever the path"):
                async with engine_on(store, plan_of(_noop)):
                    pass
        fid = await engine.start(plan)
        assert (await engine.wait(fid, timeout=10)).state is flow.State.COMPLETED
    assert files(tmp_path) == ["elsewhere", "flows.db", "hard.db", "link.db"]  # no side file
    async with engine_on(str(tmp_path / "hard.db"), plan) as engine:  # released at close
        assert (await engine.get(fid)) is not None


async def test_where_flock_would_block_sqlite_the_lock_is_beside_the_real_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    # macOS and the BSDs keep flock and POSIX locks in one list: there the lock is an flock on
    # a sidecar beside the file's real path (symlinks and relative paths meet there).
    monkeypatch.setattr(_sqlite_file, "ON_THE_FILE", False)
    db = tmp_path / "flows.db"
    (tmp_path / "link.db").symlink_to(db)
    async with engine_on(str(db), plan_of(_noop)):
        with pytest.raises(flow.StoreLocked, match=r"flows\.db\.engine-lock"):
            async with engine_on(str(tmp_path / "link.db"), plan_of(_noop)):
                pass
    async with engine_on(str(tmp_path / "link.db"), plan_of(_noop)):
        pass
    assert files(tmp_path) == ["flows.db", "flows.db.engine-lock", "link.db"]


def _posix_locks(path: Path) -> set[tuple[str, str, str]]:
    """The POSIX (fcntl) locks this process holds on `path`'s file (Linux: /proc/locks), as
    (kind, first byte, last byte)."""
    ino = os.stat(path).st_ino
    mine = set()
    with open("/proc/locks") as table:
        for line in table:
            fields = line.split()
            if "->" in fields:
                continue  # a waiter
            ours = fields[1] == "POSIX" and int(fields[4]) == os.getpid()
            if ours and fields[5].rsplit(":", 1)[1] == str(ino):
                mine.add((fields[3], fields[6], fields[7]))
    return mine


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/locks")
async def test_an_engine_on_an_open_store_leaves_its_sqlite_locks_in_place(
    tmp_path: Path,
) -> None:
    # Closing any descriptor of a file drops the process's POSIX locks on it, also those of the
    # SQLite connections of an `SqliteStore` that stays open (in WAL mode, each keeps a shared
    # lock for as long as it is open). Neither opening an engine on it nor closing one may.
    db = tmp_path / "flows.db"
    plan = plan_of(_noop)
    async with SqliteStore(db, connections=1) as store:
        await store.transact(lambda tx: tx.execute("CREATE TABLE mine (x)"))
        held = _posix_locks(db)
        assert held, "an open WAL connection holds a shared lock"
        async with engine_on(store, plan) as engine:
            assert _posix_locks(db) == held
            await engine.wait(await engine.start(plan), timeout=10)
        assert _posix_locks(db) == held
    async with engine_on(str(db), plan):  # the kept descriptor is reused, then closed
        pass
    assert _posix_locks(db) == set()


_HOLDER = """
import sys, trio
from ferry import flow

async def main(path):
    plan = flow.Plan("p")

    @plan.step()
    async def s(ctx):
        pass

    async with flow.open_engine(path, plans=[plan]):
        print("open", flush=True)
        await trio.sleep_forever()

trio.run(main, sys.argv[1])
"""


def test_a_killed_engine_process_releases_the_lock(tmp_path: Path) -> None:
    db = tmp_path / "flows.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "link.db")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    (tmp_path / "link.db").symlink_to(db)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"

        async def open_one() -> None:
            async with engine_on(str(db), plan_of(_noop)):
                pass

        with pytest.raises(flow.StoreLocked):
            trio.run(open_one)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()
    trio.run(open_one)  # the kernel released it with the process


# -------------------------------------------------------------- what open_engine refuses (item 2)


@pytest.mark.parametrize(
    ("path", "says"),
    [
        (":memory:", "cannot use an in-memory SQLite database (':memory:'): flows must outlive"),
        ("file::memory:?cache=shared", "cannot use an in-memory SQLite database"),
        ("file:flows.db?mode=rwc", "not a URI ('file:flows.db?mode=rwc'): give the file's path"),
        ("", "got an empty path: give the path of an SQLite file"),
        (".", "'.' is a directory: give open_engine the path of an SQLite file in it"),
    ],
)
async def test_paths_that_cannot_be_an_engines_file_are_a_value_error_and_leave_nothing(
    path: str,
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as caught:
        async with engine_on(path, plan_of(_noop)):
            pass
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert files(tmp_path) == []
    # the inspector refuses it with the same words (one check), as one line
    code, out, err = await trio.to_thread.run_sync(lambda: inspect(capsys, path, "list"))
    assert (code, out) == (1, "")
    assert err.startswith(f"{_inspect_read.PROG}: error: ") and err.count("\n") == 1
    assert says.replace("open_engine", _inspect_read.PROG) in err
    assert files(tmp_path) == []


# --------------------------------------------------------------- the inspector's reads (item 3)


def _fill(path: Path, n: int) -> None:
    async def main() -> None:
        plan = plan_of(_park)
        async with engine_on(str(path), plan) as engine:
            for i in range(n):
                await engine.start(plan, flow_id=f"f{i}")
            await trio.testing.wait_all_tasks_blocked()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def _park(ctx: flow.Context) -> flow.Outcome:
    return flow.park(None)


def test_the_inspector_reads_while_another_connection_holds_a_write_transaction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "flows.db"
    _fill(db, 3)
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # an engine's batch, say, holding SQLite's write lock
    writer.execute("UPDATE flow_flows SET error = 'x' WHERE flow_id = 'f0'")
    try:
        for command in (["list"], ["show", "f1"], ["stats"]):
            code, out, err = inspect(capsys, str(db), *command, "--json")
            assert (code, err) == (0, "") and json.loads(out), command
        assert {
            f["flow_id"] for f in json.loads(inspect(capsys, str(db), "list", "--json")[1])["flows"]
        } == {
            "f0",
            "f1",
            "f2",
        }
        assert writer.in_transaction  # and the writer was never in its way
    finally:
        writer.execute("ROLLBACK")
        writer.close()


async def test_a_read_only_transaction_refuses_writes_and_the_next_one_may_write(
    tmp_path: Path,
) -> None:
    async with SqliteStore(tmp_path / "x.db", connections=1) as store:
        await store.transact(lambda tx: tx.execute("CREATE TABLE t (x)"))
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            await store.transact(lambda tx: tx.execute("INSERT INTO t VALUES (1)"), read_only=True)
        await store.transact(lambda tx: tx.execute("INSERT INTO t VALUES (2)"))
        rows = await store.transact(lambda tx: tx.execute("SELECT x FROM t"), read_only=True)
        assert rows == [(2,)]


def test_a_read_only_transaction_on_postgres(pg_server: pg.PgServer) -> None:
    async def main() -> None:
        async with PostgresStore(pg_server.fresh_schema_dsn(), connections=1) as store:
            ro = await store.transact(
                lambda tx: tx.execute("SHOW transaction_read_only"), read_only=True
            )
            rw = await store.transact(lambda tx: tx.execute("SHOW transaction_read_only"))
            assert (ro, rw) == ([("on",)], [("off",)])

    trio.run(main)


# ------------------------------------------------------------------ no orphans on SQLite (item 4)


async def test_an_sqlite_engine_running_flows_has_no_orphans(tmp_path: Path) -> None:
    db = tmp_path / "flows.db"
    go = trio.Event()

    async def slow(ctx: flow.Context) -> None:
        await go.wait()

    plan = plan_of(slow)
    async with engine_on(str(db), plan) as engine:
        for i in range(3):
            await engine.start(plan, flow_id=f"r{i}")
        await trio.testing.wait_all_tasks_blocked()
        code, out, err = await inspect_in_thread(str(db), "stats", "--json")
        assert code == 0, err
        stats = json.loads(out)
        assert stats["states"]["RUNNING"] == 3 and stats["orphans"] == 0
        code, out, _ = await inspect_in_thread(str(db), "show", "r0")
        assert code == 0 and "lapsed" not in out and "engine that holds the file runs it" in out
        go.set()


# ------------------------------------------------------------ ids shown safely (item 14, the rest)

ODD_IDS = ["two\nlines", "a\ttab", "\x1b[31mred\x1b[0m", "bell\x07", "rtl\u202eevil"]


def test_ids_with_control_characters_are_shown_escaped_and_exact_in_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "flows.db"

    async def main() -> None:
        plan = plan_of(_park)
        async with engine_on(str(db), plan) as engine:
            for fid in ODD_IDS:
                await engine.start(plan, flow_id=fid)
            await trio.testing.wait_all_tasks_blocked()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    code, out, _ = inspect(capsys, str(db), "list")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 2 + len(ODD_IDS)
    assert all(line.isprintable() for line in lines)
    assert {line.split("  ")[0].rstrip() for line in lines[2:]} == {repr(f) for f in ODD_IDS}
    widths = {len(line.split(" PARKED ")[0]) for line in lines[2:]}
    assert len(widths) == 1  # the columns line up
    listed = json.loads(inspect(capsys, str(db), "list", "--json")[1])["flows"]
    assert sorted(f["flow_id"] for f in listed) == sorted(ODD_IDS)  # exact
    for fid in ODD_IDS:
        code, out, _ = inspect(capsys, str(db), "show", fid)
        assert code == 0 and out.splitlines()[0] == f"flow      {fid!r}"
        assert all(line.isprintable() for line in out.splitlines())
        assert json.loads(inspect(capsys, str(db), "show", fid, "--json")[1])["flow"][
            "flow_id"
        ] == (fid)


# ------------------------------------------------------------- testing with a mock clock (5.3.3)


def _docs_block(title: str) -> str:
    text = (ROOT / "docs" / "flow.md").read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return str(block)


def test_the_docs_saga_test(tmp_path: Path) -> None:
    """docs/flow.md's "Testing your sagas" example, run as it is written there: an hour-long park
    and a 30-minute `wait` timeout under a mock clock, through `open_engine(path)`."""
    code = _docs_block("11. Testing your sagas")
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    exec(compile(code, "docs/flow.md", "exec"), namespace)
    tests = sorted(name for name in namespace if name.startswith("test_"))
    assert tests == ["test_a_confirmation_ships_the_order", "test_no_confirmation_refunds"]
    for name in tests:
        (tmp_path / name).mkdir()
        namespace[name](tmp_path / name)


async def test_time_never_jumps_while_a_transaction_is_in_flight(
    tmp_path: Path, autojump_clock: Any
) -> None:
    async def step(ctx: flow.Context) -> None:
        ctx.data["n"] = ctx.data.get("n", 0) + 1

    plan = plan_of(step, step, step)
    for store in (str(tmp_path / "a.db"), SqliteStore(tmp_path / "b.db")):
        async with engine_on(store, plan) as engine:
            start = trio.current_time()
            fids = [await engine.start(plan) for _ in range(5)]
            for fid in fids:
                # Nothing in the flow waits for time: with a transaction on a worker thread the
                # mock clock would jump to this deadline and `wait` would raise TooSlowError.
                snap = await engine.wait(fid, timeout=60)
                assert snap.state is flow.State.COMPLETED and snap.data == {"n": 3}
            assert trio.current_time() == start
        if isinstance(store, SqliteStore):
            await store.aclose()
