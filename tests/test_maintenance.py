"""One bounded maintenance pass, phase by phase, through the public API, as the seed's
"check the deployment" list asks: a due schedule, a due retry and release, token timeout and
completion, an expired lease and a cancellation, delivery recovery, and cleanup with
tombstones; the status view for each signal; limits; and the command line."""

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

from runlane import (
    ConfigurationError,
    MaintenanceLimits,
    MaintenancePhase,
    MaintenanceResult,
    NonRetryableError,
    RetentionPolicy,
    RetryPolicy,
    RunContext,
    Runlane,
    RunNotFound,
    RunStatus,
    StatusReport,
    WaitTokenStatus,
    WaitTokenTimedOut,
    schedule,
    task,
)
from runlane.cli import main
from runlane.storage import ClaimedRun, Completion, Failure, LeaseRef
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb, storage_of

# Set by the CLI tests: ``runlane status tests.test_maintenance:CLI_APP``.
CLI_APP: Runlane | None = None

NO_BACKOFF = RetryPolicy(
    max_attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0), jitter=0.0
)


@task(id="ok")
def ok(payload: Any, context: RunContext) -> dict[str, Any]:
    return {"ok": True, "attempt": context.attempt}


@task(id="flaky", retry=NO_BACKOFF)
def flaky(payload: Any, context: RunContext) -> None:
    raise RuntimeError("boom")


@task(
    id="slow-retry",
    retry=RetryPolicy(
        max_attempts=3, initial_delay=timedelta(hours=1), max_delay=timedelta(hours=1), jitter=0.0
    ),
)
def slow_retry(payload: Any, context: RunContext) -> None:
    raise RuntimeError("boom")


@task(id="once", retry=RetryPolicy(max_attempts=1))
def once(payload: Any, context: RunContext) -> None:
    return None


@task(id="fatal")
def fatal(payload: Any, context: RunContext) -> None:
    raise NonRetryableError("no")


@task(id="releaser")
def releaser(payload: Any, context: RunContext) -> str:
    if context.attempt == 1:
        context.release(delay=0)
    return "done"


@task(id="sleeper")
def sleeper(payload: Any, context: RunContext) -> str:
    context.sleep(timedelta(hours=1))
    return "woke"


@attrs.frozen
class TokenRef:
    token: str


@task(id="waiter", schema=TokenRef)
def waiter(payload: TokenRef, context: RunContext) -> dict[str, Any]:
    try:
        return {"got": context.wait_for_token(payload.token)}
    except WaitTokenTimedOut:
        return {"timed_out": True}


ALL_TASKS = [ok, flaky, slow_retry, once, fatal, releaser, sleeper, waiter]


class Db(SchemaDb):
    """Set-up and assertions on the test's schema through a separate connection."""

    def expire_lease(self, run_id: uuid.UUID) -> None:
        changed = self.run(
            "update {schema}.runs set lease_expires_at = now() - interval '1 second' "
            "where id = %s and status in ('running', 'cancellation_requested')",
            run_id,
        )
        assert changed == 1

    def age(self, run_id: uuid.UUID, by: timedelta) -> None:
        """Pretend the run finished ``by`` ago."""
        assert self.run(
            "update {schema}.runs set finished_at = finished_at - %s where id = %s", by, run_id
        )

    def exists(self, run_id: uuid.UUID) -> bool:
        return bool(self.all("select 1 from {schema}.runs where id = %s", run_id))

    def attempts(self, run_id: uuid.UUID) -> list[tuple[Any, ...]]:
        return self.all(
            "select attempt, lease_token, outcome, error->>'type' from {schema}.attempts "
            "where run_id = %s order by attempt",
            run_id,
        )


@pytest.fixture
def dbx(db: Conn, schema: str) -> Db:
    return Db(db, schema)


@pytest.fixture
def rl(make_runlane: RunlaneFactory) -> Runlane:
    runtime = make_runlane(tasks=ALL_TASKS)
    runtime.start()
    return runtime


def claim(
    rl: Runlane, count: int = 1, lease: timedelta = timedelta(seconds=30)
) -> list[ClaimedRun]:
    claimed = storage_of(rl).run_claim(rl.environment, ["default"], count, lease)
    assert len(claimed) == count
    return claimed


