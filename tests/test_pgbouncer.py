"""Through PgBouncer in transaction mode (issue 40): the lane conformance suite, a worker,
maintenance, triggers from many threads and the operator CLI, with the LISTEN connection
straight to the server (``listen_connection_string=``), or found to go through the pooler and
given up for polling; and a process out of pooled connections says so within its connect
timeout, having written nothing. PgBouncer 1.18 (Debian bookworm) cannot keep a prepared
statement across transactions: a named prepared statement sent through it fails as soon as
the next transaction runs on another server connection, which these tests make likely by
giving the pooler few server connections for many clients."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from runlane import (
    ConfigurationError,
    Queue,
    RunContext,
    StorageUnavailable,
    Task,
    create_runlane,
)
from runlane import task as runlane_task
from runlane.postgres import postgres_polling_lane
from runlane.postgres._storage import PostgresStorage
from runlane.rabbitmq import rabbitmq_lane
from runlane.runtime import _waiting
from runlane.testing.conformance import LaneConformance, LaneHarness
from tests._pgbouncer import PgBouncer, require_pgbouncer, start_pgbouncer
from tests.conftest import RunlaneFactory
from tests.helpers import count_runs, in_process_cli, logged, statuses, storage_of, wait_until

# few server connections for every client of the module: a statement prepared by name on
# one would be missing on the next transaction's
_POOL_SIZE = 4


@pytest.fixture(scope="module")
def bouncer(database_url: str) -> Iterator[PgBouncer]:
    require_pgbouncer()
    with start_pgbouncer(database_url, pool_size=_POOL_SIZE) as running:
        yield running


def _lane(bouncer: PgBouncer, database_url: str, schema: str, **options: Any) -> Any:
    return postgres_polling_lane(
        connection_string=bouncer.url,
        schema=schema,
        listen_connection_string=database_url,
        pooler="transaction",
        **options,
    )


class PgBouncerHarness(LaneHarness):
    """The polling lane through PgBouncer, its LISTEN connection straight to the server."""

    name = "postgres-polling-through-pgbouncer"

    def __init__(self, bouncer: PgBouncer, database_url: str, schema: str) -> None:
        self.bouncer = bouncer
        self.database_url = database_url
        self.schema = schema

    def build_lane(self, *, lease_duration: timedelta, poll_interval: timedelta) -> Any:
        return _lane(
            self.bouncer,
            self.database_url,
            self.schema,
            lease_duration=lease_duration,
            poll_interval=poll_interval,
        )


class TestPollingLaneThroughPgBouncer(LaneConformance):
    @pytest.fixture
    def lane_harness(self, bouncer: PgBouncer, database_url: str, schema: str) -> LaneHarness:
        return PgBouncerHarness(bouncer, database_url, schema)


def _echo(payload: Any, context: RunContext) -> Any:
    return payload


def _storage(rl: Any) -> PostgresStorage:
    storage = storage_of(rl)
    assert isinstance(storage, PostgresStorage)
    return storage


def _pooler_errors(bouncer: PgBouncer) -> list[str]:
    """What PgBouncer logged as a statement's or a login's failure."""
    return [
        line
        for line in bouncer.log_text().splitlines()
        if "ERROR" in line or "FATAL" in line or "prepared statement" in line
    ]


def test_triggers_from_many_threads_a_worker_and_maintenance(
    bouncer: PgBouncer, database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    """Group commit's inserts (the libpq path: unprepared here), claims, lifecycle writes
    and maintenance passes, from 8 trigger threads and a worker at concurrency 4, on 4
    server connections: every run completes once, and neither side logged an error."""
    done: list[int] = []
    lock = threading.Lock()

    def count(payload: int, context: RunContext) -> int:
        with lock:
            done.append(payload)
        return payload

    task: Task[Any, Any] = runlane_task(id="count")(count)
    rl = create_runlane(lane=_lane(bouncer, database_url, schema), tasks=[task])
    try:
        assert _storage(rl)._db._shared.pooling.transaction
        # nothing is prepared by name through the pooler: not by psycopg, not by _pq.py
        assert _storage(rl)._db.run(lambda conn: conn.prepare_threshold) is None
        worker = rl.create_delivery_worker(concurrency=4)
        errors: list[BaseException] = []

        def trigger(start: int) -> None:
            try:
                for n in range(start, start + 50):
                    rl.trigger(task, n)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=trigger, args=(i * 50,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        rl.run_maintenance_once()
        wait_until(lambda: len(done) >= 400, timeout=60, what="400 runs done")
        worker.close(10)
        rl.run_maintenance_once()
    finally:
        rl.close()
    assert sorted(done) == list(range(400))
    assert statuses(db, schema) == {"completed": 400}
    assert _pooler_errors(bouncer) == []


def test_the_rabbitmq_lane_through_pgbouncer(
    bouncer: PgBouncer,
    database_url: str,
    schema: str,
    rabbitmq_url: str,
    db: psycopg.Connection[Any],
) -> None:
    """The RabbitMQ lane's storage through PgBouncer (its outbox claims set their claim in
    the transaction), its publisher's LISTEN straight to the server: triggered one at a
    time and in a batch, every run completes once; neither side logged an error."""
    task: Task[Any, Any] = runlane_task(id="relay")(_echo)
    lane = rabbitmq_lane(
        connection_string=bouncer.url,
        schema=schema,
        amqp_url=rabbitmq_url,
        listen_connection_string=database_url,
        pooler="transaction",
    )
    rl = create_runlane(lane=lane, tasks=[task])
    try:
        with rl.create_delivery_worker(concurrency=2):
            for n in range(20):
                rl.trigger(task, n)
            rl.trigger_many(task, list(range(20, 60)))
            wait_until(
                lambda: statuses(db, schema) == {"completed": 60},
                timeout=30,
                what="60 runs completed",
            )
    finally:
        rl.close()
    assert _pooler_errors(bouncer) == []


def test_the_lane_finds_the_pooler_and_polls_when_listen_cannot_go_elsewhere(
    bouncer: PgBouncer, schema: str, db: psycopg.Connection[Any]
) -> None:
    """``pooler="auto"`` (the default) on PgBouncer's URL: the storage finds the pooler on
    its first connection (no prepared statements from then on), the listener says in one
    line that LISTEN through it cannot hear and stops, and the worker runs by polling."""
    task: Task[Any, Any] = runlane_task(id="echo")(_echo)
    lane = postgres_polling_lane(
        connection_string=bouncer.url, schema=schema, poll_interval=timedelta(milliseconds=50)
    )
    rl = create_runlane(lane=lane, tasks=[task])
    try:
        with logged("goes through a connection pooler", "runlane.listener") as gave_up:
            run = rl.trigger(task, 1)
            assert _storage(rl)._db._shared.pooling.transaction
            with rl.create_delivery_worker(concurrency=2):
                assert gave_up.wait(10)
                assert rl.wait_for_run(run.id, timeout=10).status == "completed"
                for n in range(20):  # enough statements for psycopg to prepare them
                    rl.trigger(task, n)
                wait_until(
                    lambda: statuses(db, schema) == {"completed": 21},
                    timeout=20,
                    what="21 completed",
                )
    finally:
        rl.close()
    assert _pooler_errors(bouncer) == []


def test_the_start_says_where_listen_goes(
    bouncer: PgBouncer, database_url: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "runlane")
    task: Task[Any, Any] = runlane_task(id="noop")(_echo)
    rl = create_runlane(lane=_lane(bouncer, database_url, schema), tasks=[task])
    try:
        with (
            logged("(listen_connection_string)", "runlane.listener") as said,
            rl.create_delivery_worker(concurrency=1),
        ):
            assert said.wait(10)
    finally:
        rl.close()
    polling = create_runlane(
        lane=postgres_polling_lane(connection_string=bouncer.url, schema=schema, listen=False),
        tasks=[task],
    )
    try:
        with (
            logged("polls only (listen=False)", "runlane.postgres.acquirer") as said,
            polling.create_delivery_worker(concurrency=1),
        ):
            assert said.wait(10)
    finally:
        polling.close()


def _waiting_for(rl: Any, run_id: Any) -> tuple[threading.Thread, list[Any]]:
    """A thread in ``wait_for_run(run_id)`` (45 s at most), and where its answer goes."""
    answers: list[Any] = []
    waiter = threading.Thread(
        target=lambda: answers.append(rl.wait_for_run(run_id, timeout=45)),
        name="test-pgbouncer-waiter",
    )
    waiter.start()
    return waiter, answers


def test_wait_for_run_hears_the_end_through_listen_connection_string(
    bouncer: PgBouncer,
    database_url: str,
    schema: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``pooler="auto"`` on PgBouncer's URL with ``listen_connection_string=``: the LISTEN
    of wait_for_run goes straight to the server, as a worker's does, and a run's end wakes
    it. Its fallback read is put off to a minute, so only the announcement can end a wait
    that started once the LISTEN was up, within the 20 s given."""
    monkeypatch.setattr(_waiting, "_ENDS_FALLBACK_POLL_SECONDS", 60.0)
    caplog.set_level(logging.INFO, "runlane")
    task: Task[Any, Any] = runlane_task(id="echo")(_echo)
    lane = postgres_polling_lane(
        connection_string=bouncer.url, schema=schema, listen_connection_string=database_url
    )
    rl = create_runlane(lane=lane, tasks=[task])
    try:
        run = rl.trigger(task, 1)
        with logged("(listen_connection_string)", "runlane.listener") as listening:
            with pytest.raises(TimeoutError):  # starts the runtime's run-end listener
                rl.wait_for_run(run.id, timeout=0.1)
            assert listening.wait(10)
        waiter, answers = _waiting_for(rl, run.id)
        assert rl.drain().completed == 1
        waiter.join(20)
        assert not waiter.is_alive(), "the run's end was not heard"
        assert [answer.status for answer in answers] == ["completed"]
    finally:
        rl.close()
    assert _pooler_errors(bouncer) == []


