"""Finding runs (issue 39): task and queue prefixes, the idempotency key and payload
containment, through ``Runlane.list_runs``, ``runlane runs list`` and the console (a real
headless Chromium); a search bounded by its time budget says how far back it looked and
continues from there; each worker's running runs, linked both ways."""

from __future__ import annotations

import json
import re
import threading
import uuid
from typing import Any
from urllib.parse import quote

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement

from runlane import RunContext, Runlane, RunStatus, queue, task
from runlane.cli import EXIT_CONFIGURATION, main
from runlane.errors import ConfigurationError
from runlane.postgres._web_reads import FIRST_WINDOW, WebReadRepository
from runlane.web import create_app
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb, wait_until
from tests.test_web import (
    browser,
    click,
    everyone,
    served,
    shot,
    submit_by_script,
    text,
    waiting,
)

__all__ = ["browser"]  # the module's Chromium (tests/test_web.py's fixture)


@task(id="billing.charge")
def charge(payload: Any, context: RunContext) -> Any:
    return payload


@task(id="billing.refund")
def refund(payload: Any, context: RunContext) -> Any:
    return payload


@task(id="mail.send")
def send(payload: Any, context: RunContext) -> Any:
    return payload


QUEUES = [queue("default", default=True), queue("mail-eu"), queue("mail-us"), queue("other")]


@pytest.fixture
def shop(make_runlane: RunlaneFactory) -> dict[str, Any]:
    rl = make_runlane(queues=QUEUES, tasks=[charge, refund, send])
    ids = {
        "charge": rl.trigger(charge, {"customer": {"id": 7, "tier": "gold"}, "amount": 5}).id,
        "charge2": rl.trigger(charge, {"customer": {"id": 8}, "amount": 5}).id,
        "refund": rl.trigger(refund, {"customer": {"id": 7}}, idempotency_key="order-42").id,
        "eu": rl.trigger(send, {"to": "a@example.eu"}, queue="mail-eu").id,
        "us": rl.trigger(send, {"to": "b@example.com"}, queue="mail-us").id,
        "other": rl.trigger(send, {"to": "c"}, queue="other", idempotency_key="order-42").id,
    }
    return {"rl": rl, "ids": ids}


def found(page: Any) -> set[uuid.UUID]:
    return {run.id for run in page.runs}


def test_list_runs_finds_by_prefix_key_and_payload(shop: dict[str, Any]) -> None:
    rl: Runlane = shop["rl"]
    ids = shop["ids"]
    # the exact task filter stays exact; the prefix finds every task under it
    assert found(rl.list_runs(task="billing")) == set()
    billing = {ids["charge"], ids["charge2"], ids["refund"]}
    assert found(rl.list_runs(task_prefix="billing")) == billing
    assert found(rl.list_runs(task_prefix="billing.ch")) == {ids["charge"], ids["charge2"]}
    assert found(rl.list_runs(queue_prefix="mail-")) == {ids["eu"], ids["us"]}
    # a key is per task: the same key of two tasks finds both, narrowed by task if asked
    assert found(rl.list_runs(idempotency_key="order-42")) == {ids["refund"], ids["other"]}
    assert found(rl.list_runs(idempotency_key="order-42", task_prefix="billing")) == {ids["refund"]}
    # containment, as jsonb @> reads it: nested objects, any depth given
    assert found(rl.list_runs(payload_contains={"customer": {"id": 7}})) == {
        ids["charge"],
        ids["refund"],
    }
    assert found(rl.list_runs(payload_contains={"customer": {"tier": "gold"}})) == {ids["charge"]}
    assert found(rl.list_runs(payload_contains={"amount": 5}, status="queued")) == {
        ids["charge"],
        ids["charge2"],
    }
    assert found(rl.list_runs(payload_contains={"amount": 5}, status=RunStatus.FAILED)) == set()
    # a page of a search pages like any list: newest first, the cursor continues
    first = rl.list_runs(task_prefix="billing", limit=2)
    assert [r.id for r in first.runs] == [ids["refund"], ids["charge2"]]
    assert first.searched_to is None
    assert first.next_cursor is not None
    rest = rl.list_runs(task_prefix="billing", limit=2, cursor=first.next_cursor)
    assert [r.id for r in rest.runs] == [ids["charge"]]
    assert rest.next_cursor is None
    assert rest.searched_to is None


