"""``runlane maintenance APP [--once] --limit NAME=N``: a pass's budget from the command line
(``MaintenanceLimits``), for the bounded pass and for the services alike; bad settings are
usage errors before anything runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from runlane import RunStatus, WaitTokenStatus
from runlane.cli import main
from tests.helpers import (
    SchemaDb,
    fresh_app_runtime,
    importable_app,
    in_process_cli,
    job_app,
    statuses,
    wait_until,
)

APP = job_app("limits.job")

NAMES = (
    "schedule_limit, due_delivery_limit, wait_token_timeout_limit, wait_token_resume_limit, "
    "attempt_expiry_limit, delivery_recovery_limit, cleanup_limit, stats_minutes, "
    "outbox_publish_limit"
)


@pytest.fixture
def app(tmp_path: Path, database_url: str, schema: str) -> Iterator[dict[str, str]]:
    """``cliapp:runlane`` importable here (fresh for each import) and in subprocesses."""
    with importable_app(tmp_path, APP, database_url, schema) as env:
        yield env


def a_due_retry(db: Any, schema: str) -> Any:
    """A run retrying and past due: the next pass's due delivery queues it."""
    runtime = fresh_app_runtime()
    try:
        handle = runtime.trigger("limits.job", "ok", delay=3600)
    finally:
        runtime.close()
    SchemaDb(db, schema).run(
        "update {schema}.runs set status = 'retrying', due_at = now() - interval '1 second' "
        "where id = %s",
        handle.id,
    )
    return handle.id


def test_once_delivers_no_more_than_its_due_delivery_limit(
    app: dict[str, str], db: Any, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    runtime = fresh_app_runtime()
    try:
        runtime.trigger_many("limits.job", ["retry"] * 3)
        assert runtime.drain().retried == 3
    finally:
        runtime.close()
    SchemaDb(db, schema).run(
        "update {schema}.runs set due_at = now() - interval '1 second' where status = 'retrying'"
    )
    cli = in_process_cli(capsys)
    code, out, err = cli(
        "maintenance", "cliapp:runlane", "--once", "--limit", "due_delivery_limit=1"
    )
    assert (code, err) == (0, "")
    counts = dict(line.split() for line in out.splitlines())
    assert counts["due_runs_delivered"] == "1", out
    assert statuses(db, schema) == {"queued": 1, "retrying": 2}

    # the same budget with the counts as a JSON record
    code, out, err = cli(
        "maintenance", "cliapp:runlane", "--once", "--limit=due_delivery_limit=1",
        "--log-format", "json",
    )  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in err.splitlines()]
    done = [r for r in records if r["message"] == "maintenance pass done"]
    assert len(done) == 1, records
    assert done[0]["due_runs_delivered"] == 1
    assert statuses(db, schema) == {"queued": 2, "retrying": 1}


BAD_LIMITS = [
    pytest.param(
        "--limit due_delivery=1",
        f"unknown limit 'due_delivery' (did you mean due_delivery_limit?); expected one of {NAMES}",
        id="short-name",
    ),
    pytest.param(
        "--limit retry_limit=5",
        f"unknown limit 'retry_limit'; expected one of {NAMES}",
        id="unknown-name",
    ),
    pytest.param(
        "--limit due_delivery_limit=lots",
        "due_delivery_limit: expected an integer, got 'lots'",
        id="not-an-integer",
    ),
    pytest.param(
        "--limit due_delivery_limit=1.5",
        "due_delivery_limit: expected an integer, got '1.5'",
        id="a-fraction",
    ),
    pytest.param(
        "--limit due_delivery_limit=-1",
        "MaintenanceLimits.due_delivery_limit must be an integer from 0 to 2147483647, got -1",
        id="negative",
    ),
    pytest.param(
        "--limit outbox_publish_limit=0",
        "MaintenanceLimits.outbox_publish_limit must be an integer from 1 to 2147483647, got 0",
        id="refused-by-maintenance-limits",
    ),
    pytest.param(
        "--limit cleanup_limit=99999999999999999999",
        "MaintenanceLimits.cleanup_limit must be an integer from 0 to 2147483647, "
        "got 99999999999999999999",
        id="over-int32",
    ),
    pytest.param(
        "--limit due_delivery_limit",
        "expected NAME=N, got 'due_delivery_limit'",
        id="without-a-value",
    ),
    pytest.param(
        "--limit due_delivery_limit=",
        "due_delivery_limit: expected an integer, got ''",
        id="empty-value",
    ),
    pytest.param(
        "--limit due_delivery_limit=1 --limit cleanup_limit=5 --limit due_delivery_limit=1",
        "due_delivery_limit given twice (1 and 1)",
        id="same-name-twice",
    ),
]


