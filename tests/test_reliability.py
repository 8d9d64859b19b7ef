"""Defects a chaos soak found, each reproduced here on its own (issue 11).

- Idle pooled connections broken by ``pg_terminate_backend`` or a restart made the next
  calls fail although the server was up: the pool never tests a connection it hands out, so
  each statement retry took the next dead one.
- ``restart_embedded_postgres`` left the restarted server running after the handle's cleanup.
- The lease tracker keyed its entries by run id: a claim lost to a crash (claims commit
  asynchronously) and the same worker's new claim of the run shared one entry.
- A ``context.step`` whose write met an outage longer than the statement retries spent an
  attempt: it now raises a runlane error saying what to do, and the attempt is handed back.
- A worker paused for longer than the lease (SIGSTOP, a VM freeze) started the runs it had
  claimed ahead before the pause, although maintenance had already expired those attempts.
"""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from runlane import (
    RetryPolicy,
    RunContext,
    RunStatus,
    StorageUnavailable,
    create_runlane,
    task,
)
from runlane.errors import StopReason
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.storage import ClaimedRun, LeaseRef, NewRuns, Storage
from runlane.testing import restart_embedded_postgres, start_embedded_postgres
from runlane.worker._leases import LeaseTracker
from tests._proxy import tcp_proxy
from tests.helpers import poll, ready_process, storage_of, wait_for_status, wait_until

LEASE = timedelta(seconds=30)


@attrs.frozen
class Item:
    n: int


@task(id="noop", schema=Item)
def noop(payload: Item, context: RunContext) -> int:
    return payload.n


def _backends(db: psycopg.Connection[Any], application: str) -> int:
    row = db.execute(
        "select count(*) from pg_stat_activity where application_name = %s", [application]
    ).fetchone()
    assert row is not None
    return int(row[0])


def _pids(db: psycopg.Connection[Any], application: str) -> set[int]:
    rows = db.execute(
        "select pid from pg_stat_activity where application_name = %s", [application]
    ).fetchall()
    return {int(row[0]) for row in rows}


