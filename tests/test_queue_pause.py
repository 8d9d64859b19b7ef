"""Queue pause and resume, and list_queues (SPEC section 9, Queues): the pause is a row the
claim statements read, so it holds for in-process and other-process workers, drain() and
RabbitMQ consumers alike; resume wakes idle workers at once."""

from __future__ import annotations

import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg import sql

from runlane import (
    ConfigurationError,
    QueueInfo,
    RetryPolicy,
    RunContext,
    Runlane,
    RunStatus,
    queue,
    task,
)
from runlane.postgres import PostgresStorage, _queues
from runlane.postgres._sql import statements
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, ready_process, wait_until

ONCE = RetryPolicy(max_attempts=1)


@task(id="pause.mark", queue="held", retry=ONCE)
def mark(payload: Any, context: RunContext) -> str:
    return context.queue


QUEUES = [queue("held"), queue("open", default=True)]


def by_name(infos: list[QueueInfo]) -> dict[str, QueueInfo]:
    return {info.name: info for info in infos}


def count_claims(worker: Any) -> list[float]:
    """Record when the worker's acquirer claims (its real claims, against the database)."""
    times: list[float] = []
    acquirer = worker.acquirer
    real = acquirer.acquire

    def counted(want: int, for_bounded: int) -> Any:
        times.append(time.monotonic())
        return real(want, for_bounded)

    acquirer.acquire = counted
    return times


# -- workers, drain ------------------------------------------------------------------------


def test_a_pause_stops_a_running_workers_claims_and_resume_wakes_it_at_once(
    make_runlane: Any,
) -> None:
    rl = make_runlane(
        tasks=[mark], queues=QUEUES, lane_options={"poll_interval": timedelta(seconds=30)}
    )
    with rl.create_delivery_worker(concurrency=2) as worker:
        assert worker.idle_signal.wait(10)
        assert worker.acquirer.listener.connected.wait(10), "LISTEN"
        assert rl.pause_queue("held", reason="incident 42") is True
        claims = count_claims(worker)
        worker.idle_signal.clear()
        held = rl.trigger(mark, None)  # a paused queue still accepts triggers
        # the worker claims both queues in one statement: the later run of the open queue
        # completing proves a claim after the held run was stored, which skipped it
        opened = rl.trigger(mark, None, queue="open")
        assert rl.wait_for_run(opened.id, timeout=10).output == "open"
        assert rl.get_run(held.id).status is RunStatus.QUEUED
        # no claim loop on the paused queue: once idle, the worker waits for its 30 s poll
        assert worker.idle_signal.wait(5)
        settled = len(claims)
        worker.idle_signal.clear()  # set by every empty claim: a claim loop would set it
        worker.idle_signal.wait(0.5)
        assert len(claims) == settled, f"{len(claims) - settled} claims while paused and idle"
        asked = time.monotonic()
        assert rl.resume_queue("held") is True
        assert rl.wait_for_run(held.id, timeout=5).status is RunStatus.COMPLETED
        took = time.monotonic() - asked
        assert took < 2.0, f"the resumed run started {took:.2f}s after resume (poll is 30 s)"


def test_drain_leaves_a_paused_queues_runs_queued(make_runlane: Any) -> None:
    rl = make_runlane(tasks=[mark], queues=QUEUES)
    rl.pause_queue("held")
    handles = rl.trigger_many(mark, [None] * 3)
    opened = rl.trigger(mark, None, queue="open")
    assert rl.drain().runs_executed == 1
    assert rl.get_run(opened.id).status is RunStatus.COMPLETED
    assert {rl.get_run(h.id).status for h in handles} == {RunStatus.QUEUED}
    assert rl.drain(queues=["held"]).runs_executed == 0
    rl.resume_queue("held")
    assert rl.drain().runs_executed == 3


def test_a_claim_does_not_read_a_paused_queues_backlog(
    make_runlane: Any, db: Conn, schema: str
) -> None:
    # 20,000 due runs of the paused queue sort before the served queue's one run (higher
    # priority, due earlier): a claim that walked the environment's queued runs read and
    # skipped every one of them (519 buffers in its pick); one that reads the served queue's
    # runs alone touches a few pages (9).
    rl = make_runlane(tasks=[mark], queues=QUEUES)
    rl.pause_queue("held")
    opened = rl.trigger(mark, None, queue="open")
    row = db.execute(
        sql.SQL("select environment from {}.runs where id = %s").format(sql.Identifier(schema)),
        (opened.id,),
    ).fetchone()
    assert row is not None
    environment = row[0]
    db.execute(
        sql.SQL(
            """
            insert into {}.runs (id, environment, task_id, queue, status, priority, payload,
                                 max_attempts, due_at)
            select gen_random_uuid(), %s, 'pause.mark', 'held', 'queued', 10, 'null'::jsonb,
                   1, now() - interval '1 hour' + g * interval '1 ms'
            from generate_series(1, 20000) as g
            """
        ).format(sql.Identifier(schema)),
        (environment,),
    )
    db.execute(sql.SQL("analyze {}.runs").format(sql.Identifier(schema)))
    params = {
        "environment": environment,
        "queues": ["open", "held"],
        "limit": 8,
        "lease_seconds": 60.0,
        "concurrency_limit": None,
        "worker_id": None,
        "now": None,
    }
    claim = statements(schema)["run_claim"]
    with db.transaction(force_rollback=True):
        plan = db.execute("explain (analyze, buffers, format json) " + claim, params).fetchone()
    assert plan is not None
    top = plan[0][0]["Plan"]
    assert top["Actual Rows"] == 1  # the open queue's run, claimed (and rolled back)
    (pick,) = [p for p in top["Plans"] if p.get("Subplan Name") == "CTE candidates"]
    buffers = pick["Shared Hit Blocks"] + pick["Shared Read Blocks"]
    assert buffers < 50, plan


