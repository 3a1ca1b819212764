"""Order fulfilment with `ferry.flow`: durable sagas that reserve stock, charge a card, wait for the
payment gateway, and ship, or undo what they did.

    python examples/orders.py [--orders 200] [--rate 150] [--seed 1] [--timeout 1.5]
                              [--db PATH | --postgres DSN] [--crash] [--metrics-port N]
                              [--trace] [--json] [--quiet]

Every order is a flow of the plan ``order`` (version 1):

1. ``reserve`` takes the stock (``fail()`` if there is not enough); compensation: put it back.
2. ``charge`` charges the card, asks the simulated payment gateway to confirm, and parks until
   the gateway publishes ``payment.confirmed`` or ``payment.declined`` (choreography: mappers
   registered with ``engine.on`` turn each event into a wake of its order, the event id as
   message id); a park that times out compensates. Compensation: refund the charge.
3. ``ship`` fails the order if the payment was declined, else ships it (the carrier is flaky:
   a first attempt sometimes raises, and the step is retried).

The shop's services (stock, payments, carrier) are tables in the same store, and every call is
idempotent: it carries the step's ``ctx.idempotency_key`` (putting stock back names the
reservation), so a step that runs again after a crash repeats the call and the repeat changes
nothing (counted as "repeats absorbed"). The gateway is
a task that reads the charges due for an answer and publishes events: some before the order
parks (the charge step publishes at once: the wake is ``QUEUED``), some twice (``DUPLICATE``),
some after the order gave up (``STALE``), some never (the park times out).

While it runs, a progress line (stderr) shows the flows by state. At the end a summary with a
legend, and an audit: every completed order was charged once and shipped once and keeps its
stock; every failed order was refunded what it was charged and has its stock back; stock adds
up; no step outcome is recorded twice in any history; each order's progress (every step emits
to its stream, ``reserved``, ``charged``, ``shipped`` or, compensating, ``refunded`` and ``stock
put back``, and sets its event ``progress``) holds each value once, in order, and agrees with
its end. The exit code is 1 if the audit fails.

``--crash`` runs the engine in a child process and SIGKILLs it mid-run, at the worst moment for
one order (picked at random from the seed among those arriving mid-run): its card has just been
charged and its ``charge`` step has not returned, so nothing durable says the charge happened.
A new engine on the same database recovers the flows, runs that step again, and the repeated
charge is absorbed by its idempotency key (at least one "repeat absorbed"; other steps caught in
flight add theirs). The progress line and the summary count both engines.

``--db PATH`` keeps the store (``python -m ferry.flow PATH list`` looks at its flows); without
it the store is a file in a temporary directory, removed at the end. ``--postgres DSN`` runs on
PostgreSQL; ``--json`` prints the summary as JSON. ``--metrics-port N`` serves the engine's
Prometheus metrics while it runs (``curl 127.0.0.1:N/metrics``; a slow run to watch them:
``--orders 2000 --rate 50``).
``--trace`` gives the engine an OpenTelemetry TracerProvider and prints, at the end, the spans
of one flow (one whose step raised and was retried) as an indented tree: one trace from its
start across its park to its end (needs opentelemetry-sdk; not with ``--crash``, whose engines
run in child processes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TextIO

import attrs
import trio

if not __package__:  # run as a script: make `ferry` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import _cli as cli
from examples import _trace
from ferry import flow
from ferry.projected import PostgresStore, SqliteStore, Store, Tx

#: What the simulated gateway does with a charge -> how often (weights)
GATEWAY: dict[str, int] = {
    "confirm": 50,  # confirms after a short delay: the wake is RESUMED, the order completes
    "early": 12,  # confirms before the order parks: QUEUED, and the park takes it at once
    "twice": 12,  # confirms twice, same event id: the second is DUPLICATE
    "decline": 10,  # declines: ship fails the order, compensations run
    "never": 8,  # never answers: the park times out, compensations run
    "late": 8,  # answers after the timeout: STALE (or QUEUED while compensating)
}
SKUS = {"tea": 10_000, "cups": 10_000, "pot": 10_000, "kettle": 10_000, "rare-leaf": 25}
TICK = 0.05  # seconds between the counters a --crash child reports to its parent

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS orders_stock (
        sku TEXT PRIMARY KEY, initial BIGINT NOT NULL, available BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS orders_reservations (
        key TEXT PRIMARY KEY, order_id TEXT NOT NULL, sku TEXT NOT NULL, qty BIGINT NOT NULL,
        released INTEGER NOT NULL, calls BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS orders_charges (
        key TEXT PRIMARY KEY, order_id TEXT NOT NULL, run TEXT NOT NULL, amount BIGINT NOT NULL,
        gateway TEXT NOT NULL, due DOUBLE PRECISION NOT NULL, published INTEGER NOT NULL,
        calls BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS orders_refunds (
        key TEXT PRIMARY KEY, order_id TEXT NOT NULL, amount BIGINT NOT NULL,
        calls BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS orders_shipments (
        key TEXT PRIMARY KEY, order_id TEXT NOT NULL, tracking TEXT NOT NULL,
        calls BIGINT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS orders_charges_due ON orders_charges (run, published, due)",
]

LEGEND = {
    "orders": "flows started, one per order, and how they ended (from the store)",
    "failed_because": "why the failed orders failed (their flow's error)",
    "time": "wall time until every order had settled (with --crash: of the whole run, restart"
    " included)",
    "steps": "step attempts started by the engine(s), per second of that time; retries: "
    "attempts after a step raised (the carrier is flaky). With --crash, these counters add up"
    " both engines, the killed one's as of its last report (every 0.05 s), so a few steps it ran"
    " in its last moments may be missing",
    "wakes": "what became of each wake sent by the gateway's events (flow.Delivery): RESUMED "
    "woke a parked order, QUEUED was kept for an order not parked yet, DUPLICATE was a repeated "
    "event id, STALE came after the order had ended",
    "compensations": "compensation attempts (stock put back, charges refunded)",
    "writes": "durable step boundaries and the database transactions that carried them "
    "(group commit: many flows share one transaction)",
    "repeats_absorbed": "calls to the shop's services that came again with an idempotency key "
    "already used (a step re-run after a crash) and changed nothing",
    "crash": "engine processes killed with SIGKILL, and flows the next engine resumed",
    "store": "where the flows and the shop's tables are: an SQLite file (kept: it is still there"
    " after the run, for python -m ferry.flow PATH list; --db PATH keeps it) or PostgreSQL",
    "metrics": "with --metrics-port: where the engine's Prometheus metrics were served while it"
    " ran, and what one scrape at the end found (ferry_flow_steps_total should equal the steps"
    " run; docs/operating.md explains every metric)",
    "audit": "charged once and shipped once per completed order; refunded and restocked per "
    "failed order; stock adds up; no step outcome recorded twice",
    "note": "shown when more orders timed out than the gateway left unanswered by design: the "
    "machine could not keep up with --rate",
    "trace": "with --trace: the OpenTelemetry spans of one flow (one whose step raised and was"
    " retried), a tree under its start span: one trace across its park",
}


@attrs.frozen
class Order:
    order_id: str
    sku: str
    qty: int
    amount: int
    gateway: str  # a key of GATEWAY
    delay: float  # seconds from the charge to the gateway's answer
    flaky_carrier: bool
    arrival: float  # seconds after the run's start at which the customer places the order


def make_orders(n: int, seed: int, run: str, rate: float) -> list[Order]:
    """`n` orders from `seed`, arriving `rate` per second on average (their ids carry the `run`
    tag, so runs never share a flow)."""
    rng = random.Random(seed)
    kinds = list(GATEWAY)
    weights = [GATEWAY[k] for k in kinds]
    orders = []
    for i in range(n):
        sku = rng.choice(list(SKUS))
        orders.append(
            Order(
                order_id=f"{run}-order-{i:04d}",
                sku=sku,
                qty=rng.randint(1, 3),
                amount=rng.randint(5, 120),
                gateway=rng.choices(kinds, weights)[0],
                delay=round(rng.uniform(0.05, 0.6), 3),
                flaky_carrier=rng.random() < 0.1,
                arrival=round(rng.uniform(0, n / rate), 3),
            )
        )
    return orders


# ----------------------------------------------------------------------- the shop's services


def setup(tx: Tx, run: str) -> None:
    for statement in SCHEMA:
        tx.execute(statement)
    for sku, units in SKUS.items():
        tx.execute(
            "INSERT INTO orders_stock (sku, initial, available) VALUES (?, ?, ?)"
            " ON CONFLICT (sku) DO NOTHING",
            (f"{run}/{sku}", units, units),
        )


def _again(tx: Tx, table: str, key: str) -> bool:
    """True if `key` was used before in `table` (and counts the repeat)."""
    rows = tx.execute(f"UPDATE {table} SET calls = calls + 1 WHERE key = ? RETURNING key", (key,))
    return bool(rows)


def reserve_tx(tx: Tx, key: str, order: Order, sku: str) -> bool:
    """Take `order.qty` of `sku` unless there is not enough; idempotent by `key`."""
    if _again(tx, "orders_reservations", key):
        return True
    taken = tx.execute(
        "UPDATE orders_stock SET available = available - ? WHERE sku = ? AND available >= ?"
        " RETURNING sku",
        (order.qty, sku, order.qty),
    )
    if not taken:
        return False
    tx.execute(
        "INSERT INTO orders_reservations (key, order_id, sku, qty, released, calls)"
        " VALUES (?, ?, ?, ?, 0, 1)",
        (key, order.order_id, sku, order.qty),
    )
    return True


def release_tx(tx: Tx, reservation: str) -> None:
    """Put a reservation's stock back; idempotent (a released reservation stays released)."""
    rows = tx.execute(
        "UPDATE orders_reservations SET released = 1 WHERE key = ? AND released = 0"
        " RETURNING sku, qty",
        (reservation,),
    )
    for sku, qty in rows:
        tx.execute("UPDATE orders_stock SET available = available + ? WHERE sku = ?", (qty, sku))


