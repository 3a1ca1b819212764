"""Instructions per operation on the ferry's hot paths, counted by callgrind.

Wall-clock figures on a shared 2-core machine move by 20 to 50% from run to run; an instruction
count does not depend on the load, so A/B decisions (ADR 0033) are taken on these.

    python -m tests.bench.instructions [--src DIR] [WORKLOAD[=N] ...]

runs each workload under `valgrind --tool=callgrind` twice, with 0 operations and with N, and
prints (instructions of the N run - those of the 0 run) / N: the marginal cost of one operation,
start-up and imports excluded, garbage collection included as it comes. `--src DIR` puts DIR
first on the path, so that the `ferry` and `stm` of another commit are measured with this
workload (`git archive COMMIT ferry stm | tar -x -C DIR`). Hash seed fixed; trio's scheduler
still draws its own randomness, so counts vary by a fraction of a percent between runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import trio

import ferry
from ferry import _lanes
from ferry._room import Room
from tests.bench import bench_ferry as b

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def _scope(n: int) -> float:
    """One cancel scope created, entered and left: what a direct call pays to be cancellable."""
    for _ in range(n):
        with trio.CancelScope():  # noqa: ASYNC100  (its cost is the point)
            pass
    return 0.0


async def _checkpoint(n: int) -> float:
    """`checkpoint_if_cancelled` then `cancel_shielded_checkpoint`: a checkpoint in two halves."""
    for _ in range(n):
        await trio.lowlevel.checkpoint_if_cancelled()
        await trio.lowlevel.cancel_shielded_checkpoint()
    return 0.0


async def _claim_release(n: int) -> float:
    """A direct call's two room transactions (claim, release) on an idle per-key ferry."""
    async with ferry.open_per_key_ferry(b.io_call, key=lambda x: x) as f:
        room: Any = f._shell.room
        for i in range(n):
            room.admit(i, None, 1.0, None, 0.0)
            room.release(i, 0.0, False)
    return 0.0


_PLAIN_LIMITS = _lanes.Limits(max_batch_size=100, max_queueing=10**9, one_in_flight=False)


async def _room_admit(n: int) -> float:
    """The plain ferry's admission transaction (`Room.admit`), a batch taken every 100 inputs."""
    room: Room[Any, Any] = Room(_PLAIN_LIMITS)
    for i in range(n):
        room.admit(None, i, 1.0, None, 0.0)
        if i % 100 == 99:
            room.take(0.0)
            room.release(None, 0.0, False)
    return 0.0


async def _pure_admit(n: int) -> float:
    """The pure transition alone (`_lanes.admit`), a batch taken every 100 inputs."""
    state = _lanes.empty(_PLAIN_LIMITS)
    for i in range(n):
        state, _, _ = _lanes.admit(state, None, i, now=0.0)
        if i % 100 == 99:
            state, _ = _lanes.take(state, 0.0)
            state = _lanes.release(state, None, 0.0)
    return 0.0


async def _nothing(n: int) -> float:
    return 0.0


WORKLOADS: dict[str, tuple[Callable[[int], Awaitable[float]], int]] = {
    "plain": (b._plain, 10_000),
    "baseline": (b._baseline, 10_000),
    "per_key": (b._per_key, 10_000),
    "direct": (b._direct, 10_000),
    "bare": (b._plain_await, 10_000),
    "lock": (b._lock_round, 10_000),
    "scope": (_scope, 20_000),
    "checkpoint": (_checkpoint, 20_000),
    "claim_release": (_claim_release, 20_000),
    "room_admit": (_room_admit, 20_000),
    "pure_admit": (_pure_admit, 20_000),
    "nothing": (_nothing, 1),
}


def _run_one(name: str, n: int) -> None:
    trio.run(WORKLOADS[name][0] if n else _nothing, n)


def count(name: str, n: int, src: str | None) -> int:
    """Instructions callgrind counts for one run of `name` with `n` operations."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, _ROOT) if p)
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={tmp}/cg.out",
                sys.executable,
                "-m",
                "tests.bench.instructions",
                "--run",
                name,
                str(n),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=src or _ROOT,  # `-m` puts the working directory first on the path
            env=env,
        )
    found = re.search(r"Collected : (\d+)", out.stderr)
    assert found, out.stderr
    return int(found.group(1))


_zero: dict[str | None, int] = {}


def per_op(name: str, n: int, src: str | None) -> float:
    """Marginal instructions per operation of `name` (see the module docstring)."""
    if src not in _zero:
        _zero[src] = count("nothing", 0, src)
    return (count(name, n, src) - _zero[src]) / n


def main(argv: list[str]) -> int:
    if argv[:1] == ["--run"]:
        _run_one(argv[1], int(argv[2]))
        return 0
    src = None
    if argv[:1] == ["--src"]:
        src, argv = os.path.abspath(argv[1]), argv[2:]
    for arg in argv or [w for w in WORKLOADS if w != "nothing"]:
        name, _, size = arg.partition("=")
        n = int(size) if size else WORKLOADS[name][1]
        print(f"{name:<14} n={n:<7} {per_op(name, n, src):>10.0f} instructions/op", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