def test_running_attempts_finish_after_a_pause(make_runlane: Any) -> None:
    started, go = threading.Event(), threading.Event()

    @task(id="pause.block", queue="held", retry=ONCE)
    def block(payload: Any, context: RunContext) -> str:
        started.set()
        assert go.wait(10)
        return "done"

    rl = make_runlane(tasks=[block], queues=QUEUES)
    with rl.create_delivery_worker(concurrency=1):
        handle = rl.trigger(block, None)
        assert started.wait(10)
        rl.pause_queue("held")
        go.set()
        snapshot = rl.wait_for_run(handle.id, timeout=10)
    assert snapshot.status is RunStatus.COMPLETED
    assert snapshot.output == "done"


_OTHER_WORKER = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    from runlane import RetryPolicy, RunContext, create_runlane, queue, task
    from runlane.postgres import PostgresStorage, _queues, postgres_polling_lane

    @task(id="pause.mark", queue="held", retry=RetryPolicy(max_attempts=1))
    def mark(payload, context: RunContext) -> str:
        return context.queue

    lane = postgres_polling_lane(
        connection_string=sys.argv[1], schema=sys.argv[2], poll_interval=timedelta(seconds=30)
    )
    rl = create_runlane(lane=lane, tasks=[mark], queues=[queue("held"), queue("open")])
    with rl.create_delivery_worker(concurrency=2) as worker:
        worker.idle_signal.wait(10)
        worker.acquirer.listener.connected.wait(10)
        print("ready", flush=True)
        sys.stdin.read()
    rl.close()
    """
)


def test_a_pause_holds_for_a_worker_in_another_process(
    make_runlane: RunlaneFactory, database_url: str, schema: str
) -> None:
    rl = make_runlane(tasks=[mark], queues=QUEUES)
    with ready_process(_OTHER_WORKER, database_url, schema):
        before = rl.trigger(mark, None)
        assert rl.wait_for_run(before.id, timeout=10).status is RunStatus.COMPLETED
        rl.pause_queue("held")
        held = rl.trigger(mark, None)
        opened = rl.trigger(mark, None, queue="open")  # claimed in the same statement
        assert rl.wait_for_run(opened.id, timeout=10).status is RunStatus.COMPLETED
        assert rl.get_run(held.id).status is RunStatus.QUEUED
        asked = time.monotonic()
        rl.resume_queue("held")
        assert rl.wait_for_run(held.id, timeout=5).status is RunStatus.COMPLETED
        assert time.monotonic() - asked < 2.0  # woken by NOTIFY, not its 30 s poll


# -- maintenance -------------------------------------------------------------------------------


def test_delivery_recovery_does_not_announce_a_paused_queue(make_runlane: Any) -> None:
    rl = make_runlane(tasks=[mark], queues=QUEUES)
    rl.pause_queue("held")
    rl.trigger(mark, None, run_at=datetime.now(UTC) - timedelta(seconds=1))
    for _ in range(2):
        assert rl.run_maintenance_once().queues_woken == 0
    rl.resume_queue("held")
    assert rl.run_maintenance_once().queues_woken == 1


# -- the operator's view and bad input ---------------------------------------------------------


def test_pause_and_resume_are_idempotent_and_shown(make_runlane: Any, db: Conn) -> None:
    rl = make_runlane(tasks=[mark], queues=QUEUES)
    assert rl.pause_queue("held", reason="deploy") is True
    first = by_name(rl.list_queues())["held"]
    assert first.paused
    assert first.paused_reason == "deploy"
    assert first.defined
    assert first.paused_at is not None
    assert rl.pause_queue("held", reason="still deploying") is False
    again = by_name(rl.list_queues())["held"]
    assert again.paused_reason == "still deploying"
    assert again.paused_at == first.paused_at  # paused since the first pause
    status = {q.name: q for q in rl.status().queues}
    assert status["held"].paused
    assert not status["open"].paused
    assert rl.resume_queue("held") is True
    assert rl.resume_queue("held") is False
    after = by_name(rl.list_queues())["held"]
    assert (after.paused, after.paused_reason, after.paused_at) == (False, None, None)
    assert not {q.name: q for q in rl.status().queues}["held"].paused


def test_list_queues_shows_queues_known_only_from_the_database(make_runlane: Any) -> None:
    app = make_runlane(tasks=[mark], queues=[*QUEUES, queue("bounded", concurrency_limit=3)])
    app.trigger_many(mark, [None] * 4)
    app.trigger(mark, None, queue="open")
    app.pause_queue("bounded", reason="r")
    ops = make_runlane()  # no tasks, no queues: a database URL alone
    infos = by_name(ops.list_queues())
    held = infos["held"]
    assert not held.defined
    assert held.concurrency_limit is None
    assert held.counts["queued"] == 4
    assert set(held.counts) == {
        "queued",
        "running",
        "retrying",
        "released",
        "waiting",
        "cancellation_requested",
    }
    assert held.oldest_queued_age is not None
    assert held.oldest_queued_age >= 0
    bounded = infos["bounded"]  # a pause row for a queue this runtime does not define
    assert bounded.paused
    assert not bounded.defined
    assert bounded.counts["queued"] == 0
    assert bounded.oldest_queued_age is None
    assert infos["default"].defined  # the runtime's own default queue
    # the defining runtime shows its limits
    assert by_name(app.list_queues())["bounded"].concurrency_limit == 3
    # an operator may pause a queue it knows only from the database
    assert ops.pause_queue("held") is True
    assert app.drain().runs_executed == 1  # the open queue's run only


def test_an_unknown_queue_is_refused_and_nothing_is_stored(
    make_runlane: Any, db: Conn, schema: str
) -> None:
    rl: Runlane = make_runlane(tasks=[mark], queues=QUEUES)
    calls: list[Callable[[], bool]] = [
        lambda: rl.pause_queue("helld"),
        lambda: rl.resume_queue("helld"),
    ]
    for call in calls:
        with pytest.raises(ConfigurationError, match="queue 'helld' is unknown") as info:
            call()
        assert "runlane queues list" in str(info.value)
    states = sql.SQL("select count(*) from {}.queue_states").format(sql.Identifier(schema))
    row = db.execute(states).fetchone()
    assert row is not None
    assert row[0] == 0
    assert "helld" not in by_name(rl.list_queues())


@pytest.mark.parametrize(
    ("name", "reason", "match"),
    [
        ("", None, "queue name"),
        ("x" * 10_000, None, "queue name"),
        (42, None, "queue name"),
        ("held", 42, "reason must be a non-empty string"),
        ("held", "", "reason must be a non-empty string"),
        ("held", "r" * 501, "at most 500 characters"),
        ("held", "a\x00b", "NUL"),
    ],
)
def test_bad_names_and_reasons_are_refused(
    make_runlane: Any, name: Any, reason: Any, match: str
) -> None:
    rl = make_runlane(tasks=[mark], queues=QUEUES)
    with pytest.raises(ConfigurationError, match=match) as info:
        rl.pause_queue(name, reason=reason)
    assert len(str(info.value)) < 1_000  # a long value is not repeated whole
    assert not by_name(rl.list_queues())["held"].paused


# -- the RabbitMQ lane ---------------------------------------------------------------------


def test_a_rabbitmq_consumer_acknowledges_a_paused_queues_deliveries_and_resume_delivers_them(
    rabbit_runtime: Any,
    rabbitmq_url: str,
    db: Conn,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queue_name = f"held{uuid.uuid4().hex[:8]}"

    @task(id="pause.rabbit", queue=queue_name, retry=ONCE)
    def rabbit(payload: Any, context: RunContext) -> str:
        return "ran"

    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[rabbit], queues=[queue(queue_name)])
    items = sql.SQL("select count(*) from {}.outbox").format(sql.Identifier(schema))

    def outbox() -> int:
        row = db.execute(items).fetchone()
        assert row is not None
        return int(row[0])

    with rl.create_delivery_worker(concurrency=1) as worker:
        stats = worker.acquirer.stats
        assert worker.acquirer.consuming.wait(15), "the consumer"
        rl.pause_queue(queue_name)
        handles = rl.trigger_many(rabbit, [None] * 8)
        wait_until(lambda: stats.paused >= 8, timeout=15, what="the paused deliveries")
        assert {rl.get_run(h.id).status for h in handles} == {RunStatus.QUEUED}
        assert stats.deferred == 0
        assert outbox() == 0
        # maintenance's recovery leaves it alone while paused (threshold passed at once)
        storage = rl._life.storage
        assert isinstance(storage, PostgresStorage)
        assert storage.outbox_recover(rl.environment, timedelta(microseconds=1), 100) == 0
        assert {rl.get_run(h.id).status for h in handles} == {RunStatus.QUEUED}
        monkeypatch.setattr(_queues, "RESUME_BATCH", 3)  # several batches: 3 + 3 + 2
        assert rl.resume_queue(queue_name) is True
        for h in handles:
            assert rl.wait_for_run(h.id, timeout=15).output == "ran"
    assert stats.paused == 8