def charge_tx(tx: Tx, key: str, order: Order, run: str, due: float, published: bool) -> bool:
    """Charge the card and tell the gateway (`due`: when it answers); idempotent by `key`.
    True if this call charged (False: a repeat)."""
    if _again(tx, "orders_charges", key):
        return False
    tx.execute(
        "INSERT INTO orders_charges (key, order_id, run, amount, gateway, due, published, calls)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, 1)",
        (key, order.order_id, run, order.amount, order.gateway, due, int(published)),
    )
    return True


def refund_tx(tx: Tx, key: str, charge: str) -> None:
    """Refund what the charge `charge` took; idempotent by `key`."""
    if _again(tx, "orders_refunds", key):
        return
    tx.execute(
        "INSERT INTO orders_refunds (key, order_id, amount, calls)"
        " SELECT ?, order_id, amount, 1 FROM orders_charges WHERE key = ?",
        (key, charge),
    )


def ship_tx(tx: Tx, key: str, order_id: str) -> str:
    """Hand the parcel to the carrier; idempotent by `key`. The tracking number."""
    rows = tx.execute(
        "UPDATE orders_shipments SET calls = calls + 1 WHERE key = ? RETURNING tracking", (key,)
    )
    if rows:
        return str(rows[0][0])
    tracking = f"TRK-{uuid.uuid4().hex[:10].upper()}"
    tx.execute(
        "INSERT INTO orders_shipments (key, order_id, tracking, calls) VALUES (?, ?, ?, 1)",
        (key, order_id, tracking),
    )
    return tracking


