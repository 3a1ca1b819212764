"""How the dashboard writes times, durations, counts and a flow's history (pure functions, no
I/O): ISO 8601 times in UTC (``2026-12-01T12:00:05Z``), durations in the unit that reads best
(``350 ms``, ``4.2 s``, ``3 min 5 s``, ``2 h 10 min``, ``3 d 4 h``), counts with thousands
separators (``12,345``), and each history event as a `Shown` row of the timeline: its outcome
(which colours its dot), the time since the event before it, its details as words (times as
ISO, never an epoch float), and the error and traceback of a failed attempt.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

import attrs

from ..._model._types import Event


def iso(t: float | None) -> str:
    """`t` (seconds since the epoch) as ISO 8601 in UTC, to the second; ``-`` for None."""
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def duration(seconds: float) -> str:
    """A length of time in words: ``0 ms``, ``350 ms``, ``4.2 s``, ``3 min 5 s``, ``2 h 10 min``,
    ``3 d 4 h`` (a negative one, from clocks of two machines, is shown with a minus)."""
    if seconds < 0:
        return "-" + duration(-seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    if s < 86400:
        m = (s % 3600) // 60
        return f"{s // 3600} h {m} min" if m else f"{s // 3600} h"
    h = (s % 86400) // 3600
    return f"{s // 86400} d {h} h" if h else f"{s // 86400} d"


def count(n: int) -> str:
    """A count with thousands separators: ``12,345``."""
    return f"{n:,}"


#: The events whose dot says something went wrong (red), something was given up or undone
#: (amber), or the flow waits (violet); the others say it went on (blue) or ended well (green).
_TONE = {
    "started": "run",
    "resumed": "run",
    "woken": "wait",
    "parked": "wait",
    "timed_out": "wait",
    "compensated": "undo",
    "cancelled": "undo",
    "completed": "ok",
    "attempt_failed": "error",
    "failed": "error",
    "blocked": "error",
    "abandoned": "error",
    "undone_by_parent": "undo",  # a completed child compensated because its parent compensates
}

#: Detail keys that hold a time (seconds since the epoch) and one that holds seconds.
_TIMES = ("deadline", "at", "until")
_SECONDS = ("timeout",)


@attrs.frozen
class Shown:
    """One event of the timeline as the page writes it."""

    event: Event
    tone: str  # run, ok, wait, undo, warn, error: the dot's colour
    since: str | None  # the time since the event before it (None for the first)
    fields: tuple[tuple[str, str], ...]  # the details other than the error and traceback
    error: str | None  # a failed attempt's or step's error (its type first, if known)
    traceback: str | None


def tone_of(e: Event) -> str:
    """The outcome of `e`: a step that raised on its last attempt is an error, one that
    returned `fail` a warning (its compensations run), one that parked or spawned waits, one
    that went on a success; a spawn's end (``children_ended``) a success if every child
    completed, else a warning."""
    if e.kind == "step":
        outcome = e.detail.get("outcome") if isinstance(e.detail, dict) else None
        if outcome == "error":
            return "error"
        if outcome == "fail":
            return "warn"
        if outcome in ("park", "spawn"):  # a spawn parks the parent until its children end
            return "wait"
        return "ok"
    if e.kind == "children_ended":  # a parent's spawn is over: did every child complete?
        d = e.detail if isinstance(e.detail, dict) else {}
        return "warn" if d.get("failed") or d.get("stopped") else "ok"
    return _TONE.get(e.kind, "run")


def _word(key: str, value: Any) -> str:
    if key in _TIMES and isinstance(value, int | float) and not isinstance(value, bool):
        return iso(float(value))
    if key in _SECONDS and isinstance(value, int | float) and not isinstance(value, bool):
        return duration(float(value))
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return ", ".join(_word("", v) for v in value) or "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def shown(e: Event, before: Event | None) -> Shown:
    """`e` as a row of the timeline, `before` the event before it (None for the first)."""
    detail = e.detail
    fields: list[tuple[str, str]] = []
    error = traceback = None
    if isinstance(detail, dict):
        for key, value in detail.items():
            if key == "traceback" and isinstance(value, str):
                traceback = value
            elif key == "error" and isinstance(value, str):
                error = value
            elif key == "type" and e.kind == "attempt_failed":
                continue  # said with the error
            else:
                fields.append((key, _word(key, value)))
        kind = detail.get("type")
        if error is not None and isinstance(kind, str) and not error.startswith(kind):
            error = f"{kind}: {error}"
    elif detail is not None:
        fields.append(("detail", _word("", detail)))
    since = None if before is None else duration(e.at - before.at)
    return Shown(e, tone_of(e), since, tuple(fields), error, traceback)


def timeline(history: Sequence[Event]) -> list[Shown]:
    """The rows of a flow's timeline, oldest first."""
    return [shown(e, history[i - 1] if i else None) for i, e in enumerate(history)]
