"""docs/adr/README.md has one row per record, in number order, each linking its file; a record
the index says is amended or superseded names the record that changed it."""

from __future__ import annotations

import re
from pathlib import Path

ADR = Path(__file__).resolve().parent.parent / "docs" / "adr"
ROW = re.compile(r"^\| \[(\d{4})\]\(([^)]+)\) \| (.+?) \| (.+?) \| (.+?) \|$")


def rows() -> list[tuple[str, str, str]]:
    found = []
    for line in (ADR / "README.md").read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            found.append((m.group(1), m.group(2), m.group(5)))
    return found


def test_every_record_has_one_row_in_number_order() -> None:
    records = sorted(p.name for p in ADR.glob("[0-9][0-9][0-9][0-9]-*.md"))
    listed = rows()
    assert [link for _n, link, _s in listed] == records
    assert all(link.startswith(number) for number, link, _s in listed)


def test_an_amended_record_names_its_amendment_near_its_top() -> None:
    missing = []
    for number, link, status in rows():
        for later in re.findall(r"(?:amended|superseded) by (\d{4})", status):
            head = "\n".join((ADR / link).read_text(encoding="utf-8").splitlines()[:12])
            if later not in head:
                missing.append(f"{number} does not name {later} near its top")
    assert missing == []
