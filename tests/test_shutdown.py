"""Shutdown, ownership and stop reasons: each test first reproduces a failure the lanes issue
described (a claim in flight at close, a blocked completion write, a closed runtime that kept
its workers, a handler that could not tell shutdown from cancel), then shows it fixed.

Blocking is made real: an advisory lock held from another connection stops a bounded
queue's claim in flight; a row lock stops a completion write.
"""

from __future__ import annotations

import inspect
import math
import signal
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from runlane import (
    ConfigurationError,
    NonRetryableError,
    RetryPolicy,
    RunContext,
    Runlane,
    RunlaneClosed,
    RunStatus,
    StopReason,
    WaitTokenStatus,
    WorkerFailed,
    queue,
    schedule,
    task,
)
from runlane.errors import RunInterrupted
from tests.conftest import RabbitRuntimes, RunlaneFactory
from tests.helpers import (
    attempt_rows,
    cli_process,
    count_runs,
    q,
    run_row,
    wait_for_status,
    wait_until,
)


@attrs.frozen
class Item:
    n: int


ONE_ATTEMPT = RetryPolicy(max_attempts=1)


@task(id="noop", schema=Item)
def noop(payload: Item, context: RunContext) -> None:
    pass


def _runlane_threads(*, with_pool: bool = False) -> list[str]:
    """Threads of workers, drains and services (and, ``with_pool``, the runtime's pool)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.is_alive()
        and t.name.startswith("runlane-")
        and (with_pool or not t.name.startswith("runlane-t_"))
    )


def _no_runlane_threads() -> bool:
    return not _runlane_threads()


def _hold_claim_lock(database_url: str, schema: str, queue_name: str) -> psycopg.Connection[Any]:
    """Take the bounded queue's claim lock in an open transaction: claims of the queue wait."""
    conn = psycopg.connect(database_url)
    conn.execute(
        "select pg_advisory_xact_lock(hashtext(%s), hashtext(%s))",
        (f"runlane:{schema}:default", queue_name),
    )
    return conn


def _claim_waiting(db: psycopg.Connection[Any]) -> bool:
    row = db.execute(
        "select count(*) from pg_stat_activity where application_name like %s "
        "and wait_event_type = 'Lock'",
        ("runlane-worker-%-claims",),
    ).fetchone()
    return row is not None and int(row[0]) > 0


# -- stop reasons ------------------------------------------------------------------------------


