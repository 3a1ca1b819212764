"""The fleet harness: ledger service processes, and clients that route keys (often wrongly) and
follow the client rules (retry on failed/rejected/closed/dropped/timeout with the same id and
content).

Routing: an account's home process is ``crc32(account) % n``; each attempt goes elsewhere (at
random) with probability `wrong`. A process that was killed is simply unreachable until it is
restarted: clients get a refused connection and retry.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from examples import ledger_domain as ledger

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "examples" / "ledger_service.py"
RETRY = ("failed", "rejected", "closed")
ACK = ("ok", "refused", "committed")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Linux: SIGKILL this service if the test process dies, so nothing is left running even
    when the test run itself is killed. Elsewhere a no-op (the finally blocks still stop it)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Service:
    """One `examples/ledger_service.py` process; `port` is None while it is down."""

    def __init__(self, index: int, dsn: str, workdir: Path, extra: Sequence[str]) -> None:
        self.index = index
        self.dsn = dsn
        self.workdir = workdir
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.starts = 0

    @property
    def port_file(self) -> Path:
        return self.workdir / f"service-{self.index}.port"

    def log(self) -> str:
        path = self.workdir / f"service-{self.index}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def _spawn(self) -> None:
        self.port_file.unlink(missing_ok=True)
        self.starts += 1
        with open(self.workdir / f"service-{self.index}.log", "ab") as logfile:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(SERVICE),
                    "--dsn",
                    self.dsn,
                    "--port-file",
                    str(self.port_file),
                    "--sweep-interval",
                    "0.5",
                    *self.extra,
                ],
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )

    async def start(self) -> None:
        """Start the process and wait (at most 60 s) until it has written its port."""
        assert self.proc is None or self.proc.poll() is not None
        self._spawn()
        assert self.proc is not None
        with trio.fail_after(60):
            while not self.port_file.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"service {self.index} exited early:\n{self.log()}")
                await trio.sleep(0.05)
        self.port = int(self.port_file.read_text())

    def kill(self) -> None:
        """SIGKILL, no goodbye: in-flight requests see their connection drop."""
        self.port = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (the service shuts down cleanly), SIGKILL if it takes more than 10 s."""
        self.port = None
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


@attrs.define
class Tally:
    """What the clients saw. `acknowledged`: input id -> (op, answer)."""

    acknowledged: dict[str, tuple[ledger.Op, Any]] = attrs.Factory(dict)
    outcomes: dict[str, int] = attrs.Factory(dict)
    retries: dict[str, int] = attrs.Factory(dict)
    bugs: list[str] = attrs.Factory(list)

    def count(self, table: dict[str, int], name: str) -> None:
        table[name] = table.get(name, 0) + 1


class _Connection:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        await self.stream.send_all(json.dumps(message).encode() + b"\n")
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise EOFError("the service closed the connection")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply


