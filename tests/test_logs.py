"""Run logs: each attempt's start and end at INFO with structured fields, each failure once
on runlane.worker (WARNING when retried, ERROR when final) with its traceback, and the
worker's warning that maintenance is not running."""

from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta
from typing import Any

import attrs
import pytest

from runlane import NonRetryableError, RetryPolicy, RunContext, RunStatus, task
from runlane.logging import JsonFormatter
from runlane.worker import _watch
from tests.conftest import RunlaneFactory
from tests.helpers import SchemaDb, poll, wait_for_status, wait_until

FIELDS = ("run_id", "task_id", "attempt", "queue")


@attrs.frozen
class Job:
    kind: str


# set when a "stop" job's handler has begun (a running status only says it was claimed)
_stop_entered = threading.Event()


@task(id="logs.job", schema=Job, retry=RetryPolicy(max_attempts=2))
def job(payload: Job, context: RunContext) -> str:
    if payload.kind == "retry":
        raise ValueError("try again")
    if payload.kind == "fatal":
        raise NonRetryableError("give up")
    if payload.kind == "stop":
        _stop_entered.set()
        context.cancelled.wait(30)
        context.raise_if_stopped()
    return payload.kind


def run_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name in ("runlane.runs", "runlane.worker")]


def failure_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "outcome", None) in ("retried", "failed")]


def by_outcome(records: list[logging.LogRecord]) -> dict[str, logging.LogRecord]:
    return {getattr(r, "outcome"): r for r in records if hasattr(r, "outcome")}  # noqa: B009


def test_each_attempt_logs_its_start_and_end_with_fields(
    make_runlane: RunlaneFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="runlane")
    rl = make_runlane(tasks=[job])
    handles = {k: rl.trigger(job, {"kind": k}) for k in ("ok", "retry", "fatal")}
    result = rl.drain()
    assert (result.completed, result.retried, result.failed) == (1, 1, 1)

    records = run_records(caplog)
    starts = [r for r in records if "started" in r.getMessage()]
    assert len(starts) == 3
    for record in records:
        for field in FIELDS:
            assert hasattr(record, field), (field, record.getMessage())
    ends = by_outcome(records)
    assert set(ends) == {"completed", "retried", "failed"}
    done = ends["completed"]
    assert done.run_id == str(handles["ok"].id)  # type: ignore[attr-defined]
    assert (done.task_id, done.attempt, done.queue) == ("logs.job", 1, "default")  # type: ignore[attr-defined]
    assert done.duration_ms >= 0  # type: ignore[attr-defined]
    assert done.levelno == logging.INFO
    assert "completed in" in done.getMessage()
    retried = ends["retried"]
    assert retried.name == "runlane.worker"
    assert retried.levelno == logging.WARNING
    assert "failed; retry in" in retried.getMessage()
    assert "ValueError: try again" in retried.getMessage()
    assert retried.retry_delay_s > 0  # type: ignore[attr-defined]
    assert retried.run_id == str(handles["retry"].id)  # type: ignore[attr-defined]
    assert retried.exc_info is not None
    assert isinstance(retried.exc_info[1], ValueError)
    failed = ends["failed"]
    assert failed.name == "runlane.worker"
    assert failed.levelno == logging.ERROR
    assert "failed for good at attempt 1" in failed.getMessage()
    assert failed.exc_info is not None
    assert isinstance(failed.exc_info[1], NonRetryableError)
    assert failed.error_type == "runlane.NonRetryableError"  # type: ignore[attr-defined]
    # each failure is one record: nothing else names the failed runs
    failures = [r for r in caplog.records if "try again" in r.getMessage()]
    assert failures == [retried]
    assert [r for r in caplog.records if "give up" in r.getMessage()] == [failed]

    # the CLI's JSON formatter carries the fields
    entry = json.loads(JsonFormatter().format(done))
    assert entry["run_id"] == str(handles["ok"].id)
    assert entry["task_id"] == "logs.job"
    assert entry["attempt"] == 1
    assert entry["queue"] == "default"
    assert entry["outcome"] == "completed"
    assert isinstance(entry["duration_ms"], float)
    entry = json.loads(JsonFormatter().format(failed))
    assert entry["level"] == "ERROR"
    assert entry["logger"] == "runlane.worker"
    assert entry["run_id"] == str(handles["fatal"].id)
    assert "Traceback (most recent call last)" in entry["exception"]
    assert "give up" in entry["exception"]


