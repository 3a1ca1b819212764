"""The inspector's ``show FLOW_ID``: a flow's state, who runs it, its data, its family (SPEC 5.7:
its parent, and each spawn's phase and counters with its children's keys, states and ids), its
events and its stream's last values (SPEC 5.10), then its history; ``--json`` carries the same.
One read-only transaction (`_inspect_read.read_store`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from typing import Any

from ferry.projected import PostgresStore, SqliteStore

from .._model import _values
from .._model._types import Event, Json, State
from .._model._values import ACTIVE, Flow, Mailbox
from .._store import _lineage, _queue_view, _signals, _store
from .._store._lineage import Family
from .._store._queue_view import Waits
from ._inspect_read import (
    Problem,
    cut,
    deadline_text,
    detail_text,
    flow_json,
    output,
    read_store,
    safe,
    step_text,
    table,
    when,
)

__all__ = ["do_show", "family_json", "family_lines", "signal_lines", "signals_json"]


async def do_show(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    now = time.time()

    def read(tx: Any) -> tuple[Flow | None, Any, Any, Any, bool, Family | None, Any, Any]:
        f = _store.load(tx, args.flow_id)
        if f is None:
            return None, None, None, None, False, None, None, None
        events = _store.load_history(tx, args.flow_id) or []
        box = _store.load_mailbox(tx, args.flow_id)
        hold = _store.holder(tx, args.flow_id, _store.lease_clock(tx, now))  # docs/adr/0110
        waits = _queue_view.waiting(tx, f, now)
        out = _signals.shown(tx, args.flow_id)
        return f, events, box, hold, _store.leased(tx), _lineage.family_of(tx, f), waits, out

    f, events, box, hold, leased, family, waits, out = await read_store(store, args.where, read)
    if f is None:
        raise Problem(f"no flow has id {args.flow_id!r} in {args.where}")
    held = None
    if hold is not None:
        until, orphaned = hold
        held = {"owner": f.owner, "until": until if until > -math.inf else None, "lapsed": orphaned}
    assert family is not None
    lines = _show_lines(f, events, box, held, leased, now)
    at = lines.index("")  # the history's table comes after the snapshot's lines
    queue = queue_lines(f, waits)
    said = [*lines[:at], *queue, *signal_lines(*out), *family_lines(f, family), *lines[at:]]
    queued = {"not_before": f.not_before, "waits_for": None if waits is None else waits.json()}
    shown = {**_show_json(f, events, box, held), **queued, "family": family_json(family)}
    output(args, "\n".join(said), {**shown, **signals_json(*out)})


def queue_lines(f: Flow, waits: Waits | None) -> list[str]:
    """What ``show`` says of a flow's place in its plan's queue (SPEC 5.8): why a queued flow
    waits, and a delayed start's time."""
    lines = []
    if waits is not None:
        lines.append(f"waits for {safe(waits.text)}")
    if f.not_before is not None:
        lines.append(f"starts at {when(f.not_before)} (delayed start)")
    return lines


def signal_lines(events: dict[str, str], length: int, last: list[tuple[int, str]]) -> list[str]:
    """The lines of ``show`` that say the flow's events (SPEC 5.10) and its stream's last
    values; nothing for a flow that set and emitted nothing."""
    lines = []
    if events:
        text = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in events.items())
        lines.append(f"events    {safe(cut('{' + text + '}', 200))}")
    if length:
        values = " | ".join(f"{n} {cut(v, 60)}" for n, v in last)
        lines.append(f"stream    {length} values; the last {len(last)}: {safe(values)}")
    return lines


def signals_json(
    events: dict[str, str], length: int, last: list[tuple[int, str]]
) -> dict[str, Json]:
    """What ``show --json`` says of the flow's events and stream (`signal_lines`, as data)."""
    return {
        "events": {k: json.loads(v) for k, v in events.items()},
        "stream": {"length": length, "last": [[n, json.loads(v)] for n, v in last]},
    }


def _show_json(
    f: Flow, events: Sequence[Event], box: Mailbox, held: dict[str, Any] | None
) -> dict[str, Json]:
    """What ``show --json`` prints: the flow, who holds it, its queued messages, its history."""
    return {
        "flow": flow_json(f),
        "held": held,
        "queued": [
            {"message_id": q.message_id, "payload": json.loads(q.payload)} for q in box.queued
        ],
        "history": [
            {
                "revision": e.revision,
                "at": e.at,
                "kind": e.kind,
                "step": e.step,
                "attempt": e.attempt,
                "detail": e.detail,
            }
            for e in events
        ],
    }


