"""Faults of the RabbitMQ lane, each a test: the broker SIGTERMed or SIGKILLed mid-flow, a
confirmed publish whose result is lost, a stale publisher, a producer dying after commit, a
consumer SIGKILLed before and after its claim, duplicate, unknown and malformed messages, a
broker down during triggers, and a purged queue.

In every test each run completes and its handler executes once (per attempt); a duplicate
message is acknowledged and counted, never executed. Real Postgres and real RabbitMQ nodes on
loopback throughout; tests that stop their broker get a private node (``rabbitmq_node``), the
others share the session's (``rabbitmq_url``; queue names carry the test's schema)."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from runlane import (
    RetryPolicy,
    RunContext,
    Runlane,
    RunStatus,
    task,
)
from runlane.cli._rabbit_nodes import RabbitNode
from runlane.postgres import PostgresStorage
from runlane.rabbitmq import RabbitMQStatus
from runlane.storage import OutboxItem
from tests.conftest import RabbitRuntimes, RunlaneFactory
from tests.helpers import (
    Executions,
    amqp_queue,
    attempt_rows,
    closed_port,
    consumer_ready,
    consumer_stats,
    elapse,
    outbox_count,
    poll,
    publish_by_hand,
    q,
    ready_messages,
    statuses,
    storage_of,
    wait_until,
)

Conn = psycopg.Connection[Any]
QUICK_RETRY = RetryPolicy(max_attempts=2, initial_delay=timedelta(0), jitter=0.0)


def _settle(
    rl: Runlane,
    db: Conn,
    schema: str,
    run_ids: Sequence[uuid.UUID],
    *,
    timeout: float,
    maintenance: bool = True,
) -> None:
    """Run maintenance passes (bounded poll) until every run is completed and the outbox is
    empty."""
    ids = list(run_ids)
    row: tuple[Any, ...] = (0, 0)

    def settled() -> bool:
        nonlocal row
        found = db.execute(
            q(
                "select count(*) filter (where status = 'completed'), "
                "(select count(*) from {s}.outbox) from {s}.runs where id = any(%s)",
                schema,
            ),
            (ids,),
        ).fetchone()
        assert found is not None
        row = found
        if row[0] == len(ids) and row[1] == 0:
            return True
        if maintenance:
            rl.run_maintenance_once()
        return False

    if not poll(settled, timeout=timeout, interval=0.2):
        pytest.fail(
            f"{row[0]} of {len(ids)} runs completed, {row[1]} outbox items left after "
            f"{timeout}s; runs by status {statuses(db, schema)}; {rl.status()}"
        )


def _assert_once_each(executions: Executions, run_ids: Sequence[uuid.UUID]) -> None:
    assert set(executions.runs) == set(run_ids)
    assert not executions.more_than_once(), "handlers executed more than once"


# -- 1. the broker SIGTERMed or SIGKILLed while publishing and consuming --------------------------


def _save_queue_registry(node: RabbitNode) -> None:
    """Have the node write its quorum queue registry and mnesia's log now."""
    synced = node.evaluate("[mnesia:sync_log() | [dets:sync(T) || T <- dets:all()]]")
    assert set(synced) == {"ok"}, synced


