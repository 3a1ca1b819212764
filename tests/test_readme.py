"""The README's tour runs and prints what its comments say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tour_runs() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has no python block"
    tour = blocks[0]
    done = subprocess.run(
        [sys.executable, "-c", tour],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == ["70", "acct-2: 42", "charge 30", "State.COMPLETED"]
    assert "make demo" in text and "make test" in text
