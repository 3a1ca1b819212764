"""The flow fleet test's pieces (ADR 0045): engine processes, the chaos, what is read back, and
the oracle.

The engine process (``python -m tests.fleet._flows DSN --owner NAME ...``) opens a flow engine
on PostgreSQL (its connections carry ``application_name=NAME``, so the database knows who wrote
what), says ``ready``, waits for ``go EPOCH`` on stdin (or takes ``--epoch``), and then plays
its part of the seeded scenario: it starts the flows assigned to it, and sends the payment wakes
and events assigned to it (each wake or event goes to a random engine, some of them to a second
one too) at their times after the epoch, either as `Engine.wake` or as `Engine.publish` through
a mapper. A restarted process (a new owner name) plays its part again from the start: starts
are idempotent, and a wake or event it sends again is a `DUPLICATE`. It serves until SIGTERM,
then closes the engine and prints its statistics.

The plan is an order: ``reserve`` (compensated by ``release``), ``charge`` (compensated by
``refund``; parks until the payment arrives, or times out and compensates), ``ship`` (which may
fail, or raise on every attempt). Every step body and compensation makes its "external call"
first: it inserts ``(idempotency key, attempt, owner)`` into the side table ``side_runs`` in
autocommit, then pauses a few milliseconds; a body that raises does so before its call, so the
side table counts exactly the runs that had an effect. A process to be killed or frozen
(``--hold-at T``) holds the first call it makes from ``T`` seconds after the epoch on: it says
``holding KEY`` and waits, its call made, until a line comes on its stdin, so the test strikes
when a body is in flight, not at a time that a slow machine may not have reached.

What the database records beside the flows (`prepare`): an ``AFTER UPDATE`` trigger writes every
change of a flow's revision to ``audit`` with the writer's ``application_name``, the old and new
owner, state and position, and until when the old owner held the flow (its engine's lease, read
from ``flow_engines`` by the trigger, or the time it let the flow go). The oracle reads it, not
the engines' word.

The oracle (`check`, pure):
- every flow is ``COMPLETED`` or ``FAILED``;
- no step outcome and no compensation is recorded twice in a flow's history;
- every key's effective runs are at most 1 + the takeovers that caught it in flight (an audit row
  that moved an active flow at that key from one owner to another: the SIGKILL's and the
  SIGSTOP's orphans, and any lease that lapsed on its own);
- no engine wrote a flow that another engine held under a lease that had not lapsed (by the
  database's clock at the write, the one clock of leases: docs/adr/0110); and the frozen owner
  advanced nothing after it woke from the revisions it held when it was frozen;
- every failed flow's compensations ran in the reverse order of its completed steps, each once,
  and a completed flow compensated nothing;
- for each parent (about 6% of the flows: plan ``batch`` of tests/flow/_sigkill_family.py, ADR
  0162), the family half: each child started once and ended as its kind says, the spawn ended
  once, the parent resumed after its last child ended, completed children of a failed parent
  undone once each; and each child goes through the per-flow rules above.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

import ferry
from ferry import flow
from ferry.flow._store import _schema, _store
from ferry.projected import PostgresStore
from tests import switches
from tests.flow import _sigkill_family as fam
from tests.flow import _sigkill_limited as lim

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("reserve", "charge", "ship")
COMPENSATED = {"reserve": 0, "charge": 1, "prepare": 0, "pick": 0}  # with the family's

# ------------------------------------------------------------------------------- the scenario

#: kind -> weight; "family": a parent with children, of a kind of `_sigkill_family.FAMILIES`
KINDS = {"paid": 52, "declined": 14, "timeout": 14, "broken": 9, "refused": 5, "family": 6}
assert not set(KINDS) & set(fam.FAMILIES), "a plain kind's name taken by a parent's"


@attrs.frozen
class Send:
    """One wake or event: to which engine, when (seconds after the epoch), how."""

    engine: int
    at: float
    via: str  # "wake" or "publish"
    message_id: str
    ok: bool


@attrs.frozen
class Spec:
    flow_id: str
    kind: str
    start_on: int  # the engine that starts it
    start_at: float
    data: dict[str, Any]
    sends: tuple[Send, ...]

    @property
    def kids(self) -> tuple[fam.KidSpec, ...]:
        """A parent's children and how each must end (none for a plain flow)."""
        return fam.kid_specs(self.flow_id, self.data) if self.kind in fam.FAMILIES else ()


