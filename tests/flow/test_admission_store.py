"""Flow control's store half (`_store/_admission.py`, docs/adr/0141, 0147) against real SQLite
and PostgreSQL: the store admits exactly what the pure rule admits, a rolled-back transaction
leaves the counts as they were, a slot is given back once, an admission costs the same index
probes with 1,000 and 100,000 flows queued, and (PostgreSQL) engines admitting at once on
their own connections never exceed a global or a per-key limit and never deadlock.

The tests drive the functions over a `Tx` of the driver's own connection, one transaction at a
time as the runtime will (its write path calls them next round); the flow rows are written here
as the runtime's batch will write them (a start inserts the row ``QUEUED``, an end writes its
state).
"""

from __future__ import annotations

import random
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest

from ferry.flow._model import _admission as adm
from ferry.flow._model._limits import Limits, Rate, StartOptions
from ferry.flow._store import _admission as sa
from ferry.flow._store import _dialect, _schema
from ferry.flow._store._sql import FLOWS, HISTORY
from tests import pg

T0 = 1_700_000_000.0


class SqliteTx:
    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.connection = conn
        self.statements: list[tuple[str, tuple[Any, ...]]] = []

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.statements.append((sql, tuple(params)))
        cur = self.connection.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self.connection.executemany(sql, rows)


class PgTx:
    dialect = "postgres"

    def __init__(self, conn: Any) -> None:
        self.connection = conn
        self.statements: list[tuple[str, tuple[Any, ...]]] = []

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self.statements.append((sql, tuple(params)))
        cur = self.connection.execute(sql.replace("%", "%%").replace("?", "%s"), params)
        return cur.fetchall() if cur.description is not None else []

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self.connection.cursor() as cur:
            cur.executemany(sql.replace("?", "%s"), rows)


Tx = SqliteTx | PgTx


@attrs.define
class Db:
    """One database and one connection to it; `transaction` runs a function in one
    transaction and commits, or rolls back on an exception. (The tests of engines at once give
    each thread a connection of its own.)"""

    connect: Callable[[], Tx]
    _tx: Tx | None = None

    @property
    def tx(self) -> Tx:
        if self._tx is None:
            self._tx = self.connect()
        return self._tx

    def transaction(self, fn: Callable[[Tx], Any]) -> Any:
        tx = self.tx
        tx.statements.clear()
        if isinstance(tx, SqliteTx):
            tx.connection.execute("BEGIN IMMEDIATE")
        try:
            out = fn(tx)
        except BaseException:
            tx.connection.rollback()
            raise
        tx.connection.commit()
        return out

    def close(self) -> None:
        if self._tx is not None:
            self._tx.connection.close()


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    if request.param == "sqlite":
        path = tmp_path / "flows.db"

        def connect() -> Tx:
            return SqliteTx(sqlite3.connect(path, isolation_level=None, timeout=30))

        made = Db(connect)
    else:
        import psycopg

        server: pg.PgServer = request.getfixturevalue("pg_server")
        dsn = server.fresh_schema_dsn("adm")

        def connect() -> Tx:
            return PgTx(psycopg.connect(dsn, autocommit=False))

        made = Db(connect)
    made.transaction(_schema.create_schema)
    yield made
    made.close()


def insert_queued(tx: Tx, plan: str, flow_id: str, blocked_from: str | None = None) -> None:
    """A start's row as the batch writes it: ``QUEUED``, held by nobody."""
    tx.execute(
        f"INSERT INTO {FLOWS} (flow_id, plan, version, state, step_index, attempt, data,"
        " revision, updated_at, timed_out, stack, start_data, created_at, blocked_from)"
        " VALUES (?, ?, 1, 'QUEUED', 0, 0, '{}', 0, ?, 0, '', '{}', ?, ?)",
        (flow_id, plan, T0, T0, blocked_from),
    )


def end(tx: Tx, flow_id: str, state: str = "COMPLETED") -> None:
    tx.execute(
        f"UPDATE {FLOWS} SET state = ?, revision = revision + 1 WHERE flow_id = ?",
        (state, flow_id),
    )


def states(tx: Tx, plan: str) -> dict[str, str]:
    rows = tx.execute(f"SELECT flow_id, state FROM {FLOWS} WHERE plan = ?", (plan,))
    return {str(f): str(s) for f, s in rows}


def _key(data: Any) -> str:
    return str(data)


def start_one(
    tx: Tx, *, plan: str, limits: Limits, fid: str, o: StartOptions, now: float
) -> list[sa.Admitted]:
    """A start: its row written ``QUEUED``, then queued (and what may go admitted)."""
    insert_queued(tx, plan, fid)
    return sa.enqueue(tx, plan, limits, fid, o, now, "e1")


