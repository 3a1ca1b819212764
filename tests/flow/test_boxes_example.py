"""examples/boxes.py (child flows: orders that ship in boxes) runs as a script, as a user would
run it, on SQLite: its audit is clean (every failed order recalled what it shipped, in reverse,
once, before its shipment was called off; never more boxes at once than `--max-running`), its
JSON summary is snake_case, a second run on its kept store runs orders of its own, and a bad
flag is a one-line error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples import boxes as example

ROOT = Path(__file__).resolve().parents[2]


def boxes(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / "boxes.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # as a user runs it
        check=False,
    )


def test_the_default_run_audits_clean_and_again_on_its_kept_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = boxes("--db", str(tmp_path / "boxes.db"))
    assert done.returncode == 0, done.stderr + done.stdout
    assert "audit               OK" in done.stdout
    assert "most boxes at once  " in done.stdout  # the label and its value apart
    assert (tmp_path / "boxes.db").exists()
    # A second run on the kept store starts orders of its own (not the first run's ids, which
    # would run nothing and fail its audit), in-process to keep the test short.
    assert example.main(["--db", str(tmp_path / "boxes.db"), "--orders", "3"]) == 0
    out = capsys.readouterr().out
    assert "audit               OK" in out and "steps run           0" not in out


def test_failures_undo_the_boxes_and_the_summary_says_so() -> None:
    done = boxes("--json", "--orders", "12", "--boxes", "4", "--max-running", "3", "--fail", "0.3")
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(done.stdout)
    assert report["audit"] == {"ok": True, "problems": []}
    assert report["orders"]["started"] == 12 and report["orders"].get("FAILED", 0) > 0
    assert 0 < report["boxes_recalled"] <= report["boxes_sent"]
    assert report["most_boxes_at_once"] <= 3
    assert all(k.replace("_", "").isalnum() and k == k.lower() for k in report)


def test_a_bad_flag_is_one_line_on_stderr() -> None:
    done = boxes("--max-running", "0")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "boxes.py: error: argument --max-running: must be between 1 and 1000, got 0 (see --help)"
    ]
