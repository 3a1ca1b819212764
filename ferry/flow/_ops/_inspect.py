"""The flow inspector: ``python -m ferry.flow STORE COMMAND``, for operators.

It looks at the flows of a store (an SQLite file or a PostgreSQL DSN) -- ``list``, ``show``,
``stats`` -- and acts on one flow, or on every flow a filter matches (`_bulk`) -- ``wake``,
``cancel``, ``resume`` -- through the engine API,
with an operator's engine (``open_engine(store, [], serve=False)``): it needs none of the
application's plans (it reads the plan shapes that engines recorded in the store), it runs no
step and holds no lease. What its action makes runnable is left to the engines that serve the
store: on PostgreSQL the next scan of any of them takes it over; on SQLite, where one engine at a
time holds the file (an OS-level lock), the operator's engine needs that lock too, so while a
service engine holds the file the actions are refused with a clear error (make the call through
that engine's API, or stop it first) and the next engine to open the file runs what the action
made runnable. The reading commands take no lock and work while engines run.

``schedules`` lists the stored schedules, ``schedule pause|unpause|trigger NAME`` acts on one
(`_inspect_schedules`).

``purge --finished-before TIME`` deletes finished flows by hand, as ``open_engine(retain=)``
does (`_store._purge`: batches of 500, safe beside running engines, on SQLite too: a
finished flow is never written again). It counts them and asks first, unless ``--yes``.

Output is a readable table, or JSON with ``--json``. Errors are one line on stderr: exit status
2 for bad arguments, 1 for everything else that went wrong (an unknown flow, an action that did
not apply, an unreachable store).

This module is the command line itself (its arguments, the dispatch, the exit status); the store
checks, the reads and their rendering are in `_inspect_read`, the actions in `_inspect_act`.
"""

from __future__ import annotations

import argparse
import getpass
import json
import math
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Sequence
from typing import NoReturn

import trio

from ferry._text import shown
from ferry.projected import PostgresStore, SqliteStore

from .._model import _times
from .._model._checks import shown_number
from .._model._types import Json
from .._store import _purge, _query
from . import _bulk
from ._inspect_act import do_abandon, do_cancel, do_purge, do_resume, do_wake, so_far
from ._inspect_read import (
    PROG,
    Problem,
    do_list,
    do_stats,
    is_dsn,
    one_line,
    open_store,
)
from ._inspect_schedules import add_commands as _schedule_commands
from ._inspect_schedules import do_schedule, do_schedules
from ._inspect_show import do_show
from ._trace_url import check as _trace_url_check


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line (and a pointer to ``--help``), not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


#: The most a count on the command line may be (--limit, --oldest): more than any store holds.
COUNT_MAX = 10**9


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= COUNT_MAX:
        raise argparse.ArgumentTypeError(
            f"{shown_number(text)} is not a whole number >= 1 and <= {COUNT_MAX}"
        )
    return n


def _seconds(text: str) -> float:
    try:
        n = float(text)
    except ValueError:
        n = math.nan
    if not 0 < n <= 86_400:
        raise argparse.ArgumentTypeError(
            f"{shown_number(text)} is not a number of seconds > 0 and <= 86400"
        )
    return n