def only(result: MaintenanceResult, **expected: int) -> None:
    """The pass changed exactly what ``expected`` names and nothing else. ``queues_woken``
    is a wake-up hint, not a change (a queue whose runs came due within the last minute is
    woken by every pass), so it is compared only when named."""
    got = result.counts()
    if "queues_woken" not in expected:
        got.pop("queues_woken")
    want = {**MaintenanceResult().counts(), **expected}
    if "queues_woken" not in expected:
        want.pop("queues_woken")
    assert got == want


# -- SCHEDULES --------------------------------------------------------------------------------


def test_due_schedule_creates_its_run(make_runlane: RunlaneFactory, dbx: Db) -> None:
    runtime = make_runlane(
        tasks=[ok], schedules=[schedule(id="minutely", task=ok, cron="* * * * *")]
    )
    only(runtime.run_maintenance_once())  # first sighting: waits for the next slot
    dbx.run("update {schema}.schedules set next_slot_at = next_slot_at - interval '2 minutes'")
    only(runtime.run_maintenance_once(), schedules_created=1)
    assert runtime.drain().runs_executed == 1
    (status,) = dbx.one("select status from {schema}.runs where task_id = 'ok'")
    assert status == "completed"


def test_a_schedule_that_never_fires_does_not_stop_maintenance(
    make_runlane: RunlaneFactory,
) -> None:
    try:
        never = schedule(id="never", task=ok, cron="0 0 31 2 *")
    except ConfigurationError:
        return  # rejected at definition time: fixed
    runtime = make_runlane(tasks=[ok, flaky], schedules=[never])
    handle = runtime.trigger(flaky, None)
    runtime.drain()
    assert runtime.get_run(handle.id).status is RunStatus.RETRYING
    result = runtime.run_maintenance_once()
    assert result.due_runs_delivered == 1


# -- DUE_DELIVERY -----------------------------------------------------------------------------


def test_due_retry_is_delivered(rl: Runlane) -> None:
    handle = rl.trigger(flaky, None)
    later = rl.trigger(slow_retry, None)
    assert rl.drain().runs_executed == 2
    assert rl.get_run(handle.id).status is RunStatus.RETRYING
    assert rl.get_run(later.id).status is RunStatus.RETRYING
    report = rl.status()
    assert report.deferred_past_due == 1  # the slow retry is not due for an hour
    assert report.oldest_deferred_due_at is not None
    only(rl.run_maintenance_once(), due_runs_delivered=1)
    assert rl.get_run(handle.id).status is RunStatus.QUEUED
    assert rl.get_run(later.id).status is RunStatus.RETRYING
    report = rl.status()
    assert (report.deferred_past_due, report.oldest_deferred_due_at) == (0, None)
    assert report.queued_due == 1
    # the delivered run is executed again as its second attempt
    assert rl.drain().runs_executed == 1
    snap = rl.get_run(handle.id)
    assert (snap.status, snap.attempt) == (RunStatus.RETRYING, 2)


def test_due_release_is_delivered(rl: Runlane) -> None:
    handle = rl.trigger(releaser, None)
    assert rl.drain().runs_executed == 1
    assert rl.get_run(handle.id).status is RunStatus.RELEASED
    assert rl.status().deferred_past_due == 1
    only(rl.run_maintenance_once(), due_runs_delivered=1)
    assert rl.get_run(handle.id).status is RunStatus.QUEUED
    assert rl.drain().runs_executed == 1
    snap = rl.get_run(handle.id)
    assert (snap.status, snap.output, snap.attempt) == (RunStatus.COMPLETED, "done", 2)


def test_due_durable_sleep_is_delivered(rl: Runlane, dbx: Db) -> None:
    handle = rl.trigger(sleeper, None)
    rl.drain()
    assert rl.get_run(handle.id).status is RunStatus.WAITING
    only(rl.run_maintenance_once())  # not due for an hour
    dbx.run(
        "update {schema}.runs set due_at = now() - interval '1 second' where id = %s", handle.id
    )
    only(rl.run_maintenance_once(), due_runs_delivered=1)
    assert rl.get_run(handle.id).status is RunStatus.QUEUED


