"""Announcing at one point (the runs triggers of migration 2), and "a run ended: resume its
waiters" at one point, checked on the storage with a real LISTEN connection.

Payloads on the schema's channel: ``env|<queue>`` (runs became queued and due),
``env|free|<queue>`` (attempts stopped holding a lease), ``env|cancel|<run id>`` (a running
run's cancellation was requested). NOTIFY is delivered at commit only.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from runlane import RunContext, Runlane, RunStatus, task
from runlane.maintenance import LaneMaintenance, MaintenanceLimits
from runlane.postgres import PostgresStorage, notify_channel, postgres_polling_lane
from runlane.retry import RetryPolicy, next_retry_delay
from runlane.storage import ClaimedRun, Completion, Expiration, Failure, LeaseRef, NewRuns
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb

ENV = "env"
LEASE = timedelta(seconds=60)
ERROR = json.dumps({"type": "Boom", "message": "boom", "traceback": None, "retryable": True})


@pytest.fixture
def storage(database_url: str, schema: str) -> Iterator[PostgresStorage]:
    store = PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=2)
    store.open()
    yield store
    store.close()


@attrs.frozen
class Listener:
    """A connection listening on the schema's channel."""

    conn: Conn
    channel: str


@pytest.fixture
def listener(database_url: str, schema: str) -> Iterator[Listener]:
    channel = notify_channel(schema)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("listen {}").format(sql.Identifier(channel)))
        yield Listener(conn, channel)


@pytest.fixture
def dbx(db: Conn, schema: str) -> SchemaDb:
    return SchemaDb(db, schema)


def heard(listener: Listener) -> list[str]:
    """Every payload announced by what committed before this call, in order: the listener
    sends a marker on the channel and reads until it (Postgres queues notifications at
    commit, in commit order, and delivers a session its own), rather than waiting out a
    silence that a slow delivery could outlast."""
    marker = f"marker|{uuid.uuid4()}"
    listener.conn.execute("select pg_notify(%s, %s)", (listener.channel, marker))
    payloads: list[str] = []
    for note in listener.conn.notifies(timeout=30):
        if note.payload == marker:
            return payloads
        payloads.append(note.payload)
    raise AssertionError(f"the marker was not delivered within 30 s; before it: {payloads}")


def insert(
    storage: PostgresStorage,
    queue: str = "q",
    *,
    count: int = 1,
    delay: timedelta = timedelta(0),
    max_attempts: int = 3,
) -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in range(count)]
    storage.run_insert_many(
        NewRuns(
            environment=ENV,
            task_id="t",
            queue=queue,
            ids=ids,
            payloads=["null"] * count,
            idempotency_keys=[None] * count,
            priority=0,
            max_attempts=max_attempts,
            delay=delay,
            run_at=None,
        )
    )
    return ids


def claim(storage: PostgresStorage, queue: str = "q") -> ClaimedRun:
    (claimed,) = storage.run_claim(ENV, [queue], 1, LEASE)
    return claimed


def lapse(dbx: SchemaDb, run_id: uuid.UUID) -> None:
    dbx.run(
        "update {schema}.runs set lease_expires_at = now() - interval '1 second' where id = %s",
        run_id,
    )


def expire_all(storage: PostgresStorage, policy: RetryPolicy | None) -> list[Any]:
    return storage.run_expire_many(
        [
            Expiration(
                a.run_id,
                a.attempt,
                a.lease_token,
                ERROR,
                next_retry_delay(policy, a.attempts_consumed, a.max_attempts),
            )
            for a in storage.run_list_expired(ENV, 10)
        ]
    )


# -- what is announced ------------------------------------------------------------------------


def test_a_due_insert_is_announced_once_per_queue(
    storage: PostgresStorage, listener: Listener
) -> None:
    insert(storage, "q", count=3)
    insert(storage, "other")
    assert sorted(heard(listener)) == ["env|other", "env|q"]


def test_a_run_due_within_an_idle_workers_poll_spacing_is_announced_at_once(
    storage: PostgresStorage, listener: Listener
) -> None:
    # schema version 27: a worker whose polls are spaced out (10 s at most) would find it
    # late; one due later is learnt at its next spaced-out poll, before it is due
    insert(storage, "soon", delay=timedelta(seconds=5))
    insert(storage, "later", delay=timedelta(seconds=30))  # (15 s: the spacing and its jitter)
    assert heard(listener) == ["env|soon"]


def test_a_run_moved_to_now_is_announced(storage: PostgresStorage, listener: Listener) -> None:
    # schema version 28: "run now" of a queued delayed run (an idle worker remembered its
    # old due time); a move to later is not
    (run_id,) = insert(storage, "q", delay=timedelta(hours=1))
    assert storage.run_reschedule(ENV, run_id, None) is not None
    assert heard(listener) == ["env|q"]
    later = storage.database_now() + timedelta(hours=2)
    assert storage.run_reschedule(ENV, run_id, later) is not None
    assert heard(listener) == []