def test_shutdown_hands_back_a_handler_that_raises_if_stopped(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    """Before: a handler that watched ``cancelled`` and returned had its unfinished run
    recorded completed on shutdown. Now it can tell why and hand the run back."""
    started = threading.Event()
    seen: list[StopReason | None] = []

    @task(id="careful", schema=Item, retry=ONE_ATTEMPT)
    def careful(payload: Item, context: RunContext) -> int:
        if context.attempt > 1:
            return payload.n
        started.set()
        context.cancelled.wait(10)
        seen.append(context.stop_reason)
        context.raise_if_stopped()
        return payload.n

    rl = make_runlane(tasks=[careful])
    run = rl.trigger(careful, Item(1))
    worker = rl.create_delivery_worker(concurrency=1)
    assert started.wait(10)
    worker.close(timeout=5)
    assert worker.wait_until_closed(0) is True
    assert seen == [StopReason.SHUTDOWN]
    row = run_row(db, schema, run.id)
    assert row["status"] == "queued"
    assert attempt_rows(db, schema, run.id) == [(1, "released")]
    # the attempt was not spent: with max_attempts=1 another worker still completes it
    with rl.create_delivery_worker(concurrency=1):
        snap = wait_for_status(rl, run.id, RunStatus.COMPLETED)
    assert snap.output == 1


def test_cancel_is_told_apart_and_ends_cancelled(make_runlane: RunlaneFactory) -> None:
    started = threading.Event()
    seen: list[StopReason | None] = []

    @task(id="cancellable", schema=Item)
    def cancellable(payload: Item, context: RunContext) -> None:
        started.set()
        context.cancelled.wait(10)
        seen.append(context.stop_reason)
        context.raise_if_stopped()

    rl = make_runlane(tasks=[cancellable])
    run = rl.trigger(cancellable, Item(1))
    with rl.create_delivery_worker(concurrency=1):
        assert started.wait(10)
        rl.cancel(run.id)
        wait_for_status(rl, run.id, RunStatus.CANCELLED)
    assert seen == [StopReason.CANCEL_REQUESTED]


def test_a_handler_returning_normally_after_shutdown_completed_its_run(
    make_runlane: RunlaneFactory,
) -> None:
    started = threading.Event()

    @task(id="returns", schema=Item, retry=ONE_ATTEMPT)
    def returns(payload: Item, context: RunContext) -> str:
        started.set()
        context.cancelled.wait(10)
        return f"stopped:{context.stop_reason}"

    rl = make_runlane(tasks=[returns])
    run = rl.trigger(returns, Item(1))
    worker = rl.create_delivery_worker(concurrency=1)
    assert started.wait(10)
    worker.close(timeout=5)
    snap = rl.get_run(run.id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.output == f"stopped:{StopReason.SHUTDOWN}"


def test_stop_reason_is_none_until_asked_and_raise_if_stopped_needs_a_handler(
    make_runlane: RunlaneFactory,
) -> None:
    reasons: list[StopReason | None] = []

    @task(id="calm", schema=Item)
    def calm(payload: Item, context: RunContext) -> None:
        reasons.append(context.stop_reason)
        context.raise_if_stopped()  # not stopped: returns

    rl = make_runlane(tasks=[calm])
    run = rl.trigger(calm, Item(1))
    assert rl.drain().runs_executed == 1
    assert reasons == [None]
    assert rl.get_run(run.id).status is RunStatus.COMPLETED
    loose = RunContext(
        run_id=uuid.uuid4(), task_id="x", queue="q", attempt=1, max_attempts=1, environment="e"
    )
    with pytest.raises(ConfigurationError, match="inside a handler"):
        loose.raise_if_stopped()
    assert issubclass(RunInterrupted, Exception)


# -- bounded, lossless close --------------------------------------------------------------------


def test_close_with_a_claim_in_flight_strands_nothing(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], database_url: str, schema: str
) -> None:
    """Before: close(timeout=0.5) during a claim dropped the claimed run's hand-back; its
    lease lapsed and with max_attempts=1 it failed (LeaseExpired) without ever running.
    Here the claim is held in flight by the queue's claim lock, and released while close
    waits, so the claim commits after close began: its run must be handed back."""
    ran = threading.Event()

    @task(id="scarce", schema=Item, queue="scarce", retry=ONE_ATTEMPT)
    def scarce(payload: Item, context: RunContext) -> None:
        ran.set()

    rl = make_runlane(tasks=[scarce], queues=[queue("scarce", concurrency_limit=1)])
    run = rl.trigger(scarce, Item(1))
    blocker = _hold_claim_lock(database_url, schema, "scarce")
    try:
        worker = rl.create_delivery_worker(concurrency=1)
        wait_until(lambda: _claim_waiting(db), timeout=10, what="the claim to wait on the lock")
        closer = threading.Thread(target=worker.close, kwargs={"timeout": 3.0})
        closer.start()
        assert worker._stopping.wait(10)  # close began: it joins the slot whose claim waits
        blocker.rollback()  # the claim proceeds and commits after close began
        closer.join(10)
        assert not closer.is_alive()
    finally:
        blocker.close()
    assert worker.wait_until_closed(0) is True  # a clean close never raises
    assert not ran.is_set()
    row = run_row(db, schema, run.id)
    assert row["status"] == "queued", row
    with rl.create_delivery_worker(concurrency=1):
        wait_for_status(rl, run.id, RunStatus.COMPLETED)


def test_close_returns_in_time_when_the_claim_stays_blocked(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], database_url: str, schema: str
) -> None:
    @task(id="scarce", schema=Item, queue="scarce", retry=ONE_ATTEMPT)
    def scarce(payload: Item, context: RunContext) -> None:
        pass

    rl = make_runlane(tasks=[scarce], queues=[queue("scarce", concurrency_limit=1)])
    run = rl.trigger(scarce, Item(1))
    blocker = _hold_claim_lock(database_url, schema, "scarce")
    try:
        worker = rl.create_delivery_worker(concurrency=1)
        wait_until(lambda: _claim_waiting(db), timeout=10, what="the claim to wait on the lock")
        began = time.monotonic()
        worker.close(timeout=0.5)
        took = time.monotonic() - began
    finally:
        blocker.close()
    assert took < 2.5, f"close(timeout=0.5) took {took:.2f}s"
    assert worker.wait_until_closed(0) is True
    assert run_row(db, schema, run.id)["status"] == "queued"
    wait_until(
        _no_runlane_threads, timeout=5, what="runlane threads to end", state=_runlane_threads
    )