def test_due_delivery_limit(rl: Runlane) -> None:
    handles = [rl.trigger(flaky, None) for _ in range(3)]
    assert rl.drain().runs_executed == 3
    only(rl.run_maintenance_once(MaintenanceLimits(due_delivery_limit=1)), due_runs_delivered=1)
    assert rl.status().deferred_past_due == 2
    only(rl.run_maintenance_once(MaintenanceLimits(due_delivery_limit=0)))
    only(rl.run_maintenance_once(), due_runs_delivered=2)
    assert {rl.get_run(h.id).status for h in handles} == {RunStatus.QUEUED}


# -- WAIT_TOKEN_RESOLUTION --------------------------------------------------------------------


def test_token_timeout_resumes_its_waiting_run(rl: Runlane, dbx: Db) -> None:
    token = rl.create_wait_token(timeout=timedelta(hours=1))
    handle = rl.trigger(waiter, TokenRef(str(token.id)))
    rl.drain()
    assert rl.get_run(handle.id).status is RunStatus.WAITING
    only(rl.run_maintenance_once())
    dbx.run(
        "update {schema}.wait_tokens set timeout_at = now() - interval '1 second' where id = %s",
        token.id,
    )
    only(
        rl.run_maintenance_once(MaintenanceLimits(wait_token_timeout_limit=0))
    )  # zero skips the timeouts
    only(rl.run_maintenance_once(), wait_tokens_timed_out=1, wait_token_runs_resumed=1)
    assert rl.get_wait_token(token.id).status is WaitTokenStatus.TIMED_OUT
    assert rl.get_run(handle.id).status is RunStatus.QUEUED
    rl.drain()
    snap = rl.get_run(handle.id)
    assert (snap.status, snap.output) == (RunStatus.COMPLETED, {"timed_out": True})


def test_completed_token_whose_eager_resume_was_missed(rl: Runlane, dbx: Db) -> None:
    token = rl.create_wait_token()
    handle = rl.trigger(waiter, TokenRef(str(token.id)))
    rl.drain()
    assert rl.get_run(handle.id).status is RunStatus.WAITING
    # completed behind the runtime's back: no eager resume pass ran
    dbx.run(
        "update {schema}.wait_tokens set status = 'completed', output = '\"hi\"', "
        "resolved_at = now() where id = %s",
        token.id,
    )
    assert rl.get_run(handle.id).status is RunStatus.WAITING
    only(rl.run_maintenance_once(MaintenanceLimits(wait_token_resume_limit=0)))
    only(rl.run_maintenance_once(), wait_token_runs_resumed=1)
    rl.drain()
    snap = rl.get_run(handle.id)
    assert (snap.status, snap.output) == (RunStatus.COMPLETED, {"got": "hi"})


def test_status_reports_tokens_past_their_timeout(rl: Runlane, dbx: Db) -> None:
    token = rl.create_wait_token(timeout=timedelta(hours=1))
    dbx.run(
        "update {schema}.wait_tokens set timeout_at = now() - interval '1 second' where id = %s",
        token.id,
    )
    report = attrs.asdict(rl.status())
    token_signals = {k: v for k, v in report.items() if "token" in k}
    assert 1 in token_signals.values(), report


# -- ATTEMPT_EXPIRY ---------------------------------------------------------------------------


def test_expired_attempt_retries_per_policy(rl: Runlane, dbx: Db) -> None:
    handle = rl.trigger(ok, None)
    (claimed,) = claim(rl)
    assert rl.status().expired_leases == 0
    only(rl.run_maintenance_once())  # the lease is live: nothing to do
    dbx.expire_lease(handle.id)
    report = rl.status()
    assert (report.expired_leases, report.running) == (1, 1)
    only(rl.run_maintenance_once(), attempts_expired=1)
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.RETRYING
    assert snap.error is not None
    assert snap.error.type == "runlane.LeaseExpired"
    assert snap.error.retryable
    assert snap.finished_at is None
    # the default policy: about one second of backoff (± 20 % jitter)
    assert timedelta(seconds=0.75) <= snap.due_at - snap.updated_at <= timedelta(seconds=1.25)
    assert dbx.attempts(handle.id) == [(1, claimed.lease_token, "expired", "runlane.LeaseExpired")]
    assert rl.status().expired_leases == 0
    only(rl.run_maintenance_once(MaintenanceLimits(due_delivery_limit=0)))  # only once


