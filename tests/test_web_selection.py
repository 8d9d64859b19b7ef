"""Row selection for the console's bulk actions, in a real headless Chromium (issue 39):
ticking runs on the runs list (one by one or all of the page), live updates held while runs
are ticked, a confirmation that counts what the action will change, a reason, the action on
the selected runs only and one audit record counting them. Through Flask's client: the cap
on the ids one request takes, the CSRF token, a selection of no runs or of bad ids."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from typing import Any

from flask.testing import FlaskClient
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from runlane import Runlane, RunStatus
from runlane.web import create_app
from runlane.web._selection import SELECTION_LIMIT
from tests.test_web import browser, click, served, text, waiting
from tests.test_web_actions import audit_rows, flaky, rl
from tests.test_web_live import body_number

__all__ = ["browser", "rl"]  # fixtures, shared


def alice(request: Any, action: str) -> str:
    return "alice@example.com"


def boxes(driver: WebDriver) -> dict[str, Any]:
    return {
        str(box.get_attribute("value")): box
        for box in driver.find_elements(By.CSS_SELECTOR, "input.pick[name=run_id]")
    }


def test_selected_runs_are_retried_the_others_left_and_the_action_recorded(
    browser: WebDriver, rl: Runlane
) -> None:
    failed = [str(rl.trigger(flaky, {"n": n}, max_attempts=1).id) for n in range(3)]
    rl.drain()
    app = create_app(rl, authorize=alice)
    with served(app) as url:
        app.config["RUNLANE_REFRESH_SECONDS"] = 1  # served() set 600: read per request
        browser.get(f"{url}/runs?status=failed")
        assert set(boxes(browser)) == set(failed)
        # the select-all box ticks every row of the page, and clears them
        browser.find_element(By.ID, "pick-all").click()
        assert all(box.is_selected() for box in boxes(browser).values())
        browser.find_element(By.ID, "pick-all").click()
        assert not any(box.is_selected() for box in boxes(browser).values())
        # unticked, the list updates in place
        updates = body_number(browser, "data-updates")
        waiting(browser).until(lambda d: body_number(d, "data-updates") > updates)
        chosen, left = failed[:2], failed[2]
        for key in chosen:
            boxes(browser)[key].click()
        # while runs are ticked, the timer turns and nothing is swapped: the ticks stay
        updates = body_number(browser, "data-updates")
        ticks = body_number(browser, "data-ticks")
        waiting(browser).until(lambda d: body_number(d, "data-ticks") >= ticks + 3)
        assert body_number(browser, "data-updates") == updates
        ticked = {key for key, box in boxes(browser).items() if box.is_selected()}
        assert ticked == set(chosen)
        click(browser, "#selected-retry")
        assert "2 of the 2 selected runs are failed or cancelled" in text(browser, "#matched")
        assert set(text(browser, "#selected-ids").split()) == set(chosen)
        browser.find_element(By.ID, "selection-reason").send_keys("picked by hand")
        click(browser, "#confirm")
        assert "2 of 2 matching runs changed" in text(browser, "#bulk-result")
        rows = audit_rows(browser, url)
    assert {rl.get_run(key).status for key in chosen} == {RunStatus.QUEUED}
    assert rl.get_run(left).status is RunStatus.FAILED
    assert [(a, who.split(" (")[0], runs, why) for a, who, runs, why in rows] == [
        ("bulk_retry", "alice@example.com", "2", "picked by hand"),
    ]
    (record,) = rl.list_audit().items
    assert sorted(record.details["run_ids"]) == sorted(chosen)


def _token(client: FlaskClient, path: str) -> str:
    page = client.get(path).get_data(as_text=True)
    found = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert found is not None, "no CSRF token on " + path
    return found.group(1)


def test_the_cap_the_csrf_token_and_bad_selections(rl: Runlane) -> None:
    failed = [str(rl.trigger(flaky, {"n": n}, max_attempts=1).id) for n in range(2)]
    rl.drain()
    client = create_app(rl, authorize=alice).test_client()
    token = _token(client, f"/runs/{failed[0]}")
    too_many = [str(uuid.uuid4()) for _ in range(SELECTION_LIMIT + 1)]
    base = {"action": "retry", "csrf_token": token}
    # more ids than the cap: one line, on the confirmation and on the POST; nothing changed
    page = client.get("/runs/selected", query_string={"action": "retry", "run_id": too_many})
    assert page.status_code == 400
    assert f"101 runs are selected, more than {SELECTION_LIMIT}" in page.get_data(as_text=True)
    page = client.post("/runs/selected", data={**base, "run_id": too_many})
    assert page.status_code == 400
    assert "more than 100" in page.get_data(as_text=True)
    for bad, says in (([], "no runs are selected"), (["nope"], "is not a run id")):
        page = client.post("/runs/selected", data={**base, "run_id": bad})
        assert page.status_code == 400
        assert says in page.get_data(as_text=True)
    # without the CSRF token: refused before anything is read
    page = client.post("/runs/selected", data={"action": "retry", "run_id": failed})
    assert page.status_code == 403
    assert {rl.get_run(key).status for key in failed} == {RunStatus.FAILED}
    assert not rl.list_audit().items
    # with it, the two are retried
    page = client.post("/runs/selected", data={**base, "run_id": failed})
    assert page.status_code == 303
    assert "changed=2" in page.headers["Location"]
    assert {rl.get_run(key).status for key in failed} == {RunStatus.QUEUED}


def _help(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "runlane.cli", *argv], capture_output=True, text=True, check=True
    )
    return " ".join(done.stdout.split())


def test_runlane_web_says_what_it_serves_and_when_it_acts() -> None:
    listing, web = _help("--help"), _help("web", "--help")
    assert "serve the web console and /metrics" in listing
    assert "RUNLANE_WEB_TOKEN or RUNLANE_WEB_USER/RUNLANE_WEB_PASSWORD" in listing
    assert "/metrics in the Prometheus text format" in web
    assert "unless the environment gives it credentials: RUNLANE_WEB_TOKEN" in web
    assert "RUNLANE_WEB_USER and RUNLANE_WEB_PASSWORD" in web
