"""The web console in a real browser: Debian's headless Chromium driven by Selenium (nothing
is downloaded: the driver and the browser are the system's), against a waitress server in a
thread and the test's Postgres schema.

Each action is clicked through; stored values holding markup are shown as text and run no
script; POSTs without a valid CSRF token, and any POST to a read-only console, are refused;
the Content-Security-Policy header is sent; a database outage is a clear 503 page; the
blueprint works under a prefix in a user's Flask app. With ``RUNLANE_SCREENSHOTS=1`` the run
writes a screenshot of each page to docs/images/console-*.png.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from flask import Flask, Request
from psycopg import sql
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait
from waitress.server import create_server

from runlane import RetryPolicy, RunContext, Runlane, RunStatus, create_runlane, queue, task
from runlane.cli._web import parse_bind, serve_until
from runlane.postgres import postgres_polling_lane
from runlane.schedules import schedule
from runlane.web import ACTIONS, blueprint, create_app
from tests.conftest import RabbitRuntimes, RunlaneFactory
from tests.helpers import Conn, SchemaDb, closed_port, wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"

SCRIPT_XSS = "<script>window.__xss=1</script>"
IMG_XSS = '<img src=x onerror="window.__xss=1">'
HOSTILE = f"{SCRIPT_XSS} and {IMG_XSS}"

ONCE = RetryPolicy(max_attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0), jitter=0)


class Boom(Exception):
    pass


@task(id="web.ok")
def ok(payload: Any, context: RunContext) -> Any:
    return {"echo": payload}


@task(id="web.fail", retry=ONCE)
def fail(payload: Any, context: RunContext) -> None:
    raise Boom(f"failed with {HOSTILE}")


@task(id="web.child")
def child(payload: Any, context: RunContext) -> str:
    return "child done"


@task(id="web.parent")
def parent(payload: Any, context: RunContext) -> str:
    context.step("fetch", lambda: {"fetched": HOSTILE})
    context.trigger_child(child, {"from": "parent"})
    context.report_progress(fraction=0.5, message=f"half way {IMG_XSS}")
    return "parent done"


@task(id="web.waits")
def waits(payload: Any, context: RunContext) -> Any:
    return context.wait_for_token(payload["token"])


NIGHTLY = schedule(id="nightly", task=ok, cron="0 3 * * *", payload={"nightly": True})


# -- the browser -------------------------------------------------------------------------------


def browser_verdict(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """run, or skip (locally) / fail (under CI=true) with the reason no browser is here."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if shutil.which(path) is None]
    if not missing:
        return "run", ""
    reason = (
        f"no headless browser: {', '.join(missing)} missing (apt install chromium chromium-driver)"
    )
    env = os.environ if environ is None else environ
    if env.get("CI", "").strip().lower() in {"true", "1", "yes"}:
        return "fail", f"CI=true and the console's browser tests need Chromium: {reason}"
    return "skip", reason


def test_browser_verdict_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda path: None)
    assert browser_verdict({})[0] == "skip"
    verdict, message = browser_verdict({"CI": "true"})
    assert verdict == "fail"
    assert "chromedriver" in message


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    verdict, message = browser_verdict()
    if verdict == "skip":
        pytest.skip(message)
    if verdict == "fail":
        pytest.fail(message, pytrace=False)
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not fetch a driver or browser
    options = Options()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@contextmanager
def served(app: Any) -> Iterator[str]:
    """``app`` served by waitress on a free loopback port, in a thread; its base URL. Its
    pages reload themselves every 10 minutes, not 10 seconds: a reload between two steps of
    a test would pull the page from under it."""
    app.config["RUNLANE_REFRESH_SECONDS"] = 600
    sockets: dict[int, Any] = {}
    server: Any = create_server(app, map=sockets, host="127.0.0.1", port=0, threads=4)
    port = server.effective_port
    stop = threading.Event()
    # as `runlane web` serves, with short turns: the teardown waits at most one
    thread = threading.Thread(
        target=serve_until,
        args=(server, sockets, stop, 0.05),
        name="web-test-server",
        daemon=True,
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(10)
        assert not thread.is_alive()


def shot(driver: WebDriver, name: str) -> None:
    if os.environ.get("RUNLANE_SCREENSHOTS") == "1":
        IMAGES.mkdir(parents=True, exist_ok=True)
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1400, min(max(int(height) + 40, 700), 2400))
        driver.save_screenshot(str(IMAGES / f"console-{name}.png"))
        driver.set_window_size(1400, 1000)


