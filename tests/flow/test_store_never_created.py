"""Neither the dashboard nor the inspector ever creates the SQLite file they were pointed at.

The file is removed while the dashboard serves it, or its path becomes a symlink to nowhere or a
directory: an action is refused as unavailable (503, "nothing was done"), as the pages are, and
the path is left as it was. Before, the operator's engine of the action opened the path creating
it (and its tables), and the action answered 404 "No flow has the id" from the new empty store.
The inspector's store and an operator's engine (`open_engine(..., serve=False)`) are opened
without create too: a file removed after the inspector's first check is an error, never made.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from ferry import flow
from ferry.flow._ops import _inspect
from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader
from ferry.flow._ops._inspect_act import do_wake
from ferry.flow._ops._inspect_read import open_store
from ferry.projected import SqliteStore

from .test_dashboard import TOKEN, client_of, fill


def there(path: str) -> bool:
    """Is there anything at `path` (a file, a directory, a symlink, even to nowhere)?"""
    return os.path.lexists(path)


def remove(path: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)


def removed(path: str) -> Callable[[], bool]:
    remove(path)
    return lambda: not os.path.lexists(path)


def dangling(path: str) -> Callable[[], bool]:
    remove(path)
    target = os.path.join(os.path.dirname(path), "nowhere.db")
    os.symlink(target, path)
    return lambda: os.path.islink(path) and not os.path.lexists(target)


def directory(path: str) -> Callable[[], bool]:
    remove(path)
    os.mkdir(path)
    return lambda: os.path.isdir(path) and os.listdir(path) == []


GONE = {"removed": removed, "a symlink to nowhere": dangling, "a directory": directory}


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "flows.db")
    fill(path)
    return path


@pytest.mark.parametrize("gone", GONE.values(), ids=GONE.keys())
async def test_an_action_on_a_gone_file_is_unavailable_and_creates_nothing(
    db: str, gone: Callable[[str], Callable[[], bool]]
) -> None:
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN)
    async with await client_of(dash) as web:
        assert (await web.get("/flows")).status_code == 200
        as_it_was = gone(db)
        for action, form in (
            ("wake", {"payload": '"go"'}),
            ("cancel", {}),
            ("resume", {}),
        ):
            r = await web.post(f"/flow/{action}", data={"id": "parked", "token": TOKEN, **form})
            assert r.status_code == 503, (action, r.text[:300])
            assert "The database is unavailable" in r.text and "No flow has the id" not in r.text
            assert as_it_was(), action
        for url in ("/", "/flows", "/flow?id=parked", "/metrics"):
            assert (await web.get(url)).status_code == 503, url
        assert as_it_was()


@pytest.mark.parametrize("gone", GONE.values(), ids=GONE.keys())
async def test_an_operators_engine_never_creates_the_file(
    db: str, gone: Callable[[str], Callable[[], bool]]
) -> None:
    as_it_was = gone(db)
    with pytest.raises((FileNotFoundError, ValueError)):
        async with flow.open_engine(db, [], serve=False):
            pass
    assert as_it_was()
    with pytest.raises((FileNotFoundError, ValueError)):
        async with flow.open_engine(SqliteStore(db), [], serve=False):
            pass
    assert as_it_was()


async def test_a_store_opened_without_create_never_makes_the_file(tmp_path: Path) -> None:
    path = str(tmp_path / "none.db")
    async with SqliteStore(path, create=False) as store:
        with pytest.raises(Exception, match="unable to open"):
            await store.transact(lambda tx: tx.execute("SELECT 1"))
    assert not there(path)
    with pytest.raises(TypeError, match="create must be a bool"):
        SqliteStore(path, create=0)  # type: ignore[arg-type]


async def test_the_inspectors_action_on_a_file_removed_after_its_check(db: str) -> None:
    args = _inspect.parser().parse_args([db, "wake", "parked", "--payload", '"go"'])
    args.where, args.json, args.filter = repr(db), False, None
    store = open_store(db)  # the file is checked here
    try:
        remove(db)
        with pytest.raises(Exception, match=r"unable to open|no flow store"):
            await do_wake(argparse.Namespace(**vars(args)), store)
    finally:
        await store.aclose()
    assert not there(db)


async def test_a_serving_engine_still_creates_its_file(tmp_path: Path) -> None:
    path = tmp_path / "new" / "flows.db"
    path.parent.mkdir()
    plan = flow.Plan("p")

    @plan.step
    async def one(ctx: flow.Context) -> None:
        pass

    async with flow.open_engine(str(path), [plan]):
        pass
    assert path.is_file()
    shutil.rmtree(path.parent)
