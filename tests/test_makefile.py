"""`make demo` installs only the runtime, `make test` the dev tools (a dry run of the Makefile in
an empty folder, so nothing is installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def dry_run(tmp_path: Path, target: str) -> str:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    done = subprocess.run(
        ["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, check=True
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
