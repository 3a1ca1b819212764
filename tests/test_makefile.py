"""`make demo` installs only the runtime, `make test` the dev tools and runs the suite on at most
2 pytest-xdist workers (a dry run of the Makefile in an empty folder, so nothing is installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def dry_run(tmp_path: Path, target: str, *args: str) -> str:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    done = subprocess.run(
        ["make", "-n", target, *args], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_the_demo_installs_the_runtime_without_the_dev_tools(tmp_path: Path) -> None:
    demo = dry_run(tmp_path, "demo")
    assert "pip install --quiet --quiet --disable-pip-version-check -e .\n" in demo
    assert "[dev]" not in demo
    assert "examples/orders.py" in demo


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_the_tests_install_the_dev_tools(tmp_path: Path) -> None:
    assert "-e '.[dev]'" in dry_run(tmp_path, "lint")


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_the_suite_runs_on_at_most_two_workers_and_serially_on_request(tmp_path: Path) -> None:
    def pytest_line(*args: str) -> str:
        (line,) = [
            line for line in dry_run(tmp_path, "pytest", *args).splitlines() if "-m pytest" in line
        ]
        return line

    workers = min(len(os.sched_getaffinity(0)), 2)  # what `nproc` counts
    assert pytest_line() == f".venv/bin/python -m pytest -n {workers} --dist worksteal"
    assert pytest_line("WORKERS=0") == ".venv/bin/python -m pytest -n 0 --dist worksteal"
    with open(ROOT / "pyproject.toml", "rb") as f:
        dev = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith("pytest-xdist") for d in dev), dev
