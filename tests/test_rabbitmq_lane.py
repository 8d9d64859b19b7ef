"""The RabbitMQ lane as a caller sees it: eager triggers started within milliseconds, the
caller's transaction respected, drain() refused, bad configuration refused before anything is
written, a worker that waits out a missing broker, bounded queues across workers, and the
outbox in ``status``.

Tests share the session broker (``rabbitmq_url``; queue names carry the test's schema) unless
they need to stop their own (``rabbitmq_node``)."""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from runlane import (
    ConfigurationError,
    MaintenanceLimits,
    RetryPolicy,
    RunContext,
    Runlane,
    RunlaneClosed,
    RunStatus,
    queue,
    task,
)
from runlane.cli._rabbit_nodes import RabbitNode
from runlane.lanes import AcquirerOptions
from runlane.rabbitmq import RabbitMQStatus, rabbitmq_lane
from runlane.rabbitmq._consumer import RabbitAcquirer
from runlane.testing import MovableClock
from tests.conftest import RabbitRuntimes
from tests.helpers import (
    Executions,
    closed_port,
    consumer_ready,
    consumer_stats,
    outbox_count,
    poll,
    q,
    wait_for_status,
    wait_until,
)

Conn = psycopg.Connection[Any]


def _rows(db: Conn, schema: str) -> tuple[int, int, int]:
    """(runs, outbox items, outbox environments) stored in the schema."""
    row = db.execute(
        q(
            "select (select count(*) from {s}.runs), (select count(*) from {s}.outbox), "
            "(select count(*) from {s}.outbox_environments)",
            schema,
        )
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


# -- eager triggers and the caller's transaction -------------------------------------------------


def test_eager_trigger_starts_an_idle_worker_within_milliseconds_without_maintenance(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, database_url: str, schema: str, db: Conn
) -> None:
    executions = Executions()
    eager = executions.task("lane.eager")

    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[eager])
    worker = rl.create_delivery_worker(concurrency=2)
    consumer_ready(worker)
    # the first trigger connects the runtime's publisher; measure the ones after it
    rl.wait_for_run(rl.trigger(eager, "warm-up").id, timeout=15)
    latencies: list[float] = []
    for n in range(20):
        before = time.monotonic()
        run_id = rl.trigger(eager, n).id
        wait_until(
            lambda run_id=run_id: run_id in executions.started,  # type: ignore[misc]
            timeout=5,
            what=f"run {n} to start",
        )
        latencies.append(executions.started[run_id] - before)
    p50 = statistics.median(latencies)
    print(f"\ntrigger-to-start p50 {p50 * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms")
    assert p50 < 1.0, latencies
    assert max(latencies) < 2.0, latencies

    # trigger(connection=...): stored unclaimed; published only once the caller commits
    with psycopg.connect(database_url) as conn:
        held = rl.trigger(eager, "in-transaction", connection=conn).id
        # a run triggered after it, outside the transaction, starts and completes meanwhile
        rl.wait_for_run(rl.trigger(eager, "sentinel").id, timeout=10)
        assert held not in executions.started, "a run started before its trigger committed"
        conn.commit()
        committed_at = time.monotonic()
    rl.wait_for_run(held, timeout=10)
    after_commit = executions.started[held] - committed_at
    print(f"connection= trigger started {after_commit * 1000:.1f} ms after its commit")
    assert after_commit < 2.0  # woken by NOTIFY: no maintenance runs here

    # rolled back: no run, no item, no message
    with psycopg.connect(database_url) as conn:
        gone = rl.trigger(eager, "rolled-back", connection=conn).id
        conn.rollback()
    rl.wait_for_run(rl.trigger(eager, "after-rollback").id, timeout=10)
    worker.close(timeout=10)
    assert gone not in executions.runs
    assert not executions.more_than_once()
    assert db.execute(
        q("select count(*) from {s}.runs where id = %s", schema), (gone,)
    ).fetchone() == (0,)
    assert outbox_count(db, schema) == 0
    assert consumer_stats(worker).unknown == 0
    assert consumer_stats(worker).duplicates == 0


