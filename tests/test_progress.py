"""context.report_progress: shown by get_run, list_runs and the history; throttled to one
write a second per attempt with the last value winning, and written with the attempt's end;
fenced (a stale attempt's progress changes nothing and its next report raises StaleLease);
bad values refused with nothing written. Through delivery workers and drain()."""

from __future__ import annotations

import datetime
import math
import threading
import time
import uuid
from typing import Any

import attrs
import pytest

from runlane import (
    ConfigurationError,
    RetryPolicy,
    RunContext,
    RunStatus,
    StaleLease,
    task,
)
from runlane.cli._runs import _show_text
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb, poll, wait_until


@attrs.frozen
class Part:
    number: int


def _stored(db: Conn, schema: str, run_id: uuid.UUID) -> Any:
    return SchemaDb(db, schema).one("select progress from {schema}.runs where id = %s", run_id)[0]


def test_the_last_progress_is_shown_by_get_run_list_runs_and_history(
    make_runlane: RunlaneFactory,
) -> None:
    @task(id="progress.steps")
    def steps(payload: Any, context: RunContext) -> str:
        for n in range(1, 4):
            context.report_progress(fraction=n / 3, message=f"step {n} of 3", data={"n": n})
        return "done"

    rl = make_runlane(tasks=[steps])
    handle = rl.trigger(steps, None)
    assert rl.get_run(handle.id).progress is None
    assert rl.drain().completed == 1
    last = {"fraction": 1.0, "message": "step 3 of 3", "data": {"n": 3}}
    assert rl.get_run(handle.id).progress == last
    assert rl.list_runs().runs[0].progress == last
    assert rl.get_run_history(handle.id).run.progress == last
    # an operator's runtime (no tasks) reads it too
    assert make_runlane().get_run(handle.id).progress == last


def test_throttled_to_one_write_a_second_the_last_value_written_at_the_end(
    make_runlane: RunlaneFactory,
) -> None:
    reports = 0

    @task(id="progress.busy")
    def busy(payload: Any, context: RunContext) -> None:
        nonlocal reports
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            reports += 1
            context.report_progress(fraction=0.5, message=f"report {reports}")
            time.sleep(0.005)
        context.report_progress(fraction=1.0, message="last")

    rl = make_runlane(tasks=[busy])
    handle = rl.trigger(busy, None)
    with rl.create_delivery_worker(concurrency=1) as worker:
        done = rl.wait_for_run(handle.id, timeout=20)
        written = worker.stats.progress
    assert done.status is RunStatus.COMPLETED
    assert done.progress == {"fraction": 1.0, "message": "last", "data": None}
    print(f"\n{reports} reports, {written} written")
    assert reports > 100
    # leading edge, about one a second while it ran, and the last one with the completion
    assert 3 <= written <= 5


