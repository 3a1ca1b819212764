"""The examples are runnable programs: run each as a subprocess and check what it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bank_example_runs_and_balances() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "bank.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "money in the bank: 1000 (expected 1000)" in done.stdout
    assert "big withdrawal: done" in done.stdout
    assert "impossible withdrawal: timed out" in done.stdout
    assert "0 waiters left" in done.stdout
