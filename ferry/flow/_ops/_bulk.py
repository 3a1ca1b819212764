"""The inspector's filters and its actions on many flows at once.

``list``, ``cancel``, ``resume``, ``abandon`` and ``wake`` take the same filters
(`add_filters`): state, plan, version, step, when a flow was last written or started (ISO 8601
or a duration before now), an id prefix and a text in the error. They become one
`_query.FlowFilter`, so that the inspector and the dashboard find the same flows in the same
order (newest started first; id order with an id prefix).

An action on a filter (`act`) counts the matches first, says how many and asks (``--yes``
skips the question), then acts on each match through a client (`flow.connect`): one request
per flow, applied by the engine serving the store, or, with none serving, by the client itself
through one operator's engine held for the whole action; each flow its own write: a flow that
moved on meanwhile (a parked flow woken and completed before its cancel came) is reported as
not acted on, and the others go on. Nothing is done before the answer; an interrupted run
leaves every flow either acted on or untouched.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from ferry.projected import Store

from .._engine._client import Client, connect
from .._model import _times
from .._model._checks import shown_number
from .._model._plan import MAX_VERSION
from .._model._types import State
from .._model._values import Flow
from .._store import _inbox, _query
from .._store._query import FlowFilter

#: The filter options: (flag, FlowFilter field).
FILTERS = (
    ("--state", "state"),
    ("--plan", "plan"),
    ("--version", "version"),
    ("--step", "step"),
    ("--since", "updated_after"),
    ("--until", "updated_before"),
    ("--started-since", "created_after"),
    ("--started-until", "created_before"),
    ("--id-prefix", "id_prefix"),
    ("--error", "error"),
    ("--parent", "parent"),
)
_WHEN = (
    "ISO 8601 (2026-12-01T12:00, UTC unless it names a zone) or a duration before now"
    " (90s, 15m, 2h, 3d)"
)


def _state(text: str) -> State:
    try:
        return State[text.upper()]
    except KeyError:
        names = ", ".join(s.name for s in State)
        raise argparse.ArgumentTypeError(f"no state {text!r}; one of {names}") from None


def _version(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_VERSION:
        raise argparse.ArgumentTypeError(
            f"{shown_number(text)} is not a plan version (a whole number from 1 to {MAX_VERSION})"
        )
    return n


def utf8(text: str) -> str:
    """An argparse type: `text` as it is, if it is valid UTF-8 text. A shell hands Python bytes
    that are not UTF-8 (a terminal in another encoding, a mangled paste) as lone surrogates,
    which no flow id, plan, step or message id can hold: say so, instead of a codec error."""
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            raise argparse.ArgumentTypeError(
                f"{text!r} is not valid UTF-8 text ({ch!r} at index {i}: bytes the shell could"
                " not decode, or a lone surrogate); nothing in a store holds it: check the"
                " terminal's encoding (LANG, LC_ALL) and retype it"
            )
    return text


def _name(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave it out to match every flow)")
    return utf8(text)


def _when(text: str) -> float:
    try:
        return _query.parse_time(text, time.time(), "time")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("time: ")) from None


def add_filters(parser: argparse.ArgumentParser, what: str) -> None:
    """The filter options, in a group of their own in `parser`'s help."""
    g = parser.add_argument_group("filters", f"which flows {what}: every filter given must hold")
    g.add_argument("--state", type=_state, help="in this state (e.g. PARKED, BLOCKED)")
    g.add_argument("--plan", metavar="NAME", type=_name, help="of this plan (its name)")
    g.add_argument("--version", metavar="N", type=_version, help="of this plan version")
    g.add_argument("--step", metavar="NAME", type=_name, help="at this step (its name)")
    g.add_argument("--since", metavar="WHEN", type=_when, help=f"last written at or after: {_WHEN}")
    g.add_argument("--until", metavar="WHEN", type=_when, help="last written before WHEN")
    g.add_argument("--started-since", metavar="WHEN", type=_when, help="started at or after WHEN")
    g.add_argument("--started-until", metavar="WHEN", type=_when, help="started before WHEN")
    g.add_argument("--id-prefix", metavar="PREFIX", type=_name, help="whose id starts so")
    g.add_argument(
        "--error",
        metavar="TEXT",
        type=_name,
        help="whose error (a blocked flow's reason) holds TEXT, in any case; %%, _ and \\ match"
        " themselves",
    )
    g.add_argument(
        "--parent", metavar="ID", type=_name, help="the children of this flow (child flows)"
    )


def has_filters(args: argparse.Namespace) -> bool:
    return any(getattr(args, _dest(flag)) is not None for flag, _ in FILTERS)


def flow_filter(args: argparse.Namespace) -> FlowFilter:
    """The filter of the command line; `ValueError` for an impossible one (a range that ends
    before it starts), in the words of the flags."""
    values = {field: getattr(args, _dest(flag)) for flag, field in FILTERS}
    for a, b in (("--since", "--until"), ("--started-since", "--started-until")):
        lo, hi = getattr(args, _dest(a)), getattr(args, _dest(b))
        if lo is not None and hi is not None and hi < lo:
            raise ValueError(f"{b} is earlier than {a}: no flow can match; swap them")
    return FlowFilter(**values)