def due_answers(tx: Tx, run: str, now: float) -> list[tuple[str, str, str]]:
    return [
        (r[0], r[1], r[2])
        for r in tx.execute(
            "SELECT key, order_id, gateway FROM orders_charges"
            " WHERE run = ? AND published = 0 AND due <= ? ORDER BY due",
            (run, now),
        )
    ]


def unanswered(tx: Tx, run: str) -> int:
    """Charges the gateway still has to answer (it never answers the "never" ones)."""
    rows = tx.execute(
        "SELECT COUNT(*) FROM orders_charges WHERE run = ? AND published = 0"
        " AND gateway <> 'never'",
        (run,),
    )
    return int(rows[0][0])


def mark_published(tx: Tx, keys: list[str]) -> None:
    tx.executemany("UPDATE orders_charges SET published = 1 WHERE key = ?", [(k,) for k in keys])


# ---------------------------------------------------------------------------------- the saga


@attrs.define
class Shop:
    """The services the steps call, the run's orders, and the engine once it is open."""

    store: Store
    run: str
    orders: dict[str, Order]
    timeout: float
    epoch: float  # wall-clock time of the run's start (orders arrive after it)
    engine: flow.Engine | None = None
    settled: int = 0
    ended: Counter[str] = attrs.Factory(Counter)  # orders settled (seen by `wait`), by state
    steps_before: int = 0  # steps a killed engine ran before this one (--crash), as reported
    mark: str | None = None  # --crash: the order whose charge the parent kills the engine in
    metrics_port: int | None = None  # --metrics-port

    async def call(self, fn: Any, *args: Any) -> Any:
        """``fn(tx, *args)`` in a transaction of its own, after the service's latency."""
        await trio.sleep(0.005)
        return await self.store.transact(lambda tx: fn(tx, *args))


def payment_event(order_id: str) -> dict[str, str]:
    return {"id": f"pay-{order_id}", "order": order_id}


def make_plan(shop: Shop) -> flow.Plan:
    order = flow.Plan("order", version=1)

    async def release(ctx: flow.Context) -> None:
        await shop.call(release_tx, ctx.data["reservation"])
        ctx.emit("stock put back")

    async def refund(ctx: flow.Context) -> None:
        await shop.call(refund_tx, ctx.idempotency_key, ctx.data["charge"])
        ctx.emit("refunded")

    @order.step(compensate=release)
    async def reserve(ctx: flow.Context) -> flow.Outcome | None:
        o = shop.orders[ctx.flow_id]
        if not await shop.call(reserve_tx, ctx.idempotency_key, o, f"{shop.run}/{o.sku}"):
            return flow.fail(f"out of stock: {o.qty} x {o.sku}")
        ctx.data["reservation"] = ctx.idempotency_key
        ctx.emit("reserved")  # the order's progress: its stream, and the event "progress"
        ctx.set_event("progress", "stock reserved")
        return None

    @order.step(compensate=refund)
    async def charge(ctx: flow.Context) -> flow.Outcome:
        o = shop.orders[ctx.flow_id]
        early = o.gateway == "early"
        late = shop.timeout + 0.3 if o.gateway == "late" else o.delay
        due = time.time() + late
        await shop.call(charge_tx, ctx.idempotency_key, o, shop.run, due, early)
        if ctx.flow_id == shop.mark:  # --crash: charged, the step not returned: kill me now
            print(f"charged {ctx.flow_id}", flush=True)
            await trio.sleep(30)  # the parent's SIGKILL comes first
        ctx.data["charge"] = ctx.idempotency_key
        ctx.emit("charged")
        ctx.set_event("progress", "charged: waiting for the gateway")
        if early:  # the gateway answers before the order parks: the wake is kept (QUEUED)
            assert shop.engine is not None
            await shop.engine.publish("payment.confirmed", payment_event(o.order_id))
        return flow.park(timeout=shop.timeout)

    @order.step(attempts=3)
    async def ship(ctx: flow.Context) -> flow.Outcome | None:
        if ctx.wake["status"] == "declined":
            return flow.fail("payment declined")
        if shop.orders[ctx.flow_id].flaky_carrier and ctx.attempt == 1:
            raise ConnectionError("the carrier's API timed out")
        ctx.data["tracking"] = await shop.call(ship_tx, ctx.idempotency_key, ctx.flow_id)
        ctx.emit("shipped")
        ctx.set_event("progress", "shipped")
        return None

    return order


def confirmed(event: Any) -> flow.Wake:
    return flow.Wake(event["order"], {"status": "confirmed"}, message_id=event["id"])


def declined(event: Any) -> flow.Wake:
    return flow.Wake(event["order"], {"status": "declined"}, message_id=event["id"])


