"""The dashboard bounds request bodies before it reads them, and checks the token before it looks
anything up.

A real server (``python -m ferry.flow STORE serve``, hypercorn over a socket) is sent 50 MB
without a token, once with a ``Content-Length`` and once chunked (no length, growing past the
limit): each is answered 413, and the server's peak memory (``VmHWM``) grows by far less than the
body. Before the bound, the whole body was read before the token was looked at, and the server's
peak grew by more than the body's size (the bytes, and their join). The same for a read-only
server. Then, at the ASGI app: a form at the limit still acts, one byte over is 413 with nothing
written; a wrong token with the id of no flow is 403 (it was 404: the flow was looked up first).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from ferry import flow
from ferry.flow._ops._dashboard._app import MAX_BODY, Dashboard
from ferry.flow._ops._dashboard._reads import Reader

from .test_dashboard import TOKEN, client_of, fill, row, text_of
from .test_inspect import ROOT

BODY = 50 * 1024 * 1024
CHUNK = 256 * 1024
#: What the server's peak memory may grow by while it is sent `BODY` bytes.
GROWTH = 16 * 1024 * 1024


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "flows.db")
    fill(path)
    return path


class Server:
    def __init__(self, proc: subprocess.Popen[str], port: int, token: str | None) -> None:
        self.proc = proc
        self.port = port
        self.token = token

    def peak(self) -> int:
        """The server process's peak resident memory, in bytes."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
        assert found is not None
        return int(found.group(1)) * 1024


def _serve(db: str, *more: str) -> Iterator[Server]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferry.flow", db, "serve", "--port", "0", *more],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        second = proc.stdout.readline()
        url = re.search(r"on http://127\.0\.0\.1:(\d+)/", first)
        assert url is not None, first + (proc.stderr.read() if proc.stderr else "")
        token = second.rsplit(" ", 1)[1].strip() if second.startswith("token") else None
        server = Server(proc, int(url.group(1)), token)
        assert httpx.get(f"http://127.0.0.1:{server.port}/flows").status_code == 200  # warm
        yield server
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)


@pytest.fixture
def server(db: str) -> Iterator[Server]:
    yield from _serve(db)


@pytest.fixture
def read_only_server(db: str) -> Iterator[Server]:
    yield from _serve(db, "--read-only")


def post_big(port: int, *, chunked: bool, size: int = BODY) -> tuple[int, int]:
    """POST `size` bytes of a form without a token to /flow/resume, sent while the answer is
    read; the answer's status, and how many bytes the server let us send before it answered and
    closed (the kernel's buffers hold a few MB of them, unread)."""
    head = "POST /flow/resume HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += "Content-Type: application/x-www-form-urlencoded\r\n"
    head += "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {size}\r\n"
    piece = b"id=blocked&" + b"x" * (CHUNK - 11)
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    answer: list[bytes] = []
    answered = threading.Event()

    def read() -> None:  # the answer, as it comes (before the server's close)
        try:
            while data := sock.recv(65536):
                answer.append(data)
                if b"\r\n\r\n" in b"".join(answer):
                    break
        except OSError:
            pass
        finally:
            answered.set()

    reader = threading.Thread(target=read)
    reader.start()
    sent = 0
    try:
        sock.sendall(head.encode() + b"\r\n")
        while sent < size and not answered.is_set():
            n = min(CHUNK, size - sent)
            data = piece[:n]
            sock.sendall(b"%x\r\n%s\r\n" % (n, data) if chunked else data)
            sent += n
        if chunked and not answered.is_set():
            sock.sendall(b"0\r\n\r\n")
    except OSError:  # the server answered and closed: it reads no more
        pass
    reader.join(30)
    sock.close()
    status = re.match(rb"HTTP/1\.1 (\d{3})", b"".join(answer))
    assert status is not None, b"".join(answer)[:200]
    return int(status.group(1)), sent


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_huge_post_without_a_token_is_413_and_never_held(
    server: Server, db: str, chunked: bool
) -> None:
    before, peak = row(db, "blocked"), server.peak()
    status, sent = post_big(server.port, chunked=chunked)
    assert status == 413
    assert server.peak() - peak < GROWTH, (server.peak() - peak, sent)
    assert row(db, "blocked") == before
    # the server goes on serving
    r = httpx.post(
        f"http://127.0.0.1:{server.port}/flow/resume", data={"id": "blocked", "token": server.token}
    )
    assert r.status_code == 303