def describe(args: argparse.Namespace) -> str:
    """The filters given, as the operator wrote them."""
    words = []
    for flag, _ in FILTERS:
        value = getattr(args, _dest(flag))
        if value is None:
            continue
        if isinstance(value, State):
            value = value.name
        elif flag in ("--since", "--until", "--started-since", "--started-until"):
            value = _times.iso(value)
        words.append(f"{flag} {value}")
    return " ".join(words)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


# ---------------------------------------------------------------------------------- reading


def matching(
    tx: Any, flt: FlowFilter, *, limit: int | None, after: str | None = None
) -> tuple[list[Flow], str | None]:
    """The first `limit` flows (all if None) matching `flt` after the cursor `after`, in the
    listing's order, read a page of at most `_query.MAX_LIMIT` at a time; and the cursor of
    the next one (None: no more match)."""
    flows: list[Flow] = []
    cursor = after
    while limit is None or len(flows) < limit:
        want = _query.MAX_LIMIT if limit is None else min(_query.MAX_LIMIT, limit - len(flows))
        page = _query.query_page(tx, flt, limit=want, after=cursor)
        flows.extend(page.flows)
        cursor = page.next
        if cursor is None:
            break
    return flows, cursor


# ---------------------------------------------------------------------------------- acting


#: What an action on one flow did: (acted, what became of it, its state after or None).
Done = tuple[bool, str, str | None]


#: Seconds between two progress lines of an action on many flows (stderr).
PROGRESS_EVERY = 1.0


class Refused(Exception):
    """The operator did not say yes: nothing was done."""


async def confirm(question: str) -> bool:
    """Ask on stderr, read one line of stdin (not on the trio thread); yes is ``y``/``yes``."""
    print(question, end="", file=sys.stderr, flush=True)
    answer = await trio.to_thread.run_sync(sys.stdin.readline)
    if not answer.endswith("\n"):
        print(file=sys.stderr)  # stdin ended: finish the question's line
    return answer.strip().lower() in ("y", "yes")


async def act(
    store: Store,
    ids: list[str],
    one: Callable[[Client, str], Awaitable[Done]],
    results: list[dict[str, Any]] | None = None,
    progress: Callable[[list[dict[str, Any]]], None] | None = None,
    *,
    timeout: float = 10.0,  # noqa: ASYNC109
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Run ``one(client, flow_id)`` for each id with one client, each its own request; a result
    per flow, in order, appended to `results` as each is done (so that a caller that is
    interrupted knows how far it got), and the heartbeat row of the serving engine that applied
    them (None: the client did, no engine serving). ``progress(results)`` is called after a flow
    at most every `PROGRESS_EVERY` seconds, and after the last one if it was called before.
    `trio.TooSlowError` if the serving engine does not answer a request in time."""
    results = [] if results is None else results
    shown_at, shown = 0.0, 0
    by: str | None = None
    async with connect(store, timeout=timeout) as client, client._holding():
        start = time.monotonic()
        for fid in ids:
            acted, what, state = await one(client, fid)
            last = client.last
            if last is not None and last.served:
                by = last.applied_by
            results.append({"flow_id": fid, "acted": acted, "result": what, "state": state})
            now = time.monotonic()
            if progress is not None and now - max(shown_at, start) >= PROGRESS_EVERY:
                progress(results)
                shown_at, shown = now, len(results)
    if progress is not None and 0 < shown < len(results):
        progress(results)  # the last line says that all were done
    beat = None
    if by is not None:
        rows = await store.transact(_inbox.heartbeats)
        beat = next((b for b in rows if b["owner"] == by), {"owner": by, "pid": None})
    return results, beat


async def state_of(engine: Client, fid: str) -> str | None:
    snap = await engine.get(fid)
    return None if snap is None else snap.state.name


async def cancel_one(engine: Client, fid: str, *, reason: str) -> Done:
    done = await engine.cancel(fid, reason)
    state = await state_of(engine, fid)
    if done:
        return True, "cancelled", state
    return False, "not cancelled: not running or parked" if state else "gone", state


async def resume_one(engine: Client, fid: str) -> Done:
    done = await engine.resume(fid)
    state = await state_of(engine, fid)
    if done:
        return True, "resumed", state
    if state == "BLOCKED":
        return False, "still blocked: its plan version still cannot drive it", state
    return False, "not resumed: not BLOCKED" if state else "gone", state


async def abandon_one(engine: Client, fid: str, *, reason: str, by: str) -> Done:
    done = await engine.abandon(fid, reason=reason, by=by)
    state = await state_of(engine, fid)
    if done:
        return True, "abandoned", state
    return False, "not abandoned: not BLOCKED" if state else "gone", state


async def wake_one(engine: Client, fid: str, *, payload: Any, message_id: str | None) -> Done:
    delivery = await engine.wake(fid, payload, message_id=message_id)
    state = await state_of(engine, fid)
    acted = delivery.name in ("RESUMED", "QUEUED")
    return acted, delivery.name, state


def one_for(args: argparse.Namespace) -> Callable[[Client, str], Awaitable[Done]]:
    """The action of the command on one flow."""
    if args.command == "cancel":
        return partial(cancel_one, reason=args.reason)
    if args.command == "resume":
        return resume_one
    if args.command == "abandon":
        return partial(abandon_one, reason=args.reason, by=args.by)
    return partial(wake_one, payload=args.payload, message_id=args.message_id)


def tally(results: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    return counts