async def gateway(shop: Shop, engine: flow.Engine) -> None:
    """The simulated payment gateway: answers the charges that are due, all at once, then notes
    them as answered (so after a crash an answer may come again: events are at-least-once)."""

    async def answer(order_id: str, kind: str) -> None:
        event_type = "payment.declined" if kind == "decline" else "payment.confirmed"
        for _ in range(2 if kind == "twice" else 1):
            await engine.publish(event_type, payment_event(order_id))

    while True:
        due = await shop.store.transact(partial(due_answers, run=shop.run, now=time.time()))
        async with trio.open_nursery() as nursery:
            for _key, order_id, kind in due:
                if kind != "never":
                    nursery.start_soon(answer, order_id, kind)
        if due:
            await shop.store.transact(partial(mark_published, keys=[d[0] for d in due]))
        await trio.sleep(0.02)


class Progress:
    """One status line on stderr: redrawn in place on a TTY, else a line every second."""

    def __init__(self, shop: Shop, engine: flow.Engine, out: TextIO) -> None:
        self.shop, self.engine, self.out = shop, engine, out
        self.tty = out.isatty()

    def draw(self, *, final: bool = False) -> None:
        """Settled orders by state as their `wait` saw them (after a --crash restart, every
        order is waited for again, so these add up to the summary); running and parked: this
        engine's; steps and the clock: the whole run's, the killed engine's included."""
        s = self.engine.statistics()
        shop = self.shop
        elapsed = max(0.0, time.time() - shop.epoch)
        steps = shop.steps_before + s.steps_run
        text = (
            f"{shop.settled:>5}/{len(shop.orders)} settled  running {s.running:>4}"
            f"  parked {s.parked:>4}  completed {shop.ended['COMPLETED']:>4}"
            f"  failed {shop.ended['FAILED']:>4}"
            f"  steps {steps:>5} ({steps / max(elapsed, 1e-9):,.0f}/s)"
            f"  {elapsed:4.1f} s"
        )
        if self.tty:
            self.out.write(f"\r{text}" + ("\n" if final else ""))
        else:
            self.out.write(text + "\n")
        self.out.flush()

    async def run(self) -> None:
        while True:
            await trio.sleep(0.1 if self.tty else 1.0)
            self.draw()


def counters(engine: flow.Engine, settle_seconds: float | None = None) -> dict[str, Any]:
    """The engine's statistics that the summary shows, as JSON."""
    s = engine.statistics()
    return {
        "steps": s.steps_run,
        "step_retries": s.step_retries,
        "compensations": s.compensations_run,
        "wakes": {d.name: n for d, n in s.wakes.items()},
        "writes": s.writes,
        "write_batches": s.write_batches,
        "recovered": s.recovered,
        "seconds": settle_seconds,
    }


async def drive(
    shop: Shop,
    *,
    quiet: bool,
    on_open: Callable[[], None] | None = None,
    tick: Any = None,
    tracer_provider: Any = None,
) -> dict[str, Any]:
    """Open the engine, start every order (idempotent), run the gateway, and wait until every
    order is settled (and the gateway has sent its late answers). The engine's `counters`.
    `tick(counters)` is called every `TICK` seconds while it runs, if given."""
    plan = make_plan(shop)
    t0 = time.perf_counter()
    async with (
        flow.open_engine(shop.store, plans=[plan], tracer_provider=tracer_provider) as engine,
        metrics_served(engine, shop.metrics_port) as url,
    ):
        shop.engine = engine
        engine.on("payment.confirmed", confirmed)
        engine.on("payment.declined", declined)
        if on_open is not None:
            on_open()
        progress = Progress(shop, engine, sys.stderr)
        async with trio.open_nursery() as background:
            background.start_soon(gateway, shop, engine)
            if not quiet:
                background.start_soon(progress.run)
            if tick is not None:
                background.start_soon(ticking, engine, tick)

            async def one(o: Order) -> None:
                await trio.sleep(max(0.0, shop.epoch + o.arrival - time.time()))
                data = {"sku": o.sku, "qty": o.qty, "amount": o.amount}
                await engine.start(plan, flow_id=o.order_id, data=data)
                snap = await engine.wait(o.order_id)
                shop.ended[snap.state.name] += 1
                shop.settled += 1

            async with trio.open_nursery() as nursery:
                for o in shop.orders.values():
                    nursery.start_soon(one, o)
            settled = time.perf_counter() - t0
            with trio.move_on_after(shop.timeout + 2.0):  # the late answers, to see them STALE
                while await shop.store.transact(partial(unanswered, run=shop.run)):  # noqa: ASYNC110
                    await trio.sleep(0.05)
            if not quiet:
                progress.draw(final=True)
            background.cancel_scope.cancel()
        result = counters(engine, settled)
        if url is not None:  # one scrape of our own endpoint, to show what it serves
            result["metrics"] = await trio.to_thread.run_sync(scrape, url)
    shop.engine = None
    return result


@asynccontextmanager
async def metrics_served(engine: flow.Engine, port: int | None) -> AsyncIterator[str | None]:
    """With --metrics-port: the engine's Prometheus metrics (`ferry.metrics`) served on
    127.0.0.1 while the run lasts; the URL. Else nothing (None)."""
    if port is None:
        yield None
        return
    import prometheus_client

    from ferry import metrics

    registry = prometheus_client.CollectorRegistry()
    collector = metrics.register(engine, registry=registry)
    server, thread = prometheus_client.start_http_server(port, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    print(f"metrics: {url} (while the run lasts)", file=sys.stderr, flush=True)
    try:
        yield url
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.shutdown)
        server.server_close()
        thread.join()
        collector.unregister()


