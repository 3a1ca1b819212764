"""The flow speed benchmark's baseline (tests/bench/_baseline.py, docs/adr/0100): the code of a
past commit extracted, imported by the benchmark's child in place of today's code; a checkout
without that commit gives today's figures alone, never an error."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import _baseline, _usage
from tests.bench._harness import print_table
from tests.bench.bench_flow_speed import SCRIPT, Run, cpu_row, ratio_row


def test_the_child_runs_flows_on_the_baseline_code(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    base = _baseline.extract(tmp_path / "code")
    if base.code is None:
        assert base.reason  # what the benchmark prints instead of the baseline's figures
        pytest.skip(f"no baseline in this checkout: {base.reason}")
    assert (base.code / "ferry" / "flow" / "__init__.py").is_file()
    assert (base.code / "stm" / "__init__.py").is_file()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "f.db"), "three", "3"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env=_baseline.child_env(base.code),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    # The extracted code, not the checkout's (first on sys.path) nor the editable install's.
    assert Path(report["ferry"]).resolve().is_relative_to(base.code.resolve())
    assert report["flows"] == 3
    assert report["writes"] == 12  # start and three step outcomes, each one write


def test_a_checkout_without_the_commit_gives_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    (tmp_path / "checkout").mkdir()  # no .git here nor above it
    (tmp_path / "code").mkdir()
    base = _baseline.extract(tmp_path / "code", root=tmp_path / "checkout")
    assert base.code is None
    assert "67e18f2" in base.reason
    assert not any((tmp_path / "code").iterdir())


def test_a_commit_the_history_lacks_gives_a_reason(tmp_path: Path) -> None:
    base = _baseline.extract(tmp_path, commit="0123456789abcdef0123456789abcdef01234567")
    assert base.code is None
    assert "0123456789abcdef" in base.reason


def test_without_a_baseline_the_row_shows_todays_figure_and_no_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    used = _usage.Used(1.0, 1.0, 0.0, 1.0, math.nan, math.nan)
    today = [Run(seconds=s, flows=1000, cpu=1.0, write_batches=4, used=used) for s in (2, 1, 3)]
    missing = _baseline.Baseline("67e18f2", None, "commit 67e18f2 is not in this checkout")
    row = ratio_row("flow speed SQLite", 0.5, today, [], missing)
    assert row.value == 2 / 1000  # the median run
    assert math.isnan(row.baseline)
    assert "500 flows/s" in row.note
    assert "not in this checkout" in row.note
    cpu = cpu_row("flow speed SQLite", 0.5, today, [], missing)
    assert cpu.value == 1 / 1000
    assert math.isnan(cpu.baseline)
    print_table([row, cpu])
    for line in capsys.readouterr().out.splitlines()[1:3]:
        assert "      -  -" in line  # no target, no verdict

    with_base = _baseline.Baseline("67e18f2", Path("/old"))
    before = [Run(seconds=4, flows=1000, cpu=1.0, write_batches=4, used=used)]
    row = ratio_row("flow speed SQLite", 0.5, today, before, with_base)
    assert row.ratio == 0.5
    assert row.ok
    assert "500 vs 250 flows/s" in row.note
