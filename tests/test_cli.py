"""The long-running commands as a process supervisor sees them: signals and exit codes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from runlane import RunContext, RunStatus, create_runlane, task
from runlane.cli import main
from runlane.postgres import postgres_polling_lane

APP = textwrap.dedent(
    """
    import os, sys, threading
    from datetime import timedelta
    from runlane import RunContext, create_runlane, task
    from runlane.postgres import postgres_polling_lane

    @task(id="cli.echo")
    def echo(payload, context: RunContext):
        if isinstance(payload, dict) and payload.get("hang"):
            print(f"hanging {context.run_id}", file=sys.stderr, flush=True)
            threading.Event().wait(600)  # until the process is killed
        if isinstance(payload, dict) and payload.get("until"):
            print(f"waiting {context.run_id}", file=sys.stderr, flush=True)
            while not os.path.exists(payload["until"]):
                threading.Event().wait(0.05)
            context.step("after-freeze", lambda: "zombie")  # fenced: must be refused
            return "zombie"
        return payload

    runlane = create_runlane(
        lane=postgres_polling_lane(
            connection_string=os.environ["APP_DATABASE_URL"],
            schema=os.environ["APP_SCHEMA"],
            lease_duration=timedelta(seconds=float(os.environ.get("APP_LEASE", "30"))),
        ),
        tasks=[echo],
    )
    """
)


@contextmanager
def _spawn(
    tmp_path: Path, database_url: str, schema: str, *args: str, lease: float = 30
) -> Iterator[subprocess.Popen[str]]:
    (tmp_path / "cliapp.py").write_text(APP)
    env = {
        **os.environ,
        "APP_DATABASE_URL": database_url,
        "APP_SCHEMA": schema,
        "APP_LEASE": str(lease),
    }
    with subprocess.Popen(
        [sys.executable, "-m", "runlane.cli", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def _wait_for_line(proc: subprocess.Popen[str], *needles: str) -> str:
    """Read stderr until a line holds one of ``needles``; returns that line."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if any(needle in line for needle in needles):
            return line
    pytest.fail(f"the command exited without printing any of {needles!r}")


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_worker_runs_and_closes_cleanly_on_a_signal(
    tmp_path: Path, database_url: str, schema: str, stop: signal.Signals
) -> None:
    @task(id="cli.echo")
    def echo(payload: object, context: RunContext) -> object:
        return payload  # the worker process runs its own copy of this task

    producer = create_runlane(
        lane=postgres_polling_lane(connection_string=database_url, schema=schema), tasks=[echo]
    )
    args = ("worker", "cliapp:runlane", "--concurrency", "2")
    with _spawn(tmp_path, database_url, schema, *args) as proc:
        try:
            _wait_for_line(proc, "SIGTERM or Ctrl-C stops it")
            handle = producer.trigger(echo, {"hello": "cli"})
            done = producer.wait_for_run(handle.id, timeout=30)
            assert done.status is RunStatus.COMPLETED
            assert done.output == {"hello": "cli"}
        finally:
            producer.close()
            proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr is not None
        assert f"{stop.name} received" in proc.stderr.read()
    with psycopg.connect(database_url, autocommit=True) as conn:
        alive = conn.execute(
            "select count(*) from pg_stat_activity where application_name like 'runlane-worker-%'"
        ).fetchone()
    assert alive == (0,)


def test_worker_exits_non_zero_when_the_worker_fails(
    tmp_path: Path, database_url: str, fresh_schema: str
) -> None:
    # an unmigrated schema: the first claim fails for an infrastructure reason
    with _spawn(tmp_path, database_url, fresh_schema, "worker", "cliapp:runlane") as proc:
        code = proc.wait(timeout=60)
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert code == 1
    assert "WorkerFailed" in err
    assert "runlane migrate" in err


def test_maintenance_closes_cleanly_on_sigterm(
    tmp_path: Path, database_url: str, schema: str
) -> None:
    with _spawn(tmp_path, database_url, schema, "maintenance", "cliapp:runlane") as proc:
        try:
            _wait_for_line(proc, "SIGTERM or Ctrl-C stops it")
        finally:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    with psycopg.connect(database_url, autocommit=True) as conn:
        live = conn.execute(
            sql.SQL(
                "select count(*) from {}.maintenance_leases where expires_at > clock_timestamp()"
            ).format(sql.Identifier(schema))
        ).fetchone()
    assert live == (0,)  # the bands' leases were released on the way out


