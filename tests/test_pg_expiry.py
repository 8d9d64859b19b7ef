"""Attempt expiry uses the same retry arithmetic as a raised exception (next_retry_delay),
and its write re-checks each lease: an attempt extended, completed or re-leased between the
listing and the write is left alone."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runlane import MaintenanceLimits, RetryPolicy, RunContext, Runlane, RunStatus, task
from runlane.postgres import PostgresStorage
from runlane.retry import next_retry_delay
from runlane.storage import ClaimedRun, Completion, Expiration, ExpiredAttempt, NewRuns, Storage
from tests.conftest import RunlaneFactory
from tests.helpers import SchemaDb, storage_of

ENV = "default"
LEASE = timedelta(seconds=60)
ERROR = json.dumps({"type": "X", "message": "x", "traceback": None, "retryable": True})
CAPPED = RetryPolicy(
    max_attempts=3,
    initial_delay=timedelta(seconds=10),
    multiplier=2,
    max_delay=timedelta(seconds=15),
    jitter=0,
)


@task(id="capped", retry=CAPPED)
def capped(payload: Any, context: RunContext) -> None:
    return None


@pytest.fixture
def rl(make_runlane: RunlaneFactory) -> Runlane:
    return make_runlane(tasks=[capped])


@pytest.fixture
def dbx(db: Any, schema: str) -> SchemaDb:
    return SchemaDb(db, schema)


def lapse(dbx: SchemaDb, run_id: uuid.UUID) -> None:
    dbx.run(
        "update {schema}.runs set lease_expires_at = now() - interval '1 second' where id = %s",
        run_id,
    )


def claim(storage: Storage, queue: str = "default") -> ClaimedRun:
    (claimed,) = storage.run_claim(ENV, [queue], 1, LEASE)
    return claimed


EXPIRY_ONLY = MaintenanceLimits(
    schedule_limit=0,
    due_delivery_limit=0,
    wait_token_timeout_limit=0,
    wait_token_resume_limit=0,
    delivery_recovery_limit=0,
    cleanup_limit=0,
)


def test_expired_attempts_back_off_exactly_as_next_retry_delay_says(
    rl: Runlane, dbx: SchemaDb
) -> None:
    handle = rl.trigger(capped, None)
    storage = storage_of(rl)
    for attempt in (1, 2):
        claimed = claim(storage)
        assert (claimed.attempt, claimed.attempts_consumed) == (attempt, attempt)
        lapse(dbx, handle.id)
        result = rl.run_maintenance_once(EXPIRY_ONLY)
        assert result.attempts_expired == 1
        # due_at and updated_at were both written by the expiry, at one database now()
        status, waited = dbx.one(
            "select status, due_at - updated_at from {schema}.runs where id = %s", handle.id
        )
        assert status == "retrying"
        assert waited == next_retry_delay(CAPPED, attempt, 3)
        assert waited == (timedelta(seconds=10) if attempt == 1 else timedelta(seconds=15))
        dbx.run("update {schema}.runs set due_at = now() where id = %s", handle.id)
        assert storage.run_deliver_due(ENV, 10) == 1
    # the third attempt is the last one: its expiry fails the run
    claim(storage)
    lapse(dbx, handle.id)
    assert rl.run_maintenance_once(EXPIRY_ONLY).attempts_expired == 1
    snapshot = rl.get_run(handle.id)
    assert snapshot.status is RunStatus.FAILED
    assert snapshot.error is not None
    assert snapshot.error.type == "runlane.LeaseExpired"
    assert "attempt 3 lost its lease" in snapshot.error.message
    outcomes = dbx.all(
        "select attempt, outcome, error->>'type' from {schema}.attempts where run_id = %s "
        "order by attempt",
        handle.id,
    )
    assert outcomes == [(n, "expired", "runlane.LeaseExpired") for n in (1, 2, 3)]


def test_an_unknown_task_expires_with_the_default_policy(rl: Runlane, dbx: SchemaDb) -> None:
    storage = storage_of(rl)
    run_id = uuid.uuid4()
    storage.run_insert_many(
        NewRuns(ENV, "gone", "default", [run_id], ["null"], [None], 0, 1, timedelta(0), None)
    )
    claim(storage)
    lapse(dbx, run_id)
    assert rl.run_maintenance_once(EXPIRY_ONLY).attempts_expired == 1
    assert rl.get_run(run_id).status is RunStatus.FAILED  # max_attempts=1: spent


def test_a_lapsed_cancellation_ends_cancelled(rl: Runlane, dbx: SchemaDb) -> None:
    handle = rl.trigger(capped, None)
    claim(storage_of(rl))
    rl.cancel(handle.id)
    lapse(dbx, handle.id)
    result = rl.run_maintenance_once(EXPIRY_ONLY)
    assert (result.attempts_expired, result.cancellations_finalized) == (0, 1)
    assert rl.get_run(handle.id).status is RunStatus.CANCELLED


# -- the write re-checks the lease ------------------------------------------------------------


@pytest.fixture
def storage(database_url: str, schema: str) -> Iterator[PostgresStorage]:
    store = PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=3)
    store.open()
    yield store
    store.close()


def expirations(listed: list[ExpiredAttempt]) -> list[Expiration]:
    return [
        Expiration(
            a.run_id,
            a.attempt,
            a.lease_token,
            ERROR,
            next_retry_delay(CAPPED, a.attempts_consumed, a.max_attempts),
        )
        for a in listed
    ]


def new_runs(count: int) -> NewRuns:
    ids = [uuid.uuid4() for _ in range(count)]
    return NewRuns(
        ENV, "capped", "default", ids, ["null"] * count, [None] * count, 0, 3, timedelta(0), None
    )


# what happens to a listed attempt between the listing and the expiry write
MEANWHILE = ["nothing", "extended", "completed", "expired_and_re_leased"]


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(fates=st.lists(st.sampled_from(MEANWHILE), min_size=1, max_size=5))
def test_only_attempts_still_lapsed_under_the_listed_lease_are_expired(
    storage: PostgresStorage, dbx: SchemaDb, fates: list[str]
) -> None:
    dbx.run("truncate {schema}.attempts, {schema}.runs cascade")
    batch = new_runs(len(fates))
    storage.run_insert_many(batch)
    claimed = {c.id: c for c in storage.run_claim(ENV, ["default"], len(fates), LEASE)}
    for run_id in batch.ids:
        lapse(dbx, run_id)
    listed = storage.run_list_expired(ENV, 10)
    assert {a.run_id for a in listed} == set(batch.ids)
    for run_id, fate in zip(batch.ids, fates, strict=True):
        c = claimed[run_id]
        if fate == "extended":  # an extension that made it in (a live lease again)
            dbx.run(
                "update {schema}.runs set lease_expires_at = now() + interval '1 minute' "
                "where id = %s",
                run_id,
            )
        elif fate == "completed":
            storage.run_complete_many([Completion(c.id, c.attempt, c.lease_token, "1")])
        elif fate == "expired_and_re_leased":
            # another replica expired it, it was delivered and claimed again, and lapsed again
            assert (
                len(storage.run_expire_many(expirations([a for a in listed if a.run_id == run_id])))
                == 1
            )
            dbx.run("update {schema}.runs set due_at = now() where id = %s", run_id)
            storage.run_deliver_due(ENV, 10)
            storage.run_claim(ENV, ["default"], 1, LEASE)
            lapse(dbx, run_id)
    applied = storage.run_expire_many(expirations(listed))
    expected = {run_id for run_id, fate in zip(batch.ids, fates, strict=True) if fate == "nothing"}
    assert {a.run_id for a in applied} == expected
    assert all(a.status is RunStatus.RETRYING for a in applied)
    for run_id, fate in zip(batch.ids, fates, strict=True):
        status, attempt = dbx.one("select status, attempt from {schema}.runs where id = %s", run_id)
        assert (status, attempt) == {
            "nothing": ("retrying", 1),
            "extended": ("running", 1),
            "completed": ("completed", 1),
            "expired_and_re_leased": ("running", 2),
        }[fate]
    # one history row per finished attempt, never two
    rows = dbx.all("select run_id, attempt, count(*) from {schema}.attempts group by 1, 2")
    assert all(n == 1 for _, _, n in rows)


def race_once(storage: PostgresStorage, other: PostgresStorage, dbx: SchemaDb) -> None:
    dbx.run("truncate {schema}.attempts, {schema}.runs cascade")
    storage.run_insert_many(new_runs(1))
    c = claim(storage)
    lapse(dbx, c.id)
    listed = storage.run_list_expired(ENV, 10)
    barrier = threading.Barrier(2)
    results: dict[str, Any] = {}

    def complete() -> None:
        barrier.wait(5)
        done = Completion(c.id, c.attempt, c.lease_token, "1")
        results["completed"] = other.run_complete_many([done])

    def expire() -> None:
        barrier.wait(5)
        results["expired"] = storage.run_expire_many(expirations(listed))

    threads = [threading.Thread(target=complete), threading.Thread(target=expire)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results["completed"]) + len(results["expired"]) == 1
    (outcome,) = dbx.all("select outcome from {schema}.attempts where run_id = %s", c.id)
    assert outcome == (("completed",) if results["completed"] else ("expired",))


def test_a_completion_racing_the_expiry_write_wins_or_loses_whole(
    storage: PostgresStorage, database_url: str, schema: str, dbx: SchemaDb
) -> None:
    """Real threads on separate connections: a completion and an expiry of the same lapsed
    attempt. Exactly one applies, and the history records that one."""
    other = PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=1)
    other.open()
    try:
        for _ in range(10):
            race_once(storage, other, dbx)
    finally:
        other.close()
