"""The overview's chart has axes (flows per bucket up to a round number, UTC times at round
ticks) and other spans than the last hour (24 h in 15-minute buckets, 7 d in 2-hour ones), for
all plans or one; the stylesheet has a dark scheme and a narrow layout (the browser test
photographs both).

Checked to fail before the chart had axes and spans (one hour only, no tick labels, no
``@media`` rule at all).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest

from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader, Series
from ferry.flow._ops._dashboard._render import chart

from .test_dashboard import TOKEN, client_of, db  # noqa: F401 (db: a fixture)
from .test_inspect import ROOT, T0


@pytest.fixture
async def web(db: str) -> AsyncIterator[httpx.AsyncClient]:  # noqa: F811
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN, clock=lambda: T0)
    async with await client_of(dash) as client:
        yield client


def drawn(html: str) -> dict[str, int]:
    """How many points each line of the chart has."""
    return {
        name: len(points.split())
        for name, points in re.findall(r'<polyline class="line (\w+)" points="([^"]*)"', html)
    }


def ticks(html: str, axis: str) -> list[str]:
    return re.findall(rf'<text class="tick {axis}"[^>]*>([^<]*)</text>', html)


def totals(html: str) -> dict[str, int]:
    return {
        k: int(v.replace(",", "")) for k, v in re.findall(r'class="key (\w+)">\w+ ([\d,]+)', html)
    }


async def test_the_chart_has_axes_and_spans(web: httpx.AsyncClient) -> None:
    r = await web.get("/")
    assert drawn(r.text) == {"started": 60, "completed": 60, "failed": 60}
    # T0 is 22:13:20 UTC: the hour from 21:14 has ticks every 10 minutes
    assert ticks(r.text, "x") == ["21:20", "21:30", "21:40", "21:50", "22:00", "22:10"]
    assert ticks(r.text, "y") == ["0", "5", "10"]  # 9 flows started in the last minute
    assert "per 1 min" in r.text and '<strong class="range" id="span-1h">' in r.text
    r = await web.get("/", params={"span": "24h"})
    assert drawn(r.text) == {"started": 96, "completed": 96, "failed": 96}
    assert ticks(r.text, "x") == ["00:00", "04:00", "08:00", "12:00", "16:00", "20:00"]
    assert "per 15 min" in r.text
    r = await web.get("/", params={"span": "7d"})
    assert drawn(r.text) == {"started": 84, "completed": 84, "failed": 84}
    assert ticks(r.text, "x") == ["11-08", "11-09", "11-10", "11-11", "11-12", "11-13", "11-14"]
    assert "per 2 h" in r.text
    r = await web.get("/", params={"span": "1y"})  # not a span: the hour
    assert drawn(r.text)["started"] == 60


async def test_the_chart_of_one_plan(web: httpx.AsyncClient) -> None:
    r = await web.get("/")
    assert totals(r.text) == {"started": 9, "completed": 1, "failed": 1}
    assert 'href="/?span=1h&amp;plan=refund"' in r.text  # a link per plan
    r = await web.get("/", params={"plan": "refund", "span": "24h"})
    assert totals(r.text) == {"started": 1, "completed": 0, "failed": 0}
    assert "(refund)" in r.text and 'id="plan-all"' in r.text
    assert 'href="/?span=7d&plan=refund"' in r.text.replace("&amp;", "&")  # the plan is kept


def test_the_axis_goes_to_a_round_number() -> None:
    flat = Series(T0, (0,) * 60, (0,) * 60, (0,) * 60)
    assert chart(flat)["top"] == 1
    busy = Series(T0, (0,) * 59 + (1234,), (0,) * 60, (0,) * 60)
    c = chart(busy)
    assert c["top"] == 2000 and [label for _y, label in c["y_ticks"]] == ["0", "1,000", "2,000"]


def test_a_tick_label_at_the_edge_stays_inside_the_picture() -> None:
    """A tick on the last bucket (the hour ending on a round ten minutes) is anchored at its
    end, one in the middle at its middle: a centred label there was cut by the picture's edge."""
    start = 1_764_000_000 - 1_764_000_000 % 600 + 60  # so that the last bucket is round
    c = chart(Series(start, (0,) * 60, (0,) * 60, (0,) * 60))
    last_x, _label, anchor = c["x_ticks"][-1]
    assert float(last_x) > c["width"] - 20 and anchor == "end"
    assert {a for _x, _l, a in c["x_ticks"][:-1]} == {"middle"}


def test_the_stylesheet_has_a_dark_scheme_and_a_narrow_layout() -> None:
    css = (ROOT / "ferry" / "flow" / "_ops" / "_dashboard" / "static" / "style.css").read_text()
    assert "@media (prefers-color-scheme: dark)" in css
    assert "@media (max-width: 700px)" in css
    assert "word-break: break-all" not in css  # ids wrap where they can, not at every letter


def test_the_docs_show_the_schemes_and_widths() -> None:
    """docs/dashboard.md shows pages from the browser test light and dark, wide and narrow."""
    page = (ROOT / "docs" / "dashboard.md").read_text()
    for name in ("overview", "flow-dark", "flows-narrow", "overview-narrow-dark"):
        assert f"img/dashboard-{name}.png" in page, name
        png = ROOT / "docs" / "img" / f"dashboard-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
