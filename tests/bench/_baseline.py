"""The code of a past commit, for a benchmark that compares today's code with it in one run.

`extract` writes that commit's ``ferry`` and ``stm`` packages into a directory (``git archive``);
`child_env` is the environment of a child process whose ``import ferry`` is then that code (the
directory first on ``PYTHONPATH``; the child must be run as a script from outside the checkout,
so that neither the current directory nor the editable install comes first). A checkout
without the commit (no git history, a shallow clone) gives `Baseline.missing`'s reason instead:
the benchmark then reports today's figures alone (docs/adr/0100).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import attrs

COMMIT = "67e18f2"  # main just before the flow speed work (ADR 0096-0100)
PACKAGES = ("ferry", "stm")
ROOT = Path(__file__).resolve().parents[2]


@attrs.frozen
class Baseline:
    """`code`: the directory holding the commit's packages, or None with `reason` why not."""

    commit: str
    code: Path | None
    reason: str = ""


def extract(dest: Path, *, commit: str = COMMIT, root: Path = ROOT) -> Baseline:
    """Write `commit`'s packages under `dest` (which must exist). Never raises for a checkout
    without that commit or without git: the result says why there is no baseline."""
    try:
        known = subprocess.run(
            ["git", "-C", str(root), "cat-file", "-e", f"{commit}^{{commit}}"],
            capture_output=True,
            check=False,
        )
    except FileNotFoundError:
        return Baseline(commit, None, "git is not installed")
    if known.returncode != 0:
        return Baseline(commit, None, f"commit {commit} is not in this checkout's git history")
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", "--format=tar", commit, *PACKAGES],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise RuntimeError(
            f"git archive {commit} failed: {archive.stderr.decode(errors='replace').strip()}"
        )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return Baseline(commit, dest)


def child_env(code: Path) -> dict[str, str]:
    """This process's environment with `code` alone on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": str(code)}
