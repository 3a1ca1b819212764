"""``examples/orders.py --trace`` (ADR 0086): the spans of one flow, as a tree under its start
span, in the text summary and in ``--json``."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .test_orders_example import orders


def test_trace_prints_one_flow_as_a_tree_of_spans(tmp_path: Path) -> None:
    done = orders("--db", str(tmp_path / "o.db"), "--orders", "40", "--quiet", "--json", "--trace")
    assert done.returncode == 0, done.stderr
    trace = json.loads(done.stdout)["trace"]
    assert re.fullmatch(r"[0-9a-f]{32}", trace["trace_id"])
    # The gateway's wakes (one, or more if it sent its event twice) are spans of the trace too.
    wakes = [s for s in trace["spans"] if s["name"] == "wake order"]
    assert wakes and all(s["depth"] == 1 for s in wakes)
    assert {s["delivery"] for s in wakes} <= {"RESUMED", "QUEUED", "DUPLICATE"}
    spans = [s for s in trace["spans"] if s["name"] != "wake order"]
    assert [(s["depth"], s["name"]) for s in spans] == [
        (0, "start order"),
        (1, "step order.reserve"),
        (1, "step order.charge"),
        (1, "step order.ship"),
        (1, "step order.ship"),
        (1, "end order"),
    ]
    assert spans[-1]["end"] == "completed"
    assert [(s["attempt"], s["outcome"]) for s in spans[1:-1]] == [
        (1, "continue"),
        (1, "park"),
        (1, "raised"),
        (2, "continue"),
    ]
    assert spans[3]["error"] == "ConnectionError: the carrier's API timed out"
    text = orders("--db", str(tmp_path / "p.db"), "--orders", "40", "--quiet", "--trace")
    assert text.returncode == 0, text.stderr
    tree = text.stdout[text.stdout.index("\ntrace ") + 1 :].splitlines()
    assert re.fullmatch(r"trace [0-9a-f]{32} of flow \S+-order-\d+ \(\d+ spans\)", tree[0])
    assert tree[1].startswith("  start order ") and tree[2].startswith("    step order.reserve ")
    assert any(line.startswith("    wake order ") for line in tree)
    raised = [line for line in tree if "raised" in line]
    assert len(raised) == 1 and "ConnectionError" in raised[0]


def test_trace_and_crash_is_a_one_line_error() -> None:
    done = orders("--trace", "--crash")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "cannot be combined with --crash" in done.stderr
