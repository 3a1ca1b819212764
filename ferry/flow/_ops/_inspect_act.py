"""The inspector's actions: ``wake``, ``cancel`` and ``resume`` of one flow or of every flow a
filter matches (`_bulk`), and ``purge`` of finished flows.

Each action goes through a client (`flow.connect`, docs/adr/0125): while an engine serves the
store (on SQLite too, where it holds the file), the action is a request that engine applies at
once, and the report names it (owner, pid, host) and says what it does now; with no engine
serving, the client applies it itself through an operator's engine, and what it makes runnable
is left to the next engine. A bulk action and a purge say what they match and ask first, unless
``--yes``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from ferry.projected import PostgresStore, SqliteStore

from .._engine._client import Receipt, connect
from .._model import _times
from .._model._types import Delivery, Json, State
from .._model._values import ACTIVE, Flow
from .._store import _inbox, _lineage, _purge, _query, _store
from . import _bulk
from ._inspect_read import Problem, is_dsn, output, read_store


async def _act(
    args: argparse.Namespace, store: SqliteStore | PostgresStore, call: Callable[[Any], Any]
) -> tuple[Any, Flow | None]:
    """Run ``call(client)`` with a client of the store; its result, and the flow's row after.
    Sets ``args.served_by`` (the serving engine's heartbeat row, or None: applied here)."""
    await read_store(store, args.where, lambda tx: None)  # a store without flows: say so
    try:
        async with connect(store, timeout=args.timeout) as client:
            result = await call(client)
            receipt = client.last
    except trio.TooSlowError as exc:
        raise Problem(str(exc)) from None
    after = await store.transact(partial(_store.load, flow_id=args.flow_id))
    args.served_by = await _engine_of(store, receipt)
    return result, after


async def _engine_of(store: SqliteStore | PostgresStore, receipt: Receipt | None) -> Any:
    """The heartbeat row of the engine that applied the request (None: a client did)."""
    if receipt is None or not receipt.served:
        return None
    beats = await store.transact(_inbox.heartbeats, read_only=True)
    for beat in beats:
        if beat["owner"] == receipt.applied_by:
            return beat
    return {"owner": receipt.applied_by, "pid": None, "host": None}


def _engine_words(beat: dict[str, Any]) -> str:
    where = "" if beat.get("pid") is None else f", pid {beat['pid']} on {beat['host']}"
    return f"engine {beat['owner']!r}{where}"


def _accepted(args: argparse.Namespace, what: str) -> str:
    """``accepted: the serving engine 'svc' (pid 12 on host) applied it: RESUMED``, or what a
    client applied itself."""
    beat = getattr(args, "served_by", None)
    if beat is None:
        return what  # no engine serves the store: this command applied it (`_runs_next`)
    return f"accepted: the serving {_engine_words(beat)} applied it: {what}"


def _runs_next(args: argparse.Namespace) -> str:
    beat = getattr(args, "served_by", None)
    if beat is not None:
        return f"the serving {_engine_words(beat)} runs it now"
    if is_dsn(args.store):
        return "the next scan of an engine serving the store runs it"
    return "the next engine to open the file runs it"


async def do_bulk(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    """`wake`, `cancel` or `resume` on every flow the filters match (see `_bulk`)."""
    flt = args.filter

    def read(tx: Any) -> tuple[int, list[Flow]]:  # one snapshot: the count and the matches
        flows, _ = _bulk.matching(tx, flt, limit=args.limit)
        return _query.count(tx, flt), flows

    total, flows = await read_store(store, args.where, read)
    ids = [f.flow_id for f in flows]
    which = _bulk.describe(args)
    data: dict[str, Any] = {"action": args.command, "filters": which, "matched": total}
    if not ids:
        data.update(acted=0, results=[])
        output(args, f"no flow matches {which}: nothing to {args.command}", data)
        return
    some = f" (the first {len(ids)}: --limit {args.limit})" if len(ids) < total else ""
    question = (
        f"{total} flow{'s' if total != 1 else ''} match {which}{some}."
        f" {args.command.capitalize()} {'it' if len(ids) == 1 else f'each of the {len(ids)}'},"
        " one write per flow? [y/N] "
    )
    if not args.yes and not await _bulk.confirm(question):
        raise Problem(f"not confirmed: no flow was {_DONE[args.command]}")
    args.started = time.monotonic()
    args.done, args.matched = [], len(ids)  # how far it got, if Ctrl-C stops it (`_inspect`)
    try:
        results, args.served_by = await _bulk.act(
            store,
            ids,
            _bulk.one_for(args),
            args.done,
            partial(_progress, args),
            timeout=args.timeout,
        )
    except trio.TooSlowError as exc:
        raise Problem(str(exc)) from None
    counts = _bulk.tally(results)
    acted = sum(1 for r in results if r["acted"])
    data.update(acted=acted, outcomes=counts, results=results)
    flows = f"{len(ids)} flow" + ("s" if len(ids) != 1 else "")
    lines = [_accepted(args, f"{args.command}: {flows}, {acted} {_DONE[args.command]}")]
    lines += [f"  {n:>6}  {what}" for what, n in sorted(counts.items(), key=lambda c: -c[1])]
    if acted and any(r["state"] in ("RUNNING", "COMPENSATING") for r in results):
        lines.append(f"what runs now: {_runs_next(args)}")
    output(args, "\n".join(lines), data)


_DONE = {
    "cancel": "cancelled",
    "resume": "resumed",
    "abandon": "abandoned",
    "wake": "woken or queued",
}


def so_far(args: argparse.Namespace, results: list[dict[str, Any]], how: str = "") -> str:
    """``cancel: 120 of 3000 flows done (118 cancelled)``, or with `how`, ``cancel stopped
    after 120 of 3000 flows (118 cancelled)``."""
    acted = sum(1 for r in results if r["acted"])
    which = f"{len(results)} of {args.matched} flows"
    counts = f"({acted} {_DONE[args.command]})"
    if how:
        return f"{args.command} {how} {which} {counts}"
    return f"{args.command}: {which} done {counts}"


def _progress(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """A progress line of a long bulk action, on stderr (stdout keeps the report alone)."""
    elapsed = time.monotonic() - args.started
    print(f"{so_far(args, results)}, {elapsed:.0f} s", file=sys.stderr, flush=True)


async def do_wake(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    if args.flow_id is None:
        return await do_bulk(args, store)
    delivery, after = await _act(
        args,
        store,
        lambda e: e.wake(args.flow_id, args.payload, message_id=args.message_id),
    )
    if delivery is Delivery.UNKNOWN:
        raise Problem(f"no flow has id {args.flow_id!r} in {args.where}")
    notes = {
        Delivery.RESUMED: f"it was parked and runs its next step: {_runs_next(args)}",
        Delivery.QUEUED: "kept in its mailbox: its next park takes it",
        Delivery.DUPLICATE: "this message id was delivered before: nothing changed",
        Delivery.STALE: "the flow has ended: nothing changed",
    }
    if after is not None and after.state is State.BLOCKED:
        notes[Delivery.QUEUED] = "kept in its mailbox: the flow is BLOCKED (resume it)"
    if after is not None and after.state is not State.RUNNING and args.served_by is not None:
        notes[Delivery.RESUMED] = (
            f"it was parked, and the serving engine ran it on: {after.state.name}"
        )
    elif after is not None and after.state is State.COMPLETED:
        notes[Delivery.RESUMED] = "it was parked at its last step, and the wake ended it: COMPLETED"
    output(
        args,
        _accepted(args, f"{delivery.name}: {notes[delivery]}"),
        {
            "flow_id": args.flow_id,
            "delivery": delivery.name,
            "state": None if after is None else after.state.name,
        },
    )


async def do_cancel(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    if args.flow_id is None:
        return await do_bulk(args, store)
    done, after = await _act(args, store, lambda e: e.cancel(args.flow_id, args.reason))
    if after is None:
        raise Problem(f"no flow has id {args.flow_id!r} in {args.where}")
    if not done:
        raise Problem(
            f"not cancelled: flow {args.flow_id!r} is {after.state.name} (only a running or"
            " parked flow can be cancelled)"
        )
    if after.state is State.FAILED:
        text = "cancelled: it had nothing to compensate, and has FAILED"
    elif after.owner is not None and args.served_by is None:
        text = f"cancelled: engine {after.owner} stops its step and compensates"
    else:
        text = f"cancelled: it compensates; {_runs_next(args)}"
    output(
        args,
        _accepted(args, text),
        {"flow_id": args.flow_id, "cancelled": True, "state": after.state.name},
    )


async def do_resume(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    if args.flow_id is None:
        return await do_bulk(args, store)
    done, after = await _act(args, store, lambda e: e.resume(args.flow_id))
    if after is None:
        raise Problem(f"no flow has id {args.flow_id!r} in {args.where}")
    if not done:
        why = (
            f"plan {after.plan!r} version {after.version} still cannot drive it ({after.blocked})"
            if after.state is State.BLOCKED
            else f"it is {after.state.name} (only a BLOCKED flow can be resumed)"
        )
        raise Problem(f"not resumed: flow {args.flow_id!r}: {why}")
    where = _runs_next(args) if after.state in ACTIVE else f"it is {after.state.name} again"
    output(
        args,
        _accepted(args, f"resumed: {where}"),
        {"flow_id": args.flow_id, "resumed": True, "state": after.state.name},
    )


async def do_abandon(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    if args.flow_id is None:
        return await do_bulk(args, store)
    done, after = await _act(
        args, store, lambda e: e.abandon(args.flow_id, reason=args.reason, by=args.by)
    )
    if after is None:
        raise Problem(f"no flow has id {args.flow_id!r} in {args.where}")
    if not done:
        raise Problem(
            f"not abandoned: flow {args.flow_id!r} is {after.state.name} (only a BLOCKED flow"
            " can be abandoned)"
        )
    output(
        args,
        _accepted(args, f"abandoned: it has FAILED, its compensations skipped ({after.error})"),
        {"flow_id": args.flow_id, "abandoned": True, "state": after.state.name},
    )


def _confirm(question: str) -> bool:
    """Ask on the terminal (stderr, stdin); True for yes."""
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    try:
        answer = input()
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


async def _purge_all(store: SqliteStore | PostgresStore, before: float, only: _purge.Only) -> int:
    """Delete the finished flows `only` admits that ended before `before`, one batch per
    transaction, paced as an engine's retention is (`_purge.pause_after`); how many."""
    total = 0
    while True:
        began = trio.current_time()
        deleted = await store.transact(partial(_purge.purge_batch, before=before, only=only))
        total += len(deleted)
        if len(deleted) < _purge.BATCH:
            return total
        await trio.sleep(_purge.pause_after(trio.current_time() - began))


async def do_purge(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    """Count, ask, then delete in batches (the engine's purge: safe while engines serve the
    store, on SQLite too, since a finished flow is never written again)."""
    before = args.finished_before
    when = _times.iso(before)
    if args.flow is not None:
        await _not_a_child(args, store)
    only = _purge.Only(plan=args.plan, state=args.state, flow_id=args.flow)
    count = partial(_purge.count_finished, before=before, only=only)
    matched = await read_store(store, args.where, count)
    data: dict[str, Json] = {
        "finished_before": when,
        "plan": only.plan,
        "state": only.state,
        **({} if only.flow_id is None else {"flow": only.flow_id}),
        "matched": matched,
        "deleted": 0,
    }
    which = "" if only.state is None else f" ({only.state})"
    if only.plan is not None:
        which += f" of plan {only.plan!r}"
    if only.flow_id is not None:
        which += f" of id {only.flow_id!r}"
    if not matched:
        output(args, f"no finished flow{which} ended before {when}: nothing to delete", data)
        return
    question = (
        f"delete {matched} finished flow{'s' * (matched != 1)}"
        f"{which or ' (COMPLETED or FAILED)'} that ended before {when}, with their history and"
        f" mailbox, from {args.where}?"
    )
    if not args.yes and not sys.stdin.isatty():
        raise Problem(
            f"{matched} finished flows ended before {when}; nothing was deleted: stdin is not a"
            " terminal to ask on, so add --yes to delete them"
        )
    if not args.yes and not await trio.to_thread.run_sync(
        _confirm, question, abandon_on_cancel=True
    ):
        output(args, "nothing deleted", data)
        return
    data["deleted"] = deleted = await _purge_all(store, before, only)
    output(args, f"deleted {deleted} finished flows{which} that ended before {when}", data)


async def _not_a_child(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    """`Problem` if ``purge --flow ID`` names no flow, or a child flow (SPEC 5.7: a child goes
    only with its parent's whole tree, once that parent has ended): it names the parent and
    the tree's top-level flow to purge instead."""

    def read(tx: Any) -> tuple[Flow | None, Flow | None]:
        f = _store.load(tx, args.flow)
        return f, None if f is None else _lineage.root_of(tx, f)

    f, root = await read_store(store, args.where, read)
    if f is None:
        raise Problem(f"no flow has id {args.flow!r} in {args.where}: nothing was deleted")
    if f.parent is not None:
        assert root is not None
        top = "" if root.flow_id == f.parent else f" (the top of its tree is {root.flow_id!r})"
        raise Problem(
            f"flow {f.flow_id!r} is a child of flow {f.parent!r}{top}: a child is deleted only"
            f" with its parent's whole tree, once that has ended; nothing was deleted (purge"
            f" --flow {root.flow_id} deletes the tree)"
        )