def test_a_pending_value_is_written_within_the_second_without_more_reports(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    go_on = threading.Event()

    @task(id="progress.pause")
    def pause(payload: Any, context: RunContext) -> None:
        context.report_progress(fraction=0.1)
        context.report_progress(fraction=0.2)  # inside the second: pending, replaces 0.1
        go_on.wait(20)

    rl = make_runlane(tasks=[pause])
    handle = rl.trigger(pause, None)
    with rl.create_delivery_worker(concurrency=1):
        wait_until(
            lambda: (_stored(db, schema, handle.id) or {}).get("fraction") == 0.2,
            timeout=10,
            what="the pending progress written while the handler waits",
            state=lambda: _stored(db, schema, handle.id),
        )
        assert rl.get_run(handle.id).status is RunStatus.RUNNING
        go_on.set()
        rl.wait_for_run(handle.id, timeout=10)


def test_progress_is_written_with_a_failure_too(make_runlane: RunlaneFactory) -> None:
    @task(id="progress.fails", retry=RetryPolicy(max_attempts=1))
    def fails(payload: Any, context: RunContext) -> None:
        context.report_progress(fraction=0.1)
        context.report_progress(fraction=0.7, message="got this far")
        raise RuntimeError("then it broke")

    rl = make_runlane(tasks=[fails])
    handle = rl.trigger(fails, None)
    with rl.create_delivery_worker(concurrency=1):
        failed = rl.wait_for_run(handle.id, timeout=10)
    assert failed.status is RunStatus.FAILED
    assert failed.progress == {"fraction": 0.7, "message": "got this far", "data": None}


def test_a_stale_attempts_progress_changes_nothing_and_its_next_report_raises(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    first_written = threading.Event()
    lease_taken = threading.Event()
    finished = threading.Event()
    outcome: dict[str, Any] = {}

    @task(id="progress.stale")
    def stale(payload: Any, context: RunContext) -> None:
        context.report_progress(fraction=0.1, message="mine")
        first_written.set()
        lease_taken.wait(20)
        try:
            context.report_progress(fraction=0.9, message="stale")  # pending: the next second
            # the worker's write of it finds another attempt's lease (read, never set, here)
            poll(lambda: context._progress is not None and context._progress.stale, timeout=10)
            context.report_progress(fraction=0.9, message="stale again")
        except StaleLease as exc:
            outcome["raised"] = str(exc)
        outcome["cancelled"] = context.cancelled.is_set()
        finished.set()

    rl = make_runlane(tasks=[stale])
    handle = rl.trigger(stale, None)
    with rl.create_delivery_worker(concurrency=1):
        first_written.wait(10)
        wait_until(
            lambda: _stored(db, schema, handle.id) is not None,
            timeout=10,
            what="the first progress written",
        )
        # another attempt owns the run now: its lease token is not this attempt's
        SchemaDb(db, schema).run(
            "update {schema}.runs set lease_token = gen_random_uuid() where id = %s", handle.id
        )
        lease_taken.set()
        assert finished.wait(15), "the handler did not finish"
    assert "no longer holds its lease" in outcome["raised"]
    assert outcome["cancelled"] is True
    assert _stored(db, schema, handle.id) == {"fraction": 0.1, "message": "mine", "data": None}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fraction": -0.1}, "must be from 0 to 1"),
        ({"fraction": 1.5}, "must be from 0 to 1"),
        ({"fraction": math.nan}, "must be from 0 to 1"),
        ({"fraction": math.inf}, "must be from 0 to 1"),
        ({"fraction": True}, "takes a number from 0 to 1"),
        ({"fraction": "0.5"}, "takes a number from 0 to 1"),
        ({"message": 5}, "takes a string"),
        ({"message": "x" * 10_000}, "at most 1,000 characters"),
        ({"message": "a\x00b"}, "NUL"),
        ({"data": object()}, "cannot be stored as JSON"),
        ({"data": "x" * 5_000}, "max_output_bytes"),
        ({"data": {"n": math.nan}}, "NaN"),
        # issue 37: nothing is converted (a set was stored as a list, silently)
        ({"data": {1}}, "type set is not JSON serializable"),
        ({"data": {"tags": frozenset({"a"})}}, "type frozenset is not JSON serializable"),
        ({"data": b"raw"}, "type bytes is not JSON serializable"),
        ({"data": [datetime.date(2024, 1, 1)]}, "type date is not JSON serializable"),
        ({"data": Part(2)}, "type Part is not JSON serializable"),
    ],
)
def test_bad_values_are_refused_and_nothing_is_written(
    make_runlane: RunlaneFactory, kwargs: dict[str, Any], match: str
) -> None:
    caught: list[ConfigurationError] = []

    @task(id="progress.bad")
    def bad(payload: Any, context: RunContext) -> None:
        try:
            context.report_progress(**kwargs)
        except ConfigurationError as exc:
            caught.append(exc)

    rl = make_runlane(tasks=[bad], max_output_bytes=4_096)
    handle = rl.trigger(bad, None)
    rl.drain()
    assert len(caught) == 1, caught
    message = str(caught[0])
    assert match.lower() in message.lower(), message
    assert "nothing was written" in message
    assert len(message) < 1_000
    done = rl.get_run(handle.id)
    assert (done.status, done.progress) == (RunStatus.COMPLETED, None)


def test_data_of_plain_json_values_is_stored_as_given(make_runlane: RunlaneFactory) -> None:
    """Tuples are JSON arrays (as in a payload of a task without a schema); nothing else is
    converted."""
    data = {"rows": (1, [2, 3.5], {"ok": True, "none": None}), "name": "x"}

    @task(id="progress.plain")
    def plain(payload: Any, context: RunContext) -> None:
        context.report_progress(data=data)

    rl = make_runlane(tasks=[plain])
    handle = rl.trigger(plain, None)
    rl.drain()
    stored = rl.get_run(handle.id).progress
    assert stored is not None
    assert stored["data"] == {"rows": [1, [2, 3.5], {"ok": True, "none": None}], "name": "x"}


def test_report_progress_needs_a_run_attempt() -> None:
    loose = RunContext(
        run_id=uuid.uuid4(),
        task_id="t",
        queue="default",
        attempt=1,
        max_attempts=1,
        environment="default",
    )
    with pytest.raises(ConfigurationError, match="not attached to a run attempt"):
        loose.report_progress(fraction=0.5)


def test_runs_show_prints_the_progress(
    make_runlane: RunlaneFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    @task(id="progress.shown")
    def shown(payload: Any, context: RunContext) -> None:
        context.report_progress(fraction=0.4, message="copying part 2", data={"part": 2})

    rl = make_runlane(tasks=[shown])
    handle = rl.trigger(shown, None)
    rl.drain()
    _show_text(rl.get_run_history(handle.id))
    assert 'progress         40% copying part 2 {"part": 2}' in capsys.readouterr().out