def test_a_read_only_server_bounds_bodies_too(read_only_server: Server) -> None:
    """A length over the limit is 413; a chunked body is refused (403) before it is read."""
    peak = read_only_server.peak()
    for chunked, refused in ((False, 413), (True, 403)):
        status, _sent = post_big(read_only_server.port, chunked=chunked)
        assert status == refused
    assert read_only_server.peak() - peak < GROWTH
    r = httpx.post(
        f"http://127.0.0.1:{read_only_server.port}/flow/resume",
        data={"id": "blocked", "token": TOKEN},
    )
    assert r.status_code == 403 and "read-only" in r.text


# ---------------------------------------------------------------------------- at the ASGI app


async def post_chunks(dash: Dashboard, parts: list[bytes]) -> tuple[int, int]:
    """POST `parts` to /flow/resume as a body without a length, straight to the ASGI app; the
    answer's status, and how many parts were left unread."""
    left = list(parts)
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        body = left.pop(0) if left else b""
        return {"type": "http.request", "body": body, "more_body": bool(left)}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/flow/resume",
        "raw_path": b"/flow/resume",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/x-www-form-urlencoded"),
            (b"transfer-encoding", b"chunked"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await dash.app(hosts=None)(scope, receive, send)
    return statuses[0], len(left)


def dashboard(db: str, **kw: object) -> Dashboard:
    return Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN, **kw)  # type: ignore[arg-type]


async def test_a_form_at_the_limit_acts_one_byte_over_is_413(db: str) -> None:
    async with await client_of(dashboard(db)) as web:
        form = f"id=blocked&token={TOKEN}&pad="
        over = form + "x" * (MAX_BODY + 1 - len(form))
        before = row(db, "blocked")
        headers = {"content-type": "application/x-www-form-urlencoded"}
        r = await web.post("/flow/resume", content=over.encode(), headers=headers)
        assert r.status_code == 413 and f"over {MAX_BODY} bytes" in r.text
        assert row(db, "blocked") == before

        parts = [over[: MAX_BODY // 2].encode(), over[MAX_BODY // 2 :].encode(), b"x" * 9]
        assert await post_chunks(dashboard(db), parts) == (413, 1)  # 413 at the 2nd, 3rd unread
        assert row(db, "blocked") == before
        r = await web.post("/flow/resume", content=over[:-1].encode(), headers=headers)
        assert r.status_code == 303
        assert row(db, "blocked")[0].state is flow.State.COMPENSATING


async def test_the_limit_is_the_dashboards_to_set(db: str) -> None:
    async with await client_of(dashboard(db, max_body=2048)) as web:
        r = await web.post("/flow/resume", data={"id": "blocked", "token": TOKEN, "p": "x" * 2048})
        assert r.status_code == 413 and "over 2048 bytes" in r.text
    for bad in (0, 1023, True, 2.5, "64k"):
        with pytest.raises(ValueError, match="max_body"):
            dashboard(db, max_body=bad)


@pytest.mark.parametrize("token", ["", "wrong-" + TOKEN])
async def test_a_bad_token_is_403_whether_or_not_the_flow_exists(db: str, token: str) -> None:
    async with await client_of(dashboard(db)) as web:
        for fid in ("no-such-flow", "blocked"):
            r = await web.post("/flow/resume", data={"id": fid, "token": token})
            assert r.status_code == 403, fid
            assert "token" in text_of(r.text, "problem")
            assert "No flow has the id" not in r.text