def scenario(n: int, engines: int, seed: int, *, spread: float) -> list[Spec]:
    """`n` flows, started over `spread` seconds on random engines, from `seed` alone."""
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    specs = []
    for i in range(n):
        kind = rng.choices(kinds, weights)[0]
        start_at = round(rng.uniform(0.0, spread), 3)
        if kind == "family":  # a parent with children, in place of a plain flow
            names, shares = list(fam.FAMILIES), [w for w, _ in fam.FAMILIES.values()]
            kind = rng.choices(names, shares)[0]
            data = fam.family_data(kind, rng)
            specs.append(Spec(f"o{i:05d}", kind, rng.randrange(engines), start_at, data, ()))
            continue
        data = {
            "kind": kind,
            "pause": round(rng.uniform(0.0, 0.03), 3),
            "timeout": round(rng.uniform(1.0, 3.0), 3) if kind == "timeout" else 60.0,
        }
        sends: tuple[Send, ...] = ()
        if kind != "timeout":
            at = start_at + rng.choice([0.0, round(rng.uniform(0.1, 2.5), 3)])  # 0: early
            mid = f"pay-{i}"
            first = rng.randrange(engines)
            sends = (Send(first, at, rng.choice(["wake", "publish"]), mid, kind != "declined"),)
            if rng.random() < 0.3:  # delivered twice, to another engine
                other = rng.choice([e for e in range(engines) if e != first])
                later = at + round(rng.uniform(0.0, 0.5), 3)
                sends += (
                    Send(other, later, rng.choice(["wake", "publish"]), mid, kind != "declined"),
                )
        specs.append(Spec(f"o{i:05d}", kind, rng.randrange(engines), start_at, data, sends))
    return specs


# ------------------------------------------------------------------------ the engine process


@attrs.define
class Hold:
    """Hold one body in flight for the test to kill or freeze the process at: the first body
    (or compensation) that makes its call at or after `after` (wall clock) says ``holding KEY``
    on stdout and waits, its call made, until a line (or the end) comes on stdin."""

    after: float = float("inf")  # set once the epoch is known
    held: bool = False

    async def __call__(self, key: str) -> None:
        if self.held or time.time() < self.after:
            return
        self.held = True
        async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
            print(f"holding {key}", flush=True)
            await stdin.receive_some()


def make_plans(side: Any, owner: str, hold: Hold | None = None) -> list[flow.Plan]:
    """The order plan, then the parents' and the children's (`_sigkill_family`)."""

    async def call(ctx: flow.Context) -> None:
        """The external call: committed (autocommit) before the body goes on."""
        await trio.to_thread.run_sync(
            side.execute,
            "INSERT INTO side_runs (key, attempt, owner) VALUES (%s, %s, %s)",
            (ctx.idempotency_key, ctx.attempt, owner),
        )
        if hold is not None:
            await hold(ctx.idempotency_key)
        await trio.sleep(ctx.data["pause"])

    return [make_plan(call), *fam.make_family(call), lim.make_limited(call)]