def test_expiry_uses_the_tasks_retry_policy(rl: Runlane, dbx: Db) -> None:
    handle = rl.trigger(slow_retry, None)
    claim(rl)
    dbx.expire_lease(handle.id)
    only(rl.run_maintenance_once(), attempts_expired=1)
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.RETRYING
    wait = snap.due_at - snap.updated_at
    assert timedelta(minutes=59) < wait <= timedelta(hours=1)


def test_int_retry_policy_fields_do_not_break_attempt_expiry(
    make_runlane: RunlaneFactory, dbx: Db
) -> None:
    @task(id="int-policy", retry=RetryPolicy(multiplier=3, jitter=0))
    def int_policy(payload: Any, context: RunContext) -> None:
        return None

    runtime = make_runlane(tasks=[ok, int_policy])
    handle = runtime.trigger(ok, None)
    claim(runtime)
    dbx.expire_lease(handle.id)
    only(runtime.run_maintenance_once(), attempts_expired=1)


def test_expired_attempt_with_attempts_spent_fails(rl: Runlane, dbx: Db) -> None:
    handle = rl.trigger(once, None)
    claim(rl)
    dbx.expire_lease(handle.id)
    only(rl.run_maintenance_once(), attempts_expired=1)
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.FAILED
    assert snap.finished_at is not None
    assert snap.error is not None
    assert snap.error.type == "runlane.LeaseExpired"


def test_stale_attempt_cannot_write_after_expiry(rl: Runlane, dbx: Db) -> None:
    handle = rl.trigger(ok, None)
    (claimed,) = claim(rl)
    dbx.expire_lease(handle.id)
    only(rl.run_maintenance_once(), attempts_expired=1)
    before = dbx.all("select r::text from {schema}.runs r")
    old = LeaseRef(claimed.id, claimed.attempt, claimed.lease_token)
    storage = storage_of(rl)
    assert (
        storage.run_complete_many([Completion(old.run_id, old.attempt, old.lease_token, "1")])
        == set()
    )
    assert (
        storage.run_fail_many([Failure(old.run_id, old.attempt, old.lease_token, "{}", None)]) == []
    )
    assert storage.run_extend_leases([old], timedelta(seconds=30)) == {}
    assert storage.run_release_many(rl.environment, [old]) == set()
    assert not storage.step_store(old, "step", "1").fenced
    assert dbx.all("select r::text from {schema}.runs r") == before
    assert rl.get_run(handle.id).status is RunStatus.RETRYING


def test_cancellation_whose_attempt_is_gone_becomes_cancelled(rl: Runlane, dbx: Db) -> None:
    handle = rl.trigger(ok, None)
    (claimed,) = claim(rl)
    cancelled = rl.cancel(handle.id)
    assert (cancelled.previous, cancelled.status) == (
        RunStatus.RUNNING,
        RunStatus.CANCELLATION_REQUESTED,
    )
    report = rl.status()
    assert (report.stuck_cancellations, report.expired_leases) == (0, 0)  # still live
    only(rl.run_maintenance_once())
    dbx.expire_lease(handle.id)
    report = rl.status()
    assert (report.stuck_cancellations, report.expired_leases) == (1, 1)
    only(rl.run_maintenance_once(), cancellations_finalized=1)
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.CANCELLED
    assert snap.finished_at is not None
    assert dbx.attempts(handle.id) == [(1, claimed.lease_token, "expired", None)]
    report = rl.status()
    assert (report.stuck_cancellations, report.expired_leases) == (0, 0)
    # the stale attempt cannot complete it afterwards
    done = Completion(claimed.id, claimed.attempt, claimed.lease_token, "1")
    assert storage_of(rl).run_complete_many([done]) == set()
    assert rl.get_run(handle.id).status is RunStatus.CANCELLED


