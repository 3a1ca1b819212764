"""The dashboard asks for the token once per browser (docs/adr/0129): the first action with the
right token starts a session (an ``HttpOnly``, ``SameSite=Strict`` cookie, ``Secure`` over
https); then the pages' forms carry the session's CSRF token instead of a token field, and a
POST needs both the cookie and that CSRF token. A form from another site is refused even with
the token; signing out or a restart ends the session; each action that succeeded is logged at
INFO with who and what in ``extra=``.

Checked to fail before sessions existed (no ``Set-Cookie``, every form asked for the token).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from ferry import flow
from ferry.flow._ops._dashboard._app import Dashboard, loopback_hosts
from ferry.flow._ops._dashboard._reads import Reader

from .test_dashboard import TOKEN, db, flow_url, row, text_of  # noqa: F401 (db: a fixture)


def dashboard(path: str) -> Dashboard:
    return Dashboard(reader=Reader(path=path), store=path, where="x", token=TOKEN)


def client(dash: Dashboard, scheme: str = "http") -> httpx.AsyncClient:
    app: Any = dash.app(hosts=loopback_hosts("127.0.0.1"))
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url=f"{scheme}://127.0.0.1"
    )


@pytest.fixture
async def web(db: str) -> AsyncIterator[httpx.AsyncClient]:  # noqa: F811
    async with client(dashboard(db)) as c:
        yield c


def csrf_of(html: str) -> str:
    found = re.search(r'<input type="hidden" name="csrf" value="([^"]+)">', html)
    assert found is not None, "no csrf field"
    return found.group(1)


async def test_the_token_once_then_the_session(
    web: httpx.AsyncClient,
    db: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="ferry.flow")
    r = await web.get(flow_url("parked"))
    assert 'id="cancel-token"' in r.text and 'name="csrf"' not in r.text
    r = await web.post("/flow/wake", data={"id": "parked", "token": TOKEN, "payload": "1"})
    assert r.status_code == 303
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("ferry_flow_session=")
    attrs = {a.strip() for a in cookie.split(";")[1:]}
    assert attrs == {"Path=/", "HttpOnly", "SameSite=Strict"}  # no Secure over http
    r = await web.get(flow_url("parked-old"))
    assert 'id="cancel-token"' not in r.text and 'id="signed-in"' in r.text
    assert 'id="signout"' in r.text
    csrf = csrf_of(r.text)
    # the session and its CSRF token: no token needed
    r = await web.post("/flow/cancel", data={"id": "parked-old", "csrf": csrf})
    assert r.status_code == 303 and "set-cookie" not in r.headers
    assert row(db, "parked-old")[0].state is flow.State.COMPENSATING
    # the cookie without the CSRF token, or with another one: refused, nothing done
    before = row(db, "blocked")
    r = await web.post("/flow/resume", data={"id": "blocked"})
    assert r.status_code == 403 and "no token" in text_of(r.text, "problem")
    r = await web.post("/flow/resume", data={"id": "blocked", "csrf": csrf[::-1]})
    assert r.status_code == 403 and "does not belong to your session" in r.text
    assert row(db, "blocked") == before
    audit = [vars(x) for x in caplog.records if x.levelname == "INFO" and hasattr(x, "by")]
    assert [(a["action"], a["flow_id"], a["by"], a["outcome"]) for a in audit] == [
        ("wake", "parked", "dashboard (127.0.0.1)", "wake-RESUMED"),
        ("cancel", "parked-old", "dashboard (127.0.0.1)", "cancel"),
    ]


async def test_a_csrf_token_without_its_cookie_is_refused(db: str) -> None:  # noqa: F811
    dash = dashboard(db)
    async with client(dash) as first:
        await first.post("/flow/resume", data={"id": "done", "token": TOKEN})
        csrf = csrf_of((await first.get(flow_url("blocked"))).text)
    before = row(db, "blocked")
    async with client(dash) as other:  # another browser: no cookie
        r = await other.post("/flow/resume", data={"id": "blocked", "csrf": csrf})
        assert r.status_code == 403 and "your session has ended" in r.text
    assert row(db, "blocked") == before


async def test_a_restart_or_signing_out_ends_the_session(db: str) -> None:  # noqa: F811
    async with client(dashboard(db)) as web:
        await web.post("/flow/resume", data={"id": "done", "token": TOKEN})
        csrf = csrf_of((await web.get(flow_url("blocked"))).text)
        cookies = httpx.Cookies(web.cookies.jar)  # the browser keeps its cookie
    async with client(dashboard(db)) as web:  # the dashboard restarted
        web.cookies = cookies
        r = await web.post("/flow/resume", data={"id": "blocked", "csrf": csrf})
        assert r.status_code == 403 and "your session has ended" in r.text
        r = await web.get(flow_url("blocked"))
        assert 'id="resume-token"' in r.text  # the token is asked again
        await web.post("/flow/resume", data={"id": "done", "token": TOKEN})
        csrf = csrf_of((await web.get(flow_url("blocked"))).text)
        r = await web.post("/session/end", data={"csrf": csrf})
        assert r.status_code == 303 and "Max-Age=0" in r.headers["set-cookie"]
        r = await web.get(flow_url("blocked"))
        assert 'id="resume-token"' in r.text and 'name="csrf"' not in r.text
        r = await web.post("/flow/resume", data={"id": "blocked", "csrf": csrf})
        assert r.status_code == 403
    assert row(db, "blocked")[0].state is flow.State.BLOCKED


async def test_over_https_the_cookie_is_secure(db: str) -> None:  # noqa: F811
    async with client(dashboard(db), scheme="https") as web:
        r = await web.post("/flow/resume", data={"id": "done", "token": TOKEN})
        assert "Secure" in {a.strip() for a in r.headers["set-cookie"].split(";")}


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({"origin": "http://evil.example"}, "another origin"),
        ({"origin": "null"}, "another origin"),
        ({"origin": "https://127.0.0.1"}, "another origin"),  # another scheme
        ({"sec-fetch-site": "cross-site"}, "another site"),
    ],
)
async def test_a_form_from_another_site_is_refused_even_with_the_token(
    web: httpx.AsyncClient,
    db: str,  # noqa: F811
    headers: dict[str, str],
    why: str,
) -> None:
    before = row(db, "blocked")
    form = {"id": "blocked", "token": TOKEN}
    r = await web.post("/flow/resume", data=form, headers=headers)
    assert r.status_code == 403 and why in text_of(r.text, "problem")
    assert "set-cookie" not in r.headers
    assert row(db, "blocked") == before
    r = await web.post("/flow/resume", data=form, headers={"origin": "http://127.0.0.1"})
    assert r.status_code == 303  # its own origin


async def test_an_action_on_a_filter_with_the_session(
    web: httpx.AsyncClient,
    db: str,  # noqa: F811
) -> None:
    r = await web.get("/flows/bulk", params={"action": "resume", "state": "blocked"})
    assert 'id="bulk-token"' in r.text  # no session yet: the token is asked
    await web.post("/flow/resume", data={"id": "done", "token": TOKEN})
    r = await web.get("/flows/bulk", params={"action": "resume", "state": "blocked"})
    assert 'id="bulk-token"' not in r.text
    form = {"action": "resume", "state": "blocked", "csrf": csrf_of(r.text)}
    r = await web.post("/flows/bulk", data=form)
    assert r.status_code == 200 and text_of(r.text, "bulk-done") == "Acted on 2 of 2 flows."
    assert [row(db, fid)[0].state for fid in ("blocked", "blocked-2")] == [
        flow.State.COMPENSATING
    ] * 2
