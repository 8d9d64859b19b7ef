"""``/metrics`` (issue 39): scraped from the console, from ``runlane metrics --bind`` and from
runlane.metrics's WSGI app, and read back with prometheus-client's own parser.

Known data: queued runs in a paused queue whose oldest became due a known time ago (the
test's database clock moves), running and stopped workers, a live and an expired maintenance
band; the figures scraped are those.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from runlane import RetryPolicy, RunContext, Runlane, queue, task
from runlane.metrics import MISSING, wsgi_app
from runlane.postgres import postgres_polling_lane
from runlane.runtime import create_runlane
from runlane.testing import MovableClock
from runlane.web import create_app
from tests._optional import require
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb, closed_port, wait_until

parser = require("prometheus_client.parser", "prometheus-client")

ROOT = Path(__file__).resolve().parent.parent


@task(id="metrics.ok")
def ok(payload: Any, context: RunContext) -> Any:
    return payload


@task(id="metrics.boom", retry=RetryPolicy(max_attempts=1, initial_delay=timedelta(0)))
def boom(payload: Any, context: RunContext) -> None:
    raise RuntimeError("boom")


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parsed(text: str) -> tuple[dict[str, str], Samples]:
    """(type of each family, value of each sample by name and labels less environment)."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in parser.text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("environment") == "default"
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def known(make_runlane: RunlaneFactory, db: Conn, schema: str) -> Iterator[Runlane]:
    rl = make_runlane(queues=[queue("default", default=True), queue("mail")], tasks=[ok])
    sdb = SchemaDb(db, schema)
    old = [h.id for h in rl.trigger_many(ok, [{"n": n} for n in range(3)], queue="mail")]
    # due 90 s ago (by hand: the database clock moved by the clock fixture would also make
    # the worker registered below look lost until its first heartbeat)
    sdb.run(
        "update {schema}.runs set due_at = due_at - interval '90 seconds' where id = any(%s)",
        old,
    )
    rl.trigger(ok, {"n": 3}, queue="mail")
    rl.trigger(ok, {"later": True}, queue="mail", delay=3600)  # queued, not due
    rl.trigger(ok, {"n": 4})
    rl.drain(queues=["default"])  # completed: history, not depth
    rl.pause_queue("mail", reason="metrics test")
    gone = rl.create_delivery_worker(concurrency=1, queues=["default"])
    gone.close(timeout=5)
    worker = rl.create_delivery_worker(concurrency=2, queues=["default"])
    for band, hours, fencing in (("expiry", 1, 3), ("cleanup", -1, 1)):
        sdb.run(
            "insert into {schema}.maintenance_leases (environment, band, owner, fencing, "
            "expires_at, acquired_at) values ('default', %s, %s, %s, "
            "now() + %s * interval '1 hour', now())",
            band,
            uuid.uuid4(),
            fencing,
            hours,
        )
    try:
        wait_until(lambda: len(rl.list_workers()) == 1, timeout=10, what="the worker")
        yield rl
    finally:
        worker.close(timeout=5)


def check_known(text: str) -> None:
    types, samples = parsed(text)
    assert types["runlane_queue_runs"] == "gauge"
    assert value(samples, "runlane_queue_runs", queue="mail", status="queued") == 5
    assert value(samples, "runlane_queue_runs", queue="mail", status="running") == 0
    assert value(samples, "runlane_queue_runs", queue="default", status="queued") == 0
    assert value(samples, "runlane_queue_paused", queue="mail") == 1
    assert value(samples, "runlane_queue_paused", queue="default") == 0
    age = value(samples, "runlane_queue_oldest_queued_age_seconds", queue="mail")
    assert 90 <= age < 120, age
    assert value(samples, "runlane_queue_oldest_queued_age_seconds", queue="default") == 0
    assert value(samples, "runlane_workers", state="running") == 1
    assert value(samples, "runlane_workers", state="stopped") == 1
    assert value(samples, "runlane_workers", state="lost") == 0
    assert value(samples, "runlane_maintenance_band_live", band="expiry") == 1
    assert value(samples, "runlane_maintenance_band_live", band="cleanup") == 0
    assert value(samples, "runlane_maintenance_band_fencing_token", band="expiry") == 3


def test_the_console_serves_metrics_a_parser_reads(known: Runlane) -> None:
    answer = create_app(known).test_client().get("/metrics")
    assert answer.status_code == 200
    assert answer.content_type.startswith("text/plain; version=0.0.4")
    check_known(answer.get_data(as_text=True))


