"""The long-running commands as a process supervisor sees them: signals and exit codes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from runlane import ConfigurationError, RunContext, RunStatus, create_runlane, task
from runlane.cli import (
    EXIT_CONFIGURATION,
    EXIT_FAILURE,
    EXIT_FORCED,
    _parser,
    load_app,
    main,
)
from runlane.logging import JsonFormatter
from runlane.postgres import postgres_polling_lane
from runlane.testing import MovableClock
from tests.helpers import cli_process, poll

APP = textwrap.dedent(
    """
    import os, signal, sys, threading
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

    def signal_from_this_thread(path):
        # the kernel hands a signal sent to the process to any of its threads: this one
        while not os.path.exists(path):
            threading.Event().wait(0.02)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    if os.environ.get("APP_SIGNAL_FILE"):
        threading.Thread(
            target=signal_from_this_thread, args=(os.environ["APP_SIGNAL_FILE"],), daemon=True
        ).start()
    """
)


def _spawn(
    tmp_path: Path,
    database_url: str,
    schema: str,
    *args: str,
    lease: float = 30,
    env: dict[str, str] | None = None,
) -> AbstractContextManager[subprocess.Popen[str]]:
    env = {"APP_LEASE": str(lease), **(env or {})}
    return cli_process(tmp_path, APP, database_url, schema, *args, env=env)


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


@pytest.mark.parametrize("command", ["worker", "maintenance"])
def test_unmigrated_schema_exits_at_once_with_the_migrate_hint(
    tmp_path: Path, database_url: str, fresh_schema: str, command: str
) -> None:
    """No thread starts and nothing is retried: one line naming the migrate step, exit 1."""
    started = time.monotonic()
    with _spawn(tmp_path, database_url, fresh_schema, command, "cliapp:runlane") as proc:
        code = proc.wait(timeout=60)
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert code == EXIT_FAILURE
    assert time.monotonic() - started < 20
    (line,) = [line for line in err.splitlines() if line.startswith("runlane: error: ")]
    assert "runlane migrate" in line
    assert fresh_schema in line
    assert "Traceback" not in err


def test_worker_exits_non_zero_when_the_worker_fails(
    tmp_path: Path, database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    # the schema disappears under a running worker: its next claim fails for good
    with _spawn(tmp_path, database_url, schema, "worker", "cliapp:runlane") as proc:
        _wait_for_line(proc, "SIGTERM or Ctrl-C stops it")
        # the drop locks every table while the worker's statements lock some: the server may
        # pick the drop as a deadlock's victim, and it is only this test's set-up
        for attempt in range(5):
            try:
                db.execute(sql.SQL("drop schema {} cascade").format(sql.Identifier(schema)))
                break
            except psycopg.errors.DeadlockDetected:
                if attempt == 4:
                    raise
        code = proc.wait(timeout=60)
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert code == EXIT_FAILURE
    assert [line for line in err.splitlines() if line.startswith("runlane: error: ")]
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


@pytest.mark.parametrize("command", ["worker", "maintenance"])
def test_a_stop_signal_handed_to_another_thread_closes_the_command(
    tmp_path: Path, database_url: str, schema: str, command: str
) -> None:
    """The kernel hands a signal sent to the process to any of its threads, and Python runs
    the handler on the main thread only once that thread runs Python code: a main thread
    waiting without a timeout never did (CI: maintenance still running 30 s after SIGTERM,
    its main thread in Services.wait_until_closed). Here SIGTERM goes to a thread of the
    app's own, never to the main thread."""
    go = tmp_path / "signal-now"
    app_env = {"APP_SIGNAL_FILE": str(go)}
    with _spawn(tmp_path, database_url, schema, command, "cliapp:runlane", env=app_env) as proc:
        _wait_for_line(proc, "SIGTERM or Ctrl-C stops it")
        go.touch()
        assert proc.wait(timeout=30) == 0
        assert proc.stderr is not None
        assert "SIGTERM received; closing" in proc.stderr.read()


def test_second_signal_stops_a_worker_at_once(
    tmp_path: Path, database_url: str, schema: str
) -> None:
    """A handler that ignores the stop keeps the graceful close waiting; a second SIGTERM
    exits at once with code 3 and leaves the run to lease expiry."""

    @task(id="cli.echo")
    def echo(payload: object, context: RunContext) -> object:
        return payload

    producer = create_runlane(
        lane=postgres_polling_lane(connection_string=database_url, schema=schema), tasks=[echo]
    )
    try:
        handle = producer.trigger(echo, {"hang": True})
        with _spawn(tmp_path, database_url, schema, "worker", "cliapp:runlane") as proc:
            _wait_for_line(proc, f"hanging {handle.id}")
            proc.send_signal(signal.SIGTERM)
            _wait_for_line(proc, "SIGTERM received; closing")
            started = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == EXIT_FORCED
            assert time.monotonic() - started < 5
            assert proc.stderr is not None
            assert "second signal: exiting now" in proc.stderr.read()
        assert producer.get_run(handle.id).status is RunStatus.RUNNING  # left to lease expiry
    finally:
        producer.close()


