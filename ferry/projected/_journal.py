"""The journal: schema, the journal transaction, the projection step, and the audit.

Everything here is synchronous and runs inside one store transaction on a worker thread (or, for
`audit`, on plain values): no trio, no clock. The SQL is the common dialect of SQLite >= 3.35 and
PostgreSQL (``ON CONFLICT``, ``RETURNING``, partial indexes, ``?`` placeholders).

Tables, for a namespace ``ns`` (docs/adr/0010):

- ``ns_keys(key, version, last_seq, projected_seq, state)``: one row per key. `version` is the
  fence, bumped by every journal transaction that writes; `state` is the decision state after
  record `last_seq`; `projected_seq` is how far the view has been brought.
- ``ns_journal(kind, rid, key, seq, content, answer)``: primary key ``(kind, rid)`` makes inputs
  idempotent by id (and postings by posting id); ``(key, seq)`` is unique while fencing is on.
- ``ns_inbox(posting_id, dest_key, source_key, payload, ingested)``: cross-key postings, written
  by the source key's transaction, ingested by the destination key's.

The journal transaction first takes the key's row (``UPDATE ... SET version = version``, which
locks it in PostgreSQL; SQLite's BEGIN IMMEDIATE already serializes writers) and, with a cached
view of the key, compares versions: a mismatch is a `FenceConflict`. Every later statement of the
transaction runs under that lock.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Sequence

import attrs

from .._errors import IdReused
from .._text import canonical_json
from ._errors import FenceConflict
from ._types import Decision, Json, Record, Tx

Decide = Callable[[Json, Json], Decision]
"""``decide(state, content) -> Decision`` for inputs; ``receive(state, payload)`` for postings."""

Project = Callable[[Tx, str, Sequence[Record]], "Sequence[BaseException | None] | None"]
"""``project(view, key, records)``: apply records to the view; per-record outcome or None."""

_NAMESPACE = re.compile(r"[a-z_][a-z0-9_]{0,40}")
_INSERT_CHUNK = 100


def check_namespace(ns: str) -> str:
    if not isinstance(ns, str) or not _NAMESPACE.fullmatch(ns):
        raise ValueError(f"namespace must match {_NAMESPACE.pattern}, got {ns!r}")
    return ns


def ddl(ns: str, *, fencing: bool) -> list[str]:
    """The schema's statements, each idempotent. Without fencing (tests only) ``(key, seq)`` is
    not unique, so that the fence alone is what keeps sequence numbers right."""
    unique = "UNIQUE INDEX" if fencing else "INDEX"
    index = f"{ns}_journal_key_seq" if fencing else f"{ns}_journal_key_seq_unfenced"
    return [
        f"""CREATE TABLE IF NOT EXISTS {ns}_keys (
            key TEXT PRIMARY KEY,
            version BIGINT NOT NULL,
            last_seq BIGINT NOT NULL,
            projected_seq BIGINT NOT NULL,
            state TEXT NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_keys_behind ON {ns}_keys (key)"
        " WHERE projected_seq < last_seq",
        f"""CREATE TABLE IF NOT EXISTS {ns}_journal (
            kind TEXT NOT NULL,
            rid TEXT NOT NULL,
            key TEXT NOT NULL,
            seq BIGINT NOT NULL,
            content TEXT NOT NULL,
            answer TEXT NOT NULL,
            PRIMARY KEY (kind, rid))""",
        f"CREATE {unique} IF NOT EXISTS {index} ON {ns}_journal (key, seq)",
        f"""CREATE TABLE IF NOT EXISTS {ns}_inbox (
            posting_id TEXT PRIMARY KEY,
            dest_key TEXT NOT NULL,
            source_key TEXT NOT NULL,
            payload TEXT NOT NULL,
            ingested INTEGER NOT NULL)""",
        f"CREATE INDEX IF NOT EXISTS {ns}_inbox_pending ON {ns}_inbox (dest_key, posting_id)"
        " WHERE ingested = 0",
    ]


