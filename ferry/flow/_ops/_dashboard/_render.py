"""What the dashboard's pages are made with: the Jinja2 environment (autoescape on every
template, its filters and globals) and the overview's chart, built from numbers only.
"""

from __future__ import annotations

import datetime
import json
import math
import urllib.parse
from typing import Any

import jinja2

from ..._model._types import State
from ..._store import _queue_view, _triage
from . import _shown
from ._reads import UNFINISHED, Series

#: How often the overview reloads itself, and a page that found the store unavailable.
REFRESH = 5


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return ""
    d = t - now
    a = abs(d)
    text = (
        f"{a:.0f} s"
        if a < 120
        else f"{a / 60:.0f} min"
        if a < 7200
        else f"{a / 3600:.0f} h"
        if a < 172800
        else f"{a / 86400:.0f} d"
    )
    return f"in {text}" if d > 0 else f"{text} ago"


#: How much of an error the flows list and the overview show (the whole on hover, and on the
#: flow's page).
ERROR_WIDTH = 80
#: How many groups of failed and blocked flows the overview shows.
ERROR_GROUPS = 10


def _cut(text: str | None, width: int = ERROR_WIDTH) -> str:
    if text is None:
        return ""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _nice(top: int) -> int:
    """The least of 1, 2, 5, 10, 20, 50, ... at or above `top`."""
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale >= top:
                return m * scale
        scale *= 10


#: Where the x axis has a tick: seconds between ticks, and how a tick's time is written.
_TICKS = {"1h": (600, "%H:%M"), "24h": (4 * 3600, "%H:%M"), "7d": (86400, "%m-%d")}


def chart(series: Series, width: int = 640, height: int = 180) -> dict[str, Any]:
    """The overview's chart as numbers for the template's inline SVG: a polyline per series
    (started, completed and failed per bucket over the span), the y axis (flows per bucket,
    from 0 to a round number) and the x axis (UTC times at round ticks)."""
    n = len(series.started)
    top = _nice(max(1, *series.started, *series.completed, *series.failed))
    left, right, above, below = 44, 10, 10, 24
    inner_w, inner_h = width - left - right, height - above - below
    step = inner_w / max(1, n - 1)

    def x_of(i: float) -> float:
        return left + i * step

    def y_of(v: float) -> float:
        return above + inner_h - v * inner_h / top

    def points(values: tuple[int, ...]) -> str:
        return " ".join(f"{x_of(i):.1f},{y_of(v):.1f}" for i, v in enumerate(values))

    y_ticks = [(f"{y_of(v):.1f}", _shown.count(v)) for v in sorted({0, top // 2, top})]
    every, fmt = _TICKS.get(series.span, (600, "%H:%M"))
    end = series.start + (n - 1) * series.step
    x_ticks = []
    t = math.ceil(series.start / every) * every
    while t <= end:
        label = datetime.datetime.fromtimestamp(t, datetime.UTC).strftime(fmt)
        x = x_of((t - series.start) / series.step)
        # A label centred on a tick near an edge would be cut by the picture's edge: it ends
        # (or starts) at its tick there instead.
        anchor = "end" if x > width - 20 else "start" if x < 20 else "middle"
        x_ticks.append((f"{x:.1f}", label, anchor))
        t += every
    return {
        "width": width,
        "height": height,
        "top": top,
        "left": left,
        "right": width - right,
        "above": above,
        "bottom": above + inner_h,
        "y_ticks": y_ticks,
        "x_ticks": x_ticks,
        "per": _shown.duration(series.step),
        "span": series.span,
        "lines": [
            ("started", points(series.started), sum(series.started)),
            ("completed", points(series.completed), sum(series.completed)),
            ("failed", points(series.failed), sum(series.failed)),
        ],
    }


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("ferry.flow._ops._dashboard", "templates"),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = _shown.iso
    env.filters["num"] = _shown.count
    env.filters["duration"] = _shown.duration
    env.filters["compact"] = lambda v: json.dumps(v, ensure_ascii=False, sort_keys=True)
    env.filters["quote"] = lambda s: urllib.parse.quote(str(s), safe="")
    env.globals["ago"] = _ago
    env.globals["zip"] = zip
    env.globals["timeline"] = _shown.timeline
    env.globals["states"] = [s.name for s in State]
    env.globals["unfinished"] = UNFINISHED
    env.filters["error_of"] = _triage.error_of
    env.filters["cut"] = _cut
    env.filters["limits"] = _queue_view.limits_text
    return env
