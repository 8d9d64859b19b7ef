"""The overview's one-hour chart reads the stats rollup (Runlane.stats), not runs, in a real
headless Chromium (issue 39): runs folded by maintenance are drawn with their counts, a run
finished but not folded yet is not, runs deleted after the fold stay counted (a scan of runs
would have lost them), and the overview links to the charts over time."""

from __future__ import annotations

from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from runlane import Runlane
from runlane.web import create_app
from runlane.web._present import CHART_HEIGHT
from tests.test_web import browser, click, served, text
from tests.test_web_charts import folded, ok

__all__ = ["browser", "folded"]  # fixtures, shared


def bar_heights(driver: WebDriver, kind: str) -> list[float]:
    found = driver.find_elements(By.CSS_SELECTOR, f"#throughput rect.{kind}")
    return [float(rect.get_attribute("height") or "0") for rect in found]


def test_the_overview_chart_draws_the_rollup_and_links_the_charts(
    browser: WebDriver, folded: Runlane
) -> None:
    # folded: 5 completed (4 in mail, 1 in default) and 1 failed, in one minute
    stats = folded.stats(bucket="1m")
    assert (stats.totals.completed, stats.totals.failed) == (5, 1)
    # finished after the fold, in a minute not folded yet: not drawn
    folded.trigger(ok, {"late": True})
    folded.drain()
    # deleted after the fold: still counted where the rollup counted it
    assert folded.delete_runs(task="charts.boom").changed == 1
    with served(create_app(folded)) as base:
        browser.get(base + "/")
        legend = text(browser, "section[data-live=throughput] .legend")
        assert "completed 5" in legend
        assert "failed 1" in legend
        assert "peak 6 a minute" in legend
        # one minute's bar: completed 5 of a peak of 6, failed 1 on top of it
        assert bar_heights(browser, "completed") == [round(CHART_HEIGHT * 5 / 6, 2)]
        assert bar_heights(browser, "failed") == [round(CHART_HEIGHT * 1 / 6, 2)]
        click(browser, "#over-time-link")
        assert browser.current_url.startswith(base + "/charts")