def test_broker_sigtermed_then_sigkilled_while_publishing_and_consuming(
    rabbit_runtime: RabbitRuntimes, rabbitmq_node: RabbitNode, db: Conn, schema: str
) -> None:
    """One private node, two outages in a row: SIGTERM (a graceful shutdown), then SIGKILL of
    the whole VM, each while runs are being triggered, published and consumed."""
    executions = Executions()
    work = executions.task("faults.work", retry=QUICK_RETRY)
    rl = rabbit_runtime(
        amqp_url=rabbitmq_node.amqp_url,
        tasks=[work],
        publish_timeout=timedelta(seconds=2),
        claim_duration=timedelta(seconds=5),
    )
    worker = rl.create_delivery_worker(concurrency=4)
    consumer_ready(worker)  # the worker declared the queue
    triggered: list[uuid.UUID] = []
    during: dict[str, list[uuid.UUID]] = {"terminate": [], "kill": []}
    outage: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def trigger_loop() -> None:
        n = 0
        try:
            while not stop.is_set():
                run_id = rl.trigger(work, n).id
                triggered.append(run_id)
                if outage:
                    during[outage[0]].append(run_id)
                n += 1
                stop.wait(0.02)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    producer = threading.Thread(target=trigger_loop, name="faults-producer")
    producer.start()
    try:
        wait_until(lambda: len(executions.runs) >= 20, timeout=15, what="runs to flow")
        for how in ("terminate", "kill"):
            # RabbitMQ saves its registry of quorum queue members every 0.5 s: a node
            # SIGKILLed before a save after the declaration restarts with a queue that never
            # answers again (see tests/test_rabbitmq_node.py), a broker limit rather than
            # the lane's. The saves are made now instead of waited for.
            _save_queue_registry(rabbitmq_node)
            outage[:] = [how]
            if how == "kill":
                rabbitmq_node.kill()
            else:
                rabbitmq_node.terminate()
                wait_until(lambda: not rabbitmq_node.running, timeout=30, what="the stop")
            for _ in range(3):  # maintenance passes while the broker is down
                rl.run_maintenance_once()
            rabbitmq_node.start()
            outage.clear()
            # runs flow again through the restarted broker (eager triggers, no backlog)
            flowing = len(executions.runs)
            wait_until(
                lambda n=flowing: len(executions.runs) >= n + 20,  # type: ignore[misc]
                timeout=20,
                what=f"runs to flow again after the {how}",
            )
    finally:
        stop.set()
        producer.join(30)
    assert not errors, errors
    assert all(len(ids) >= 10 for ids in during.values()), "an outage was trivially short"
    elapse(db, schema, 30, "outbox.available_at")  # the outages' back-offs, moved past
    _settle(rl, db, schema, triggered, timeout=60)
    worker.close(timeout=10)
    _assert_once_each(executions, triggered)
    assert outbox_count(db, schema) == 0
    print(
        f"\n{len(triggered)} runs ({len(during['terminate'])} during the SIGTERM outage, "
        f"{len(during['kill'])} during the SIGKILL one), each once; "
        f"consumer {consumer_stats(worker)}"
    )


# -- 2. publish confirmed, its result not stored ---------------------------------------------------


def test_a_confirmed_publish_whose_result_is_lost_is_published_again_and_runs_once(
    rabbit_runtime: RabbitRuntimes,
    rabbitmq_url: str,
    *,
    database_url: str,
    db: Conn,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="runlane.rabbitmq")
    executions = Executions()
    work = executions.task("faults.work", retry=QUICK_RETRY)
    rl = rabbit_runtime(
        amqp_url=rabbitmq_url,
        tasks=[work],
        claim_duration=timedelta(seconds=2),
        publish_timeout=timedelta(seconds=1),
    )
    worker = rl.create_delivery_worker(concurrency=2)
    consumer_ready(worker)
    # the fault: the publisher's delete of its item waits on a lock the test holds (a gate
    # trigger on this schema's outbox), and the test kills its backend while it waits,
    # after the broker confirmed the message
    key = random.randrange(1, 2**31)
    db.execute(
        q(
            "create function {s}.delete_gate() returns trigger language plpgsql as $$ "
            f"begin perform pg_advisory_xact_lock_shared({key}); return old; end $$",
            schema,
        )
    )
    db.execute(
        q(
            "create trigger delete_gate before delete on {s}.outbox "
            "for each row execute function {s}.delete_gate()",
            schema,
        )
    )
    lost = "could not record it"
    with psycopg.connect(database_url, autocommit=True) as gate:
        gate.execute("select pg_advisory_lock(%s)", (key,))
        run_id = rl.trigger(work, "confirmed").id
        # the message was confirmed and delivered: the run executes while the delete waits
        rl.wait_for_run(run_id, timeout=10)

        def kill_waiters() -> bool:
            db.execute(
                "select pg_terminate_backend(pid) from pg_locks "
                "where locktype = 'advisory' and not granted and objid = %s and pid <> %s",
                (key, gate.info.backend_pid),
            )
            return any(lost in r.getMessage() for r in caplog.records)

        # the storage retries a lost connection a few times: kill each retry
        wait_until(kill_waiters, timeout=15, interval=0.05, what="the publisher to give up")
        gate.execute("select pg_advisory_unlock(%s)", (key,))
    db.execute(q("drop trigger delete_gate on {s}.outbox", schema))
    row = db.execute(q("select claim_token is not null from {s}.outbox", schema)).fetchone()
    assert row == (True,), "the item should stay, claimed, until its claim expires"
    # after its claim expires (2 s: on the database's clock, moved rather than waited),
    # maintenance publishes it again: a duplicate message
    elapse(db, schema, 10, "outbox.claim_expires_at")
    stats = consumer_stats(worker)

    def redelivered() -> bool:
        if stats.duplicates >= 1 and not outbox_count(db, schema):
            return True
        rl.run_maintenance_once()
        return False

    assert poll(redelivered, timeout=20, interval=0.2), f"no duplicate delivered: {stats}"
    worker.close(timeout=10)
    assert rl.get_run(run_id).status is RunStatus.COMPLETED
    assert executions.runs[run_id] == 1
    assert stats.duplicates == 1
    assert stats.claimed == 1


