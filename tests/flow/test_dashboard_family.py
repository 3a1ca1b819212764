"""The dashboard and child flows (SPEC 5.7, docs/adr/0159), through its ASGI app (httpx, no
browser): a parent's page lists each spawn (phase, counters) and its children with their states,
each a link to the child's page (a kept one has no page yet); a child's page links to its
parent; ``/flows?parent=ID`` lists a parent's children; the events ``children_ended`` and
``undone_by_parent`` are on the timeline with their tones; a child key holding markup is text.

The store is the inspector's family store (`test_inspect_family._fill`), plus ``bad``: a child
``<b>x`` completed, then ``b1`` failed, so ``bad`` compensated and undid ``<b>x``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader

from .test_dashboard import TOKEN, client_of, flow_url
from .test_inspect_family import _fill

MARKUP = "<b>x"


@pytest.fixture(scope="module")
def family_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("family") / "flows.db")
    trio.run(lambda: _fill(path, bad=[{"key": MARKUP}, {"fail": 1}]))
    return path


@pytest.fixture
async def web(family_db: str) -> AsyncIterator[httpx.AsyncClient]:
    dash = Dashboard(reader=Reader(path=family_db), store=family_db, where="x", token=TOKEN)
    async with await client_of(dash) as client:
        yield client


def children_rows(html: str) -> list[tuple[str, str, str]]:
    """(key, state, the link of the child or '' for a kept one) of each child row."""
    rows = []
    for body in re.findall(r'<tr class="child">(.*?)</tr>', html, re.S):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", body, re.S)
        state = re.search(r'class="badge state-[a-z]+">([A-Z]+)<', cells[1])
        link = re.search(r'<a href="([^"]+)"', cells[2])
        assert state is not None
        rows.append((cells[0], state.group(1), "" if link is None else link.group(1)))
    return rows


async def test_a_parents_page_lists_its_children_with_their_states_and_links(
    web: httpx.AsyncClient,
) -> None:
    r = await web.get(flow_url("o"))
    assert r.status_code == 200
    assert children_rows(r.text) == [
        ("b0", "PARKED", "/flow?id=o%2F1%2Fb0"),
        ("b1", "KEPT", ""),
        ("b2", "KEPT", ""),
    ]
    spawn = re.search(r'id="spawn-1">\s*<p>(.*?)</p>', r.text, re.S)
    assert spawn is not None
    assert "waiting</span> spawned at step 1: 3 children, 1 active, 0 ended, 2 kept" in spawn[1]
    assert 'href="/flows?parent=o" id="all-children"' in r.text
    assert 'id="parent"' not in r.text  # a top-level flow


async def test_a_childs_page_links_to_its_parent(web: httpx.AsyncClient) -> None:
    r = await web.get(flow_url("o/1/b0"))
    assert r.status_code == 200
    parent = re.search(r'<td id="parent">(.*?)</td>', r.text, re.S)
    assert parent is not None
    assert '<a href="/flow?id=o"><code>o</code></a>' in parent[1]
    assert 'class="badge state-parked">PARKED<' in parent[1]
    assert "<h2>Children</h2>" not in r.text
    back = await web.get("/flow?id=o")  # and back: the parent lists it
    assert "/flow?id=o%2F1%2Fb0" in back.text


async def test_flows_of_a_parent(web: httpx.AsyncClient) -> None:
    r = await web.get("/flows", params={"parent": "done"})
    assert r.status_code == 200
    ids = re.findall(r'<td class="id"><a [^>]*>([^<]*)</a>', r.text)
    assert sorted(ids) == ["done/1/b0", "done/1/b1"]
    assert 'id="f-parent" value="done"' in r.text
    r = await web.get("/flows", params={"parent": "o/1/b0"})
    assert re.findall(r'<td class="id"><a [^>]*>([^<]*)</a>', r.text) == []


async def test_a_spawns_end_and_an_undone_child_on_the_timelines(web: httpx.AsyncClient) -> None:
    r = await web.get(flow_url("bad"))
    assert r.status_code == 200
    assert children_rows(r.text) == [
        ("&lt;b&gt;x", "FAILED", "/flow?id=bad%2F1%2F%3Cb%3Ex"),
        ("b1", "FAILED", "/flow?id=bad%2F1%2Fb1"),
    ]
    assert "undone by its parent" in r.text and MARKUP not in r.text
    assert re.search(r'class="event kind-children_ended tone-warn"', r.text)
    assert re.search(r'class="event kind-step tone-wait"', r.text)  # the spawn parks it
    child = await web.get(flow_url(f"bad/1/{MARKUP}"))
    assert child.status_code == 200 and MARKUP not in child.text
    event = re.search(r'class="event kind-undone_by_parent tone-undo">(.*?)</li>', child.text, re.S)
    assert event is not None and '<span class="key">parent</span> bad' in event[1]
    done = await web.get(flow_url("done"))
    assert re.search(r'class="event kind-children_ended tone-ok"', done.text)
