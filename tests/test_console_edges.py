"""The console's and ``runlane web``'s unclear cases of issue 37, each now a clear
behaviour (docs/console.md, docs/bad-input.md): time filters at the ends of the calendar,
``authorize`` hooks raising ``BaseException``, a *Run now* nonce sent again for another
schedule, ``--bind`` addresses waitress cannot listen on, and counts of one.

Console requests go through Flask's test client, as a browser would send them (the CSRF
cookie and token included)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
import urllib.parse
from collections.abc import Callable
from datetime import UTC, timedelta
from typing import Any

import pytest
from flask import Request
from flask.testing import FlaskClient

from runlane import RetryPolicy, RunContext, Runlane, RunStatus, schedule, task
from runlane.cli import EXIT_CONFIGURATION, main
from runlane.web import create_app
from runlane.web._security import CSRF_COOKIE, CSRF_FIELD
from tests.conftest import RunlaneFactory

ONCE = RetryPolicy(max_attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0), jitter=0)
SECRET = "console-edges-secret"
SEED = "s" * 32  # a CSRF cookie value the test sets itself

LATE = "9999-12-31T23:59:59-14:00"  # 10000-01-01T13:59:59 in UTC
EARLY = "0001-01-01T00:00:00+14:00"  # 0000-12-31T10:00:00 in UTC


@task(id="edges.fail", retry=ONCE)
def fail(payload: Any, context: RunContext) -> None:
    raise RuntimeError("always")


@task(id="edges.ok")
def ok(payload: Any, context: RunContext) -> Any:
    return payload


FIRST = schedule(id="edges.first", task=ok, cron="0 3 * * *", payload={"from": "first"})
SECOND = schedule(id="edges.second", task=ok, cron="0 4 * * *", payload={"from": "second"})


def everyone(request: Request, action: str) -> bool:
    return True


def client_of(rl: Runlane, authorize: Callable[[Request, str], bool] | None) -> FlaskClient:
    app = create_app(rl, authorize=authorize)
    app.secret_key = SECRET
    client = app.test_client()
    client.set_cookie(CSRF_COOKIE, SEED)
    return client


def token() -> str:
    return hmac.new(SECRET.encode(), SEED.encode(), hashlib.sha256).hexdigest()


def post(client: FlaskClient, path: str, **form: str) -> Any:
    return client.post(path, data={CSRF_FIELD: token(), **form})


@pytest.fixture
def failed(make_runlane: RunlaneFactory) -> tuple[Runlane, Any]:
    """A runtime with one failed run."""
    rl = make_runlane(tasks=[fail, ok], schedules=[FIRST, SECOND])
    handle = rl.trigger(fail, {"n": 1})
    rl.drain()
    assert rl.get_run(handle.id).status is RunStatus.FAILED
    return rl, handle


# -- time filters at the ends of the calendar ------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        ("created_before", LATE, True),
        ("created_after", LATE, False),
        ("created_before", EARLY, False),
        ("created_after", EARLY, True),
    ],
    ids=["before-late", "after-late", "before-early", "after-early"],
)
def test_time_filters_past_the_ends_of_the_calendar_are_filters(
    failed: tuple[Runlane, Any],
    case: tuple[str, str, bool],
    cli_target: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A time whose UTC instant is outside years 1 to 9999 filters as the CLI does (it
    matches every run or none) instead of a 500 page from an OverflowError; the CLI and the
    console read it with the same function, and count the same runs."""
    name, value, listed = case
    rl, handle = failed
    client = client_of(rl, everyone)
    query = urllib.parse.urlencode({name: value})
    runs = client.get(f"/runs?{query}")
    assert runs.status_code == 200
    assert (str(handle.id)[:8] in runs.get_data(as_text=True)) is listed

    bulk = client.get(f"/runs/bulk?action=retry&{query}")
    assert bulk.status_code == 200
    page = bulk.get_data(as_text=True)
    expected = "<b>1</b> run matches" if listed else "<b>0</b> runs match"
    assert expected in page
    # the filter travels on in the form and the links, as given
    assert f'name="{name}" value="{value}"' in page or not listed

    capsys.readouterr()
    option = "--" + name.replace("_", "-")
    code = main(["runs", "retry", option, value, "--dry-run", *cli_target])
    assert code == 0
    assert capsys.readouterr().out.strip() == ("1 run matches" if listed else "0 runs match")

    if listed:
        applied = post(client, "/runs/bulk", action="retry", **{name: value})
        assert applied.status_code == 303
        assert rl.get_run(handle.id).status is RunStatus.QUEUED
        after = client.get(applied.headers["Location"])
        assert after.status_code == 200
        assert "1 of 1 matching run changed." in after.get_data(as_text=True)


def test_a_fraction_of_a_second_travels_with_a_bulk_filter(
    failed: tuple[Runlane, Any],
) -> None:
    """The confirmation's form carries the time it counted with, to the microsecond (it
    was cut to the second: the action could take runs the count had left out)."""
    rl, handle = failed
    # a second before the run, so it matches and the confirmation shows its form
    created = (rl.get_run(handle.id).created_at - timedelta(seconds=1)).replace(microsecond=123456)
    stamp = created.strftime("%Y-%m-%dT%H:%M:%S.%f%z")
    client = client_of(rl, everyone)
    page = client.get(
        "/runs/bulk?" + urllib.parse.urlencode({"action": "retry", "created_after": stamp})
    ).get_data(as_text=True)
    utc = created.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.123456")
    assert f'name="created_after" value="{utc}"' in page