# -- 3. a stale publisher paused past its claim ---------------------------------------------------


def _outbox_storage(make_runlane: RunlaneFactory) -> tuple[Runlane, PostgresStorage]:
    """A runtime on the polling lane (no publisher of its own to race the test) whose
    storage writes outbox items for the default environment."""

    @task(id="faults.outboxed")
    def outboxed(payload: Any, context: RunContext) -> None:
        return None

    rl = make_runlane(tasks=[outboxed])
    rl.start()
    storage = storage_of(rl)
    assert isinstance(storage, PostgresStorage)
    storage.outbox_enable("default", timedelta(minutes=5))
    return rl, storage


def _item_row(db: Conn, schema: str, item_id: uuid.UUID) -> tuple[Any, ...] | None:
    return db.execute(
        q(
            "select claim_token, claim_expires_at, available_at, failures, last_error "
            "from {s}.outbox where id = %s",
            schema,
        ),
        (item_id,),
    ).fetchone()


def _expire_claim(db: Conn, schema: str, item_id: uuid.UUID) -> None:
    db.execute(
        q(
            "update {s}.outbox set claim_expires_at = now() - interval '1 second' "
            "where id = %s and claim_token is not null",
            schema,
        ),
        (item_id,),
    )


def test_a_stale_publisher_changes_nothing(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl, storage = _outbox_storage(make_runlane)
    run_id = rl.trigger("faults.outboxed", None).id
    (first,) = storage.outbox_claim_page("default", 10, timedelta(seconds=30))
    assert first.run_id == run_id
    assert storage.outbox_claim_page("default", 10, timedelta(seconds=30)) == []  # a live claim
    _expire_claim(db, schema, first.id)  # the first publisher paused past its claim
    (second,) = storage.outbox_claim_page("default", 10, timedelta(seconds=30))
    assert second.id == first.id
    assert second.claim_token != first.claim_token
    held = _item_row(db, schema, first.id)
    assert held is not None
    assert held[0] == second.claim_token

    assert storage.outbox_published([first]) == set()
    assert storage.outbox_failed([first], "late failure", timedelta(0)) == set()
    assert _item_row(db, schema, first.id) == held  # still the second claimer's, unchanged
    assert storage.outbox_published([second]) == {second.id}
    assert _item_row(db, schema, first.id) is None
    assert storage.outbox_failed([second], "after success", timedelta(0)) == set()


class _ClaimMachine(RuleBasedStateMachine):
    """Three publishers claim, record success or failure, and pause past their claims, in
    any interleaving, on one outbox item per example. Model: the publisher whose token is in
    the row is the current claimer; only its writes apply."""

    rl: Runlane
    storage: PostgresStorage
    db: Conn
    schema: str

    def __init__(self) -> None:
        super().__init__()
        run_id = self.rl.trigger("faults.outboxed", None).id
        row = self.db.execute(
            q("select id from {s}.outbox where run_id = %s", self.schema), (run_id,)
        ).fetchone()
        assert row is not None
        self.item_id: uuid.UUID = row[0]
        self.held: dict[int, OutboxItem] = {}
        self.current: int | None = None
        self.claimable = True
        self.deleted = False
        self.failures = 0

    def _row(self) -> tuple[Any, ...] | None:
        return _item_row(self.db, self.schema, self.item_id)

    @rule(publisher=st.integers(0, 2))
    def claim(self, publisher: int) -> None:
        page = [
            i
            for i in self.storage.outbox_claim_page("default", 50, timedelta(minutes=5))
            if i.id == self.item_id
        ]
        if self.deleted or not self.claimable:
            assert page == []
            return
        assert len(page) == 1
        self.held[publisher] = page[0]
        self.current = publisher
        self.claimable = False

    @rule()
    def pause_past_claim(self) -> None:
        if not self.deleted and self.current is not None:
            _expire_claim(self.db, self.schema, self.item_id)
            self.claimable = True

    @rule(publisher=st.integers(0, 2))
    def published(self, publisher: int) -> None:
        item = self.held.get(publisher)
        if item is None:
            return
        before = self._row()
        applied = self.storage.outbox_published([item])
        if not self.deleted and self.current == publisher:
            assert applied == {self.item_id}
            self.deleted = True
        else:
            assert applied == set()
            assert self._row() == before

    @rule(publisher=st.integers(0, 2))
    def failed(self, publisher: int) -> None:
        item = self.held.get(publisher)
        if item is None:
            return
        before = self._row()
        applied = self.storage.outbox_failed([item], f"publisher {publisher}", timedelta(0))
        if not self.deleted and self.current == publisher:
            assert applied == {self.item_id}
            self.current = None
            self.claimable = True
            self.failures += 1
        else:
            assert applied == set()
            assert self._row() == before

    @invariant()
    def row_matches_the_model(self) -> None:
        row = self._row()
        if self.deleted:
            assert row is None
            return
        assert row is not None
        token, _expires, _available, failures, _error = row
        if self.current is None:
            assert token is None
        else:
            assert token == self.held[self.current].claim_token
        assert failures == self.failures

    def teardown(self) -> None:
        self.db.execute(q("delete from {s}.outbox where id = %s", self.schema), (self.item_id,))


def test_interleaved_publishers_only_the_current_claimer_writes(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl, storage = _outbox_storage(make_runlane)

    class Machine(_ClaimMachine):
        pass

    Machine.rl, Machine.storage, Machine.db, Machine.schema = rl, storage, db, schema
    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=40,
            stateful_step_count=20,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# -- 4. an eager producer killed after commit ----------------------------------------------------

PRODUCER = textwrap.dedent(
    """
    import os, sys
    from datetime import timedelta
    from runlane import RetryPolicy, create_runlane, task
    from runlane.rabbitmq import rabbitmq_lane

    @task(id="faults.work", retry=RetryPolicy(max_attempts=2, initial_delay=timedelta(0),
                                               jitter=0.0))
    def work(payload, context):
        return payload

    rl = create_runlane(
        lane=rabbitmq_lane(
            connection_string=sys.argv[1], schema=sys.argv[2], amqp_url=sys.argv[3],
            claim_duration=timedelta(seconds=2), publish_timeout=timedelta(seconds=1),
            connect_timeout=1.0,
        ),
        tasks=[work],
    )
    print(rl.trigger(work, "orphan").id, flush=True)
    os._exit(0)  # dies before its publisher could publish or release the item
    """
)


def test_an_eager_producer_killed_after_commit_leaves_its_item_to_be_published_after_expiry(
    rabbit_runtime: RabbitRuntimes,
    rabbitmq_url: str,
    *,
    database_url: str,
    db: Conn,
    schema: str,
    tmp_path: Path,
) -> None:
    executions = Executions()
    work = executions.task("faults.work", retry=QUICK_RETRY)
    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[work])
    worker = rl.create_delivery_worker(concurrency=2)
    consumer_ready(worker)
    # the producer's broker accepts TCP and never answers: its publish cannot finish
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        port = mute.getsockname()[1]
        (tmp_path / "producer.py").write_text(PRODUCER)
        done = subprocess.run(
            [
                sys.executable,
                str(tmp_path / "producer.py"),
                database_url,
                schema,
                # stack_timeout bounds the AMQP handshake of the lane's start-up check,
                # which the mute broker would otherwise hold for pika's default 15 s
                f"amqp://guest:guest@127.0.0.1:{port}/%2F?stack_timeout=1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    run_id = uuid.UUID(done.stdout.strip())
    claim = q("select claim_token, failures from {s}.outbox where run_id = %s", schema)
    row = db.execute(claim, (run_id,)).fetchone()
    assert row is not None
    token, failures = row
    assert token is not None, "the dead producer's item should still be claimed"
    assert failures == 0
    # while the dead producer's claim lasts, maintenance leaves its item alone
    assert rl.run_maintenance_once().outbox_published == 0
    assert db.execute(claim, (run_id,)).fetchone() == (token, 0)
    assert rl.get_run(run_id).status is RunStatus.QUEUED
    assert run_id not in executions.runs
    # once the claim has expired (2 s on the database's clock: moved, not waited), this
    # runtime's maintenance publishes the item
    elapse(db, schema, 10, "outbox.claim_expires_at")
    _settle(rl, db, schema, [run_id], timeout=20)
    worker.close(timeout=10)
    assert executions.runs[run_id] == 1


# -- 5. a consumer SIGKILLed before and after its claim --------------------------------------------

WORKER_APP = textwrap.dedent(
    """
    import os, sys, threading
    from datetime import timedelta
    from runlane import RetryPolicy, create_runlane, task
    from runlane.rabbitmq import rabbitmq_lane

    @task(id="faults.work", retry=RetryPolicy(max_attempts=2, initial_delay=timedelta(0),
                                               jitter=0.0))
    def work(payload, context):
        # one write: the CLI's log thread writes to the same stream at the same time
        sys.stderr.write(f"executing {context.run_id} {context.attempt}\\n")
        sys.stderr.flush()
        threading.Event().wait(600)  # blocks until the process is killed

    runlane = create_runlane(
        lane=rabbitmq_lane(
            connection_string=os.environ["APP_DATABASE_URL"],
            schema=os.environ["APP_SCHEMA"],
            amqp_url=os.environ["APP_AMQP_URL"],
            lease_duration=timedelta(seconds=2),
        ),
        tasks=[work],
    )
    """
)


def test_a_consumer_sigkilled_before_and_after_its_claim_loses_nothing(
    rabbit_runtime: RabbitRuntimes,
    rabbitmq_url: str,
    *,
    database_url: str,
    db: Conn,
    schema: str,
    tmp_path: Path,
) -> None:
    executions = Executions()
    work = executions.task("faults.work", retry=QUICK_RETRY)
    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[work], lease_duration=timedelta(seconds=2))
    name = amqp_queue(schema)
    (tmp_path / "faultsapp.py").write_text(WORKER_APP)
    env = {
        **os.environ,
        "APP_DATABASE_URL": database_url,
        "APP_SCHEMA": schema,
        "APP_AMQP_URL": rabbitmq_url,
    }
    with subprocess.Popen(
        [sys.executable, "-m", "runlane.cli", "worker", "faultsapp:runlane", "--concurrency", "1"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            claimed = rl.trigger(work, "claimed").id  # (b): the killed worker claims it
            wait_until(
                lambda: rl.get_run(claimed).status is RunStatus.RUNNING,
                timeout=30,
                what="the worker process to claim the first run",
            )
            prefetched = rl.trigger(work, "prefetched").id  # (a): delivered, not claimed
            wait_until(
                lambda: outbox_count(db, schema) == 0 and ready_messages(rabbitmq_url, name) == 0,
                timeout=10,
                what="the second message to be delivered to the worker process",
            )
            assert rl.get_run(prefetched).status is RunStatus.QUEUED
            proc.send_signal(signal.SIGKILL)
            _, stderr = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    executed_there = re.findall(r"executing ([0-9a-f-]{36}) (\d+)", stderr)
    assert executed_there == [(str(claimed), "1")], stderr

    worker = rl.create_delivery_worker(concurrency=2)
    # (a) the unacked message comes back at once; (b) the lease lapses (2 s on the database's
    # clock: moved, not waited; the killed process cannot renew it), maintenance expires the
    # attempt, the retry is announced through the outbox and runs as attempt 2
    elapse(db, schema, 10, "runs.lease_expires_at")
    _settle(rl, db, schema, [claimed, prefetched], timeout=30)
    worker.close(timeout=10)
    assert dict(executions.attempts) == {(prefetched, 1): 1, (claimed, 2): 1}
    outcomes = attempt_rows(db, schema, claimed)
    assert [attempt for attempt, _ in outcomes] == [1, 2]
    assert outcomes[1][1] == "completed"
    assert attempt_rows(db, schema, prefetched) == [(1, "completed")]


# -- 6. and 7. duplicate, unknown and malformed messages ----------------------------------------


def test_a_duplicate_message_by_hand_never_executes_a_run_twice(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    executions = Executions()
    release = threading.Event()

    @task(id="faults.dup")
    def dup(payload: Any, context: RunContext) -> Any:
        executions.add(context)
        if payload == "blocker":
            release.wait(30)
        return payload

    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[dup])
    name = amqp_queue(schema)
    worker = rl.create_delivery_worker(concurrency=1)  # prefetch 1: one delivery at a time
    consumer_ready(worker)

    def body(run_id: uuid.UUID) -> bytes:
        return json.dumps({"run_id": str(run_id), "environment": "default"}).encode()

    completed = rl.trigger(dup, "completed").id
    rl.wait_for_run(completed, timeout=10)
    publish_by_hand(rabbitmq_url, name, body(completed))

    blocker = rl.trigger(dup, "blocker").id  # holds the only slot
    wait_until(lambda: blocker in executions.runs, timeout=10, what="the blocker to start")
    queued = rl.trigger(dup, "queued").id
    wait_until(lambda: outbox_count(db, schema) == 0, timeout=10, what="the run published")
    publish_by_hand(rabbitmq_url, name, body(queued))  # while the run is still queued
    assert rl.get_run(queued).status is RunStatus.QUEUED
    release.set()
    for run_id in (completed, blocker, queued):
        assert rl.wait_for_run(run_id, timeout=10).status is RunStatus.COMPLETED
    stats = consumer_stats(worker)
    wait_until(
        lambda: stats.duplicates == 2, timeout=10, what="both duplicates", state=lambda: stats
    )
    worker.close(timeout=10)
    _assert_once_each(executions, [completed, blocker, queued])
    assert stats.claimed == 3
    assert stats.unknown == stats.malformed == 0
    assert ready_messages(rabbitmq_url, name) == 0


def test_unknown_runs_and_malformed_bodies_are_acked_logged_and_counted(
    rabbit_runtime: RabbitRuntimes,
    rabbitmq_url: str,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="runlane.rabbitmq")
    executions = Executions()
    work = executions.task("faults.work", retry=QUICK_RETRY)
    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[work])
    name = amqp_queue(schema)
    worker = rl.create_delivery_worker(concurrency=2)
    consumer_ready(worker)
    stranger = uuid.uuid4()
    publish_by_hand(
        rabbitmq_url,
        name,
        json.dumps({"run_id": str(stranger), "environment": "default"}).encode(),
        b"not json at all",
        json.dumps({"run": "no run_id key"}).encode(),
        json.dumps({"run_id": "not-a-uuid"}).encode(),
        b"[" * 100_000,  # too deep for the JSON parser: it used to kill the consumer's worker
    )
    stats = consumer_stats(worker)
    wait_until(
        lambda: stats.unknown == 1 and stats.malformed == 4,
        timeout=10,
        what="the messages to be counted",
        state=lambda: stats,
    )
    # a run still goes through afterwards
    run_id = rl.trigger(work, "after").id
    assert rl.wait_for_run(run_id, timeout=10).status is RunStatus.COMPLETED
    worker.close(timeout=10)
    # acked, not merely held: nothing came back when the consumer's connection closed
    assert ready_messages(rabbitmq_url, name) == 0
    messages = [r.getMessage() for r in caplog.records if r.name == "runlane.rabbitmq.consumer"]
    assert sum(str(stranger) in m and "does not have" in m for m in messages) == 1
    assert sum("names no run" in m for m in messages) == 4
    assert stats.duplicates == 0
    assert executions.runs == {run_id: 1}


# -- 8. the broker down during trigger() -----------------------------------------------------------


def test_triggers_commit_while_the_broker_is_down_and_are_delivered_when_it_returns(
    rabbit_runtime: RabbitRuntimes, rabbitmq_node: RabbitNode, db: Conn, schema: str
) -> None:
    executions = Executions()
    work = executions.task("faults.work", retry=QUICK_RETRY)
    rl = rabbit_runtime(
        amqp_url=rabbitmq_node.amqp_url,
        tasks=[work],
        publish_timeout=timedelta(seconds=1),
        claim_duration=timedelta(seconds=3),
    )
    worker = rl.create_delivery_worker(concurrency=4)
    consumer_ready(worker)
    rabbitmq_node.stop()
    run_ids: list[uuid.UUID] = []
    for n in range(20):
        run_ids.append(rl.trigger(work, n).id)  # commits though nothing can be published
        if n % 5 == 4:
            assert rl.status().outbox_pending == n + 1
    for run_id in run_ids:
        assert rl.get_run(run_id).status is RunStatus.QUEUED
    report = rl.status()
    assert report.outbox_pending == 20
    assert report.outbox_oldest_age_seconds is not None
    broker = RabbitMQStatus.of(report).broker
    assert broker is not None
    assert broker.startswith(f"unreachable at 127.0.0.1:{rabbitmq_node.port}")
    rabbitmq_node.start()
    # the failed publishes' back-off passes on the database's clock (moved, not waited)
    elapse(db, schema, 30, "outbox.available_at")
    _settle(rl, db, schema, run_ids, timeout=60)
    worker.close(timeout=10)
    _assert_once_each(executions, run_ids)
    assert rl.status().outbox_pending == 0


def test_triggers_during_an_outage_wait_out_the_back_off_without_trying_the_broker_each(
    rabbit_runtime: RabbitRuntimes, db: Conn, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Once a publish found the broker gone, the eager items of later triggers wait with
    it until the back-off has passed (released at once, due at the next try) rather than
    each trying a connection (it was two a trigger): an outage under a steady trigger rate
    cost the publisher a connection attempt and a write per trigger, and maintenance's
    publish request, queued behind them, timed out under load."""
    caplog.set_level(logging.WARNING, logger="runlane.rabbitmq.publisher")
    executions = Executions()
    work = executions.task("faults.work", retry=QUICK_RETRY)
    rl = rabbit_runtime(
        amqp_url=f"amqp://guest:guest@127.0.0.1:{closed_port()}/%2F",
        tasks=[work],
        publish_timeout=timedelta(seconds=1),
    )
    run_ids = [rl.trigger(work, n).id for n in range(40)]

    def released() -> int:
        row = db.execute(
            q(
                "select count(*) from {s}.outbox where claim_token is null and failures >= 1 "
                "and last_error like '%%unreachable%%'",
                schema,
            )
        ).fetchone()
        return 0 if row is None else int(row[0])

    wait_until(lambda: released() == 40, timeout=30, what="every item released", state=released)
    tries = [r for r in caplog.records if "unreachable" in r.getMessage()]
    # a try (and its one fresh retry) a back-off of 0.5 s doubling: a few, not 80
    assert 1 <= len(tries) <= 20, len(tries)
    report = rl.status()
    assert report.outbox_pending == 40
    assert rl.run_maintenance_once().outbox_published == 0  # answers: nothing to publish
    assert {r for r in run_ids if rl.get_run(r).status is RunStatus.QUEUED} == set(run_ids)
    assert not executions.runs


# -- 9. a purged queue --------------------------------------------------------------------------


def test_a_purged_queue_is_recovered_by_maintenance(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    executions = Executions()
    work = executions.task("faults.work", retry=QUICK_RETRY)
    rl = rabbit_runtime(
        amqp_url=rabbitmq_url, tasks=[work], recovery_threshold=timedelta(seconds=1)
    )
    name = amqp_queue(schema)
    run_ids = [h.id for h in rl.trigger_many(work, list(range(5)))]
    wait_until(lambda: outbox_count(db, schema) == 0, timeout=10, what="the runs published")
    assert ready_messages(rabbitmq_url, name) == 5
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        assert conn.channel().queue_purge(name).method.message_count == 5
    finally:
        conn.close()
    worker = rl.create_delivery_worker(concurrency=2)
    consumer_ready(worker)
    # nothing can arrive: the messages are gone and no outbox item is left
    wait_until(
        lambda: bool(
            db.execute(
                q(
                    "select bool_and(updated_at < now() - interval '1 second') from {s}.runs",
                    schema,
                )
            ).fetchone()
            == (True,)
        ),
        timeout=10,
        what="the runs to be queued past the recovery threshold",
    )
    stats = consumer_stats(worker)
    assert stats.claimed == 0
    assert all(rl.get_run(r).status is RunStatus.QUEUED for r in run_ids)
    result = rl.run_maintenance_once()
    assert result.deliveries_recovered == 5
    for run_id in run_ids:
        assert rl.wait_for_run(run_id, timeout=10).status is RunStatus.COMPLETED
    _settle(rl, db, schema, run_ids, timeout=10, maintenance=False)
    worker.close(timeout=10)
    _assert_once_each(executions, run_ids)
    assert rl.run_maintenance_once().deliveries_recovered == 0