def scrape(url: str) -> dict[str, Any]:
    """Fetch `url` once: how many metric families it served, and the step attempts it counted."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    steps = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ferry_flow_steps_total{")
    )
    return {"url": url, "families": text.count("# TYPE "), "steps_total": int(steps)}


async def ticking(engine: flow.Engine, tick: Callable[[dict[str, Any]], None]) -> None:
    while True:
        await trio.sleep(TICK)
        tick(counters(engine))


# ---------------------------------------------------------------------------------- the audit


def _rows(tx: Tx, run: str) -> dict[str, list[tuple[Any, ...]]]:
    like = f"{run}-%"
    return {
        "stock": tx.execute(
            "SELECT sku, initial, available FROM orders_stock WHERE sku LIKE ?", (f"{run}/%",)
        ),
        "reservations": tx.execute(
            "SELECT order_id, sku, qty, released, calls FROM orders_reservations"
            " WHERE order_id LIKE ?",
            (like,),
        ),
        "charges": tx.execute(
            "SELECT order_id, amount, calls FROM orders_charges WHERE order_id LIKE ?", (like,)
        ),
        "refunds": tx.execute(
            "SELECT order_id, amount, calls FROM orders_refunds WHERE order_id LIKE ?", (like,)
        ),
        "shipments": tx.execute(
            "SELECT order_id, calls FROM orders_shipments WHERE order_id LIKE ?", (like,)
        ),
    }


@attrs.define
class Audit:
    states: Counter[str] = attrs.Factory(Counter)
    reasons: Counter[str] = attrs.Factory(Counter)
    absorbed: int = 0
    problems: list[str] = attrs.Factory(list)


REASONS = {"out of stock": "out_of_stock", "declined": "declined", "timed out": "no_answer"}


def _reason(error: str | None) -> str:
    """The short reason of a failed order: a value of `REASONS`, or the whole error."""
    for cue, reason in REASONS.items():
        if error is not None and cue in error:
            return reason
    return str(error)


async def audit(store: Store, engine: flow.Engine, shop: Shop) -> Audit:
    """Check the shop's tables against the flows' end states and histories (module doc)."""
    result = Audit()
    rows = await store.transact(partial(_rows, run=shop.run))
    per: dict[str, dict[str, list[tuple[Any, ...]]]] = {}
    for table in ("reservations", "charges", "refunds", "shipments"):
        for row in rows[table]:
            per.setdefault(row[0], {}).setdefault(table, []).append(row)
            result.absorbed += row[-1] - 1
    held: Counter[str] = Counter()
    for oid, o in shop.orders.items():
        snap = await engine.get(oid)
        state = "MISSING" if snap is None else snap.state.name
        result.states[state] += 1
        mine = per.get(oid, {})
        reservations = mine.get("reservations", [])
        charged = sum(r[1] for r in mine.get("charges", []))
        refunded = sum(r[1] for r in mine.get("refunds", []))
        shipped = len(mine.get("shipments", []))
        if state == "COMPLETED":
            if len(mine.get("charges", [])) != 1 or refunded or shipped != 1:
                result.problems.append(
                    f"{oid} completed but was charged {len(mine.get('charges', []))} times,"
                    f" refunded {refunded}, shipped {shipped} times"
                )
            if len(reservations) != 1 or reservations[0][3]:
                result.problems.append(f"{oid} completed without its stock held")
            if o.gateway in ("decline", "never"):
                result.problems.append(f"{oid} completed, but its gateway said {o.gateway}")
        elif state == "FAILED":
            assert snap is not None
            reason = _reason(snap.error)
            result.reasons[reason] += 1
            if reason not in REASONS.values():
                result.problems.append(f"{oid} failed for an unexpected reason: {reason}")
            if refunded != charged or shipped:
                result.problems.append(
                    f"{oid} failed: charged {charged}, refunded {refunded}, shipped {shipped}"
                )
            if any(not r[3] for r in reservations):
                result.problems.append(f"{oid} failed but its stock was not put back")
        else:
            result.problems.append(f"{oid} ended {state}, not COMPLETED or FAILED")
        for r in reservations:
            if not r[3]:
                held[r[1]] += r[2]
        twice = [
            f"{kind} {step}"
            for (kind, step), n in Counter(
                (e.kind, e.step)
                for e in await engine.history(oid)
                if e.kind in ("step", "compensated")
            ).items()
            if n > 1
        ]
        if twice:
            result.problems.append(f"{oid}: recorded more than once: {', '.join(twice)}")
        result.problems += await progress_problems(engine, oid, state)
    for sku, initial, available in rows["stock"]:
        if available + held[sku] != initial:
            result.problems.append(
                f"stock of {sku}: {available} available + {held[sku]} held != {initial}"
            )
    return result


async def progress_problems(engine: flow.Engine, oid: str, state: str) -> list[str]:
    """What is wrong with the order's progress (its stream and its event "progress"): offsets
    1, 2, 3, ... with each value once, whatever crashed; a completed order reserved, charged
    and shipped; a failed one never shipped, and refunded and put back what it took."""
    got = [item async for item in engine.stream(oid)]
    values = [v for _n, v in got]
    events = await engine.get_events(oid)
    problems = []
    if [n for n, _v in got] != list(range(1, len(got) + 1)) or len(set(values)) != len(values):
        problems.append(f"{oid}: its stream is not each value once, in order: {got}")
    if state == "COMPLETED" and (
        values != ["reserved", "charged", "shipped"] or events != {"progress": "shipped"}
    ):
        problems.append(f"{oid} completed, but its progress says {values} and {events}")
    if state == "FAILED" and (
        "shipped" in values
        or ("charged" in values) != ("refunded" in values)
        or ("reserved" in values) != ("stock put back" in values)
    ):
        problems.append(f"{oid} failed, but its progress says {values}")
    return problems


# -------------------------------------------------------------------------------- the summary


def summary(
    shop: Shop,
    stats: dict[str, Any],
    checked: Audit,
    seconds: float,
    kills: int,
    store: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "orders": {"started": len(shop.orders), **dict(sorted(checked.states.items()))},
        "failed_because": dict(checked.reasons.most_common()),
        "time": round(seconds, 3),
        "steps": {
            "run": stats["steps"],
            "per_second": round(stats["steps"] / max(seconds, 1e-9), 1),
            "retries": stats["step_retries"],
        },
        "wakes": stats["wakes"],
        "compensations": stats["compensations"],
        "writes": {"boundaries": stats["writes"], "transactions": stats["write_batches"]},
        "repeats_absorbed": checked.absorbed,
        "crash": {"kills": kills, "recovered": stats["recovered"]},
        "store": store or {"kind": "postgres"},
        **({"metrics": stats["metrics"]} if "metrics" in stats else {}),
        "audit": {"ok": not checked.problems, "problems": checked.problems},
        **overload(shop, checked),
    }


def kept(store: dict[str, Any]) -> str:
    """The summary's "store" row: where the store is, and whether it is still there."""
    if store["kind"] == "postgres":
        return "PostgreSQL (--postgres)"
    if store["kept"]:
        return f"{store['path']} (kept: python -m ferry.flow {store['path']} list shows its flows)"
    return f"{store['path']} (a temporary file, removed now: --db PATH keeps the store)"