# -- authorize raising BaseException ---------------------------------------------------------


@pytest.mark.parametrize(
    "raised",
    [SystemExit(3), GeneratorExit(), KeyboardInterrupt()],
    ids=["SystemExit", "GeneratorExit", "KeyboardInterrupt"],
)
def test_an_authorize_hook_raising_a_base_exception_refuses(
    failed: tuple[Runlane, Any], raised: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    """On a request thread (as waitress and ``flask run`` serve), anything authorize
    raises refuses the action with 403 and is logged; the request gets its answer."""
    rl, handle = failed

    def hostile(request: Request, action: str) -> bool:
        raise raised

    client = client_of(rl, hostile)
    answers: dict[str, Any] = {}

    def serve() -> None:
        answers["page"] = client.get(f"/runs/{handle.id}")
        answers["retry"] = post(client, f"/runs/{handle.id}/retry")

    with caplog.at_level(logging.ERROR, logger="runlane.web"):
        thread = threading.Thread(target=serve)
        thread.start()
        thread.join(30)
    assert answers["page"].status_code == 200
    assert 'action="/runs/' not in answers["page"].get_data(as_text=True)  # no button
    assert answers["retry"].status_code == 403
    assert "does not allow retry" in answers["retry"].get_data(as_text=True)
    assert rl.get_run(handle.id).status is RunStatus.FAILED
    assert "authorize(request, 'retry') raised: the action is refused" in caplog.text
    assert type(raised).__name__ in caplog.text


def test_a_ctrl_c_on_the_main_thread_stops_a_single_threaded_server(
    failed: tuple[Runlane, Any],
) -> None:
    rl, handle = failed

    def interrupted(request: Request, action: str) -> bool:
        raise KeyboardInterrupt

    client = client_of(rl, interrupted)
    with pytest.raises(KeyboardInterrupt):
        post(client, f"/runs/{handle.id}/retry")
    assert rl.get_run(handle.id).status is RunStatus.FAILED


# -- Run now --------------------------------------------------------------------------------


def _run_of(response: Any) -> tuple[str, str]:
    assert response.status_code == 303, response.get_data(as_text=True)
    location = urllib.parse.urlsplit(response.headers["Location"])
    run_id = location.path.rsplit("/", 1)[-1]
    return run_id, urllib.parse.parse_qs(location.query)["done"][0]


def test_a_run_now_nonce_is_bound_to_its_schedule(failed: tuple[Runlane, Any]) -> None:
    """The same form nonce sent for another schedule of the same task makes that
    schedule's run (it returned the first schedule's run, and said it was created)."""
    rl, _ = failed
    client = client_of(rl, everyone)
    nonce = "n" * 24
    first, done = _run_of(post(client, "/schedules/run", id=FIRST.id, nonce=nonce))
    assert done == "triggered"
    second, done = _run_of(post(client, "/schedules/run", id=SECOND.id, nonce=nonce))
    assert second != first
    assert done == "triggered"
    assert rl.get_run(first).payload == {"from": "first"}
    assert rl.get_run(second).payload == {"from": "second"}
    # the same form sent twice: one run, and the page says so
    again, done = _run_of(post(client, "/schedules/run", id=FIRST.id, nonce=nonce))
    assert (again, done) == (first, "triggered_before")
    page = client.get(f"/runs/{first}?done=triggered_before").get_data(as_text=True)
    assert "This form was sent before: the run it created then is shown." in page
    assert len(rl.list_runs(task="edges.ok").runs) == 2


# -- runlane web --bind -------------------------------------------------------------------------


def test_runlane_web_cannot_listen_is_one_error_line(
    cli_target: list[str], taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = {
        "no-such-host.invalid:8080": "the host does not resolve to an address",
        f"127.0.0.1:{taken_port}": "the address is in use",
        "192.0.2.1:8080": "cannot listen there (Cannot assign requested address)",
    }
    for bind, needle in cases.items():
        capsys.readouterr()
        code = main(["web", *cli_target, "--bind", bind])
        err = capsys.readouterr().err
        assert code == EXIT_CONFIGURATION, err
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"runlane: error: --bind '{bind}': {needle}"), err
        assert "Traceback" not in err


def test_counts_of_one_read_as_one(failed: tuple[Runlane, Any]) -> None:
    rl, _ = failed
    client = client_of(rl, everyone)
    page = client.get("/runs/bulk?action=retry&status=failed").get_data(as_text=True)
    assert "<b>1</b> run matches" in page
    assert re.search(r'id="confirm" class="danger">Retry 1 run</button>', page)
    app = create_app(rl)
    app.config["RUNLANE_REFRESH_SECONDS"] = 1
    footer = app.test_client().get("/queues").get_data(as_text=True)
    assert "This page updates in place every 1 second." in footer
