"""The console's charts over time (issue 39) in a real headless Chromium: known runs go
through a real worker, maintenance folds them into the rollup, and ``/charts`` draws what
they were (per queue and task, over 1 h / 24 h / 7 d) as inline SVG under the console's CSP.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from runlane import RetryPolicy, RunContext, Runlane, queue, task
from runlane.testing import MovableClock
from runlane.web import create_app
from runlane.web._charts import CHART_HEIGHT, line_chart
from tests.conftest import RunlaneFactory
from tests.test_web import browser, click, served, shot, text, waiting  # noqa: F401 - browser: a fixture

STROKE = (
    "return getComputedStyle(document.querySelector("
    "'#throughput g[data-line=completed] polyline')).stroke"
)
ONCE = RetryPolicy(max_attempts=1, initial_delay=timedelta(0))


@task(id="charts.ok")
def ok(payload: Any, context: RunContext) -> Any:
    return payload


@task(id="charts.boom", retry=ONCE)
def boom(payload: Any, context: RunContext) -> None:
    raise RuntimeError("boom")


@pytest.fixture
def folded(make_runlane: RunlaneFactory, clock: MovableClock) -> Runlane:
    """In queue mail: 4 charts.ok runs that completed and 1 charts.boom that failed, each
    waiting 30 s from due to start; in queue default one more completed run. Folded."""
    rl = make_runlane(queues=[queue("default", default=True), queue("mail")], tasks=[ok, boom])
    rl.trigger_many(ok, [{"n": n} for n in range(4)], queue="mail")
    rl.trigger(boom, None, queue="mail")
    rl.trigger(ok, {"elsewhere": True})
    clock.advance(30)
    rl.drain()
    clock.advance(60)
    rl.run_maintenance_once()
    return rl


def legend(driver: WebDriver, chart: str) -> dict[str, str]:
    found = driver.find_elements(By.CSS_SELECTOR, f"#{chart}-legend b[data-line]")
    return {str(b.get_attribute("data-line")): str(b.text) for b in found}


def circles(driver: WebDriver, chart: str, line: str) -> list[Any]:
    return list(driver.find_elements(By.CSS_SELECTOR, f"#{chart} g[data-line={line}] circle"))


def seconds(shown: str) -> float:
    match = re.fullmatch(r"([0-9.,]+) s", shown)
    assert match, shown
    return float(match[1].replace(",", ""))


def test_charts_draw_known_runs_per_queue_task_and_range(
    browser: WebDriver,  # noqa: F811 - the fixture imported above
    folded: Runlane,
) -> None:
    with served(create_app(folded)) as base:
        browser.get(base + "/charts?queue=mail")
        assert browser.execute_script("return window.__xss") is None
        assert "Over time · queue mail" in text(browser, "h1")
        assert legend(browser, "throughput") == {
            "completed": "4 runs",
            "failed": "1 run",
            "retried": "0 runs",
            "cancelled": "0 runs",
            "triggered": "5 runs",
        }
        # an hour of one-minute buckets (and the minute now begun); one point each
        completed = circles(browser, "throughput", "completed")
        assert len(completed) in {60, 61}
        peak = [c for c in completed if c.get_attribute("cy") != str(float(CHART_HEIGHT))]
        assert len(peak) == 1
        # the chart's top is 5 (the next 1-2-5 step above 4): 4 runs sit at 4/5 of its height
        assert float(str(peak[0].get_attribute("cy"))) == CHART_HEIGHT - CHART_HEIGHT * 4 / 5
        tooltip = peak[0].find_element(By.TAG_NAME, "title").get_attribute("textContent")
        assert str(tooltip).endswith("UTC: completed 4 runs")
        # wait: the 30 s the clock moved (interpolated within its bucket, 22.6 s to 32.8 s)
        waits = legend(browser, "wait")
        assert set(waits) == {"p50", "p95", "p99"}
        for shown in waits.values():
            assert 22.6 <= seconds(shown) <= 32.8, waits
        # a bucket without finished runs has no wait: one point, not a line down to zero
        assert len(circles(browser, "wait", "p50")) == 1
        assert seconds(legend(browser, "run-time")["p99"]) < 16
        # the stylesheet of the charts loaded under the CSP (no inline style, no script)
        assert browser.execute_script(STROKE) == "rgb(46, 139, 87)"
        shot(browser, "charts")
        # dark mode: the lines take console.css's dark colours
        dark = {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia", dark)
        try:
            assert browser.execute_script(STROKE) == "rgb(79, 191, 132)"
        finally:
            browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})

        # 24 h in 15-minute buckets, 7 d in hours: the same runs, the same totals
        click(browser, "#range-24h")
        assert "range=24h" in browser.current_url
        assert "queue=mail" in browser.current_url
        assert len(circles(browser, "throughput", "completed")) in {96, 97}
        assert legend(browser, "throughput")["completed"] == "4 runs"
        click(browser, "#range-7d")
        assert len(circles(browser, "throughput", "completed")) in {168, 169}
        assert legend(browser, "throughput")["failed"] == "1 run"

        # per task, and every queue
        browser.get(base + "/charts?task=charts.ok&range=1h")
        assert legend(browser, "throughput")["completed"] == "5 runs"
        assert legend(browser, "throughput")["failed"] == "0 runs"
        browser.get(base + "/charts?queue=default")
        assert legend(browser, "throughput")["completed"] == "1 run"
        assert legend(browser, "wait")["p50"] != "-"

        # at 420 px the page does not scroll sideways: the charts scale to the width
        narrow = {"width": 420, "height": 900, "deviceScaleFactor": 1, "mobile": True}
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", narrow)
        try:
            browser.get(base + "/charts?queue=mail")
            widths = browser.execute_script(
                "return [document.documentElement.scrollWidth, window.innerWidth,"
                " document.getElementById('throughput').getBoundingClientRect().width]"
            )
            assert widths[0] <= widths[1] == 420, widths
            assert 300 < widths[2] <= 420, widths
        finally:
            browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})

        # a range that is not one is a clear 400 page
        browser.get(base + "/charts?range=2y")
        assert "range '2y' is not one of 1h, 24h, 7d" in text(browser)


def test_the_charts_update_in_place(
    browser: WebDriver,  # noqa: F811 - the fixture imported above
    folded: Runlane,
    clock: MovableClock,
) -> None:
    app = create_app(folded)
    with served(app) as base:
        app.config["RUNLANE_REFRESH_SECONDS"] = 1  # served() set 600: read per request
        browser.get(base + "/charts?queue=mail")
        browser.execute_script("window.localStorage.clear()")  # live updates not paused
        browser.get(base + "/charts?queue=mail")
        browser.execute_script("window.__same_document = true")  # a reload would drop it
        assert legend(browser, "throughput")["completed"] == "4 runs"
        folded.trigger_many(ok, [{"more": n} for n in range(3)], queue="mail")
        folded.drain(queues=["mail"])
        clock.advance(60)
        folded.run_maintenance_once()
        waiting(browser).until(
            lambda driver: legend(driver, "throughput").get("completed") == "7 runs"
        )
        assert browser.execute_script("return window.__same_document") is True


def test_a_line_breaks_where_a_bucket_has_no_value() -> None:
    from datetime import UTC, datetime  # noqa: PLC0415

    starts = [datetime(2026, 1, 1, 0, m, tzinfo=UTC) for m in range(4)]
    chart = line_chart("c", starts, [("p50", [1.0, None, 2.0, 3.0], 2.0)], unit="s")
    (line,) = chart.lines
    assert chart.top == 5.0
    assert len(line.segments) == 2
    assert line.points[0].label == "2026-01-01 00:00 UTC: p50 1 s"
    assert line.legend == "2 s"