def limited_specs(flows: int, seed: int) -> list[lim.Limited]:
    """The limited flows beside the scenario's (`_sigkill_limited`, ADR 0171): one in 80."""
    return lim.limited_scenario(flows // 80, seed, prefix="l")


def limited_order(seen: Observed, ids: set[str]) -> list[tuple[str, str]]:
    """`_sigkill_limited.audit_limited`'s order on PostgreSQL: the limited flows' admissions
    (out of QUEUED) and ends in the order of the audit's ids (each write's row, made in its
    transaction: an admission waits for the budget row, so it comes after the end whose slot
    it takes)."""
    out = []
    for a in seen.audit:
        if a.flow_id not in ids or a.old_state == a.new_state:
            continue
        if a.old_state == "QUEUED" and a.new_state not in ("COMPLETED", "FAILED"):
            out.append((a.flow_id, "admitted"))
        elif a.old_state != "QUEUED" and a.new_state in ("COMPLETED", "FAILED"):
            out.append((a.flow_id, "ended"))
    return out


def make_plan(call: fam.Call) -> flow.Plan:
    plan = flow.Plan("order")

    async def release(ctx: flow.Context) -> None:
        await call(ctx)

    async def refund(ctx: flow.Context) -> None:
        await call(ctx)

    @plan.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        await call(ctx)

    @plan.step(compensate=refund, attempts=2)
    async def charge(ctx: flow.Context) -> flow.Outcome:
        await call(ctx)
        return flow.park(timeout=ctx.data["timeout"])

    @plan.step(attempts=2)
    async def ship(ctx: flow.Context) -> flow.Outcome | None:
        kind = ctx.data["kind"]
        if kind == "broken":
            raise ConnectionError("carrier unavailable")  # before the call: no effect
        if kind == "refused" or not ctx.wake["ok"]:
            return flow.fail("payment declined" if kind == "declined" else "no carrier")
        await call(ctx)
        return None

    assert tuple(s.name for s in plan.steps) == STEPS
    return plan


async def serve(args: argparse.Namespace) -> None:
    import psycopg

    side = psycopg.connect(args.dsn, autocommit=True)
    specs = scenario(args.flows, args.engines, args.seed, spread=args.spread)
    hold = None if args.hold_at is None else Hold()
    plans = make_plans(side, args.owner, hold)
    by_name = {p.name: p for p in plans}
    dsn = f"{args.dsn} application_name={args.owner}"

    def mapper(event: Any) -> flow.Wake:
        return flow.Wake(event["flow"], {"ok": event["ok"]}, message_id=event["id"])

    async with PostgresStore(dsn, connections=4) as store:
        async with switches.open_engine(
            store,
            plans=plans,
            owner=args.owner,
            lease=args.lease,
            fencing=not args.no_fencing,
        ) as engine:
            engine.on("payment", mapper)
            print("ready", flush=True)
            epoch = args.epoch
            if epoch is None:
                line = await trio.to_thread.run_sync(sys.stdin.readline)
                assert line.startswith("go "), line
                epoch = float(line[3:])
            if hold is not None:
                hold.after = epoch + args.hold_at

            async def at(t: float) -> None:
                await trio.sleep(max(0.0, epoch + t - time.time()))

            async def start(spec: Spec) -> None:
                await at(spec.start_at)
                plan = by_name["batch" if spec.kind in fam.FAMILIES else "order"]
                for _ in range(100):  # like a client: on any doubt, again (it is idempotent)
                    with contextlib.suppress(ferry.Failed):
                        await engine.start(plan, flow_id=spec.flow_id, data=spec.data)
                        return
                    await trio.sleep(0.1)

            limited = limited_specs(args.flows, args.seed)

            async def start_limited(i: int, spec: lim.Limited) -> None:
                await at(i * args.spread / max(1, len(limited)))
                when = None if spec.at is None else epoch + spec.at
                for _ in range(100):  # on any doubt, again (it is idempotent)
                    with contextlib.suppress(ferry.Failed):
                        await engine.start(
                            by_name[lim.PLAN],
                            flow_id=spec.flow_id,
                            data=spec.data,
                            priority=spec.priority,
                            at=when,
                        )
                        return
                    await trio.sleep(0.1)

            async def send(spec: Spec, s: Send) -> None:
                """Like a gateway: an order it does not know yet (UNKNOWN) is tried again."""
                await at(s.at)
                for _ in range(600):
                    d: object = None
                    with contextlib.suppress(ferry.Failed):  # on any doubt, again
                        if s.via == "wake":
                            d = await engine.wake(
                                spec.flow_id, {"ok": s.ok}, message_id=s.message_id
                            )
                        else:
                            event = {"flow": spec.flow_id, "ok": s.ok, "id": s.message_id}
                            (d,) = await engine.publish("payment", event)
                    if d not in (None, flow.Delivery.UNKNOWN):
                        return
                    await trio.sleep(0.1)

            async with trio.open_nursery() as nursery:
                with trio.open_signal_receiver(signal.SIGTERM) as signals:
                    for i, queued in enumerate(limited):
                        if i % args.engines == args.index:
                            nursery.start_soon(start_limited, i, queued)
                    for spec in specs:
                        if spec.start_on == args.index:
                            nursery.start_soon(start, spec)
                        for s in spec.sends:
                            if s.engine == args.index:
                                nursery.start_soon(send, spec, s)
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        break
            stats = engine.statistics()
    side.close()
    report = {k: v for k, v in attrs.asdict(stats).items() if k != "wakes"}
    report["wakes"] = {d.name: n for d, n in stats.wakes.items()}
    print("stats " + json.dumps(report), flush=True)


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description="one engine process of the flow fleet test")
    p.add_argument("dsn")
    p.add_argument("--owner", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--engines", type=int, required=True)
    p.add_argument("--flows", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--spread", type=float, required=True)
    p.add_argument("--lease", type=float, required=True)
    p.add_argument("--epoch", type=float, default=None)
    p.add_argument("--no-fencing", action="store_true")
    p.add_argument("--hold-at", type=float, default=None, help="see `Hold` (after the epoch)")
    trio.run(serve, p.parse_args(argv))


# ------------------------------------------------------------------------------ the processes


def _die_with_parent() -> None:  # in the child, between fork and exec (Linux only)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EngineProcess:
    """One engine process; a restart is a new process with a new owner name."""

    def __init__(self, index: int, dsn: str, workdir: Path, options: Sequence[str]) -> None:
        self.index = index
        self.dsn = dsn
        self.workdir = workdir
        self.options = list(options)
        self.generation = 0
        self.proc: subprocess.Popen[str] | None = None
        self.reports: list[dict[str, Any]] = []

    @property
    def owner(self) -> str:
        return f"e{self.index}.g{self.generation}"

    def _close_pipes(self) -> None:
        if self.proc is not None:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()

    def spawn(self, epoch: float | None = None, *, hold_at: float | None = None) -> None:
        """Start the next generation; with `hold_at`, it holds a body in flight (`Hold`) from
        `hold_at` seconds after the epoch on: `wait_holding` waits for it, `release` ends it."""
        self._close_pipes()
        self.generation += 1
        command = [sys.executable, "-m", "tests.fleet._flows", self.dsn, "--owner", self.owner]
        command += ["--index", str(self.index), *self.options]
        if epoch is not None:
            command += ["--epoch", repr(epoch)]
        if hold_at is not None:
            command += ["--hold-at", repr(hold_at)]
        log = open(self.workdir / f"{self.owner}.log", "w")  # noqa: SIM115 (the child owns it)
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            preexec_fn=_die_with_parent,
        )
        log.close()

    def readline(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"{self.owner} said nothing for {timeout} s: {self.log()}")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"{self.owner} exited: {self.log()}")
        return line

    def wait_ready(self, timeout: float = 60.0) -> None:
        line = self.readline(timeout)
        assert line == "ready\n", f"{self.owner}: {line!r} {self.log()}"

    def wait_holding(self, timeout: float = 120.0) -> str:
        """Wait until the process holds a body in flight, its call made; that body's key."""
        line = self.readline(timeout)
        assert line.startswith("holding "), f"{self.owner}: {line!r} {self.log()}"
        return line[len("holding ") :].strip()

    def release(self) -> None:
        """End the hold: the held body goes on."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write("release\n")
        self.proc.stdin.flush()

    def go(self, epoch: float) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(f"go {epoch!r}\n")
        self.proc.stdin.flush()

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM; read its statistics (SIGKILL if it does not stop in time)."""
        if self.proc is None or self.proc.poll() is not None:
            self._close_pipes()
            return
        self.proc.send_signal(signal.SIGCONT)  # in case it is frozen
        self.proc.send_signal(signal.SIGTERM)
        try:
            line = self.readline(timeout)
            if line.startswith("stats "):
                self.reports.append({"owner": self.owner, **json.loads(line[6:])})
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._close_pipes()

    def log(self) -> str:
        path = self.workdir / f"{self.owner}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def stop_all(engines: Sequence[EngineProcess]) -> None:
    """Stop every engine, even when stopping one fails (it is killed then): a process left
    running, and its pipes, would outlive the test. The first failure is raised after."""
    failures: list[BaseException] = []
    for e in engines:
        try:
            e.stop()
        except Exception as exc:  # each engine is stopped whatever the others did
            failures.append(exc)
    if failures:
        raise failures[0]