def _cursor(text: str) -> str:
    try:
        return _query.check_cursor(_bulk.utf8(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave it out for no deduplication)")
    return _bulk.utf8(text)


def _said(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must say something: it is recorded in the history")
    return _bulk.utf8(text)


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value (JSON has no NaN and Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{shown_number(text)} is too big for a float (JSON numbers are finite)")
    return value


def _json_value(text: str) -> Json:
    try:
        value: Json = json.loads(text, parse_constant=_not_json, parse_float=_finite_float)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    return value


def _operator() -> str:
    """``user@host`` of whoever runs the inspector (recorded by ``abandon``)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def _before(text: str) -> float:
    now = time.time()
    try:
        when = _times.read(text, now, units="smhdw")
        if when is None:
            raise ValueError(
                f"{shown_number(text)} is not a time: give an ISO 8601 date or time"
                " (2026-11-01, 2026-11-01T12:00:00Z; UTC unless it says otherwise) or an age"
                " such as 7d, 12h, 30m, 90s, 2w"
            )
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if when > now:
        raise argparse.ArgumentTypeError(
            f"{text!r} is in the future: every finished flow ended before it, including those"
            " that end from now on; give a time in the past or an age (7d)"
        )
    return when


def parser() -> argparse.ArgumentParser:
    """The command line: STORE, then one subcommand, each built by its own function below."""
    p = _Parser(
        prog=PROG,
        description="Look at the flows of a ferry.flow store, and wake, cancel or resume one.",
        epilog="STORE is an SQLite file, or a PostgreSQL DSN"
        " ('postgresql://user@host/db' or 'host=... dbname=...').",
    )
    p.add_argument("store", metavar="STORE", help="an SQLite file or a PostgreSQL DSN")
    p.add_argument(
        "--json", dest="json_first", action="store_true", help="the same as COMMAND --json"
    )
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=summary, description=summary)

    def acting(name: str, summary: str, what: str) -> argparse.ArgumentParser:
        c = sub.add_parser(
            name, parents=[common], help=summary, description=f"{summary} {_ONE_OR_MANY}"
        )
        _one_or_many(c, what)
        return c

    _list_arguments(
        command(
            "list",
            "List flows, newest started first (in id order with --id-prefix), and filter them.",
        )
    )
    show = command("show", "One flow: its state, and its history as a table.")
    show.add_argument("flow_id", metavar="FLOW_ID", type=_bulk.utf8)
    _stats_arguments(
        command(
            "stats",
            "Counts by state and plan, the oldest parked flows, failed and blocked flows grouped"
            " by their error, the engines.",
        )
    )
    _wake_arguments(acting("wake", "Put a message in a flow's mailbox (Engine.wake).", "to wake"))
    cancel = acting(
        "cancel", "Stop a running or parked flow; it compensates (Engine.cancel).", "to cancel"
    )
    cancel.add_argument(
        "--reason", type=_bulk.utf8, default="cancelled by an operator", help="recorded as why"
    )
    acting("resume", "Re-drive a BLOCKED flow (Engine.resume).", "to resume")
    _abandon_arguments(
        acting(
            "abandon",
            "End a BLOCKED flow FAILED without running the compensations left on it, the failing"
            " one among them (Engine.abandon): once their effect was handled by hand.",
            "to abandon",
        )
    )
    _purge_arguments(
        command(
            "purge",
            "Delete finished (COMPLETED or FAILED) flows that ended before a time, with their"
            " history and mailbox, as open_engine(retain=) does; after it asks (see --yes).",
        )
    )
    _schedule_commands(sub, common, _bulk.utf8, _seconds)
    what = (
        "Serve the dashboard, a web page of the flows with wake, cancel and resume buttons"
        " (needs: pip install 'stm-ferry[dashboard]')."
    )
    serve = sub.add_parser("serve", help=what, description=what)  # no --json: it prints no table
    serve.set_defaults(json=False)
    _serve_arguments(serve)
    return p


def _list_arguments(ls: argparse.ArgumentParser) -> None:
    _bulk.add_filters(ls, "to list")
    ls.add_argument(
        "--limit", metavar="N", type=_count, default=50, help="at most this many (default 50)"
    )
    ls.add_argument(
        "--after",
        metavar="CURSOR",
        type=_cursor,
        help="the page after this cursor (list prints it when more flows match than --limit)",
    )


def _stats_arguments(stats: argparse.ArgumentParser) -> None:
    stats.add_argument(
        "--oldest", type=_count, default=10, help="how many parked flows to list (default 10)"
    )
    stats.add_argument(
        "--limit",
        metavar="N",
        type=_count,
        default=20,
        help="how many groups of failed and blocked flows by error to show (default 20)",
    )


#: What the description of each action on one flow or many says after its summary.
_ONE_OR_MANY = (
    "Give FLOW_ID for one flow, or filters for every flow they match: the count is shown and"
    " confirmed (y/N on stdin; --yes skips the question), then each flow is acted on in its"
    " own write."
)


def _one_or_many(c: argparse.ArgumentParser, what: str) -> None:
    """The arguments every action on one flow or on a filter's flows has."""
    c.add_argument(
        "flow_id",
        metavar="FLOW_ID",
        nargs="?",
        type=_bulk.utf8,
        help="one flow (or use filters)",
    )
    _bulk.add_filters(c, what)
    c.add_argument("--limit", metavar="N", type=_count, help="act on at most this many matches")
    c.add_argument("--yes", action="store_true", help="do not ask: act on every match")
    c.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_seconds,
        default=10.0,
        help="how long to wait for the answer of the engine serving the store (default 10;"
        " the request stays stored after it and is applied when an engine takes it)",
    )


def _wake_arguments(wake: argparse.ArgumentParser) -> None:
    wake.add_argument("--payload", type=_json_value, default=None, help="JSON (default null)")
    wake.add_argument(
        "--message-id",
        type=_nonempty,
        help="deduplicates: a repeat is reported DUPLICATE",
    )


def _abandon_arguments(abandon: argparse.ArgumentParser) -> None:
    abandon.add_argument("--reason", type=_said, required=True, help="recorded as why (required)")
    abandon.add_argument(
        "--by",
        type=_said,
        default=_operator(),
        help="recorded as who (default: this user@host)",
    )


def _purge_arguments(purge: argparse.ArgumentParser) -> None:
    purge.add_argument(
        "--finished-before",
        metavar="TIME",
        type=_before,
        required=True,
        help="ISO 8601 (2026-11-01, 2026-11-01T12:00:00Z; UTC unless it says otherwise) or an"
        " age: 7d, 12h, 30m, 90s, 2w",
    )
    purge.add_argument(
        "--plan", metavar="NAME", type=_bulk.utf8, help="only the flows of this plan (its name)"
    )
    purge.add_argument(
        "--state",
        choices=_purge.FINISHED_STATES,
        help="only the flows that ended in this state (keep failed flows longer, say)",
    )
    purge.add_argument(
        "--flow",
        metavar="ID",
        type=_bulk.utf8,
        help="only this flow, a top-level one, with its whole tree of child flows (a child"
        " goes only with its parent's tree: refused, naming its parent)",
    )
    purge.add_argument("--yes", action="store_true", help="delete without asking")


def _serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine)"
    )
    serve.add_argument("--port", type=_port, default=8080, help="the port (default 8080)")
    serve.add_argument(
        "--read-only", action="store_true", help="show no buttons and refuse every action"
    )
    serve.add_argument(
        "--trace-url",
        type=_trace_url,
        default=None,
        metavar="TEMPLATE",
        help="link each flow's page to its trace: an http(s) address holding {trace_id}, e.g."
        " 'https://jaeger.example/trace/{trace_id}'",
    )