def overload(shop: Shop, checked: Audit) -> dict[str, str]:
    """A note if more orders timed out than the gateway left unanswered by design ("never" and
    "late"): then answers came too late because the machine could not keep up with the rate."""
    timed_out = checked.reasons.get(REASONS["timed out"], 0)
    by_design = sum(1 for o in shop.orders.values() if o.gateway in ("never", "late"))
    if timed_out <= by_design:
        return {}
    return {
        "note": f"{timed_out - by_design:,} more orders timed out than the gateway left unanswered"
        f" ({by_design:,}): its answers came too late for --timeout {shop.timeout:g} because this"
        " machine could not keep up with the orders' rate; try a lower --rate or a longer"
        " --timeout"
    }


def show(report: dict[str, Any], where: str, out: TextIO) -> None:
    def pairs(d: dict[str, Any]) -> str:
        return "   ".join(
            f"{k.replace('_', ' ')} {v:,}" if isinstance(v, int) else f"{k.replace('_', ' ')} {v}"
            for k, v in d.items()
        )

    w = report["writes"]
    per = w["boundaries"] / w["transactions"] if w["transactions"] else 0.0
    problems = report["audit"]["problems"]
    rows = [
        ("orders", pairs(report["orders"])),
        ("failed because", pairs(report["failed_because"]) or "-"),
        ("time", f"{report['time']:.2f} s ({where})"),
        ("steps", pairs(report["steps"])),
        ("wakes", pairs(report["wakes"])),
        ("compensations", f"{report['compensations']:,}"),
        ("writes", f"{pairs(w)}   ({per:.1f} boundaries per transaction)"),
        ("repeats absorbed", f"{report['repeats_absorbed']:,}"),
        ("crash", pairs(report["crash"])),
        ("store", kept(report["store"])),
        *(
            [
                (
                    "metrics",
                    "{url}: {families} metric families, step attempts {steps_total}".format(
                        **report["metrics"]
                    ),
                )
            ]
            if "metrics" in report
            else []
        ),
        (
            "audit",
            f"FAILED: {len(problems)} problems"
            if problems
            else "OK: completed orders charged and shipped once, failed ones refunded and"
            " restocked, stock adds up, no outcome recorded twice",
        ),
    ]
    if "note" in report:
        rows.append(("note", report["note"]))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        lines = textwrap.wrap(value, 100 - width) if name == "note" else [value]
        print(f"  {name:<{width}}  {lines[0]}", file=out)
        for more in lines[1:]:
            print(f"  {'':<{width}}  {more}", file=out)
    for problem in problems[:20]:
        print(f"    {problem}", file=out)
    print("\n  legend:", file=out)
    explained = {name for name, _ in rows} | ({"trace"} if "trace" in report else set())
    for key, text in LEGEND.items():
        name = key.replace("_", " ")
        if name not in explained:  # a line this run did not print (--metrics-port, ...)
            continue
        lines = textwrap.wrap(text, 96 - width)
        print(f"    {name:<{width}}  {lines[0]}", file=out)
        for more in lines[1:]:
            print(f"    {'':<{width}}  {more}", file=out)


# ------------------------------------------------------------------------------------ running


def open_store(args: argparse.Namespace, path: Path | None) -> Store:
    if args.postgres:
        return PostgresStore(args.postgres, connect_timeout=5.0)
    assert path is not None
    return SqliteStore(path)


def arriving(args: argparse.Namespace) -> str:
    """How many orders, and over how long they arrive (a large --orders at a low --rate takes
    a while: say so before it starts)."""
    orders = cli.plural(args.orders, "order")
    return f"{orders} arriving over {args.orders / args.rate:.1f} s ({args.rate:g}/s)"


def where(args: argparse.Namespace, path: Path | None) -> str:
    return "PostgreSQL" if args.postgres else f"SQLite {path}"