def create_schema(
    tx: Tx, ns: str, *, fencing: bool, setup: Callable[[Tx], None] | None = None
) -> None:
    if tx.dialect == "postgres":  # concurrent CREATE ... IF NOT EXISTS can race in PostgreSQL
        tx.execute("SELECT pg_advisory_xact_lock(?)", (zlib.crc32(ns.encode()),))
    for statement in ddl(ns, fencing=fencing):
        tx.execute(statement)
    if setup is not None:
        setup(tx)


@attrs.frozen
class KeyCache:
    """What this process last saw of a key: its fence version, last seq and decision state."""

    version: int
    last_seq: int
    state: Json


@attrs.frozen
class Stored:
    """An input's slot once it is in the journal (new or replayed)."""

    seq: int
    answer: Json


@attrs.frozen
class AppendOutcome:
    slots: tuple[Stored | IdReused, ...]
    cache: KeyCache
    written: int
    replayed: int
    ingested: int


def append(
    tx: Tx,
    *,
    ns: str,
    key: str,
    cache: KeyCache | None,
    items: Sequence[tuple[str, str]],
    decide: Decide,
    receive: Decide | None,
    initial_text: str,
    fencing: bool,
) -> AppendOutcome:
    """The journal transaction of one batch: fence, ingest postings, decide, write.

    `items` are ``(input id, canonical content)`` in batch order. Raises `FenceConflict` (the
    caller must roll back and forget its cache) or whatever `decide`/`receive` raise.
    """
    keys, journal, inbox = f"{ns}_keys", f"{ns}_journal", f"{ns}_inbox"
    state: Json
    if cache is not None:
        if fencing:
            rows = tx.execute(
                f"UPDATE {keys} SET version = version WHERE key = ? AND version = ? RETURNING key",
                (key, cache.version),
            )
            if not rows:
                raise FenceConflict(
                    f"fence conflict on key {key!r}: another process wrote it since this one last"
                    f" looked (version {cache.version} is stale); nothing was written and this"
                    " process has forgotten the key, so a retry is safe"
                )
        version, last_seq, state = cache.version, cache.last_seq, cache.state
    else:
        rows = tx.execute(
            f"UPDATE {keys} SET version = version WHERE key = ? RETURNING version, last_seq, state",
            (key,),
        )
        if rows:
            version, last_seq, state = rows[0][0], rows[0][1], json.loads(rows[0][2])
        else:
            rows = tx.execute(
                f"INSERT INTO {keys} (key, version, last_seq, projected_seq, state)"
                " VALUES (?, 0, 0, 0, ?) ON CONFLICT (key) DO NOTHING RETURNING version",
                (key, initial_text),
            )
            if not rows:
                raise FenceConflict(
                    f"fence conflict on key {key!r}: another process created it concurrently;"
                    " nothing was written, a retry is safe"
                )
            version, last_seq, state = 0, 0, json.loads(initial_text)

    seq = last_seq
    new_records: list[tuple[str, str, str, int, str, str]] = []
    postings: list[tuple[str, str, str, str]] = []

    def apply(fn: Decide, kind: str, rid: str, content_text: str) -> Stored:
        nonlocal seq, state
        decision = fn(state, json.loads(content_text))
        if not isinstance(decision, Decision):
            raise TypeError(f"decide/receive must return a Decision, got {decision!r}")
        answer_text = canonical_json(decision.answer)
        for i, posting in enumerate(decision.postings):
            if receive is None:
                raise TypeError("a Decision has postings, but ProjectedWrite got no `receive`")
            postings.append(
                (f"{rid}/{i}", str(posting.dest_key), key, canonical_json(posting.payload))
            )
        seq += 1
        state = decision.state
        new_records.append((kind, rid, key, seq, content_text, answer_text))
        return Stored(seq, json.loads(answer_text))

    ingested = 0
    if receive is not None:
        pending = tx.execute(
            f"SELECT posting_id, payload FROM {inbox} WHERE dest_key = ? AND ingested = 0"
            " ORDER BY posting_id",
            (key,),
        )
        for posting_id, payload_text in pending:
            apply(receive, "posting", posting_id, payload_text)
            tx.execute(f"UPDATE {inbox} SET ingested = 1 WHERE posting_id = ?", (posting_id,))
            ingested += 1

    existing: dict[str, tuple[str, int, str, str]] = {}
    ids = list(dict.fromkeys(rid for rid, _ in items))
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        marks = ",".join("?" * len(chunk))
        for rid, rkey, rseq, rcontent, ranswer in tx.execute(
            f"SELECT rid, key, seq, content, answer FROM {journal}"
            f" WHERE kind = 'input' AND rid IN ({marks})",
            chunk,
        ):
            existing[rid] = (rkey, rseq, rcontent, ranswer)

    slots: list[Stored | IdReused] = []
    replayed = 0
    for rid, content_text in items:
        prior = existing.get(rid)
        if prior is None:
            stored = apply(decide, "input", rid, content_text)
            existing[rid] = (key, stored.seq, content_text, "")
            slots.append(stored)
            continue
        prior_key, prior_seq, prior_content, prior_answer = prior
        if prior_key != key or prior_content != content_text:
            slots.append(
                IdReused(
                    f"input id {rid!r} was already used"
                    + (f" for key {prior_key!r}" if prior_key != key else "")
                    + " with different content; nothing was written for this input"
                )
            )
            continue
        replayed += 1
        if prior_answer:
            slots.append(Stored(prior_seq, json.loads(prior_answer)))
        else:  # a duplicate inside this batch: the same slot as its first occurrence
            first = next(s for s in slots if isinstance(s, Stored) and s.seq == prior_seq)
            slots.append(first)

    if not new_records:
        return AppendOutcome(tuple(slots), KeyCache(version, last_seq, state), 0, replayed, 0)

    for start in range(0, len(new_records), _INSERT_CHUNK):
        chunk_rows = new_records[start : start + _INSERT_CHUNK]
        values = ",".join(["(?, ?, ?, ?, ?, ?)"] * len(chunk_rows))
        inserted = tx.execute(
            f"INSERT INTO {journal} (kind, rid, key, seq, content, answer) VALUES {values}"
            " ON CONFLICT DO NOTHING RETURNING rid",
            [field for row in chunk_rows for field in row],
        )
        if len(inserted) != len(chunk_rows):
            lost = sorted({row[1] for row in chunk_rows} - {r[0] for r in inserted})
            raise FenceConflict(
                f"fence conflict on key {key!r}: records {lost!r} were written concurrently by"
                " another transaction; nothing was written, a retry is safe"
            )
    if postings:
        tx.executemany(
            f"INSERT INTO {inbox} (posting_id, dest_key, source_key, payload, ingested)"
            " VALUES (?, ?, ?, ?, 0) ON CONFLICT DO NOTHING",
            postings,
        )
    state_text = canonical_json(state)
    rows = tx.execute(
        f"UPDATE {keys} SET version = version + 1, last_seq = ?, state = ? WHERE key = ?"
        " RETURNING version",
        (seq, state_text, key),
    )
    new_cache = KeyCache(rows[0][0], seq, json.loads(state_text))
    written = sum(1 for r in new_records if r[0] == "input")
    return AppendOutcome(tuple(slots), new_cache, written, replayed, ingested)


