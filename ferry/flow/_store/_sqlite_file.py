"""An engine's SQLite file: the one check of a path, and the engine lock that belongs to the file.

Design
------
The lock is an ``flock(LOCK_EX | LOCK_NB)`` on the database file itself (docs/adr/0065), not on
a name: whatever path reaches the file (a symlink, a hard link, a relative path), the kernel
sees one inode and one lock, and it drops the lock when the process dies, however it dies. On
Linux `flock` locks and SQLite's own POSIX (``fcntl``) locks are independent, so holding one
never blocks SQLite. Where they are not independent (the BSDs and macOS keep both kinds in one
list per file, so an exclusive `flock` would block SQLite's own locks), the lock is an `flock` on
a sidecar file beside the file's real path (``<real path>.engine-lock``): symlinks and relative
paths still meet there, hard links do not.

What is delicate is closing: POSIX locks belong to the process and the file, and closing *any*
descriptor of the file drops all of the process's POSIX locks on it, also those of SQLite
connections that are still open (SQLite's "How to corrupt" page, 2.2). So the lock's descriptor
is closed only when no other descriptor of this process refers to the file (read from
``/proc/self/fd``); until then it is kept, unlocked, in `_KEPT` and reused by the next engine on
the file, and closed by a later `release` once it is safe. The header check reads through the
same descriptor for the same reason.
"""

from __future__ import annotations

import fcntl
import os
import re
import sqlite3
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

import attrs

from ferry._text import shown

from .._model._errors import StoreLocked

#: The first bytes of every SQLite database file.
SQLITE_HEADER = b"SQLite format 3\x00"

#: Does the kernel keep `flock` and POSIX locks apart (so the lock can be on the file itself)?
ON_THE_FILE = sys.platform.startswith("linux")

_SIDECAR = ".engine-lock"

# (st_dev, st_ino) -> descriptors of that file, unlocked, kept open because closing them would
# have dropped the POSIX locks of an SQLite connection of this process. Guarded by `_KEPT_LOCK`.
_KEPT: dict[tuple[int, int], list[int]] = {}
_KEPT_LOCK = threading.Lock()


class ReadOnlyTx:
    """A `ferry.projected.Tx` over a plain SQLite connection opened read-only, for reads of a
    file outside any store (the inspector's first look, the dashboard's pages). Writes are
    refused."""

    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    @property
    def connection(self) -> sqlite3.Connection:
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, params).fetchall()

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        raise sqlite3.OperationalError("read-only")


#: What reads as a URL (``scheme://``), and as a libpq key=value DSN (a keyword, then ``=``).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_LIBPQ = re.compile(r"(?:^|\s)(?:host|hostaddr|port|dbname|user|password|sslmode|service)\s*=")


def _refuse_dsn(text: str, who: str) -> None:
    """A `ValueError` for a path that is no file but reads as a PostgreSQL DSN or another URL:
    given as a path, it would name an SQLite file in the working directory (or a missing one)."""
    url = _URL.match(text)
    where = shown(text)
    if (url is not None and url.group(1) in ("postgres", "postgresql")) or (
        url is None and _LIBPQ.search(text)
    ):
        raise ValueError(
            f"{who} got {where}, which looks like a PostgreSQL DSN, where it takes the path of"
            " an SQLite file or an open store: for PostgreSQL give it a PostgresStore, as in"
            " `async with PostgresStore(dsn) as store, flow.open_engine(store, plans=...)`"
            " (from ferry.projected import PostgresStore)"
        )
    if url is not None:
        raise ValueError(
            f"{who} got {where}, which looks like a URL (scheme {url.group(1)!r}), where it"
            " takes the path of an SQLite file (for example 'orders.db'); a PostgreSQL DSN"
            " starts with postgresql://"
            + (" (open it as a PostgresStore(dsn))" if who == "open_engine" else "")
        )


