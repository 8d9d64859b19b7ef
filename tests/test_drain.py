"""Executing runs in the calling thread: drain, its limits, ordering, filters and leases."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from runlane import (
    ConfigurationError,
    DrainResult,
    RunContext,
    RunStatus,
    StopReason,
    Task,
    queue,
    task,
)
from tests.conftest import RunlaneFactory
from tests.helpers import statuses


@attrs.frozen
class Item:
    name: str


def lease_row(db: psycopg.Connection[Any], schema: str, run_id: uuid.UUID) -> dict[str, Any]:
    """The run's lease columns plus the database's ``now()``, read on ``db``."""
    with db.cursor(row_factory=dict_row) as cur:
        cur.execute(
            sql.SQL(
                "select status, attempt, lease_token, lease_expires_at, now() as db_now "
                "from {}.runs where id = %s"
            ).format(sql.Identifier(schema)),
            (run_id,),
        )
        row = cur.fetchone()
    assert row is not None
    return row


def recording_task(calls: list[str], task_id: str = "record", **options: Any) -> Task[Item, str]:
    """A task whose handler appends its payload's name to ``calls``."""

    @task(id=task_id, schema=Item, **options)
    def record(payload: Item, context: RunContext) -> str:
        calls.append(payload.name)
        return payload.name

    return record


