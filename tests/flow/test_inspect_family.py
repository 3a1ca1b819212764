"""The inspector and child flows (SPEC 5.7, docs/adr/0159): ``show`` names a child's parent and
lists a parent's spawn (phase, counters) with its children (key, state, id), ``--json`` the
same; ``list --parent ID`` lists a parent's children (from another process too); ``purge
--flow`` of a child refuses and names the parent, and of a top-level flow deletes its tree.

The store is written by a real engine, closed before the inspector reads it: ``o`` waits for
its spawn (``o/1/b0`` parked, ``b1`` and ``b2`` kept), ``done`` completed with two children.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from ferry import flow
from ferry.flow._store import _lineage
from ferry.projected import PostgresStore
from tests import pg

from .test_inspect import ROOT, run, run_json


def family_plans() -> list[flow.Plan]:
    box = flow.Plan("box")

    async def unpack(ctx: flow.Context) -> None:
        pass

    @box.step(compensate=unpack)
    async def pack(ctx: flow.Context) -> flow.Outcome | None:
        if ctx.data.get("fail"):
            return flow.fail("no box")
        return flow.park() if ctx.data.get("park") else None

    order = flow.Plan("order")

    @order.step
    async def reserve(ctx: flow.Context) -> None:
        pass

    @order.step
    async def ship_all(ctx: flow.Context) -> flow.Outcome:
        boxes = ctx.data["boxes"]
        children = [flow.Child(box, key=b.get("key", f"b{i}"), data=b) for i, b in enumerate(boxes)]
        return flow.spawn(children, max_running=ctx.data.get("max"))

    @order.step
    async def invoice(ctx: flow.Context) -> None:
        ctx.data["got"] = sorted(ctx.children)

    return [order, box]


async def _fill(path: str | PostgresStore, *, bad: list[dict[str, object]] | None = None) -> None:
    """The store of the module doc; with `bad`, also ``bad``, an order of those boxes, ended."""
    order, box = family_plans()
    async with flow.open_engine(path, plans=[order, box], retain=None) as engine:
        if bad is not None:
            await engine.start(order, flow_id="bad", data={"boxes": bad, "max": 1})
            await engine.wait("bad", timeout=30)
        await engine.start(order, flow_id="done", data={"boxes": [{}, {}]})
        snap = await engine.wait("done", timeout=30)
        assert snap.state is flow.State.COMPLETED
        await engine.start(order, flow_id="o", data={"boxes": [{"park": 1}, {}, {}], "max": 1})
        while (b0 := await engine.get("o/1/b0")) is None or b0.state is not flow.State.PARKED:  # noqa: ASYNC110
            await trio.sleep(0.001)


@pytest.fixture(scope="module")
def family_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("family") / "flows.db")
    trio.run(_fill, path)
    return path


@pytest.fixture
def copy_db(family_db: str, tmp_path: Path) -> str:
    """A copy of the store that a test may change (a purge)."""
    import sqlite3

    path = str(tmp_path / "flows.db")
    src, dst = sqlite3.connect(family_db), sqlite3.connect(path)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return path


def test_show_lists_a_parents_spawn_and_its_children(
    family_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, family_db, "show", "o")
    assert code == 0, err
    assert (
        "spawn     step 1: waiting; 3 children: 1 active, 0 ended, 2 kept (max_running 1,"
        " on_failure compensate)"
    ) in out
    rows = [line.split() for line in out.splitlines() if line.startswith("b")]
    assert rows == [["b0", "PARKED", "o/1/b0"], ["b1", "KEPT", "o/1/b1"], ["b2", "KEPT", "o/1/b2"]]
    assert "parent" not in out  # a top-level flow
    assert out.index("spawn ") < out.index("REV")  # before the history


def test_show_names_a_childs_parent(family_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, family_db, "show", "o/1/b0")
    assert code == 0
    assert "parent    o (PARKED)\n" in out
    assert "spawn " not in out
    data = run_json(capsys, family_db, "show", "o/1/b0")
    assert data["flow"]["parent"] == "o"
    assert data["family"] == {"parent": "o", "parent_state": "PARKED", "spawns": []}


def test_show_json_carries_the_spawn_and_its_children(
    family_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = run_json(capsys, family_db, "show", "done")
    (spawn,) = data["family"]["spawns"]
    assert {k: spawn[k] for k in ("phase", "total", "active", "ended", "kept")} == {
        "phase": "over",
        "total": 2,
        "active": 0,
        "ended": 2,
        "kept": 0,
    }
    assert [(c["key"], c["state"], c["flow_id"]) for c in spawn["children"]] == [
        ("b0", "COMPLETED", "done/1/b0"),
        ("b1", "COMPLETED", "done/1/b1"),
    ]
    assert sorted(c["ended"] for c in spawn["children"]) == [1, 2]  # the order of their ends
    assert spawn["children_left_out"] == 0
    assert data["family"]["parent"] is None


def test_show_says_how_many_children_it_leaves_out(
    family_db: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_lineage, "CHILDREN_SHOWN", 1)
    code, out, _ = run(capsys, family_db, "show", "o")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines() if line.startswith("b")] == ["b0"]
    assert "(2 more: list --parent o lists them all, --json too)" in out


def test_list_parent_lists_its_started_children(
    family_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = run_json(capsys, family_db, "list", "--parent", "done")
    assert sorted(f["flow_id"] for f in data["flows"]) == ["done/1/b0", "done/1/b1"]
    assert {f["parent"] for f in data["flows"]} == {"done"}
    code, out, _ = run(capsys, family_db, "list", "--parent", "o")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["o/1/b0"]  # kept: no row yet
    code, out, _ = run(capsys, family_db, "list", "--parent", "o/1/b0")
    assert (code, out) == (0, "no flows match\n")


def test_list_parent_from_another_process(family_db: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ferry.flow", family_db, "list", "--parent", "done", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(f["flow_id"] for f in json.loads(done.stdout)["flows"]) == [
        "done/1/b0",
        "done/1/b1",
    ]


def test_purge_of_a_child_refuses_and_names_its_parent(
    copy_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for child in ("done/1/b0", "o/1/b0"):  # finished or not: a child never goes alone
        code, out, err = run(
            capsys, copy_db, "purge", "--finished-before", "0s", "--flow", child, "--yes"
        )
        assert (code, out) == (1, "")
        parent = child.split("/")[0]
        assert f"flow {child!r} is a child of flow {parent!r}" in err
        assert f"purge --flow {parent} deletes the tree" in err
    assert len(run_json(capsys, copy_db, "list", "--parent", "done")["flows"]) == 2
    code, _, err = run(capsys, copy_db, "purge", "--finished-before", "0s", "--flow", "nope")
    assert code == 1 and "no flow has id 'nope'" in err


def test_purge_of_a_top_level_flow_deletes_its_tree(
    copy_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    report = run_json(
        capsys, copy_db, "purge", "--finished-before", "0s", "--flow", "done", "--yes"
    )
    assert (report["flow"], report["matched"], report["deleted"]) == ("done", 1, 1)
    assert run_json(capsys, copy_db, "list", "--parent", "done")["flows"] == []
    left = sorted(f["flow_id"] for f in run_json(capsys, copy_db, "list")["flows"])
    assert left == ["o", "o/1/b0"]


def test_on_postgres_show_and_list_parent(
    pg_server: pg.PgServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = pg_server.fresh_schema_dsn()

    async def fill() -> None:
        async with PostgresStore(dsn, connections=2) as store:
            await _fill(store)

    trio.run(fill)
    (spawn,) = run_json(capsys, dsn, "show", "o")["family"]["spawns"]
    assert (spawn["phase"], spawn["active"], spawn["kept"]) == ("waiting", 1, 2)
    assert [(c["key"], c["state"]) for c in spawn["children"]] == [
        ("b0", "PARKED"),
        ("b1", "KEPT"),
        ("b2", "KEPT"),
    ]
    assert run_json(capsys, dsn, "show", "o/1/b0")["family"]["parent_state"] == "PARKED"
    listed = run_json(capsys, dsn, "list", "--parent", "done")["flows"]
    assert sorted(f["flow_id"] for f in listed) == ["done/1/b0", "done/1/b1"]
    code, _, err = run(capsys, dsn, "purge", "--finished-before", "0s", "--flow", "done/1/b1")
    assert code == 1 and "is a child of flow 'done'" in err