def test_wait_for_run_through_the_pooler_alone_says_so_once_and_polls(
    bouncer: PgBouncer,
    schema: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``pooler="auto"`` on PgBouncer's URL and nowhere else to LISTEN: wait_for_run's
    listener finds the pooler, says so in one WARNING line for the runtime, and stops;
    waits read the run at their polling interval (not the 60 s fallback of a listener
    thought to hear), so each returns once drain() completes its run."""
    monkeypatch.setattr(_waiting, "_ENDS_FALLBACK_POLL_SECONDS", 60.0)
    caplog.set_level(logging.WARNING, "runlane.listener")
    task: Task[Any, Any] = runlane_task(id="echo")(_echo)
    rl = create_runlane(
        lane=postgres_polling_lane(connection_string=bouncer.url, schema=schema), tasks=[task]
    )
    try:
        first, second = rl.trigger(task, 1), rl.trigger(task, 2)
        with logged("goes through a connection pooler", "runlane.listener") as gave_up:
            with pytest.raises(TimeoutError):  # starts the runtime's run-end listener
                rl.wait_for_run(first.id, timeout=0.1)
            assert gave_up.wait(10)
        for run in (first, second):
            waiter, answers = _waiting_for(rl, run.id)
            assert rl.drain(max_runs=1).completed == 1
            waiter.join(20)
            assert not waiter.is_alive(), "wait_for_run did not poll"
            assert [answer.status for answer in answers] == ["completed"]
    finally:
        rl.close()
    said = [r for r in caplog.records if "goes through a connection pooler" in r.getMessage()]
    assert len(said) == 1
    assert "runlane-run-ends" in said[0].getMessage()
    assert _pooler_errors(bouncer) == []


def test_the_operator_cli_through_pgbouncer(
    bouncer: PgBouncer,
    make_runlane: RunlaneFactory,
    schema: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    task: Task[Any, Any] = runlane_task(id="later", queue="held")(_echo)
    rl = make_runlane(tasks=[task], queues=[Queue("held")])
    ids = [str(rl.trigger(task, n).id) for n in range(3)]
    cli = in_process_cli(capsys)
    target = ["--database-url", bouncer.url, "--schema", schema]
    for _ in range(3):  # past psycopg's prepare threshold on repeated statements
        code, out, err = cli("status", *target)
        assert code == 0, err
        code, out, err = cli("runs", "list", "--json", *target)
        assert code == 0, err
        assert all(run_id in out for run_id in ids)
    code, out, err = cli("queues", "pause", "held", *target)
    assert code == 0, err
    code, out, err = cli("runs", "cancel", ids[0], *target)
    assert code == 0, err
    assert rl.get_run(ids[0]).status in {"cancelled", "cancellation_requested"}
    assert _pooler_errors(bouncer) == []


def test_a_process_out_of_pooled_connections_says_so_in_one_line(
    bouncer: PgBouncer, database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    """Every connection of the runtime's pool is in use: a trigger waits the connect
    timeout for one, then fails in one line saying so; no run was written."""
    task: Task[Any, Any] = runlane_task(id="t")(_echo)
    lane = _lane(bouncer, database_url, schema, pool_max_size=1, connect_timeout=1.0)
    rl = create_runlane(lane=lane, tasks=[task])
    try:
        rl.list_queues()  # the pool is open
        source: Any = _storage(rl)._db._source
        with source.connection():  # the pool's one connection, held
            started = time.monotonic()
            with pytest.raises(StorageUnavailable) as caught:
                rl.trigger(task, 1)
            waited = time.monotonic() - started
        message = str(caught.value)
        assert "\n" not in message
        assert "all 1 connections of its pool" in message, message
        assert "nothing was written" in message
        assert 0.9 <= waited < 5, waited
        assert count_runs(db, schema) == 0
        rl.trigger(task, 2)  # the pool was kept: it is only busy
        assert count_runs(db, schema) == 1
    finally:
        rl.close()


def test_a_pooler_out_of_connections_is_said_in_one_line(
    database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    """PgBouncer's own budget spent: its one server connection held by another client's
    transaction, a trigger waits the pooler's query_wait_timeout once (not once more per
    reconnect try), then fails in one line naming it; nothing was written. A client past
    its max_client_conn is refused in one line too."""
    task: Task[Any, Any] = runlane_task(id="t")(_echo)
    with (
        start_pgbouncer(database_url, pool_size=1, max_client_conn=2, query_wait_timeout=1) as tiny,
        psycopg.connect(tiny.url, autocommit=True) as holder,
    ):
        holder.execute("begin")
        holder.execute("select 1")  # the pooler's one server connection, held
        lane = postgres_polling_lane(
            connection_string=tiny.url, schema=schema, pooler="transaction", listen=False
        )
        rl = create_runlane(lane=lane, tasks=[task])
        late = create_runlane(lane=lane, tasks=[task])
        try:
            started = time.monotonic()
            with pytest.raises(StorageUnavailable) as caught:
                rl.trigger(task, 1)
            waited = time.monotonic() - started
            message = str(caught.value)
            assert "\n" not in message
            assert "query_wait_timeout, so nothing was written" in message, message
            assert waited < 4, waited  # one wait of about a second, not one per retry
            rl.close()  # its pool would make a new client connection meanwhile
            with (
                psycopg.connect(tiny.url, autocommit=True),  # the second client of two
                pytest.raises(StorageUnavailable) as refused,
            ):
                late.trigger(task, 2)  # a third
            assert "takes no more client connections (max_client_conn)" in str(refused.value)
            assert "\n" not in str(refused.value)
        finally:
            holder.execute("rollback")
            rl.close()
            late.close()
    assert count_runs(db, schema) == 0


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"pooler": "transaction"}, "listen_connection_string="),
        ({"pooler": "pgbouncer"}, "pooler must be one of"),
        ({"listen": False, "listen_connection_string": "host=x"}, "pass one or the other"),
        ({"listen_connection_string": "port=x"}, "port"),
    ],
)
def test_listen_and_pooler_options_are_checked(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        postgres_polling_lane(connection_string="host=localhost", **options)
    assert needle in str(caught.value)
    assert "\n" not in str(caught.value)


def test_direct_connections_keep_their_startup_settings(
    database_url: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Straight to the server (found so by ``auto``): the dedicated connections keep their
    statement_timeout and the pool its prepared statements; nothing is said of a pooler."""
    lane = postgres_polling_lane(connection_string=database_url, schema=schema)
    storage = lane.create_storage()
    caplog.set_level(logging.INFO, "runlane.postgres")
    try:
        claims = storage.dedicated("claims-probe", durable_commits=False)
        try:
            timeout = claims._db.run(lambda conn: conn.execute("show statement_timeout").fetchone())
            assert timeout == ("1min",)
        finally:
            claims.close()
        assert not storage._db._shared.pooling.transaction
    finally:
        storage.close()
    assert "goes through a pooler" not in caplog.text
