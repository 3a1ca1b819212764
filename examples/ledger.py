"""The ledger demo: many concurrent clients, one per-key ferry, a durable journal, an exact audit.

    python examples/ledger.py [--clients 500] [--accounts 100] [--ops 30000] [--seed 1]
                              [--db PATH | --postgres DSN] [--timeout 10] [--json] ...

Simulated clients (trio tasks) send deposits, withdrawals and transfers, each with its own id, to
a per-key ferry (keyed by the account debited) over `ProjectedWrite` on SQLite (a file in a temp
dir, or `--db PATH`) or PostgreSQL (`--postgres DSN`). A withdrawal above the balance is refused
on its merits; that refusal is the stored answer. Clients follow the rules of docs/fleet.md: on
`Failed`, `Rejected`, `Closed` or a timeout they retry with the same id and content.

While it runs, a progress line shows inputs done, rate, batch sizes, rejections and failures.
At the end a summary gives throughput, batch sizes, latency percentiles and outcomes, with a
legend (`--json`: the same as one JSON object on stdout), and the oracle
(`examples/ledger_domain.verify`) checks that every balance equals the fold of its journal and
that every acknowledged input is in the journal exactly once, with the answer its client got.
The exit code is 1 if it finds anything, 2 for a bad option.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

import attrs
import trio

if not __package__:  # run as a script: make `examples.ledger_domain` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ferry
from examples import _cli as cli
from examples import ledger_domain as ledger
from ferry.projected import PostgresStore, ProjectedWrite, SqliteStore, Store, Tx

T = TypeVar("T")

KINDS: tuple[ledger.Kind, ...] = ("deposit", "withdraw", "transfer")


def make_ops(n: int, accounts: int, seed: int) -> list[ledger.Op]:
    """`n` operations over `accounts` accounts, from `seed` alone (ids are unique per seed)."""
    rng = random.Random(seed)
    names = [f"acct-{i:04d}" for i in range(accounts)]
    ops = []
    for i in range(n):
        kind = rng.choices(KINDS, weights=(4, 3, 3))[0]
        source = rng.choice(names)
        amount = rng.randint(1, 100)
        op_id = f"s{seed}-{i}"
        if kind == "transfer" and accounts > 1:
            dest = rng.choice([a for a in names if a != source])
            ops.append(ledger.transfer(op_id, source, dest, amount))
        elif kind == "deposit" or kind == "transfer":
            ops.append(ledger.deposit(op_id, source, amount))
        else:
            ops.append(ledger.withdraw(op_id, source, amount))
    return ops


class FlakyStore:
    """Wraps a store; a fraction `rate` of transactions fail, half of them after committing (the
    database did the work, the answer was lost on the way back): what a retry must survive."""

    def __init__(self, inner: Store, rate: float, rng: random.Random) -> None:
        self.inner = inner
        self.rate = rate
        self.rng = rng
        self.injected = 0

    @property
    def dialect(self) -> str:
        return self.inner.dialect

    async def transact(self, fn: Callable[[Tx], T]) -> T:
        roll = self.rng.random()
        if roll < self.rate / 2:
            self.injected += 1
            raise ConnectionError("injected fault before the transaction")
        result = await self.inner.transact(fn)
        if roll < self.rate:
            self.injected += 1
            raise ConnectionError("injected fault after the commit: the answer was lost")
        return result

    async def aclose(self) -> None:
        await self.inner.aclose()


@attrs.define
class Tally:
    """What the clients saw. `acknowledged`: id -> (op, answer the client was given)."""

    acknowledged: dict[str, tuple[ledger.Op, Any]] = attrs.Factory(dict)
    latencies: list[float] = attrs.Factory(list)
    outcomes: dict[str, int] = attrs.Factory(
        lambda: dict.fromkeys(("ok", "refused", "committed", "id_reused", "gave_up"), 0)
    )
    retries: dict[str, int] = attrs.Factory(
        lambda: dict.fromkeys(("rejected", "failed", "closed", "timeout"), 0)
    )

    @property
    def done(self) -> int:
        return sum(self.outcomes.values())


async def submit(
    f: ferry.PerKeyFerry[ledger.Op, Any],
    op: ledger.Op,
    tally: Tally,
    *,
    patience: float,
    attempts: int,
    rng: random.Random,
) -> None:
    """One client request, with the client rules: retry on Failed, Rejected, Closed and timeouts
    (`patience` seconds per try) with the same op (same id, same content), backing off with
    jitter; at most `attempts` tries."""
    start = time.perf_counter()
    backoff = 0.005
    for _ in range(attempts):
        try:
            with trio.fail_after(patience):
                answer = await f(op)
        except ferry.Rejected:
            tally.retries["rejected"] += 1
        except ferry.Failed:
            tally.retries["failed"] += 1
        except ferry.Closed:
            tally.retries["closed"] += 1
        except trio.TooSlowError:
            tally.retries["timeout"] += 1
        except ferry.IdReused:
            tally.outcomes["id_reused"] += 1  # a client bug: never retried
            return
        else:
            tally.latencies.append(time.perf_counter() - start)
            if isinstance(answer, ferry.Committed):
                tally.outcomes["committed"] += 1
                answer = answer.provisional
            else:
                tally.outcomes["ok" if answer["ok"] else "refused"] += 1
            tally.acknowledged[op.id] = (op, answer)
            return
        await trio.sleep(rng.uniform(0, backoff))
        backoff = min(backoff * 2, 0.5)
    tally.outcomes["gave_up"] += 1


def batch_summary(stats: ferry.FerryStatistics) -> tuple[int, float, int]:
    """(calls, mean inputs per call, largest call), counting direct calls as calls of one."""
    calls = stats.batches + stats.direct_calls
    inputs = stats.inputs_sent + stats.direct_calls
    largest = max(stats.batch_sizes, default=1 if stats.direct_calls else 0)
    return calls, inputs / calls if calls else 0.0, largest


class Progress:
    """One status line: redrawn with \\r on a TTY (10 times a second), else a plain line every
    second; `finish()` draws the final state once more."""

    def __init__(
        self, f: ferry.PerKeyFerry[ledger.Op, Any], tally: Tally, total: int, out: TextIO
    ) -> None:
        self.f, self.tally, self.total, self.out = f, tally, total, out
        self.tty = out.isatty()
        self.start = self.last_time = time.perf_counter()
        self.last_done = 0
        self.rate = 0.0

    def draw(self, *, final: bool = False) -> None:
        now = time.perf_counter()
        done = self.tally.done
        if final:
            self.rate = done / max(now - self.start, 1e-9)
        elif now - self.last_time >= 0.5 or not self.tty:
            self.rate = (done - self.last_done) / (now - self.last_time)
            self.last_time, self.last_done = now, done
        _, mean, _ = batch_summary(self.f.statistics())
        rej, failed = self.tally.retries["rejected"], self.tally.retries["failed"]
        text = (
            f"{done:>7}/{self.total} inputs  {self.rate:>7.0f}/s  batch {mean:5.1f}  "
            f"rejected {rej}  failed {failed}  {now - self.start:5.1f} s"
        )
        if self.tty:
            width = 24
            filled = round(width * done / self.total) if self.total else width
            end = "\n" if final else ""
            self.out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}{end}")
        else:
            self.out.write(text + "\n")
        self.out.flush()

    async def run(self) -> None:
        while True:
            await trio.sleep(0.1 if self.tty else 1.0)
            self.draw()


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The `q` quantile of `sorted_values` (nearest rank), or None if there are none."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


LEGEND = """\

  legend
  outcomes   what each client finally got: ok (done), refused (done, refused on its merits, say
             for insufficient funds: that refusal is the stored answer), committed (durable, its
             view not confirmed yet: the sweeper finishes it), id_reused (an id sent again with
             other content: a client bug, never retried), gave_up (no answer after 50 tries)
  retries    why a client sent an input again, with the same id and content: rejected (the
             waiting room was full), failed (its batch call raised: here, an injected fault in
             the journal transaction; every client of that batch retries, so failed is at least
             the faults that hit a journal transaction), closed (the ferry was closing), timeout
             (no answer within --timeout)
  journal    written: inputs appended. replayed: retried inputs found already journaled (their
             fault struck after the commit): the stored answer is returned, nothing is written
             twice. fence conflicts: batches refused because another writer held the key.
             injected faults: store transactions failed on purpose (--faults, half of them after
             the commit), in journal, projection and sweeper transactions alike