def test_drain_is_refused_with_the_reason_and_what_to_use_instead(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    @task(id="lane.noop")
    def noop(payload: Any, context: RunContext) -> None:
        return None

    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[noop])
    with pytest.raises(ConfigurationError) as caught:
        rl.drain()
    message = str(caught.value)
    assert "rabbitmq lane" in message
    assert "cannot prove that the broker holds no message" in message  # why
    assert "create_delivery_worker" in message  # what to use instead
    assert "runlane worker APP" in message
    assert "wait_for_run" in message
    assert "postgres_polling_lane" in message


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("amqp_url", "says"),
    [
        ("http://guest:s3cret-pw@x", "must start with amqp:// or amqps://, got http scheme"),
        ("amqp://", "names no host"),
        ("amqp://guest:s3cret-pw@h:99999/", "not a valid URL"),
        ("", "needs an amqp_url"),
        ("   ", "needs an amqp_url"),
        (None, "needs an amqp_url"),
        (5672, "needs an amqp_url"),
        (b"amqp://guest:s3cret-pw@h/", "needs an amqp_url"),
        ("guest:s3cret-pw@h:5672", "must start with amqp://"),
    ],
)
def test_an_amqp_url_that_is_not_one_is_refused_without_echoing_a_password(
    database_url: str, fresh_schema: str, db: Conn, amqp_url: Any, says: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        rabbitmq_lane(connection_string=database_url, schema=fresh_schema, amqp_url=amqp_url)
    assert says in str(caught.value)
    assert "s3cret-pw" not in str(caught.value)
    assert caught.value.__cause__ is None  # no chained exception repeats the URL either
    # nothing was created: not even the schema
    row = db.execute(
        "select count(*) from information_schema.schemata where schema_name = %s", (fresh_schema,)
    ).fetchone()
    assert row == (0,)


def test_bad_limits_and_claim_durations_are_refused_and_write_nothing(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, database_url: str, schema: str, db: Conn
) -> None:
    @task(id="lane.noop")
    def noop(payload: Any, context: RunContext) -> None:
        return None

    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[noop])
    rl.trigger(noop, None)
    # its item is published (and removed) on the publisher's thread: wait for that, so
    # that what the refused calls must not change holds still (a CI run read the item
    # before its publish and the outbox empty after it)
    wait_until(lambda: _rows(db, schema)[1] == 0, timeout=15, what="the eager publish")
    before = _rows(db, schema)
    limits: list[Any] = [0, -1, True, 1.5]
    for limit in limits:
        with pytest.raises(
            ConfigurationError, match="outbox_publish_limit must be an integer from 1 to"
        ):
            rl.run_maintenance_once(MaintenanceLimits(outbox_publish_limit=limit))
    for claim, publish in ((1, 2), (2, 2), (0.5, 10)):
        with pytest.raises(ConfigurationError, match="must be longer than publish_timeout"):
            rabbitmq_lane(
                connection_string=database_url,
                schema=schema,
                amqp_url=rabbitmq_url,
                claim_duration=timedelta(seconds=claim),
                publish_timeout=timedelta(seconds=publish),
            )
    with pytest.raises(ConfigurationError, match="claim_duration must be a positive"):
        rabbitmq_lane(
            connection_string=database_url,
            schema=schema,
            amqp_url=rabbitmq_url,
            claim_duration=timedelta(0),
        )
    assert _rows(db, schema) == before
    assert rl.status().outbox_pending == before[1]


# -- a broker that is not there --------------------------------------------------------------