def test_run_completed_in_between_is_never_overwritten(rl: Runlane, dbx: Db) -> None:
    handle = rl.trigger(ok, None)
    (claimed,) = claim(rl)
    dbx.expire_lease(handle.id)
    assert rl.status().expired_leases == 1
    # the slow worker finishes before maintenance gets to it: its lease lapsed but was not
    # finalized, so its completion is still accepted
    done = Completion(claimed.id, claimed.attempt, claimed.lease_token, json.dumps("late"))
    assert storage_of(rl).run_complete_many([done]) == {handle.id}
    only(rl.run_maintenance_once())
    snap = rl.get_run(handle.id)
    assert (snap.status, snap.output, snap.error) == (RunStatus.COMPLETED, "late", None)
    assert dbx.attempts(handle.id) == [(1, claimed.lease_token, "completed", None)]


def test_expired_run_locked_by_an_inflight_write_is_skipped(
    rl: Runlane, dbx: Db, database_url: str
) -> None:
    """A completion holding the run's row lock when maintenance looks: maintenance skips
    the row instead of waiting and overwriting it afterwards."""
    handle = rl.trigger(ok, None)
    (claimed,) = claim(rl)
    dbx.expire_lease(handle.id)
    with psycopg.connect(database_url) as writer:
        writer.execute(dbx.q("select 1 from {schema}.runs where id = %s for update"), (handle.id,))
        only(rl.run_maintenance_once())  # skipped, not blocked
        writer.rollback()
    done = Completion(claimed.id, claimed.attempt, claimed.lease_token, json.dumps("x"))
    assert storage_of(rl).run_complete_many([done]) == {handle.id}
    only(rl.run_maintenance_once())
    assert rl.get_run(handle.id).status is RunStatus.COMPLETED


def test_attempt_expiry_limit(rl: Runlane, dbx: Db) -> None:
    handles = [rl.trigger(ok, None) for _ in range(3)]
    claim(rl, 3)
    for handle in handles:
        dbx.expire_lease(handle.id)
    only(rl.run_maintenance_once(MaintenanceLimits(attempt_expiry_limit=1)), attempts_expired=1)
    assert rl.status().expired_leases == 2
    only(rl.run_maintenance_once(MaintenanceLimits(attempt_expiry_limit=0)))
    only(rl.run_maintenance_once(MaintenanceLimits(due_delivery_limit=0)), attempts_expired=2)
    assert {rl.get_run(h.id).status for h in handles} == {RunStatus.RETRYING}


# -- DELIVERY_RECOVERY ------------------------------------------------------------------------


@pytest.fixture
def listener(database_url: str, schema: str) -> Iterator[Conn]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("listen {}").format(sql.Identifier(f"runlane.{schema}")))
        yield conn


def test_delayed_run_that_came_due_wakes_its_queue(rl: Runlane, dbx: Db, listener: Conn) -> None:
    handle = rl.trigger(ok, None, delay=timedelta(hours=1))
    only(rl.run_maintenance_once())  # not due
    dbx.run(
        "update {schema}.runs set due_at = now() - interval '1 second' where id = %s", handle.id
    )
    assert list(listener.notifies(timeout=0.2)) == []
    only(rl.run_maintenance_once(), queues_woken=1)
    notes = list(listener.notifies(timeout=5, stop_after=1))
    assert [n.payload for n in notes] == ["default|default"]
    only(rl.run_maintenance_once(MaintenanceLimits(delivery_recovery_limit=0)))
    # a run that came due long ago was found by polling; it is not woken again
    dbx.run(
        "update {schema}.runs set due_at = now() - interval '10 minutes' where id = %s", handle.id
    )
    only(rl.run_maintenance_once(), queues_woken=0)
    assert list(listener.notifies(timeout=0.2)) == []


# -- CLEANUP ----------------------------------------------------------------------------------

PRUNE_AT_ONCE = RetentionPolicy(
    completed=timedelta(0), failed=timedelta(days=30), cancelled=timedelta(0)
)


