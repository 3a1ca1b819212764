"""A ledger service for a fleet: newline-delimited JSON over TCP, a per-key ferry, PostgreSQL.

    python examples/ledger_service.py --dsn "host=... dbname=..." [--port 0] [--port-file PATH]

Each line a client sends is one input::

    {"id": "c1-17", "kind": "transfer", "account": "acct-3", "amount": 5, "to": "acct-9"}

and each gets one line back, in completion order (match replies by `id`)::

    {"id": "c1-17", "outcome": "ok", "answer": {"ok": true, "balance": 40}}

`outcome` is one of: ``ok`` (done and confirmed), ``refused`` (done: refused on its merits, e.g.
insufficient funds), ``committed`` (durable, view not confirmed yet: do not resubmit),
``rejected`` / ``failed`` / ``closed`` (nothing is known to be done: retry with the same id and
content), ``id_reused`` (the id was used with other content: a client bug) or ``error`` (a
malformed line). Clients follow docs/fleet.md: retry on rejected, failed, closed, a dropped
connection or a timeout, always with the same id and content.

Any number of these processes may serve the same database: keys may be routed to the wrong one,
or to two at once, and fenced idempotent writes keep the data right. Each process also runs the
sweeper. ``--no-fencing`` is for tests only: it turns the fence off to show what goes wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

if not __package__:  # run as a script: make `examples.ledger_domain` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ferry
from examples import _cli as cli
from examples import ledger_domain as ledger
from ferry.projected import PostgresStore

MAX_LINE = 64 * 1024
Reply = dict[str, Any]


def parse_op(message: Any) -> ledger.Op:
    """An `Op` from one decoded line; `ValueError` if it is not a well-formed input."""
    if not isinstance(message, dict):
        raise ValueError("an input is a JSON object")
    fields = {"id", "kind", "account", "amount", "to"}
    if unknown := set(message) - fields:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    op_id, kind, account = message.get("id"), message.get("kind"), message.get("account")
    amount, to = message.get("amount"), message.get("to")
    if not isinstance(op_id, str) or not op_id:
        raise ValueError("id must be a non-empty string")
    if kind not in ("deposit", "withdraw", "transfer"):
        raise ValueError("kind must be deposit, withdraw or transfer")
    if not isinstance(account, str) or not account:
        raise ValueError("account must be a non-empty string")
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise ValueError("amount must be an integer")
    if kind == "transfer":
        if not isinstance(to, str) or not to or to == account:
            raise ValueError("a transfer needs `to`, another account")
    elif to is not None:
        raise ValueError(f"a {kind} has no `to`")
    return ledger.Op(op_id, kind, account, amount, to)


async def answer(f: ferry.PerKeyFerry[ledger.Op, Any], line: bytes) -> Reply:
    """The reply to one line. Never raises an `Exception`: every outcome is a reply."""
    message: Any = None
    try:
        message = json.loads(line)
        op = parse_op(message)
    except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        rid = message.get("id") if isinstance(message, dict) else None
        return {"id": rid, "outcome": "error", "error": str(exc)}
    reply: Reply = {"id": op.id}
    try:
        result = await f(op)
    except ferry.Rejected:
        reply["outcome"] = "rejected"
    except ferry.Failed as exc:
        reply.update(outcome="failed", error=repr(exc.__cause__))
    except ferry.Closed:
        reply["outcome"] = "closed"
    except ferry.IdReused as exc:
        reply.update(outcome="id_reused", error=str(exc))
    except ferry.FerryError as exc:  # BatchContractError, another InputError: a bug somewhere
        reply.update(outcome="error", error=repr(exc))
    else:
        if isinstance(result, ferry.Committed):
            reply.update(outcome="committed", answer=result.provisional)
        else:
            reply.update(outcome="ok" if result.get("ok", True) else "refused", answer=result)
    return reply


async def serve_connection(f: ferry.PerKeyFerry[ledger.Op, Any], stream: trio.SocketStream) -> None:
    """Read lines, answer each in its own task (so one connection can pipeline), write replies
    whole under a lock. A client that goes away only ends its own connection."""
    send_lock = trio.Lock()

    async def reply_to(line: bytes) -> None:
        reply = await answer(f, line)
        data = json.dumps(reply, separators=(",", ":")).encode() + b"\n"
        async with send_lock:
            # A client that left will retry with the same id elsewhere.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(data)

    async with stream:
        async with trio.open_nursery() as nursery:
            buffer = b""
            try:
                while chunk := await stream.receive_some(MAX_LINE):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            nursery.start_soon(reply_to, line)
                    if len(buffer) > MAX_LINE:
                        break  # no line is that long: not a client of ours
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


def write_port_file(path: str, port: int) -> None:
    """Write whole (through a rename), so that a reader never sees half of it."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(f"{port}\n")
    os.replace(tmp, path)


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM or SIGINT: store, ProjectedWrite, ferry, sweeper, TCP listener."""
    async with PostgresStore(args.dsn, connections=args.connections) as store:
        write = ledger.make_write(store, fencing=not args.no_fencing)
        await write.setup()
        async with ferry.open_per_key_ferry(
            write,
            key=ledger.op_key,
            max_batch_size=args.max_batch_size,
            max_in_flight_batches=args.in_flight,
        ) as f:
            async with trio.open_nursery() as nursery:
                await nursery.start(write.run_sweeper, args.sweep_interval)
                listeners = await trio.open_tcp_listeners(args.port, host=args.host)
                port = listeners[0].socket.getsockname()[1]
                nursery.start_soon(
                    trio.serve_listeners, lambda s: serve_connection(f, s), listeners
                )
                if args.port_file:
                    write_port_file(args.port_file, port)
                fencing = "OFF (test only)" if args.no_fencing else "on"
                print(f"ledger service pid {os.getpid()} on {args.host}:{port}, fencing {fencing}")
                sys.stdout.flush()
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        break
                nursery.cancel_scope.cancel()


CLIENT = """\
a session from a shell (one input per line in, one reply per line out, in completion order):

  python examples/ledger_service.py --dsn "dbname=ledger" --port 7000 &
  echo '{"id": "c1-1", "kind": "deposit", "account": "acct-1", "amount": 5}' | python -c \\
    "import socket, sys; s = socket.create_connection(('127.0.0.1', 7000)); \\
    s.sendall(sys.stdin.buffer.read()); s.shutdown(socket.SHUT_WR); \\
    print(s.makefile().read(), end='')"