def _trace_url(text: str) -> str:
    try:
        return _trace_url_check(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535; 0: any free one)")
    return n


async def do_serve(args: argparse.Namespace, store: SqliteStore | PostgresStore) -> None:
    try:
        from ._dashboard._serve import CannotListen, run_command
    except ImportError as exc:
        raise Problem(
            f"the dashboard needs its extra ({(exc.name or '?').split('.')[0]} is missing):"
            " pip install 'stm-ferry[dashboard]'"
        ) from None
    try:
        await run_command(
            args.store,
            where=args.where,
            is_dsn=is_dsn(args.store),
            host=args.host,
            port=args.port,
            read_only=args.read_only,
            trace_url=args.trace_url,
        )
    except CannotListen as exc:
        raise Problem(str(exc)) from None


COMMANDS = {
    "serve": do_serve,
    "list": do_list,
    "show": do_show,
    "stats": do_stats,
    "wake": do_wake,
    "cancel": do_cancel,
    "resume": do_resume,
    "abandon": do_abandon,
    "purge": do_purge,
    "schedules": do_schedules,
    "schedule": do_schedule,
}


async def run(args: argparse.Namespace) -> None:
    store = open_store(args.store)
    try:
        if args.command == "serve":  # the server stops on Ctrl-C its own way
            await do_serve(args, store)
        else:
            await _until_ctrl_c(COMMANDS[args.command](args, store))
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