def test_drain_returns_runs_executed(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    calls: list[str] = []
    record = recording_task(calls)
    runlane = make_runlane(tasks=[record])
    handles = runlane.trigger_many(record, [Item(name=str(i)) for i in range(3)])
    result = runlane.drain()
    assert isinstance(result, DrainResult)
    assert result.runs_executed == 3
    assert sorted(calls) == ["0", "1", "2"]
    for handle in handles:
        snap = runlane.get_run(handle.id)
        assert snap.status is RunStatus.COMPLETED
        assert snap.attempt == 1
        assert snap.finished_at is not None
    assert statuses(db, schema) == {"completed": 3}
    assert runlane.drain().runs_executed == 0


def test_drain_on_empty_schema(make_runlane: RunlaneFactory) -> None:
    calls: list[str] = []
    runlane = make_runlane(tasks=[recording_task(calls)])
    assert runlane.drain().runs_executed == 0
    assert calls == []


def test_drain_stops_at_max_runs(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    calls: list[str] = []
    record = recording_task(calls)
    runlane = make_runlane(tasks=[record])
    runlane.trigger_many(record, [Item(name=str(i)) for i in range(5)])
    assert runlane.drain(max_runs=2).runs_executed == 2
    assert len(calls) == 2
    assert statuses(db, schema) == {"completed": 2, "queued": 3}
    assert runlane.drain(max_runs=10).runs_executed == 3
    assert statuses(db, schema) == {"completed": 5}


def test_drain_max_runs_zero_runs_nothing(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    calls: list[str] = []
    record = recording_task(calls)
    runlane = make_runlane(tasks=[record])
    runlane.trigger(record, Item(name="a"))
    assert runlane.drain(max_runs=0).runs_executed == 0
    assert calls == []
    assert statuses(db, schema) == {"queued": 1}


@pytest.mark.parametrize("max_runs", [-1, True, 1.5, "3"], ids=repr)
def test_drain_rejects_invalid_max_runs(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, max_runs: Any
) -> None:
    calls: list[str] = []
    record = recording_task(calls)
    runlane = make_runlane(tasks=[record])
    runlane.trigger(record, Item(name="a"))
    with pytest.raises(ConfigurationError, match="max_runs"):
        runlane.drain(max_runs=max_runs)
    assert calls == []
    assert statuses(db, schema) == {"queued": 1}


def test_drain_with_stop_already_set_runs_nothing(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    calls: list[str] = []
    record = recording_task(calls)
    runlane = make_runlane(tasks=[record])
    runlane.trigger(record, Item(name="a"))
    stop = threading.Event()
    stop.set()
    assert runlane.drain(stop=stop).runs_executed == 0
    assert calls == []
    assert statuses(db, schema) == {"queued": 1}


def test_drain_stop_set_inside_handler_stops_after_that_run(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    stop = threading.Event()
    calls: list[str] = []

    @task(id="stopper", schema=Item)
    def stopper(payload: Item, context: RunContext) -> None:
        calls.append(payload.name)
        stop.set()

    runlane = make_runlane(tasks=[stopper])
    runlane.trigger_many(stopper, [Item(name=str(i)) for i in range(3)])
    assert runlane.drain(stop=stop).runs_executed == 1
    assert calls == ["0"]  # FIFO: the first triggered ran
    assert statuses(db, schema) == {"completed": 1, "queued": 2}


def _stop_while_running(
    runlane_factory: RunlaneFactory, *, raise_on_stop: bool
) -> tuple[dict[str, Any], float, uuid.UUID, Any]:
    """Drain one run whose handler waits (up to 30 s) for its stop; ``stop`` is set from
    another thread once the handler started. Returns what the handler saw, how long drain
    took after the stop was set, the run and the runtime."""
    started = threading.Event()
    seen: dict[str, Any] = {}

    @task(id="patient", schema=Item)
    def patient(payload: Item, context: RunContext) -> str:
        started.set()
        seen["woke"] = context.cancelled.wait(30)
        seen["cancelled"] = context.cancelled.is_set()
        seen["reason"] = context.stop_reason
        if raise_on_stop:
            context.raise_if_stopped()
        return "stopped early"

    runlane = runlane_factory(tasks=[patient])
    handle = runlane.trigger(patient, Item(name="a"))
    stop = threading.Event()
    set_at: list[float] = []

    def stopper() -> None:
        assert started.wait(30)
        set_at.append(time.monotonic())
        stop.set()

    thread = threading.Thread(target=stopper, name="test-drain-stopper")
    thread.start()
    result = runlane.drain(stop=stop)
    took = time.monotonic() - set_at[0]
    thread.join(5)
    seen["runs_executed"] = result.runs_executed
    return seen, took, handle.id, runlane


def test_drain_stop_asks_the_running_handler_to_stop(make_runlane: RunlaneFactory) -> None:
    """Seed: drain returns when its abort signal is cancelled; the running handler sees
    the stop (cancelled, StopReason.SHUTDOWN) and one that returns has completed its run."""
    seen, took, run_id, runlane = _stop_while_running(make_runlane, raise_on_stop=False)
    assert seen["woke"] is True
    assert seen["cancelled"] is True
    assert seen["reason"] is StopReason.SHUTDOWN
    assert took < 2.0  # the handler would have waited 30 s
    assert seen["runs_executed"] == 1
    snap = runlane.get_run(run_id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.output == "stopped early"


def test_drain_stop_hands_back_a_handler_that_stops_by_raising(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    seen, took, run_id, runlane = _stop_while_running(make_runlane, raise_on_stop=True)
    assert seen["reason"] is StopReason.SHUTDOWN
    assert took < 2.0
    snap = runlane.get_run(run_id)
    # handed back with its attempt unspent
    assert snap.status is RunStatus.QUEUED
    assert [a.outcome for a in runlane.get_run_history(run_id).attempts] == ["released"]
    assert seen["runs_executed"] == 1  # the handler ran; its run went back
    assert not [t for t in threading.enumerate() if t.name.endswith("-stop-watch")]


def test_future_runs_do_not_keep_drain_open(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    calls: list[str] = []
    record = recording_task(calls)
    runlane = make_runlane(tasks=[record])
    runlane.trigger(record, Item(name="delayed"), delay=timedelta(seconds=60))
    runlane.trigger(record, Item(name="later"), run_at=datetime.now(UTC) + timedelta(hours=1))
    runlane.start()
    began = time.monotonic()
    assert runlane.drain().runs_executed == 0
    assert time.monotonic() - began < 2.0
    assert calls == []
    assert statuses(db, schema) == {"queued": 2}


def test_due_runs_are_drained_past_future_ones(make_runlane: RunlaneFactory) -> None:
    calls: list[str] = []
    record = recording_task(calls)
    runlane = make_runlane(tasks=[record])
    # the future run has the higher priority, so it sorts first among queued runs
    runlane.trigger(record, Item(name="future"), delay=timedelta(seconds=60), priority=100)
    runlane.trigger(record, Item(name="now"))
    assert runlane.drain().runs_executed == 1
    assert calls == ["now"]


def test_priority_order_then_fifo(make_runlane: RunlaneFactory) -> None:
    calls: list[str] = []
    record = recording_task(calls)
    runlane = make_runlane(tasks=[record])
    plan = [
        ("p0-a", 0),
        ("p5-a", 5),
        ("p0-b", 0),
        ("p10", 10),
        ("pm1", -1),
        ("p5-b", 5),
        ("p0-c", 0),
        ("p5-c", 5),
    ]
    for name, priority in plan:
        runlane.trigger(record, Item(name=name), priority=priority)
    assert runlane.drain().runs_executed == len(plan)
    assert calls == ["p10", "p5-a", "p5-b", "p5-c", "p0-a", "p0-b", "p0-c", "pm1"]


def test_queue_filter_drains_only_listed_queues(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    calls: list[str] = []
    record = recording_task(calls, queue="alpha")
    runlane = make_runlane(queues=[queue("alpha"), queue("beta"), queue("gamma")], tasks=[record])
    runlane.trigger(record, Item(name="a1"))
    runlane.trigger(record, Item(name="b1"), queue="beta")
    runlane.trigger(record, Item(name="a2"))
    runlane.trigger(record, Item(name="g1"), queue="gamma")
    assert runlane.drain(queues=["alpha"]).runs_executed == 2
    assert calls == ["a1", "a2"]
    assert statuses(db, schema) == {"completed": 2, "queued": 2}
    assert runlane.drain(queues=["beta", "gamma"]).runs_executed == 2
    assert calls == ["a1", "a2", "b1", "g1"]


@pytest.mark.parametrize(
    ("queues", "match"),
    [
        (["alpha", "nope"], "nope"),
        (["missing"], "missing"),
        ("alpha", "list"),
        ([], "at least one"),
    ],
    ids=["one-unknown", "all-unknown", "string", "empty"],
)
def test_queue_filter_rejects_bad_names(
    make_runlane: RunlaneFactory,
    db: psycopg.Connection[Any],
    schema: str,
    queues: Any,
    match: str,
) -> None:
    calls: list[str] = []
    record = recording_task(calls, queue="alpha")
    runlane = make_runlane(queues=[queue("alpha")], tasks=[record])
    runlane.trigger(record, Item(name="a"))
    with pytest.raises(ConfigurationError, match=match):
        runlane.drain(queues=queues)
    assert calls == []
    assert statuses(db, schema) == {"queued": 1}


def test_unregistered_task_fails_terminally(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    producer_calls: list[str] = []
    worker_calls: list[str] = []
    foreign = recording_task(producer_calls, task_id="foreign")
    local = recording_task(worker_calls, task_id="local")
    producer = make_runlane(tasks=[foreign])
    worker = make_runlane(tasks=[local])
    orphan = producer.trigger(foreign, Item(name="x"), max_attempts=5)
    mine = worker.trigger(local, Item(name="y"))

    assert worker.drain().runs_executed == 1  # the orphan is not counted
    assert worker_calls == ["y"]
    assert producer_calls == []
    assert worker.get_run(mine.id).status is RunStatus.COMPLETED

    snap = producer.get_run(orphan.id)
    assert snap.status is RunStatus.FAILED
    assert snap.attempt == 1
    assert snap.finished_at is not None
    assert snap.error is not None
    assert "TaskNotFound" in snap.error.type
    assert "foreign" in snap.error.message
    assert snap.error.retryable is False

    # not retried: nothing for maintenance to deliver, nothing left to drain
    assert producer.run_maintenance_once().due_runs_delivered == 0
    assert producer.drain().runs_executed == 0
    assert producer_calls == []
    assert producer.get_run(orphan.id).attempt == 1
    attempts = db.execute(
        sql.SQL("select attempt, outcome from {}.attempts where run_id = %s").format(
            sql.Identifier(schema)
        ),
        (orphan.id,),
    ).fetchall()
    assert attempts == [(1, "failed")]


def test_context_fields(make_runlane: RunlaneFactory) -> None:
    seen: list[RunContext] = []

    @task(id="ctx.check", schema=Item, queue="ctxq")
    def check(payload: Item, context: RunContext) -> None:
        seen.append(context)

    runlane = make_runlane(
        queues=[queue("ctxq"), queue("other")], tasks=[check], environment="ctx-env"
    )
    first = runlane.trigger(check, Item(name="a"), max_attempts=6)
    second = runlane.trigger(check, Item(name="b"), queue="other")
    assert runlane.drain().runs_executed == 2
    by_run = {c.run_id: c for c in seen}
    assert set(by_run) == {first.id, second.id}
    ctx = by_run[first.id]
    assert ctx.task_id == "ctx.check"
    assert ctx.queue == "ctxq"
    assert ctx.attempt == 1
    assert ctx.max_attempts == 6
    assert ctx.environment == "ctx-env"
    assert not ctx.cancelled.is_set()
    assert by_run[second.id].queue == "other"
    assert by_run[second.id].max_attempts == 3


def test_lease_is_held_while_handler_runs(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    observed: list[dict[str, Any]] = []

    @task(id="lease.observe", schema=Item)
    def observe(payload: Item, context: RunContext) -> None:
        # db is a separate autocommit connection, not one of the runtime's
        observed.append(lease_row(db, schema, context.run_id))

    runlane = make_runlane(tasks=[observe], lane_options={"lease_duration": timedelta(seconds=20)})
    handle = runlane.trigger(observe, Item(name="a"))
    assert runlane.drain().runs_executed == 1
    (row,) = observed
    assert row["status"] == "running"
    assert row["attempt"] == 1
    assert isinstance(row["lease_token"], uuid.UUID)
    assert row["lease_expires_at"] > row["db_now"]
    assert row["lease_expires_at"] - row["db_now"] <= timedelta(seconds=20)
    after = lease_row(db, schema, handle.id)
    assert after["status"] == "completed"
    assert after["lease_token"] is None
    assert after["lease_expires_at"] is None


def test_each_attempt_gets_a_fresh_lease_token(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    tokens: list[uuid.UUID] = []

    @task(id="lease.tokens", schema=Item)
    def grab(payload: Item, context: RunContext) -> None:
        tokens.append(lease_row(db, schema, context.run_id)["lease_token"])

    runlane = make_runlane(tasks=[grab])
    runlane.trigger_many(grab, [Item(name="a"), Item(name="b")])
    assert runlane.drain().runs_executed == 2
    assert len(set(tokens)) == 2


def test_lease_is_extended_while_handler_runs(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    observed: list[dict[str, Any]] = []
    cancelled: list[bool] = []

    @task(id="lease.long", schema=Item)
    def long_running(payload: Item, context: RunContext) -> None:
        observed.append(lease_row(db, schema, context.run_id))
        # the lease is 1 s; waiting 2.5 s outlives it unless it is extended
        threading.Event().wait(2.5)
        observed.append(lease_row(db, schema, context.run_id))
        cancelled.append(context.cancelled.is_set())

    runlane = make_runlane(
        tasks=[long_running], lane_options={"lease_duration": timedelta(seconds=1)}
    )
    handle = runlane.trigger(long_running, Item(name="a"))
    assert runlane.drain().runs_executed == 1
    first, second = observed
    assert first["status"] == second["status"] == "running"
    assert first["lease_token"] == second["lease_token"]
    assert second["lease_expires_at"] > first["lease_expires_at"] + timedelta(seconds=1)
    assert second["lease_expires_at"] > second["db_now"]  # still live after 2.5 s
    assert cancelled == [False]
    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.attempt == 1


def test_task_timeout_sets_cancelled(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    seen: list[bool] = []
    waited: list[float] = []

    @task(id="slow", schema=Item, timeout=timedelta(seconds=1))
    def slow(payload: Item, context: RunContext) -> None:
        began = time.monotonic()
        seen.append(context.cancelled.wait(10))  # 10 s is only a safety net
        waited.append(time.monotonic() - began)

    runlane = make_runlane(tasks=[slow], lane_options={"lease_duration": timedelta(seconds=1)})
    handle = runlane.trigger(slow, Item(name="a"))
    assert runlane.drain().runs_executed == 1
    assert seen == [True]
    assert 0.9 <= waited[0] < 5.0
    # the attempt is failed as timed out (and retried per policy), not left holding a lease
    row = lease_row(db, schema, handle.id)
    assert row["status"] == "retrying"
    assert row["lease_token"] is None
    snap = runlane.get_run(handle.id)
    assert snap.error is not None
    assert "TaskTimeout" in snap.error.type