@pytest.mark.parametrize(
    ("keywords", "words"),
    [
        ({"payload_contains": [1]}, "payload_contains must be a JSON object"),
        ({"payload_contains": {"x": float("nan")}}, "payload_contains must be JSON"),
        ({"payload_contains": {"x": "a\x00b"}}, "cannot contain the NUL character"),
        ({"payload_contains": {"x": "\ud800"}}, "lone surrogate"),
        ({"payload_contains": {1: "x"}}, "payload_contains must be JSON"),
        ({"payload_contains": {"x": "y" * 20_000}}, "at most 10,000"),
        ({"task_prefix": ""}, "task_prefix must be a non-empty string"),
        ({"queue_prefix": 3}, "queue_prefix must be a non-empty string"),
        ({"idempotency_key": "a\x00b"}, "idempotency_key"),
        ({"task_prefix": "x", "search_seconds": 0}, "search_seconds must be a number"),
        ({"task_prefix": "x", "search_seconds": True}, "search_seconds must be a number"),
    ],
)
def test_bad_search_arguments_are_one_clear_error(
    shop: dict[str, Any], keywords: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigurationError, match=words) as caught:
        shop["rl"].list_runs(**keywords)
    assert "\n" not in str(caught.value)


def test_a_search_out_of_time_says_how_far_back_it_looked_and_continues(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl = make_runlane(queues=QUEUES, tasks=[charge, send])
    needle = rl.trigger(charge, {"needle": True}).id
    # more runs than the first two windows of a search walk, all newer than the needle
    SchemaDb(db, schema).run(
        "insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
        "max_attempts, due_at, created_at) select gen_random_uuid(), 'default', 'mail.send', "
        "'default', 'queued', jsonb_build_object('n', n), 1, now(), "
        "now() + n * interval '1 millisecond' from generate_series(1, %s) as n",
        5 * FIRST_WINDOW + 10,
    )
    # a budget spent by the first window: it stops there, says so, and the cursor goes on
    pages = []
    cursor = None
    while True:
        page = rl.list_runs(payload_contains={"needle": True}, search_seconds=1e-6, cursor=cursor)
        pages.append(page)
        cursor = page.next_cursor
        if cursor is None:
            break
        assert len(pages) < 10, "the search made no progress"
    assert pages[0].runs == ()
    assert pages[0].searched_to is not None
    assert [run.id for page in pages for run in page.runs] == [needle]
    assert pages[-1].searched_to is None
    reached = [page.searched_to for page in pages[:-1] if page.searched_to is not None]
    assert len(reached) == len(pages) - 1
    assert reached == sorted(reached, reverse=True), "each page looked further back"
    # with time enough, one call walks every window
    whole = rl.list_runs(payload_contains={"needle": True})
    assert [run.id for run in whole.runs] == [needle]
    assert whole.searched_to is None


def test_a_search_uses_the_optional_index_the_docs_name(
    shop: dict[str, Any], db: Conn, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With runs_payload_search or runs_key_search (docs/console.md) a payload or key search
    is one statement through it; without, it walks windows and never tries one."""
    rl: Runlane = shop["rl"]
    ids = shop["ids"]

    def no_direct(*args: Any) -> None:
        raise AssertionError("searched through an index this schema does not have")

    monkeypatch.setattr(WebReadRepository, "direct", no_direct)
    assert found(rl.list_runs(payload_contains={"customer": {"id": 8}})) == {ids["charge2"]}
    assert found(rl.list_runs(idempotency_key="order-42")) == {ids["refund"], ids["other"]}
    monkeypatch.undo()

    sdb = SchemaDb(db, schema)
    sdb.run("create index runs_payload_search on {schema}.runs using gin (payload jsonb_path_ops)")
    sdb.run(
        "create index runs_key_search on {schema}.runs (environment, idempotency_key) "
        "where idempotency_key is not null"
    )

    def no_windows(*args: Any) -> None:
        raise AssertionError("walked windows though the index was there")

    monkeypatch.setattr(WebReadRepository, "windows", no_windows)
    assert found(rl.list_runs(payload_contains={"customer": {"id": 7}})) == {
        ids["charge"],
        ids["refund"],
    }
    assert found(
        rl.list_runs(payload_contains={"customer": {"id": 7}}, task_prefix="billing.r")
    ) == {ids["refund"]}
    assert found(rl.list_runs(idempotency_key="order-42")) == {ids["refund"], ids["other"]}
    page = rl.list_runs(idempotency_key="order-42", limit=1)
    assert [r.id for r in page.runs] == [ids["other"]]
    rest = rl.list_runs(idempotency_key="order-42", limit=1, cursor=page.next_cursor)
    assert [r.id for r in rest.runs] == [ids["refund"]]
    assert rest.next_cursor is None


def test_a_worker_gone_while_stopping_reads_lost_after_two_heartbeats(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    """A stopping worker beats every interval until it writes stopped; one whose process
    died meanwhile (killed, or out of its close timeout) reads lost after two intervals
    unseen, not stopping for good. A running one keeps the three intervals."""
    rl = make_runlane(queues=QUEUES, tasks=[charge])
    sdb = SchemaDb(db, schema)
    rows = {
        "stopping-gone": ("stopping", 2.5),
        "stopping-alive": ("stopping", 1.2),
        "running-late": ("running", 2.5),
        "running-gone": ("running", 3.5),
    }
    ids = {}
    for name, (state, intervals) in rows.items():
        ids[name] = uuid.uuid4()
        sdb.run(
            "insert into {schema}.workers (id, environment, host, pid, runlane_version, "
            "queues, concurrency, heartbeat_seconds, state, started_at, last_seen_at) values "
            "(%s, 'default', %s, 1, 'test', array['default'], 1, 10, %s, now() - interval "
            "'1 hour', now() - %s * interval '10 seconds')",
            ids[name],
            name,
            state,
            intervals,
        )
    states = {w.host: w.state.value for w in rl.list_workers()}
    assert states == {
        "stopping-gone": "lost",
        "stopping-alive": "stopping",
        "running-late": "running",
        "running-gone": "lost",
    }


# -- in the browser ------------------------------------------------------------------------------


@task(id="hold.on")
def hold_on(payload: Any, context: RunContext) -> Any:
    RELEASE.wait(30)
    return "released"


RELEASE = threading.Event()


def test_find_in_the_browser(browser: WebDriver, shop: dict[str, Any]) -> None:
    rl: Runlane = shop["rl"]
    ids = shop["ids"]
    with served(create_app(rl, authorize=everyone)) as base:
        # the run-id box, on any page: a full id opens the run, anything else says why not
        browser.get(base + "/queues")
        box = browser.find_element(By.ID, "find-run")
        box.send_keys(f"  {ids['refund']} ")
        submit_by_script(browser, "document.getElementById('find').submit()")
        assert browser.current_url == f"{base}/runs/{ids['refund']}"
        assert text(browser, "#run-id") == str(ids["refund"])
        copy = browser.find_element(By.CSS_SELECTOR, "h1 [data-copy]")
        assert copy.get_attribute("data-copy") == str(ids["refund"])
        copy.click()
        waiting(browser, 5).until(lambda d: copy.get_attribute("data-copied") == "1")
        assert copy.text == "copied"
        browser.get(base + "/find?run=billing")
        assert "is not a run id" in text(browser, "#error")

        # full ids in the list, each with its copy button
        browser.get(base + "/runs")
        shown = browser.find_elements(By.CSS_SELECTOR, "table.runs td.run-id a")
        assert {a.text for a in shown} == {str(i) for i in ids.values()}
        buttons = browser.find_elements(By.CSS_SELECTOR, "table.runs td.run-id [data-copy]")
        assert {b.get_attribute("data-copy") for b in buttons} == {str(i) for i in ids.values()}

        def search(**fields: str) -> set[str]:
            browser.get(base + "/runs")
            for name, value in fields.items():
                browser.find_element(By.CSS_SELECTOR, f"#filters [name={name}]").send_keys(value)
            click(browser, "#filters button[type=submit]")
            return {str(row.get_attribute("data-run")) for row in rows_of(browser)}

        assert search(task_prefix="billing") == {
            str(ids["charge"]),
            str(ids["charge2"]),
            str(ids["refund"]),
        }
        assert search(queue_prefix="mail-") == {str(ids["eu"]), str(ids["us"])}
        assert search(idempotency_key="order-42") == {str(ids["refund"]), str(ids["other"])}
        assert search(payload='{"customer": {"tier": "gold"}}') == {str(ids["charge"])}
        # the form keeps what was searched; a search offers no bulk action by filter
        field = browser.find_element(By.CSS_SELECTOR, "#filters [name=payload]")
        assert field.get_attribute("value") == '{"customer": {"tier": "gold"}}'
        assert not browser.find_elements(By.ID, "bulk-retry")
        shot(browser, "search")
        assert search(payload="{not json") == set()
        assert "payload contains: '{not json' is not JSON" in text(browser, "#error")


def rows_of(driver: WebDriver) -> list[WebElement]:
    return driver.find_elements(By.CSS_SELECTOR, "table.runs tbody tr[data-run]")


def test_a_search_that_ran_out_of_time_says_so_in_the_browser(
    browser: WebDriver, make_runlane: RunlaneFactory, db: Conn, schema: str, monkeypatch: Any
) -> None:
    rl = make_runlane(queues=QUEUES, tasks=[charge, send])
    needle = rl.trigger(charge, {"needle": True}).id
    SchemaDb(db, schema).run(
        "insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
        "max_attempts, due_at, created_at) select gen_random_uuid(), 'default', 'mail.send', "
        "'default', 'queued', jsonb_build_object(), 1, now(), now() + n * interval '1 millisecond' "
        "from generate_series(1, %s) as n",
        FIRST_WINDOW + 10,
    )
    monkeypatch.setattr("runlane.web._pages.SEARCH_SECONDS", 1e-6)
    with served(create_app(rl, authorize=everyone)) as base:
        browser.get(base + "/runs?payload=" + quote('{"needle": true}'))
        assert rows_of(browser) == []
        note = text(browser, "#searched-to")
        assert note.startswith("The search stopped early: it looked at runs created down to")
        click(browser, "#searched-to a")
        assert [row.get_attribute("data-run") for row in rows_of(browser)] == [str(needle)]
        assert not browser.find_elements(By.ID, "searched-to")
        # a search that stopped below created_after has nothing older to look at
        browser.get(
            base + "/runs?created_after=2100-01-01T00:00:00&payload=" + quote('{"needle": true}')
        )
        assert rows_of(browser) == []
        assert not browser.find_elements(By.ID, "searched-to")
        assert not browser.find_elements(By.ID, "older")


def test_each_worker_lists_its_runs_and_a_run_names_its_worker(
    browser: WebDriver, make_runlane: RunlaneFactory
) -> None:
    rl = make_runlane(queues=[*QUEUES, queue("hold")], tasks=[charge, hold_on])
    RELEASE.clear()
    held = rl.trigger(hold_on, None, queue="hold").id
    worker = rl.create_delivery_worker(concurrency=1, queues=["hold"])
    try:
        wait_until(lambda: rl.get_run(held).executing, timeout=15, what="the handler to start")
        worker_id = str(worker.worker_id)
        with served(create_app(rl)) as base:
            browser.get(base + "/workers")
            row = browser.find_element(By.ID, f"worker-{worker_id}")
            links = row.find_elements(By.CSS_SELECTOR, "td.held a")
            assert [a.text for a in links] == [str(held)]
            shot(browser, "worker-runs")
            click(browser, f"#worker-{worker_id} td.held a")
            assert browser.current_url == f"{base}/runs/{held}"
            named = text(browser, "#run-worker")
            host = rl.list_workers()[0].host
            assert named.startswith(f"{worker_id} on {host}")
            assert text(browser, "#run-host") == host
            click(browser, "#run-worker a")
            assert browser.current_url == f"{base}/workers?stopped=1#worker-{worker_id}"
            assert browser.find_element(By.ID, f"worker-{worker_id}").is_displayed()
    finally:
        RELEASE.set()
        worker.close(timeout=10)


def test_queues_of_finished_runs_are_listed_and_an_added_default_is_marked(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    """The queues page of a runtime that defines nothing (``runlane web --database-url``):
    a queue whose runs all finished is listed, and the default queue runlane added to the
    runtime is marked as known only from the database; an app's own default is not."""
    bare = make_runlane()
    SchemaDb(db, schema).run(
        "insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
        "max_attempts, due_at, started_at, finished_at) values (gen_random_uuid(), "
        "'default', 'old.task', 'archive', 'completed', jsonb_build_object(), 1, now(), "
        "now(), now())"
    )
    page = create_app(bare).test_client().get("/queues").get_data(as_text=True)
    rows = dict(re.findall(r'<tr data-queue="([^"]+)">(.*?)</tr>', page, re.DOTALL))
    assert set(rows) == {"archive", "default"}
    assert "(from the database)" in rows["archive"]
    assert "(from the database)" in rows["default"]
    assert "archive" in {q.name for q in bare.list_queues()}  # the rule list_queues reads
    app = make_runlane(queues=QUEUES, tasks=[charge])
    page = create_app(app).test_client().get("/queues").get_data(as_text=True)
    own = re.search(r'<tr data-queue="default">(.*?)</tr>', page, re.DOTALL)
    assert own is not None
    assert "(from the database)" not in own.group(1)


def test_runs_list_finds_from_the_cli(
    shop: dict[str, Any],
    database_url: str,
    schema: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = shop["ids"]
    for name in ("RUNLANE_DATABASE_URL", "RUNLANE_SCHEMA", "RUNLANE_ENVIRONMENT"):
        monkeypatch.delenv(name, raising=False)

    def runs(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["runs", "list", *argv, "--database-url", database_url, "--schema", schema])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, _ = runs("--task-prefix", "billing", "--json")
    assert code == 0
    assert {run["id"] for run in json.loads(out)["runs"]} == {
        str(ids["charge"]),
        str(ids["charge2"]),
        str(ids["refund"]),
    }
    code, out, _ = runs("--payload-contains", '{"customer": {"tier": "gold"}}')
    assert code == 0
    assert str(ids["charge"]) in out
    assert str(ids["charge2"]) not in out
    code, out, _ = runs("--idempotency-key", "order-42", "--queue-prefix", "oth", "--json")
    assert [run["id"] for run in json.loads(out)["runs"]] == [str(ids["other"])]
    # bad input: one line, exit 2
    code, _, err = runs("--payload-contains", "[1]")
    assert code == EXIT_CONFIGURATION
    assert err.strip().count("\n") == 0
    assert "payload_contains must be a JSON object" in err
    code, _, err = runs("--payload-contains", "{nope")
    assert code == EXIT_CONFIGURATION
    assert "--payload-contains is not valid JSON" in err
    code, _, err = runs("--task-prefix", "x", "--search-seconds", "0")
    assert code == EXIT_CONFIGURATION
    assert "search_seconds must be a number" in err
