"""The ferry examples run as scripts, as a user would run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("lookups.py", ("--callers", "200", "--latency", "0.005"), "through a ferry"),
        ("inference.py", ("--requests", "500"), "prompts per batch"),
    ],
)
def test_example_runs(script: str, args: tuple[str, ...], expected: str) -> None:
    assert expected in run_example(script, *args)
