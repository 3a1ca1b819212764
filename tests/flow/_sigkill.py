"""The SIGKILL test's pieces (ADR 0055): the child that runs the flows, the parent that
kills and restarts it, and the oracle.

The child (``python -m tests.flow._sigkill DIR --flows N --gen G ...``) opens an engine on
``DIR/flows.db`` (the path form: SQLite, WAL, ``synchronous=FULL``), starts every flow of the
scenario (idempotent, so a restarted child simply starts them again), publishes the scenario's
payment events at their (wall-clock) times, and waits for every flow to end. Its step bodies and
compensations are "external calls": each effective run inserts ``(idempotency key, attempt,
generation)`` into ``DIR/side.db``, another SQLite file, in autocommit, before the body goes on
and returns. A body that is to raise (a transient or a permanent error) raises before its call,
as a failed call has no effect, so the side table counts exactly the runs that had an effect.

The parent (`run_with_kills`) starts a child, SIGKILLs it at a seeded random moment (mostly a
little after the child's engine opened, sometimes while it is still starting or recovering),
and before it restarts the child it reads, from the flow store the dead process left, which
steps and compensations were in flight: the keys of the ``RUNNING`` and ``COMPENSATING`` flows.
That set is exactly the work the kill may have interrupted, measured independently of the side
table. The first and the last of the kills after the engine opened are not timed: that child
holds the first call it makes some time after its engine opened (``--hold-after``), says
``holding KEY`` and waits, and the parent kills it then, so those kills catch a body in flight
however slow the machine is. After the last kill a child runs to the end.

The oracle (`audit`, pure): every flow ends ``COMPLETED`` or ``FAILED`` (and the one its scenario
says); no step outcome and no compensation is recorded twice in its history; every key's
effective runs are at most 1 + the number of kills that caught that key in flight; every
step recorded as done (or parked) ran at least once; and a plain flow's stream (each call
emits its key, SPEC 5.10) is offsets 1, 2, 3, ... holding each recorded call's key once, in
the order of its history. See docs/adr/0055.

Some flows of the scenario are parents with children (`_sigkill_family`, docs/adr/0162): each
child's history and keys go through the same oracle, and its family half checks the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from ferry import flow
from ferry.flow._store import _signals, _store

from . import _sigkill_family as fam
from . import _sigkill_limited as lim
from ._helpers import _InlineTx

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("reserve", "charge", "ship", "notify")
COMPENSATED = frozenset({"reserve", "charge"})

# ------------------------------------------------------------------------------- the scenario

#: scenario -> (weight, expected end state)
SCENARIOS: dict[str, tuple[int, flow.State]] = {
    "woken": (40, flow.State.COMPLETED),  # a confirmation (before or after the park; maybe twice)
    "declined": (10, flow.State.FAILED),  # a decline: ship fails, compensations run
    "timeout": (15, flow.State.FAILED),  # no event: the park times out and compensates
    "continue": (10, flow.State.COMPLETED),  # no event: times out, on_timeout="continue"
    "fail": (10, flow.State.FAILED),  # ship returns fail()
    "raise": (10, flow.State.FAILED),  # ship raises on every attempt
    "flaky": (5, flow.State.COMPLETED),  # reserve and ship raise on their first attempt
}


@attrs.frozen
class Spec:
    """One flow of the scenario: its data, the payment events to publish, how it must end."""

    flow_id: str
    scenario: str
    data: dict[str, Any]
    events: tuple[tuple[float, str], ...]  # (seconds after the epoch, event id), maybe repeated
    expected: flow.State
    kids: tuple[fam.KidSpec, ...] = ()  # a parent's children (`_sigkill_family`)


def scenario(n: int, seed: int) -> list[Spec]:
    """`n` flows from `seed` alone: plain ones, and parents (`_sigkill_family.FAMILIES`) that
    take the place of some of them."""
    rng = random.Random(seed)
    names = [*SCENARIOS, *fam.FAMILIES]
    weights = [SCENARIOS[s][0] for s in SCENARIOS] + [w for w, _ in fam.FAMILIES.values()]
    specs = []
    for i in range(n):
        kind = rng.choices(names, weights)[0]
        fid = f"f{i:05d}"
        if kind in fam.FAMILIES:
            parent = fam.family_data(kind, rng)
            kids = fam.kid_specs(fid, parent)
            specs.append(Spec(fid, kind, parent, (), fam.FAMILIES[kind][1], kids))
            continue
        waits = kind in ("timeout", "continue")
        data: dict[str, Any] = {
            "kind": kind,
            "pause": round(rng.uniform(0.0, 0.08), 3),  # each call takes this long
            "timeout": round(rng.uniform(0.3, 2.0), 3) if waits else None,
            "on_timeout": "continue" if kind == "continue" else "compensate",
        }
        events: tuple[tuple[float, str], ...] = ()
        if not waits:
            at = rng.choice([0.0, round(rng.uniform(0.0, 4.0), 3)])  # 0: before the park
            events = ((at, f"evt-{fid}"),)
            if rng.random() < 0.3:  # the gateway sends it twice
                events += ((at + round(rng.uniform(0.0, 0.5), 3), f"evt-{fid}"),)
        specs.append(Spec(fid, kind, data, events, SCENARIOS[kind][1]))
    return specs


# ------------------------------------------------------------------------------------ the child


@attrs.define
class Hold:
    """Hold a body in flight for the parent to kill the child at: the first call made at or
    after `after` (monotonic) says ``holding KEY`` on stdout and never returns."""

    after: float = math.inf  # set once the engine is open
    held: bool = False

    async def __call__(self, key: str) -> None:
        if self.held or time.monotonic() < self.after:
            return
        self.held = True
        print(f"holding {key}", flush=True)
        await trio.sleep_forever()


def make_plan(
    side: sqlite3.Connection, gen: int, plant: str | None, hold: Hold | None = None
) -> flow.Plan:
    """The plan: reserve (compensated), charge (compensated; parks), ship, notify."""
    plan = flow.Plan("sigkill")

    async def call(ctx: flow.Context) -> None:
        """The external call: its effect is committed (autocommit) before the body goes on."""
        side.execute(
            "INSERT INTO runs (key, attempt, gen) VALUES (?, ?, ?)",
            (ctx.idempotency_key, ctx.attempt, gen),
        )
        ctx.emit(ctx.idempotency_key)  # saved with the outcome: once, whatever the kills
        if hold is not None:
            await hold(ctx.idempotency_key)
        await trio.sleep(ctx.data["pause"])

    async def replay_previous(ctx: flow.Context) -> None:
        # The planted bug: on a re-run, an engine that "resumes" by replaying the previous step
        # (what was reported of Prefect's resume) runs a step whose outcome is recorded.
        if plant == "replay" and ctx.attempt > 1 and ctx.step_index > 0:
            previous = STEPS[ctx.step_index - 1]
            key = f"{ctx.flow_id}/{ctx.step_index - 1}/{previous}"
            side.execute("INSERT INTO runs (key, attempt, gen) VALUES (?, ?, ?)", (key, 0, gen))

    async def release(ctx: flow.Context) -> None:
        if ctx.data["kind"] in ("raise", "timeout") and ctx.attempt == 1:
            raise ConnectionError("stock service busy")
        await call(ctx)

    async def refund(ctx: flow.Context) -> None:
        await call(ctx)

    @plan.step(compensate=release)
    async def reserve(ctx: flow.Context) -> None:
        if ctx.data["kind"] == "flaky" and ctx.attempt == 1:
            raise ConnectionError("stock service busy")
        await call(ctx)

    @plan.step(compensate=refund)
    async def charge(ctx: flow.Context) -> flow.Outcome:
        await replay_previous(ctx)
        await call(ctx)
        return flow.park(timeout=ctx.data["timeout"], on_timeout=ctx.data["on_timeout"])

    @plan.step
    async def ship(ctx: flow.Context) -> flow.Outcome | None:
        await replay_previous(ctx)
        kind = ctx.data["kind"]
        if kind == "raise" or (kind == "flaky" and ctx.attempt == 1):
            raise ConnectionError("carrier unavailable")
        if kind == "fail":
            return flow.fail("no carrier for this address")
        if ctx.wake is not None and not ctx.wake["ok"]:
            return flow.fail("payment declined")
        await call(ctx)
        return None

    @plan.step
    async def notify(ctx: flow.Context) -> flow.Outcome:
        await replay_previous(ctx)
        await call(ctx)
        return flow.COMPLETE

    assert tuple(s.name for s in plan.steps) == STEPS
    return plan


def make_plans(
    side: sqlite3.Connection, gen: int, plant: str | None, hold: Hold | None = None
) -> list[flow.Plan]:
    """The plain flows' plan, then the parents' and the children's (`_sigkill_family`)."""
    plan = make_plan(side, gen, plant, hold)

    async def call(ctx: flow.Context) -> None:
        side.execute(
            "INSERT INTO runs (key, attempt, gen) VALUES (?, ?, ?)",
            (ctx.idempotency_key, ctx.attempt, gen),
        )
        ctx.emit(ctx.idempotency_key)  # saved with the outcome: once, whatever the kills
        if hold is not None:
            await hold(ctx.idempotency_key)
        await trio.sleep(ctx.data["pause"])

    return [plan, *fam.make_family(call), lim.make_limited(call)]


