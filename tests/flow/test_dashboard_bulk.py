"""Actions on every flow a filter matches, from the dashboard's list: a GET shows a confirmation
page with the count and changes nothing; the POST needs the token (403 otherwise, nothing
done), acts on each match in its own call (a match in a state the action does not apply to is
left and counted as such), says what became of them, never acts on more than its cap, and
writes an audit line naming who and what.

Checked to fail before there were actions on a filter (``/flows/bulk`` was 404/405).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator

import httpx
import pytest

from ferry import flow
from ferry.flow._ops._dashboard._app import Dashboard
from ferry.flow._ops._dashboard._reads import Reader

from .test_dashboard import TOKEN, client_of, db, row, text_of  # noqa: F401 (db: a fixture)

BLOCKED = ("blocked", "blocked-2")


@pytest.fixture
async def web(db: str) -> AsyncIterator[httpx.AsyncClient]:  # noqa: F811
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN, page_size=3)
    async with await client_of(dash) as client:
        yield client


def states(db: str, *ids: str) -> list[flow.State]:  # noqa: F811
    return [row(db, fid)[0].state for fid in ids]


async def test_the_list_offers_actions_on_its_filter(web: httpx.AsyncClient) -> None:
    r = await web.get("/flows", params={"state": "BLOCKED", "plan": "order"})
    form = r.text.split('id="bulk-form"')[1].split("</form>")[0]
    assert '<input type="hidden" name="state" value="BLOCKED">' in form
    assert '<input type="hidden" name="plan" value="order">' in form
    assert 'value="abandon" id="bulk-abandon"' in form and 'value="cancel"' in form


async def test_abandon_on_a_filter_asks_with_the_count_then_acts(
    web: httpx.AsyncClient,
    db: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="ferry.flow")
    before = [row(db, fid) for fid in BLOCKED]
    r = await web.get("/flows/bulk", params={"action": "abandon", "state": "blocked"})
    assert r.status_code == 200
    assert text_of(r.text, "bulk-count") == "2 flows match."
    assert "state=blocked" in text_of(r.text, "bulk-filter")
    assert 'id="bulk-token"' in r.text and 'id="bulk-reason"' in r.text
    assert [row(db, fid) for fid in BLOCKED] == before  # asking changes nothing
    form = {"action": "abandon", "state": "blocked", "reason": "refunded by hand"}
    r = await web.post("/flows/bulk", data=form)
    assert r.status_code == 403 and "no token" in text_of(r.text, "problem")
    r = await web.post("/flows/bulk", data={**form, "token": TOKEN, "reason": ""})
    assert r.status_code == 400 and "abandon needs a reason" in text_of(r.text, "problem")
    assert [row(db, fid) for fid in BLOCKED] == before
    r = await web.post("/flows/bulk", data={**form, "token": TOKEN})
    assert r.status_code == 200
    assert text_of(r.text, "bulk-done") == "Acted on 2 of 2 flows."
    assert states(db, *BLOCKED) == [flow.State.FAILED] * 2
    mine = [r_ for r_ in caplog.records if r_.getMessage().startswith("dashboard: bulk")]
    assert [r_.levelname for r_ in mine] == ["WARNING", "INFO"]  # the refusal, the action
    audit = vars(mine[1])  # its extra=
    assert audit["by"] == "dashboard (127.0.0.1)"
    assert audit["action"] == "bulk abandon" and audit["acted"] == audit["tried"] == 2
    assert audit["filter"] == "state=blocked"


async def test_a_match_the_action_does_not_apply_to_is_left_and_counted(
    web: httpx.AsyncClient,
    db: str,  # noqa: F811
) -> None:
    r = await web.post("/flows/bulk", data={"action": "resume", "plan": "order", "token": TOKEN})
    assert r.status_code == 200
    # populate's order flows (8 of its 9 are order's... the markup flow too): only the blocked
    # ones are resumed, the others are said not to be
    done = text_of(r.text, "bulk-done")
    assert re.fullmatch(r"Acted on 2 of \d+ flows\.", done), done
    tally = dict(re.findall(r"<tr><td>([^<]+)</td><td class=\"num\">(\d+)</td></tr>", r.text))
    assert tally["resumed"] == "2" and "not resumed: not BLOCKED" in tally
    assert states(db, *BLOCKED) == [flow.State.COMPENSATING] * 2
    assert states(db, "parked", "done") == [flow.State.PARKED, flow.State.COMPLETED]


async def test_an_action_on_a_filter_never_acts_on_more_than_its_cap(db: str) -> None:  # noqa: F811
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN)
    dash.bulk_max = 1
    async with await client_of(dash) as web:
        r = await web.get("/flows/bulk", params={"action": "cancel", "state": "parked"})
        assert "More than 1 flows match: this acts on the newest 1" in r.text
        r = await web.post(
            "/flows/bulk", data={"action": "cancel", "state": "parked", "token": TOKEN}
        )
        assert text_of(r.text, "bulk-done") == "Acted on 1 of 1 flow."
    # the newest parked flow ("parked", started after "parked-old") was cancelled
    assert states(db, "parked", "parked-old") == [flow.State.COMPENSATING, flow.State.PARKED]


async def test_bad_actions_and_filters_are_said(web: httpx.AsyncClient) -> None:
    r = await web.get("/flows/bulk", params={"action": "explode"})
    assert r.status_code == 400 and "no action &#39;explode&#39;" in r.text
    r = await web.get("/flows/bulk", params={"action": "cancel", "version": "two"})
    assert r.status_code == 400 and "version must be a whole number" in r.text
    r = await web.post("/flows/bulk", data={"action": "wake", "token": TOKEN})
    assert r.status_code == 400 and "no action &#39;wake&#39;" in r.text


async def test_read_only_offers_no_actions_on_a_filter(db: str) -> None:  # noqa: F811
    dash = Dashboard(reader=Reader(path=db), store=db, where="x", token=TOKEN, read_only=True)
    async with await client_of(dash) as web:
        r = await web.get("/flows", params={"state": "blocked"})
        assert 'id="bulk-form"' not in r.text
        before = [row(db, fid) for fid in BLOCKED]
        form = {"action": "resume", "state": "blocked", "token": TOKEN}
        r = await web.post("/flows/bulk", data=form)
        assert r.status_code == 403 and "read-only" in text_of(r.text, "problem")
        assert [row(db, fid) for fid in BLOCKED] == before
