"""The console's new actions in a real headless Chromium (issue 39): ``runlane web`` acting
only after its token login, run now and reschedule of delayed and retrying runs, delete of a
terminal run, the confirmation before cancelling a running run, and each action's record
on the audit page, named by the identity authorize returned. Basic auth, read-only without
credentials, and the environment's bad credentials, through Flask's client and the CLI."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg import sql
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from runlane import RetryPolicy, RunContext, Runlane, RunStatus, queue, task
from runlane.web import create_app, environment_login
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, closed_port, poll
from tests.test_web import browser, click, served, shot, text

__all__ = ["browser"]  # the module's browser fixture, shared

TOKEN = "s3cret-token-for-the-console"
LATER = RetryPolicy(
    max_attempts=3, initial_delay=timedelta(hours=1), max_delay=timedelta(hours=1), jitter=0
)


@task(id="webact.ok")
def ok(payload: Any, context: RunContext) -> str:
    return "done"


@task(id="webact.flaky", retry=LATER)
def flaky(payload: Any, context: RunContext) -> None:
    raise RuntimeError("later")


@pytest.fixture
def rl(make_runlane: RunlaneFactory) -> Runlane:
    return make_runlane(tasks=[ok, flaky], queues=[queue("default", default=True)])


@pytest.fixture
def web_command(database_url: str, schema: str, tmp_path: Any) -> Iterator[str]:
    """``runlane web --database-url ... --bind`` with RUNLANE_WEB_TOKEN set; its base URL."""
    port = closed_port()
    env = {**os.environ, "RUNLANE_WEB_TOKEN": TOKEN}
    argv = [sys.executable, "-m", "runlane.cli", "web", "--database-url", database_url]
    argv += ["--schema", schema, "--bind", f"127.0.0.1:{port}", "--threads", "4"]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(url + "/audit", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return proc.poll() is not None

    try:
        assert poll(up, timeout=30)
        assert proc.poll() is None, "runlane web exited"
        assert proc.stdout is not None
        assert "acts for a browser that logs in at /login" in proc.stdout.readline()
        yield url
    finally:
        proc.terminate()
        proc.wait(15)
        if proc.stdout is not None:
            proc.stdout.close()


def mark_running(db: Conn, schema: str, run_id: Any) -> None:
    db.execute(
        sql.SQL(
            "update {}.runs set status = 'running', attempt = 1, lease_token = gen_random_uuid(), "
            "lease_expires_at = now() + interval '10 minutes' where id = %s"
        ).format(sql.Identifier(schema)),
        (run_id,),
    )


def audit_rows(driver: WebDriver, url: str) -> list[tuple[str, str, str, str]]:
    driver.get(url + "/audit")
    return [
        (
            row.get_attribute("data-action") or "",
            row.find_element(By.CSS_SELECTOR, ".audit-who").text,
            row.find_element(By.CSS_SELECTOR, ".audit-runs").text,
            row.find_element(By.CSS_SELECTOR, ".audit-reason").text,
        )
        for row in driver.find_elements(By.CSS_SELECTOR, "tr.audit-row")
    ]


def test_runlane_web_acts_after_its_token_login_and_records_who(
    browser: WebDriver, web_command: str, rl: Runlane, db: Conn, schema: str
) -> None:
    url = web_command
    delayed = rl.trigger(ok, {}, delay=timedelta(hours=2)).id
    retrying = rl.trigger(flaky, {}).id
    rl.drain()
    assert rl.get_run(retrying).status is RunStatus.RETRYING
    done = rl.trigger(ok, {}).id
    rl.drain()
    running = rl.trigger(ok, {}, delay=timedelta(hours=5)).id
    mark_running(db, schema, running)

    browser.delete_all_cookies()
    browser.get(f"{url}/runs/{delayed}")
    assert "log in to act" in text(browser, "header")
    assert not browser.find_elements(By.ID, "run-now")  # read-only without the login
    click(browser, "#login-link")
    shot(browser, "login")
    browser.find_element(By.ID, "login-token").send_keys("not-the-token")
    click(browser, "#login-submit")
    assert "not this console's" in text(browser, "#login-failed")
    browser.find_element(By.ID, "login-token").send_keys(TOKEN)
    click(browser, "#login-submit")
    assert text(browser, "#identity") == "token"

    # run now: a delayed run is due at once
    browser.get(f"{url}/runs/{delayed}")
    click(browser, "#run-now")
    assert text(browser, "#notice") == "The run is due now."
    assert rl.get_run(delayed).due_at <= datetime.now(UTC) + timedelta(seconds=5)
    assert not browser.find_elements(By.ID, "run-now")  # due now: nothing to move forward

    # reschedule a retrying run to a time given in the form (UTC)
    browser.get(f"{url}/runs/{retrying}")
    target = (datetime.now(UTC) + timedelta(days=2)).replace(microsecond=0)
    field = browser.find_element(By.ID, "run-at")
    browser.execute_script(
        "arguments[0].value = arguments[1]", field, target.strftime("%Y-%m-%dT%H:%M:%S")
    )
    browser.find_element(By.ID, "reschedule-reason").send_keys("after the weekend")
    click(browser, "#reschedule")
    assert text(browser, "#notice") == "The run's due time was moved."
    assert rl.get_run(retrying).due_at == target

    # cancelling a running run asks first
    browser.get(f"{url}/runs/{running}")
    click(browser, "#cancel")
    assert "is running now" in text(browser, "#cancel-warning")
    shot(browser, "cancel-confirm")
    browser.find_element(By.ID, "cancel-reason").send_keys("wrong customer")
    click(browser, "#cancel-confirm")
    assert rl.get_run(running).status is RunStatus.CANCELLATION_REQUESTED

    # delete a terminal run
    browser.get(f"{url}/runs/{done}")
    browser.find_element(By.ID, "delete-reason").send_keys("test data")
    click(browser, "#delete")
    assert text(browser, "#notice") == "The run was deleted."

    rows = audit_rows(browser, url)
    shot(browser, "audit")
    assert [(a, who.split(" (")[0], runs, why) for a, who, runs, why in rows] == [
        ("delete", "token", "1", "test data"),
        ("cancel", "token", "1", "wrong customer"),
        ("reschedule", "token", "1", "after the weekend"),
        ("reschedule", "token", "1", ""),
    ]
    assert {r.via for r in rl.list_audit().items} == {"console"}

    click(browser, "#logout")
    browser.get(f"{url}/runs/{delayed}")
    assert not browser.find_elements(By.ID, "run-now")
    assert "log in to act" in text(browser, "header")


def test_basic_auth_names_its_user_and_bad_credentials_are_one_line(
    rl: Runlane, database_url: str, schema: str, tmp_path: Any
) -> None:
    login = environment_login({"RUNLANE_WEB_USER": "ops", "RUNLANE_WEB_PASSWORD": "pw-123456"})
    client = create_app(rl, authorize=login).test_client()
    assert client.get("/login").status_code == 401
    assert "Basic" in client.get("/login").headers["WWW-Authenticate"]
    assert 'name="csrf_token"' not in client.get("/queues").get_data(as_text=True)  # read-only
    right = {"Authorization": "Basic " + _b64("ops:pw-123456")}
    page = client.get("/queues", headers=right).get_data(as_text=True)
    token = page.split('name="csrf_token" value="')[1].split('"')[0]
    # the wrong password acts as nobody
    wrong = {"Authorization": "Basic " + _b64("ops:nope")}
    form = {"csrf_token": token, "name": "default"}
    assert client.post("/queues/pause", data=form, headers=wrong).status_code == 403
    assert client.post("/queues/pause", data=form, headers=right).status_code == 303
    (record,) = rl.list_audit().items
    assert (record.action, record.actor, record.via) == ("pause_queue", "ops", "console")

    # credentials that cannot be meant: one line, exit 2, before anything is served
    for env in (
        {"RUNLANE_WEB_TOKEN": ""},
        {"RUNLANE_WEB_USER": "ops"},
        # basic auth splits at the first colon: this user could never log in
        {"RUNLANE_WEB_USER": "ops:night", "RUNLANE_WEB_PASSWORD": "pw-123456"},
    ):
        argv = [sys.executable, "-m", "runlane.cli", "web", "--database-url", database_url]
        argv += ["--schema", schema, "--bind", f"127.0.0.1:{closed_port()}"]
        done = subprocess.run(
            argv,
            check=False,
            env={**os.environ, **env},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2
        assert done.stderr.count("\n") == 1
        assert "RUNLANE_WEB_" in done.stderr
    assert environment_login({}) is None


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_the_console_records_authorizes_identity_and_the_forms_reasons(
    browser: WebDriver, rl: Runlane
) -> None:
    failed = [rl.trigger(flaky, {"n": n}, max_attempts=1).id for n in range(3)]
    rl.drain()
    assert {rl.get_run(i).status for i in failed} == {RunStatus.FAILED}

    def alice(request: Any, action: str) -> str:
        return "alice@example.com"

    with served(create_app(rl, authorize=alice)) as url:
        browser.get(f"{url}/runs/{failed[0]}")
        browser.find_element(By.ID, "retry-reason").send_keys("one by hand")
        click(browser, "#retry")
        browser.get(f"{url}/runs/bulk?action=retry&task=webact.flaky&status=failed")
        browser.find_element(By.ID, "bulk-reason").send_keys("the rest")
        click(browser, "#confirm")
        # delete by filter: the completed runs the filters match, confirmed first
        rl.drain()  # the three retried runs fail again (one attempt each)
        browser.get(f"{url}/runs?task=webact.flaky&status=failed")
        click(browser, "#bulk-delete")
        assert "3 runs match" in text(browser, "#matched")
        browser.find_element(By.ID, "bulk-reason").send_keys("noise")
        click(browser, "#confirm")
        assert "3 of 3 matching runs changed" in text(browser, "#bulk-result")
        rows = audit_rows(browser, url)
    assert [(a, who.split(" (")[0], runs, why) for a, who, runs, why in rows] == [
        ("bulk_delete", "alice@example.com", "3", "noise"),
        ("bulk_retry", "alice@example.com", "2", "the rest"),
        ("retry", "alice@example.com", "1", "one by hand"),
    ]
