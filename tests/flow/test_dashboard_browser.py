"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``make test`` installs) driven by selenium, against a live PostgreSQL
fleet engine with flows in every state.

One test, in the order an operator would go: the overview's counts and chart (the last hour,
then 24 h); the flows list, its count, filtered by BLOCKED, and the confirmation page of an
abandon on that filter; a blocked flow's history; resume without the token, with a wrong one,
and on a read-only dashboard (each changes nothing); resume with the token, which starts a
session (an HttpOnly, SameSite=Strict cookie no script can read), after which the serving
engine takes the flow over and the page shows it COMPLETED; an abandon of the other blocked
flow through the session (no token asked); a page of no flow; a parent's page listing its
children with their states, and the links from it to a child and back; a flow whose id and data
hold markup shown as text, with no script run. Every page is photographed under the test's tmp dir
at 1280 px, and at 1400 px and 420 px in the light and the dark scheme, each checked to fit its
width with ids not cut one letter per line (``DASHBOARD_SHOTS=DIR`` copies them to DIR; the
ones in docs/img/ were copied from there).

The browser is blocking: it runs in a worker thread (`trio.to_thread`) while the engines and the
dashboards serve on the test's trio loop; it reads the store through `trio.from_thread`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from ferry import flow
from ferry.flow._ops._dashboard._serve import open_dashboard, serve
from ferry.projected import PostgresStore
from tests import pg

CHROMEDRIVER = "/usr/bin/chromedriver"
_missing = [p for p in ("chromium", "chromedriver") if shutil.which(p) is None]
pytestmark = pytest.mark.skipif(
    bool(_missing),
    reason=f"{' and '.join(_missing)} not installed: the browser test needs Debian's chromium"
    " and chromium-driver (make browser installs them: apt-get install chromium chromium-driver)",
)

TOKEN = "browser-test-token-0123456789abcdef"
XSS = "<img src=x onerror=alert(1)>"
WAIT = 20.0  # the longest any page state is waited for (a loaded machine)

order = flow.Plan("order", version=1)
other = flow.Plan("other", version=1)
hang = trio.Event()  # never set: a step or compensation that waits on it stays in flight
reached: dict[str, trio.Event] = {}


def _reach(ctx: flow.Context) -> None:
    reached.setdefault(ctx.flow_id, trio.Event()).set()


async def undo_reserve(ctx: flow.Context) -> None:
    if ctx.data.get("stuck_undo"):
        _reach(ctx)
        await hang.wait()


@order.step(compensate=undo_reserve)
async def reserve(ctx: flow.Context) -> flow.Outcome | None:
    if ctx.data.get("stuck"):
        _reach(ctx)
        await hang.wait()
    if ctx.data.get("no_stock"):
        return flow.fail("no stock")
    return None


@order.step
async def pay(ctx: flow.Context) -> flow.Outcome | None:
    if ctx.data.get("prepaid"):
        return None
    if ctx.data.get("declined"):
        return flow.fail("card declined")
    return flow.park(timeout=3600 if ctx.data.get("deadline") else None)


@order.step
async def ship(ctx: flow.Context) -> None:
    ctx.data["shipped"] = True
    ctx.data["paid_with"] = ctx.wake


@other.step
async def noop(ctx: flow.Context) -> None:
    return None


kid = flow.Plan("kid", version=1)
boxes = flow.Plan("ship", version=1)


@kid.step
async def pack(ctx: flow.Context) -> flow.Outcome | None:
    return flow.park() if ctx.data.get("park") else None


@boxes.step
async def ship_all(ctx: flow.Context) -> flow.Outcome:
    return flow.spawn([flow.Child(kid, key="k0"), flow.Child(kid, key="k1", data={"park": 1})])


@boxes.step
async def shipped(ctx: flow.Context) -> None:
    return None


async def until(engine: flow.Engine, fid: str, state: flow.State) -> None:
    """Until the flow is in `state` (read from the store; a few reads, at most `WAIT`)."""
    with trio.fail_after(WAIT):
        while True:
            snap = await engine.get(fid)
            if snap is not None and snap.state is state:
                return
            await trio.sleep(0.02)


def chrome(profile: str) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        "--window-size=1280,1100",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(arg)
    opts.binary_location = shutil.which("chromium") or "chromium"
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