def finish(tx: Tx, *, plan: str, limits: Limits, fid: str, now: float) -> list[sa.Admitted]:
    """An end: its row written ``COMPLETED``, then its slot given back."""
    end(tx, fid)
    return sa.release(tx, plan, limits, fid, now, "e1")


def cancel(tx: Tx, *, plan: str, limits: Limits, fid: str, now: float) -> list[sa.Admitted]:
    """A queued flow cancelled: its row written ``FAILED``, then taken out of the queue."""
    end(tx, fid, "FAILED")
    return sa.unqueue(tx, plan, limits, fid, now, "e1")


# ---------------------------------------------------------------- the store admits as the rule


@attrs.define
class Rule:
    """The pure rule's side of one plan: its usage and queue, driven like the store."""

    limits: Limits
    usage: adm.Usage = adm.EMPTY
    queue: list[adm.Waiting] = attrs.Factory(list)
    seq: int = 0

    def _admit(self, now: float) -> list[str]:
        taken, self.usage = adm.admit(self.limits, self.usage, self.queue, now)
        for w in taken:
            self.queue.remove(w)
        return [w.flow_id for w in taken]

    def enqueue(self, flow_id: str, o: StartOptions, now: float) -> list[str]:
        self.seq += 1
        turn = adm.turn_for(self.usage, self.queue, o.key)
        self.queue.append(adm.Waiting(flow_id, self.seq, o.key, o.priority, turn, o.not_before))
        return self._admit(now)

    def release(self, key: str | None, now: float) -> list[str]:
        self.usage = adm.release(self.usage, key)
        return self._admit(now)

    def unqueue(self, flow_id: str, now: float) -> list[str]:
        self.queue = [w for w in self.queue if w.flow_id != flow_id]
        return self._admit(now)


LIMITS = [
    Limits(concurrency=2),
    Limits(concurrency=3, key=_key, per_key=1),
    Limits(key=_key, per_key=2),
    Limits(key=_key, per_key=1, rate=Rate(2, per=10.0)),
    Limits(concurrency=4, key=_key, rate=Rate(3, per=5.0)),
]


@pytest.mark.parametrize("limits", LIMITS, ids=lambda x: str(x.stored()))
def test_the_store_admits_what_the_rule_admits(db: Db, limits: Limits) -> None:
    """Starts (keys, priorities, delays), ends, cancels of queued flows and the timer, at
    random: each transaction admits exactly the flows the pure rule admits, in its order, and
    the counters equal the rule's usage and the flows' own states. (Made to fail by ordering
    the open keys without their turn, and by a key row `open` without room under `per_key`.)"""
    rng = random.Random(str(limits.stored()))
    plan = "p"
    db.transaction(lambda tx: sa.register(tx, plan, limits))
    rule = Rule(limits)
    now = T0
    active: list[tuple[str, str | None]] = []
    queued: list[str] = []
    keys = {}
    for i in range(60):
        op = rng.random()
        if op < 0.5 or not (active or queued):
            fid = f"f{i:03}"
            key = rng.choice("abc") if limits.key is not None else None
            delay = rng.choice([None, None, None, 3.0, 7.0])
            o = StartOptions(rng.choice([0, 0, 1, -1]), None if delay is None else now + delay, key)
            keys[fid] = key
            got = db.transaction(
                partial(start_one, plan=plan, limits=limits, fid=fid, o=o, now=now)
            )
            want = rule.enqueue(fid, o, now)
            queued.append(fid)
        elif op < 0.8 and active:
            fid, key = active.pop(rng.randrange(len(active)))
            got = db.transaction(partial(finish, plan=plan, limits=limits, fid=fid, now=now))
            want = rule.release(key, now)
        elif op < 0.9 and queued:
            fid = queued.pop(rng.randrange(len(queued)))
            got = db.transaction(partial(cancel, plan=plan, limits=limits, fid=fid, now=now))
            want = rule.unqueue(fid, now)
        else:
            now += rng.choice([1.0, 2.5, 6.0])
            got = db.transaction(
                partial(sa.came_due, plan=plan, limits=limits, now=now, owner="e1")
            )
            want = rule._admit(now)
        assert [a.flow_id for a in got] == want, i
        for a in got:
            assert a.state == "RUNNING" and a.key == keys[a.flow_id]
            queued.remove(a.flow_id)
            active.append((a.flow_id, a.key))
        usage, n_queued = db.transaction(lambda tx: sa.usage(tx, plan))
        assert usage == attrs.evolve(rule.usage, window=usage.window)
        assert usage.window == adm.prune(limits, rule.usage, now).window or limits.rate is None
        assert n_queued == len(rule.queue) == len(queued)
        counted = db.transaction(lambda tx: sa.recount(tx, plan))
        assert sum(counted["active"].values()) == usage.active == len(active)
        assert sum(counted["queued"].values()) == len(queued)