def check_path(path: object, *, who: str = "open_engine") -> str:
    """`path` as a file system path (str) if it can name an SQLite file; else a `ValueError` (or
    `TypeError`) saying what to give instead. `who` names the caller in the message.

    Refused: an empty path, ``":memory:"`` (an engine's flows must outlive the process), a
    ``file:`` URI (give the file's path), a directory. Nothing is created or opened. A path in a
    missing directory is a `FileNotFoundError` naming the directory."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{who} takes the path of an SQLite file, got {path!r}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{who} takes the path of an SQLite file as a str, got {path!r}")
    if not text:
        raise ValueError(f"{who} got an empty path: give the path of an SQLite file")
    if text == ":memory:" or text.startswith("file::memory:"):
        raise ValueError(
            f"{who} cannot use an in-memory SQLite database ({text!r}): flows must outlive the"
            " process; give the path of an SQLite file (a temporary directory's file in a test)"
        )
    if text.startswith("file:"):
        raise ValueError(
            f"{who} takes the path of an SQLite file, not a URI ({text!r}): give the file's path"
            " (for example 'orders.db'); open options are not taken"
        )
    if not os.path.exists(text):
        _refuse_dsn(text, who)
    if os.path.isdir(text):
        raise ValueError(
            f"{text!r} is a directory: give {who} the path of an SQLite file in it (for example"
            f" {os.path.join(text, 'flows.db')!r})"
        )
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"no such directory: {directory!r}, where the flow store {text!r} would be; create"
            f" the directory first, or give {who} another path"
        )
    return text


@attrs.define
class EngineLock:
    """The engine lock of one SQLite file, held from `acquire` to `release`."""

    path: str
    fd: int
    key: tuple[int, int]  # the file's (st_dev, st_ino)
    sidecar: str | None  # the sidecar's path where the lock cannot be on the file itself

    @classmethod
    def acquire(cls, path: str, *, create: bool = True) -> EngineLock:
        """Check `path` (`check_path`), create the file if missing (unless not `create`: then a
        missing file, or a symlink to nowhere, is a `FileNotFoundError` and nothing is made),
        check that it is an SQLite database (`ValueError`), and take its engine lock
        (`StoreLocked` if another engine, in this process or another, holds it). Not a
        checkpoint: a few system calls."""
        check_path(path)
        fd, key = _open(path, path, create)
        try:
            _check_header(fd, path)
            if ON_THE_FILE:
                _flock(fd, path, path)
                return cls(path, fd, key, None)
        except BaseException:
            _close(fd, key)
            raise
        sidecar = os.path.realpath(path) + _SIDECAR
        side_fd = os.open(sidecar, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _close(fd, key)
        try:
            _flock(side_fd, path, sidecar)
        except BaseException:
            os.close(side_fd)
            raise
        return cls(path, side_fd, key, sidecar)

    def release(self) -> None:
        """Let the lock go (closing its descriptor once that drops no SQLite lock of this
        process). Idempotent."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        if self.sidecar is not None:
            os.close(fd)
        else:
            _close(fd, self.key)
        _close_kept()


def _open(path: str, shown: str, create: bool = True) -> tuple[int, tuple[int, int]]:
    """A descriptor of the file at `path` (created if missing and `create`), reusing a kept
    one."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        key = (st.st_dev, st.st_ino)
        with _KEPT_LOCK:
            kept = _KEPT.get(key)
            fd = kept.pop() if kept else None
            if kept == []:
                del _KEPT[key]
        if fd is not None:
            return fd, key
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise
        raise FileNotFoundError(
            f"no flow store at {shown!r}: there is no such file (it was removed, or a symlink"
            " points nowhere), and an operator's engine never creates one"
        ) from None
    except OSError as exc:
        raise type(exc)(f"cannot open the flow store {shown!r}: {exc.strerror}") from None
    st = os.fstat(fd)
    return fd, (st.st_dev, st.st_ino)


def read_header(path: str, size: int = 100) -> bytes:
    """The first `size` bytes of the file at `path` (`OSError` if it cannot be read), read so
    that no SQLite lock of this process is dropped (the descriptor is closed only if no other
    descriptor of the process has the file open, else kept: see the module doc)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    st = os.fstat(fd)
    try:
        return os.pread(fd, size, 0)
    finally:
        _close(fd, (st.st_dev, st.st_ino))


def _check_header(fd: int, path: str) -> None:
    header = os.pread(fd, len(SQLITE_HEADER), 0)
    if header and header != SQLITE_HEADER:
        raise ValueError(
            f"{path!r} is not an SQLite database: give open_engine the path of an engine's SQLite"
            " file, or of a new file"
        )