def test_idle_pooled_connections_killed_by_the_server_are_replaced_before_the_retry(
    database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    lane = postgres_polling_lane(
        connection_string=database_url, schema=schema, pool_min_size=10, pool_max_size=10
    )
    rl = create_runlane(lane=lane, tasks=[noop])
    application = f"runlane-{schema}"
    try:
        rl.start()
        wait_until(lambda: _backends(db, application) == 10, timeout=10, what="a full pool")
        for _ in range(3):
            killed = _pids(db, application)
            db.execute(
                "select pg_terminate_backend(pid) from unnest(%s::int[]) pid", [list(killed)]
            )
            assert killed
            # the killed backends are gone (the pool may already be replacing the ones it
            # found broken: a count of zero could pass unseen on a busy machine)
            wait_until(
                lambda killed=killed: not killed & _pids(db, application),  # type: ignore[misc]
                timeout=10,
                what="the killed backends gone",
            )
            began = time.monotonic()
            handle = rl.trigger(noop, Item(1))  # before: AdminShutdown once retries were spent
            assert rl.get_run(handle.id).status is RunStatus.QUEUED
            assert time.monotonic() - began < 1.0  # one failed statement, not the retry ladder
    finally:
        rl.close()


@pytest.mark.slow
def test_a_restarted_server_keeps_the_pool_working_and_its_cleanup_stops_it() -> None:
    if os.environ.get("RUNLANE_TEST_DATABASE_URL"):
        pytest.skip("restarting the server needs the embedded server this test starts itself")
    url, server = start_embedded_postgres()
    pgdata = Path(server.pgdata)
    try:
        schema = f"r_{uuid.uuid4().hex[:8]}"
        apply_postgres_storage_migrations(connection_string=url, schema=schema)
        lane = postgres_polling_lane(
            connection_string=url, schema=schema, pool_min_size=10, pool_max_size=10
        )
        rl = create_runlane(lane=lane, tasks=[noop])
        try:
            rl.start()
            restart_embedded_postgres(server)
            handle = rl.trigger(noop, Item(2))
            assert rl.get_run(handle.id).status is RunStatus.QUEUED
        finally:
            rl.close()
        postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    finally:
        server.cleanup()
    poll(lambda: not _alive(postmaster), timeout=10, interval=0.05)
    assert not _alive(postmaster), "the restarted server was left running"
    assert not pgdata.exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child counts as gone
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


def _insert(storage: Storage, task_id: str, count: int) -> None:
    storage.run_insert_many(
        NewRuns(
            environment="default",
            task_id=task_id,
            queue="default",
            ids=[uuid.uuid4() for _ in range(count)],
            payloads=['{"n": 1}'] * count,
            idempotency_keys=[None] * count,
            priority=0,
            max_attempts=5,
            delay=timedelta(0),
            run_at=None,
        )
    )


def _claim_one(database_url: str, schema: str) -> tuple[Any, ClaimedRun]:
    lane = postgres_polling_lane(connection_string=database_url, schema=schema)
    rl = create_runlane(lane=lane, tasks=[noop])
    storage = storage_of(rl)
    _insert(storage, "noop", 1)
    (claimed,) = storage.run_claim("default", ["default"], 1, LEASE)
    return rl, claimed


def test_a_lost_claim_and_the_new_claim_of_the_same_run_are_tracked_apart(
    database_url: str, schema: str
) -> None:
    rl, live = _claim_one(database_url, schema)
    try:
        # the claim a crash lost: same run, same attempt number, a token the database never
        # kept (the new claim got the same attempt number because the old one was lost)
        lost = attrs.evolve(live, lease_token=uuid.uuid4())
        tracker = LeaseTracker(LEASE)
        tracker.hold(lost)
        tracker.hold(live)
        assert len(tracker) == 2
        # the lost claim's end cannot take the live claim's entry with it
        assert tracker.untrack(lost) is not None
        (only,) = tracker.tracked()
        assert only.ref == LeaseRef(live.id, live.attempt, live.lease_token)
        # an extension signals the lost claim and keeps the live one
        tracker.hold(lost)
        entries = {item.ref.lease_token: item for item in tracker.tracked()}
        tracker.extend(storage_of(rl))
        assert entries[lost.lease_token].stop_reason is StopReason.LEASE_LOST
        assert entries[live.lease_token].stop_reason is None
        assert tracker.tracked() == [entries[live.lease_token]]
    finally:
        rl.close()


def test_a_claim_whose_lease_was_not_confirmed_for_too_long_has_lapsed(
    database_url: str, schema: str
) -> None:
    rl, live = _claim_one(database_url, schema)
    try:
        tracker = LeaseTracker(LEASE)
        now = time.monotonic()
        tracker.hold(live, sent_at=now)
        assert not tracker.lapsed(live, now + 1)
        # the budget is the lease less one extension interval
        assert tracker.lapsed(live, now + LEASE.total_seconds() * 2 / 3 + 0.01)
        # an applied extension confirms the lease again from when it was sent
        tracker.extend(storage_of(rl))
        assert not tracker.lapsed(live, time.monotonic() + LEASE.total_seconds() / 2)
    finally:
        rl.close()


_FROZEN_WORKER = textwrap.dedent(
    """
    import sys, threading, time
    from datetime import timedelta
    import attrs, psycopg
    from psycopg import sql
    from runlane import RunContext, create_runlane, task
    from runlane.postgres import postgres_polling_lane

    url, schema = sys.argv[1], sys.argv[2]
    journal = psycopg.connect(url, autocommit=True)
    lock = threading.Lock()
    # checked_at: when the worker checked the lease before starting the run, by the
    # database's clock: a reading of it, less the time since the check measured after that
    # reading returned. A freeze anywhere between the check and the record then moves
    # checked_at earlier, never later. (Measured before the record's statement was sent,
    # a freeze falling just after the measurement made a check made before the pause look
    # made after the resume: "1 expired attempts started after resume", whose record came
    # 2.6 s after its check.)
    clock = "select clock_timestamp()"
    insert = sql.SQL(
        "insert into {}.handler_log (run_id, attempt, pid, started_at, checked_at) "
        "values (%s, %s, %s, clock_timestamp(), %s)"
    ).format(sql.Identifier(schema))

    @attrs.frozen
    class Item:
        n: int

    @task(id="slow", schema=Item)
    def slow(payload: Item, context: RunContext) -> int:
        with lock:
            (now,) = journal.execute(clock).fetchone()
            checked_at = now - timedelta(seconds=time.monotonic() - context._lease_checked_at)
            journal.execute(
                insert, [context.run_id, context.attempt, __import__("os").getpid(), checked_at]
            )
        time.sleep(0.005)  # short handlers: the worker claims ahead of its free slot
        return payload.n

    lane = postgres_polling_lane(
        connection_string=url, schema=schema, lease_duration=timedelta(seconds=2),
        poll_interval=timedelta(seconds=0.2),
    )
    rl = create_runlane(lane=lane, tasks=[slow])
    with rl.create_delivery_worker(concurrency=1):
        print("ready", flush=True)
        sys.stdin.read()
    rl.close()
    """
)


@pytest.mark.slow
def test_a_worker_paused_past_its_leases_starts_none_of_the_runs_it_had_claimed_ahead(
    database_url: str, schema: str, db: psycopg.Connection[Any], make_runlane: Any
) -> None:
    db.execute(
        sql.SQL(
            "create table {}.handler_log (run_id uuid, attempt int, pid int, "
            "started_at timestamptz, checked_at timestamptz)"
        ).format(sql.Identifier(schema))
    )
    producer = make_runlane(tasks=[])
    _insert(storage_of(producer), "slow", 3000)
    log = sql.Identifier(schema, "handler_log")
    runs = sql.Identifier(schema, "runs")

    def one(query: sql.SQL | sql.Composed, *params: Any) -> Any:
        row = db.execute(query, params).fetchone()
        assert row is not None
        return row[0]

    with ready_process(_FROZEN_WORKER, database_url, schema) as worker:
        try:
            count_log = sql.SQL("select count(*) from {}").format(log)
            wait_until(lambda: one(count_log) >= 5, timeout=20, what="the worker to run handlers")
            # claimed ahead and not started: running attempts with no handler record
            count_held = sql.SQL(
                "select count(*) from {} r where r.status = 'running' and not exists "
                "(select 1 from {} h where h.run_id = r.id and h.attempt = r.attempt)"
            ).format(runs, log)
            # the frozen worker's statements in flight have settled: its backends are idle
            in_flight = sql.SQL(
                "select count(*) from pg_stat_activity "
                "where application_name like 'runlane-worker-%%' and state = 'active'"
            )

            def resume() -> None:  # and let it run a handler
                ran = one(count_log)
                os.kill(worker.pid, signal.SIGCONT)
                wait_until(lambda: one(count_log) > ran, timeout=20, what="it to run again")

            held = 0
            for _ in range(20):  # freeze it at a moment it holds runs claimed ahead
                wait_until(lambda: one(count_held) >= 2, timeout=20, what="runs claimed ahead")
                os.kill(worker.pid, signal.SIGSTOP)
                wait_until(lambda: one(in_flight) == 0, timeout=10, what="its statements")
                held = one(count_held)
                if held >= 1:
                    break
                resume()
            assert held >= 1, "the worker held no run claimed ahead; the test proves nothing"
            maintainer = make_runlane(tasks=[])
            # the real clock must pass the 2 s leases, not only the database's: what is under
            # test is the resumed worker's own deadline for what it claimed ahead (with the
            # database's clock moved instead, it started 13 expired attempts)
            # until every attempt it holds is expired: the leases of runs claimed after its
            # last extension lapse later than the others (up to an extension interval), and
            # stopping at the first pass that expired any left those running (expired <
            # held, and untested)
            count_running = sql.SQL("select count(*) from {} where status = 'running'").format(runs)
            expired = 0

            def all_expired() -> bool:
                nonlocal expired
                expired += maintainer.run_maintenance_once().attempts_expired
                return bool(expired) and one(count_running) == 0

            poll(all_expired, timeout=20, interval=0.5)
            assert expired >= held
            resumed_at = one(sql.SQL("select clock_timestamp()"))
            os.kill(worker.pid, signal.SIGCONT)
            # let it run until its one slot has been through the hand-off (first in, first
            # out): the runs it held, then one claimed after the resume
            after_resume = sql.SQL(
                "select count(*) from {} where pid = %s and checked_at > %s"
            ).format(log)
            wait_until(
                lambda: one(after_resume, worker.pid, resumed_at) > held,
                timeout=20,
                what="the resumed worker to work through what it held",
            )
            started_expired = one(
                sql.SQL(
                    "select count(*) from {} h join {} a "
                    "on a.run_id = h.run_id and a.attempt = h.attempt "
                    "where a.outcome = 'expired' and h.pid = %s and h.checked_at > %s"
                ).format(log, sql.Identifier(schema, "attempts")),
                worker.pid,
                resumed_at,
            )
            assert started_expired == 0, f"{started_expired} expired attempts started after resume"
            assert one(count_log) > 5, "the resumed worker did no further work"
        finally:
            os.kill(worker.pid, signal.SIGCONT)


def test_a_step_meeting_a_long_outage_raises_a_runlane_error_and_spends_no_attempt(
    database_url: str, schema: str, make_runlane: Any
) -> None:
    entered = threading.Event()
    go = threading.Event()
    seen: list[BaseException] = []

    @task(id="stepper", schema=Item, retry=RetryPolicy(max_attempts=1))
    def stepper(payload: Item, context: RunContext) -> int:
        entered.set()
        go.wait(10)
        try:
            return int(context.step("one", lambda: payload.n))
        except Exception as exc:
            seen.append(exc)
            raise

    producer = make_runlane(tasks=[stepper])
    with tcp_proxy(database_url) as proxy:
        proxy.up()
        lane = postgres_polling_lane(
            connection_string=proxy.url_for(database_url), schema=schema, connect_timeout=1
        )
        rl = create_runlane(lane=lane, tasks=[stepper])
        try:
            with rl.create_delivery_worker(concurrency=1):
                handle = producer.trigger(stepper, Item(7))
                assert entered.wait(10)
                proxy.down()  # longer than the statement retries (about 1.3 s)
                go.set()
                wait_until(lambda: bool(seen), timeout=20, what="the step to give up")
                proxy.up()
                done = wait_for_status(producer, handle.id, RunStatus.COMPLETED, timeout=30)
        finally:
            rl.close()
    error = seen[0]
    assert isinstance(error, StorageUnavailable)
    assert "context.step()" in str(error)
    assert "Let this error propagate" in str(error)
    assert not isinstance(error, psycopg.Error)
    # one attempt allowed, and it was not spent: handed back, then completed
    assert done.output == 7
    outcomes = [a.outcome for a in producer.get_run_history(handle.id).attempts]
    assert outcomes == ["released", "completed"]