def test_a_rolled_back_transaction_leaves_the_counts_as_they_were(db: Db) -> None:
    """A start that admitted and an end that gave back and admitted, each rolled back (its
    engine killed before the commit): counters, key rows, window and flows as before."""
    limits = Limits(concurrency=1, key=_key, per_key=1, rate=Rate(5, per=60.0))
    plan = "p"
    db.transaction(lambda tx: sa.register(tx, plan, limits))

    def start(fid: str, key: str) -> Callable[[Tx], list[sa.Admitted]]:
        def run(tx: Tx) -> list[sa.Admitted]:
            insert_queued(tx, plan, fid)
            return sa.enqueue(tx, plan, limits, fid, StartOptions(0, None, key), T0, "e1")

        return run

    assert [a.flow_id for a in db.transaction(start("f1", "a"))] == ["f1"]
    assert db.transaction(start("f2", "b")) == []

    def snapshot(tx: Tx) -> Any:
        return (
            sa.usage(tx, plan),
            sorted(tx.execute(f"SELECT * FROM {sa.KEYS}")),
            sorted(tx.execute(f"SELECT * FROM {sa.BUDGETS}")),
            sorted(tx.execute(f"SELECT * FROM {sa.ADMISSIONS}")),
            states(tx, plan),
        )

    before = db.transaction(snapshot)

    class Killed(Exception):
        pass

    def killed(fn: Callable[[Tx], Any], admitted: list[str]) -> Callable[[Tx], Any]:
        def run(tx: Tx) -> Any:
            assert [a.flow_id for a in fn(tx)] == admitted  # inside, before the kill
            raise Killed

        return run

    def finish(tx: Tx) -> list[sa.Admitted]:
        end(tx, "f1")
        return sa.release(tx, plan, limits, "f1", T0 + 1, "e1")

    with pytest.raises(Killed):
        db.transaction(killed(finish, ["f2"]))
    with pytest.raises(Killed):
        db.transaction(killed(start("f3", "c"), []))  # a start queued
    assert db.transaction(snapshot) == before
    assert [a.flow_id for a in db.transaction(finish)] == ["f2"]


def test_a_slot_is_given_back_once(db: Db) -> None:
    """An end released twice, a queued flow released, an active flow unqueued: `BudgetError`,
    nothing written (the flow's claim, its `seq`, is cleared by the one release)."""
    limits = Limits(concurrency=1)
    plan = "p"
    db.transaction(lambda tx: sa.register(tx, plan, limits))
    o = StartOptions(0, None, None)
    for fid in ("f1", "f2"):
        db.transaction(partial(start_one, plan=plan, limits=limits, fid=fid, o=o, now=T0))
    with pytest.raises(adm.BudgetError, match="gives back no slot"):
        db.transaction(lambda tx: sa.release(tx, plan, limits, "f1", T0, "e1"))
    db.transaction(partial(finish, plan=plan, limits=limits, fid="f1", now=T0))
    with pytest.raises(adm.BudgetError, match="holds nothing"):
        db.transaction(lambda tx: sa.release(tx, plan, limits, "f1", T0, "e1"))
    with pytest.raises(adm.BudgetError, match="once it has left the queue"):
        db.transaction(lambda tx: sa.unqueue(tx, plan, limits, "f2", T0, "e1"))
    usage, queued = db.transaction(lambda tx: sa.usage(tx, plan))
    assert (usage.active, queued) == (1, 0)
    assert db.transaction(lambda tx: states(tx, plan)) == {"f1": "COMPLETED", "f2": "RUNNING"}


def test_a_call_that_does_not_fit_is_refused_naming_it(db: Db) -> None:
    """A plan with no budget row, a key given to a plan without a key function (and none to one
    with), a flow not written ``QUEUED`` or queued twice: a `ValueError` naming it, nothing
    written."""
    limits = Limits(concurrency=1)
    keyed = Limits(key=_key, per_key=1)
    o = StartOptions(0, None, None)
    with pytest.raises(ValueError, match="'nope' has no budget row"):
        db.transaction(partial(start_one, plan="nope", limits=limits, fid="f0", o=o, now=T0))
    db.transaction(partial(sa.register, plan="p", limits=limits))
    db.transaction(partial(sa.register, plan="k", limits=keyed))
    with pytest.raises(ValueError, match="key 'a' does not fit limits whose key function is not"):
        db.transaction(
            partial(
                start_one, plan="p", limits=limits, fid="f1", o=StartOptions(0, None, "a"), now=T0
            )
        )
    with pytest.raises(ValueError, match="key None does not fit limits whose key function is set"):
        db.transaction(partial(start_one, plan="k", limits=keyed, fid="f1", o=o, now=T0))
    db.transaction(partial(start_one, plan="p", limits=limits, fid="f1", o=o, now=T0))
    with pytest.raises(ValueError, match="'f1' is not a flow of plan 'p' written QUEUED"):
        db.transaction(lambda tx: sa.enqueue(tx, "p", limits, "f1", o, T0, "e1"))
    assert db.transaction(partial(states, plan="p")) == {"f1": "RUNNING"}
    assert db.transaction(partial(states, plan="k")) == {}
    usage, queued = db.transaction(partial(sa.usage, plan="p"))
    assert (usage.active, queued) == (1, 0)