@attrs.frozen
class ProjectionStep:
    """What one projection transaction did for one key."""

    projected_seq: int
    last_seq: int
    projected: int
    failed_seq: int | None = None
    failure: BaseException | None = attrs.field(default=None, eq=False)


def _first_failure(outcomes: object, n: int) -> int | None:
    if outcomes is None:
        return None
    if not isinstance(outcomes, Sequence) or len(outcomes) != n:
        raise TypeError(
            f"project must return None or one outcome per record ({n}), got {outcomes!r}"
        )
    for i, o in enumerate(outcomes):
        if o is None:
            continue
        if isinstance(o, BaseException):
            return i
        raise TypeError(f"a projection outcome must be None or an exception, got {o!r}")
    return None


def project_step(tx: Tx, *, ns: str, key: str, project: Project, limit: int) -> ProjectionStep:
    """Project up to `limit` unprojected records of `key`, in journal order, in this transaction.

    Takes the key's row first, so concurrent projections of one key serialize and none applies a
    record twice. If `project` reports a failed record, everything it did is rolled back to a
    savepoint and it is called again on the records before the failure; the projected offset
    advances over that successful prefix only. If `project` raises, the exception propagates
    (the store rolls the transaction back).
    """
    keys, journal = f"{ns}_keys", f"{ns}_journal"
    rows = tx.execute(
        f"UPDATE {keys} SET projected_seq = projected_seq WHERE key = ?"
        " RETURNING projected_seq, last_seq",
        (key,),
    )
    if not rows:
        return ProjectionStep(0, 0, 0)
    projected_seq, last_seq = rows[0]
    if projected_seq >= last_seq:
        return ProjectionStep(projected_seq, last_seq, 0)
    records = [
        Record(key, s, kind, rid, json.loads(content), json.loads(answer))
        for s, kind, rid, content, answer in tx.execute(
            f"SELECT seq, kind, rid, content, answer FROM {journal}"
            " WHERE key = ? AND seq > ? ORDER BY seq LIMIT ?",
            (key, projected_seq, limit),
        )
    ]
    failed_seq: int | None = None
    failure: BaseException | None = None
    while records:
        tx.execute("SAVEPOINT ferry_projection")
        outcomes = project(tx, key, records)
        i = _first_failure(outcomes, len(records))
        if i is None:
            tx.execute("RELEASE SAVEPOINT ferry_projection")
            break
        tx.execute("ROLLBACK TO SAVEPOINT ferry_projection")
        tx.execute("RELEASE SAVEPOINT ferry_projection")
        assert outcomes is not None
        failed_seq, failure = records[i].seq, outcomes[i]
        records = records[:i]
    if records:
        projected_seq = records[-1].seq
        tx.execute(f"UPDATE {keys} SET projected_seq = ? WHERE key = ?", (projected_seq, key))
    return ProjectionStep(projected_seq, last_seq, len(records), failed_seq, failure)


