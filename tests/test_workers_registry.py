"""Delivery workers in the ``workers`` table: registration, heartbeats carried by the lease
extensions, ``stopping``/``stopped`` on close, ``lost`` after three missed heartbeats (a
SIGKILLed process), the worker and host of each attempt, and cleanup of old rows; on both
lanes."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from runlane import (
    AttemptRecord,
    ConfigurationError,
    RetryPolicy,
    RunContext,
    Runlane,
    RunStatus,
    Task,
    WorkerInfo,
    WorkerState,
    create_runlane,
    task,
)
from runlane.cli import main
from runlane.maintenance import MaintenanceLimits, RetentionPolicy
from runlane.postgres import postgres_polling_lane
from runlane.testing import MovableClock
from runlane.worker import Worker
from tests._proxy import tcp_proxy
from tests.conftest import RabbitRuntimes, RunlaneFactory
from tests.helpers import Conn, elapse, logged, q, wait_for_status, wait_until

# interval between heartbeats: a third of the lease
LEASE = timedelta(seconds=1.5)
INTERVAL = LEASE.total_seconds() / 3

release = threading.Event()  # lets blocked handlers return


@pytest.fixture(autouse=True)
def _released() -> Iterator[None]:
    release.clear()
    yield
    release.set()


@task(id="workers.quick")
def quick(payload: Any, context: RunContext) -> int:
    return 1


@task(id="workers.blocked")
def blocked(payload: Any, context: RunContext) -> str:
    release.wait(30)
    return "released"


@task(id="workers.flaky", retry=RetryPolicy(max_attempts=2, initial_delay=timedelta(0), jitter=0))
def flaky(payload: Any, context: RunContext) -> str:
    if context.attempt == 1:
        raise RuntimeError("first attempt fails")
    return "second"


@task(id="workers.stuck")
def stuck(payload: Any, context: RunContext) -> None:
    raise AssertionError("runs only in the killed subprocess")


TASKS: list[Task[Any, Any]] = [quick, blocked, flaky, stuck]


def _runtime(make_runlane: RunlaneFactory, **kwargs: Any) -> Runlane:
    return make_runlane(tasks=TASKS, lane_options={"lease_duration": LEASE}, **kwargs)


def _row(rl: Runlane, worker_id: uuid.UUID | None) -> WorkerInfo | None:
    assert worker_id is not None
    found = [w for w in rl.list_workers(include_stopped=True) if w.worker_id == worker_id]
    return found[0] if found else None


def _registered(rl: Runlane, worker: Worker) -> WorkerInfo:
    wait_until(
        lambda: _row(rl, worker.worker_id) is not None,
        timeout=10,
        what="the worker's registration",
    )
    row = _row(rl, worker.worker_id)
    assert row is not None
    return row


def _state(rl: Runlane, worker_id: uuid.UUID | None) -> WorkerState | None:
    row = _row(rl, worker_id)
    return None if row is None else row.state


def _completed(rl: Runlane, run_id: uuid.UUID) -> None:
    """Wait for the run to complete, running maintenance meanwhile (a retrying run is made
    queued again by its due delivery)."""

    def done() -> bool:
        rl.run_maintenance_once()
        return rl.get_run(run_id).status is RunStatus.COMPLETED

    wait_until(done, timeout=20, what=f"run {run_id} to complete")


def _db_now(db: Conn) -> Any:
    row = db.execute("select now()").fetchone()
    assert row is not None
    return row[0]


# -- registration and listing -----------------------------------------------------------------


def test_a_delivery_worker_registers_itself_and_is_listed(make_runlane: RunlaneFactory) -> None:
    rl = _runtime(make_runlane)
    with rl.create_delivery_worker(concurrency=3) as worker:
        row = _registered(rl, worker)
        assert row.host == socket.gethostname()
        assert row.pid == os.getpid()
        assert row.runlane_version == importlib.metadata.version("runlane")
        assert row.queues == ("default",)
        assert row.concurrency == 3
        assert row.state is WorkerState.RUNNING
        assert row.stopped_at is None
        assert row.started_at <= row.last_seen_at
        assert [w.worker_id for w in rl.list_workers()] == [worker.worker_id]

        # an operator's runtime, built from the database URL alone, sees it too
        operator = make_runlane()
        assert [w.worker_id for w in operator.list_workers()] == [worker.worker_id]
        # another environment's workers are not listed
        assert make_runlane(environment="elsewhere").list_workers() == []
    # drain is not a delivery worker: it registers nothing
    rl.trigger(quick, None)
    assert rl.drain().runs_executed == 1
    assert [w.worker_id for w in rl.list_workers(include_stopped=True)] == [worker.worker_id]


def test_a_worker_registered_on_a_moved_clock_is_seen_at_that_time(
    make_runlane: RunlaneFactory, clock: MovableClock
) -> None:
    # registration stamps the moved clock, as heartbeats and list_workers read it: a worker
    # registered after the clock moved a day on is running, not lost, before its heartbeat
    clock.advance(86_400)
    rl = _runtime(make_runlane)
    with rl.create_delivery_worker(concurrency=1) as worker:
        row = _registered(rl, worker)
        assert row.state is WorkerState.RUNNING
        assert row.started_at <= row.last_seen_at
        assert row.started_at >= clock() - timedelta(seconds=60)


def test_list_workers_refuses_a_non_boolean_include_stopped(make_runlane: RunlaneFactory) -> None:
    rl = make_runlane()
    with pytest.raises(ConfigurationError, match="include_stopped must be True or False"):
        rl.list_workers(include_stopped="yes")  # type: ignore[arg-type]


def test_a_worker_that_cannot_register_at_start_says_so_and_registers_later(
    make_runlane: RunlaneFactory, database_url: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The database refuses new connections after the runtime started (its pool's open
    connection still answers, so the worker's start finds the database there): the worker
    starts anyway (as its claims do, its registration on a connection of its own is
    retried), the failure is logged, and a heartbeat registers it once the database takes
    connections again. (A database that does not answer at all when a worker starts is
    waited for: tests/test_wait_for_database.py.)"""
    direct = make_runlane()
    with tcp_proxy(database_url) as proxy:
        proxy.up()
        rl = create_runlane(
            lane=postgres_polling_lane(
                connection_string=proxy.url_for(database_url),
                schema=schema,
                connect_timeout=1,
                lease_duration=LEASE,
            ),
            tasks=TASKS,
        )
        try:
            rl.start()
            proxy.refuse_new()
            with (
                caplog.at_level(logging.WARNING, logger="runlane.lifecycle"),
                logged("registering the worker failed") as failed,
            ):
                worker = rl.create_delivery_worker(concurrency=1)
                assert failed.wait(15), "the failed registration was not logged"
            assert _row(direct, worker.worker_id) is None
            proxy.up()
            row = _registered(direct, worker)
            assert row.state is WorkerState.RUNNING
            worker.close(10)
            assert _state(direct, worker.worker_id) is WorkerState.STOPPED
        finally:
            rl.close(10)