def test_a_blocked_flow_gives_its_slot_back_and_resumed_waits_its_turn(db: Db) -> None:
    """A flow blocked in ``COMPENSATING`` gives its slot back (the next flow is admitted); its
    resume queues it behind that one, keeping ``blocked_from``, and its admission writes it
    back ``COMPENSATING``, held by the admitting engine, revision + 1, with an ``admitted``
    history row."""
    limits = Limits(concurrency=1)
    plan = "p"
    o = StartOptions(0, None, None)
    db.transaction(partial(sa.register, plan=plan, limits=limits))
    for fid in ("f1", "f2"):
        db.transaction(partial(start_one, plan=plan, limits=limits, fid=fid, o=o, now=T0))

    def block(tx: Tx) -> list[sa.Admitted]:
        tx.execute(
            f"UPDATE {FLOWS} SET state = 'BLOCKED', blocked_from = 'COMPENSATING',"
            " revision = revision + 1 WHERE flow_id = 'f1'"
        )
        return sa.release(tx, plan, limits, "f1", T0 + 1, "e1")

    assert [a.flow_id for a in db.transaction(block)] == ["f2"]

    def resume(tx: Tx) -> list[sa.Admitted]:
        tx.execute(f"UPDATE {FLOWS} SET state = 'QUEUED' WHERE flow_id = 'f1'")
        return sa.enqueue(tx, plan, limits, "f1", o, T0 + 2, "e1")

    assert db.transaction(resume) == []
    got = db.transaction(partial(finish, plan=plan, limits=limits, fid="f2", now=T0 + 3))
    assert got == [sa.Admitted("f1", None, "COMPENSATING", 3)]
    row = db.transaction(
        lambda tx: tx.execute(
            f"SELECT state, blocked_from, owner, revision FROM {FLOWS} WHERE flow_id = 'f1'"
        )
    )
    assert row == [("COMPENSATING", None, "e1", 3)]
    kinds = db.transaction(
        lambda tx: tx.execute(
            f"SELECT revision, kind, at FROM {HISTORY} WHERE flow_id = 'f1' ORDER BY revision"
        )
    )
    assert kinds == [(1, "admitted", T0), (3, "admitted", T0 + 3)]


def test_a_clock_behind_never_widens_the_rate_window(db: Db) -> None:
    """`Rate(2, per=10)`: an admission at 100 s, then one by an engine whose clock says 95 s
    (recorded at 100 s, never before the window's last); at 105 s the window still holds both,
    so a third waits for the rate until 110 s, when it goes. (Made to fail by recording the
    engine's own time: the window then drops 95 s at 105 s and admits the third.)"""
    limits = Limits(rate=Rate(2, per=10.0))
    plan = "p"
    o = StartOptions(0, None, None)
    db.transaction(partial(sa.register, plan=plan, limits=limits))
    for fid, now in (("f1", T0 + 100), ("f2", T0 + 95), ("f3", T0 + 105)):
        db.transaction(partial(start_one, plan=plan, limits=limits, fid=fid, o=o, now=now))
    usage, queued = db.transaction(partial(sa.usage, plan=plan))
    assert usage.window == (T0 + 100, T0 + 100) and queued == 1
    why = db.transaction(
        partial(sa.waits_for, plan=plan, limits=limits, flow_id="f3", now=T0 + 105)
    )
    assert why == adm.RATE
    assert db.transaction(partial(sa.next_wake, plan=plan, limits=limits, now=T0 + 105)) == T0 + 110
    got = db.transaction(partial(sa.admit, plan=plan, limits=limits, now=T0 + 110, owner="e1"))
    assert [a.flow_id for a in got] == ["f3"]