async def test_the_dashboard_in_a_browser(pg_server: pg.PgServer, tmp_path: Path) -> None:
    reached.clear()  # (a second run in one process starts afresh)
    dsn = pg_server.fresh_schema_dsn()
    shots = tmp_path / "screenshots"
    shots.mkdir()
    async with (
        PostgresStore(dsn, connections=4) as store,
        PostgresStore(dsn, connections=2) as store2,
    ):
        async with flow.open_engine(store, [order, boxes, kid], owner="svc", lease=1.5) as svc:
            # Flows in every state, and a parent waiting for a parked child (the other done).
            await svc.start(boxes, flow_id="ship-7")
            await svc.start(order, flow_id="done", data={"prepaid": True})
            await svc.start(order, flow_id="failed", data={"no_stock": True})
            await svc.start(order, flow_id="running", data={"stuck": True})
            await svc.start(order, flow_id="compensating", data={"declined": True, "stuck_undo": 1})
            await svc.start(order, flow_id="parked", data={"deadline": True})
            await svc.start(order, flow_id=XSS, data={"note": "</pre><script>alert(2)</script>"})
            for fid in ("blocked-1", "blocked-2"):
                await svc.start(order, flow_id=fid, data={"sku": "A1"})
            for fid in ("done", "failed"):
                await svc.wait(fid, timeout=WAIT)
            for fid in ("parked", XSS, "blocked-1", "blocked-2", "ship-7/0/k1"):
                await until(svc, fid, flow.State.PARKED)
            await until(svc, "ship-7/0/k0", flow.State.COMPLETED)
            for fid in ("running", "compensating"):
                reached.setdefault(fid, trio.Event())
                with trio.fail_after(WAIT):
                    await reached[fid].wait()
        # The serving engine is down for a deploy, and an engine without the order plan takes
        # the payments: no live engine can drive those flows, which block with the payment
        # kept in their mailboxes.
        async with flow.open_engine(store2, [other], owner="legacy", lease=1.5) as legacy:
            for fid in ("blocked-1", "blocked-2"):
                paid = await legacy.wake(fid, {"card": "visa"}, message_id=f"pay-{fid}")
                assert paid is flow.Delivery.QUEUED
                assert (await legacy.get(fid)).state is flow.State.BLOCKED  # type: ignore[union-attr]
        # The serving engine is back (the same owner name: it closed cleanly, so it takes its
        # flows over at once); the running and compensating flows run again and hang again.
        async with (
            flow.open_engine(store, [order, boxes, kid], owner="svc", lease=1.5) as svc,
            trio.open_nursery() as nursery,
        ):
            where = "test store"
            async with (
                open_dashboard(dsn, where=where, is_dsn=True, token=TOKEN) as dash,
                open_dashboard(dsn, where=where, is_dsn=True, token=TOKEN, read_only=True) as ro,
            ):
                url = await nursery.start(partial(serve, dash, host="127.0.0.1", port=0))
                ro_url = await nursery.start(partial(serve, ro, host="127.0.0.1", port=0))

                def state_of(fid: str) -> tuple[flow.State, int]:
                    snap = trio.from_thread.run(svc.get, fid)
                    assert snap is not None
                    return snap.state, snap.revision

                with tempfile.TemporaryDirectory() as profile:
                    await trio.to_thread.run_sync(
                        partial(browse, url, ro_url, profile, shots, state_of)
                    )
                nursery.cancel_scope.cancel()
    pages = (
        "overview",
        "overview-24h",
        "flows",
        "flows-blocked",
        "bulk-confirm",
        "flow-blocked",
        "flow-completed",
        "flow-abandoned",
        "missing",
        "flow-parent",
        "flow-markup",
    )
    for name in pages:
        assert (shots / f"{name}.png").stat().st_size > 10_000, name
        for width in (1400, 420):
            for scheme in ("light", "dark"):
                assert (shots / f"{name}-{width}-{scheme}.png").stat().st_size > 5_000, name
    if os.environ.get("DASHBOARD_SHOTS"):  # where to keep them (to look at, or for the docs)
        shutil.copytree(shots, os.environ["DASHBOARD_SHOTS"], dirs_exist_ok=True)