# ------------------------------------------------------------------------- the database side

AUDIT = """
CREATE TABLE side_runs (id BIGSERIAL, key TEXT NOT NULL, attempt BIGINT, owner TEXT);
CREATE TABLE audit (
    id BIGSERIAL PRIMARY KEY,
    flow_id TEXT, app TEXT,
    old_revision BIGINT, new_revision BIGINT,
    old_owner TEXT, new_owner TEXT,
    old_state TEXT, new_state TEXT,
    old_lease DOUBLE PRECISION, written_at DOUBLE PRECISION,
    old_step_index BIGINT, old_step TEXT,
    old_attempt BIGINT, new_attempt BIGINT);
CREATE FUNCTION audit_flow() RETURNS trigger AS $$
BEGIN
    INSERT INTO audit (flow_id, app, old_revision, new_revision, old_owner, new_owner,
                       old_state, new_state, old_lease, written_at, old_step_index, old_step,
                       old_attempt, new_attempt)
    VALUES (OLD.flow_id, current_setting('application_name'), OLD.revision, NEW.revision,
            OLD.owner, NEW.owner, OLD.state, NEW.state,
            coalesce(OLD.lease_until,
                     (SELECT e.lease_until FROM flow_engines e WHERE e.owner = OLD.owner)),
            EXTRACT(EPOCH FROM now()),
            OLD.step_index, OLD.step, OLD.attempt, NEW.attempt);
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER audit_flow AFTER UPDATE ON flow_flows FOR EACH ROW
    WHEN (OLD.revision IS DISTINCT FROM NEW.revision) EXECUTE FUNCTION audit_flow();
"""