"""


async def run(args: argparse.Namespace, store: Store, where: str) -> int:
    ops = make_ops(args.ops, args.accounts, args.seed)
    await ledger.make_write(store).setup()  # the schema, without faults
    flaky = FlakyStore(store, args.faults, random.Random(args.seed + 2))
    pw: ProjectedWrite[ledger.Op] = ledger.make_write(flaky)
    tally = Tally()
    rng = random.Random(args.seed + 1)
    print(
        f"ledger: {cli.plural(len(ops), 'input')} from {cli.plural(args.clients, 'client')} over"
        f" {cli.plural(args.accounts, 'account')},"
        f" {where}",
        file=sys.stderr if args.json else sys.stdout,
        flush=True,
    )
    start = time.perf_counter()
    async with ferry.open_per_key_ferry(
        pw,
        key=ledger.op_key,
        max_batch_size=args.max_batch_size,
        max_batch_delay=args.max_batch_delay,
        max_in_flight_batches=args.in_flight,
        max_queueing=args.max_queueing,
        direct_calls=not args.no_direct_calls,
    ) as f:
        async with trio.open_nursery() as background:
            background.start_soon(pw.run_sweeper, 1.0)
            progress = Progress(f, tally, len(ops), sys.stderr)
            if not args.quiet:
                background.start_soon(progress.run)
            work = iter(ops)

            async def client() -> None:
                for op in work:  # a shared iterator: each client takes the next op when free
                    await submit(f, op, tally, patience=args.timeout, attempts=50, rng=rng)

            async with trio.open_nursery() as clients:
                for _ in range(args.clients):
                    clients.start_soon(client)
            elapsed = time.perf_counter() - start
            background.cancel_scope.cancel()
            if not args.quiet:
                progress.draw(final=True)
        stats = f.statistics()
    flaky.rate = 0.0  # the audit itself runs on a healthy store
    await pw.sweep()  # finish any view the run left behind, then audit everything
    problems = await ledger.verify(pw, acknowledged=tally.acknowledged, caught_up=True)
    lost = len(ops) - len(tally.acknowledged) - tally.outcomes["id_reused"]
    if lost:
        problems.append(f"{lost} inputs were never acknowledged")

    calls, mean, largest = batch_summary(stats)
    lat = sorted(tally.latencies)
    pstats = pw.statistics()
    summary: dict[str, Any] = {
        "inputs": len(ops),
        "store": where,
        "seconds": round(elapsed, 3),
        "throughput_per_second": round(len(tally.acknowledged) / elapsed, 1),
        "batch_calls": calls,
        "mean_batch": round(mean, 2),
        "largest_batch": largest,
        "direct_calls": stats.direct_calls,
        "latency_ms": {
            name: None if (v := percentile(lat, q)) is None else round(v * 1e3, 2)
            for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
        },
        "outcomes": dict(tally.outcomes),
        "retries": dict(tally.retries),
        "journal": {
            "written": pstats.written,
            "replayed": pstats.replayed,
            "fence_conflicts": pstats.fence_conflicts,
            "injected_faults": flaky.injected,
        },
        "verification": {"ok": not problems, "problems": problems},
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary, acknowledged=len(tally.acknowledged))
    return 1 if problems else 0


def print_summary(summary: dict[str, Any], *, acknowledged: int) -> None:
    """The summary as an aligned table, the first problems if any, and the legend."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    latency = summary["latency_ms"]
    journal = summary["journal"]
    problems = summary["verification"]["problems"]
    rows = [
        ("time", f"{summary['seconds']:.2f} s"),
        ("throughput", f"{summary['throughput_per_second']:,.0f} inputs/s"),
        (
            "batch calls",
            f"{summary['batch_calls']:,} (mean {summary['mean_batch']:.1f} inputs, largest"
            f" {summary['largest_batch']}; {summary['direct_calls']:,} direct)",
        ),
        ("latency", "   ".join(f"{q} {ms(v)}" for q, v in latency.items())),
        ("outcomes", "   ".join(f"{k} {v:,}" for k, v in summary["outcomes"].items())),
        ("retries", "   ".join(f"{k} {v:,}" for k, v in summary["retries"].items())),
        (
            "journal",
            f"{journal['written']:,} written, {journal['replayed']:,} replayed,"
            f" {journal['fence_conflicts']:,} fence conflicts,"
            f" {journal['injected_faults']:,} injected faults",
        ),
    ]
    if problems:
        rows.append(("verification", f"FAILED: {len(problems)} problems"))
    else:
        rows.append(
            (
                "verification",
                f"OK: every balance equals the fold of its journal; all {acknowledged:,}"
                " acknowledged inputs are in the journal exactly once",
            )
        )
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for problem in problems[:20]:
        print(f"    {problem}")
    if len(problems) > 20:
        print(f"    ... and {len(problems) - 20} more")
    print(LEGEND, end="")