"""


def build_parser() -> cli.ArgumentParser:
    p = cli.parser(__doc__, epilog=CLIENT)
    p.connects(
        p.add_argument(
            "--dsn",
            metavar="DSN",
            required=True,
            type=cli.postgres_dsn,
            help="PostgreSQL connection string, checked at start (required)",
        )
    )
    p.add_argument("--host", metavar="HOST", default="127.0.0.1", help="address to listen on")
    p.add_argument(
        "--port",
        metavar="N",
        type=cli.integer(0, 65535),
        default=0,
        help="port to listen on (0: any free port)",
    )
    p.add_argument(
        "--port-file",
        metavar="PATH",
        help="write the bound port to this file once listening (default: no file)",
    )
    p.add_argument(
        "--connections", metavar="N", type=cli.integer(1), default=4, help="PostgreSQL connections"
    )
    cli.add_ferry_options(p)
    p.add_argument(
        "--sweep-interval",
        metavar="SECONDS",
        type=cli.number(0, above=True),
        default=1.0,
        help="seconds between sweeps of unprojected records",
    )
    p.add_argument(
        "--no-fencing",
        action="store_true",
        help="TEST ONLY: turn the per-key fence off (ProjectedWrite(fencing=False)) to show that"
        " wrong routing then corrupts the ledger. Never use it in production.",
    )
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


if __name__ == "__main__":
    with cli.ctrl_c("ledger_service.py"):
        cli.run(serve, parse(sys.argv[1:]))