def test_second_signal_stops_maintenance_at_once(
    tmp_path: Path, database_url: str, schema: str
) -> None:
    """Bands stuck in a statement (their lease rows locked elsewhere) keep the graceful
    close waiting; a second signal exits at once with code 3."""
    with _spawn(tmp_path, database_url, schema, "maintenance", "cliapp:runlane") as proc:
        _wait_for_line(proc, "SIGTERM or Ctrl-C stops it")
        with psycopg.connect(database_url) as blocker:

            def locked() -> bool:
                rows = blocker.execute(
                    sql.SQL("select * from {}.maintenance_leases for update").format(
                        sql.Identifier(schema)
                    )
                ).fetchall()
                if not rows:
                    blocker.rollback()
                return bool(rows)

            assert poll(locked, timeout=30, interval=0.05), "no band was ever acquired"
            proc.send_signal(signal.SIGTERM)
            _wait_for_line(proc, "SIGTERM received; closing")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == EXIT_FORCED
            blocker.rollback()


# the app holds the process after the command returned, as a thread of its own still running
# (or a log thread draining) would: the exit waits for this non-daemon thread
LINGERING_APP = APP + textwrap.dedent(
    """
    def linger():
        threading.main_thread().join()  # returns once the command returned and Python exits
        print("lingering", file=sys.stderr, flush=True)
        threading.Event().wait(60)

    threading.Thread(target=linger, name="app-linger").start()
    """
)


@pytest.mark.parametrize(
    ("command", "log_format"), [("worker", "text"), ("maintenance", "text"), ("worker", "json")]
)
def test_a_second_ctrl_c_after_the_close_finished_exits_3(
    tmp_path: Path, database_url: str, schema: str, command: str, log_format: str
) -> None:
    """Issue 37: once the first Ctrl-C's graceful close had finished, the command put back
    Python's own handlers, and a second Ctrl-C while the process exited did not exit with
    the documented code 3 (a KeyboardInterrupt, or the signal's own end). The main thread
    then waits for the app's thread without a timeout: the kernel may hand the signal to
    either thread."""
    args = (command, "cliapp:runlane", "--log-format", log_format)
    with cli_process(tmp_path, LINGERING_APP, database_url, schema, *args) as proc:
        _wait_for_line(proc, "SIGTERM or Ctrl-C stops it")
        proc.send_signal(signal.SIGINT)
        _wait_for_line(proc, " stopped")  # the graceful close finished
        _wait_for_line(proc, "lingering")  # the command returned: the process is exiting
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == EXIT_FORCED
        assert proc.stderr is not None
        rest = proc.stderr.read()
    assert "second signal: exiting now" in rest
    assert "lease expiry" not in rest  # nothing was left running
    assert "Traceback" not in rest
    if log_format == "json":  # after the log thread stopped, still one JSON object
        (line,) = rest.splitlines()
        record = json.loads(line)
        assert (record["level"], record["exit_code"]) == ("WARNING", EXIT_FORCED)