def test_cleanup_prunes_by_retention(make_runlane: RunlaneFactory, dbx: Db) -> None:
    runtime = make_runlane(tasks=ALL_TASKS, retention=PRUNE_AT_ONCE)
    done = [runtime.trigger(ok, None) for _ in range(2)]
    failed = runtime.trigger(fatal, None)
    cancelled = runtime.trigger(ok, None, delay=timedelta(hours=1))
    runtime.cancel(cancelled.id)
    waiting = runtime.trigger(ok, None, delay=timedelta(hours=1))
    assert runtime.drain().runs_executed == 3
    assert dbx.attempts(done[0].id) != []
    only(runtime.run_maintenance_once(), runs_pruned=3)
    for handle in [*done, cancelled]:
        with pytest.raises(RunNotFound):
            runtime.get_run(handle.id)
        assert dbx.attempts(handle.id) == []
    assert runtime.get_run(failed.id).status is RunStatus.FAILED  # kept for 30 days
    assert runtime.get_run(waiting.id).status is RunStatus.QUEUED  # not terminal
    only(runtime.run_maintenance_once())
    dbx.age(failed.id, timedelta(days=29))
    only(runtime.run_maintenance_once())
    dbx.age(failed.id, timedelta(days=2))
    only(runtime.run_maintenance_once(), runs_pruned=1)
    assert not dbx.exists(failed.id)
    assert dbx.exists(waiting.id)


def test_default_retention_keeps_completed_runs_a_week(rl: Runlane, dbx: Db) -> None:
    handle = rl.trigger(ok, None)
    rl.drain()
    dbx.age(handle.id, timedelta(days=6, hours=23))
    only(rl.run_maintenance_once())
    dbx.age(handle.id, timedelta(hours=2))
    only(rl.run_maintenance_once(), runs_pruned=1)
    assert not dbx.exists(handle.id)


def test_cleanup_limit(make_runlane: RunlaneFactory, dbx: Db) -> None:
    runtime = make_runlane(tasks=[ok], retention=PRUNE_AT_ONCE)
    runtime.trigger_many(ok, [None] * 5)
    assert runtime.drain().runs_executed == 5
    only(runtime.run_maintenance_once(MaintenanceLimits(cleanup_limit=0)))
    only(runtime.run_maintenance_once(MaintenanceLimits(cleanup_limit=2)), runs_pruned=2)
    only(runtime.run_maintenance_once(), runs_pruned=3)
    assert dbx.all("select id from {schema}.runs") == []


def test_cleanup_larger_than_one_batch(make_runlane: RunlaneFactory, dbx: Db) -> None:
    """More prunable runs than one statement's batch (500): one pass loops to its limit."""
    runtime = make_runlane(tasks=[ok], retention=PRUNE_AT_ONCE)
    runtime.trigger_many(ok, [None] * 1200)
    dbx.run("update {schema}.runs set status = 'completed', finished_at = now() - interval '1 s'")
    only(runtime.run_maintenance_once(MaintenanceLimits(cleanup_limit=1100)), runs_pruned=1100)
    only(runtime.run_maintenance_once(), runs_pruned=100)


def adopt(dbx: Db, parent: uuid.UUID, children: list[uuid.UUID]) -> None:
    assert dbx.run(
        "update {schema}.runs set parent_run_id = %s where id = any(%s)", parent, children
    ) == len(children)


def tombstone(dbx: Db, run_id: uuid.UUID) -> tuple[bool, int | None, Any, Any]:
    pruned, remaining, payload, output = dbx.one(
        "select pruned_at is not null, remaining_children, payload, output "
        "from {schema}.runs where id = %s",
        run_id,
    )
    return pruned, remaining, payload, output


