"""Ctrl-C in the middle of an example: one line on stderr that says it was interrupted (and, for
the orders, where the flows that had not settled are), exit status 130, no traceback, no process
left behind. The signal goes to the example's whole process group, as a terminal's Ctrl-C does,
once the example has printed its first line (it is running)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _default_sigint() -> None:
    # A test run started in the background inherits an ignored SIGINT; a terminal's user does not.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted(script: str, *args: str, on_stderr: bool = False) -> tuple[int, str, str]:
    """Start `script`, Ctrl-C it once it printed its first line (on stderr: its first progress
    line); its exit status, out, err."""
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        preexec_fn=_default_sigint,
        start_new_session=True,
    )
    assert p.stdout is not None and p.stderr is not None
    try:
        first = (p.stderr if on_stderr else p.stdout).readline()
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
        out, err = (out, first + err) if on_stderr else (first + out, err)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, out, err


def test_ctrl_c_stops_the_ledger_with_one_line() -> None:
    code, _, err = interrupted("ledger.py", "--ops", "50000", "--quiet")
    assert "Traceback" not in err, err
    assert code == 130, err
    assert err.splitlines()[-1] == "ledger.py: interrupted (Ctrl-C)", err


@pytest.mark.parametrize("crash", [False, pytest.param(True, marks=pytest.mark.long)])
def test_ctrl_c_stops_the_orders_and_says_where_their_flows_are(
    tmp_path: Path, crash: bool
) -> None:
    db = tmp_path / "orders.db"
    args = ["--orders", "5000", "--rate", "200", "--db", str(db)] + (["--crash"] if crash else [])
    code, out, err = interrupted("orders.py", *args, on_stderr=True)  # flows are running
    assert out.startswith("orders: "), out
    assert "Traceback" not in err, err
    assert code == 130, err
    last = err.splitlines()[-1]
    assert last.startswith("orders.py: interrupted (Ctrl-C): "), err
    assert f"python -m ferry.flow {db} list" in last, last
    # the store is whole and no engine holds it: the inspector's action takes its lock
    done = subprocess.run(
        [sys.executable, "-m", "ferry.flow", str(db), "cancel", "nobody"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1 and "no flow has id 'nobody'" in done.stderr, done.stderr


def test_a_reader_that_stops_early_ends_the_ledger_quietly() -> None:
    """``python examples/ledger.py | head -1``: the example's later lines meet a closed pipe; it
    ends with exit status 141 (as a program that SIGPIPE ended) and nothing on stderr, not a
    BrokenPipeError traceback (neither from the print nor from the flush at exit)."""
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "ledger.py"), "--ops", "300", "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert p.stdout is not None and p.stderr is not None
    try:
        first = p.stdout.readline()
        p.stdout.close()  # the reader is done: the summary that follows has nowhere to go
        err = p.stderr.read()
        p.wait(timeout=60)
    finally:
        p.stderr.close()
        if p.poll() is None:
            p.kill()
            p.wait()
    assert first.startswith("ledger: 300 inputs"), first
    assert err == "", err
    assert p.returncode == 141, err