def no_script_ran(driver: WebDriver) -> None:
    assert driver.execute_script("return window.__xss") is None


def text(driver: WebDriver, css: str = "body") -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def _left(page: WebElement) -> Callable[[WebDriver], bool]:
    """True once ``page`` (the old document's root) is gone. Besides selenium's stale
    element error, Chromium answers a look at a node of a document being replaced with
    "Node with given id does not belong to the document" (a plain WebDriverException),
    which staleness_of let through as a failure."""

    def left(driver: WebDriver) -> bool:
        try:
            page.is_enabled()
        except WebDriverException:  # StaleElementReferenceException is one too
            return True
        return False

    return left


# how often a wait for the next page looks (selenium's default, 0.5 s, cost most clicks
# half a second: the first look, at once, comes before the page has gone)
PAGE_POLL = 0.02


def waiting(driver: WebDriver, timeout: float = 15.0) -> WebDriverWait[WebDriver]:
    """A wait that looks every PAGE_POLL; an element a live update swapped out while it was
    read (stale) is looked at again, not a failure."""
    return WebDriverWait(
        driver,
        timeout,
        poll_frequency=PAGE_POLL,
        ignored_exceptions=(StaleElementReferenceException,),
    )


def click(driver: WebDriver, css: str) -> None:
    """Click ``css`` and wait for the page it leads to (the old page goes stale)."""
    page = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(By.CSS_SELECTOR, css).click()
    waiting(driver).until(_left(page))


def submit_by_script(driver: WebDriver, script: str) -> None:
    """Run ``script`` (which submits a form) and wait for the page it leads to."""
    page = driver.find_element(By.TAG_NAME, "html")
    driver.execute_script(script)
    waiting(driver).until(_left(page))


