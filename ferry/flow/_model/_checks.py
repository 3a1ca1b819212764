"""What may be stored: the one place that checks data, ids and outcomes (docs/adr/0062).

Used at the calls (`start` data, `wake` payloads, `publish` decisions, flow and message ids:
bad input is refused there with `TypeError`/`ValueError`, nothing stored) and after every step
(its outcome and `ctx.data`: a bad one fails that flow alone, with an error naming the step and
the problem). Everything here is pure and cheap: O(size of the value).

Storable JSON: None, bool, int, float (finite), str, lists and str-keyed dicts, that survive a
JSON round trip unchanged; nested at most `MAX_DEPTH` levels; every string (keys too) valid
Unicode text that UTF-8 can encode (no lone surrogates such as ``"\\udc80"``, which JSON with
``ensure_ascii=False`` lets through and the database then refuses); for a flow's data, at most
the engine's `max_data_bytes` of UTF-8 JSON text. Storable text (ids, names, reasons): a str that
UTF-8 can encode and that holds no NUL character (PostgreSQL's text type refuses it).
"""

from __future__ import annotations

import datetime
import inspect
import json
import math
import traceback
from typing import Any

from ferry._text import canonical_json

from ._types import Fail, Json, MisusedOutcome, OnTimeout, Outcome, Park, _Complete, _Continue

MAX_DEPTH = 64  # levels of nested lists and dicts a stored JSON value may have
MAX_DATA_BYTES = 1 << 20  # the default of open_engine(max_data_bytes=): 1 MiB of JSON text


def finite(value: int | float) -> bool:
    """Is the number `value` finite? A whole number too big for a float (``10**400``) is not:
    it has no float, so it can be neither a time nor a count of seconds (`math.isfinite` would
    raise `OverflowError` for it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown_number(value: object, width: int = 40) -> str:
    """`value` for an error message, as `repr` says it, cut short if it is long (a whole number
    of 400 digits is said as its first digits and how many it has)."""
    text = repr(value)
    if len(text) <= width:
        return text
    return f"{text[:width]}... ({len(text)} characters)"


def text_problem(value: str) -> str | None:
    """Why `value` cannot be stored as text, or None if it can."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"it holds {value[exc.start : exc.end]!r} at index {exc.start}, which is not valid"
            " Unicode text (a lone surrogate, as from a bytes value decoded with"
            " errors='surrogateescape'): UTF-8 cannot store it"
        )
    if "\x00" in value:
        return f"it holds a NUL character ('\\x00') at index {value.index(chr(0))}"
    return None


# The types JSON gives back as themselves: a value made only of these (dicts with str keys)
# survives a round trip unchanged, so `json_text` need not parse its text again to know it.
_PLAIN = frozenset({str, int, float, bool, type(None), dict, list})
_SCALARS = frozenset({str, int, float, bool, type(None)})  # plain, and never nested
_DEEP, _ODD = 1, 2


def _walk(value: Json) -> int:
    """`_DEEP` if `value` is nested deeper than `MAX_DEPTH` lists and dicts (or contains itself),
    else `_ODD` if it holds anything JSON may not give back unchanged (a tuple, a non-str key, a
    subclass of a JSON type, a type JSON cannot carry), else 0. No recursion: a value nested a
    million levels deep is answered as quickly. Cost: O(size), one look at each item."""
    plain = _PLAIN
    scalars = _SCALARS
    odd = type(value) not in plain
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is dict or isinstance(item, dict):
            children: Any = item.values()
            for key in item:
                if type(key) is not str:
                    odd = True
        elif kind is list or isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > MAX_DEPTH:
            return _DEEP
        for child in children:
            ck = type(child)
            if ck in scalars:  # most children: no isinstance call
                continue
            if ck is dict or ck is list or isinstance(child, dict | list | tuple):
                stack.append((child, depth + 1))
            if ck not in plain:
                odd = True
    return _ODD if odd else 0


def json_text(value: Json, what: str, *, max_bytes: int | None = None) -> str:
    """The canonical JSON text of `value`, checked to be storable; raises `TypeError` (not
    JSON) or `ValueError` (too deep, too big, a string UTF-8 cannot hold) naming `what`.

    Cost: one walk of the value and one encoding; the text is parsed back (to compare) only
    when the walk found something JSON may change (a tuple, a non-str key, a subclass)."""
    shape = _walk(value)
    if shape == _DEEP:
        raise ValueError(
            f"{what} is nested deeper than {MAX_DEPTH} levels of lists and dicts (or contains"
            " itself): flatten it"
        )
    try:
        text = canonical_json(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{what} must be JSON (None, bool, int, float, str, list, dict): {exc}"
        ) from None
    if shape == _ODD and json.loads(text) != value:
        raise TypeError(
            f"{what} must be JSON and survive a round trip unchanged (dict keys must be str,"
            f" sequences lists), got {_short(value)}"
        )
    if text.isascii():  # a flag of the str: no scan; no surrogate can hide in ASCII
        size = len(text)
    else:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{what} holds a string with {text[exc.start : exc.end]!r}, which is not valid"
                " Unicode text (a lone surrogate, as from bytes decoded with"
                " errors='surrogateescape'): UTF-8 cannot store it; decode bytes strictly, or"
                " store them as base64"
            ) from None
    if max_bytes is not None and size > max_bytes:
        raise ValueError(
            f"{what} is {size} bytes of JSON, more than the engine's max_data_bytes={max_bytes}:"
            " keep large values outside the flow (store a reference), or open the engine with a"
            " larger max_data_bytes"
        )
    return text


