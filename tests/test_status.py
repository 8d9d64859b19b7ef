"""The monitoring view: per-queue counts, waiting runs, tombstones' children, and
``runlane status`` exiting non-zero (naming the check) when a check is unhealthy."""

from __future__ import annotations

import importlib
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from runlane import (
    MaintenanceLimits,
    QueueStatus,
    RunContext,
    RunStatus,
    queue,
    task,
)
from runlane._operator.status import format_report, unhealthy
from runlane.cli import EXIT_FAILURE, main
from tests.conftest import RunlaneFactory
from tests.helpers import SchemaDb, importable_app, storage_of, wait_until

APP = textwrap.dedent(
    """
    import os
    from runlane import create_runlane, queue, task

    @task(id="status.echo", queue="mail")
    def echo(payload, context):
        return payload

    runlane = create_runlane(
        lane=__import__("runlane.postgres").postgres.postgres_polling_lane(
            connection_string=os.environ["APP_DATABASE_URL"], schema=os.environ["APP_SCHEMA"]
        ),
        queues=[queue("mail", concurrency_limit=2), queue("default", default=True)],
        tasks=[echo],
    )
    """
)


@task(id="status.echo", queue="mail")
def echo(payload: Any, context: RunContext) -> Any:
    return payload


@pytest.fixture
def app(tmp_path: Path, database_url: str, schema: str) -> Iterator[dict[str, str]]:
    """``cliapp:runlane`` importable in this process and in subprocesses."""
    with importable_app(tmp_path, APP, database_url, schema) as env:
        yield env


def test_status_counts_per_queue(make_runlane: RunlaneFactory, db: Any, schema: str) -> None:
    rl = make_runlane(
        queues=[queue("mail", concurrency_limit=2), queue("default", default=True)],
        tasks=[echo],
    )
    handles = rl.trigger_many(echo, [{"n": i} for i in range(5)])
    sdb = SchemaDb(db, schema)
    sdb.run(
        "update {schema}.runs set status = 'retrying', due_at = now() + interval '1 hour' "
        "where id = %s",
        handles[0].id,
    )
    sdb.run(
        "update {schema}.runs set status = 'waiting', wait_kind = 'sleep', "
        "due_at = now() + interval '1 hour' where id = %s",
        handles[1].id,
    )
    sdb.run(
        "update {schema}.runs set status = 'running', attempt = 1, lease_token = "
        "gen_random_uuid(), lease_expires_at = now() + interval '1 minute', "
        "attempt_started_at = now(), started_at = now(), started_attempt = 1 where id = %s",
        handles[2].id,
    )
    sdb.run(
        "update {schema}.runs set pruned_at = now(), remaining_children = 3, "
        "status = 'completed', finished_at = now() where id = %s",
        handles[3].id,
    )
    report = rl.status()
    assert report.queues == (
        QueueStatus("default", 0, 0, 0, 0, 0, None),
        QueueStatus(
            "mail",
            queued=1,
            running=1,
            retrying=1,
            waiting=1,
            live_leases=1,
            concurrency_limit=2,
        ),
    )
    assert report.waiting == 1
    assert report.tombstones_with_children == 1
    assert report.tombstone_remaining_children == 3
    # deferred work and no maintenance owner: unhealthy
    assert any("no maintenance band has a live owner" in p for p in unhealthy(report))


def status(*options: str) -> int:
    sys.modules.pop("cliapp", None)  # a fresh runtime: the command closes the one it used
    return main(["status", "cliapp:runlane", *options])


def test_status_command_exits_non_zero_and_names_the_check(
    app: dict[str, str], db: Any, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert status() == 0
    out = capsys.readouterr()
    assert "mail" in out.out
    assert "0/2" in out.out  # live leases against the limit
    assert "unhealthy" not in out.err

    runlane = importlib.import_module("cliapp").runlane

    runlane.start()  # the command closed it
    handle = runlane.trigger("status.echo", {"x": 1})
    runlane.close()
    SchemaDb(db, schema).run(
        "update {schema}.runs set status = 'retrying', due_at = now() - interval '1 minute' "
        "where id = %s",
        handle.id,
    )
    assert status() == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "runlane: unhealthy: 1 retrying or released run is past due" in err
    assert "no maintenance band has a live owner" in err
    assert status("--json") == EXIT_FAILURE
    printed = capsys.readouterr().out
    assert '"unhealthy": [' in printed
    assert '"tombstone_remaining_children": 0' in printed


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_status_watch_refreshes_until_interrupted(
    app: dict[str, str], stop: signal.Signals
) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "runlane.cli", "status", "cliapp:runlane", "--watch", "0.1"],
        env=app,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        reports = 0
        for line in proc.stdout:
            if line.startswith("environment "):
                reports += 1
                if reports == 3:
                    break
        proc.send_signal(stop)
        # read on, as a terminal would: a report blocked on a full pipe cannot stop. Through
        # the same file object, to the end: communicate() reads the pipe itself and would
        # miss what the loop above had already buffered (the rest of the third report)
        out = proc.stdout.read()
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in err
        assert not out or out.endswith("\n\n")  # it stopped between two reports