def prepare(dsn: str) -> None:
    """The flow tables (as an engine makes them), the side table and the audit trigger."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        tx = _SyncTx(conn)
        _schema.create_schema(tx)
        conn.execute(AUDIT)


class _SyncTx:
    dialect = "postgres"

    def __init__(self, conn: Any) -> None:
        self.connection = conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cur = self.connection.execute(sql.replace("%", "%%").replace("?", "%s"), params)
        return cur.fetchall() if cur.description is not None else []

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        raise NotImplementedError


def query(dsn: str, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def key_of(flow_id: str, state: str, step_index: int, step: str | None) -> str:
    """The idempotency key of the step (RUNNING) or compensation in flight."""
    if state == "RUNNING":
        return f"{flow_id}/{step_index}/{step}"
    return f"{flow_id}/{step_index}-compensate/{step}"


def in_flight(dsn: str, owner: str) -> dict[str, tuple[str, int]]:
    """The active flows `owner` holds now: flow id -> (the key in flight, the revision)."""
    rows = query(
        dsn,
        "SELECT flow_id, state, step_index, step, revision FROM flow_flows"
        " WHERE owner = %s AND state IN ('RUNNING', 'COMPENSATING')",
        (owner,),
    )
    return {r[0]: (key_of(r[0], r[1], r[2], r[3]), r[4]) for r in rows}


def quiesce(dsn: str, owner: str, ceiling: float = 60.0) -> None:
    """Wait until the database runs nothing `owner`'s process sent it (its connections carry
    its name as `application_name`): after a SIGSTOP, a
    statement (a COMMIT) sent just before the signal still completes, and may move or end a
    flow the stopped process held; what it holds is read once that has landed.

    A statement that waits on the stopped process itself (``wait_event_type = 'Client'``: the
    rest of a statement it was sending, or rows it does not read) counts as settled: it cannot
    end before the process wakes, and the engine that takes over its flows ends its session
    first (docs/adr/0158)."""
    end, idle, seen = time.monotonic() + ceiling, 0, []
    while time.monotonic() < end:
        seen = query(
            dsn,
            "SELECT pid, wait_event_type, wait_event, left(query, 160)"
            " FROM pg_stat_activity WHERE application_name = %s AND state = 'active'",
            (owner,),
        )
        busy = [row for row in seen if row[1] != "Client"]
        # Idle at three reads in a row: bytes still in the socket may not show yet at one.
        idle = 0 if busy else idle + 1
        if idle == 3:
            if seen:
                print(f"quiesce: {owner} stopped mid-request: {seen}")
            return
        time.sleep(0.03)
    stuck = query(
        dsn,
        "SELECT a.pid, a.wait_event_type, a.wait_event, left(a.query, 200),"
        " (SELECT array_agg(b.application_name || ' ' || b.state || ' ' || left(b.query, 200))"
        "  FROM pg_stat_activity b WHERE b.pid = ANY(pg_blocking_pids(a.pid)))"
        " FROM pg_stat_activity a WHERE a.application_name = %s AND a.state = 'active'",
        (owner,),
    )
    raise AssertionError(
        f"{owner}'s statements still run {ceiling} s after it was stopped: {stuck}"
    )


def still_held(dsn: str, owner: str, flow_ids: Mapping[str, object]) -> int:
    """How many of `flow_ids` `owner` still holds."""
    rows = query(
        dsn,
        "SELECT count(*) FROM flow_flows WHERE owner = %s AND flow_id = ANY(%s)"
        " AND state IN ('RUNNING', 'COMPENSATING')",
        (owner, list(flow_ids)),
    )
    return int(rows[0][0])


def unsettled(dsn: str) -> int:
    rows = query(dsn, "SELECT count(*) FROM flow_flows WHERE state NOT IN ('COMPLETED', 'FAILED')")
    return int(rows[0][0])


def last_audit_id(dsn: str) -> int:
    return int(query(dsn, "SELECT coalesce(max(id), 0) FROM audit")[0][0])


@attrs.frozen
class AuditRow:
    id: int
    flow_id: str
    app: str
    old_revision: int
    new_revision: int
    old_owner: str | None
    new_owner: str | None
    old_state: str
    new_state: str
    old_lease: float | None
    #: the database's clock when the write was made (the clock leases go by: docs/adr/0110)
    written_at: float
    old_step_index: int
    old_step: str | None
    old_attempt: int
    new_attempt: int

    @property
    def takeover(self) -> bool:
        """An active flow moved from one engine to another (its step may have run on both)."""
        active = ("RUNNING", "COMPENSATING")
        return (
            self.old_state in active
            and self.new_state in active
            and self.old_owner is not None
            and self.new_owner != self.old_owner
        )

    @property
    def rerun(self) -> bool:
        """An engine took over an active flow whose lease had lapsed (from another engine, or
        back from itself after it let it go): its step may have run before, and runs again."""
        active = ("RUNNING", "COMPENSATING")
        return (
            self.old_state in active
            and self.new_state == self.old_state
            and self.old_owner is not None
            and self.new_attempt > self.old_attempt
            and (self.old_lease is None or self.old_lease < self.written_at)
        )

    @property
    def key(self) -> str:
        return key_of(self.flow_id, self.old_state, self.old_step_index, self.old_step)


@attrs.frozen
class Observed:
    """Everything the oracle reads, once every engine has stopped."""

    states: Mapping[str, str]
    history: Mapping[str, Sequence[flow.Event]]
    runs: Counter[str]  # key -> effective runs (side table)
    audit: Sequence[AuditRow]
    order: Mapping[str, Sequence[int]] = attrs.Factory(dict)  # key -> its calls' ids, in order


def observe(dsn: str) -> Observed:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        tx = _SyncTx(conn)
        states = {r[0]: r[1] for r in tx.execute("SELECT flow_id, state FROM flow_flows")}
        history = {fid: _store.load_history(tx, fid) or [] for fid in states}
        order: dict[str, list[int]] = {}
        for i, key in tx.execute("SELECT id, key FROM side_runs ORDER BY id"):
            order.setdefault(key, []).append(i)
        runs = Counter({key: len(ids) for key, ids in order.items()})
        cols = ", ".join(a.name for a in attrs.fields(AuditRow))
        audit = [AuditRow(*r) for r in tx.execute(f"SELECT {cols} FROM audit ORDER BY id")]
    return Observed(states, history, runs, audit, order)


# ------------------------------------------------------------------------------------ the oracle


@attrs.frozen
class Freeze:
    """The frozen owner: its name, the flows it held when it was frozen (flow id -> revision),
    and the last audit ids before it was frozen and before it was thawed."""

    owner: str
    held: Mapping[str, int]
    frozen_after: int
    thawed_after: int

    def taken_while_frozen(self, seen: Observed) -> set[str]:
        """Which of its flows other engines took over while it was frozen."""
        return {
            a.flow_id
            for a in seen.audit
            if self.frozen_after < a.id <= self.thawed_after
            and a.takeover
            and a.old_owner == self.owner
        }


def check(specs: Sequence[Spec], seen: Observed, freeze: Freeze | None) -> list[str]:
    """Every violation of the oracle (module doc), one line each; empty if all holds."""
    problems: list[str] = []
    for spec in specs:
        fid = spec.flow_id
        state = seen.states.get(fid)
        if state not in ("COMPLETED", "FAILED"):
            problems.append(f"{fid} ({spec.kind}) ended {state}, not COMPLETED or FAILED")
        problems += _check_flow(fid, state, seen)
        if spec.kids:
            problems += _check_family(spec, seen)
    problems += _check_runs(seen, freeze)
    return problems


def _check_family(spec: Spec, seen: Observed) -> list[str]:
    """The family oracle (`_sigkill_family.audit_family`) for the parent `spec`, and the
    per-flow one for each of its children."""
    kids = spec.kids
    if FAMILY_ENDS[spec.kind] != seen.states.get(spec.flow_id):
        expected = FAMILY_ENDS[spec.kind]
        return [
            f"{spec.flow_id} ({spec.kind}) ended {seen.states.get(spec.flow_id)}, not {expected}"
        ]
    states = {k.flow_id: _state(seen.states.get(k.flow_id)) for k in kids}
    problems = fam.audit_family(
        spec.flow_id, spec.kind, spec.data["max"], kids, states, seen.history, seen.order
    )
    for k in kids:
        if k.expected is not None:
            problems += _check_flow(k.flow_id, seen.states.get(k.flow_id), seen)
    return problems


FAMILY_ENDS = {kind: state.name for kind, (_w, state) in fam.FAMILIES.items()}


def _state(name: str | None) -> flow.State | None:
    return None if name is None else flow.State[name]


def _check_flow(fid: str, state: str | None, seen: Observed) -> list[str]:
    """One flow's history: each outcome once, compensations in reverse order of its steps."""
    problems: list[str] = []
    events = seen.history.get(fid, ())
    recorded = Counter((e.kind, e.step) for e in events if e.kind in ("step", "compensated"))
    for (kind, step), n in sorted(recorded.items()):
        if n > 1:
            problems.append(f"{fid}: the {kind} outcome of {step!r} is recorded {n} times")
    done = [
        e.step
        for e in events
        if e.kind == "step"
        and e.step in COMPENSATED
        and e.detail["outcome"] in ("continue", "park")
    ]
    undone = [e.step for e in events if e.kind == "compensated"]
    expected = list(reversed(done)) if state == "FAILED" else []
    if undone != expected:
        problems.append(f"{fid} ({state}): compensated {undone}, completed {done}")
    return problems