def json_object_text(value: Json, what: str, *, max_bytes: int | None = None) -> str:
    """`json_text` of a JSON object (a dict); `TypeError` for anything else."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a JSON object (a dict), got {type(value).__name__}")
    return json_text(value, what, max_bytes=max_bytes)


def _short(value: object, limit: int = 200) -> str:
    return describe(value, limit)


def _storable(text: str) -> str:
    """`text` as it is if it can be stored, else with what UTF-8 cannot hold escaped."""
    if text_problem(text) is None:
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def describe(value: object, limit: int = 1000) -> str:
    """``repr(value)`` as text that can be stored (an error message, say): at most `limit`
    characters, what UTF-8 cannot hold escaped, and a `repr` that raises named as such."""
    try:
        text = repr(value)
    except Exception as exc:  # a user's __repr__ that raises: name it, never raise from here
        text = f"<{type(value).__name__} whose repr raised {type(exc).__name__}>"
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return _storable(text)


#: A failure's traceback is kept up to this many characters: its first and (mostly) its last
#: lines, where the raising frame is.
TRACEBACK_CHARS = 4000


def said(value: object, name: str) -> str:
    """`value`, a str that says something and can be stored (a reason, who did it: recorded in
    a flow's history); `TypeError`/`ValueError` naming `name` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {describe(value, 200)}")
    if not value.strip():
        raise ValueError(f"{name} must say something (it is recorded), got {value!r}")
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(f"{name} {value!r} cannot be stored: {problem}")
    return value


def traceback_text(error: BaseException, limit: int = TRACEBACK_CHARS) -> str:
    """`error`'s traceback as text that can be stored, at most about `limit` characters: the
    head and the tail (the frame that raised) of a longer one."""
    try:
        text = "".join(traceback.format_exception(error)).rstrip()
    except Exception as exc:  # a user's exception whose str or repr raises: name it
        text = f"<the traceback could not be formatted: {type(exc).__name__}>"
    if len(text) > limit:
        head = limit // 4
        cut = len(text) - limit
        text = f"{text[:head]}\n... ({cut} characters left out) ...\n{text[-(limit - head) :]}"
    return _storable(text)


def failure(error: BaseException) -> dict[str, Json]:
    """What an attempt that raised records: ``error`` (its `describe`), ``type`` (the
    exception's qualified name) and ``traceback`` (`traceback_text`)."""
    cls = type(error)
    module = cls.__module__
    name = cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"
    return {"error": describe(error), "type": _storable(name), "traceback": traceback_text(error)}


def flow_id(value: object) -> str:
    """A flow id: a non-empty str that can be stored; `TypeError`/`ValueError` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"flow_id must be a str, got {_short(value)}")
    if not value:
        raise ValueError("flow_id must not be empty")
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(f"flow_id {value!r} cannot be stored: {problem}")
    return value


def message_id(value: object, what: str) -> None:
    """A message id is a non-empty, storable str or None: an empty one (an event without its
    id) would make every later wake with it a silent `DUPLICATE`."""
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str or None, got {_short(value)}")
    if not value:
        raise ValueError(
            f"{what} must not be empty: every later wake with it would be a DUPLICATE (give the"
            " event's id, or None for a wake that is never deduplicated)"
        )
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(f"{what} {value!r} cannot be stored: {problem}")


def outcome(result: object) -> Outcome | str | None:
    """A step's return value as an outcome (None = continue), or a str saying what is wrong
    with it ("returned ..., which ..."): not an outcome, or a `Park`/`Fail` built by hand with
    values `park()`/`fail()` would have refused (`checked_outcome`, the one check of both)."""
    if result is None or isinstance(result, _Continue | _Complete):
        return result
    if isinstance(result, Park | Fail):
        try:
            return checked_outcome(result)
        except MisusedOutcome as exc:
            return f"returned {_short(result)}: {exc}"
    from ._children import Spawn, spawn_problem

    if isinstance(result, Spawn):
        return spawn_problem(result) or result
    hint = ""
    if result is park or result is fail:
        hint = f": call it, return flow.{result.__name__}(...)"
    elif inspect.iscoroutine(result):
        result.close()  # never to be awaited now: no "never awaited" warning
        hint = ": an await is missing"
    return (
        f"returned {_short(result)}, which is not an outcome (None, CONTINUE, COMPLETE, park(),"
        f" fail()){hint}"
    )


class _OutcomeTypeError(MisusedOutcome, TypeError):
    pass


class _OutcomeValueError(MisusedOutcome, ValueError):
    pass


# Shown as what they are to the user (in a flow's error, a traceback): a TypeError, a ValueError.
for _cls, _as in ((_OutcomeTypeError, TypeError), (_OutcomeValueError, ValueError)):
    _cls.__name__ = _cls.__qualname__ = _as.__name__
    _cls.__module__ = "builtins"


def checked_outcome(o: Park | Fail) -> Park | Fail:
    """`o` if its values are ones a step may return (a park's timeout a finite number of
    seconds >= 0 or None, as a float; its on_timeout "compensate" or "continue"; a fail's
    reason a str that can be stored), else `TypeError`/`ValueError` (a `MisusedOutcome`).

    The one check of a park's and a fail's values: `park()` and `fail()` raise it at the call,
    and a `Park`/`Fail` built by hand is checked by it when the step returns it (`outcome`),
    which fails its flow with the same words. O(1), but a reason's O(length) text check."""
    if isinstance(o, Fail):
        reason: object = o.reason  # typed str, but a Fail built by hand may hold anything
        if not isinstance(reason, str):
            raise _OutcomeTypeError(f"fail()'s reason must be a str, got {_short(reason)}")
        problem = text_problem(reason)
        if problem is not None:
            raise _OutcomeValueError(f"fail()'s reason cannot be stored: {problem}")
        return o
    timeout: object = o.timeout  # typed, but a Park built by hand may hold anything
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise _OutcomeTypeError(
                "park(timeout=...) must be a number of seconds, a datetime.timedelta or None,"
                f" got {_short(timeout)}"
            )
        if not (finite(timeout) and timeout >= 0):
            raise _OutcomeValueError(
                f"park(timeout=...) must be finite and >= 0, got {shown_number(timeout)}"
            )
    if o.on_timeout not in ("compensate", "continue"):
        raise _OutcomeValueError(
            f"park(on_timeout=...) must be 'compensate' or 'continue', got {o.on_timeout!r}"
        )
    if timeout is None or type(timeout) is float:
        return o
    return Park(float(timeout), o.on_timeout)


def park(
    timeout: float | datetime.timedelta | None = None, on_timeout: OnTimeout = "compensate"
) -> Park:
    """Persist the flow and stop until `Engine.wake` (or a published event) resumes it.

    `timeout`: seconds (finite, >= 0) or a `datetime.timedelta` (>= 0) after which the park times
    out, or None for never. On a timeout the flow compensates (``on_timeout="compensate"``, the
    default) or runs its next step with `Context.timed_out` set (``"continue"``). Raises
    `TypeError`/`ValueError` at once for a bad argument; raised in a step, it fails the flow at
    once (the step is not retried: the same code would make the same mistake). The step that
    parks has completed: its compensation runs if the flow compensates.
    """
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    result = checked_outcome(Park(timeout, on_timeout))
    assert isinstance(result, Park)
    return result


def fail(reason: str = "failed") -> Fail:
    """Stop and compensate the steps that completed, in reverse order; the flow ends `FAILED`.

    `reason` (a str) becomes the flow's `error`. The failing step's own compensation does not run.
    A reason that is not a str raises `TypeError`, one that cannot be stored (a lone surrogate,
    a NUL) `ValueError`; raised in a step, it fails the flow at once.
    """
    result = checked_outcome(Fail(reason))
    assert isinstance(result, Fail)
    return result


def idempotency_key(flow_id: str, step_index: int, step: str, *, compensation: bool) -> str:
    """The idempotency key of a step, ``f"{flow_id}/{step_index}/{step}"``, or of its
    compensation, ``f"{flow_id}/{step_index}-compensate/{step}"``.

    No two (flow, step or compensation) share a key, whatever characters flow ids hold: a step
    name holds no ``/`` (`Plan.step` refuses it), so a key splits from the right into its step
    name, then a middle part, then the flow id; the middle part is a bare number for a step and
    ``<number>-compensate`` for a compensation, so neither kind can be mistaken for the other.
    """
    if compensation:
        return f"{flow_id}/{step_index}-compensate/{step}"
    return f"{flow_id}/{step_index}/{step}"


def whole_deadline(seconds: object) -> float | None:
    """A whole flow's `deadline` given to ``start`` (seconds from now, finite and > 0, or
    None), as a float; `TypeError`/`ValueError` naming what was wrong."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(
            f"deadline must be a number of seconds or None, got {describe(seconds, 60)}"
        )
    if not (finite(seconds) and seconds > 0):
        raise ValueError(f"deadline must be finite and > 0 seconds, got {shown_number(seconds)}")
    return float(seconds)