def behind_keys(tx: Tx, ns: str, limit: int) -> tuple[list[str], list[str]]:
    """Keys with unprojected records, and keys with postings waiting in the inbox."""
    behind = tx.execute(
        f"SELECT key FROM {ns}_keys WHERE projected_seq < last_seq ORDER BY key LIMIT ?",
        (limit,),
    )
    pending = tx.execute(
        f"SELECT DISTINCT dest_key FROM {ns}_inbox WHERE ingested = 0 ORDER BY dest_key LIMIT ?",
        (limit,),
    )
    return [r[0] for r in behind], [r[0] for r in pending]


@attrs.frozen
class KeyRow:
    """A key's row as stored."""

    version: int
    last_seq: int
    projected_seq: int
    state: Json


@attrs.frozen
class InboxRow:
    """A posting as stored in the inbox."""

    posting_id: str
    dest_key: str
    source_key: str
    payload: Json
    ingested: bool


@attrs.frozen
class JournalSnapshot:
    """Everything the store holds for one namespace, read in one transaction (for audits)."""

    keys: dict[str, KeyRow]
    records: dict[str, list[Record]]  # by key, in (seq, kind, id) order
    inbox: dict[str, InboxRow]


def read_snapshot(tx: Tx, ns: str) -> JournalSnapshot:
    keys = {
        k: KeyRow(v, ls, ps, json.loads(st))
        for k, v, ls, ps, st in tx.execute(
            f"SELECT key, version, last_seq, projected_seq, state FROM {ns}_keys"
        )
    }
    records: dict[str, list[Record]] = {}
    for k, s, kind, rid, content, answer in tx.execute(
        f"SELECT key, seq, kind, rid, content, answer FROM {ns}_journal"
        " ORDER BY key, seq, kind, rid"
    ):
        records.setdefault(k, []).append(
            Record(k, s, kind, rid, json.loads(content), json.loads(answer))
        )
    inbox = {
        p: InboxRow(p, d, s, json.loads(payload), bool(ing))
        for p, d, s, payload, ing in tx.execute(
            f"SELECT posting_id, dest_key, source_key, payload, ingested FROM {ns}_inbox"
        )
    }
    return JournalSnapshot(keys, records, inbox)