async def prepare(store: Store, run: str, args: argparse.Namespace) -> None:
    try:
        await store.transact(partial(setup, run=run))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        target = "PostgreSQL (--postgres)" if args.postgres else f"the SQLite file {args.db}"
        fail(f"cannot use {target}: {first}")


async def in_process(args: argparse.Namespace, path: Path | None, run: str) -> int:
    """Everything in this process: prepare, drive, audit."""
    async with open_store(args, path) as store:  # type: ignore[attr-defined]
        await prepare(store, run, args)
        shop = make_shop(store, args, run)
        if not args.json:
            print(f"orders: {arriving(args)}, {where(args, path)}", flush=True)
        traces = _trace.Collector() if args.trace else None
        provider = None if traces is None else traces.provider
        stats = await drive(shop, quiet=args.quiet, tracer_provider=provider)
        return await finish(args, path, shop, stats, stats["seconds"], kills=0, traces=traces)


async def finish(
    args: argparse.Namespace,
    path: Path | None,
    shop: Shop,
    stats: dict[str, Any],
    seconds: float,
    kills: int,
    traces: _trace.Collector | None = None,
) -> int:
    if not (args.quiet or args.json):
        print(f"auditing {len(shop.orders)} orders ...", file=sys.stderr, flush=True)
    async with flow.open_engine(shop.store, plans=[make_plan(shop)]) as engine:
        checked = await audit(shop.store, engine, shop)
    store = None if path is None else {"kind": "sqlite", "path": str(path), "kept": bool(args.db)}
    report = summary(shop, stats, checked, seconds, kills, store)
    lines: list[str] = []
    if traces is not None:  # --trace: one flow's spans
        shown = _trace.one_flow(traces.spans())
        if shown is not None:
            report["trace"] = shown
            lines = _trace.render(shown)
    if args.json:
        print(json.dumps({**report, "legend": LEGEND}, indent=2))
    else:
        show(report, where(args, path), sys.stdout)
        if lines:
            print("\n" + "\n".join(lines))
    return 1 if checked.problems else 0


def make_shop(store: Store, args: argparse.Namespace, run: str) -> Shop:
    orders = make_orders(args.orders, args.seed, run, args.rate)
    epoch = time.time() if args.epoch is None else args.epoch
    shop = Shop(store, run, {o.order_id: o for o in orders}, args.timeout, epoch)
    shop.metrics_port = args.metrics_port
    return shop


async def worker(args: argparse.Namespace, path: Path | None) -> None:
    """``--crash``'s child: drive the run `args.run`. Prints ``open`` once the engine is open,
    then its counters every `TICK` seconds (so a parent that kills it knows what it did), and at
    the end."""

    def tell(stats: dict[str, Any]) -> None:
        print("stats " + json.dumps(stats), flush=True)

    async with open_store(args, path) as store:  # type: ignore[attr-defined]
        shop = make_shop(store, args, args.run)
        shop.mark, shop.steps_before = args.mark, args.steps_before
        opened = partial(print, "open", flush=True)
        tell(await drive(shop, quiet=args.quiet, on_open=opened, tick=tell))


def victim(args: argparse.Namespace, run: str) -> str:
    """The order whose charge the --crash run kills the engine in: picked from the seed among the
    orders that arrive mid-run (30% to 90% of the arrivals) and whose stock cannot run out."""
    orders = make_orders(args.orders, args.seed, run, args.rate)
    span = args.orders / args.rate
    mid = [o for o in orders if 0.3 * span <= o.arrival <= 0.9 * span and o.sku != "rare-leaf"]
    pool = mid or [o for o in orders if o.sku != "rare-leaf"] or orders
    return random.Random(args.seed + 1).choice(pool).order_id


def crash(args: argparse.Namespace, path: Path | None, run: str) -> int:
    """Drive the run in a child, SIGKILL it right after one order's charge (`victim`), drive it
    to the end in a new child, audit."""

    async def setup_store() -> None:
        async with open_store(args, path) as store:  # type: ignore[attr-defined]
            await prepare(store, run, args)

    cli.run(setup_store)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--run", run]
    command += ["--orders", str(args.orders), "--seed", str(args.seed), "--rate", str(args.rate)]
    command += ["--epoch", repr(time.time() + 0.5)]  # about when the first engine is open
    command += ["--timeout", str(args.timeout)] + (["--quiet"] if args.quiet or args.json else [])
    command += ["--postgres", args.postgres] if args.postgres else ["--db", str(path)]
    if args.metrics_port is not None:  # each engine process serves its own, in turn
        command += ["--metrics-port", str(args.metrics_port)]
    mark = victim(args, run)

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    say(f"orders: {arriving(args)}, {where(args, path)}, the engine in a child process")
    t0 = time.perf_counter()
    totals: Counter[str] = Counter()
    wakes: Counter[str] = Counter()
    kills = 0
    for attempt in range(2):
        more = ["--mark", mark] if attempt == 0 else ["--steps-before", str(totals["steps"])]
        child = subprocess.Popen(command + more, stdout=subprocess.PIPE, text=True)
        with stopped_with(child):
            lines, killed = drive_child(child, attempt, mark, say, t0)
        if killed:
            kills += 1
        if not killed and child.returncode != 0:
            fail(f"the engine process failed (exit code {child.returncode})")
        reports = [line[6:] for line in lines if line.startswith("stats ")]
        if reports:  # the killed engine's counters as of its last report (`TICK` apart)
            stats = json.loads(reports[-1])
            stats.pop("seconds")
            stats.pop("metrics", None)
            wakes.update(stats.pop("wakes"))
            totals.update(stats)
        if not killed:
            break
    seconds = time.perf_counter() - t0
    merged: dict[str, Any] = {**totals, "wakes": dict(wakes)}

    async def audited() -> int:
        async with open_store(args, path) as store:  # type: ignore[attr-defined]
            shop = make_shop(store, args, run)
            return await finish(args, path, shop, merged, seconds, kills)

    return cli.run(audited)