def test_a_worker_started_before_its_broker_retries_with_backoff_then_consumes(
    rabbit_runtime: RabbitRuntimes,
    rabbitmq_node: RabbitNode,
    caplog: pytest.LogCaptureFixture,
    db: Conn,
    schema: str,
) -> None:
    caplog.set_level(logging.INFO, logger="runlane")
    password = rabbitmq_node.amqp_url.split(":")[2].split("@")[0]
    assert len(password) >= 8
    assert password in rabbitmq_node.amqp_url
    executions = Executions()
    late = executions.task("lane.late")

    rabbitmq_node.stop()
    rl = rabbit_runtime(
        amqp_url=rabbitmq_node.amqp_url,
        tasks=[late],
        publish_timeout=timedelta(seconds=1),
        claim_duration=timedelta(seconds=3),
    )
    run_ids = [rl.trigger(late, n).id for n in range(3)]  # commits; publishing fails
    worker = rl.create_delivery_worker(concurrency=2)
    where = f"127.0.0.1:{rabbitmq_node.port}"

    def retries() -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.name == "runlane.rabbitmq.consumer" and "unavailable" in r.getMessage()
        ]

    wait_until(lambda: len(retries()) >= 4, timeout=15, what="the consumer to retry 4 times")
    seen = retries()
    assert all(where in r.getMessage() and "retrying" in r.getMessage() for r in seen)
    gaps = [b.created - a.created for a, b in itertools.pairwise(seen)]
    assert gaps[-1] > gaps[0], f"no backoff between retries: {gaps}"
    report = rl.status()
    broker = RabbitMQStatus.of(report).broker
    assert broker is not None
    assert broker.startswith(f"unreachable at {where}")
    assert report.outbox_pending == 3
    assert all(rl.get_run(r).status is RunStatus.QUEUED for r in run_ids)

    rabbitmq_node.start()
    consumer_ready(worker, timeout=20)

    def completed() -> bool:
        if all(rl.get_run(r).status is RunStatus.COMPLETED for r in run_ids):
            return True
        rl.run_maintenance_once()
        return False

    assert poll(completed, timeout=45, interval=0.2), rl.status()
    worker.close(timeout=10)
    assert not executions.more_than_once()
    assert set(executions.runs) == set(run_ids)
    assert RabbitMQStatus.of(rl.status()).broker == f"reachable at {where}"
    for record in caplog.records:
        text = record.getMessage() + (
            logging.Formatter().formatException(record.exc_info) if record.exc_info else ""
        )
        assert password not in text, f"{record.name} logged the broker's password"
    assert any(where in r.getMessage() and "consuming" in r.getMessage() for r in caplog.records)


# -- bounded queues ------------------------------------------------------------------------


def test_a_bounded_queue_never_runs_two_handlers_at_once_across_two_workers(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    single = queue("single", concurrency_limit=1)
    executions = Executions()
    lock = threading.Lock()
    active = [0]
    most = [0]
    held_back = threading.Event()

    @task(id="lane.bounded", queue="single")
    def bounded(payload: Any, context: RunContext) -> Any:
        executions.add(context)
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        # the first run holds the queue's one slot until the others arrived and were held back
        held_back.wait(30)
        with lock:
            active[0] -= 1
        return payload

    def runtime() -> Runlane:
        return rabbit_runtime(
            amqp_url=rabbitmq_url,
            tasks=[bounded],
            queues=[single],
            defer_delay=timedelta(milliseconds=100),
        )

    producer, first, second = runtime(), runtime(), runtime()
    workers = [
        first.create_delivery_worker(concurrency=2),
        second.create_delivery_worker(concurrency=2),
    ]
    for worker in workers:
        consumer_ready(worker)
    run_ids = [h.id for h in producer.trigger_many(bounded, list(range(12)))]
    wait_until(
        lambda: sum(consumer_stats(w).deferred for w in workers) > 0,
        timeout=30,
        what="a delivery held back",
    )
    held_back.set()
    for run_id in run_ids:
        snapshot = producer.wait_for_run(run_id, timeout=30)
        assert snapshot.status is RunStatus.COMPLETED
    for worker in workers:
        worker.close(timeout=10)
    assert most[0] == 1
    assert not executions.more_than_once()
    assert set(executions.runs) == set(run_ids)
    deferred = sum(consumer_stats(w).deferred for w in workers)
    print(f"\n{deferred} deliveries deferred through the outbox")
    assert deferred > 0
    assert outbox_count(db, schema) == 0


def test_deliveries_taken_around_ones_still_buffered_are_each_acknowledged_once(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str
) -> None:
    """A claim's deliveries are acknowledged with one frame up to the lowest delivery still
    unsettled, the rest one by one. Deliveries of a bounded queue beyond the free slots stay
    in the buffer while later ones of another queue are claimed and acknowledged:
    acknowledging those "up to" past a buffered one would settle it early, and acknowledging
    it again later is a channel error (unknown delivery tag) that closes the consumer's
    channel. The acquirer is driven directly, as a worker's acquiring slot drives it."""
    single = queue("single", concurrency_limit=1)
    fast = queue("fast")

    @task(id="lane.slow", queue="single")
    def slow(payload: Any, context: RunContext) -> Any:
        return payload

    @task(id="lane.fast", queue="fast")
    def quick(payload: Any, context: RunContext) -> Any:
        return payload

    runlane = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[slow, quick], queues=[single, fast])
    runlane.start()
    acquirer = runlane.lane.create_acquirer(
        runlane._life.storage,
        AcquirerOptions(
            environment=runlane.environment,
            queues=[single, fast],
            name="test-acquirer",
            lease=timedelta(seconds=60),
            drain=False,
            concurrency=4,
            claim_batch=16,
        ),
        lambda run_id: None,
    )
    assert isinstance(acquirer, RabbitAcquirer)
    acquirer.start()
    try:
        assert acquirer.consuming.wait(15), "the consumer consuming"
        slow_ids = {h.id for h in runlane.trigger_many(slow, list(range(6)))}
        wait_until(lambda: len(acquirer._buffer) == 6, timeout=15, what="6 buffered")
        fast_ids = {h.id for h in runlane.trigger_many(quick, list(range(10)))}
        wait_until(lambda: len(acquirer._buffer) == 16, timeout=15, what="16 buffered")
        # one bounded run and every other queue's: five bounded deliveries stay buffered,
        # below the tags acknowledged now
        taken = {c.id for c in acquirer.acquire(11, 1)}
        assert taken - slow_ids == fast_ids
        assert len(taken & slow_ids) == 1
        assert _channel_round_trip(acquirer) == []
        # the rest: the bounded queue is at capacity, so they are deferred and acknowledged
        assert acquirer.acquire(16, 5) == []
        assert _channel_round_trip(acquirer) == []
        assert acquirer.stats.deferred == 5, acquirer.stats
        assert acquirer.stats.connections == 1, acquirer.stats
        assert not acquirer._unsettled
    finally:
        acquirer.close(10)


