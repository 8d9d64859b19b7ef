"""The console's pages in a real headless Chromium (Debian's chromium and chromium-driver
through Selenium; nothing downloaded), issue 39: tables and counts update in place without
a reload, the pause toggle stops that, dark mode follows prefers-color-scheme, and at 420 px
no page scrolls sideways (wide tables scroll inside their own box). With
``RUNLANE_SCREENSHOTS=1`` the run writes screenshots to docs/images/console-*.png."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from runlane import RunContext, Runlane, queue, task
from runlane.web import create_app
from tests.conftest import RunlaneFactory
from tests.test_web import IMAGES, browser, everyone, served, waiting

__all__ = ["browser"]  # the module's Chromium (tests/test_web.py's fixture)


@task(id="live.job")
def job(payload: Any, context: RunContext) -> Any:
    return payload


@pytest.fixture
def live(make_runlane: RunlaneFactory) -> Runlane:
    rl = make_runlane(queues=[queue("default", default=True), queue("live")], tasks=[job])
    rl.trigger(job, {"n": 0}, queue="live")
    return rl


@pytest.fixture
def page_of(live: Runlane, browser: WebDriver) -> Iterator[tuple[str, Any]]:
    """The console served with pages that update every second, and its app."""
    app = create_app(live, authorize=everyone)
    with served(app) as base:
        app.config["RUNLANE_REFRESH_SECONDS"] = 1  # served() set 600: pages read it per request
        yield base, app
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})


def body_number(driver: WebDriver, name: str) -> int:
    return int(driver.find_element(By.TAG_NAME, "body").get_attribute(name) or "0")


def rows(driver: WebDriver) -> int:
    return len(driver.find_elements(By.CSS_SELECTOR, "table.runs tbody tr[data-run]"))


def shot(driver: WebDriver, name: str) -> None:
    if os.environ.get("RUNLANE_SCREENSHOTS") == "1":
        IMAGES.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(IMAGES / f"console-{name}.png"))


def test_a_page_updates_in_place_and_the_pause_toggle_stops_it(
    browser: WebDriver, live: Runlane, page_of: tuple[str, Any]
) -> None:
    base, _ = page_of
    browser.get(base + "/runs?queue=live")
    browser.execute_script("window.localStorage.clear()")
    browser.get(base + "/runs?queue=live")
    assert rows(browser) == 1
    # a mark on this document: a reload would make a new one without it
    browser.execute_script("window.__same_document = true")
    assert "updates in place every 1 second" in browser.find_element(By.ID, "live-state").text

    live.trigger(job, {"n": 1}, queue="live")
    waiting(browser).until(lambda d: rows(d) == 2)
    assert browser.execute_script("return window.__same_document") is True

    # the overview's counts too: a card changes without a reload
    browser.get(base + "/")
    browser.execute_script("window.__same_document = true")
    cards = browser.find_element(By.CSS_SELECTOR, "[data-live=cards]").text
    assert "2\nqueued and due" in cards
    live.trigger(job, {"n": 2}, queue="live")
    waiting(browser).until(
        lambda d: "3\nqueued and due" in d.find_element(By.CSS_SELECTOR, "[data-live=cards]").text
    )
    assert browser.execute_script("return window.__same_document") is True

    # paused: the timer still turns, the page is not fetched and does not change
    browser.get(base + "/runs?queue=live")
    toggle = browser.find_element(By.ID, "live-toggle")
    assert toggle.text == "Pause live updates"
    toggle.click()
    assert toggle.text == "Resume live updates"
    assert browser.find_element(By.ID, "live-state").text == "Live updates are paused."
    shown = rows(browser)
    updates = body_number(browser, "data-updates")
    ticks = body_number(browser, "data-ticks")
    live.trigger(job, {"n": 3}, queue="live")
    waiting(browser).until(lambda d: body_number(d, "data-ticks") >= ticks + 3)
    assert rows(browser) == shown
    assert body_number(browser, "data-updates") == updates
    # the pause is remembered by this browser: a new page starts paused
    browser.get(base + "/runs?queue=live")
    assert browser.find_element(By.ID, "live-toggle").text == "Resume live updates"
    assert rows(browser) == shown + 1  # the reload itself shows the new run
    # resumed, it updates again
    browser.find_element(By.ID, "live-toggle").click()
    live.trigger(job, {"n": 4}, queue="live")
    waiting(browser).until(lambda d: rows(d) == shown + 2)


def test_dark_mode_follows_the_system(
    browser: WebDriver, live: Runlane, page_of: tuple[str, Any]
) -> None:
    base, _ = page_of

    def colors() -> tuple[str, str]:
        return tuple(
            browser.execute_script(
                "return [getComputedStyle(document.body).backgroundColor,"
                " getComputedStyle(document.querySelector('table')).backgroundColor]"
            )
        )

    browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "light"}]},
    )
    browser.get(base + "/runs")
    assert colors() == ("rgb(247, 248, 250)", "rgb(255, 255, 255)")
    browser.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
    )
    browser.get(base + "/runs")
    assert colors() == ("rgb(18, 22, 30)", "rgb(26, 31, 42)")
    text_color = browser.execute_script("return getComputedStyle(document.body).color")
    assert text_color == "rgb(227, 231, 239)"
    browser.set_window_size(1100, 700)
    shot(browser, "dark")
    browser.set_window_size(1400, 1000)


def test_at_420_px_no_page_scrolls_sideways(
    browser: WebDriver, live: Runlane, page_of: tuple[str, Any]
) -> None:
    base, _ = page_of
    run_id = live.list_runs(queue="live").runs[0].id
    worker = live.create_delivery_worker(concurrency=1, queues=["default"])
    try:
        browser.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": 420, "height": 900, "deviceScaleFactor": 1, "mobile": True},
        )
        for path in ("/", "/runs", f"/runs/{run_id}", "/queues", "/workers", "/schedules"):
            browser.get(base + path)
            page_width = browser.execute_script(
                "return [document.documentElement.scrollWidth, window.innerWidth]"
            )
            assert page_width[0] <= page_width[1] == 420, (path, page_width)
            # the wide tables are inside a box that scrolls, not crushed to 420 px
            boxes = browser.execute_script(
                "return Array.from(document.querySelectorAll('.scroll')).map("
                "b => [b.scrollWidth, b.clientWidth, b.firstElementChild.offsetWidth])"
            )
            assert boxes, path
            for scroll_width, client_width, table_width in boxes:
                assert client_width <= 420 - 2 * 12
                assert table_width >= 640  # the table keeps a readable width and scrolls
                assert scroll_width > client_width
            if path == "/runs":
                shot(browser, "narrow")
    finally:
        worker.close(timeout=5)