def build_parser() -> cli.ArgumentParser:
    p = cli.parser(__doc__)
    p.add_argument(
        "--clients", metavar="N", type=cli.integer(1), default=500, help="concurrent clients"
    )
    p.add_argument("--accounts", metavar="N", type=cli.integer(1), default=100, help="accounts")
    p.add_argument("--ops", metavar="N", type=cli.integer(0), default=30_000, help="inputs in all")
    cli.add_seed(p, 1)
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--db",
        type=cli.new_file,
        metavar="PATH",
        help="SQLite file (default: a new file in a temporary directory)",
    )
    p.connects(
        where.add_argument(
            "--postgres",
            type=cli.postgres_dsn,
            metavar="DSN",
            help="use PostgreSQL at this connection string, checked at start (default: SQLite)",
        )
    )
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=cli.number(0, above=True),
        default=10.0,
        help="seconds a client waits for one try before it retries",
    )
    cli.add_ferry_options(p)
    p.add_argument(
        "--max-batch-delay",
        metavar="SECONDS",
        type=cli.number(0),
        default=0.0,
        help="seconds a partial batch waits for company",
    )
    p.add_argument(
        "--max-queueing",
        metavar="N",
        type=cli.integer(1),
        default=10_000,
        help="most inputs waiting at once",
    )
    p.add_argument(
        "--no-direct-calls",
        action="store_true",
        help="batch every input, even for an idle key (more throughput under heavy load)",
    )
    p.add_argument(
        "--faults",
        metavar="FRACTION",
        type=cli.number(0, below=1),
        default=0.01,
        help="fraction of store transactions that fail, half of them after committing",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument(
        "--json", action="store_true", help="print the summary as one JSON object on stdout"
    )
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


async def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    if args.postgres:
        async with PostgresStore(args.postgres) as pg:
            return await run(args, pg, "PostgreSQL")
    if args.db:
        async with SqliteStore(args.db) as lite:
            return await run(args, lite, f"SQLite {args.db}")
    with tempfile.TemporaryDirectory(prefix="ledger-") as tmp:
        path = Path(tmp) / "ledger.db"
        async with SqliteStore(path) as lite:
            return await run(args, lite, f"SQLite {path}")


if __name__ == "__main__":
    with cli.ctrl_c("ledger.py"):
        sys.exit(cli.run(main, sys.argv[1:]))