def _show_lines(
    f: Flow,
    events: Sequence[Event],
    box: Mailbox,
    held: dict[str, Any] | None,
    leased: bool,
    now: float,
) -> list[str]:
    """What ``show`` prints: the flow's state, who runs it, its data, then its history."""
    snap = _values.snapshot(f)
    lines = [
        f"flow      {safe(f.flow_id)}",
        f"plan      {safe(f.plan)} version {f.version}",
        f"state     {f.state.name}",
        f"step      {safe(step_text(f))} (attempt {f.attempt})",
        f"revision  {f.revision}, last written {when(f.updated_at)}",
    ]
    if snap.error is not None:
        what = "blocked" if f.state is State.BLOCKED else "error"
        lines.append(f"{what:<9} {safe(snap.error)}")
    if f.park_deadline is not None:
        lines.append(
            f"deadline  {deadline_text(f.park_deadline, now)}; then {safe(f.on_timeout)}"
            " (on timeout)"
        )
    trace = _values.trace_id(f.trace)
    if trace is not None:
        lines.append(f"trace     {trace}")
    if held is not None:
        status = "lapsed: any engine may take it over" if held["lapsed"] else "held"
        lines.append(f"engine    {safe(f.owner)}, until {when(held['until'])} ({status})")
    elif f.state in ACTIVE and not leased:
        lines.append(
            "engine    the engine that holds the file runs it (with none open, the next engine"
            " to open the file)"
        )
    elif f.state in ACTIVE:
        lines.append("engine    none: the next engine to scan the store runs it")
    if box.queued:
        lines.append(f"queued    {', '.join(safe(q.message_id) for q in box.queued)}")
    lines.append(f"data      {safe(cut(json.dumps(snap.data, ensure_ascii=False), 200))}")
    rows = [
        [
            e.revision,
            when(e.at),
            e.kind,
            e.step,
            e.attempt,
            "" if e.detail is None else detail_text(e.detail, now),
        ]
        for e in events
    ]
    return [*lines, "", table(("REV", "AT", "KIND", "STEP", "ATTEMPT", "DETAIL"), rows)]


def family_lines(f: Flow, family: Family) -> list[str]:
    """The lines of ``show`` that name the flow's parent and list each of its spawns (phase,
    counters, options) with its children (key, state, id), the first
    `_lineage.CHILDREN_SHOWN` of each; nothing for a flow with neither."""
    lines = []
    if family.parent is not None:
        state = family.parent_state or "gone"
        lines.append(f"parent    {safe(family.parent)} ({state})")
    for s in family.spawns:
        counts = f"{s.total} children: {s.active} active, {s.ended} ended, {s.kept} kept"
        also = f"max_running {s.max_running}, on_failure {s.on_failure}"
        why = "" if s.reason is None else f", stopped: {safe(s.reason)}"
        lines.append(f"spawn     step {s.step_index}: {s.phase}; {counts} ({also}{why})")
        rows = [[k.key, k.state + (" (undone)" if k.undone else ""), k.flow_id] for k in s.children]
        lines += ["", table(("KEY", "STATE", "CHILD"), rows)]
        if s.more:
            lines.append(
                f"({s.more} more: list --parent {safe(f.flow_id)} lists them all, --json too)"
            )
        lines.append("")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def family_json(family: Family) -> dict[str, Json]:
    """What ``show --json`` says of the flow's family (`family_lines`, as data)."""
    return {
        "parent": family.parent,
        "parent_state": family.parent_state,
        "spawns": [
            {
                "step_index": s.step_index,
                "phase": s.phase,
                "total": s.total,
                "active": s.active,
                "ended": s.ended,
                "kept": s.kept,
                "max_running": s.max_running,
                "on_failure": s.on_failure,
                "reason": s.reason,
                "undoing": s.undoing,
                "children": [
                    {
                        "key": k.key,
                        "state": k.state,
                        "flow_id": k.flow_id,
                        "plan": k.plan,
                        "version": k.version,
                        "undone": k.undone,
                        "ended": k.ended,
                    }
                    for k in s.children
                ],
                "children_left_out": s.more,
            }
            for s in family.spawns
        ],
    }