# -- heartbeats -----------------------------------------------------------------------------


def test_heartbeats_ride_on_lease_extensions_while_a_run_holds_its_lease(
    make_runlane: RunlaneFactory, db: Conn
) -> None:
    rl = _runtime(make_runlane)
    handle = rl.trigger(blocked, None)
    with rl.create_delivery_worker(concurrency=1) as worker:
        wait_for_status(rl, handle.id, RunStatus.RUNNING)
        first = _registered(rl, worker).last_seen_at
        alone_before = worker.stats.beats_alone
        # four intervals with the lease held: each heartbeat goes with an extension
        wait_until(
            lambda: worker.stats.beats_with_extensions >= 4,
            timeout=10,
            what="four heartbeats carried by lease extensions",
            state=lambda: worker.stats,
        )
        row = _row(rl, worker.worker_id)
        assert row is not None
        assert row.last_seen_at > first
        # at most one heartbeat went alone: the one due before the first extension
        assert worker.stats.beats_alone - alone_before <= 1, worker.stats
        release.set()
        wait_for_status(rl, handle.id, RunStatus.COMPLETED)


def test_many_runs_cost_no_heartbeat_each(make_runlane: RunlaneFactory) -> None:
    """300 quick runs in a few intervals: the heartbeats sent stay about one an interval,
    and the worker's row keeps being seen."""
    rl = _runtime(make_runlane)
    with rl.create_delivery_worker(concurrency=2) as worker:
        first = _registered(rl, worker).last_seen_at
        started = time.monotonic()
        beats_before = worker.stats.beats_alone + worker.stats.beats_with_extensions
        handles = rl.trigger_many(quick, [None] * 300)

        def next_beat() -> None:
            sent = worker.stats.beats_alone + worker.stats.beats_with_extensions
            wait_until(
                lambda: worker.stats.beats_alone + worker.stats.beats_with_extensions > sent,
                timeout=10,
                what="the next heartbeat",
            )

        for _ in range(3):  # spread the runs over several heartbeat intervals
            handles += rl.trigger_many(quick, [None] * 100)
            next_beat()
        wait_until(
            lambda: worker.runs_executed >= len(handles),
            timeout=60,
            what="every run executed",
        )
        elapsed = time.monotonic() - started
        beats = worker.stats.beats_alone + worker.stats.beats_with_extensions - beats_before
        assert 1 <= beats <= elapsed / INTERVAL + 2, (beats, elapsed, worker.stats)
        row = _row(rl, worker.worker_id)
        assert row is not None
        assert row.last_seen_at > first
        assert row.state is WorkerState.RUNNING