def test_unknown_queue_and_bad_app_exit_non_zero(
    tmp_path: Path, database_url: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cliapp.py").write_text(APP)
    os.environ["APP_DATABASE_URL"], os.environ["APP_SCHEMA"] = database_url, schema
    sys.path.insert(0, str(tmp_path))
    try:
        assert main(["worker", "cliapp:runlane", "--queues", "nope"]) == 1
        assert "unknown queues ['nope']" in capsys.readouterr().err
        with pytest.raises(SystemExit, match="has no attribute"):
            main(["worker", "cliapp:missing"])
        with pytest.raises(SystemExit, match="module:attribute"):
            main(["drain", "cliapp"])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cliapp", None)
        del os.environ["APP_DATABASE_URL"], os.environ["APP_SCHEMA"]


def test_a_killed_worker_loses_no_run(tmp_path: Path, database_url: str, schema: str) -> None:
    """SIGKILL mid-run: the lease lapses, maintenance retries the run, another worker
    completes it, and the dead worker's attempt is recorded as expired."""

    @task(id="cli.echo")
    def echo(payload: object, context: RunContext) -> object:
        return payload

    lane = postgres_polling_lane(connection_string=database_url, schema=schema)
    survivor = create_runlane(lane=lane, tasks=[echo])
    try:
        handle = survivor.trigger(echo, {"hang": True})
        with _spawn(tmp_path, database_url, schema, "worker", "cliapp:runlane", lease=1) as proc:
            _wait_for_line(proc, f"hanging {handle.id}")
            proc.kill()  # SIGKILL: no shutdown, no hand-back, connections simply vanish
            assert proc.wait(timeout=30) == -signal.SIGKILL
        assert survivor.get_run(handle.id).status is RunStatus.RUNNING
        deadline = time.monotonic() + 30
        while survivor.run_maintenance_once().attempts_expired == 0:  # lease: 1 s
            assert time.monotonic() < deadline, "the dead worker's lease never lapsed"
            time.sleep(0.2)
        survivor.run_maintenance_once()  # the retry is due at once (RetryPolicy default 1 s)
        deadline = time.monotonic() + 30
        while survivor.get_run(handle.id).status is not RunStatus.QUEUED:
            assert time.monotonic() < deadline, "the retry was never delivered"
            time.sleep(0.2)
            survivor.run_maintenance_once()
        # the survivor's handler does not hang: it returns the payload
        assert survivor.drain().runs_executed == 1
        done = survivor.get_run(handle.id)
        assert done.status is RunStatus.COMPLETED
        assert done.attempt == 2
        assert done.output == {"hang": True}
    finally:
        survivor.close()


def test_a_frozen_worker_resumed_after_a_takeover_changes_nothing(
    tmp_path: Path, database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    """SIGSTOP past the lease, another worker takes the run over and completes it, SIGCONT:
    the zombie's step write and its completion are both rejected by fencing."""

    @task(id="cli.echo")
    def echo(payload: dict[str, str], context: RunContext) -> str:
        context.step("after-freeze", lambda: "survivor")
        return "survivor"

    lane = postgres_polling_lane(connection_string=database_url, schema=schema)
    survivor = create_runlane(lane=lane, tasks=[echo])
    flag = tmp_path / "go"
    try:
        handle = survivor.trigger(echo, {"until": str(flag)})
        with _spawn(tmp_path, database_url, schema, "worker", "cliapp:runlane", lease=1) as proc:
            _wait_for_line(proc, f"waiting {handle.id}")
            proc.send_signal(signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 30
                while survivor.get_run(handle.id).status is not RunStatus.QUEUED:
                    assert time.monotonic() < deadline, "the frozen worker's run was not retried"
                    time.sleep(0.2)
                    survivor.run_maintenance_once()
                assert survivor.drain().runs_executed == 1
            finally:
                flag.write_text("go")
                proc.send_signal(signal.SIGCONT)
            # the zombie resumes and is refused either way round: its step raises StaleLease
            # and the writer rejects the failure write as stale, or its lease extension is
            # refused first and the attempt's result is discarded
            _wait_for_line(proc, "rejected as stale", "lost its lease")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        done = survivor.get_run(handle.id)
        assert done.status is RunStatus.COMPLETED
        assert done.output == "survivor"
        assert done.attempt == 2
        steps = db.execute(
            sql.SQL("select output from {}.steps where run_id = %s").format(sql.Identifier(schema)),
            (handle.id,),
        ).fetchall()
        assert steps == [("survivor",)]
    finally:
        survivor.close()
