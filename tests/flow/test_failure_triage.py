"""Failure triage on a real store, SQLite and PostgreSQL: the error column of ``list`` and of the
dashboard's flows list, the error filter (``--error``, the dashboard's "error holds" field, a
bulk action's filter), and ``stats`` grouping failed and blocked flows by a normalised error
(the dashboard's overview shows the same groups, linked to the filtered list).

The store holds 2,000 blocked flows whose reasons each hold another account number (one
group of 2,000, not 20 rows of one flow), failed flows whose errors hold LIKE's metacharacters
(``%``, ``_``, ``\\``) and decoys that would match if they were wildcards, a reason that held a
lone surrogate (stored escaped, as the engine stores every error), and markup. Each test failed
before the triage was built: ``list`` had no ERROR column and no ``--error``, ``stats`` had no
``errors`` (its ``blocked`` stopped at 20 exact reasons), the dashboard no error column, field
or groups.
"""

from __future__ import annotations

import re
import sqlite3
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ferry.flow._model import _checks
from ferry.flow._model import _machine as m
from ferry.flow._model._types import CONTINUE, fail
from ferry.flow._model._values import Flow, Mailbox, Transition
from ferry.flow._ops._dashboard._app import Dashboard, loopback_hosts
from ferry.flow._ops._dashboard._reads import Reader
from ferry.flow._store import _batch, _op, _query, _schema, _store
from ferry.projected import PostgresStore
from tests import pg

from ._helpers import _InlineTx
from .test_inspect import ORDER, T0, run, run_json

BLOCKED = 2000
REASON = "compensation of step 'reserve' failed: RuntimeError('refund to account <n> failed')"
#: FAILED flows: id -> error. `pct` holds LIKE's metacharacters; `pct-decoy` would match its
#: text if % and _ were wildcards, `path-decoy` if the backslash were LIKE's escape.
FAILED = {
    "pct": "discount 100%_off denied",
    "pct-decoy": "discount 100 XX offline denied",
    "path": "no such file C:\\tmp\\x",
    "path-decoy": "no such file C:tmp",
    "xss": "<script>alert(1)</script> " + "long " * 40,
}
_NO_ERROR = "(no error recorded)"
#: A compensation that raised with a lone surrogate in its message: stored as the engine
#: stores every error, escaped (`_checks.describe`).
SURROGATE = _checks.describe(RuntimeError("account \udc80 closed"))


def fill(tx: Any, blocked_flows: int = BLOCKED) -> None:
    _schema.create_schema(tx)
    _store.register_plans(tx, [ORDER], T0)

    def step(f: Flow, outcome: Any, at: float) -> _op.Change:
        def apply(flow: Flow, box: Mailbox) -> Transition:
            return m.step_done(flow, box, ORDER, outcome, flow.data, at)

        return _op.Change(f.flow_id, apply, flow=f, first_queued=True)

    def flows(results: list[_op.Result]) -> list[Flow]:
        out = []
        for r in results:
            assert isinstance(r, _op.Created | _op.Changed), r
            out.append(r.transition.flow)
        return out

    blocked = {f"acct-{i:05d}": T0 + 10 + i for i in range(blocked_flows)}
    blocked["surrogate"] = T0 + 5
    made = flows(
        _batch.write_batch(
            tx, [_op.Create(m.start(ORDER, fid, "{}", at)) for fid, at in blocked.items()]
        )
    )
    made = flows(_batch.write_batch(tx, [step(f, CONTINUE, blocked[f.flow_id]) for f in made]))
    made = flows(_batch.write_batch(tx, [step(f, fail("x"), blocked[f.flow_id]) for f in made]))

    def error(fid: str) -> str:
        if fid == "surrogate":
            return SURROGATE
        return repr(RuntimeError(f"refund to account {100000 + int(fid[5:])} failed"))

    _batch.write_batch(
        tx,
        [
            _op.Change(
                f.flow_id,
                lambda fl, _b: m.compensation_failed(fl, error(fl.flow_id), blocked[fl.flow_id]),
            )
            for f in made
        ],
    )
    made = flows(
        _batch.write_batch(tx, [_op.Create(m.start(ORDER, fid, "{}", T0 + 1)) for fid in FAILED])
    )
    _batch.write_batch(tx, [step(f, fail(FAILED[f.flow_id]), T0 + 1) for f in made])