@pytest.mark.usefixtures("app")
@pytest.mark.parametrize("once", [True, False], ids=["once", "services"])
@pytest.mark.parametrize(("given", "message"), BAD_LIMITS)
def test_a_bad_limit_is_a_usage_error_and_nothing_runs(
    db: Any,
    schema: str,
    capsys: pytest.CaptureFixture[str],
    *,
    given: str,
    message: str,
    once: bool,
) -> None:
    run_id = a_due_retry(db, schema)
    sys.modules.pop("cliapp", None)
    capsys.readouterr()
    argv = ["maintenance", "cliapp:runlane", *(["--once"] if once else []), *given.split()]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: runlane maintenance"), captured.err
    error = captured.err.splitlines()[-1]
    assert error == f"runlane maintenance: error: argument --limit: {message}"
    assert "cliapp" not in sys.modules  # APP was never imported, nothing connected
    status, leases = SchemaDb(db, schema).one(
        "select (select status from {schema}.runs where id = %s),"
        " (select count(*) from {schema}.maintenance_leases)",
        run_id,
    )
    assert (status, leases) == ("retrying", 0)


@pytest.mark.parametrize(
    "command", [["maintenance"], ["worker", "--with-maintenance"]], ids=["maintenance", "worker"]
)
def test_the_services_run_with_the_limits(
    app: dict[str, str], db: Any, schema: str, command: list[str]
) -> None:
    """``--limit due_delivery_limit=0`` on the services (of ``runlane maintenance``, or of a
    worker's ``--with-maintenance``): the delivery band times out a wait token past its
    timeout (the band's passes run) while the due retry it would deliver in the same pass,
    before the tokens, stays retrying (a worker claims only queued runs)."""
    run_id = a_due_retry(db, schema)
    runtime = fresh_app_runtime()
    try:
        token = runtime.create_wait_token(timeout=timedelta(hours=1))
        SchemaDb(db, schema).run(
            "update {schema}.wait_tokens set timeout_at = now() - interval '1 second' "
            "where id = %s",
            token.id,
        )
        argv = [sys.executable, "-m", "runlane.cli", command[0], "cliapp:runlane", *command[1:]]
        argv += ["--limit", "due_delivery_limit=0", "--limit", "cleanup_limit=7"]
        with subprocess.Popen(
            argv, env=app, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        ) as proc:
            try:
                assert proc.stderr is not None
                started = next(
                    (line for line in proc.stderr if "SIGTERM or Ctrl-C stops it" in line), ""
                )
                assert "with limits due_delivery_limit=0, cleanup_limit=7" in started, started
                wait_until(
                    lambda: runtime.get_wait_token(token.id).status is WaitTokenStatus.TIMED_OUT,
                    timeout=30,
                    what="the services' delivery band timing out the token",
                )
                assert runtime.get_run(run_id).status is RunStatus.RETRYING
            finally:
                proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            err = proc.stderr.read()
    finally:
        runtime.close()
    assert "Traceback" not in err
    # never delivered while the services ran
    assert SchemaDb(db, schema).one("select status from {schema}.runs") == ("retrying",)


def test_a_worker_refuses_limit_without_its_maintenance(
    app: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    cli = in_process_cli(capsys)
    code, _out, err = cli("worker", "cliapp:runlane", "--limit", "cleanup_limit=1")
    assert code == 2
    assert "--limit sets the budgets of the maintenance services --with-maintenance" in err
    assert "cliapp" not in sys.modules  # refused before APP was imported


@pytest.mark.parametrize("batch", ["0", "10001"])
def test_a_worker_passes_claim_batch_on(
    app: dict[str, str], capsys: pytest.CaptureFixture[str], batch: str
) -> None:
    # the worker's own check refuses it: the option reached create_delivery_worker
    cli = in_process_cli(capsys)
    code, _out, err = cli("worker", "cliapp:runlane", "--concurrency", "1", "--claim-batch", batch)
    assert code == 2, err
    assert "claim_batch" in err, err