def audit(
    snap: JournalSnapshot, *, decide: Decide, receive: Decide | None, initial: Json
) -> list[str]:
    """Problems found in a snapshot; empty when the journal is exact.

    Checks: each key's seqs are exactly 1..n; the key row's last_seq is n and its projected_seq
    is within 0..n; replaying decide/receive over the journal from `initial` reproduces every
    stored answer, the stored state and exactly the inbox postings; every posting is ingested
    exactly once, as a record of its destination key, iff its inbox row says so. Cost: O(journal).
    """
    problems: list[str] = []
    emitted: dict[str, tuple[str, str, str]] = {}  # posting id -> (dest, source, payload text)
    ingested_as: dict[str, list[str]] = {}
    for key in sorted(set(snap.keys) | set(snap.records)):
        recs = snap.records.get(key, [])
        seqs = [r.seq for r in recs]
        if seqs != list(range(1, len(recs) + 1)):
            dups = sorted({s for s in seqs if seqs.count(s) > 1})
            gaps = sorted(set(range(1, max(seqs, default=0) + 1)) - set(seqs))
            problems.append(
                f"key {key!r}: seqs not 1..{len(recs)} (duplicates {dups}, gaps {gaps})"
            )
        row = snap.keys.get(key)
        if row is None:
            problems.append(f"key {key!r}: journal records but no key row")
        else:
            if row.last_seq != len(recs):
                problems.append(f"key {key!r}: last_seq {row.last_seq} but {len(recs)} records")
            if not 0 <= row.projected_seq <= row.last_seq:
                problems.append(
                    f"key {key!r}: projected_seq {row.projected_seq} outside 0..{row.last_seq}"
                )
        state = json.loads(canonical_json(initial))
        for r in recs:
            fn = decide if r.kind == "input" else receive
            if fn is None:
                problems.append(f"key {key!r} seq {r.seq}: posting record but no receive hook")
                continue
            try:
                d = fn(state, r.content)
            except Exception as exc:  # a replay that raises is itself a finding
                problems.append(f"key {key!r} seq {r.seq}: replay raised {exc!r}")
                continue
            if canonical_json(d.answer) != canonical_json(r.answer):
                problems.append(
                    f"key {key!r} seq {r.seq} ({r.kind} {r.id!r}): stored answer {r.answer!r},"
                    f" replay decides {d.answer!r}"
                )
            for i, posting in enumerate(d.postings):
                emitted[f"{r.id}/{i}"] = (posting.dest_key, key, canonical_json(posting.payload))
            if r.kind == "posting":
                ingested_as.setdefault(r.id, []).append(key)
            state = d.state
        if row is not None and canonical_json(state) != canonical_json(row.state):
            problems.append(f"key {key!r}: stored state {row.state!r}, replay gives {state!r}")
    for pid, p in snap.inbox.items():
        want = emitted.pop(pid, None)
        got = (p.dest_key, p.source_key, canonical_json(p.payload))
        if want is None:
            problems.append(f"posting {pid!r}: in the inbox, but no record emits it")
        elif want != got:
            problems.append(f"posting {pid!r}: inbox holds {got!r}, replay emits {want!r}")
        where = ingested_as.pop(pid, [])
        if p.ingested and where != [p.dest_key]:
            problems.append(f"posting {pid!r}: ingested, but recorded under keys {where!r}")
        if not p.ingested and where:
            problems.append(f"posting {pid!r}: not marked ingested, but recorded under {where!r}")
    for pid in sorted(emitted):
        problems.append(f"posting {pid!r}: emitted by a record but missing from the inbox")
    for pid, where in sorted(ingested_as.items()):
        problems.append(f"posting {pid!r}: recorded under {where!r} but not in the inbox")
    return problems