def _check_runs(seen: Observed, freeze: Freeze | None) -> list[str]:
    """Runs at most 1 + takeovers; no write over a live lease; nothing from the frozen owner."""
    problems: list[str] = []
    hits: Counter[str] = Counter(a.key for a in seen.audit if a.rerun)
    for key, n in sorted(seen.runs.items()):
        if n > 1 + hits[key]:
            problems.append(f"{key} ran {n} times; takeovers that caught it: {hits[key]}")
    for a in seen.audit:
        if (
            a.old_state in ("RUNNING", "COMPENSATING")
            and a.old_owner not in (None, a.app)
            and a.old_lease is not None
            and a.old_lease >= a.written_at
        ):
            problems.append(
                f"{a.flow_id}: {a.app} wrote revision {a.new_revision} over {a.old_owner}'s"
                f" lease (until {a.old_lease:.3f}, written at {a.written_at:.3f};"
                f" {a.old_state} at {a.old_step!r} -> {a.new_state}, owner {a.new_owner})"
            )
    if freeze is not None:
        for a in seen.audit:
            if (
                a.id > freeze.thawed_after
                and a.app == freeze.owner
                and freeze.held.get(a.flow_id) == a.old_revision
            ):
                problems.append(
                    f"{a.flow_id}: the frozen owner {freeze.owner} advanced it after it woke,"
                    f" from revision {a.old_revision}, which it held when it was frozen"
                )
    return problems