def limited_specs(flows: int, seed: int) -> list[lim.Limited]:
    """The limited flows that run beside the scenario's (`_sigkill_limited`): a tenth as many."""
    return lim.limited_scenario(flows // 10, seed)


def open_side(path: Path) -> sqlite3.Connection:
    side = sqlite3.connect(path, isolation_level=None)
    side.execute("PRAGMA journal_mode=WAL")
    side.execute("PRAGMA synchronous=NORMAL")  # a process crash loses nothing committed
    side.execute("CREATE TABLE IF NOT EXISTS runs (key TEXT NOT NULL, attempt INT, gen INT)")
    return side


async def child(args: argparse.Namespace) -> None:
    work = Path(args.dir)
    side = open_side(work / "side.db")
    specs = scenario(args.flows, args.seed)
    hold = None if args.hold_after is None else Hold()
    plans = make_plans(side, args.gen, args.plant, hold)
    by_name = {p.name: p for p in plans}
    epoch = args.epoch

    def mapper(event: Any) -> flow.Wake:
        return flow.Wake(event["flow"], {"ok": event["ok"]}, message_id=event["id"])

    async with flow.open_engine(work / "flows.db", plans=plans) as engine:
        engine.on("payment", mapper)
        print("open", flush=True)
        if hold is not None:
            hold.after = time.monotonic() + args.hold_after

        async def publish(spec: Spec, at: float, event_id: str) -> None:
            await trio.sleep(max(0.0, epoch + at - time.time()))
            event = {"flow": spec.flow_id, "ok": spec.scenario != "declined", "id": event_id}
            await engine.publish("payment", event)

        async def one(spec: Spec) -> None:
            plan = by_name["batch" if spec.kids else "sigkill"]
            await engine.start(plan, flow_id=spec.flow_id, data=spec.data)
            async with trio.open_nursery() as nursery:
                for at, event_id in spec.events:
                    nursery.start_soon(publish, spec, at, event_id)
                await engine.wait(spec.flow_id)

        async def limited(spec: lim.Limited) -> None:
            at = None if spec.at is None else epoch + spec.at
            plan = by_name[lim.PLAN]
            await engine.start(
                plan, flow_id=spec.flow_id, data=spec.data, priority=spec.priority, at=at
            )
            await engine.wait(spec.flow_id)

        async with trio.open_nursery() as nursery:
            for spec in specs:
                nursery.start_soon(one, spec)
            for queued in limited_specs(args.flows, args.seed):
                nursery.start_soon(limited, queued)
        stats = engine.statistics()
    report = {
        "recovered": stats.recovered,
        "steps_run": stats.steps_run,
        "writes": stats.writes,
        "write_batches": stats.write_batches,
        "wakes": {d.name: n for d, n in stats.wakes.items()},
    }
    print("done " + json.dumps(report), flush=True)


# ----------------------------------------------------------------------------------- the parent


@attrs.define
class Run:
    """What the parent saw: per generation, whether it was killed and what it left in flight."""

    dir: Path
    flows: int
    kills: int = 0
    early_kills: int = 0  # kills that came before the child's engine had opened
    hits: Counter[str] = attrs.Factory(Counter)  # key -> kills that caught it in flight
    held: list[str] = attrs.Factory(list)  # the bodies held in flight for a kill
    reports: list[dict[str, Any]] = attrs.Factory(list)
    seconds: float = 0.0
    epoch: float = 0.0  # the scenario's time 0 (wall clock): its events' and delayed starts'


def _readline(proc: subprocess.Popen[str], deadline: float) -> str | None:
    """The child's next stdout line, or None if it did not come by `deadline` (monotonic)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
    return proc.stdout.readline() if ready else None


def in_flight(db: Path) -> list[str]:
    """The idempotency keys of the steps and compensations a dead engine left running."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        tables = conn.execute("SELECT name FROM sqlite_master WHERE name = 'flow_flows'")
        if not tables.fetchall():
            return []  # killed before it made its tables
        active = _store.load_active(_InlineTx(conn))
    finally:
        conn.close()
    keys = []
    for f in active:
        if f.state is flow.State.RUNNING:
            keys.append(f"{f.flow_id}/{f.step_index}/{f.step}")
        else:
            keys.append(f"{f.flow_id}/{f.step_index}-compensate/{f.step}")
    return keys


def run_with_kills(
    work: Path,
    *,
    flows: int,
    kills: int,
    seed: int,
    plant: str | None = None,
    patience: float = 120.0,
) -> Run:
    """Run the scenario in child processes, SIGKILLing `kills` of them at seeded random moments;
    the last child runs to the end. Raises AssertionError if a child fails or hangs."""
    rng = random.Random(seed)
    # Each kill: (early, delay). Now and then (early) `delay` s after the start, while the child
    # starts or recovers; else `delay` s after its engine opened. The first and the last of
    # those wait, after the delay, until the child holds a body in flight (`Hold`): whatever
    # the machine's speed, they catch work in flight, which runs again after.
    moments = []
    for _ in range(kills):
        early = rng.random() < 0.2
        moments.append((early, rng.uniform(0.05, 0.6) if early else rng.uniform(0.0, 0.6)))
    opened_kills = [gen for gen, (early, _) in enumerate(moments) if not early]
    holds = {opened_kills[0], opened_kills[-1]} if opened_kills else set()
    epoch = time.time() + 0.5  # roughly when the first child's engine is open
    run = Run(work, flows, epoch=epoch)
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for gen in range(kills + 1):
        last = gen == kills
        early, delay = (False, 0.0) if last else moments[gen]
        held = gen in holds
        command = [sys.executable, "-m", "tests.flow._sigkill", str(work)]
        command += ["--flows", str(flows), "--seed", str(seed), "--gen", str(gen)]
        command += ["--epoch", repr(epoch)] + (["--plant", plant] if plant else [])
        if held:
            command += ["--hold-after", repr(delay)]
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        try:
            deadline = time.monotonic() + patience
            if early:
                time.sleep(delay)
                opened = False
            else:
                line = _readline(proc, deadline)
                assert line == "open\n", f"generation {gen}: {line!r}, {_stderr(proc)}"
                opened = True
                if held:
                    line = _readline(proc, deadline)
                    if line is not None and line.startswith("done "):  # nothing left to hold
                        run.reports.append(_done(proc, line, deadline, gen))
                        break
                    assert line and line.startswith("holding "), f"{gen}: {line!r} {_stderr(proc)}"
                    run.held.append(line[len("holding ") :].strip())
                elif not last:
                    time.sleep(delay)
            if not last and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                run.kills += 1
                run.early_kills += not opened
                run.hits.update(in_flight(work / "flows.db"))
                continue
            run.reports.append(_report(proc, deadline, gen))
            break
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
    run.seconds = time.monotonic() - t0
    return run


def _report(proc: subprocess.Popen[str], deadline: float, gen: int) -> dict[str, Any]:
    """The last child's closing report, once it exited cleanly."""
    while (line := _readline(proc, deadline)) is not None:
        if line.startswith("done "):
            return _done(proc, line, deadline, gen)
        assert line, f"generation {gen} ended without a report: {_stderr(proc)}"
    raise AssertionError(f"generation {gen} did not finish in time: {_stderr(proc)}")


def _done(proc: subprocess.Popen[str], line: str, deadline: float, gen: int) -> dict[str, Any]:
    """The report on the child's ``done`` line, once it exited cleanly."""
    assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, _stderr(proc)
    report: dict[str, Any] = json.loads(line[5:])
    return report


def _stderr(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
    assert proc.stderr is not None
    return proc.stderr.read()[-3000:]


# ------------------------------------------------------------------------------------ the oracle


@attrs.frozen
class Observed:
    """What the oracle reads once everything has stopped."""

    states: Mapping[str, flow.State | None]  # flow id -> its end state (None: no such flow)
    history: Mapping[str, Sequence[flow.Event]]
    runs: Counter[str]  # idempotency key -> effective runs (side table)
    order: Mapping[str, Sequence[int]] = attrs.Factory(dict)  # key -> its calls' row ids
    # a plain flow's stream, (offset, value): each step's and compensation's key, once
    streams: Mapping[str, Sequence[tuple[int, Any]]] = attrs.Factory(dict)


def read_outcome(work: Path, specs: Sequence[Spec]) -> Observed:
    """The flows' end states and histories (from the store) and the side table's runs."""
    conn = sqlite3.connect(work / "flows.db", isolation_level=None)
    try:
        tx: Any = _InlineTx(conn)
        states: dict[str, flow.State | None] = {}
        history: dict[str, list[flow.Event]] = {}
        for fid in [f for spec in specs for f in (spec.flow_id, *(k.flow_id for k in spec.kids))]:
            row = _store.load(tx, fid)
            states[fid] = None if row is None else row.state
            history[fid] = _store.load_history(tx, fid) or []
        streams = {
            spec.flow_id: [(n, json.loads(v)) for n, v in _signals.stream_of(tx, spec.flow_id, 0)]
            for spec in specs
            if not spec.kids
        }
    finally:
        conn.close()
    side = sqlite3.connect(work / "side.db")
    try:
        order = fam.read_order(side)
    finally:
        side.close()
    runs = Counter({key: len(ids) for key, ids in order.items()})
    return Observed(states, history, runs, order, streams)


def read_limited(
    work: Path, specs: Sequence[lim.Limited]
) -> tuple[
    dict[str, flow.State | None], dict[str, list[flow.Event]], list[tuple[str, str]], list[str]
]:
    """The limited flows' end states, histories and slot writes in commit order, and what
    `_sigkill_limited.budget_left` says of the plan's counters."""
    conn = sqlite3.connect(work / "flows.db", isolation_level=None)
    try:
        tx: Any = _InlineTx(conn)
        states: dict[str, flow.State | None] = {}
        history: dict[str, list[flow.Event]] = {}
        for spec in specs:
            row = _store.load(tx, spec.flow_id)
            states[spec.flow_id] = None if row is None else row.state
            history[spec.flow_id] = _store.load_history(tx, spec.flow_id) or []
        left = lim.budget_left(tx)
        order = lim.sqlite_order(tx)
    finally:
        conn.close()
    return states, history, order, left


def _step_index(flow_id: str, step: str) -> int:
    return STEPS.index(step) if step in STEPS else fam.step_index(flow_id, step)


def audit(specs: Sequence[Spec], outcome: Observed, hits: Counter[str]) -> list[str]:
    """Every violation of the oracle (module doc), one line each; empty if all holds."""
    problems = []
    for spec in specs:
        fid = spec.flow_id
        state = outcome.states.get(fid)
        if state not in (flow.State.COMPLETED, flow.State.FAILED):
            problems.append(f"{fid} ({spec.scenario}) ended {state}, not COMPLETED or FAILED")
        elif state is not spec.expected:
            problems.append(f"{fid} ({spec.scenario}) ended {state}, expected {spec.expected}")
        if spec.kids:
            problems += fam.audit_family(
                fid,
                spec.scenario,
                spec.data["max"],
                spec.kids,
                outcome.states,
                outcome.history,
                outcome.order,
            )
        for f in (fid, *(k.flow_id for k in spec.kids)):
            problems += _audit_history(f, outcome)
        if fid in outcome.streams:
            problems += _audit_stream(fid, outcome)
    for key, n in sorted(outcome.runs.items()):
        if n > 1 + hits[key]:
            problems.append(f"{key} ran {n} times, but only {hits[key]} kills caught it in flight")
    return problems


def _audit_history(fid: str, outcome: Observed) -> list[str]:
    """No step outcome or compensation recorded twice; every step recorded as done ran."""
    problems = []
    recorded = Counter(
        (e.kind, e.step) for e in outcome.history.get(fid, ()) if e.kind in ("step", "compensated")
    )
    for (kind, step), n in sorted(recorded.items()):
        if n > 1:
            problems.append(f"{fid}: the {kind} outcome of {step!r} is recorded {n} times")
    for e in outcome.history.get(fid, ()):
        if e.kind == "step" and e.detail["outcome"] in ("continue", "complete", "park"):
            assert e.step is not None
            if e.step == "fan":
                continue  # a spawn makes no call
            key = f"{fid}/{_step_index(fid, e.step)}/{e.step}"
            if outcome.runs[key] < 1:
                problems.append(f"{key} is recorded as done but never ran")
    return problems


def _audit_stream(fid: str, outcome: Observed) -> list[str]:
    """The flow's stream (SPEC 5.10) is offsets 1, 2, 3, ... holding, in order, the key of each
    call whose step or compensation is recorded: each once, whatever was killed."""
    got = outcome.streams[fid]
    if [n for n, _v in got] != list(range(1, len(got) + 1)):
        return [f"{fid}: its stream's offsets are not 1, 2, 3, ...: {[n for n, _v in got]}"]
    expected = []
    for e in outcome.history.get(fid, ()):
        assert e.step is None or e.step in STEPS
        if e.kind == "step" and e.detail["outcome"] in ("continue", "complete", "park"):
            expected.append(f"{fid}/{STEPS.index(e.step)}/{e.step}")
        elif e.kind == "compensated":
            expected.append(f"{fid}/{STEPS.index(e.step)}-compensate/{e.step}")
    values = [v for _n, v in got]
    if values != expected:
        return [f"{fid}: its stream holds {values}, its recorded calls are {expected}"]
    return []


def summary(run: Run, outcome: Observed) -> str:
    reruns = sum(max(0, n - 1) for n in outcome.runs.values())
    ends = Counter(s.name if s else "missing" for s in outcome.states.values())
    return (
        f"{run.flows} flows, {run.kills} kills ({run.early_kills} before the engine opened),"
        f" {sum(run.hits.values())} steps/compensations caught in flight, {reruns} re-runs,"
        f" ends {dict(ends)}, {run.seconds:.1f} s; " + fam.family_summary(run.hits)
    )


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(description="the SIGKILL test's child process")
    p.add_argument("dir")
    p.add_argument("--flows", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--gen", type=int, required=True)
    p.add_argument("--epoch", type=float, required=True)
    p.add_argument("--plant", choices=["replay"], default=None)
    p.add_argument("--hold-after", type=float, default=None, help="see `Hold` (after open)")
    args = p.parse_args(argv)
    assert math.isfinite(args.epoch)
    trio.run(child, args)


if __name__ == "__main__":
    main(sys.argv[1:])
