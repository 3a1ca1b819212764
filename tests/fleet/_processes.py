"""Engine processes for the fleet's process tests: one handle (`EngineProcess`: its stdout a pipe
read line by line, its stderr a log file, killed with the test), the fixture's spawn-and-reap
(`spawning`), a bounded wait (`until`), and the reads of `_edge_engine`'s tables."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from ._flows import ROOT, _die_with_parent, query

P = TypeVar("P", bound="EngineProcess")


class EngineProcess:
    """One engine process: ``python -m MODULE ARGS`` from the checkout, stdout a pipe, stderr a
    log file in `workdir`; it dies with the test's process."""

    def __init__(self, workdir: Path, owner: str, module: str, args: Sequence[str]) -> None:
        self.owner = owner
        self.logfile = workdir / f"{owner}.{time.monotonic_ns()}.log"
        self.stats: dict[str, Any] = {}
        with open(self.logfile, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                preexec_fn=_die_with_parent,
            )

    def line(self, timeout: float = 60.0) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"{self.owner} said nothing for {timeout} s: {self.log()}"
        return self.proc.stdout.readline()

    def ready(self) -> None:
        line = self.line()
        assert line == "ready\n", f"{self.owner}: {line!r} {self.log()}"

    def stop(self) -> dict[str, Any]:
        """SIGCONT (if stopped), SIGTERM; its statistics (also kept in `stats`)."""
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        line = self.line()
        assert line.startswith("stats "), f"{self.owner}: {line!r} {self.log()}"
        self.stats = json.loads(line[6:])
        self.proc.wait(timeout=30)
        return self.stats

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)  # reaped: its process id is gone

    def log(self) -> str:
        return self.logfile.read_text(errors="replace")[-3000:]


@contextmanager
def spawning(make: Callable[..., P]) -> Iterator[Callable[..., P]]:
    """A fixture's spawn function: ``make(owner, *options)``; every process it made is killed
    and reaped at the end."""
    started: list[P] = []

    def spawn(owner: str, *options: str) -> P:
        e = make(owner, *options)
        started.append(e)
        return e

    yield spawn
    for e in started:
        if e.proc.poll() is None:
            e.proc.kill()
            e.proc.wait()
        if e.proc.stdout is not None:
            e.proc.stdout.close()


def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


class EdgeEngine(EngineProcess):
    """One engine process of `_edge_engine` on the fleet at `dsn`, named `owner` (its stdout a
    pipe, its stderr a log file, as every `EngineProcess`)."""

    def __init__(self, workdir: Path, dsn: str, owner: str, *options: str) -> None:
        args = [dsn, "--owner", owner, *options]
        super().__init__(workdir, owner, "tests.fleet._edge_engine", args)


def edge_runs(dsn: str) -> list[tuple[str, str, int, str]]:
    """The step bodies `_edge_engine` recorded, sorted."""
    return sorted(tuple(r) for r in query(dsn, "SELECT * FROM edge_runs"))


def states(dsn: str) -> dict[str, str]:
    return dict(query(dsn, "SELECT flow_id, state FROM flow_flows"))


def all_completed(dsn: str, n: int) -> Callable[[], bool]:
    return lambda: list(states(dsn).values()).count("COMPLETED") == n