# -- close -------------------------------------------------------------------------------------


def test_close_marks_the_worker_stopping_then_stopped(make_runlane: RunlaneFactory) -> None:
    rl = _runtime(make_runlane)
    handle = rl.trigger(blocked, None)
    worker = rl.create_delivery_worker(concurrency=1)
    _registered(rl, worker)
    wait_for_status(rl, handle.id, RunStatus.RUNNING)
    closer = threading.Thread(target=worker.close, kwargs={"timeout": 30})
    closer.start()
    try:
        # the handler still runs: close waits for it, the row says stopping meanwhile
        wait_until(
            lambda: _state(rl, worker.worker_id) is WorkerState.STOPPING,
            timeout=10,
            what="the worker's row to say stopping",
            state=lambda: _row(rl, worker.worker_id),
        )
        assert [w.worker_id for w in rl.list_workers()] == [worker.worker_id]
    finally:
        release.set()
        closer.join(30)
    assert not closer.is_alive()
    row = _row(rl, worker.worker_id)
    assert row is not None
    assert row.state is WorkerState.STOPPED
    assert row.stopped_at is not None
    assert row.stopped_at >= row.started_at
    assert rl.list_workers() == []  # stopped workers only with include_stopped
    assert rl.list_workers(include_stopped=True) == [row]


KILLED_WORKER = textwrap.dedent(
    """
    import os, threading
    from datetime import timedelta
    from runlane import create_runlane, task
    from runlane.postgres import postgres_polling_lane

    @task(id="workers.stuck")
    def stuck(payload, context):
        threading.Event().wait()

    runlane = create_runlane(
        lane=postgres_polling_lane(
            connection_string=os.environ["APP_DATABASE_URL"],
            schema=os.environ["APP_SCHEMA"],
            lease_duration=timedelta(seconds=1.5),
        ),
        tasks=[stuck],
    )
    worker = runlane.create_delivery_worker(concurrency=1)
    print(worker.worker_id, flush=True)
    threading.Event().wait()
    """
)


def test_a_sigkilled_worker_shows_lost_and_its_expired_attempt_names_it(
    make_runlane: RunlaneFactory, database_url: str, schema: str, db: Conn, tmp_path: Path
) -> None:
    rl = _runtime(make_runlane)
    handle = rl.trigger(stuck, None)
    script = tmp_path / "killed_worker.py"
    script.write_text(KILLED_WORKER)
    env = {**os.environ, "APP_DATABASE_URL": database_url, "APP_SCHEMA": schema}
    with subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            worker_id = uuid.UUID(proc.stdout.readline().strip())
            wait_for_status(rl, handle.id, RunStatus.RUNNING, timeout=20)
            # the worker's row is its lifecycle writer's first heartbeat, which can land after
            # a slot's claim on a busy machine (a full run saw the run running, no row yet)
            wait_until(lambda: _row(rl, worker_id) is not None, timeout=10, what="its registration")
            row = _row(rl, worker_id)
            assert row is not None
            assert row.pid == proc.pid
            # busy with one run for more than three intervals: its heartbeats (carried by the
            # lease extensions) keep it running
            busy_until = row.started_at + timedelta(seconds=4 * INTERVAL)
            wait_until(lambda: _db_now(db) > busy_until, timeout=10, what="four intervals")
            assert _state(rl, worker_id) is WorkerState.RUNNING
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    killed_at = _db_now(db)
    # unseen for three heartbeat intervals on the database's clock (moved, not waited for)
    elapse(db, schema, 4 * INTERVAL, "workers.last_seen_at")
    assert _state(rl, worker_id) is WorkerState.LOST, _row(rl, worker_id)
    lost = _row(rl, worker_id)
    assert lost is not None
    # lost exactly once unseen for three intervals (database time)
    assert _db_now(db) - lost.last_seen_at >= timedelta(seconds=3 * INTERVAL)
    assert lost.last_seen_at <= killed_at
    assert lost.stopped_at is None
    assert [w.worker_id for w in rl.list_workers()] == [worker_id]  # lost ones are listed

    # its lease lapses (the database's clock, moved); maintenance expires the attempt, which
    # records the worker
    elapse(db, schema, 2 * LEASE.total_seconds(), "runs.lease_expires_at")
    assert rl.run_maintenance_once().attempts_expired == 1
    (attempt,) = rl.get_run_history(handle.id).attempts
    assert (attempt.outcome, attempt.worker_id, attempt.host) == (
        "expired",
        worker_id,
        socket.gethostname(),
    )


