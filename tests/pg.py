"""A throwaway PostgreSQL server for tests: initdb + pg_ctl in a temp dir, trust auth on loopback.

`acquire()` starts the one server of this test session (or returns it), `release()` stops and
removes it when the last user is done; any conftest can wrap them in a session fixture, and they
share one server. `PgServer.fresh_schema_dsn()` gives a DSN whose connections live in a new,
empty schema (``search_path``), which isolates one test from another at the cost of one
``CREATE SCHEMA``.

When running as root (CI), the server runs as the ``postgres`` system user if there is one, else
``nobody``, through ``runuser`` (or ``setpriv``). If initdb/pg_ctl are not on PATH or in
/usr/lib/postgresql/*/bin, `find_binaries()` returns None and tests skip with `SKIP_REASON`.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Sequence

import attrs

SKIP_REASON = (
    "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or in "
    "/usr/lib/postgresql/*/bin; install them (Debian/Ubuntu: apt-get install -y postgresql) "
    "to run the PostgreSQL store tests"
)


def find_binaries() -> str | None:
    """The directory holding initdb and pg_ctl, or None."""
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return os.path.dirname(os.path.realpath(initdb))
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(os.path.join(d, "initdb"), os.X_OK):
            return d
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _as_user(cmd: Sequence[str], user: str | None) -> list[str]:
    if user is None:
        return list(cmd)
    if shutil.which("runuser"):
        return ["runuser", "-u", user, "--", *cmd]
    entry = pwd.getpwnam(user)
    return [
        "setpriv",
        f"--reuid={entry.pw_uid}",
        f"--regid={entry.pw_gid}",
        "--clear-groups",
        *cmd,
    ]


@attrs.define
class PgServer:
    """A running server: `dsn` connects to database ``postgres`` as superuser ``postgres``."""

    bindir: str
    root: str
    port: int
    user: str | None
    _counter: itertools.count[int] = attrs.field(factory=itertools.count)
    options: str = ""  # the server's -o options (for `resume`)

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def fresh_schema_dsn(self, prefix: str = "t") -> str:
        """Create an empty schema and return a DSN whose search_path is that schema."""
        import psycopg

        name = f"{prefix}_{os.getpid()}_{next(self._counter)}"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        return f"{self.dsn} options='-c search_path={name}'"

    def fresh_database_dsn(self, prefix: str = "db") -> str:
        """Create an empty database and return its DSN (heavier than a schema)."""
        import psycopg

        name = f"{prefix}_{os.getpid()}_{next(self._counter)}"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={name}"

    def halt(self) -> None:
        """Stop the server at once, as a crash would (connections drop, nothing is flushed);
        its data directory stays, for `resume`."""
        self._pg_ctl("stop", "-D", self.data, "-m", "immediate")

    def resume(self) -> None:
        """Start a halted server again on the same port and data (it recovers on start)."""
        self._pg_ctl("start", "-D", self.data, "-w", "-t", "60", "-l", self.log, "-o", self.options)

    def _pg_ctl(self, *args: str) -> None:
        done = subprocess.run(
            _as_user([os.path.join(self.bindir, "pg_ctl"), *args], self.user),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl {args[0]} failed:\n{done.stdout}\n{done.stderr}")

    @property
    def log(self) -> str:
        return os.path.join(self.root, "log")

    def stop(self) -> None:
        subprocess.run(
            _as_user(
                [os.path.join(self.bindir, "pg_ctl"), "stop", "-D", self.data, "-m", "immediate"],
                self.user,
            ),
            check=False,
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=60,
        )
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def data(self) -> str:
        return os.path.join(self.root, "data")


def start(bindir: str, settings: Sequence[str] = ()) -> PgServer:
    """initdb and start a server in a new temp dir; raise RuntimeError with its log on failure.

    `settings` are more ``name=value`` server settings, after (and over) the test defaults, e.g.
    ``["fsync=on", "synchronous_commit=on"]`` for a server whose commits are durable."""
    user: str | None = None
    if os.geteuid() == 0:
        for candidate in ("postgres", "nobody"):
            try:
                pwd.getpwnam(candidate)
            except KeyError:
                continue
            user = candidate
            break
    root = tempfile.mkdtemp(prefix="ferry-pg-")
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    os.chmod(root, 0o700)
    server = PgServer(bindir, root, _free_port(), user)

    def run(*cmd: str) -> None:
        done = subprocess.run(
            _as_user(cmd, user),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            cwd=root,
            timeout=120,
        )
        if done.returncode != 0:
            log = ""
            logfile = os.path.join(root, "log")
            if os.path.exists(logfile):
                with open(logfile) as f:
                    log = f.read()
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError(f"{cmd[0]} failed:\n{done.stdout}\n{done.stderr}\n{log}")

    run(
        os.path.join(bindir, "initdb"),
        "-D",
        server.data,
        "-U",
        "postgres",
        "--auth=trust",
        "--no-sync",
        "--no-instructions",
        "-E",
        "UTF8",
    )
    # The port was free when picked, but another process (an xdist worker starting its own
    # server, any client's ephemeral port) may take it before the server binds it: then a new port.
    for attempt in itertools.count(1):
        server.options = _options(server.port, root, settings)
        try:
            server.resume()
        except RuntimeError as e:
            log = ""
            if os.path.exists(server.log):
                with open(server.log) as f:
                    log = f.read()
                os.remove(server.log)
            if attempt < _PORT_ATTEMPTS and "could not bind" in log:
                server.port = _free_port()
                continue
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError(f"{e}\n{log}") from e
        return server
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 5


def _options(port: int, root: str, settings: Sequence[str]) -> str:
    return " ".join(
        [
            f"-p {port}",
            "-c listen_addresses=127.0.0.1",
            f"-c unix_socket_directories={root}",
            "-c fsync=off",
            "-c synchronous_commit=off",
            "-c full_page_writes=off",
            "-c max_connections=200",
            "-c shared_buffers=32MB",
            *(f"-c {setting}" for setting in settings),
        ]
    )


_lock = threading.Lock()
_server: PgServer | None = None
_users = 0


def acquire() -> PgServer | None:
    """The session's server, started on first use; None if the binaries are missing."""
    global _server, _users
    with _lock:
        if _server is None:
            bindir = find_binaries()
            if bindir is None:
                return None
            _server = start(bindir)
        _users += 1
        return _server


def release() -> None:
    """Drop one use; the last one stops the server and removes its directory."""
    global _server, _users
    with _lock:
        _users -= 1
        if _users == 0 and _server is not None:
            _server.stop()
            _server = None