@pytest.fixture(scope="module")
def sqlite_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("triage") / "flows.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("BEGIN")
    fill(_InlineTx(conn))
    conn.execute("COMMIT")
    conn.close()
    return path


@pytest.fixture(scope="module")
def postgres_dsn(pg_server: pg.PgServer) -> str:
    dsn = pg_server.fresh_schema_dsn()

    async def filled() -> None:
        async with PostgresStore(dsn, connections=1) as store:
            await store.transact(fill)

    trio.run(filled)
    return dsn


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest) -> Iterator[str]:
    """The filled store, read only by the tests that take it (the bulk action fills its own)."""
    yield request.getfixturevalue(
        f"{request.param}_file" if request.param == "sqlite" else "postgres_dsn"
    )


def ids(capsys: pytest.CaptureFixture[str], where: str, *argv: str) -> list[str]:
    return [f["flow_id"] for f in run_json(capsys, where, "list", *argv)["flows"]]


# ------------------------------------------------------------------------------ the inspector


def test_stats_groups_the_blocked_flows_of_every_account_in_one(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    errors = run_json(capsys, store, "stats")["errors"]
    top = errors["groups"][0]
    assert top == {
        "state": "BLOCKED",
        "error": REASON,
        "flows": BLOCKED,
        "first_seen": T0 + 10,
        "last_seen": T0 + 10 + BLOCKED - 1,
        "examples": ["acct-00000", "acct-01999"],  # its least and greatest id
        "match": "compensation of step 'reserve' failed: RuntimeError('refund to account",
    }
    # the failed flows: one group each (their texts differ beyond numbers), and the surrogate's
    assert errors["total_groups"] == 2 + len(FAILED)
    assert errors["groups_left_out"] == 0 == errors["flows_left_out"]
    assert errors["flows_not_grouped"] == 0
    by_error = {g["error"]: g for g in errors["groups"]}
    assert by_error["discount <n>%_off denied"]["examples"] == ["pct"]
    assert by_error[
        "compensation of step 'reserve' failed: RuntimeError('account \\udc<n> closed')"
    ]
    code, out, _ = run(capsys, store, "stats")
    assert code == 0
    table = out.split("failed and blocked, by error\n")[1].splitlines()
    assert table[0].split() == ["FLOWS", "STATE", "FIRST", "LAST", "E.G.", "ERROR"]
    assert table[2].split()[:2] == [str(BLOCKED), "BLOCKED"] and REASON in table[2]
    assert "left out" not in out


def test_stats_limit_says_what_it_left_out(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    errors = run_json(capsys, store, "stats", "--limit", "1")["errors"]
    assert [g["flows"] for g in errors["groups"]] == [BLOCKED]
    left = 1 + len(FAILED)  # the surrogate's group and the failed flows'
    assert (errors["limit"], errors["total_groups"]) == (1, 1 + left)
    assert (errors["groups_left_out"], errors["flows_left_out"]) == (left, left)
    code, out, _ = run(capsys, store, "stats", "--limit", "1")
    assert code == 0
    assert f"({left} more group(s) of {left} flow(s) left out: --limit N shows more)" in out
    code, _, err = run(capsys, store, "stats", "--limit", "0")
    assert code == 2 and "argument --limit: '0' is not a whole number >= 1" in err


def test_stats_counts_the_flows_past_the_distinct_texts_it_reads(sqlite_file: str) -> None:
    from ferry.flow._store import _triage  # here: the other tests run (and fail) without it

    conn = sqlite3.connect(sqlite_file)
    try:
        groups = _triage.failure_groups(_InlineTx(conn), limit=1, scan=2)
    finally:
        conn.close()
    # the account numbers are folded in the database: 2,000 reasons are one row of the two read
    assert groups.groups[0].flows == BLOCKED
    assert (groups.total_groups, groups.groups_left_out, groups.flows_left_out) == (2, 1, 1)
    assert groups.flows_not_grouped == len(FAILED)  # the rows past the two
    assert groups.flows == BLOCKED + 1 + len(FAILED)


@pytest.mark.parametrize(
    ("error", "normalised"),
    [
        ("refund to account 12345 failed", "refund to account <n> failed"),
        ("took 1.25 s, 3 tries", "took <n> s, <n> tries"),
        ("object at 0x7f3a2b1c90", "object at <hex>"),
        ("commit deadbeef1234 missing", "commit <hex> missing"),
        ("request 550e8400-e29b-41d4-a716-446655440000 lost", "request <uuid> lost"),
        ("no user 'alice'", "no user '<s>'"),
        ('KeyError("order-17")', 'KeyError("<s>")'),
        ("RuntimeError('card 4242 declined')", "RuntimeError('card <n> declined')"),
        ("step 'charge' raised ValueError('x-1')", "step 'charge' raised ValueError('<s>')"),
        ("flow ab-cd has no parent", "flow <flow> has no parent"),
        (None, _NO_ERROR),
        ("", _NO_ERROR),
    ],
)
def test_normalise_folds_what_varies_between_flows(error: str | None, normalised: str) -> None:
    from ferry.flow._store import _triage

    assert _triage.normalise(error, "ab-cd") == normalised


def test_list_shows_the_error_cut_and_json_the_whole(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, store, "list", "--state", "failed", "--id-prefix", "xss")
    assert code == 0
    header, _rule, line = out.splitlines()
    assert header.split()[-1] == "ERROR"
    shown = line[header.index("ERROR") :]
    assert shown.startswith("<script>alert(1)</script> long") and shown.endswith("…")
    assert len(shown) == 60
    (flow,) = run_json(capsys, store, "list", "--id-prefix", "xss")["flows"]
    assert flow["error"] == FAILED["xss"]  # whole
    (flow,) = run_json(capsys, store, "list", "--id-prefix", "acct-00007")["flows"]
    assert flow["error"] == REASON.replace("<n>", "100007")


def test_error_filter_is_a_substring_in_any_case(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ids(capsys, store, "--error", "REFUND TO ACCOUNT 100005") == ["acct-00005"]
    found = ids(capsys, store, "--error", "refund to account 10000 ", "--limit", "50")
    assert found == []  # "10000 " is in no reason: the account numbers have six digits
    found = ids(capsys, store, "--error", "account 10000", "--id-prefix", "acct")
    assert found == [f"acct-{i:05d}" for i in range(10)]
    assert len(ids(capsys, store, "--error", "refund to account", "--limit", "1000")) == 1000
    # the same start time: by id, descending
    assert ids(capsys, store, "--error", "denied", "--state", "failed") == ["pct-decoy", "pct"]
    code, out, _ = run(capsys, store, "list", "--error", "account 100005")
    assert code == 0 and "compensation of step 'reserve' failed: RuntimeError('refund…" in out


def test_error_filter_matches_like_metacharacters_literally(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ids(capsys, store, "--error", "100%_off") == ["pct"]
    assert ids(capsys, store, "--error", "100%") == ["pct"]
    assert ids(capsys, store, "--error", "0_o") == []  # "_" is no wildcard
    assert ids(capsys, store, "--error", "C:\\tmp") == ["path"]
    assert ids(capsys, store, "--error", "\\") == ["surrogate", "path"]
    assert ids(capsys, store, "--error", "%") == ["pct"]


def test_a_lone_surrogate_is_refused_and_its_escaped_text_found(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, store, "list", "--error", "account \udc80")
    assert (code, out) == (2, "")
    assert "argument --error: 'account \\udc80' is not valid UTF-8 text" in err
    assert ids(capsys, store, "--error", "account \\udc80") == ["surrogate"]
    with pytest.raises(ValueError, match="error cannot match any stored text"):
        _query.FlowFilter(error="\udc80")


def test_a_bulk_action_takes_the_error_filter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "flows.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("BEGIN")
    fill(_InlineTx(conn), 100)  # enough here: accounts 100000 to 100099
    conn.execute("COMMIT")
    conn.close()
    done = run_json(
        capsys,
        path,
        "abandon",
        "--error",
        "Refund To Account 10000",
        "--reason",
        "refunded by hand",
        "--yes",
    )
    assert done["matched"] == 10 and done["acted"] == 10
    assert "--error Refund To Account 10000" in done["filters"]
    assert sorted(r["flow_id"] for r in done["results"]) == [f"acct-{i:05d}" for i in range(10)]
    assert ids(capsys, path, "--error", "account 10000", "--state", "blocked") == []
    assert len(ids(capsys, path, "--error", "account 10000", "--state", "failed")) == 10


def test_a_bulk_action_on_postgres_takes_the_error_filter(
    pg_server: pg.PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = pg_server.fresh_schema_dsn()

    async def filled() -> None:
        async with PostgresStore(dsn, connections=1) as store:
            await store.transact(partial(fill, blocked_flows=100))

    trio.run(filled)
    done = run_json(
        capsys, dsn, "abandon", "--error", "ACCOUNT 100_0", "--reason", "by hand", "--yes"
    )
    assert done["matched"] == 0  # "_" is no wildcard
    done = run_json(
        capsys, dsn, "abandon", "--error", "ACCOUNT 10001", "--reason", "by hand", "--yes"
    )
    assert done["acted"] == 10


# ------------------------------------------------------------------------------ the dashboard

TOKEN = "t0ken-for-the-tests-0123456789"


@pytest.fixture
async def web(store: str) -> AsyncIterator[httpx.AsyncClient]:
    if store.endswith(".db"):
        reader = Reader(path=store)
        pgstore = None
    else:
        pgstore = PostgresStore(store, connections=1)
        reader = Reader(store=pgstore)
    dash = Dashboard(reader=reader, store=store, where="the store", token=TOKEN, page_size=20)
    app: Any = dash.app(hosts=loopback_hosts("127.0.0.1"))
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
        ) as client:
            yield client
    finally:
        if pgstore is not None:
            await pgstore.aclose()


def listed(html: str) -> list[str]:
    return re.findall(r'<td class="id"><a [^>]*>([^<]*)</a>', html)


async def test_dashboard_list_has_the_error_column_and_field(web: httpx.AsyncClient) -> None:
    r = await web.get("/flows", params={"error": "100%_OFF"})
    assert r.status_code == 200
    assert listed(r.text) == ["pct"]
    assert 'name="error" id="f-error" value="100%_OFF"' in r.text
    assert "<th>error</th>" in r.text
    assert '<td class="error-text" title="discount 100%_off denied">discount 100%_off denied' in (
        r.text
    )
    r = await web.get("/flows", params={"id_prefix": "xss"})
    (cell,) = re.findall(r'<td class="error-text"[^>]*>[^<]*</td>', r.text)
    assert "<script>" not in r.text and "&lt;script&gt;alert(1)&lt;/script&gt; long" in cell
    title = re.search(r'title="([^"]*)"', cell)
    assert title is not None and title.group(1).count("long") == 40  # the whole on hover
    shown = cell.split(">", 1)[1].removesuffix("</td>")
    assert shown.endswith("…") and shown.count("long") < 40
    r = await web.get("/flows", params={"id_prefix": "surrogate"})
    assert "RuntimeError(&#39;account \\udc80 closed&#39;)</td>" in r.text  # as stored, escaped
    r = await web.get("/flows?error=%ED%B2%80")  # a lone surrogate's bytes: not UTF-8
    assert r.status_code == 200 and listed(r.text) == []


async def test_dashboard_overview_shows_the_groups_linked_to_their_flows(
    web: httpx.AsyncClient,
) -> None:
    r = await web.get("/")
    assert r.status_code == 200
    section = r.text.split('<section id="errors">')[1].split("</section>")[0]
    rows = re.findall(
        r'<tr class="error-group"><td class="num"><a href="([^"]*)">(\d+)</a>', section
    )
    assert len(rows) == 2 + len(FAILED)
    link, count = rows[0]
    assert count == str(BLOCKED)
    assert "refund to account &lt;n&gt; failed" in section
    assert "errors-left-out" not in section
    r = await web.get(link.replace("&amp;", "&"))
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(link.replace("&amp;", "&")).query)
    assert query["state"] == ["BLOCKED"]
    assert listed(r.text)[:3] == ["acct-01999", "acct-01998", "acct-01997"]
    assert "surrogate" not in listed(r.text)