def test_parent_with_children_becomes_a_tombstone_until_they_are_pruned(
    make_runlane: RunlaneFactory, dbx: Db
) -> None:
    runtime = make_runlane(tasks=[ok], retention=PRUNE_AT_ONCE)
    parent = runtime.trigger(ok, {"big": "payload"})
    children = [runtime.trigger(ok, None, delay=timedelta(hours=1)) for _ in range(3)]
    adopt(dbx, parent.id, [c.id for c in children])
    assert runtime.drain().runs_executed == 1  # only the parent is due
    assert runtime.status().tombstones_with_children == 0
    only(runtime.run_maintenance_once(), runs_tombstoned=1)
    assert tombstone(dbx, parent.id) == (True, 3, None, None)
    assert runtime.status().tombstones_with_children == 1
    only(runtime.run_maintenance_once())  # a tombstone is not tombstoned again

    # one child finishes and is pruned: the count falls
    dbx.run("update {schema}.runs set due_at = now() where id = %s", children[0].id)
    assert runtime.drain().runs_executed == 1
    only(runtime.run_maintenance_once(), runs_pruned=1)
    assert tombstone(dbx, parent.id)[:2] == (True, 2)
    assert runtime.status().tombstones_with_children == 1

    # the rest finish: the count reaches zero, and the next pass deletes the tombstone
    dbx.run("update {schema}.runs set due_at = now() where parent_run_id = %s", parent.id)
    assert runtime.drain().runs_executed == 2
    only(runtime.run_maintenance_once(), runs_pruned=2)
    assert tombstone(dbx, parent.id)[:2] == (True, 0)
    assert runtime.status().tombstones_with_children == 0
    only(runtime.run_maintenance_once(), runs_pruned=1)
    assert not dbx.exists(parent.id)
    assert dbx.all("select id from {schema}.runs") == []


def test_children_made_by_a_handler_keep_their_parent_as_a_tombstone(
    make_runlane: RunlaneFactory, dbx: Db
) -> None:
    @task(id="child")
    def child(payload: Any, context: RunContext) -> None:
        return None

    @task(id="parent")
    def parent(payload: Any, context: RunContext) -> None:
        for _ in range(2):
            context.trigger_child(child, None, delay=timedelta(hours=1))

    runtime = make_runlane(tasks=[parent, child], retention=PRUNE_AT_ONCE)
    handle = runtime.trigger(parent, None)
    assert runtime.drain().runs_executed == 1
    only(runtime.run_maintenance_once(), runs_tombstoned=1)
    assert tombstone(dbx, handle.id)[:2] == (True, 2)
    assert len(dbx.all("select 1 from {schema}.runs where parent_run_id = %s", handle.id)) == 2


def test_parent_pruned_with_its_children_in_one_pass_is_not_stuck(
    make_runlane: RunlaneFactory, dbx: Db
) -> None:
    runtime = make_runlane(tasks=[ok], retention=PRUNE_AT_ONCE)
    parent = runtime.trigger(ok, None)
    children = [runtime.trigger(ok, None) for _ in range(3)]
    adopt(dbx, parent.id, [c.id for c in children])
    assert runtime.drain().runs_executed == 4
    for _ in range(3):
        runtime.run_maintenance_once()
    assert runtime.status().tombstones_with_children == 0
    assert dbx.all("select id from {schema}.runs") == []


# -- limits and arguments ---------------------------------------------------------------------


@pytest.mark.parametrize("field", [f.name for f in attrs.fields(MaintenanceLimits)])
@pytest.mark.parametrize("value", [-1, True, 1.5, "10", None])
def test_bad_limits_are_configuration_errors(field: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=field):
        MaintenanceLimits(**{field: value})


def test_limit_defaults() -> None:
    limits = MaintenanceLimits()
    assert (limits.wait_token_timeout_limit, limits.wait_token_resume_limit) == (100, 100)
    assert all(getattr(limits, f.name) > 0 for f in attrs.fields(MaintenanceLimits))


def test_limits_must_be_maintenance_limits(rl: Runlane) -> None:
    for bad in ({"schedule_limit": 1}, 10, "limits"):
        with pytest.raises(ConfigurationError, match="MaintenanceLimits"):
            rl.run_maintenance_once(bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="MaintenanceLimits"):
            rl.start_services(limits=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["completed", "failed", "cancelled"])
def test_bad_retention_is_a_configuration_error(field: str) -> None:
    with pytest.raises(ConfigurationError, match=field):
        RetentionPolicy(**{field: timedelta(seconds=-1)})
    bad: dict[str, Any] = {field: 7}
    with pytest.raises(ConfigurationError, match=field):
        RetentionPolicy(**bad)


def test_retention_must_be_a_retention_policy(make_runlane: RunlaneFactory) -> None:
    with pytest.raises(ConfigurationError, match="RetentionPolicy"):
        make_runlane(tasks=[ok], retention=timedelta(days=1))