def test_throughput_and_histograms_come_from_the_rollup(
    make_runlane: RunlaneFactory, clock: MovableClock
) -> None:
    rl = make_runlane(queues=[queue("default", default=True), queue("mail")], tasks=[ok, boom])
    rl.trigger_many(ok, [{"n": n} for n in range(4)], queue="mail")
    rl.trigger(boom, None, queue="mail")
    rl.trigger(ok, {"other": True})  # another queue's run, still queued
    clock.advance(30)  # each mail run waits 30 s from due to start
    rl.drain(queues=["mail"])
    clock.advance(60)  # the minute they finished is a whole one before the current
    rl.run_maintenance_once()  # the stats band folds the rollup
    answer = create_app(rl).test_client().get("/metrics")
    types, samples = parsed(answer.get_data(as_text=True))
    for event, count in {
        "triggered": 5,
        "started": 5,
        "completed": 4,
        "failed": 1,
        "retried": 0,
        "cancelled": 0,
    }.items():
        assert value(samples, "runlane_queue_window_runs", queue="mail", event=event) == count
    assert value(samples, "runlane_queue_window_runs", queue="default", event="triggered") == 1
    assert types["runlane_queue_wait_seconds"] == "histogram"  # a gauge histogram, as text
    wait = {
        le: value(samples, "runlane_queue_wait_seconds_bucket", queue="mail", le=le)
        for le in ("16.384", "32.768", "+Inf")
    }
    assert wait == {"16.384": 0, "32.768": 5, "+Inf": 5}
    assert value(samples, "runlane_queue_wait_seconds_gcount", queue="mail") == 5
    assert 150 <= value(samples, "runlane_queue_wait_seconds_gsum", queue="mail") < 165
    quick = value(samples, "runlane_queue_run_seconds_bucket", queue="mail", le="16.384")
    assert quick == 5
    assert value(samples, "runlane_queue_run_seconds_bucket", queue="default", le="+Inf") == 0


def test_openmetrics_when_the_scraper_asks(known: Runlane) -> None:
    openmetrics = require("prometheus_client.openmetrics.parser", "prometheus-client")
    client = create_app(known).test_client()
    answer = client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert answer.content_type.startswith("application/openmetrics-text")
    families = {
        f.name: f for f in openmetrics.text_string_to_metric_families(answer.get_data(as_text=True))
    }
    assert "runlane_queue_runs" in families


def test_the_blueprint_serves_metrics_under_its_prefix(known: Runlane) -> None:
    from flask import Flask  # noqa: PLC0415

    from runlane.web import blueprint  # noqa: PLC0415

    app = Flask("shop")
    app.register_blueprint(blueprint(known), url_prefix="/ops")
    answer = app.test_client().get("/ops/metrics")
    assert answer.status_code == 200
    check_known(answer.get_data(as_text=True))


def test_without_prometheus_client_metrics_is_one_line_501(
    known: Runlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    answer = create_app(known).test_client().get("/metrics")
    assert answer.status_code == 501
    assert answer.get_data(as_text=True) == MISSING + "\n"
    assert "pip install 'runlane[metrics]'" in MISSING
    # the console's pages do not need it
    assert create_app(known).test_client().get("/queues").status_code == 200


def test_an_unreachable_database_is_a_one_line_503(schema: str) -> None:
    url = f"postgresql://runlane:s3cret-pw@127.0.0.1:{closed_port()}/nowhere"
    dead = create_runlane(
        lane=postgres_polling_lane(connection_string=url, schema=schema, connect_timeout=1)
    )
    try:
        statuses: list[str] = []
        body = b"".join(
            wsgi_app(dead)({"PATH_INFO": "/metrics"}, lambda status, _: statuses.append(status))
        ).decode()
        assert statuses == ["503 Service Unavailable"]
        assert body.count("\n") == 1
        assert "cannot be read now" in body
        assert "s3cret" not in body
        answer = create_app(dead).test_client().get("/metrics")
        assert answer.status_code == 503
        assert answer.get_data(as_text=True) == body
        dead.close()
        answer = create_app(dead).test_client().get("/metrics")
        assert answer.status_code == 503
        assert answer.get_data(as_text=True) == "runlane's runtime behind /metrics was closed\n"
    finally:
        dead.close()


SERVE = """
import argparse, sys
from runlane.cli import load_app
from runlane.cli._metrics import add_metrics_command
parser = argparse.ArgumentParser()
add_metrics_command(parser.add_subparsers(dest="command"), load_app)
args = parser.parse_args(sys.argv[1:])
sys.exit(args.handler(args))
"""


def test_runlane_metrics_serves_it_alone(known: Runlane, database_url: str, schema: str) -> None:
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    port = closed_port()
    process = subprocess.Popen(
        [
            *(sys.executable, "-c", SERVE, "metrics", "--database-url", database_url),
            *("--schema", schema, "--bind", f"127.0.0.1:{port}"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        assert f"http://127.0.0.1:{port}/metrics" in process.stdout.readline()
        scraped: list[str] = []

        def answered() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    scraped.append(r.read().decode())
            except OSError:
                return False
            return True

        wait_until(answered, timeout=15, what="runlane metrics to answer")
        _, samples = parsed(scraped[-1])
        # a runtime made from the URL alone: no tasks, the same figures from the database
        assert value(samples, "runlane_queue_runs", queue="mail", status="queued") == 5
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/runs", timeout=5)
        assert missing.value.code == 404
        missing.value.close()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=15)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            assert process.stdout is not None
            process.stdout.close()
    assert code == 0


def test_bad_input_to_runlane_metrics_is_one_error_line(
    cli_target: list[str], taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from runlane.cli import EXIT_CONFIGURATION, main  # noqa: PLC0415

    cases = {
        ("--bind", "9464"): "--bind must be HOST:PORT",
        ("--threads", "0"): "--threads",
        ("--bind", f"127.0.0.1:{taken_port}"): "the address is in use",
    }
    for options, needle in cases.items():
        capsys.readouterr()
        assert main(["metrics", *cli_target, *options]) == EXIT_CONFIGURATION
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("runlane: error: "), err
        assert needle in lines[0], err