def test_what_a_queued_flow_waits_for_and_the_next_wake(db: Db) -> None:
    """`waits_for` names the limit (or the time) from the rows; `next_wake` is the first delayed
    start or, the window full, when its oldest admission leaves it."""
    limits = Limits(concurrency=2, key=_key, per_key=1, rate=Rate(2, per=10.0))
    plan = "p"
    db.transaction(lambda tx: sa.register(tx, plan, limits))

    def start(fid: str, key: str, not_before: float | None = None) -> None:
        def run(tx: Tx) -> list[sa.Admitted]:
            insert_queued(tx, plan, fid)
            return sa.enqueue(tx, plan, limits, fid, StartOptions(0, not_before, key), T0, "e1")

        db.transaction(run)

    def why(fid: str, now: float = T0) -> str | None:
        said: str | None = db.transaction(
            partial(sa.waits_for, plan=plan, limits=limits, flow_id=fid, now=now)
        )
        return said

    def wake(now: float = T0) -> float | None:
        when: float | None = db.transaction(
            partial(sa.next_wake, plan=plan, limits=limits, now=now)
        )
        return when

    assert wake() is None
    start("a1", "a")
    start("later", "z", T0 + 30)
    assert why("later") == adm.TIME and wake() == T0 + 30
    start("a2", "a")
    assert why("a2") == adm.PER_KEY and why("a1") is None
    start("b1", "b")
    start("c1", "c")
    assert why("c1") == adm.CONCURRENCY
    db.transaction(partial(finish, plan=plan, limits=limits, fid="a1", now=T0))
    # the window holds a1's and b1's admissions: c1 waits for the rate, a2 for its key no more
    assert why("c1") == adm.RATE and why("a2") == adm.RATE
    assert wake() == T0 + 10
    got = db.transaction(lambda tx: sa.came_due(tx, plan, limits, T0 + 10, "e1"))
    assert [a.flow_id for a in got] == ["a2"]
    assert why("later", T0 + 10) == adm.TIME


# ----------------------------------------------------------------- O(log n): plans and counts


def _bulk_queue(tx: Tx, plan: str, limits: Limits, n: int, keys: int) -> None:
    """`n` due flows queued over `keys` keys, as `enqueue` would have left them (each key's
    flows at successive turns, its head its first), written in three statements."""
    numbers = (
        "SELECT generate_series(0, ?) AS i"  # PostgreSQL's is several times faster
        if isinstance(tx, PgTx)
        else "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
        " SELECT i FROM n"
    )
    tx.execute(
        f"INSERT INTO {FLOWS} (flow_id, plan, version, state, step_index, attempt, data,"
        " revision, updated_at, timed_out, stack, start_data, created_at, queue_key, priority,"
        " turn, seq, not_before, due) SELECT ? || '-' || i, ?, 1, 'QUEUED', 0, 0, '{}', 0,"
        f" ?, 0, '', '{{}}', ?, 'k' || (i % ?), 0, i / ?, i + 1, NULL, 1 FROM ({numbers}) AS n",
        (plan, plan, T0, T0, keys, keys, n - 1),
    )
    tx.execute(f"UPDATE {sa.BUDGETS} SET seq = ? WHERE plan = ?", (n, plan))
    tx.execute(
        f"INSERT INTO {sa.KEYS} (plan, queue_key, active, queued, head_priority, head_turn,"
        " head_seq, open) SELECT plan, queue_key, 0, COUNT(*), 0, MIN(turn), MIN(seq), 1"
        f" FROM {FLOWS} WHERE plan = ? GROUP BY plan, queue_key",
        (plan,),
    )


def test_a_start_goes_straight_in_only_when_nothing_stands_before_it(db: Db) -> None:
    """A due start of an empty key is admitted as it is queued (docs/adr/0182) unless another
    key holds an open head (one passed over while another transaction held its row): then
    the rule's order holds, that head first. (Made to fail by dropping the probe of the open
    keys from `_straight_in`: the start alone is admitted and the older head waits.)"""
    limits = Limits(concurrency=5, key=_key, per_key=1)
    db.transaction(partial(sa.register, plan="p", limits=limits))
    db.transaction(partial(_bulk_queue, plan="p", limits=limits, n=1, keys=1))  # k0: open head
    got = db.transaction(
        partial(
            start_one, plan="p", limits=limits, fid="new", o=StartOptions(0, None, "k9"), now=T0
        )
    )
    assert [a.flow_id for a in got] == ["p-0", "new"]
    got = db.transaction(
        partial(
            start_one, plan="p", limits=limits, fid="alone", o=StartOptions(0, None, "k8"), now=T0
        )
    )
    assert [(a.flow_id, a.state) for a in got] == [("alone", "RUNNING")]
    assert states(db.tx, "p") == {"p-0": "RUNNING", "new": "RUNNING", "alone": "RUNNING"}
    history = db.transaction(
        lambda tx: tx.execute(f"SELECT flow_id, revision, kind FROM {HISTORY} ORDER BY flow_id", ())
    )
    assert [tuple(r) for r in history] == [
        ("alone", 1, "admitted"),
        ("new", 1, "admitted"),
        ("p-0", 1, "admitted"),
    ]
    used, queued = db.transaction(partial(sa.usage, plan="p"))
    assert (used.active, queued) == (3, 0)


