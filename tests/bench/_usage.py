"""What a benchmark interval used, for notes that say what limited a figure: the engines' CPU,
the database server's CPU, other work on the machine, or the server's WAL fsyncs.

`Meter.start()` then `Meter.stop()` gives, over the interval: the CPU seconds the given
processes used; those of a PostgreSQL server (its postmaster, every backend, and the backends
that exited meanwhile, which the postmaster's children's counters keep); the busy CPU seconds
of the whole machine (all read from /proc: NaN outside Linux); and, given a connection to a
server started with ``track_wal_io_timing=on`` (`TIMING`), its WAL fsyncs and the time they
took (``pg_stat_wal``; backends report theirs at most once a second, so these are close, not
exact).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import attrs
import psycopg

TIMING = ("track_wal_io_timing=on",)  # server settings for the WAL fsync figures
_TICK = os.sysconf("SC_CLK_TCK")


def _fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3 onwards), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def process_cpu(pid: int, *, children: bool = False) -> float:
    """CPU seconds used by `pid` (user + system); with `children`, plus its exited children
    it waited for. NaN if there is no such process."""
    f = _fields(pid)
    if f is None:
        return math.nan
    ticks = int(f[11]) + int(f[12])  # utime, stime (fields 14, 15)
    if children:
        ticks += int(f[13]) + int(f[14])  # cutime, cstime
    return ticks / _TICK


def server_cpu(postmaster: int | None) -> float:
    """CPU seconds of a PostgreSQL server: the postmaster, its exited children, its live ones
    (0 without a server)."""
    if postmaster is None:
        return 0.0
    total = process_cpu(postmaster, children=True)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            f = _fields(int(entry.name))
            if f is not None and int(f[1]) == postmaster:  # ppid (field 4)
                total += (int(f[11]) + int(f[12])) / _TICK
    return total


def machine_busy() -> float:
    """CPU seconds the whole machine has spent not idle (all cores), since boot."""
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return math.nan
    idle = cpu[3] + cpu[4]  # idle, iowait
    return (sum(cpu[:8]) - idle) / _TICK  # guest time is already counted in user


def wal_syncs(conn: psycopg.Connection | None) -> tuple[float, float]:
    """The server's WAL fsyncs since its start and their seconds (NaN without `conn`)."""
    if conn is None:
        return math.nan, math.nan
    row = conn.execute("SELECT wal_sync, wal_sync_time FROM pg_stat_wal").fetchone()
    assert row is not None
    return float(row[0]), float(row[1]) / 1000


def postmaster_of(backend: int) -> int:
    """The postmaster's pid, from one of its backends' (``SELECT pg_backend_pid()``)."""
    f = _fields(backend)
    if f is None:
        raise RuntimeError(f"no process {backend}: is the server on another machine?")
    return int(f[1])


@attrs.frozen
class Used:
    """What an interval of `wall` seconds used."""

    wall: float
    processes: float  # CPU seconds of the processes given to the meter
    server: float  # CPU seconds of the database server
    machine: float  # CPU seconds of every process on the machine, these included
    fsyncs: float  # the server's WAL fsyncs
    fsync_seconds: float  # the time they took

    @property
    def others(self) -> float:
        return self.machine - self.processes - self.server

    def note(self, flows: int) -> str:
        """Per flow, CPU of the engines and of the server; the machine's busy cores, and how
        much of that was other work; the fsyncs per flow, how long each, how busy."""
        cores = os.cpu_count() or 1

        def ms(s: float) -> str:
            return f"{s / flows * 1000:.1f} ms"

        text = (
            f"CPU/flow: engines {ms(self.processes)}, PostgreSQL {ms(self.server)};"
            f" cores busy {self.machine / self.wall:.1f} of {cores}"
            f" ({self.others / self.wall:.1f} other work)"
        )
        if self.fsyncs > 0:
            text += (
                f"; {self.fsyncs / flows:.2f} WAL fsyncs/flow of"
                f" {self.fsync_seconds / self.fsyncs * 1000:.1f} ms,"
                f" fsyncing {self.fsync_seconds / self.wall:.0%} of the time"
            )
        return text


@attrs.define
class Meter:
    """What `pids`, the server whose postmaster is `postmaster` (its WAL fsyncs read through
    `conn`, if given) and the machine use from `start` to `stop`."""

    pids: Sequence[int]
    postmaster: int | None
    conn: psycopg.Connection | None = None
    _at: tuple[float, ...] | None = None

    def _now(self) -> tuple[float, ...]:
        return (
            time.perf_counter(),
            sum(process_cpu(p) for p in self.pids),
            server_cpu(self.postmaster),
            machine_busy(),
            *wal_syncs(self.conn),
        )

    def start(self) -> None:
        self._at = self._now()

    def stop(self) -> Used:
        assert self._at is not None, "stop() before start()"
        d = [b - a for a, b in zip(self._at, self._now(), strict=True)]
        return Used(*d)