def test_close_returns_in_time_when_a_completion_write_is_blocked(
    make_runlane: RunlaneFactory, database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    """Before: a completion blocked by a row lock made close(timeout=0.5) take 5.8 s."""
    started = threading.Event()
    proceed = threading.Event()

    @task(id="quick", schema=Item)
    def quick(payload: Item, context: RunContext) -> int:
        started.set()
        proceed.wait(10)
        return payload.n

    rl = make_runlane(tasks=[quick])
    run = rl.trigger(quick, Item(7))
    worker = rl.create_delivery_worker(concurrency=1)
    assert started.wait(10)
    locker = psycopg.connect(database_url)
    try:
        locker.execute(q("select 1 from {s}.runs where id = %s for update", schema), (run.id,))
        proceed.set()  # the completion now waits on the row lock
        wait_until(  # the signal: one of the worker's backends waits on a lock
            lambda: (
                db.execute(
                    "select count(*) from pg_stat_activity "
                    "where application_name like %s and wait_event_type = 'Lock'",
                    (f"{worker.name}-%",),
                ).fetchone()
                == (1,)
            ),
            timeout=10,
            what="the completion to wait on the row lock",
        )
        began = time.monotonic()
        worker.close(timeout=0.5)
        took = time.monotonic() - began
    finally:
        locker.close()
    assert took < 2.5, f"close(timeout=0.5) took {took:.2f}s"
    assert worker.wait_until_closed(0) is True


def test_close_timeout_must_not_be_negative(make_runlane: RunlaneFactory) -> None:
    rl = make_runlane()
    worker = rl.create_delivery_worker(concurrency=1)
    with pytest.raises(ConfigurationError, match="negative"):
        worker.close(timeout=-1)
    with pytest.raises(ConfigurationError, match="negative"):
        rl.close(timeout=-1)
    worker.close()
    worker.close()  # a no-op


# -- ownership ----------------------------------------------------------------------------------


def test_runtime_close_closes_its_workers_and_services(make_runlane: RunlaneFactory) -> None:
    """Before: Runlane.close() left its workers and services running."""

    rl = make_runlane(tasks=[noop])
    worker = rl.create_delivery_worker(concurrency=2)
    services = rl.start_services()
    rl.close(timeout=10)
    assert worker.wait_until_closed(5) is True
    assert services.wait_until_closed(5) is True
    wait_until(
        lambda: not _runlane_threads(with_pool=True),
        timeout=5,
        what="runlane threads to end",
        state=lambda: _runlane_threads(with_pool=True),
    )


# Public callables of Runlane that work on a closed runtime, and why. Every other public
# method must refuse (SPEC section 1: "On a closed runtime every method raises RunlaneClosed,
# except start() ... and close()"). Properties (lane, queues, tasks) and plain attributes
# (environment, ...) are not callables: they read the runtime's definition, not the database.
ALLOWED_AFTER_CLOSE = {
    "start": "opens a closed runtime again (SPEC: the bounded-pass entry point)",
    "close": "idempotent (SPEC)",
    # not a SPEC method: how an integration (the Flask extension's init_app) adds its
    # middleware to workers made from now on; it changes the runtime's definition, opens
    # no connection and writes nothing, and holds for a runtime closed and started again
    "wrap_attempts": "configuration of the runtime object, no database",
}


def _public_methods() -> set[str]:
    """Runlane's public callables, read from the class: a method added later is in it."""
    return {name for name, member in inspect.getmembers(Runlane, callable) if name[0] != "_"}


def _schema_contents(db: psycopg.Connection[Any], schema: str) -> dict[str, str]:
    """Every table of ``schema`` with a digest of its rows: equal digests, nothing written."""
    tables = [
        str(name)
        for (name,) in db.execute(
            "select table_name from information_schema.tables where table_schema = %s"
            " and table_type = 'BASE TABLE' order by table_name",
            (schema,),
        ).fetchall()
    ]
    query = sql.SQL(" union all ").join(
        sql.SQL(
            "select {name}, md5(coalesce(string_agg(t::text, ',' order by t::text), ''))"
            " from {s}.{t} t"
        ).format(name=sql.Literal(table), s=sql.Identifier(schema), t=sql.Identifier(table))
        for table in tables
    )
    return {str(table): str(digest) for table, digest in db.execute(query).fetchall()}


@task(id="refused", schema=Item, retry=ONE_ATTEMPT)
def refused(payload: Item, context: RunContext) -> None:
    raise NonRetryableError("fails for good")


def test_a_closed_runtime_refuses_every_method(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    """Each public method but those in ALLOWED_AFTER_CLOSE raises RunlaneClosed saying to
    call start(), starts no thread and writes nothing, though each call would read or write
    something on an open runtime: a queued, a failed and a completed run, a pending wait
    token, a defined schedule, the default queue."""
    every_minute = schedule(id="closed.every_minute", task=noop, cron="* * * * *", payload=Item(0))
    rl = make_runlane(tasks=[noop, refused], schedules=[every_minute])
    failed = rl.trigger(refused, Item(0))
    done = rl.trigger(noop, Item(0))
    assert rl.drain().runs_executed == 2
    run = rl.trigger(noop, Item(1))
    token = rl.create_wait_token()
    rl.close()
    rl.close()  # a no-op
    wait_until(
        lambda: not _runlane_threads(with_pool=True),
        timeout=5,
        what="the closed runtime's threads to end",
        state=lambda: _runlane_threads(with_pool=True),
    )
    sched = every_minute.id
    calls: dict[str, Callable[[], object]] = {
        "trigger": lambda: rl.trigger(noop, Item(2)),
        "trigger_many": lambda: rl.trigger_many(noop, [Item(2)]),
        "get_run": lambda: rl.get_run(run.id),
        "wait_for_run": lambda: rl.wait_for_run(done.id, timeout=0.1),
        "cancel": lambda: rl.cancel(run.id),
        "list_runs": rl.list_runs,
        "get_run_history": lambda: rl.get_run_history(failed.id),
        "retry_run": lambda: rl.retry_run(failed.id),
        "reschedule_run": lambda: rl.reschedule_run(run.id, run_at=None),
        "delete_run": lambda: rl.delete_run(done.id),
        "list_audit": rl.list_audit,
        "stats": rl.stats,
        "retry_runs": lambda: rl.retry_runs(status="failed"),
        "cancel_runs": lambda: rl.cancel_runs(status="queued"),
        "delete_runs": lambda: rl.delete_runs(status="completed"),
        "pause_queue": lambda: rl.pause_queue("default", reason="closed"),
        "resume_queue": lambda: rl.resume_queue("default"),
        "list_queues": rl.list_queues,
        "list_workers": lambda: rl.list_workers(include_stopped=True),
        "list_schedules": rl.list_schedules,
        "pause_schedule": lambda: rl.pause_schedule(sched),
        "resume_schedule": lambda: rl.resume_schedule(sched),
        "trigger_schedule_now": lambda: rl.trigger_schedule_now(sched),
        "create_wait_token": rl.create_wait_token,
        "get_wait_token": lambda: rl.get_wait_token(token.id),
        "complete_wait_token": lambda: rl.complete_wait_token(token.id, "late"),
        "create_delivery_worker": lambda: rl.create_delivery_worker(concurrency=1),
        "drain": rl.drain,
        "run_maintenance_once": rl.run_maintenance_once,
        "start_services": rl.start_services,
        "status": rl.status,
        "opened_storage": rl.opened_storage,
    }
    unlisted = _public_methods() - set(calls) - set(ALLOWED_AFTER_CLOSE)
    assert not unlisted, (
        f"public Runlane methods this test does not call on a closed runtime: {sorted(unlisted)};"
        " add a call for each (or, if it must work after close(), an entry with the reason to"
        " ALLOWED_AFTER_CLOSE)"
    )
    assert set(calls) | set(ALLOWED_AFTER_CLOSE) <= _public_methods()  # no stale names

    before = _schema_contents(db, schema)
    wrong: dict[str, str] = {}
    for name, call in calls.items():
        try:
            result = call()
        except RunlaneClosed as exc:
            if "closed" not in str(exc) or "call start()" not in str(exc):
                wrong[name] = f"RunlaneClosed not saying it is closed and to call start(): {exc}"
        except Exception as exc:
            wrong[name] = f"raised {type(exc).__name__}: {exc}"
        else:
            wrong[name] = f"returned {type(result).__name__}"
            rl.close()  # it opened the runtime again: closed for the next call
        threads = _runlane_threads(with_pool=True)
        if threads:
            wrong[name] = f"{wrong.get(name, 'refused')}, and started threads {threads}"
            rl.close()
        after = _schema_contents(db, schema)
        if after != before:
            changed = sorted(t for t in after if after[t] != before.get(t))
            wrong[name] = f"{wrong.get(name, 'refused')}, and wrote to {changed}"
            before = after
    assert wrong == {}, "on a closed runtime: " + "; ".join(f"{k}: {v}" for k, v in wrong.items())

    rl.start()  # opens it again
    assert rl.get_run(run.id).status is RunStatus.QUEUED
    assert rl.get_run(failed.id).status is RunStatus.FAILED
    assert rl.get_wait_token(token.id).status is WaitTokenStatus.PENDING
    assert count_runs(db, schema) == 3  # nothing was written while closed


def test_bounded_pass_entry_point_works_every_time(make_runlane: RunlaneFactory) -> None:
    """Before: start()/run_maintenance_once()/close() on a shared runtime failed on its
    second invocation."""
    rl = make_runlane()
    for _ in range(3):
        rl.start()
        rl.run_maintenance_once()
        rl.close()


# -- drain runs through the worker's path --------------------------------------------------------


def test_drain_honours_bounded_queues_beside_a_worker(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    """Before: a drain beside workers put 2 live leases on a queue limited to 1."""
    inside = threading.Event()
    release = threading.Event()

    @task(id="limited", schema=Item, queue="limited")
    def limited(payload: Item, context: RunContext) -> None:
        inside.set()
        release.wait(10)

    rl = make_runlane(tasks=[limited], queues=[queue("limited", concurrency_limit=1)])
    first = rl.trigger(limited, Item(1))
    second = rl.trigger(limited, Item(2))
    with rl.create_delivery_worker(concurrency=2):
        assert inside.wait(10)
        assert rl.drain().runs_executed == 0  # the queue's one slot is taken
        live = db.execute(
            q("select count(*) from {s}.runs where status = 'running'", schema)
        ).fetchone()
        assert live is not None
        assert live[0] == 1
        release.set()
        wait_for_status(rl, first.id, RunStatus.COMPLETED)
        wait_for_status(rl, second.id, RunStatus.COMPLETED)


def test_drain_records_results_through_the_writer(make_runlane: RunlaneFactory) -> None:
    @task(id="double", schema=Item, retry=RetryPolicy(max_attempts=2, initial_delay=timedelta(0)))
    def double(payload: Item, context: RunContext) -> int:
        if payload.n < 0:
            raise ValueError("negative")
        return payload.n * 2

    rl = make_runlane(tasks=[double])
    good = rl.trigger(double, Item(3))
    bad = rl.trigger(double, Item(-1))
    assert rl.drain().runs_executed == 2
    assert rl.get_run(good.id).output == 6
    assert rl.get_run(bad.id).status is RunStatus.RETRYING
    assert _no_runlane_threads()


# -- close timeouts and closing in parts (issue 26) ---------------------------------------------


def _nothing_left(*, with_pool: bool = True) -> None:
    wait_until(
        lambda: not _runlane_threads(with_pool=with_pool),
        timeout=10,
        what="runlane threads to end",
        state=lambda: _runlane_threads(with_pool=with_pool),
    )


@pytest.mark.parametrize("timeout", [math.inf, 1e12, sys.float_info.max])
def test_close_with_an_infinite_or_huge_timeout_waits_and_closes_everything(
    make_runlane: RunlaneFactory, timeout: float
) -> None:
    """Before: a raw OverflowError from the first join past threading.TIMEOUT_MAX, part-way
    through close, left the writer, the listener and the pool's threads running."""

    rl = make_runlane(tasks=[noop])
    worker = rl.create_delivery_worker(concurrency=2)
    services = rl.start_services()
    assert services.wait_until_closed(0) is False
    worker.close(timeout=timeout)
    assert worker.wait_until_closed(timeout) is True
    services.close(timeout=timeout)
    assert services.wait_until_closed(timeout) is True
    assert services.wait_for(lambda: True, timeout=timeout) is True
    other = rl.create_delivery_worker(concurrency=1)
    rl.close(timeout=timeout)
    assert other.wait_until_closed(0) is True
    _nothing_left()


@pytest.mark.parametrize("timeout", [-1, -0.001, math.nan, -math.inf, "30", True])
def test_a_bad_close_timeout_is_refused_before_anything_closes(
    make_runlane: RunlaneFactory, timeout: Any
) -> None:
    """One rule and one message for every close and wait timeout (the worker's and the
    services' said it two ways)."""
    rl = make_runlane()
    worker = rl.create_delivery_worker(concurrency=1)
    services = rl.start_services()
    needle = r"timeout must be None \(wait as long as it takes\) or a number of seconds >= 0"
    for close in (
        rl.close,
        worker.close,
        worker.wait_until_closed,
        services.close,
        services.wait_until_closed,
    ):
        with pytest.raises(ConfigurationError, match=needle):
            close(timeout=timeout)
    assert not worker.closed
    assert not services.closed
    rl.close(timeout=10)
    _nothing_left()


def test_close_finishes_every_part_when_one_raises(
    make_runlane: RunlaneFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part of a worker's close that raises (here its lifecycle writer, after closing)
    must not leave the parts after it running: before, the listener and the writer's
    connection of that worker, the other worker, the services and the runtime's pool all
    stayed open. The first error is raised once every part ran."""
    rl = make_runlane()
    failing = rl.create_delivery_worker(concurrency=2)
    other = rl.create_delivery_worker(concurrency=1)
    services = rl.start_services()
    writer = failing._writer
    real_close = writer.close

    def close_then_fail(timeout: float | None) -> None:
        real_close(timeout)
        raise RuntimeError("the writer failed to close")

    monkeypatch.setattr(writer, "close", close_then_fail)
    with pytest.raises(RuntimeError, match="the writer failed to close"):
        rl.close(timeout=10)
    assert failing.closed
    assert other.closed
    assert services.closed
    _nothing_left()


def test_a_worker_that_cannot_start_its_threads_stops_those_it_started(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``create_delivery_worker(concurrency=10**6)`` raised a raw "can't start new
    thread" and the slots already started kept running (claiming runs for a worker nobody
    held). Concurrency is now bounded (1024), and when the process runs out of threads
    anyway (simulated here at the third slot, as the OS refuses it) the started threads are
    stopped and a WorkerFailed says what to do."""

    rl = make_runlane(tasks=[noop])
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name.endswith("-slot-3"):
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(WorkerFailed, match="out of threads; lower concurrency"):
        rl.create_delivery_worker(concurrency=4)
    monkeypatch.undo()
    _nothing_left(with_pool=False)
    wait_until(
        lambda: _worker_connections(db) == 0,
        timeout=10,
        what="the worker's connections to close",
        state=lambda: _worker_connections(db),
    )
    # the runtime is fine: a worker that can start its threads runs runs
    worker = rl.create_delivery_worker(concurrency=2)
    run = rl.trigger(noop, Item(1))
    wait_for_status(rl, run.id, RunStatus.COMPLETED)
    worker.close(timeout=10)


def _worker_connections(db: psycopg.Connection[Any]) -> int:
    row = db.execute(
        "select count(*) from pg_stat_activity where application_name like 'runlane-worker-%'"
    ).fetchone()
    return -1 if row is None else int(row[0])


def test_rabbitmq_consumer_close_finishes_every_part_when_one_raises(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RabbitMQ consumer's close: its Postgres listener failing to close must not leave
    the consumer thread and the claims' connection open."""
    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[])
    worker = rl.create_delivery_worker(concurrency=1)
    acquirer: Any = worker.acquirer
    listener = acquirer._listener
    real_close = listener.close

    def close_then_fail(timeout: float | None = None) -> None:
        real_close(timeout)
        raise RuntimeError("the listener failed to close")

    monkeypatch.setattr(listener, "close", close_then_fail)
    with pytest.raises(RuntimeError, match="the listener failed to close"):
        worker.close(timeout=10)
    assert worker.closed

    def mine() -> list[str]:
        return [n for n in _runlane_threads() if n.startswith(f"{worker.name}-")]

    wait_until(lambda: not mine(), timeout=10, what="the worker's threads to end", state=mine)
    rl.close(timeout=10)  # the runtime's publisher
    _nothing_left()


# -- the CLI's --shutdown-timeout ---------------------------------------------------------------

CLI_APP = textwrap.dedent(
    """
    import os
    from runlane import create_runlane
    from runlane.postgres import postgres_polling_lane

    runlane = create_runlane(
        lane=postgres_polling_lane(
            connection_string=os.environ["APP_DATABASE_URL"], schema=os.environ["APP_SCHEMA"]
        )
    )
    """
)


@pytest.mark.parametrize("command", ["worker", "maintenance"])
@pytest.mark.parametrize(
    "case",
    [
        ("-1", "must be inf (wait as long as it takes) or a number of seconds >= 0"),
        ("nan", "must be inf (wait as long as it takes) or a number of seconds >= 0"),
        ("soon", "expected a number of seconds, got 'soon'"),
    ],
)
def test_a_bad_shutdown_timeout_is_refused_before_the_command_starts(
    tmp_path: Path, database_url: str, schema: str, command: str, case: tuple[str, str]
) -> None:
    """Before: -1 and nan were accepted, and the stop signal then hung the process until
    SIGKILL (close() refused them only then). The flag follows close()'s one rule, in its
    words (inf, not None, for as long as it takes)."""
    value, message = case
    args = (command, "cliapp:runlane", f"--shutdown-timeout={value}")
    with cli_process(tmp_path, CLI_APP, database_url, schema, *args) as proc:
        assert proc.wait(timeout=60) == 2
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert "argument --shutdown-timeout:" in err, err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["0", "inf", "1e12"])
def test_a_zero_or_unbounded_shutdown_timeout_is_accepted(
    tmp_path: Path, database_url: str, schema: str, value: str
) -> None:
    """0 hands running work back at once; inf (or more than 100 years) waits as long as
    handlers take, as close(timeout=None) does: before, inf exited 1 with a traceback."""
    args = ("worker", "cliapp:runlane", f"--shutdown-timeout={value}")
    with cli_process(tmp_path, CLI_APP, database_url, schema, *args) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "SIGTERM or Ctrl-C stops it" in line:
                break
        else:
            pytest.fail("the worker did not start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
