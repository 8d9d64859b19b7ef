"""The operator commands (``status``, ``runs``, ``queues``, ``workers``, ``schedules``) run
from ``--database-url`` (or ``$RUNLANE_DATABASE_URL``) alone, with no application code, on a
schema a full runtime of this module populated: output, exit codes, refusals that change
nothing, and a bulk retry interrupted by Ctrl-C and re-run to completion."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from runlane import RetryPolicy, RunContext, Runlane, RunStatus, queue, schedule, task
from runlane.cli import EXIT_CONFIGURATION, EXIT_FAILURE, main
from runlane.worker import Worker
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb, poll, process, wait_until


@task(id="op.ok")
def ok(payload: Any, context: RunContext) -> str:
    return "ok"


@task(id="op.fails", retry=RetryPolicy(max_attempts=1), queue="slow")
def fails(payload: Any, context: RunContext) -> None:
    raise RuntimeError("always")


@task(id="op.report", queue="reports")
def report(payload: Any, context: RunContext) -> str:
    return "reported"


NIGHTLY = schedule(id="nightly", task=report, cron="0 3 * * *", payload={"kind": "nightly"})
QUEUES = [queue("default", default=True), queue("slow"), queue("reports"), queue("idle")]


@attrs.frozen
class Populated:
    runtime: Runlane
    worker: Worker
    completed: list[uuid.UUID]
    failed: list[uuid.UUID]
    queued: list[uuid.UUID]


@pytest.fixture
def populated(make_runlane: RunlaneFactory) -> Iterator[Populated]:
    """3 completed and 4 failed runs (drained), 2 queued ones, the schedule ``nightly``
    stored by maintenance, and a delivery worker registered (serving the empty queue
    ``idle``)."""
    rl = make_runlane(queues=QUEUES, tasks=[ok, fails, report], schedules=[NIGHTLY])
    rl.run_maintenance_once()
    completed = [rl.trigger(ok, {"n": i}).id for i in range(3)]
    failed = [rl.trigger(fails, {"n": i}).id for i in range(4)]
    while rl.drain().runs_executed:
        pass
    queued = [rl.trigger(ok, {"n": 10 + i}).id for i in range(2)]
    worker = rl.create_delivery_worker(concurrency=1, queues=["idle"])
    try:
        # a worker's row is written by its lifecycle writer's first heartbeat, just after
        # the worker starts: status read before it finds no worker (CI saw it once)
        wait_until(
            lambda: worker.worker_id in {w.worker_id for w in rl.list_workers()},
            timeout=10,
            what="the worker's registration",
        )
        yield Populated(rl, worker, completed, failed, queued)
    finally:
        worker.close(10)


@pytest.fixture
def cli(
    database_url: str,
    schema: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> Any:
    """``cli(*argv, url=True)`` runs ``runlane *argv --database-url URL --schema S``
    in-process from an empty directory; returns (exit code, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    for name in ("RUNLANE_DATABASE_URL", "RUNLANE_SCHEMA", "RUNLANE_ENVIRONMENT"):
        monkeypatch.delenv(name, raising=False)

    def run(*argv: str, url: bool = True) -> tuple[int, str, str]:
        capsys.readouterr()
        extra = ["--database-url", database_url, "--schema", schema] if url else []
        code = main([*argv, *extra])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def _error(err: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("runlane: error: "), err
    assert needle in lines[0], err


def _statuses(data: SchemaDb) -> dict[str, int]:
    rows = data.all("select status, count(*) from {schema}.runs group by status")
    return {str(status): int(n) for status, n in rows}


def test_status_and_runs_list_and_show(cli: Any, populated: Populated) -> None:
    code, out, err = cli("status")
    assert code in (0, EXIT_FAILURE), err
    assert "workers" in out
    assert str(populated.worker.worker_id) in out
    code, out, _ = cli("status", "--json")
    document = json.loads(out)
    assert [w["worker_id"] for w in document["workers"]] == [str(populated.worker.worker_id)]

    code, out, err = cli("runs", "list", "--json", "--limit", "50")
    assert code == 0, err
    runs = json.loads(out)["runs"]
    assert len(runs) == 9
    code, out, _ = cli("runs", "list", "--status", "failed", "--json")
    assert {r["id"] for r in json.loads(out)["runs"]} == {str(i) for i in populated.failed}
    code, out, _ = cli("runs", "list")
    assert code == 0
    assert "op.fails" in out

    failed = str(populated.failed[0])
    code, out, err = cli("runs", "show", failed, "--json")
    assert code == 0, err
    history = json.loads(out)
    assert history["run"]["status"] == "failed"
    assert [a["outcome"] for a in history["attempts"]] == ["failed"]
    code, out, _ = cli("runs", "show", failed)
    assert code == 0
    assert "RuntimeError: always" in out


def test_runs_retry_by_id_and_in_bulk(
    cli: Any, populated: Populated, db: Conn, schema: str
) -> None:
    data = SchemaDb(db, schema)
    first = str(populated.failed[0])
    code, out, err = cli("runs", "retry", first)
    assert code == 0, err
    assert f"run {first} is queued again" in out
    assert _statuses(data)["failed"] == 3

    # no filter: refused with the --all hint, nothing changed
    code, _, err = cli("runs", "retry")
    assert code == EXIT_CONFIGURATION
    _error(err, "--all")
    # --dry-run counts only
    before = _statuses(data)
    code, out, err = cli("runs", "retry", "--status", "failed", "--dry-run")
    assert code == 0, err
    assert "3 runs match" in out
    assert _statuses(data) == before
    # not a terminal and no --yes: refused, nothing changed
    code, out, err = cli("runs", "retry", "--status", "failed")
    assert code == EXIT_CONFIGURATION
    _error(err, "--yes")
    assert _statuses(data) == before
    # a non-retryable status: a clear error
    code, _, err = cli("runs", "retry", "--status", "queued", "--yes")
    assert code == EXIT_CONFIGURATION, err
    assert _statuses(data) == before

    code, out, err = cli("runs", "retry", "--status", "failed", "--yes")
    assert code == 0, err
    assert "3 of 3 matching runs retried" in out
    assert "failed" not in _statuses(data)
    # re-run: nothing left
    code, out, _ = cli("runs", "retry", "--status", "failed", "--yes")
    assert (code, out.strip()) == (0, "0 runs match")


def test_runs_cancel_and_delete_in_bulk(
    cli: Any, populated: Populated, db: Conn, schema: str
) -> None:
    data = SchemaDb(db, schema)
    code, out, err = cli("runs", "cancel", "--task", "op.ok", "--status", "queued", "--yes")
    assert code == 0, err
    assert "2 of 2 matching runs cancelled" in out
    assert {populated.runtime.get_run(i).status for i in populated.queued} == {RunStatus.CANCELLED}

    # deleting a non-terminal status: refused, nothing deleted
    before = _statuses(data)
    code, _, err = cli("runs", "delete", "--status", "running", "--yes")
    assert code == EXIT_CONFIGURATION
    _error(err, "running")
    code, _, err = cli("runs", "delete", "--status", "queued", "--yes")
    assert code == EXIT_CONFIGURATION
    assert _statuses(data) == before
    # run ids are not how delete works
    code, _, err = cli("runs", "delete", str(populated.completed[0]), "--yes")
    assert code == EXIT_CONFIGURATION
    assert _statuses(data) == before

    code, out, err = cli("runs", "delete", "--status", "completed", "--yes")
    assert code == 0, err
    assert "3 of 3 matching runs deleted" in out
    assert "completed" not in _statuses(data)


def test_queues_list_pause_resume(cli: Any, populated: Populated, db: Conn, schema: str) -> None:
    code, out, err = cli("queues", "list", "--json")
    assert code == 0, err
    listed = {q["name"]: q for q in json.loads(out)}
    assert listed["default"]["paused"] is False
    assert listed["default"]["counts"]["queued"] == 2

    for _ in range(2):  # idempotent
        code, out, err = cli("queues", "pause", "default", "--reason", "incident 42")
        assert code == 0, err
        assert "'default' is paused" in out
    code, out, _ = cli("queues", "list")
    assert code == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("default"))
    assert "paused (incident 42)" in line
    # the application's runtime sees the pause: its drain claims nothing
    assert populated.runtime.drain().runs_executed == 0

    for _ in range(2):
        code, out, err = cli("queues", "resume", "default")
        assert code == 0, err
        assert "'default' is running" in out
    code, out, _ = cli("queues", "list", "--json")
    assert {q["name"]: q["paused"] for q in json.loads(out)}["default"] is False

    before = SchemaDb(db, schema).all("select * from {schema}.queue_states")
    code, _, err = cli("queues", "pause", "no-such-queue")
    assert code == EXIT_CONFIGURATION
    _error(err, "no-such-queue")
    code, _, err = cli("queues", "resume", "no-such-queue")
    assert code == EXIT_CONFIGURATION
    assert SchemaDb(db, schema).all("select * from {schema}.queue_states") == before


def test_workers(cli: Any, populated: Populated) -> None:
    code, out, err = cli("workers", "--json")
    assert code == 0, err
    (worker,) = json.loads(out)
    assert worker["worker_id"] == str(populated.worker.worker_id)
    assert (worker["state"], worker["pid"], worker["queues"]) == ("running", os.getpid(), ["idle"])
    code, out, _ = cli("workers")
    assert code == 0
    assert str(populated.worker.worker_id) in out
    assert "running" in out

    populated.worker.close(10)
    code, out, _ = cli("workers")
    assert "no workers running (--all shows stopped ones)" in out
    code, out, _ = cli("workers", "--all", "--json")
    assert [w["state"] for w in json.loads(out)] == ["stopped"]


def test_schedules_list_pause_resume_run(
    cli: Any, populated: Populated, db: Conn, schema: str
) -> None:
    code, out, err = cli("schedules", "list", "--json")
    assert code == 0, err
    (listed,) = json.loads(out)
    assert (listed["id"], listed["task_id"], listed["paused"]) == ("nightly", "op.report", False)
    assert listed["next_fire_at"] is not None
    code, out, _ = cli("schedules", "list")
    assert "nightly" in out
    assert "0 3 * * *" in out

    code, out, err = cli("schedules", "pause", "nightly")
    assert code == 0, err
    assert "paused" in out
    code, out, _ = cli("schedules", "list", "--json")
    assert json.loads(out)[0]["paused"] is True
    code, out, err = cli("schedules", "resume", "nightly")
    assert code == 0, err
    code, out, _ = cli("schedules", "list", "--json")
    assert json.loads(out)[0]["paused"] is False

    code, out, err = cli("schedules", "run", "nightly")
    assert code == 0, err
    run_id = out.split()[1]
    assert populated.runtime.get_run(run_id).task_id == "op.report"
    assert populated.runtime.get_run(run_id).payload == {"kind": "nightly"}

    data = SchemaDb(db, schema)
    before = (_statuses(data), data.all("select * from {schema}.schedules"))
    for action in ("pause", "resume", "run"):
        code, _, err = cli("schedules", action, "no-such-schedule")
        assert code == EXIT_CONFIGURATION, (action, err)
        _error(err, "no-such-schedule")
    assert (_statuses(data), data.all("select * from {schema}.schedules")) == before


def test_targets_from_the_environment_and_conflicts(
    *,
    cli: Any,
    populated: Populated,
    database_url: str,
    schema: str,
    db: Conn,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a separate process in an empty directory: no application code is importable
    env = {
        **os.environ,
        "RUNLANE_DATABASE_URL": database_url,
        "RUNLANE_SCHEMA": schema,
    }
    done = subprocess.run(
        [sys.executable, "-m", "runlane.cli", "runs", "list", "--status", "failed", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert {r["id"] for r in json.loads(done.stdout)["runs"]} == {str(i) for i in populated.failed}

    monkeypatch.setenv("RUNLANE_DATABASE_URL", database_url)
    monkeypatch.setenv("RUNLANE_SCHEMA", schema)
    code, out, err = cli("workers", "--json", url=False)
    assert code == 0, err
    assert len(json.loads(out)) == 1
    monkeypatch.delenv("RUNLANE_DATABASE_URL")
    code, _, err = cli("workers", url=False)
    assert code == EXIT_CONFIGURATION
    _error(err, "--database-url")

    # APP and --database-url both: refused before anything is imported
    code, _, err = cli("workers", "some_app:runlane")
    assert code == EXIT_CONFIGURATION
    _error(err, "APP both given")
    code, _, err = cli("runs", "retry", "some_app:runlane", "--status", "failed", "--yes")
    assert code == EXIT_CONFIGURATION
    _error(err, "APP both given")
    assert _statuses(SchemaDb(db, schema))["failed"] == len(populated.failed)


FAILED_RUNS = 20_000


def test_a_bulk_retry_interrupted_by_ctrl_c_says_how_far_it_got_and_a_rerun_finishes(
    database_url: str, schema: str, db: Conn, tmp_path: Path
) -> None:
    data = SchemaDb(db, schema)
    data.run(
        "insert into {schema}.runs (id, environment, task_id, queue, status, payload,"
        " attempt, releases, max_attempts, due_at, created_at, finished_at, error)"
        " select gen_random_uuid(), 'default', 'op.fails', 'slow', 'failed',"
        " jsonb_build_object('n', g), 1, 0, 1, now(), now() - g * interval '1 millisecond',"
        ' now(), \'{{"type": "Boom", "message": "x"}}\'::jsonb'
        " from generate_series(1, %s) as g",
        FAILED_RUNS,
    )
    argv = [
        sys.executable,
        "-m",
        "runlane.cli",
        "runs",
        "retry",
        "--status",
        "failed",
        "--yes",
        "--database-url",
        database_url,
        "--schema",
        schema,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    with process(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE) as proc:
        # the first batch committed: the command is working through the rest
        def committed() -> bool:
            if _statuses(data).get("queued", 0):
                return True
            assert proc.poll() is None, proc.communicate()
            return False

        assert poll(committed, timeout=60, interval=0.005), "no batch committed within 60 s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    assert f"{FAILED_RUNS:,} runs match" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("interrupted: "))
    done = int(line.split()[1].replace(",", ""))
    assert f"of {FAILED_RUNS:,} runs retried" in line
    assert "run the same command again" in line
    counts = _statuses(data)
    # consistent: what it reported is what committed, every run still accounted for
    assert 0 < counts["queued"] <= FAILED_RUNS - 1
    assert counts["queued"] == done
    assert counts["queued"] + counts["failed"] == FAILED_RUNS

    rest = FAILED_RUNS - done
    again = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert again.returncode == 0, again.stderr
    assert f"{rest:,} of {rest:,} matching runs retried" in again.stdout
    assert _statuses(data) == {"queued": FAILED_RUNS}


def test_queues_list_shows_each_queues_flow_limits() -> None:
    from datetime import timedelta  # noqa: PLC0415

    from runlane import RateLimit  # noqa: PLC0415
    from runlane.cli._operator import _QUEUE_COLUMNS, _table  # noqa: PLC0415
    from runlane.models import QueueInfo  # noqa: PLC0415

    def info(name: str, rate: RateLimit | None, per_key: int | None) -> QueueInfo:
        return QueueInfo(
            name=name,
            paused=False,
            paused_reason=None,
            paused_at=None,
            concurrency_limit=None,
            rate_limit=rate,
            key_concurrency_limit=per_key,
            counts={},
            oldest_queued_age=None,
            defined=True,
        )

    lines = _table(
        _QUEUE_COLUMNS,
        [
            info("mail", RateLimit(100, timedelta(seconds=1), burst=10), 1),
            info("plain", None, None),
        ],
    )
    header, mail, plain = lines

    def cell(line: str, column: str) -> str:
        start = header.index(column)
        return line[start:].split("  ", maxsplit=1)[0].strip()

    assert header.index("LIMIT") < header.index("RATE") < header.index("PER KEY")
    assert cell(mail, "RATE") == "100/1s +10"
    assert cell(mail, "PER KEY") == "1"
    assert cell(plain, "RATE") == cell(plain, "PER KEY") == "-"