async def _until_ctrl_c(command: Awaitable[None]) -> None:
    """Run `command`; Ctrl-C (SIGINT) cancels it, so that the engine call in hand did not happen
    and every engine closes as at the end of its block, then raises KeyboardInterrupt (trio's
    default would raise it wherever the code is, even inside a library's bookkeeping). Off the
    main thread (`main` called from a program's worker thread) signals cannot be received: the
    command just runs."""
    if threading.current_thread() is not threading.main_thread():
        await command
        return
    interrupted = False

    async def watch(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nonlocal interrupted
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                interrupted = True
                scope.cancel()
                return

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(watch)
            try:
                await command
            finally:
                nursery.cancel_scope.cancel()
    if interrupted:
        raise KeyboardInterrupt


def _usage(p: argparse.ArgumentParser, message: str) -> int:
    """Report bad arguments as argparse does (one line); the exit status, 2."""
    try:
        p.error(message)
    except SystemExit as done:
        return int(done.code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; its exit status (0, 1 for a problem, 2 for bad arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    if argv and argv[0] in COMMANDS and not os.path.exists(argv[0]):
        rest = " ".join(argv[1:]) or "STORE"
        return _usage(p, f"the store comes first: {PROG} {rest.split()[0]} {argv[0]} ...")
    try:
        args, extras = p.parse_known_args(argv)
    except SystemExit as done:
        return int(done.code or 0)
    if extras:
        return _usage(p, _unrecognized(args, extras))
    args.json = args.json or args.json_first
    args.where = shown(args.store)
    if args.command in ("list", "wake", "cancel", "resume", "abandon"):
        try:
            args.filter = _bulk.flow_filter(args)
        except ValueError as exc:
            return _usage(p, str(exc))
    if args.command in ("wake", "cancel", "resume", "abandon"):
        if args.flow_id is not None and _bulk.has_filters(args):
            return _usage(p, f"{args.command}: give FLOW_ID or filters, not both")
        if args.flow_id is None and not _bulk.has_filters(args):
            return _usage(
                p,
                f"{args.command}: give FLOW_ID, or filters (--state, --plan, ...) to"
                f" {args.command} every flow they match",
            )
    try:
        trio.run(run, args)
    except BaseException as error:
        if not _interrupted(error):
            if isinstance(error, Exception):
                return _failed(error, args)
            raise
        if args.command == "serve":  # how a server is stopped
            return 0
        print(f"{PROG}: interrupted{_how_far(args)}", file=sys.stderr)
        return 130
    return 0


def _failed(error: Exception, args: argparse.Namespace) -> int:
    if _broken_pipe(error):  # the reader went away (`| head`): nothing to say to anyone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    print(f"{PROG}: error: {one_line(error, args.store)}", file=sys.stderr)
    return 1


def _unrecognized(args: argparse.Namespace, extras: list[str]) -> str:
    """What argparse would say about words it did not expect, and for the likeliest one (a
    wake's payload written after the flow id, as in ``Engine.wake(flow_id, payload)``) how to
    give it."""
    one_word = len(extras) == 1 and not extras[0].startswith("-")
    if args.command == "wake" and args.flow_id is not None and one_word:
        word = extras[0]
        fid, payload = shlex.quote(args.flow_id), shlex.quote(word)
        return f"wake: the payload goes in --payload: {PROG} STORE wake {fid} --payload {payload}"
    return f"unrecognized arguments: {' '.join(extras)}"


def _interrupted(error: BaseException) -> bool:
    """A Ctrl-C: KeyboardInterrupt, alone or in trio's exception groups."""
    if isinstance(error, BaseExceptionGroup):
        return all(_interrupted(e) for e in error.exceptions)
    return isinstance(error, KeyboardInterrupt)


def _how_far(args: argparse.Namespace) -> str:
    """For a bulk action stopped by Ctrl-C: how far it got, and how to go on."""
    done = getattr(args, "done", None)
    if done is None:
        return ""
    return (
        f": {so_far(args, done, 'stopped after')}; the flow in hand when it stopped may have"
        " been acted on too, the others are untouched: run the same command again to act on"
        " what still matches"
    )


def _broken_pipe(error: BaseException) -> bool:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return isinstance(error, BrokenPipeError)