def _flock(fd: int, path: str, held: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        where = "" if held == path else f" (it holds {held!r})"
        raise StoreLocked(
            f"another flow engine is serving {path!r} right now{where}; an SQLite file is served"
            " by one engine at a time, whatever the path it is opened by: close that one first"
        ) from None


def _others_open(ours: set[int], key: tuple[int, int]) -> bool:
    """Does a descriptor of this process other than `ours` refer to the file `key`? (True where
    that cannot be known.)"""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return True
    for name in names:
        if int(name) in ours:
            continue
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile, or the listing's own descriptor
        if (st.st_dev, st.st_ino) == key:
            return True
    return False


def _close(fd: int, key: tuple[int, int]) -> None:
    """Close `fd` (and the kept descriptors of its file) if that drops no POSIX lock of this
    process; else keep it in `_KEPT`."""
    with _KEPT_LOCK:
        kept = _KEPT.pop(key, [])
    if _others_open({fd, *kept}, key):
        with _KEPT_LOCK:
            _KEPT.setdefault(key, []).extend([*kept, fd])
        return
    for one in (fd, *kept):
        os.close(one)


def _close_kept() -> None:
    """Close the kept descriptors of files no other descriptor of this process refers to."""
    with _KEPT_LOCK:
        keys = list(_KEPT)
    for key in keys:
        with _KEPT_LOCK:
            kept = _KEPT.get(key)
            fd = kept.pop() if kept else None
        if fd is not None:
            _close(fd, key)


# ------------------------------------------------------------------ changes of the file, pushed

_IN_MODIFY = 0x2
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
_IN_CREATE = 0x100
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC


def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    if not hasattr(libc, "inotify_init1"):
        return None
    return libc


class Written:
    """A descriptor that becomes readable when any process writes the SQLite file at `path`
    (in WAL mode every commit writes its ``-wal`` file; a checkpoint writes the file): Linux's
    inotify on the file and its ``-wal``, no timer, nothing read from the database. `fileno` is
    None where inotify is missing (not Linux): the caller then reads ``PRAGMA data_version`` on
    a timer instead.

    An event says only "written": the caller looks (``data_version``, then its rows) to find
    out what. `drain` empties the queue of events and says whether one was the store's;
    `close` closes the descriptor."""

    def __init__(self, path: str) -> None:
        self._fd: int | None = None
        real = os.path.realpath(path)
        self._wal = os.fsencode(real + "-wal")
        self._wal_name = os.path.basename(self._wal)
        libc = _libc() if sys.platform.startswith("linux") else None
        self._libc: Any = libc
        if libc is None:
            return
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return
        # The file and its -wal (writes), and the directory for the -wal's creation only (the
        # last connection to close removes it; it is watched again once made): the other
        # files of the directory wake nobody.
        self._dir_wd = libc.inotify_add_watch(fd, os.fsencode(os.path.dirname(real)), _IN_CREATE)
        if self._dir_wd < 0 or libc.inotify_add_watch(fd, os.fsencode(real), _IN_MODIFY) < 0:
            os.close(fd)
            return
        libc.inotify_add_watch(fd, self._wal, _IN_MODIFY)  # missing until a connection makes it
        self._fd = fd

    def fileno(self) -> int | None:
        return self._fd

    def drain(self) -> bool:
        """Read every event queued (never blocks); True if one was a write of the file or of
        its ``-wal``, or the ``-wal``'s creation."""
        if self._fd is None:
            return False
        ours = False
        try:
            while True:
                data = os.read(self._fd, 65536)
                if not data:
                    break
                at = 0
                while at + _EVENT.size <= len(data):
                    wd, _mask, _cookie, size = _EVENT.unpack_from(data, at)
                    name = data[at + _EVENT.size : at + _EVENT.size + size].rstrip(b"\0")
                    at += _EVENT.size + size
                    if wd != self._dir_wd:
                        ours = True  # the file or its -wal was written
                    elif name == self._wal_name:  # the -wal made anew: watch it
                        self._libc.inotify_add_watch(self._fd, self._wal, _IN_MODIFY)
                        ours = True
        except BlockingIOError:
            pass
        return ours

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