def _channel_round_trip(acquirer: RabbitAcquirer) -> list[BaseException]:
    """A synchronous call on the consumer's channel, on its thread, after every settlement
    already scheduled (the acknowledgements wait for their WAL flush first): it fails if the
    broker closed the channel over one of them."""
    wait_until(acquirer._acks.idle, timeout=10, what="the acknowledgements' WAL flush")
    conn, channel = acquirer._conn, acquirer._channel
    assert conn is not None
    assert channel is not None
    done = threading.Event()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            channel.basic_qos(prefetch_count=acquirer._prefetch)
        except Exception as exc:  # the test reports it
            errors.append(exc)
        finally:
            done.set()

    conn.add_callback_threadsafe(call)
    assert done.wait(10), "the consumer thread did not run the call"
    return errors


# -- status ----------------------------------------------------------------------------------

APP = textwrap.dedent(
    """
    import os
    from datetime import timedelta
    from runlane import create_runlane, task
    from runlane.rabbitmq import rabbitmq_lane

    @task(id="lane.status")
    def noop(payload, context):
        return None

    runlane = create_runlane(
        lane=rabbitmq_lane(
            connection_string=os.environ["APP_DATABASE_URL"],
            schema=os.environ["APP_SCHEMA"],
            amqp_url=os.environ["APP_AMQP_URL"],
            connect_timeout=2.0,
            publish_timeout=timedelta(seconds=1),
            claim_duration=timedelta(seconds=5),
        ),
        tasks=[noop],
    )
    """
)