def test_a_delayed_insert_is_announced_when_recovery_finds_it_due(
    storage: PostgresStorage, listener: Listener, dbx: SchemaDb, database_url: str, schema: str
) -> None:
    (run_id,) = insert(storage, "q", delay=timedelta(hours=1))
    lane = postgres_polling_lane(connection_string=database_url, schema=schema)
    limits = MaintenanceLimits(delivery_recovery_limit=10)
    assert lane.recover_delivery(storage, ENV, limits, None) == LaneMaintenance()
    assert heard(listener) == []
    # time passes (by hand: a queued run's due time moving is not itself announced)
    dbx.run("update {schema}.runs set due_at = now() - interval '1 second' where id = %s", run_id)
    assert heard(listener) == []
    assert lane.recover_delivery(storage, ENV, limits, None) == LaneMaintenance(queues_woken=1)
    assert heard(listener) == ["env|q"]


def test_claims_and_lease_extensions_announce_nothing(
    storage: PostgresStorage, listener: Listener
) -> None:
    insert(storage, count=2)
    assert heard(listener) == ["env|q"]
    claimed = storage.run_claim(ENV, ["q"], 2, LEASE)
    refs = [LeaseRef(c.id, c.attempt, c.lease_token) for c in claimed]
    assert len(storage.run_extend_leases(refs, LEASE)) == 2
    assert heard(listener) == []


@pytest.mark.parametrize("how", ["complete", "fail_retry", "fail_final", "release", "expire"])
def test_an_attempt_that_stops_holding_its_lease_frees_its_queue(
    storage: PostgresStorage, listener: Listener, dbx: SchemaDb, how: str
) -> None:
    insert(storage)
    claimed = claim(storage)
    heard(listener)
    ref = LeaseRef(claimed.id, claimed.attempt, claimed.lease_token)
    if how == "complete":
        storage.run_complete_many([Completion(*attrs_of(ref), "1")])
    elif how in ("fail_retry", "fail_final"):
        delay = timedelta(hours=1) if how == "fail_retry" else None
        storage.run_fail_many([Failure(*attrs_of(ref), ERROR, delay)])
    elif how == "release":
        storage.run_release_many(ENV, [ref])
    else:
        lapse(dbx, claimed.id)
        assert len(expire_all(storage, RetryPolicy(initial_delay=timedelta(minutes=5)))) == 1
    expected = ["env|free|q"]
    if how == "release":
        expected.append("env|q")  # handed back: queued and due again at once
    assert sorted(heard(listener)) == sorted(expected)


def attrs_of(ref: LeaseRef) -> tuple[uuid.UUID, int, uuid.UUID]:
    return ref.run_id, ref.attempt, ref.lease_token


def test_cancelling_a_running_run_announces_its_id(
    storage: PostgresStorage, listener: Listener
) -> None:
    insert(storage)
    (queued,) = insert(storage)
    claimed = claim(storage)
    heard(listener)
    assert storage.run_cancel(ENV, claimed.id) == (
        RunStatus.RUNNING,
        RunStatus.CANCELLATION_REQUESTED,
    )
    assert heard(listener) == [f"env|cancel|{claimed.id}"]
    # a queued run is cancelled at once: no worker holds it, nothing to tell
    assert storage.run_cancel(ENV, queued) == (RunStatus.QUEUED, RunStatus.CANCELLED)
    assert heard(listener) == []


def test_due_deliveries_and_retried_runs_are_announced(
    storage: PostgresStorage, listener: Listener, dbx: SchemaDb
) -> None:
    insert(storage)
    claimed = claim(storage)
    storage.run_fail_many([Failure(claimed.id, claimed.attempt, claimed.lease_token, ERROR, None)])
    heard(listener)
    dbx.run("update {schema}.runs set status = 'queued', finished_at = null where true")
    assert heard(listener) == ["env|q"]  # a failed run queued again (retry_run)
    insert(storage, "later", delay=timedelta(hours=1))
    (r2,) = storage.run_claim(ENV, ["q"], 1, LEASE)
    storage.run_fail_many([Failure(r2.id, r2.attempt, r2.lease_token, ERROR, timedelta(0))])
    assert sorted(heard(listener)) == ["env|free|q"]  # retrying, not queued yet
    assert storage.run_deliver_due(ENV, 10) == 1
    assert heard(listener) == ["env|q"]


@pytest.fixture
def rl(make_runlane: RunlaneFactory) -> Runlane:
    return make_runlane(tasks=[noop], environment=ENV)


@task(id="noop", queue="default")
def noop(payload: Any, context: RunContext) -> None:
    return None


