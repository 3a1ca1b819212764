"""Events and the stream out of a running flow (SPEC 5.10): what a step's `ctx.set_event` and
`ctx.emit` leave, checked at the call, and the limits checked with the step's outcome.

A step's calls are buffered on its `Context` as JSON text (the value as it was at the call: a
later change of the object does not reach the store) and saved, as one `Signals` record on the
step's write (`_store._op.Change.signals`), in the same transaction as its outcome
(`_store._signals.record`); a step that raises leaves nothing. The stream's offsets are the
runner's to give (`Signals.first`): 1, 2, 3, ... per flow in the order of appending; the
store's primary key on ``(flow_id, pos)`` refuses a second value at an offset, never writes
two.

Limits (docs/adr/0175): each value at most the engine's `max_data_bytes` of UTF-8 JSON text
(checked with the outcome, as `ctx.data`); a key a str of 1 to `MAX_KEY_CHARS` characters
(checked at the call); at most `MAX_KEYS_PER_STEP` keys set by one step (at the call) and
`MAX_STREAM` values in one flow's stream (with the outcome). A step whose values break a limit
fails its flow, not retried, as a malformed outcome does.

Pure: no trio, no clock, no database.
"""

from __future__ import annotations

from typing import Final

import attrs

from . import _checks
from ._types import Json

#: Values one flow's stream may hold, at most (a step that would pass it fails its flow).
MAX_STREAM: Final = 100_000
#: Characters of an event's key, at most.
MAX_KEY_CHARS: Final = 256
#: Distinct keys one step (or compensation) may set, at most.
MAX_KEYS_PER_STEP: Final = 1_000


def event_key(key: object) -> str:
    """`key` if it may name an event; `TypeError`/`ValueError` naming the problem."""
    if not isinstance(key, str):
        raise TypeError(f"ctx.set_event's key must be a str, got {_checks.describe(key, 200)}")
    if not key:
        raise ValueError("ctx.set_event's key must not be empty")
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(
            f"ctx.set_event's key is {len(key)} characters, more than {MAX_KEY_CHARS}:"
            f" {_checks.describe(key, 80)}"
        )
    problem = _checks.text_problem(key)
    if problem is not None:
        raise ValueError(f"ctx.set_event's key cannot be stored: {problem}")
    return key


def value_text(value: Json, what: str) -> str:
    """The JSON text of `value` (`_checks.json_text`: `TypeError`/`ValueError` naming `what`);
    its size is checked with the outcome (`problem`)."""
    return _checks.json_text(value, what)


@attrs.frozen(kw_only=True)
class Signals:
    """What one step's write adds: `events` (key, JSON text), each key once, in the order
    first set; `values` (JSON texts) at offsets `first`, `first` + 1, ... of the flow's
    stream (`first` is 0 when there are none)."""

    events: tuple[tuple[str, str], ...] = ()
    values: tuple[str, ...] = ()
    first: int = 0

    def __repr__(self) -> str:
        return f"Signals(events={len(self.events)}, values={len(self.values)}, first={self.first})"


def problem(
    events: dict[str, str], values: list[str], emitted: int, *, max_bytes: int, what: str
) -> str | None:
    """Why what a step left (`events`, `values`, with `emitted` values in its flow's stream
    before) cannot be stored, or None: a value larger than `max_bytes`, or a stream longer than
    `MAX_STREAM`. `what` names the step."""
    if emitted + len(values) > MAX_STREAM:
        return (
            f"{what} emitted {len(values)} values to a stream of {emitted}: a flow's stream holds"
            f" at most {MAX_STREAM} (not retried)"
        )
    for key, text in events.items():
        size = _size(text)
        if size > max_bytes:
            return (
                f"{what} set event {key!r} to {size} bytes of JSON, more than the engine's"
                f" max_data_bytes={max_bytes} (not retried)"
            )
    if not values or max(map(len, values)) * 4 <= max_bytes:  # UTF-8: at most 4 bytes a char
        return None
    for n, text in enumerate(values):
        size = _size(text)
        if size > max_bytes:
            return (
                f"{what} emitted a value of {size} bytes of JSON (its {n + 1}th), more than the"
                f" engine's max_data_bytes={max_bytes} (not retried)"
            )
    return None


def _size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def signals(events: dict[str, str], values: list[str], emitted: int) -> Signals | None:
    """The record of what a step left, its values from offset ``emitted + 1``; None if
    nothing."""
    if not events and not values:
        return None
    return Signals(
        events=tuple(events.items()), values=tuple(values), first=emitted + 1 if values else 0
    )