# -- attempts ----------------------------------------------------------------------------------


def test_attempts_record_their_worker_and_host(make_runlane: RunlaneFactory) -> None:
    rl = _runtime(make_runlane)
    handle = rl.trigger(flaky, None)
    with rl.create_delivery_worker(concurrency=1) as worker:
        _completed(rl, handle.id)
    history = rl.get_run_history(handle.id)
    host = socket.gethostname()
    assert [(a.number, a.outcome, a.worker_id, a.host) for a in history.attempts] == [
        (1, "retrying", worker.worker_id, host),
        (2, "completed", worker.worker_id, host),
    ]
    # drain is no delivery worker: its attempts record none
    drained = rl.trigger(quick, None)
    rl.drain()
    (attempt,) = rl.get_run_history(drained.id).attempts
    assert (attempt.outcome, attempt.worker_id, attempt.host) == ("completed", None, None)


def test_runs_show_prints_the_worker_and_host_of_each_attempt(
    make_runlane: RunlaneFactory,
    database_url: str,
    schema: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rl = _runtime(make_runlane)
    handle = rl.trigger(flaky, None)
    with rl.create_delivery_worker(concurrency=1) as worker:
        _completed(rl, handle.id)
    drained = rl.trigger(quick, None)
    rl.drain()
    (tmp_path / "workersapp.py").write_text(
        textwrap.dedent(
            """
            import os
            from runlane import create_runlane
            from runlane.postgres import postgres_polling_lane

            runlane = create_runlane(
                lane=postgres_polling_lane(
                    connection_string=os.environ["APP_DATABASE_URL"],
                    schema=os.environ["APP_SCHEMA"],
                )
            )
            """
        )
    )
    os.environ["APP_DATABASE_URL"], os.environ["APP_SCHEMA"] = database_url, schema
    sys.path.insert(0, str(tmp_path))

    def show(*argv: str) -> str:
        sys.modules.pop("workersapp", None)  # each command closes the runtime it loaded
        capsys.readouterr()
        assert main(["runs", "show", "workersapp:runlane", *argv]) == 0
        return capsys.readouterr().out

    try:
        out = show(str(handle.id))
        ran_by = f" on {socket.gethostname()} (worker {worker.worker_id})"
        lines = [line for line in out.splitlines() if line.startswith("  #")]
        assert len(lines) == 2, out
        assert all(ran_by in line for line in lines), out
        attempts = json.loads(show(str(handle.id), "--json"))["attempts"]
        assert [(a["worker_id"], a["host"]) for a in attempts] == [
            (str(worker.worker_id), socket.gethostname())
        ] * 2
        assert json.loads(show(str(drained.id), "--json"))["attempts"][0]["worker_id"] is None
        assert "(worker " not in show(str(drained.id))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("workersapp", None)
        del os.environ["APP_DATABASE_URL"], os.environ["APP_SCHEMA"]


# -- cleanup -----------------------------------------------------------------------------------


def _insert_worker(
    db: Conn,
    schema: str,
    *,
    state: str,
    seen_ago: timedelta,
    heartbeat_seconds: float = 10.0,
    environment: str = "default",
) -> uuid.UUID:
    worker_id = uuid.uuid4()
    db.execute(
        q(
            """
            insert into {s}.workers (id, environment, host, pid, runlane_version, queues,
                                     concurrency, heartbeat_seconds, state, started_at,
                                     last_seen_at, stopped_at)
            values (%(id)s, %(environment)s, 'elsewhere', 1, '0.0', array['default'], 1,
                    %(heartbeat)s, %(state)s, now() - %(ago)s - interval '1 hour',
                    now() - %(ago)s,
                    case when %(state)s = 'stopped' then now() - %(ago)s end)
            """,
            schema,
        ),
        {
            "id": worker_id,
            "environment": environment,
            "heartbeat": heartbeat_seconds,
            "state": state,
            "ago": seen_ago,
        },
    )
    return worker_id


def _worker_ids(db: Conn, schema: str) -> set[uuid.UUID]:
    return {row[0] for row in db.execute(q("select id from {s}.workers", schema))}


def test_cleanup_prunes_old_stopped_and_lost_workers_and_keeps_the_others(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    day = timedelta(days=1)
    rl = _runtime(make_runlane, retention=RetentionPolicy(workers=day))
    handle = rl.trigger(quick, None)
    with rl.create_delivery_worker(concurrency=1) as worker:
        wait_for_status(rl, handle.id, RunStatus.COMPLETED)
        _registered(rl, worker)
        _insert_worker(db, schema, state="stopped", seen_ago=2 * day)  # pruned
        old_lost = _insert_worker(db, schema, state="running", seen_ago=2 * day)
        old_lost_stopping = _insert_worker(db, schema, state="stopping", seen_ago=3 * day)
        recent_stopped = _insert_worker(db, schema, state="stopped", seen_ago=day / 2)
        recent_lost = _insert_worker(db, schema, state="running", seen_ago=day / 2)
        # unseen for two days but with a heartbeat of a week: not lost, kept
        slow = _insert_worker(
            db, schema, state="running", seen_ago=2 * day, heartbeat_seconds=7 * 86400
        )
        other_env = _insert_worker(
            db, schema, state="stopped", seen_ago=2 * day, environment="elsewhere"
        )
        listed = {w.worker_id: w.state for w in rl.list_workers(include_stopped=True)}
        assert listed[old_lost] is WorkerState.LOST
        assert listed[old_lost_stopping] is WorkerState.LOST
        assert listed[slow] is WorkerState.RUNNING

        # bounded: one row a pass with cleanup_limit=1, oldest first
        first = rl.run_maintenance_once(MaintenanceLimits(cleanup_limit=1))
        assert first.workers_pruned == 1
        assert old_lost_stopping not in _worker_ids(db, schema)
        assert rl.run_maintenance_once().workers_pruned == 2
        assert rl.run_maintenance_once().workers_pruned == 0
        assert _worker_ids(db, schema) == {
            worker.worker_id,
            recent_stopped,
            recent_lost,
            slow,
            other_env,
        }
        assert rl.run_maintenance_once(MaintenanceLimits(cleanup_limit=0)).workers_pruned == 0

    # once the worker's own row is gone, its attempts keep its id and lose the host
    db.execute(q("delete from {s}.workers where id = %s", schema), [worker.worker_id])
    (attempt,) = rl.get_run_history(handle.id).attempts
    assert attempt == AttemptRecord(
        number=1,
        outcome="completed",
        error=None,
        started_at=attempt.started_at,
        finished_at=attempt.finished_at,
        worker_id=worker.worker_id,
        host=None,
    )


def test_retention_of_workers_is_checked() -> None:
    with pytest.raises(ConfigurationError, match=r"RetentionPolicy\.workers"):
        RetentionPolicy(workers=timedelta(days=-1))
    assert RetentionPolicy().workers == timedelta(days=7)


# -- the RabbitMQ lane -------------------------------------------------------------------------


def test_rabbitmq_lane_workers_register_record_attempts_and_stop(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str
) -> None:
    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=TASKS, lease_duration=LEASE)
    worker = rl.create_delivery_worker(concurrency=2)
    try:
        row = _registered(rl, worker)
        assert (row.state, row.concurrency, row.queues) == (WorkerState.RUNNING, 2, ("default",))
        handle = rl.trigger(flaky, None)
        _completed(rl, handle.id)
    finally:
        worker.close(10)
    history = rl.get_run_history(handle.id)
    host = socket.gethostname()
    assert [(a.outcome, a.worker_id, a.host) for a in history.attempts] == [
        ("retrying", worker.worker_id, host),
        ("completed", worker.worker_id, host),
    ]
    assert _state(rl, worker.worker_id) is WorkerState.STOPPED
    assert rl.list_workers() == []


def test_an_operator_runtime_from_a_database_url_lists_workers(
    make_runlane: RunlaneFactory, database_url: str, schema: str
) -> None:
    rl = _runtime(make_runlane)
    with rl.create_delivery_worker(concurrency=1) as worker:
        _registered(rl, worker)
        operator = create_runlane(
            lane=postgres_polling_lane(connection_string=database_url, schema=schema)
        )
        try:
            (row,) = operator.list_workers()
            assert row.worker_id == worker.worker_id
        finally:
            operator.close()
