"""Every test starts with Python's own SIGINT handler, even in a run that inherited SIGINT ignored
(started in the background by a shell without job control), and a test that leaves another
handler installed fails, named (the top conftest, ADR 0172). Checked on a pytest run of its own."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import signal

def test_a_starts_with_the_default():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

def test_b_leaves_sigint_ignored():
    signal.signal(signal.SIGINT, signal.SIG_IGN)

def test_c_starts_with_the_default_again():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
"""


PYTEST = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_a_run_that_inherited_sigint_ignored_gives_each_test_the_default(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    done = subprocess.run(
        [*PYTEST, "-q", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=ROOT,
        # Only the conftest's plugin: no xdist, trio or hypothesis plugins to load.
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        },
        capture_output=True,
        text=True,
        preexec_fn=_ignore_sigint,
        timeout=120,
    )
    out = done.stdout
    assert "3 passed, 1 error" in out, out + done.stderr
    assert "ERROR at teardown of test_b_leaves_sigint_ignored" in out, out
    assert "the test left SIGINT's handler <Handlers.SIG_IGN: 1> installed" in out, out