def browse(
    url: str,
    ro_url: str,
    profile: str,
    shots: Path,
    state_of: Callable[[str], tuple[flow.State, int]],
) -> None:
    from selenium.common.exceptions import (
        NoAlertPresentException,
        StaleElementReferenceException,
        WebDriverException,
    )
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    def staleness_of(old: Any) -> Callable[[Any], bool]:
        """Has the page `old` belongs to been replaced? As selenium's condition of that name,
        but Chromium sometimes reports a node of the replaced document as one that "does not
        belong to the document" (an unknown error) rather than as a stale element."""

        def replaced(_driver: Any) -> bool:
            try:
                old.is_enabled()
            except StaleElementReferenceException:
                return True
            except WebDriverException as exc:
                if "does not belong to the document" not in str(exc):
                    raise
                return True
            return False

        return replaced

    driver = chrome(profile)
    try:

        def text(css: str) -> str:
            return str(driver.find_element(By.CSS_SELECTOR, css).text)

        def shot(name: str) -> None:
            """The page at 1400 px and 420 px wide, light and dark (``name-1400-dark.png``
            ...), and ``name.png`` as it is (1280 px, light), each checked by `layout`."""
            driver.save_screenshot(str(shots / f"{name}.png"))
            layout(driver.execute_script("return window.innerWidth"), "light")
            for width in (1400, 420):
                driver.execute_cdp_cmd(
                    "Emulation.setDeviceMetricsOverride",
                    {"width": width, "height": 1100, "deviceScaleFactor": 1, "mobile": False},
                )
                for scheme in ("light", "dark"):
                    driver.execute_cdp_cmd(
                        "Emulation.setEmulatedMedia",
                        {"features": [{"name": "prefers-color-scheme", "value": scheme}]},
                    )
                    driver.save_screenshot(str(shots / f"{name}-{width}-{scheme}.png"))
                    layout(width, scheme)
            driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
            driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})

        def layout(width: int, scheme: str) -> None:
            """The page fits its width (a wide table scrolls inside itself), no id is cut one
            letter per line, and the colours are the scheme's."""
            wide = driver.execute_script("return document.documentElement.scrollWidth")
            assert wide <= width, (driver.current_url, width, wide)
            for cell in driver.find_elements(By.CSS_SELECTOR, "td.id, #flow-id")[:5]:
                assert cell.size["width"] >= 60, (driver.current_url, width, cell.size)
            bg = driver.execute_script("return getComputedStyle(document.body).backgroundColor")
            assert bg == ("rgb(20, 23, 30)" if scheme == "dark" else "rgb(246, 247, 250)"), bg

        def follow(element: Any, expect: str) -> None:
            """Click `element` (a link or a submit button) and wait for the next page, which
            has an element matching the CSS selector `expect`."""
            old = driver.find_element(By.TAG_NAME, "html")
            element.click()
            wait = WebDriverWait(driver, WAIT)
            wait.until(staleness_of(old))
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, expect))

        # The overview: the counts of the store.
        driver.get(url + "/")
        counts = {s.name: int(text(f"#count-{s.name} .n")) for s in flow.State}
        assert counts == {  # (with the family: its parent and child parked, a child completed)
            "RUNNING": 1,
            "PARKED": 4,
            "COMPENSATING": 1,
            "COMPLETED": 2,
            "FAILED": 1,
            "BLOCKED": 2,
            "QUEUED": 0,  # flow control's state (SPEC 5.8)
        }
        assert driver.find_elements(By.CSS_SELECTOR, "svg.chart polyline")
        assert driver.find_elements(By.CSS_SELECTOR, "svg.chart text.tick.x")
        shot("overview")
        follow(driver.find_element(By.ID, "span-24h"), "#span-24h")
        assert text("strong#span-24h") == "24h"
        shot("overview-24h")

        # The flows list, filtered by BLOCKED: exactly the blocked flows.
        follow(driver.find_element(By.LINK_TEXT, "Flows"), "#filters")
        Select(driver.find_element(By.ID, "f-state")).select_by_value("BLOCKED")
        follow(driver.find_element(By.ID, "f-go"), "#flows")
        ids = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#flows td.id")]
        assert sorted(ids) == ["blocked-1", "blocked-2"]
        assert text("#matches") == "2 flows match"
        shot("flows-blocked")
        driver.get(url + "/flows")
        shot("flows")
        # An action on the filter asks first, with the count (not done here).
        driver.get(url + "/flows?state=BLOCKED")
        follow(driver.find_element(By.ID, "bulk-abandon"), "#bulk-count")
        assert text("#bulk-count") == "2 flows match."
        shot("bulk-confirm")
        follow(driver.find_element(By.LINK_TEXT, "Flows"), "#filters")

        # A blocked flow: its history, and why it is blocked.
        follow(driver.find_element(By.LINK_TEXT, "blocked-1"), "#history")
        kinds = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#history .kind")]
        assert kinds[:2] == ["started", "step"] and kinds[-2:] == ["parked", "blocked"], kinds
        assert "plan" in text("#error") and text("#state") == "BLOCKED"
        assert "pay-blocked-1" in text("#mailbox")
        shot("flow-blocked")
        page = driver.current_url
        before = state_of("blocked-1")

        # Resume without the token, then with a wrong one: refused, nothing changed.
        for token, why in (("", "no token"), ("not-the-token-at-all", "wrong token")):
            driver.get(page)
            if token:
                driver.find_element(By.ID, "resume-token").send_keys(token)
            follow(driver.find_element(By.ID, "resume"), "#problem")
            assert why in text("#problem")
            assert state_of("blocked-1") == before

        # Read-only: no buttons; a POST with the right token (made by hand) is refused.
        driver.get(ro_url + "/flow?id=blocked-1")
        assert not driver.find_elements(By.ID, "resume")
        assert driver.find_elements(By.ID, "no-actions")
        old = driver.find_element(By.TAG_NAME, "html")
        driver.execute_script(
            "const f = document.createElement('form'); f.method = 'post';"
            " f.action = '/flow/resume';"
            " for (const [k, v] of [['id', 'blocked-1'], ['token', arguments[0]]]) {"
            "   const i = document.createElement('input'); i.name = k; i.value = v;"
            "   f.appendChild(i); }"
            " document.body.appendChild(f); f.submit();",
            TOKEN,
        )
        WebDriverWait(driver, WAIT).until(staleness_of(old))
        WebDriverWait(driver, WAIT).until(lambda d: d.find_elements(By.ID, "problem"))
        assert "read-only" in text("#problem")
        assert state_of("blocked-1") == before

        # With the token: resumed by the serving engine (a request it applies), which runs it
        # on and completes it; the banner says so.
        driver.get(page)
        driver.find_element(By.ID, "resume-token").send_keys(TOKEN)
        follow(driver.find_element(By.ID, "resume"), "#notice")
        assert text("#notice") == (
            "resumed; accepted and applied by the engine serving the store, which runs what"
            " follows now"
        )

        def completed(d: Any) -> bool:
            d.refresh()
            return text("#state") == "COMPLETED"

        # The token was asked once: the cookie cannot be read by a script, is sent to this
        # site only, and the forms now carry the session's CSRF token instead.
        (cookie,) = driver.get_cookies()
        assert cookie["name"] == "ferry_flow_session", cookie
        assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict", cookie
        assert driver.execute_script("return document.cookie") == ""

        WebDriverWait(driver, WAIT, poll_frequency=0.2).until(completed)
        kinds = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#history .kind")]
        assert kinds[-4:] == ["resumed", "woken", "step", "completed"], kinds
        assert '"card": "visa"' in text("#data")
        shot("flow-completed")

        # Abandon the other blocked flow, with the session: no token asked, a reason is.
        driver.get(url + "/flow?id=blocked-2")
        assert not driver.find_elements(By.ID, "abandon-token")
        assert driver.find_elements(By.ID, "signed-in")
        driver.find_element(By.ID, "abandon-reason").send_keys("paid back by hand")
        follow(driver.find_element(By.ID, "abandon"), "#notice")
        assert text("#notice").startswith("abandoned") and text("#state") == "FAILED"
        kinds = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#history .kind")]
        assert kinds[-2:] == ["abandoned", "failed"], kinds
        shot("flow-abandoned")
        driver.get(url + "/flow?id=nothing-has-this-id")
        shot("missing")

        # A parent's page lists its children with their states; links go both ways.
        driver.get(url + "/flow?id=ship-7")
        rows = [
            (
                r.find_element(By.CSS_SELECTOR, "td").text,
                r.find_element(By.CSS_SELECTOR, ".badge").text,
            )
            for r in driver.find_elements(By.CSS_SELECTOR, "tr.child")
        ]
        assert rows == [("k0", "COMPLETED"), ("k1", "PARKED")], rows
        assert "1 active, 1 ended, 0 kept" in text("#spawn-0")
        shot("flow-parent")
        follow(driver.find_element(By.LINK_TEXT, "ship-7/0/k1"), "#parent")
        assert text("#state") == "PARKED" and text("#parent a") == "ship-7"
        follow(driver.find_element(By.CSS_SELECTOR, "#parent a"), "#spawn-0")
        assert text("#flow-id") == "ship-7"

        # Markup in an id and in data is text; no script runs.
        driver.get(url + "/flows?id_prefix=%3C")
        assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#flows td.id")] == [XSS]
        follow(driver.find_element(By.LINK_TEXT, XSS), "#flow-id")
        assert text("#flow-id") == XSS
        assert "</pre><script>alert(2)</script>" in text("#data")
        assert driver.find_elements(By.TAG_NAME, "img") == []
        assert driver.execute_script("return document.scripts.length") == 0
        try:
            alert = driver.switch_to.alert
        except NoAlertPresentException:
            pass
        else:
            raise AssertionError(f"a script ran: an alert says {alert.text!r}")
        shot("flow-markup")
    finally:
        driver.quit()