def test_hand_back_and_cancel_are_logged(
    make_runlane: RunlaneFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="runlane")
    rl = make_runlane(tasks=[job])
    worker = rl.create_delivery_worker(concurrency=1)
    cancelled = rl.trigger(job, {"kind": "stop"})
    wait_for_status(rl, cancelled.id, RunStatus.RUNNING)
    rl.cancel(cancelled.id)
    wait_for_status(rl, cancelled.id, RunStatus.CANCELLED)
    handed = rl.trigger(job, {"kind": "stop"})
    wait_for_status(rl, handed.id, RunStatus.RUNNING)
    worker.close(timeout=10)
    assert rl.get_run(handed.id).status is RunStatus.QUEUED
    # the hand-back's line is written by the handler's thread as its attempt ends, which a
    # loaded machine may schedule after close() returned
    poll(lambda: "handed_back" in by_outcome(run_records(caplog)), timeout=10)
    ends = by_outcome(run_records(caplog))
    assert ends["cancelled"].run_id == str(cancelled.id)  # type: ignore[attr-defined]
    assert ends["handed_back"].run_id == str(handed.id)  # type: ignore[attr-defined]
    assert "handed back unspent" in ends["handed_back"].getMessage()


def test_nothing_is_built_when_info_is_off(
    make_runlane: RunlaneFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="runlane")
    rl = make_runlane(tasks=[job])
    rl.trigger(job, {"kind": "ok"})
    assert rl.drain().completed == 1
    assert run_records(caplog) == []


def test_worker_warns_when_maintenance_is_not_running(
    make_runlane: RunlaneFactory,
    db: Any,
    schema: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_watch, "CHECK_SECONDS", 0.05)
    monkeypatch.setattr(_watch, "WARN_SECONDS", 60.0)
    caplog.set_level(logging.INFO, logger="runlane")
    rl = make_runlane(tasks=[job])
    handle = rl.trigger(job, {"kind": "ok"}, delay=3600)
    SchemaDb(db, schema).run(
        "update {schema}.runs set status = 'retrying', due_at = now() - interval '1 minute' "
        "where id = %s",
        handle.id,
    )

    def warnings() -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.levelno == logging.WARNING and "maintenance is not running" in r.getMessage()
        ]

    with rl.create_delivery_worker(concurrency=1):
        wait_until(lambda: bool(warnings()), timeout=10, what="the maintenance warning")
        threading.Event().wait(0.5)  # several more checks: still one warning a minute
    (warning,) = warnings()
    assert "runlane maintenance APP" in warning.getMessage()

    # with maintenance running, the run is delivered and nothing is said
    caplog.clear()
    with rl.start_services(), rl.create_delivery_worker(concurrency=1):
        wait_for_status(rl, handle.id, RunStatus.COMPLETED, timeout=30)
        threading.Event().wait(0.3)
    assert warnings() == []


@task(id="logs.slow", schema=Job, retry=RetryPolicy(max_attempts=1), timeout=timedelta(seconds=0.3))
def slow(payload: Job, context: RunContext) -> str:
    context.cancelled.wait(10)  # signalled at the timeout
    return payload.kind


def test_a_final_timeout_is_logged_once_at_error(
    make_runlane: RunlaneFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="runlane")
    rl = make_runlane(tasks=[slow])
    handle = rl.trigger(slow, {"kind": "late"})
    with rl.create_delivery_worker(concurrency=1):
        assert rl.wait_for_run(handle.id, timeout=30).status is RunStatus.FAILED
    named = [r for r in caplog.records if str(handle.id) in r.getMessage()]
    (failure,) = [r for r in named if r.levelno >= logging.WARNING]
    assert failure.name == "runlane.worker"
    assert failure.levelno == logging.ERROR
    assert "failed for good at attempt 1" in failure.getMessage()
    assert "TaskTimeout" in failure.getMessage()
    assert failure.exc_info is not None
    assert type(failure.exc_info[1]).__name__ == "TaskTimeout"
    assert failure.outcome == "failed"  # type: ignore[attr-defined]

    # issue 37: the handler returned after its timeout; its end reads as a timeout, not as
    # a shutdown's hand-back ("finished after ... ms, after it was handed back")
    def returned() -> list[str]:
        found = [r for r in caplog.records if str(handle.id) in r.getMessage()]
        return [r.getMessage() for r in found if r.name == "runlane.worker" and r.levelno == 20]

    # the worker's line comes last, after the attempt's end record
    wait_until(lambda: bool(returned()), timeout=10, what="the late return's line")
    assert "returned after its task timeout; its result is discarded" in returned()[0]
    ends = [
        r for r in caplog.records if str(handle.id) in r.getMessage() and r.name == "runlane.runs"
    ]
    ended = ends[-1]
    assert ended.outcome == "timed_out"  # type: ignore[attr-defined]
    assert f"run {handle.id} timed out after " in ended.getMessage()
    assert "failed at its task timeout" in ended.getMessage()
    for record in caplog.records:
        assert "handed back" not in record.getMessage()
        assert "taken from this worker" not in record.getMessage()