@contextlib.contextmanager
def stopped_with(child: subprocess.Popen[str]) -> Iterator[None]:
    """If the block is left by an exception (Ctrl-C) while the engine process still runs, it is
    stopped too (a terminal's Ctrl-C reaches it as well; a SIGINT to this process alone does not),
    and waited for: no engine is left holding the store."""
    try:
        yield
    except BaseException:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        raise


def drive_child(
    child: subprocess.Popen[str], attempt: int, mark: str, say: Callable[[str], None], t0: float
) -> tuple[list[str], bool]:
    """Read the engine process's lines until it ends; on the first attempt SIGKILL it once the
    victim `mark` was charged. Its lines, and whether it was killed."""
    assert child.stdout is not None
    line = child.stdout.readline()
    if line != "open\n":
        child.wait()
        fail(f"the engine process did not start (exit code {child.returncode})")
    killed = False
    lines = []
    if attempt == 0:
        for line in child.stdout:  # its counters every TICK s, until the victim is charged
            lines.append(line)
            if line == f"charged {mark}\n":
                child.send_signal(signal.SIGKILL)
                killed = True
                say(
                    f"\n  *** SIGKILL to the engine process {child.pid} after"
                    f" {time.perf_counter() - t0:.2f} s: order {mark} was just charged, and"
                    " its charge step had not returned ***"
                )
                break
    out, _ = child.communicate()
    lines += out.splitlines()
    return lines, killed


# ------------------------------------------------------------------------------ command line


def fail(message: str) -> NoReturn:
    print(f"orders.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def build_parser() -> cli.ArgumentParser:
    p = cli.parser(__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--orders",
        metavar="N",
        type=cli.integer(1, 100_000),
        default=200,
        help="orders to fulfil (1 to 100000)",
    )
    cli.add_seed(p, 1, "seed of the orders and the gateway")
    p.add_argument(
        "--rate",
        metavar="PER_SECOND",
        type=cli.number(1, 1e6),
        default=150.0,
        help="orders arriving per second (1 to 1000000)",
    )
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=cli.number(0.05, 3600),
        help="seconds an order waits for the gateway (default: 1.5; 3 with --crash, whose"
        " restart takes about a second: parks that expire meanwhile time out at once)",
    )
    place = p.add_mutually_exclusive_group()
    place.add_argument(
        "--db",
        metavar="PATH",
        type=cli.new_file,
        help="SQLite file, kept after the run (default: one in a temporary directory, removed)",
    )
    p.connects(
        place.add_argument(
            "--postgres",
            metavar="DSN",
            type=cli.postgres_dsn,
            help="run on PostgreSQL at this DSN (default: SQLite, see --db)",
        )
    )
    p.add_argument(
        "--crash",
        action="store_true",
        help="run the engine in a child process, SIGKILL it mid-run, restart it, audit",
    )
    p.add_argument(
        "--metrics-port",
        metavar="N",
        type=cli.integer(0, 65535),
        help="serve Prometheus metrics at 127.0.0.1:N/metrics while it runs (0: any free port;"
        " needs the metrics extra) (default: off)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="trace the flows with OpenTelemetry and print one flow's spans as a tree at the end",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--epoch", type=float, help=argparse.SUPPRESS)
    p.add_argument("--mark", help=argparse.SUPPRESS)  # see `victim`
    p.add_argument("--steps-before", type=int, default=0, help=argparse.SUPPRESS)
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.timeout is None:
        args.timeout = 3.0 if args.crash else 1.5
    if args.metrics_port is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            p.error("--metrics-port needs prometheus_client: pip install 'stm-ferry[metrics]'")
    if args.trace and args.crash:
        p.error(
            "--trace shows the spans this process's engine made: it cannot be combined with"
            " --crash, whose engines run in child processes"
        )
    if args.trace and not _trace.AVAILABLE:
        p.error(_trace.NEEDS)
    if args.worker and (args.run is None or args.crash):
        p.error("--worker is the engine process that --crash starts: use --crash")
    return args


def left_behind(args: argparse.Namespace) -> str:
    """What a run stopped by Ctrl-C leaves, and where to look at it."""
    if args.worker:  # --crash's child: its parent says it
        return ""
    if args.postgres:
        return "the orders that had not settled stay in the database as they were, unaudited"
    if args.db is None:
        return "the temporary store was removed with its orders (--db PATH keeps a store)"
    return (
        f"the orders that had not settled stay in {args.db} as they were, unaudited:"
        f" python -m ferry.flow {args.db} list"
    )


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    run = args.run or uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="orders-") as tmp:
        path = None if args.postgres else Path(args.db or os.path.join(tmp, "orders.db"))
        try:
            if args.worker:
                with cli.ctrl_c("orders.py (engine process)"):
                    cli.run(worker, args, path)
                return 0
            with cli.ctrl_c("orders.py", partial(left_behind, args)):
                if args.crash:
                    return crash(args, path, run)
                return cli.run(in_process, args, path, run)
        except flow.StoreLocked:
            fail(
                f"another engine is serving {path} right now (another orders.py?): wait for it"
                " to finish, or give another --db"
            )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