def test_watch_takes_a_positive_number(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit) as exited:
            main(["status", "m:a", "--watch", bad])
        assert exited.value.code == 2
        assert "--watch" in capsys.readouterr().err


@task(id="status.wait_on_token")
def wait_on_token(payload: Any, context: RunContext) -> Any:
    return context.wait_for_token(payload["token"])


def test_resolved_tokens_report_their_waiting_runs_so_a_stuck_one_shows(
    make_runlane: RunlaneFactory, db: Any, schema: str
) -> None:
    """Seed: alert on terminal tokens whose waiting-run count does not fall. status() counts
    the runs waiting on resolved tokens and names the tokens holding the most, so one
    token's stuck backlog is told from one that maintenance is draining."""
    rl = make_runlane(tasks=[wait_on_token])
    big, small = rl.create_wait_token(), rl.create_wait_token()
    rl.trigger_many(wait_on_token, [{"token": str(big.id)}] * 3 + [{"token": str(small.id)}])
    assert rl.drain().runs_executed == 4
    assert rl.status().resolved_tokens == ()
    # both tokens resolve while their eager resume does not happen (as when it failed)
    sdb = SchemaDb(db, schema)
    sdb.run(
        "update {schema}.wait_tokens set status = 'completed', resolved_at = now() "
        "- interval '2 minutes', output = '1' where id = any(%s)",
        [big.id, small.id],
    )
    report = rl.status()
    assert report.resolved_tokens_with_waiting_runs == 2
    assert report.runs_waiting_on_resolved_tokens == 4
    assert [(t.token_id, t.waiting_runs) for t in report.resolved_tokens] == [
        (big.id, 3),
        (small.id, 1),
    ]
    assert report.resolved_tokens[0].resolved_age_seconds >= 119
    (problem,) = [p for p in unhealthy(report) if "resolved wait tokens" in p]
    assert "2 resolved wait tokens still have 4 waiting runs" in problem
    assert f"most: token {big.id}, 3 runs" in problem
    # a maintenance pass that resumes two runs: the counts fall (draining, not stuck)
    rl.run_maintenance_once(MaintenanceLimits(wait_token_resume_limit=2))
    after = rl.status()
    assert after.runs_waiting_on_resolved_tokens == 2
    assert sum(t.waiting_runs for t in after.resolved_tokens) == 2
    rl.run_maintenance_once()
    final = rl.status()
    assert (final.runs_waiting_on_resolved_tokens, final.resolved_tokens) == (0, ())
    assert not [p for p in unhealthy(final) if "resolved wait tokens" in p]


def test_running_tells_executing_runs_from_ones_only_claimed(
    make_runlane: RunlaneFactory,
) -> None:
    """A worker's claim puts runs in ``running`` before their handlers start (prefetch, or a
    claim in flight): status() and list_runs tell the two apart once the worker has
    recorded its handler's start."""
    began, release = threading.Event(), threading.Event()

    @task(id="status.slow")
    def slow(payload: Any, context: RunContext) -> int:
        began.set()
        release.wait(30)
        return int(payload["n"])

    rl = make_runlane(tasks=[slow])
    first, second = rl.trigger_many(slow, [{"n": 1}, {"n": 2}])
    worker = rl.create_delivery_worker(concurrency=1)
    try:
        assert began.wait(15)
        # another claimer (a worker claiming ahead of its slots) holds the second run
        (held,) = storage_of(rl).run_claim(rl.environment, ["default"], 1, timedelta(minutes=1))
        assert held.id == second.id

        def split() -> bool:
            report = rl.status()
            return (report.running, report.claimed_not_started) == (2, 1)

        wait_until(
            split,
            timeout=10,
            what="the worker to record its handler's start",
            state=lambda: (rl.status().running, rl.status().claimed_not_started),
        )
        report = rl.status()
        assert report.running == 2
        assert "of which claimed, not started" in "\n".join(format_report(report))
        page = rl.list_runs(status="running")
        assert {(s.id, s.executing, s.claimed_not_started) for s in page.runs} == {
            (first.id, True, False),
            (second.id, False, True),
        }
        assert rl.get_run(first.id).executing
        assert rl.get_run(second.id).claimed_not_started
    finally:
        release.set()
        worker.close(timeout=10)
    done = rl.get_run(first.id)
    assert (done.status, done.executing, done.claimed_not_started) == (
        RunStatus.COMPLETED,
        False,
        False,
    )
