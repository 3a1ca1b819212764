"""Times as operators write and read them: ISO 8601 in UTC to the second, and ages before now.

One place for the inspector, its filters, retention's ``purge`` and their messages: a time is
wall-clock seconds since the epoch (the engine's durable times are).
"""

from __future__ import annotations

import datetime
import math
import re

_AGE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def iso(t: float) -> str:
    """`t` as ISO 8601 in UTC, to the second (``2026-12-01T12:00:00Z``)."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read(text: str, now: float, *, units: str) -> float | None:
    """`text` as seconds since the epoch: ISO 8601 (UTC unless it names a zone) or an age
    before `now` in one of `units` (of ``smhdw``: ``90s``, ``15m``, ``2h``, ``3d``, ``2w``);
    None if it is neither (the caller says what it expected)."""
    text = text.strip()
    m = _AGE.fullmatch(text)
    if m is not None:
        if m.group(2) not in units:
            return None
        ago = now - float(m.group(1)) * _UNIT[m.group(2)]
        return ago if math.isfinite(ago) else None  # an age of 1e400 days is no time
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()