def _analyze(tx: Tx) -> None:
    """The planner's statistics of these tables (the server is shared by the suite's tests)."""
    tx.execute(f"ANALYZE {FLOWS}, {sa.KEYS}, {sa.ADMISSIONS}")


def _measured(tx: Tx, plan: str, limits: Limits) -> dict[str, list[tuple[str, tuple[Any, ...]]]]:
    """The statements of an admission of 5, an end that admits one, and a start that queues."""
    seen = {}
    got = sa.admit(tx, plan, limits, T0, "e1")
    assert [a.flow_id for a in got] == [f"{plan}-{i}" for i in range(5)]
    seen["admit"] = list(tx.statements)
    end(tx, f"{plan}-0")
    tx.statements.clear()
    got = sa.release(tx, plan, limits, f"{plan}-0", T0, "e1")
    assert [a.flow_id for a in got] == [f"{plan}-5"]
    seen["release"] = list(tx.statements)
    insert_queued(tx, plan, f"{plan}-new")
    tx.statements.clear()
    assert sa.enqueue(tx, plan, limits, f"{plan}-new", StartOptions(0, None, "k0"), T0, "e1") == []
    seen["enqueue"] = list(tx.statements)
    return seen


def test_an_admission_is_index_probes_whatever_the_queue(db: Db) -> None:
    """A plan with 1,000 flows queued over 10 keys and one with 100,000 over 1,000: admitting 5,
    an end that admits one and a start that queues run the same statements for both, and the
    plan of each (EXPLAIN, 100,000 queued) reads no table whole and sorts nothing: each is an
    index probe or a one-row write. (Made to fail by dropping the key queue's index: the next
    head is then found by the key's turns and sorted.)"""
    limits = Limits(concurrency=5, key=_key, per_key=1)
    for plan, n in (("small", 1_000), ("large", 100_000)):
        db.transaction(partial(sa.register, plan=plan, limits=limits))
        db.transaction(partial(_bulk_queue, plan=plan, limits=limits, n=n, keys=n // 100))
    if isinstance(db.tx, PgTx):
        db.transaction(_analyze)
    small = db.transaction(partial(_measured, plan="small", limits=limits))
    large = db.transaction(partial(_measured, plan="large", limits=limits))
    assert {k: [sql for sql, _p in v] for k, v in small.items()} == {
        k: [sql for sql, _p in v] for k, v in large.items()
    }
    # the budget's lock and write, and 6 per admitted flow (the open key, its head, the flow's
    # write and history row, the key's next head and its row); an end adds its claim, the
    # budget's lock, its key's counts and row (2), and no budget write (it admitted one: its
    # counters are as they were); a start the lock, its key's last turn, its key's counts, its
    # queue columns, its key's row (2), the budget's write
    assert [len(large[k]) for k in ("admit", "release", "enqueue")] == [1 + 6 * 5 + 1, 11, 7]

    def plans(tx: Tx) -> list[str]:
        d = _dialect.of(tx)
        found = []
        for sql, params in [s for part in large.values() for s in part]:
            if not sql.lstrip().startswith("SELECT"):
                continue
            rows = tx.execute(d.explain + sql, params)
            text = "\n".join(str(r[-1]) for r in rows)
            for table in (FLOWS, sa.KEYS, sa.ADMISSIONS):
                assert d.full_scan.format(table) not in text, (sql, text)
            assert d.sorts not in text, (sql, text)
            found.append(text)
        return found

    texts = db.transaction(plans)
    for index in ("flow_flows_queue", "flow_flows_queue_turns", "flow_keys_open"):
        assert any(re.search(rf"\b{index}\b", t) for t in texts), index


# ------------------------------------------------------------- PostgreSQL: engines at once


@pytest.fixture
def pg_db(request: pytest.FixtureRequest) -> Iterator[tuple[Db, Callable[[], Any]]]:
    """A fresh PostgreSQL schema with the flow tables: a `Db` for the test's own transactions
    and how a thread connects on its own."""
    import psycopg

    server: pg.PgServer = request.getfixturevalue("pg_server")
    dsn = server.fresh_schema_dsn("adm")

    def connect() -> Any:
        return psycopg.connect(dsn, autocommit=False)

    db = Db(lambda: PgTx(connect()))
    db.transaction(_schema.create_schema)
    yield db, connect
    db.close()


def _running(tx: Tx, plan: str, limits: Limits) -> int:
    """The plan's active flows counted from their rows (not the counters), checked against the
    limits: at most `concurrency`, at most `per_key` of a key."""
    rows = tx.execute(
        f"SELECT queue_key, COUNT(*) FROM {FLOWS} WHERE plan = ? AND state = 'RUNNING'"
        " GROUP BY queue_key",
        (plan,),
    )
    total = sum(int(n) for _k, n in rows)
    assert limits.concurrency is None or total <= limits.concurrency, rows
    assert limits.per_key is None or all(int(n) <= limits.per_key for _k, n in rows), rows
    return total


def _on_threads(n: int, work: Callable[[int], None], errors: list[BaseException]) -> None:
    """`work(i)` on `n` threads at once; what one raises is kept in `errors`."""

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck (a lock never let go)"


def _timer(
    connect: Callable[[], Any], plan: str, limits: Limits, barrier: threading.Barrier, me: int
) -> None:
    with connect() as conn:
        tx = PgTx(conn)
        barrier.wait()
        sa.came_due(tx, plan, limits, T0 + 5, f"e{me}")
        conn.commit()
        _running(tx, plan, limits)
        conn.commit()


def _ender(connect: Callable[[], Any], plan: str, limits: Limits, base: int, me: int) -> None:
    """End the plan's active flows at random, one a transaction, until every flow has ended."""
    seed = base + me
    rng = random.Random(seed)
    with connect() as conn:
        tx = PgTx(conn)
        while True:
            rows = tx.execute(
                f"SELECT flow_id FROM {FLOWS} WHERE plan = ? AND state = 'RUNNING'", (plan,)
            )
            left = tx.execute(
                f"SELECT COUNT(*) FROM {FLOWS} WHERE plan = ? AND state <> 'COMPLETED'", (plan,)
            )
            conn.commit()
            if not int(left[0][0]):
                return
            if not rows:
                continue
            fid = rng.choice(rows)[0]
            got = tx.execute(
                f"SELECT flow_id FROM {FLOWS} WHERE flow_id = ? AND state = 'RUNNING'"
                " FOR UPDATE SKIP LOCKED",
                (fid,),
            )
            if not got:
                conn.rollback()
                continue
            end(tx, fid)
            sa.release(tx, plan, limits, fid, T0 + 5, f"e{seed}")
            conn.commit()
            _running(tx, plan, limits)
            conn.commit()


def test_engines_admitting_at_once_never_exceed_the_limits(
    pg_db: tuple[Db, Callable[[], Any]],
) -> None:
    """PostgreSQL, 4 threads each with its own connection, 8 rounds: each round a plan of 24
    delayed flows over 6 keys (`concurrency=3`, `per_key=1`) comes due and every thread's timer
    admits at once; then the threads end the active flows at random, each end admitting the
    next. After every commit the flows' own rows (not the counters) hold at most 3 active and 1
    per key; when the timers are done exactly 3 are active; at the end every flow has ended and
    the counters are 0. No error (a deadlock would be SQLSTATE 40P01). (Made to fail by reading
    the budget row without FOR UPDATE: lost updates leave the counters apart from the flows.)"""
    db, connect = pg_db
    limits = Limits(concurrency=3, key=_key, per_key=1)
    errors: list[BaseException] = []
    for round_ in range(8):
        plan = f"p{round_:02}"

        def setup(tx: Tx, plan: str = plan) -> None:
            sa.register(tx, plan, limits)
            for i in range(24):
                fid = f"{plan}-{i:02}"
                insert_queued(tx, plan, fid)
                sa.enqueue(tx, plan, limits, fid, StartOptions(0, T0 + 5, f"k{i % 6}"), T0, "")

        db.transaction(setup)
        barrier = threading.Barrier(4)
        _on_threads(4, partial(_timer, connect, plan, limits, barrier), errors)
        assert not errors, errors
        assert db.transaction(partial(_running, plan=plan, limits=limits)) == 3
        _on_threads(4, partial(_ender, connect, plan, limits, 100 * round_), errors)
        assert not errors, errors
        usage, queued = db.transaction(partial(sa.usage, plan=plan))
        st = db.transaction(partial(states, plan=plan))
        assert usage.active == 0 and usage.keys == () and queued == 0
        assert set(st.values()) == {"COMPLETED"}


PLANS = {"a": Limits(concurrency=4, key=_key, per_key=1), "b": Limits(concurrency=2)}


@attrs.define
class Ids:
    made: Iterator[int] = attrs.Factory(lambda: iter(range(10**9)))
    lock: threading.Lock = attrs.Factory(threading.Lock)

    def new(self, plan: str) -> str:
        with self.lock:
            return f"{plan}-{next(self.made):06}"


def _start(tx: Tx, ids: Ids, chosen: Sequence[str], rng: random.Random) -> None:
    """New flows of the `chosen` plans: their rows first, then each plan's enqueue in plan
    order (ADR 0141's lock order)."""
    made = [(plan, ids.new(plan)) for plan in chosen]
    for plan, fid in made:
        insert_queued(tx, plan, fid)
    for plan, fid in sorted(made):
        key = f"k{rng.randrange(3)}" if PLANS[plan].key else None
        sa.enqueue(tx, plan, PLANS[plan], fid, StartOptions(0, None, key), T0, "e")


def _mixer(connect: Callable[[], Any], ids: Ids, me: int) -> None:
    rng = random.Random(me)
    with connect() as conn:
        tx = PgTx(conn)
        for _ in range(100):
            running = tx.execute(f"SELECT flow_id, plan FROM {FLOWS} WHERE state = 'RUNNING'")
            conn.commit()
            chosen = rng.sample(running, min(len(running), rng.randint(1, 3)))
            locked = tx.execute(
                f"SELECT flow_id, plan FROM {FLOWS} WHERE flow_id = ANY(?)"
                " AND state = 'RUNNING' ORDER BY flow_id FOR UPDATE",
                ([f for f, _p in chosen],),
            )
            for fid, _plan in locked:
                end(tx, fid)
            for fid, plan in sorted(locked, key=lambda r: (r[1], r[0])):
                sa.release(tx, plan, PLANS[plan], fid, T0, f"e{me}")
            conn.commit()
            for plan, limits in PLANS.items():
                _running(tx, plan, limits)
            conn.commit()
            _start(tx, ids, [rng.choice("ab") for _ in locked], rng)
            conn.commit()


def test_two_plans_taken_and_released_in_random_orders_never_deadlock(
    pg_db: tuple[Db, Callable[[], Any]],
) -> None:
    """PostgreSQL, 4 threads each with its own connection, 100 transactions each: each ends 1
    to 3 active flows of two plans chosen at random (their rows locked in flow id order, then
    each plan's release in plan order, ADR 0141's one lock order), each release admitting, and
    then starts as many at random. No error at all (a deadlock is SQLSTATE 40P01), the limits
    hold at every commit, and the counters equal the flows' states at the end. (Made to fail
    by releasing in a random plan order: 40P01 within the run.)"""
    db, connect = pg_db
    ids = Ids()
    rng = random.Random(0)

    def setup(tx: Tx) -> None:
        for plan, limits in PLANS.items():
            sa.register(tx, plan, limits)
            _start(tx, ids, [plan] * 12, rng)

    db.transaction(setup)
    errors: list[BaseException] = []
    _on_threads(4, partial(_mixer, connect, ids), errors)
    deadlocks = [e for e in errors if getattr(e, "sqlstate", None) == "40P01"]
    assert not deadlocks, deadlocks
    assert not errors, errors
    for plan in PLANS:
        usage, queued = db.transaction(partial(sa.usage, plan=plan))
        counted = db.transaction(partial(sa.recount, plan=plan))
        assert usage.active == sum(counted["active"].values())
        assert queued == sum(counted["queued"].values())


def test_a_locked_queued_head_passes_its_key_over_and_never_waits(
    pg_db: tuple[Db, Callable[[], Any]],
) -> None:
    """PostgreSQL: another connection holds the row of key a's queued head (a wake queuing a
    message for it); an end then admits key b's head at once, not a's second flow (a key's own
    order holds) and without waiting for the lock; after that connection commits, the next end
    admits a's head. (Made to fail by taking the head FOR UPDATE without SKIP LOCKED: the end
    waits, and its lock timeout fails it.)"""
    db, connect = pg_db
    limits = Limits(concurrency=1, key=_key)
    plan = "p"
    db.transaction(partial(sa.register, plan=plan, limits=limits))
    for fid, key in (("x", "x"), ("a1", "a"), ("a2", "a"), ("b1", "b")):
        o = StartOptions(0, None, key)
        db.transaction(partial(start_one, plan=plan, limits=limits, fid=fid, o=o, now=T0))
    assert db.transaction(partial(states, plan=plan))["x"] == "RUNNING"
    with connect() as wake:
        wake.execute(f"SELECT 1 FROM {FLOWS} WHERE flow_id = 'a1' FOR UPDATE")
        with connect() as conn:
            conn.execute("SET lock_timeout = '5s'")
            tx = PgTx(conn)
            got = finish(tx, plan=plan, limits=limits, fid="x", now=T0)
            conn.commit()
            assert [a.flow_id for a in got] == ["b1"]
        wake.commit()
    got = db.transaction(partial(finish, plan=plan, limits=limits, fid="b1", now=T0))
    assert [a.flow_id for a in got] == ["a1"]