def check_limited(
    dsn: str, seen: Observed, flows: int, seed: int, epoch: float
) -> tuple[list[str], int]:
    """The limits half of the oracle (`_sigkill_limited.audit_limited`, and its counters back
    to 0) on the fleet's limited flows, and the most of them active at once."""
    import psycopg

    queued = limited_specs(flows, seed)
    ids = {q.flow_id for q in queued}
    states = {fid: _state(seen.states.get(fid)) for fid in ids}
    order = limited_order(seen, ids)
    problems = lim.audit_limited(queued, states, seen.history, epoch, order)
    with psycopg.connect(dsn, autocommit=True) as conn:
        problems += lim.budget_left(_SyncTx(conn))
    return problems, lim.max_active(order)


def summary(specs: Sequence[Spec], seen: Observed, reports: Sequence[Mapping[str, Any]]) -> str:
    ends = Counter(seen.states.values())
    takeovers = Counter(a.old_owner for a in seen.audit if a.takeover)
    reruns = sum(n - 1 for n in seen.runs.values() if n > 1)
    lines = [
        f"{len(specs)} flows: {dict(ends)}; {len(seen.audit)} audited writes;"
        f" takeovers by former owner {dict(takeovers)}; {reruns} re-runs of a body",
    ]
    for r in reports:
        lines.append(
            f"  {r['owner']}: completed {r['completed']} failed {r['failed']} steps"
            f" {r['steps_run']} claimed {r['claimed']} lost {r['lost']} conflicts"
            f" {r['conflicts']} renewals {r['renewals']} writes {r['writes']}/"
            f"{r['write_batches']} batches wakes {r['wakes']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