class Client:
    """One client: one request at a time, a connection per service kept open between requests."""

    def __init__(
        self,
        services: Sequence[Service],
        tally: Tally,
        rng: random.Random,
        *,
        wrong: float,
        patience: float = 15.0,
        attempts: int = 200,
    ) -> None:
        self.services = services
        self.tally = tally
        self.rng = rng
        self.wrong = wrong
        self.patience = patience
        self.attempts = attempts
        self.connections: dict[int, _Connection] = {}  # by port

    def route(self, account: str) -> Service:
        home = zlib.crc32(account.encode()) % len(self.services)
        if self.rng.random() < self.wrong:
            return self.rng.choice([s for s in self.services if s.index != home])
        return self.services[home]

    async def _drop(self, port: int) -> None:
        conn = self.connections.pop(port, None)
        if conn is not None:
            await conn.stream.aclose()

    async def send(self, op: ledger.Op, to: Service | None = None) -> dict[str, Any] | None:
        """Send `op` until it is acknowledged (returns the reply) or is a client bug (None).

        Each attempt is routed anew (or to `to`); gives up (a bug) after `attempts`."""
        message = {
            "id": op.id,
            "kind": op.kind,
            "account": op.account,
            "amount": op.amount,
            "to": op.to,
        }
        backoff = 0.005
        for _ in range(self.attempts):
            service = to or self.route(op.account)
            port = service.port
            outcome = "closed"
            if port is not None:
                try:
                    with trio.fail_after(self.patience):
                        conn = self.connections.get(port)
                        if conn is None:
                            conn = _Connection(await trio.open_tcp_stream("127.0.0.1", port))
                            self.connections[port] = conn
                        reply = await conn.request(message)
                    outcome = reply["outcome"]
                except trio.TooSlowError:
                    outcome = "timeout"
                    await self._drop(port)
                except (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                    outcome = "closed"
                    await self._drop(port)
            if outcome in ACK:
                self.tally.count(self.tally.outcomes, outcome)
                self.tally.acknowledged[op.id] = (op, reply["answer"])
                return reply
            if outcome not in (*RETRY, "timeout"):
                self.tally.bugs.append(f"{op.id}: {reply!r}")
                return None
            self.tally.count(self.tally.retries, outcome)
            await trio.sleep(self.rng.uniform(0, backoff))
            backoff = min(backoff * 2, 0.25)
        self.tally.bugs.append(f"{op.id}: gave up after {self.attempts} attempts")
        return None

    async def aclose(self) -> None:
        for port in list(self.connections):
            await self._drop(port)


def accounts(n: int) -> list[str]:
    return [f"acct-{i:03d}" for i in range(n)]


def random_ops(n: int, names: Sequence[str], rng: random.Random, prefix: str) -> list[ledger.Op]:
    """Deposits, withdrawals (many of them refused) and transfers, in a seeded mix."""
    ops: list[ledger.Op] = []
    for i in range(n):
        source = rng.choice(names)
        amount = rng.randint(1, 60)
        roll = rng.random()
        if roll < 0.4:
            ops.append(ledger.deposit(f"{prefix}{i}", source, amount))
        elif roll < 0.7:
            ops.append(ledger.withdraw(f"{prefix}{i}", source, amount))
        else:
            dest = rng.choice([a for a in names if a != source])
            ops.append(ledger.transfer(f"{prefix}{i}", source, dest, amount))
    return ops


async def stale_probe(
    client: Client, first: Service, second: Service, account: str, tag: str
) -> Any:
    """Make `first` hold a stale view of `account`, then ask it for a withdrawal that only that
    stale view can allow. Returns the probe's answer (a refusal when fencing is on)."""
    await client.send(ledger.deposit(f"{tag}-d", account, 100), to=first)  # first sees 100
    await client.send(ledger.withdraw(f"{tag}-w1", account, 100), to=second)  # now 0
    reply = await client.send(ledger.withdraw(f"{tag}-w2", account, 100), to=first)
    return None if reply is None else reply["answer"]


async def drive(
    services: Sequence[Service],
    ops: Sequence[ledger.Op],
    tally: Tally,
    *,
    clients: int,
    wrong: float,
    seed: int,
    kill: Service | None = None,
    kill_after: int = 0,
    down_for: float = 0.5,
) -> int | None:
    """Run `clients` clients over `ops`; if `kill` is given, SIGKILL it once `kill_after` inputs
    are acknowledged and restart it `down_for` seconds later. Returns the count acknowledged at
    the kill (None if no kill)."""
    work = iter(ops)
    killed_at: int | None = None
    finished = False

    async def one_client(i: int) -> None:
        client = Client(services, tally, random.Random(seed * 1000 + i), wrong=wrong)
        try:
            for op in work:
                await client.send(op)
        finally:
            await client.aclose()

    async def killer() -> None:
        nonlocal killed_at
        assert kill is not None
        while len(tally.acknowledged) < kill_after:
            if finished:
                return
            await trio.sleep(0.01)
        killed_at = len(tally.acknowledged)
        kill.kill()
        await trio.sleep(down_for)
        await kill.start()

    async with trio.open_nursery() as nursery:
        if kill is not None:
            nursery.start_soon(killer)
        async with trio.open_nursery() as workers:
            for i in range(clients):
                workers.start_soon(one_client, i)
        finished = True
    return killed_at