def test_retention_defaults() -> None:
    assert RetentionPolicy() == RetentionPolicy(
        completed=timedelta(days=7), failed=timedelta(days=30), cancelled=timedelta(days=30)
    )


def test_phases_run_in_order_and_results_add_up() -> None:
    assert [p.value for p in MaintenancePhase] == [
        "schedules",
        "due_delivery",
        "wait_token_resolution",
        "attempt_expiry",
        "delivery_recovery",
        "cleanup",
        "stats",
    ]
    total = MaintenanceResult(attempts_expired=2) + MaintenanceResult(
        attempts_expired=1, runs_pruned=4
    )
    assert total == MaintenanceResult(attempts_expired=3, runs_pruned=4)
    assert total.total == 7


def test_environments_are_maintained_separately(make_runlane: RunlaneFactory, dbx: Db) -> None:
    prod = make_runlane(tasks=[ok], environment="prod")
    staging = make_runlane(tasks=[ok], environment="staging")
    handle = prod.trigger(ok, None)
    claim(prod)
    dbx.expire_lease(handle.id)
    assert staging.status().expired_leases == 0
    only(staging.run_maintenance_once())
    assert prod.get_run(handle.id).status is RunStatus.RUNNING
    only(prod.run_maintenance_once(), attempts_expired=1)


def test_status_is_data(rl: Runlane) -> None:
    report = rl.status()
    assert isinstance(report, StatusReport)
    assert report.environment == "default"
    assert (report.queued_due, report.running, report.tombstones_with_children) == (0, 0, 0)
    assert report.maintenance_leases == ()
    assert report.outbox_pending == 0  # the polling lane has no outbox


# -- the command line -------------------------------------------------------------------------


def test_cli_migrate_twice(
    database_url: str, fresh_schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["migrate", "--database-url", database_url, "--schema", fresh_schema]) == 0
    out = capsys.readouterr().out
    assert f"schema {fresh_schema}: applied 1" in out
    assert main(["migrate", "--database-url", database_url, "--schema", fresh_schema]) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out
    assert "applied" not in out


def test_cli_migrate_rejects_a_bad_schema_name(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["migrate", "--database-url", database_url, "--schema", "Bad-Name"]) != 0
    captured = capsys.readouterr()
    assert "Bad-Name" in captured.err
    assert "schema name" in captured.err
    assert "Traceback" not in captured.err


def test_cli_status_and_maintenance_once(
    make_runlane: RunlaneFactory,
    dbx: Db,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runtime = make_runlane(tasks=[ok])
    handle = runtime.trigger(ok, None)
    claim(runtime)
    dbx.expire_lease(handle.id)
    app = "tests.test_maintenance:CLI_APP"
    monkeypatch.setattr(f"{__name__}.CLI_APP", runtime)
    assert main(["status", app]) == 1  # an expired lease is unhealthy
    captured = capsys.readouterr()
    assert "expired" in captured.err
    out = captured.out
    assert "environment 'default'" in out
    line = next(line for line in out.splitlines() if "expired active leases" in line)
    assert line.split()[-1] == "1"
    assert "no band has been owned yet" in out

    # each CLI command closes the runtime it loaded, so give it a fresh one
    monkeypatch.setattr(f"{__name__}.CLI_APP", make_runlane(tasks=[ok]))
    assert main(["maintenance", "--once", app]) == 0
    out = capsys.readouterr().out
    values = dict(line.split() for line in out.splitlines())
    assert values["attempts_expired"] == "1"
    assert values["runs_pruned"] == "0"

    monkeypatch.setattr(f"{__name__}.CLI_APP", make_runlane(tasks=[ok]))
    main(["status", "--json", app])
    report = json.loads(capsys.readouterr().out)
    assert (report["expired_leases"], report["running"]) == (0, 0)
    assert report["environment"] == "default"
    assert report["maintenance_leases"] == []


def test_cli_rejects_an_app_that_is_not_a_runlane(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "tests.test_maintenance:ALL_TASKS"]) == 2
    assert "not a Runlane" in capsys.readouterr().err
    assert main(["status", "tests.test_maintenance"]) == 2
    assert "module:attribute" in capsys.readouterr().err
