"""Serving the dashboard: hypercorn's trio worker, on 127.0.0.1 unless told otherwise.

`open_dashboard` makes the app of one store (the reads, the operator engine's store, the
token); `serve` runs it under hypercorn until cancelled. `run_command` is what
``python -m ferry.flow STORE serve`` runs: it prints the address and the token, then serves until
Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import socket
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from ferry.projected import PostgresStore

from ._app import Dashboard, loopback_hosts
from ._reads import Reader

_log = logging.getLogger("ferry.flow")


class CannotListen(Exception):
    """The server could not bind its address (the message says which, and why)."""


@contextlib.asynccontextmanager
async def open_dashboard(
    spec: str,
    *,
    where: str,
    is_dsn: bool,
    read_only: bool = False,
    token: str | None = None,
    trace_url: str | None = None,
) -> AsyncIterator[Dashboard]:
    """The dashboard of the store `spec` (an SQLite path, or a PostgreSQL DSN if `is_dsn`), for
    the duration of the ``async with``; a new random token unless one is given; `trace_url`: the
    template of a link from a flow's page to its trace (`_trace_url`)."""
    token = secrets.token_urlsafe(24) if token is None else token
    if not is_dsn:
        yield Dashboard(
            reader=Reader(path=spec),
            store=spec,
            where=where,
            token=token,
            read_only=read_only,
            trace_url=trace_url,
        )
        return
    store = PostgresStore(spec, connections=2, connect_timeout=3.0)
    try:
        yield Dashboard(
            reader=Reader(store=store),
            store=store,
            where=where,
            token=token,
            read_only=read_only,
            trace_url=trace_url,
        )
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def _check_address(host: str, port: int) -> None:
    """Bind `host`:`port` once and let it go, so that an address in use (or not this
    machine's) is one clear `CannotListen` rather than an error from inside the server."""
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _name, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        raise CannotListen(
            f"cannot listen on {_bind(host, port)}: {exc.strerror or exc}"
            " (pick another --port or --host)"
        ) from None


async def serve(
    dashboard: Dashboard,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `dashboard` on `host`:`port` until cancelled; `task_status.started` gets its base
    URL (with the port the system chose, for port 0)."""
    config = Config()
    config.bind = [_bind(host, port)]
    config.accesslog = None
    config.errorlog = _log
    config.graceful_timeout = 1.0
    app: Any = dashboard.app(hosts=loopback_hosts(host))

    async with trio.open_nursery() as nursery:
        urls: list[str] = await nursery.start(partial(hypercorn_serve, app, config))
        task_status.started(urls[0] if urls else f"http://{_bind(host, port)}")


async def run_command(
    spec: str,
    *,
    where: str,
    is_dsn: bool,
    host: str,
    port: int,
    read_only: bool,
    trace_url: str | None = None,
) -> None:
    """``python -m ferry.flow STORE serve``: print where and the token, then serve until
    SIGINT (Ctrl-C) or SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with (
            open_dashboard(
                spec, where=where, is_dsn=is_dsn, read_only=read_only, trace_url=trace_url
            ) as dashboard,
            trio.open_nursery() as nursery,
        ):
            await _check_address(host, port)
            url = await nursery.start(partial(serve, dashboard, host=host, port=port))
            lines = [f"ferry.flow dashboard for {where} on {url}/"]
            if read_only:
                lines.append("read-only: it shows no actions and refuses every POST")
            else:
                lines.append(
                    "token for actions (wake, cancel, resume, abandon; asked once per"
                    f" browser): {dashboard.token}"
                )
            if loopback_hosts(host) is None:
                lines.append(
                    f"bound to {host}: reachable from other machines; anyone who can reach it can"
                    " read the flows (actions still need the token)"
                )
            lines.append("Ctrl-C stops it")
            print("\n".join(lines), flush=True)
            async for _ in signals:  # Ctrl-C or a polite kill: stop serving, exit 0
                _log.info("dashboard for %s stopped", where)
                nursery.cancel_scope.cancel()
                break
