"""Failure triage in a real browser (headless Chromium, as tests/flow/test_dashboard_browser.py
drives it), against an SQLite file whose flows a real engine failed and blocked, and which that
engine still serves while the dashboard reads it.

The operator's way: the overview's "Failed and blocked, by error" shows the 30 flows whose
refunds to 30 accounts failed as one group (the account numbers folded); its count links to
the list of its flows, each row with its error; the list's "error holds" field, typed in
another case, finds the one flow of one account. Screenshots of the pages are written under the
test's tmp dir. Fails without the triage: the overview had no such group, the list no error
column and no field.
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ferry import flow
from ferry.flow._ops._dashboard._serve import open_dashboard, serve

from .test_dashboard_browser import WAIT, chrome, pytestmark  # noqa: F401  (the skip)

ACCOUNTS = 30

plan = flow.Plan("refund", version=1)


async def undo_charge(ctx: flow.Context) -> None:
    raise RuntimeError(f"refund to account {ctx.data['account']} failed: account closed")


@plan.step(compensate=undo_charge, attempts=1)
async def charge(ctx: flow.Context) -> None:
    return None


@plan.step(attempts=1)
async def ship(ctx: flow.Context) -> flow.Outcome | None:
    return flow.fail(f"carrier {ctx.data['account']} refused the parcel")


async def test_failure_triage_in_a_browser(tmp_path: Path) -> None:
    path = str(tmp_path / "flows.db")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    async with flow.open_engine(path, [plan]) as engine:
        ids = [f"order-{i:02d}" for i in range(ACCOUNTS)]
        for i, fid in enumerate(ids):
            await engine.start(plan, flow_id=fid, data={"account": 700_000 + i})
        for fid in ids:  # the ship fails, the charge's refund raises: BLOCKED
            snap = await engine.wait(fid, timeout=WAIT)
            assert snap.state is flow.State.BLOCKED, snap
        async with (
            trio.open_nursery() as nursery,
            open_dashboard(path, where="test store", is_dsn=False, token="t" * 32) as dash,
        ):
            url = await nursery.start(partial(serve, dash, host="127.0.0.1", port=0))
            with tempfile.TemporaryDirectory() as profile:
                await trio.to_thread.run_sync(partial(browse, url, profile, shots))
            nursery.cancel_scope.cancel()
    for name in ("overview-errors", "flows-error-group", "flows-error-field"):
        assert (shots / f"{name}.png").stat().st_size > 10_000, name


def browse(url: str, profile: str, shots: Path) -> None:
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chrome(profile)
    try:

        def follow(element: Any, expect: str) -> None:
            """Click `element` and wait for the next page, with an element matching `expect`."""
            old = driver.find_element(By.TAG_NAME, "html")
            element.click()

            def replaced(_driver: Any) -> bool:
                try:
                    old.is_enabled()
                except StaleElementReferenceException:
                    return True
                except WebDriverException as exc:  # Chromium's other word for it
                    if "does not belong to the document" not in str(exc):
                        raise
                    return True
                return False

            wait = WebDriverWait(driver, WAIT)
            wait.until(replaced)
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, expect))

        driver.get(url + "/")
        rows = driver.find_elements(By.CSS_SELECTOR, "#errors tr.error-group")
        assert len(rows) == 1, [r.text for r in rows]
        cells = rows[0].find_elements(By.TAG_NAME, "td")
        assert cells[0].text == str(ACCOUNTS) and cells[1].text == "BLOCKED"
        assert "RuntimeError('refund to account <n> failed: account closed')" in cells[2].text
        driver.execute_script("arguments[0].scrollIntoView()", rows[0])
        driver.save_screenshot(str(shots / "overview-errors.png"))

        follow(cells[0].find_element(By.TAG_NAME, "a"), "#flows")
        listed = driver.find_elements(By.CSS_SELECTOR, "#flows tr.flow")
        assert len(listed) == ACCOUNTS
        errors = [r.find_element(By.CSS_SELECTOR, "td.error-text") for r in listed]
        assert all("refund to account 7000" in e.text for e in errors)
        title = errors[0].get_attribute("title") or ""
        assert title.startswith("compensation of step 'charge' failed: RuntimeError(")
        driver.save_screenshot(str(shots / "flows-error-group.png"))

        field = driver.find_element(By.ID, "f-error")
        field.clear()
        field.send_keys("REFUND TO ACCOUNT 700007")
        follow(driver.find_element(By.ID, "f-go"), "#flows")
        ids = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#flows td.id")]
        assert ids == ["order-07"]
        driver.save_screenshot(str(shots / "flows-error-field.png"))
    finally:
        driver.quit()