def test_trigger_with_a_connection_announces_at_commit_only(
    rl: Runlane, listener: Listener, database_url: str, dbx: SchemaDb
) -> None:
    rl.start()
    with psycopg.connect(database_url) as own:
        rl.trigger(noop, None, connection=own)
        assert heard(listener) == []  # not committed yet
        own.rollback()
    assert heard(listener) == []
    assert dbx.one("select count(*) from {schema}.runs") == (0,)
    with psycopg.connect(database_url) as own:
        handle = rl.trigger(noop, None, connection=own)
        assert heard(listener) == []
        own.commit()
    assert heard(listener) == ["env|default"]
    assert rl.get_run(handle.id).status is RunStatus.QUEUED


# -- a run ended: its waiters resume, each once -----------------------------------------------


ENDINGS = ["complete", "fail_for_good", "cancel_running", "cancel_queued", "expire_for_good"]


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_parent_waiting_on_a_child_resumes_once_when_it_ends(
    storage: PostgresStorage, listener: Listener, dbx: SchemaDb, ending: str
) -> None:
    (parent_id,) = insert(storage, "parents")
    parent = claim(storage, "parents")
    (child_id,) = insert(storage, "children", max_attempts=1)
    lease = LeaseRef(parent.id, parent.attempt, parent.lease_token)
    suspended = storage.run_suspend(lease, ENV, run_id=child_id)
    assert (suspended.target_open, suspended.suspended) == (True, True)
    if ending != "cancel_queued":
        child = claim(storage, "children")
        child_ref = (child.id, child.attempt, child.lease_token)
    heard(listener)

    if ending == "complete":
        storage.run_complete_many([Completion(*child_ref, "1")])
        child_status = "completed"
    elif ending == "fail_for_good":
        storage.run_fail_many([Failure(*child_ref, ERROR, None)])
        child_status = "failed"
    elif ending == "cancel_running":
        storage.run_cancel(ENV, child_id)
        assert dbx.one("select status from {schema}.runs where id = %s", parent_id) == (
            "waiting",
        ), "a cancellation only requested has not ended the child"
        heard(listener)
        # its handler stops as asked (raises): the attempt's end makes the run cancelled
        storage.run_fail_many([Failure(*child_ref, ERROR, None)])
        child_status = "cancelled"
    elif ending == "cancel_queued":
        storage.run_cancel(ENV, child_id)
        child_status = "cancelled"
    else:
        lapse(dbx, child_id)
        # one attempt allowed: the expiry ends it for good
        assert len(expire_all(storage, RetryPolicy())) == 1
        child_status = "failed"

    assert dbx.one("select status from {schema}.runs where id = %s", child_id) == (child_status,)
    row = dbx.one(
        "select status, wait_kind, wait_run_id, due_at <= now() from {schema}.runs where id = %s",
        parent_id,
    )
    assert row == ("queued", None, None, True)
    payloads = heard(listener)
    assert "env|parents" in payloads  # the parent's becoming queued is announced
    # exactly once: nothing is left to resume, and the parent's own history is untouched
    assert storage.run_resume_waiters(ENV, 10) == 0
    assert dbx.all(
        "select attempt, outcome from {schema}.attempts where run_id = %s", parent_id
    ) == [(1, "suspended")]
    again = claim(storage, "parents")
    assert (again.id, again.attempt, again.attempts_consumed) == (parent_id, 2, 1)


def test_a_child_that_retries_does_not_resume_its_parent(
    storage: PostgresStorage, listener: Listener, dbx: SchemaDb
) -> None:
    (parent_id,) = insert(storage, "parents")
    parent = claim(storage, "parents")
    (child_id,) = insert(storage, "children")
    storage.run_suspend(
        LeaseRef(parent.id, parent.attempt, parent.lease_token), ENV, run_id=child_id
    )
    child = claim(storage, "children")
    storage.run_fail_many(
        [Failure(child.id, child.attempt, child.lease_token, ERROR, timedelta(0))]
    )
    assert dbx.one("select status from {schema}.runs where id = %s", parent_id) == ("waiting",)


def test_many_parents_of_many_children_resume_in_one_statement(
    storage: PostgresStorage, listener: Listener, dbx: SchemaDb
) -> None:
    parents = insert(storage, "parents", count=5)
    children = insert(storage, "children", count=5)
    claimed_parents = storage.run_claim(ENV, ["parents"], 5, LEASE)
    for parent, child_id in zip(claimed_parents, children, strict=True):
        lease = LeaseRef(parent.id, parent.attempt, parent.lease_token)
        assert storage.run_suspend(lease, ENV, run_id=child_id).suspended
    claimed_children = storage.run_claim(ENV, ["children"], 5, LEASE)
    heard(listener)
    done = storage.run_complete_many(
        [Completion(c.id, c.attempt, c.lease_token, "1") for c in claimed_children]
    )
    assert done == set(children)
    rows = dbx.all("select status from {schema}.runs where id = any(%s)", parents)
    assert rows == [("queued",)] * 5
    assert sorted(heard(listener)) == ["env|free|children", "env|parents"]