def http(url: str, data: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of a GET, or a POST of ``data`` (no cookies)."""
    body = None if data is None else urllib.parse.urlencode(data).encode()
    try:
        with urllib.request.urlopen(url, data=body, timeout=10) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


# -- the data ----------------------------------------------------------------------------------


def everyone(request: Request, action: str) -> bool:
    assert action in ACTIONS
    return True


@pytest.fixture
def console(make_runlane: RunlaneFactory, db: Conn, schema: str) -> Iterator[dict[str, Any]]:
    """A runtime with runs of every kind, a live worker and maintenance bands."""
    rl = make_runlane(
        queues=[queue("default", default=True), queue("mail"), queue("idle")],
        tasks=[ok, fail, child, parent, waits],
        schedules=[NIGHTLY],
    )
    ids: dict[str, Any] = {}
    ids["ok"] = rl.trigger(ok, {"note": HOSTILE}, idempotency_key=f"key {SCRIPT_XSS}").id
    ids["fail"] = rl.trigger(fail, {"why": HOSTILE}).id
    ids["parent"] = rl.trigger(parent, None).id
    token = rl.create_wait_token()
    ids["waits"] = rl.trigger(waits, {"token": str(token.id)}).id
    ids["token"] = token.id
    rl.drain(queues=["default"])
    rl.drain(queues=["default"])  # the child
    ids["mail"] = [h.id for h in rl.trigger_many(ok, [{"n": n} for n in range(60)], queue="mail")]
    # data written by another producer (or by hand): a task id and queue runlane's checks
    # would refuse, and a stored trace context
    sdb = SchemaDb(db, schema)
    ids["hostile"] = uuid.uuid4()
    sdb.run(
        "insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
        "max_attempts, due_at, trace_context) values (%s, 'default', %s, 'idle', 'queued', "
        "%s::jsonb, 1, now() + interval '1 day', %s::jsonb)",
        ids["hostile"],
        f"task {HOSTILE}",
        '{"x": "' + SCRIPT_XSS + '"}',
        '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}',
    )
    ids["child"] = rl.list_runs(task="web.child").runs[0].id
    services = rl.start_services()
    worker = rl.create_delivery_worker(concurrency=1, queues=["idle"])
    try:
        wait_until(lambda: bool(rl.list_workers()), timeout=10, what="the worker to register")
        wait_until(
            lambda: bool(rl.status().maintenance_leases), timeout=10, what="a maintenance band"
        )
        yield {"rl": rl, "ids": ids, "db": sdb}
    finally:
        worker.close(timeout=5)
        services.close()


# -- click through every page and action ------------------------------------------------------


def test_every_page_and_action_in_the_browser(browser: WebDriver, console: dict[str, Any]) -> None:
    rl: Runlane = console["rl"]
    ids = console["ids"]
    with served(create_app(rl, authorize=everyone)) as base:
        # overview: queues, chart, workers, bands
        browser.get(base + "/")
        no_script_ran(browser)
        body = text(browser)
        assert "Finished runs, last hour" in body
        assert "mail" in text(browser, "table.queues")
        # the chart reads the rollup, which maintenance folds once a minute has closed:
        # its bars are checked on folded data in test_web_overview_chart
        assert browser.find_elements(By.CSS_SELECTOR, "#throughput rect.slot")
        assert "From the stats rollup" in text(browser, "section[data-live=throughput]")
        assert "running" in text(browser, "table.workers")
        assert text(browser, "table.bands").count("live") >= 1
        # updated in place (runlane/web/static/console.js), every 600 s under this test
        assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-refresh") == "600"
        # the stylesheet loaded (the CSP allows the console's own files)
        background = browser.execute_script(
            "return getComputedStyle(document.querySelector('header')).backgroundColor"
        )
        assert background == "rgb(29, 35, 48)"
        shot(browser, "overview")

        # runs: filter, page, open a run
        browser.get(base + "/runs")
        no_script_ran(browser)
        assert f"task {SCRIPT_XSS}" in text(browser, "table.runs")
        shot(browser, "runs")
        browser.get(base + "/runs?queue=mail")
        assert len(browser.find_elements(By.CSS_SELECTOR, "table.runs tbody tr")) == 50
        click(browser, "#older")
        assert len(browser.find_elements(By.CSS_SELECTOR, "table.runs tbody tr")) == 10
        browser.get(base + "/runs?status=failed")
        rows = browser.find_elements(By.CSS_SELECTOR, "table.runs tbody tr")
        assert len(rows) == 1
        click(browser, "table.runs tbody a")

        # a failed run: error and traceback as text; retry, cancel, retry
        assert str(ids["fail"]) in browser.current_url
        no_script_ran(browser)
        assert text(browser, "#error-type").endswith("Boom")
        assert text(browser, "#error-message") == f"failed with {HOSTILE}"
        assert "raise Boom" in text(browser, "#traceback")
        assert SCRIPT_XSS in text(browser, "#payload")
        assert "failed" in text(browser, "table.attempts")
        assert rl.list_workers()[0].host not in ("",)  # attempts show the host when known
        shot(browser, "run")
        click(browser, "#retry")
        assert text(browser, "#notice") == "The run was queued again."
        assert text(browser, "#run-status") == "queued"
        click(browser, "#cancel")
        assert text(browser, "#notice") == "The run was cancelled."
        assert rl.get_run(ids["fail"]).status is RunStatus.CANCELLED
        click(browser, "#retry")
        assert rl.get_run(ids["fail"]).status is RunStatus.QUEUED

        # the parent: steps, progress, children; the child links back
        browser.get(f"{base}/runs/{ids['parent']}")
        no_script_ran(browser)
        assert SCRIPT_XSS in text(browser, "table.steps")
        assert f"half way {IMG_XSS}" in text(browser, "#progress")
        click(browser, "#children table.runs tbody a")
        assert str(ids["child"]) in browser.current_url
        click(browser, "#parent")
        assert str(ids["parent"]) in browser.current_url

        # a waiting run shows its token; a hand-written run its trace id and hostile task id
        browser.get(f"{base}/runs/{ids['waits']}")
        assert str(ids["token"]) in text(browser, "#wait")
        browser.get(f"{base}/runs/{ids['hostile']}")
        no_script_ran(browser)
        assert text(browser, "#run-task") == f"task {HOSTILE}"
        assert text(browser, "#trace") == "4bf92f3577b34da6a3ce929d0e0e4736"

        # the completed run with a hostile idempotency key and output
        browser.get(f"{base}/runs/{ids['ok']}")
        no_script_ran(browser)
        assert SCRIPT_XSS in text(browser, "#output")
        assert f"key {SCRIPT_XSS}" in text(browser, "dl.facts")

        # bulk cancel by filter: the count first, then the action
        browser.get(base + "/runs?queue=mail&status=queued")
        click(browser, "#bulk-cancel")
        assert "60 runs match" in text(browser, "#matched")
        shot(browser, "bulk")
        assert rl.get_run(ids["mail"][0]).status is RunStatus.QUEUED  # nothing changed yet
        click(browser, "#confirm")
        assert text(browser, "#bulk-result") == "60 of 60 matching runs changed."
        assert all(rl.get_run(i).status is RunStatus.CANCELLED for i in ids["mail"])
        # bulk retry of what was just cancelled
        browser.get(base + "/runs?queue=mail&status=cancelled")
        click(browser, "#bulk-retry")
        assert "60 runs match" in text(browser, "#matched")
        click(browser, "#confirm")
        assert text(browser, "#bulk-result") == "60 of 60 matching runs changed."
        assert rl.get_run(ids["mail"][-1]).status is RunStatus.QUEUED

        # queues: pause with a reason (shown as text), resume
        browser.get(base + "/queues")
        row = "tr[data-queue='mail']"
        browser.find_element(By.CSS_SELECTOR, f"{row} input[name=reason]").send_keys(
            f"deploy {IMG_XSS}"
        )
        click(browser, f"{row} button.pause-queue")
        assert text(browser, "#notice") == "The queue is paused."
        no_script_ran(browser)
        assert f"deploy {IMG_XSS}" in text(browser, row)
        assert next(q for q in rl.list_queues() if q.name == "mail").paused
        shot(browser, "queues")
        click(browser, f"{row} button.resume-queue")
        assert text(browser, "#notice") == "The queue is running again."
        assert not next(q for q in rl.list_queues() if q.name == "mail").paused

        # workers
        browser.get(base + "/workers")
        assert "idle" in text(browser, "table.workers")
        shot(browser, "workers")

        # schedules: pause, resume, run now
        browser.get(base + "/schedules")
        row = "tr[data-schedule='nightly']"
        click(browser, f"{row} button.pause-schedule")
        assert text(browser, "#notice") == "The schedule is paused."
        assert rl.list_schedules()[0].paused
        assert "paused" in text(browser, row)
        shot(browser, "schedules")
        click(browser, f"{row} button.resume-schedule")
        assert not rl.list_schedules()[0].paused
        click(browser, f"{row} button.run-schedule")
        assert text(browser, "#notice") == "The schedule's run was created."
        assert text(browser, "#run-task") == "web.ok"
        made = uuid.UUID(browser.current_url.rsplit("/", 1)[1].split("?")[0])
        assert rl.get_run(made).payload == {"nightly": True}


# -- security -------------------------------------------------------------------------------


def test_csrf_token_is_required_on_every_post(browser: WebDriver, console: dict[str, Any]) -> None:
    rl: Runlane = console["rl"]
    failed = console["ids"]["fail"]
    with served(create_app(rl, authorize=everyone)) as base:
        browser.get(f"{base}/runs/{failed}")
        # a wrong token in the page's own form
        browser.execute_script(
            "document.querySelector('#retry').form.elements['csrf_token'].value = 'wrong'"
        )
        click(browser, "#retry")
        assert "CSRF token" in text(browser, "#error")
        assert "403" in text(browser, "#error")
        # no token at all
        browser.get(f"{base}/runs/{failed}")
        browser.execute_script(
            "document.querySelector('#retry').form.elements['csrf_token'].remove()"
        )
        click(browser, "#retry")
        assert "403" in text(browser, "#error")
        # another client's (no cookie) POST with a token copied from this page
        browser.get(f"{base}/runs/{failed}")
        token = browser.find_element(By.NAME, "csrf_token").get_attribute("value")
        assert token
        status, _, _ = http(f"{base}/runs/{failed}/retry", {"csrf_token": token})
        assert status == 403
        assert rl.get_run(failed).status is RunStatus.FAILED
        # the real form still works
        browser.get(f"{base}/runs/{failed}")
        click(browser, "#retry")
        assert rl.get_run(failed).status is RunStatus.QUEUED


def test_read_only_without_authorize(browser: WebDriver, console: dict[str, Any]) -> None:
    rl: Runlane = console["rl"]
    failed = console["ids"]["fail"]
    with served(create_app(rl)) as base:
        for path in ("/", "/runs?status=failed", f"/runs/{failed}", "/queues", "/schedules"):
            browser.get(base + path)
            assert browser.find_elements(By.CSS_SELECTOR, "form[method=post]") == []
            assert browser.find_elements(By.CSS_SELECTOR, "#bulk-retry, #bulk-cancel") == []
        assert "read-only" in text(browser, "header")
        # a crafted form posted from the console's own page is refused
        browser.get(f"{base}/runs/{failed}")
        submit_by_script(
            browser,
            "const f = document.createElement('form'); f.method = 'post';"
            f"f.action = '/runs/{failed}/retry'; document.body.appendChild(f); f.submit();",
        )
        assert "403" in text(browser, "#error")
        status, _, _ = http(f"{base}/queues/pause", {"name": "mail"})
        assert status == 403
        status, _, _ = http(f"{base}/runs/bulk?action=cancel&queue=mail")
        assert status == 403
    assert rl.get_run(failed).status is RunStatus.FAILED
    assert not any(q.paused for q in rl.list_queues())


def test_an_action_authorize_refuses_is_hidden_and_refused(
    browser: WebDriver, console: dict[str, Any]
) -> None:
    rl: Runlane = console["rl"]
    failed = console["ids"]["fail"]
    asked: list[str] = []

    def only_cancel(request: Request, action: str) -> bool:
        asked.append(action)
        return action == "cancel"

    with served(create_app(rl, authorize=only_cancel)) as base:
        browser.get(f"{base}/runs/{failed}")
        assert browser.find_elements(By.CSS_SELECTOR, "#retry") == []
        # the token of a page that has a form (cancel), in a form for retry
        browser.get(f"{base}/runs/{console['ids']['waits']}")
        submit_by_script(
            browser,
            "const t = document.querySelector('input[name=csrf_token]');"
            "const f = document.createElement('form'); f.method = 'post';"
            f"f.action = '/runs/{failed}/retry'; f.appendChild(t.cloneNode());"
            "document.body.appendChild(f); f.submit();",
        )
        assert "does not allow retry" in text(browser, "#error")
    assert rl.get_run(failed).status is RunStatus.FAILED
    assert "retry" in asked


def test_headers_and_no_secrets(console: dict[str, Any], database_url: str) -> None:
    rl: Runlane = console["rl"]
    with served(create_app(rl, authorize=everyone)) as base:
        for path in (
            "/",
            "/runs",
            f"/runs/{console['ids']['fail']}",
            "/queues",
            "/workers",
            "/schedules",
            "/runs/bulk?action=retry&status=failed",
            "/nowhere",
        ):
            status, headers, body = http(base + path)
            assert status in (200, 404), path
            policy = headers["Content-Security-Policy"]
            assert "default-src 'self'" in policy
            assert "unsafe-inline" not in policy
            # one script, the console's own file (no inline script: the CSP forbids them)
            own = '<script src="/static/console.js" defer></script>'
            assert body.count("<script") == body.count(own) <= 1
            assert "<script" not in body.replace(own, "").replace(
                SCRIPT_XSS.replace("<", "&lt;"), ""
            )
            assert database_url not in body
            assert "postgresql://" not in body
            assert "amqp://" not in body
        _, headers, _ = http(base + "/queues")  # a page with forms sets the CSRF cookie
        assert "HttpOnly" in headers["Set-Cookie"]
        assert "SameSite=Strict" in headers["Set-Cookie"]


def test_database_outage_is_a_clear_page(browser: WebDriver, schema: str) -> None:
    url = f"postgresql://runlane:s3cret-pw@127.0.0.1:{closed_port()}/nowhere"
    lane = postgres_polling_lane(connection_string=url, schema=schema, connect_timeout=1)
    dead = create_runlane(lane=lane)
    try:
        with served(create_app(dead)) as base:
            for path in ("/", "/runs", "/queues"):
                browser.get(base + path)
                assert "Database unavailable" in text(browser, "#error")
                assert "503" in text(browser, "#error")
                source = browser.page_source
                assert "s3cret" not in source
                assert "Traceback" not in source
            status, _, _ = http(base + "/workers")
            assert status == 503
    finally:
        dead.close()


def test_closed_runtime_is_a_clear_page(browser: WebDriver, console: dict[str, Any]) -> None:
    rl: Runlane = console["rl"]
    with served(create_app(rl)) as base:
        rl.close()
        browser.get(base + "/")
        assert "Console stopped" in text(browser, "#error")


def test_blueprint_under_a_prefix(browser: WebDriver, console: dict[str, Any]) -> None:
    rl: Runlane = console["rl"]
    app = Flask("user_app")
    app.secret_key = "the user's secret"

    @app.get("/")
    def home() -> str:
        return "the user's own page"

    app.register_blueprint(blueprint(rl, authorize=everyone), url_prefix="/ops/runlane")
    with served(app) as base:
        browser.get(base + "/")
        assert text(browser) == "the user's own page"
        browser.get(base + "/ops/runlane/queues")
        assert (
            browser.execute_script(
                "return getComputedStyle(document.querySelector('header')).backgroundColor"
            )
            == "rgb(29, 35, 48)"
        )
        assert all(
            (link.get_attribute("href") or "").startswith(base + "/ops/runlane/")
            for link in browser.find_elements(By.CSS_SELECTOR, "header nav a")
        )
        row = "tr[data-queue='mail']"
        click(browser, f"{row} button.pause-queue")
        assert text(browser, "#notice") == "The queue is paused."
        assert browser.current_url.startswith(base + "/ops/runlane/queues")
        assert next(q for q in rl.list_queues() if q.name == "mail").paused
        click(browser, f"{row} button.resume-queue")
        assert not next(q for q in rl.list_queues() if q.name == "mail").paused


def test_bad_filters_and_unknown_runs_are_pages_not_tracebacks(console: dict[str, Any]) -> None:
    rl: Runlane = console["rl"]
    with served(create_app(rl, authorize=everyone)) as base:
        status, _, body = http(base + "/runs?status=nope")
        assert status == 400
        assert "is not a run status" in body
        status, _, body = http(base + "/runs?created_after=yesterday")
        assert status == 400
        assert "must be a time" in body
        status, _, body = http(base + "/runs?cursor=" + "x" * 50)
        assert status == 400
        status, _, body = http(f"{base}/runs/{uuid.uuid4()}")
        assert status == 404
        status, _, body = http(base + "/runs/not-a-uuid")
        assert status == 404
        status, _, body = http(base + "/runs/bulk?action=retry")
        assert status == 400
        assert "choose at least one filter" in body
        assert "Traceback" not in body


def test_time_filters(console: dict[str, Any]) -> None:
    rl: Runlane = console["rl"]
    newest = rl.list_runs(limit=1).runs[0]
    with served(create_app(rl)) as base:
        stamp = newest.created_at.strftime("%Y-%m-%dT%H:%M:%S.%f%z")
        _, _, before = http(base + "/runs?" + urllib.parse.urlencode({"created_before": stamp}))
        assert str(newest.id)[:8] not in before
        _, _, after = http(base + "/runs?" + urllib.parse.urlencode({"created_after": stamp}))
        assert str(newest.id)[:8] in after
        assert "older" not in after.split("</table>")[1]


def test_overview_shows_the_outbox_on_the_rabbitmq_lane(
    browser: WebDriver, rabbit_runtime: RabbitRuntimes, rabbitmq_url: str
) -> None:
    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[ok])
    rl.trigger(ok, {"n": 1})
    with served(create_app(rl)) as base:
        browser.get(base + "/")
        assert "outbox items pending" in text(browser, "#outbox")
        assert text(browser, "#broker").startswith("reachable at 127.0.0.1:")
        source = browser.page_source
        assert rabbitmq_url not in source
        assert "amqp://" not in source


def test_parse_bind() -> None:
    assert parse_bind("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_bind("[::1]:9000") == ("::1", 9000)
    for bad in ("8080", "host:", "host:0", "host:70000", ":80"):
        with pytest.raises(ValueError, match="--bind must be HOST:PORT"):
            parse_bind(bad)


SERVE = """
import argparse, faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack if it hangs
from runlane.cli import load_app
from runlane.cli._web import add_web_command
parser = argparse.ArgumentParser()
add_web_command(parser.add_subparsers(dest="command"), load_app)
args = parser.parse_args(sys.argv[1:])
sys.exit(args.handler(args))
"""


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_runlane_web_serves_from_a_database_url(
    database_url: str, schema: str, stop: signal.Signals
) -> None:
    port = closed_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVE,
            "web",
            "--database-url",
            database_url,
            "--schema",
            schema,
            "--bind",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in first
        assert "read-only" in first
        statuses: list[int] = []

        def answered() -> bool:
            try:
                status, _, body = http(f"http://127.0.0.1:{port}/queues")
            except OSError:
                return False
            statuses.append(status)
            return "Queues" in body

        wait_until(answered, timeout=15, what="runlane web to answer")
        assert statuses[-1] == 200
    finally:
        # at once after a request, when waitress used to lose a Ctrl-C: the server stops,
        # the runtime is closed, exit 0
        process.send_signal(stop)
        try:
            code = process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            # where it hangs: every thread's stack (faulthandler, to the merged output), then
            # not left running (nor its Popen for a later test's garbage collector to find)
            process.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=2)
            process.kill()
            process.wait()
            assert process.stdout is not None
            output = process.stdout.read()
            pytest.fail(f"runlane web still running 15 s after {stop.name}:\n{output}")
        finally:
            assert process.stdout is not None
            process.stdout.close()
    assert code == 0


def test_a_bulk_confirmation_too_slow_to_count_shows_an_estimate(
    make_runlane: RunlaneFactory, db: Conn, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rl = make_runlane()
    db.execute(
        sql.SQL(
            "insert into {}.runs (id, environment, task_id, queue, status, payload, max_attempts,"
            " due_at) select gen_random_uuid(), 'default', 'web.t', 'big', 'queued', 'null', 1,"
            " now() from generate_series(1, 30000)"
        ).format(sql.Identifier(schema))
    )
    db.execute(sql.SQL("analyze {}.runs").format(sql.Identifier(schema)))
    with served(create_app(rl, authorize=everyone)) as base:
        _, _, exact = http(base + "/runs/bulk?action=cancel&queue=big")
        assert "More than <b>10,000</b> runs match" in exact
        monkeypatch.setattr("runlane.web._actions.BULK_COUNT_SECONDS", 0.001)
        status, _, estimated = http(base + "/runs/bulk?action=cancel&queue=big")
        assert status == 200
        assert "About <b>" in estimated
        assert "an estimate" in estimated
        assert "Cancel up to 10,000 runs" in estimated


def test_the_console_counts_attempts_as_the_cli_does(console: dict[str, Any]) -> None:
    """Attempts spent against max_attempts (docs/architecture.md, "Counting attempts"), in
    the run page and the runs table, with the latest attempt's number beside them."""
    rl: Runlane = console["rl"]
    failed = rl.get_run(console["ids"]["fail"])
    assert failed.attempts_spent >= 1
    with served(create_app(rl)) as base:
        _, _, page = http(f"{base}/runs/{failed.id}")
        spent = f"{failed.attempts_spent} of {failed.max_attempts} spent (latest #{failed.attempt})"
        assert spent in page
        _, _, listing = http(f"{base}/runs?task={failed.task_id}")
        assert f"<td>{failed.attempts_spent}/{failed.max_attempts}</td>" in listing