def test_configuration_errors_are_one_line_and_exit_2(
    tmp_path: Path, database_url: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cliapp.py").write_text(APP + "\nnot_a_runlane = 42\n")
    os.environ["APP_DATABASE_URL"], os.environ["APP_SCHEMA"] = database_url, schema
    sys.path.insert(0, str(tmp_path))
    try:
        cases = [
            (["worker", "cliapp:runlane", "--queues", "nope"], "unknown queues ['nope']"),
            (["worker", "cliapp:missing"], "has no attribute 'missing'"),
            (["drain", "cliapp"], "module:attribute"),
            (["status", "no_such_module:app"], "cannot import 'no_such_module'"),
            (["maintenance", "cliapp:not_a_runlane"], "is a int, not a Runlane"),
        ]
        for argv, message in cases:
            assert main(argv) == EXIT_CONFIGURATION, argv
            err = capsys.readouterr().err
            lines = [line for line in err.splitlines() if line.startswith("runlane: error: ")]
            assert len(lines) == 1, err
            assert message in lines[0]
            assert "Traceback" not in err
        with pytest.raises(ConfigurationError, match="module:attribute"):
            load_app("cliapp")
        saved = {k: os.environ.pop(k, None) for k in ("RUNLANE_DATABASE_URL", "DATABASE_URL")}
        try:
            assert main(["migrate"]) == EXIT_CONFIGURATION
            assert "runlane: error: no database URL" in capsys.readouterr().err
        finally:
            os.environ.update({k: v for k, v in saved.items() if v is not None})
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cliapp", None)
        del os.environ["APP_DATABASE_URL"], os.environ["APP_SCHEMA"]


def test_runtime_errors_are_one_line_and_exit_1(
    tmp_path: Path, database_url: str, fresh_schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cliapp.py").write_text(APP)
    os.environ["APP_DATABASE_URL"], os.environ["APP_SCHEMA"] = database_url, fresh_schema
    sys.path.insert(0, str(tmp_path))
    try:
        for argv in (["status", "cliapp:runlane"], ["maintenance", "cliapp:runlane", "--once"]):
            sys.modules.pop("cliapp", None)  # a fresh runtime for each command
            assert main(argv) == EXIT_FAILURE
            err = capsys.readouterr().err
            assert err.startswith("runlane: error: "), err
            assert "runlane migrate" in err
            assert len(err.strip().splitlines()) == 1, err
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cliapp", None)
        del os.environ["APP_DATABASE_URL"], os.environ["APP_SCHEMA"]


def test_version_help_and_log_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("runlane ")
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for code in ("0  success", "1  a runtime failure", "2  a usage", "3  a second SIGTERM"):
        assert code in out
    args = _parser().parse_args(["--log-level", "debug", "worker", "m:a"])
    assert (args.log_level, args.log_format) == ("DEBUG", "text")
    args = _parser().parse_args(["worker", "m:a", "--log-format", "json"])
    assert (args.log_level, args.log_format) == ("INFO", "json")


def test_json_log_lines_carry_structured_fields() -> None:
    record = logging.makeLogRecord(
        {"name": "runlane.worker", "levelname": "INFO", "msg": "run %s done", "args": ("r1",)}
    )
    record.run_id = "r1"
    record.duration_ms = 12
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "run r1 done"
    assert (entry["level"], entry["logger"]) == ("INFO", "runlane.worker")
    assert (entry["run_id"], entry["duration_ms"]) == ("r1", 12)


def test_a_killed_worker_loses_no_run(
    tmp_path: Path, database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    """SIGKILL mid-run: the lease lapses, maintenance retries the run, another worker
    completes it, and the dead worker's attempt is recorded as expired. The lease's lapse
    and the retry's delay pass on the survivor's clock (moved), not by waiting."""

    @task(id="cli.echo")
    def echo(payload: object, context: RunContext) -> object:
        return payload

    clock = MovableClock()
    lane = postgres_polling_lane(connection_string=database_url, schema=schema, clock=clock)
    survivor = create_runlane(lane=lane, tasks=[echo])
    try:
        handle = survivor.trigger(echo, {"hang": True})
        with _spawn(tmp_path, database_url, schema, "worker", "cliapp:runlane", lease=1) as proc:
            _wait_for_line(proc, f"hanging {handle.id}")
            proc.kill()  # SIGKILL: no shutdown, no hand-back, connections simply vanish
            assert proc.wait(timeout=30) == -signal.SIGKILL
        assert survivor.get_run(handle.id).status is RunStatus.RUNNING
        clock.advance(5)  # its 1 s lease lapses
        assert survivor.run_maintenance_once().attempts_expired == 1
        clock.advance(5)  # the retry's delay (RetryPolicy default 1 s) passes
        assert survivor.run_maintenance_once().due_runs_delivered == 1
        assert survivor.get_run(handle.id).status is RunStatus.QUEUED
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

    clock = MovableClock()
    lane = postgres_polling_lane(connection_string=database_url, schema=schema, clock=clock)
    survivor = create_runlane(lane=lane, tasks=[echo])
    flag = tmp_path / "go"
    try:
        handle = survivor.trigger(echo, {"until": str(flag)})
        with _spawn(tmp_path, database_url, schema, "worker", "cliapp:runlane", lease=1) as proc:
            _wait_for_line(proc, f"waiting {handle.id}")
            proc.send_signal(signal.SIGSTOP)
            try:
                # frozen past its 1 s lease (on the survivor's clock, moved) and retry delay
                clock.advance(5)
                assert survivor.run_maintenance_once().attempts_expired == 1
                clock.advance(5)
                assert survivor.run_maintenance_once().due_runs_delivered == 1
                assert survivor.get_run(handle.id).status is RunStatus.QUEUED
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