def test_status_shows_the_pending_outbox_while_the_broker_is_down(
    rabbit_runtime: RabbitRuntimes, database_url: str, schema: str, tmp_path: Path
) -> None:
    @task(id="lane.status")
    def noop(payload: Any, context: RunContext) -> None:
        return None

    down = f"amqp://guest:s3cret-pw@127.0.0.1:{closed_port()}/%2F"
    rl = rabbit_runtime(
        amqp_url=down,
        tasks=[noop],
        publish_timeout=timedelta(seconds=1),
        claim_duration=timedelta(seconds=5),
    )
    empty = rl.status()
    assert empty.outbox_pending == 0
    assert empty.outbox_oldest_age_seconds is None
    rl.trigger_many(noop, [1, 2, 3])
    first = rl.status()
    assert first.outbox_pending == 3
    assert first.outbox_oldest_age_seconds is not None
    assert first.outbox_oldest_age_seconds >= 0
    first_broker = RabbitMQStatus.of(first).broker
    assert first_broker is not None
    assert first_broker.startswith("unreachable at 127.0.0.1:")
    first_age = first.outbox_oldest_age_seconds
    wait_until(
        lambda: (rl.status().outbox_oldest_age_seconds or 0) > first_age + 0.2,
        timeout=5,
        what="the oldest item to age",
    )

    (tmp_path / "statusapp.py").write_text(APP)
    env = {
        **os.environ,
        "APP_DATABASE_URL": database_url,
        "APP_SCHEMA": schema,
        "APP_AMQP_URL": down,
    }
    done = subprocess.run(
        [sys.executable, "-m", "runlane.cli", "status", "statusapp:runlane"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done  # unhealthy: the broker is unreachable
    lines = [line.strip() for line in done.stdout.splitlines()]
    assert any(
        line.startswith("pending outbox items") and line.split()[-1] == "3" for line in lines
    ), (done.stdout, done.stderr)
    assert any(
        line.startswith("oldest pending outbox item") and line.endswith("s old") for line in lines
    ), done.stdout
    assert any(
        line.startswith("broker") and "unreachable at 127.0.0.1:" in line for line in lines
    ), done.stdout
    assert "unhealthy: broker unreachable at 127.0.0.1:" in done.stderr
    assert "s3cret-pw" not in done.stdout + done.stderr


def test_a_runtime_closed_right_after_eager_triggers_records_what_it_publishes(
    rabbit_runtime: RabbitRuntimes,
    rabbitmq_url: str,
    db: Conn,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """close() lets the publisher finish what triggers handed it: it publishes the items and
    records them (the storage refuses every other call meanwhile). It used to mark the
    storage closed first, so the records failed: 104 of 201 items stayed claimed in the
    outbox, to be published a second time when their claims expired."""
    executions = Executions()
    closing = executions.task("lane.closing")

    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[closing])
    ids = [rl.trigger(closing, "connects the publisher").id]
    lock = threading.Lock()

    def burst(first: int) -> None:
        for n in range(first, first + 50):
            run_id = rl.trigger(closing, n).id
            with lock:
                ids.append(run_id)

    threads = [
        threading.Thread(target=burst, args=(i * 50,), name=f"test-burst-{i}") for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    with caplog.at_level(logging.WARNING, logger="runlane"):
        rl.close(timeout=30)
    assert not [r for r in caplog.records if "could not record" in r.getMessage()]
    assert outbox_count(db, schema) == 0
    with pytest.raises(RunlaneClosed):
        rl.trigger(closing, "after close")
    # every run was published once: a new runtime's worker runs each, once
    again = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[closing])
    worker = again.create_delivery_worker(concurrency=8)
    wait_until(
        lambda: len(executions.runs) == len(ids),
        timeout=30,
        what="every run to execute",
        state=lambda: len(executions.runs),
    )
    worker.close(timeout=10)
    assert set(executions.runs) == set(ids)
    assert not executions.more_than_once()
    assert consumer_stats(worker).duplicates == 0


def test_a_retry_an_hour_away_is_delivered_once_the_clock_is_moved_past_it(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, clock: MovableClock
) -> None:
    """rabbitmq_lane(clock=...): the retry delay passes on the moved clock, for the
    statements and the triggers of every storage of the lane (maintenance's due delivery
    writes the outbox item, the publisher publishes it, the consumer claims it), not by
    waiting an hour."""
    attempts: list[int] = []

    @task(
        id="lane.later",
        retry=RetryPolicy(
            max_attempts=2, initial_delay=timedelta(hours=1), max_delay=timedelta(hours=1), jitter=0
        ),
    )
    def later(payload: Any, context: RunContext) -> str:
        attempts.append(context.attempt)
        if context.attempt == 1:
            raise RuntimeError("the first attempt fails")
        return "second"

    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[later], clock=clock)
    with rl.create_delivery_worker(concurrency=1) as worker:
        consumer_ready(worker)
        handle = rl.trigger(later, None)
        retrying = wait_for_status(rl, handle.id, RunStatus.RETRYING)
        assert retrying.due_at is not None
        assert retrying.due_at > clock() + timedelta(minutes=59)
        assert rl.run_maintenance_once().due_runs_delivered == 0  # not due yet
        clock.advance(3600)
        assert rl.run_maintenance_once().due_runs_delivered == 1
        done = rl.wait_for_run(handle.id, timeout=30)
    assert done.status is RunStatus.COMPLETED
    assert done.output == "second"
    assert attempts == [1, 2]


def test_a_clock_that_cannot_be_called_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="clock must be callable"):
        rabbitmq_lane(
            connection_string="postgresql://localhost/runlane",
            amqp_url="amqp://guest:guest@localhost:5672/%2F",
            clock=5,  # type: ignore[arg-type]
        )
