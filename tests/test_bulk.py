"""Bulk actions by filter: retry_runs, cancel_runs, delete_runs.

Filters and dry runs, the all=True guard, bad input (a runlane error, nothing changed),
delete of terminal runs only with parents' children kept consistent as cleanup does,
idempotent re-runs, interruptions half way (on_batch raising KeyboardInterrupt, a killed
process) finished by a re-run, and bulk-retried runs delivered on the RabbitMQ lane. Every
call is made on a runtime built with no tasks, as the operator CLI builds it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import runlane._operator.bulk
from runlane import (
    BulkResult,
    ConfigurationError,
    RetryPolicy,
    RunContext,
    Runlane,
    RunStatus,
    queue,
    task,
)
from tests.conftest import RabbitRuntimes, RunlaneFactory
from tests.helpers import Conn, SchemaDb, consumer_ready, wait_until


class Runs(SchemaDb):
    """Runs written straight into the table, shaped as runlane leaves them."""

    def insert(
        self,
        n: int,
        status: str,
        *,
        task_id: str = "bulk.t",
        queue: str = "default",
        age: timedelta = timedelta(hours=1),
        parent: uuid.UUID | None = None,
        environment: str = "default",
    ) -> list[uuid.UUID]:
        terminal = status in ("completed", "failed", "cancelled")
        running = status in ("running", "cancellation_requested")
        rows = self.all(
            "insert into {schema}.runs (id, environment, task_id, queue, status, payload,"
            " attempt, releases, max_attempts, due_at, created_at, finished_at, error,"
            " lease_token, lease_expires_at, parent_run_id, wait_kind)"
            " select gen_random_uuid(), %s, %s, %s, %s, jsonb_build_object('n', g),"
            " case when %s then 0 else 2 end, 0, 2, now(),"
            " now() - %s - g * interval '1 millisecond',"
            " case when %s then now() end,"
            ' case when %s = \'failed\' then \'{{"type": "Boom", "message": "x"}}\'::jsonb end,'
            " case when %s then gen_random_uuid() end,"
            " case when %s then now() + interval '1 hour' end, %s,"
            " case when %s = 'waiting' then 'sleep' end"
            " from generate_series(1, %s) as g returning id",
            environment,
            task_id,
            queue,
            status,
            status == "queued",
            age,
            terminal,
            status,
            running,
            running,
            parent,
            status,
            n,
        )
        return [row[0] for row in rows]

    def counts(self) -> dict[str, int]:
        rows = self.all("select status, count(*) from {schema}.runs group by status")
        return {str(s): int(n) for s, n in rows}

    def row(self, run_id: uuid.UUID) -> tuple[Any, ...] | None:
        rows = self.all(
            "select status, attempt, releases, error, finished_at, pruned_at,"
            " remaining_children from {schema}.runs where id = %s",
            run_id,
        )
        return rows[0] if rows else None


@pytest.fixture
def runs(db: Conn, schema: str) -> Runs:
    return Runs(db, schema)


@pytest.fixture
def operator(make_runlane: RunlaneFactory) -> Runlane:
    """A runtime with no tasks, queues or schedules: what the operator CLI builds."""
    return make_runlane()


def test_retry_runs_by_filter_with_dry_run_counts_and_the_single_run_semantics(
    operator: Runlane, runs: Runs
) -> None:
    old = runs.insert(3, "failed", age=timedelta(days=2))
    other_task = runs.insert(2, "failed", task_id="bulk.other")
    other_queue = runs.insert(2, "failed", queue="q2")
    cancelled = runs.insert(2, "cancelled")
    runs.insert(4, "completed")
    runs.insert(1, "queued")
    now = datetime.now(UTC)

    dry = operator.retry_runs(status="failed", dry_run=True)
    assert dry == BulkResult(matched=7, changed=0, dry_run=True)
    assert runs.counts()["failed"] == 7  # nothing changed

    assert operator.retry_runs(task="bulk.other").matched == 2
    for run_id in other_task:
        status, attempt, releases, error, finished_at, *_ = runs.row(run_id) or ()
        assert (status, attempt, releases, error, finished_at) == ("queued", 2, 2, None, None)
    assert operator.retry_runs(queue="q2", status="failed") == BulkResult(2, 2)
    assert {runs.row(r)[0] for r in other_queue} == {"queued"}  # type: ignore[index]
    before = operator.retry_runs(created_before=now - timedelta(days=1))
    assert before == BulkResult(3, 3)
    assert {runs.row(r)[0] for r in old} == {"queued"}  # type: ignore[index]
    # what is left: the cancelled ones (failed are all retried), bounded by limit
    assert operator.retry_runs(created_after=now - timedelta(days=1), limit=1) == BulkResult(1, 1)
    assert operator.retry_runs(status=["cancelled", "failed"]) == BulkResult(1, 1)
    assert {runs.row(r)[0] for r in cancelled} == {"queued"}  # type: ignore[index]
    # a re-run finds nothing left to do: not an error
    assert operator.retry_runs(status="failed") == BulkResult(0, 0)
    assert runs.counts() == {"queued": 10, "completed": 4}
    # the retried runs are served like retry_run's: get_run shows them queued
    snapshot = operator.get_run(old[0])
    assert snapshot.status is RunStatus.QUEUED
    assert snapshot.error is None


def test_a_bulk_retried_run_runs_again_with_a_fresh_attempt_budget(
    make_runlane: RunlaneFactory, operator: Runlane
) -> None:
    calls: list[int] = []

    @task(
        id="bulk.fails_once",
        retry=RetryPolicy(max_attempts=1, initial_delay=timedelta(0), jitter=0),
    )
    def fails_once(payload: Any, context: RunContext) -> int:
        calls.append(context.attempt)
        if len(calls) == 1:
            raise RuntimeError("first time")
        return context.attempt

    rl = make_runlane(tasks=[fails_once])
    handle = rl.trigger(fails_once, None)
    rl.drain()
    assert rl.get_run(handle.id).status is RunStatus.FAILED
    assert operator.retry_runs(task=fails_once) == BulkResult(1, 1)
    rl.drain()
    done = rl.get_run(handle.id)
    assert (done.status, done.output, calls) == (RunStatus.COMPLETED, 2, [1, 2])
    history = rl.get_run_history(handle.id)
    assert [a.outcome for a in history.attempts] == ["failed", "completed"]


def test_cancel_runs_cancels_live_runs_and_asks_running_ones_to_stop(
    operator: Runlane, runs: Runs
) -> None:
    queued = runs.insert(3, "queued")
    running = runs.insert(2, "running")
    waiting = runs.insert(1, "waiting")
    runs.insert(2, "completed")
    assert operator.cancel_runs(status="running", dry_run=True) == BulkResult(2, 0, True)
    assert operator.cancel_runs(all=True) == BulkResult(6, 6)
    assert {runs.row(r)[0] for r in queued + waiting} == {"cancelled"}  # type: ignore[index]
    assert {runs.row(r)[0] for r in running} == {"cancellation_requested"}  # type: ignore[index]
    assert runs.counts()["completed"] == 2
    assert operator.cancel_runs(all=True) == BulkResult(0, 0)


def test_a_call_without_a_filter_is_refused_unless_all_is_given(
    operator: Runlane, runs: Runs
) -> None:
    runs.insert(2, "failed")
    for action in (operator.retry_runs, operator.cancel_runs, operator.delete_runs):
        with pytest.raises(ConfigurationError, match="all=True"):
            action()
        with pytest.raises(ConfigurationError, match="all=True"):
            action(limit=5)  # how many, not which
    assert runs.counts() == {"failed": 2}
    assert operator.retry_runs(all=True) == BulkResult(2, 2)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        ({"status": "nope"}, "is not a run status"),
        ({"status": []}, "non-empty list"),
        ({"status": 3}, "run status"),
        ({"status": "completed"}, "only failed or cancelled runs can be retried"),
        ({"status": "queued"}, "only failed or cancelled"),
        ({"created_after": datetime(2024, 1, 1)}, "timezone-aware"),
        ({"created_before": "yesterday"}, "timezone-aware"),
        ({"all": True, "limit": 0}, "limit must be an integer"),
        ({"all": True, "limit": True}, "limit must be an integer"),
        ({"all": True, "limit": "10"}, "limit must be an integer"),
        ({"all": True, "limit": 10**12}, "limit must be an integer"),
        ({"task": ""}, "non-empty string"),
        ({"queue": 5}, "non-empty string"),
        ({"queue": "x" * 10_000}, "at most 1000 characters"),
        ({"all": "yes"}, "all must be True or False"),
        ({"all": True, "dry_run": 1}, "dry_run must be True or False"),
        ({"all": True, "on_batch": 3}, "on_batch must be a callable"),
    ],
)
def test_bad_filters_are_refused_and_change_nothing(
    operator: Runlane, runs: Runs, call: dict[str, Any], match: str
) -> None:
    runs.insert(2, "failed")
    with pytest.raises(ConfigurationError, match=match) as caught:
        operator.retry_runs(**call)
    assert len(str(caught.value)) < 2_000
    assert runs.counts() == {"failed": 2}


def test_delete_takes_terminal_statuses_only(operator: Runlane, runs: Runs) -> None:
    runs.insert(2, "queued")
    runs.insert(1, "running")
    done = runs.insert(3, "completed")
    runs.insert(1, "failed")
    for live in ("queued", "running", "waiting", "cancellation_requested"):
        with pytest.raises(ConfigurationError, match="only terminal runs"):
            operator.delete_runs(status=live)
    with pytest.raises(ConfigurationError, match="only terminal runs"):
        operator.delete_runs(status=["completed", "queued"])
    with pytest.raises(ConfigurationError, match="only queued, retrying"):
        operator.cancel_runs(status="completed")
    assert runs.counts() == {"queued": 2, "running": 1, "completed": 3, "failed": 1}
    assert operator.delete_runs(status="completed", dry_run=True) == BulkResult(3, 0, True)
    assert operator.delete_runs(status="completed") == BulkResult(3, 3)
    assert all(runs.row(r) is None for r in done)
    # no status: every terminal status, live runs untouched
    assert operator.delete_runs(all=True) == BulkResult(1, 1)
    assert runs.counts() == {"queued": 2, "running": 1}


def test_delete_keeps_parents_children_consistent_as_cleanup_does(
    operator: Runlane, runs: Runs
) -> None:
    (parent,) = runs.insert(1, "completed", task_id="bulk.parent")
    children = runs.insert(3, "completed", task_id="bulk.child", parent=parent)
    (live_parent,) = runs.insert(1, "completed", task_id="bulk.parent2")
    (live_child,) = runs.insert(1, "running", task_id="bulk.child", parent=live_parent)
    runs.run(
        "insert into {schema}.attempts (run_id, attempt, lease_token, outcome, started_at)"
        " select id, 1, gen_random_uuid(), 'completed', now() from {schema}.runs"
        " where status = 'completed'"
    )
    runs.run(
        "insert into {schema}.steps (run_id, name, output, attempt)"
        " select id, 's', '1', 1 from {schema}.runs where status = 'completed'"
    )

    # the parents alone: each becomes a tombstone counting its children
    assert operator.delete_runs(task="bulk.parent") == BulkResult(1, 1)
    assert runs.row(parent)[5:] != (None, None)  # type: ignore[index]
    assert runs.row(parent)[6] == 3  # type: ignore[index]
    assert operator.delete_runs(task="bulk.parent2") == BulkResult(1, 1)
    assert runs.row(live_parent)[6] == 1  # type: ignore[index]
    # a tombstone is no longer a run a bulk action sees
    assert operator.delete_runs(task="bulk.parent") == BulkResult(0, 0)

    # a deleted child lowers its tombstoned parent's count, in the same statement
    assert operator.delete_runs(task="bulk.child", limit=1) == BulkResult(1, 1)
    assert runs.row(parent)[6] == 2  # type: ignore[index]
    assert operator.delete_runs(task="bulk.child") == BulkResult(2, 2)
    assert runs.row(parent)[6] == 0  # type: ignore[index]
    assert all(runs.row(c) is None for c in children)
    # attempts and steps went with their runs (the tombstones keep theirs until cleanup)
    orphans = runs.one(
        "select (select count(*) from {schema}.attempts a where not exists"
        " (select from {schema}.runs r where r.id = a.run_id)),"
        " (select count(*) from {schema}.steps s where not exists"
        " (select from {schema}.runs r where r.id = s.run_id))"
    )
    assert orphans == (0, 0)
    # cleanup then deletes the tombstone whose children are gone; the live child's stays
    operator.run_maintenance_once()
    assert runs.row(parent) is None
    assert runs.row(live_parent) is not None
    assert runs.row(live_child) is not None


def test_delete_of_a_parent_and_its_children_in_one_batch(operator: Runlane, runs: Runs) -> None:
    (parent,) = runs.insert(1, "failed", task_id="bulk.parent")
    runs.insert(2, "failed", task_id="bulk.child", parent=parent)
    (kept,) = runs.insert(1, "queued", task_id="bulk.child", parent=parent)
    assert operator.delete_runs(status="failed") == BulkResult(3, 3)
    # the parent is a tombstone counting only the child that outlived the statement
    assert runs.row(parent)[6] == 1  # type: ignore[index]
    assert runs.row(kept) is not None
    assert runs.counts() == {"failed": 1, "queued": 1}  # the tombstone keeps its status


def test_interrupted_between_batches_then_re_run_to_completion(
    operator: Runlane, runs: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runlane._operator.bulk, "BATCH_SIZE", 10)
    runs.insert(35, "failed")
    seen: list[tuple[int, int]] = []

    def stop_after_two(done: int, matched: int) -> None:
        seen.append((done, matched))
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        operator.retry_runs(status="failed", on_batch=stop_after_two)
    assert seen == [(10, 35), (20, 35)]
    # every batch before the interruption committed, none after it began
    assert runs.counts() == {"queued": 20, "failed": 15}
    progress: list[tuple[int, int]] = []
    result = operator.retry_runs(status="failed", on_batch=lambda d, m: progress.append((d, m)))
    assert result == BulkResult(15, 15)
    assert progress == [(10, 15), (15, 15)]
    assert runs.counts() == {"queued": 35}


def test_a_batch_skips_runs_locked_by_others_instead_of_waiting(
    operator: Runlane, runs: Runs, database_url: str, schema: str
) -> None:
    ids = runs.insert(5, "failed")
    with psycopg.connect(database_url) as holder:
        holder.execute(
            f'select 1 from "{schema}".runs where id = %s for update',
            (ids[0],),
        )
        assert operator.retry_runs(status="failed") == BulkResult(5, 4)
    assert operator.retry_runs(status="failed") == BulkResult(1, 1)
    assert runs.counts() == {"queued": 5}


_KILLED_SCRIPT = textwrap.dedent(
    """
    import sys
    from runlane import create_runlane
    from runlane.postgres import postgres_polling_lane

    lane = postgres_polling_lane(connection_string=sys.argv[1], schema=sys.argv[2])
    rl = create_runlane(lane=lane)
    def progress(done, matched):
        print(done, matched, flush=True)
    rl.retry_runs(status="failed", on_batch=progress)
    print("finished", flush=True)
    """
)


def test_a_bulk_retry_killed_half_way_is_finished_by_a_re_run(
    operator: Runlane, runs: Runs, database_url: str, schema: str
) -> None:
    total = 20_000
    runs.insert(total, "failed")
    with subprocess.Popen(
        [sys.executable, "-c", _KILLED_SCRIPT, database_url, schema],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        assert child.stderr is not None
        first = child.stdout.readline().split()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        said = child.stderr.read()
    assert first == ["500", str(total)], said
    # the server ends the dead client's sessions once their statement is over (a batch in
    # flight committed whole or not at all); its pool's connections carry the schema's name
    wait_until(
        lambda: (
            not runs.all(
                "select 1 from pg_stat_activity where application_name = %s", f"runlane-{schema}"
            )
        ),
        timeout=30,
        what="the killed process's connections to end",
    )
    counts = runs.counts()
    done = counts.get("queued", 0)
    print(f"\nkilled after {done} of {total} runs retried")
    assert 500 <= done < total, counts
    assert done % 500 == 0, counts
    assert operator.retry_runs(status="failed") == BulkResult(total - done, total - done)
    assert runs.counts() == {"queued": total}
    consistent = runs.one(
        "select count(*) from {schema}.runs where status = 'queued' and releases = attempt"
        " and error is null and finished_at is null"
    )
    assert consistent == (total,)


def test_bulk_retried_runs_are_delivered_on_the_rabbitmq_lane(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, runs: Runs
) -> None:
    attempts: dict[int, int] = {}

    @task(id="bulk.rabbit", retry=RetryPolicy(max_attempts=1))
    def flaky(payload: int, context: RunContext) -> int:
        attempts[payload] = attempts.get(payload, 0) + 1
        if attempts[payload] == 1:
            raise RuntimeError("first attempt fails")
        return payload

    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[flaky], queues=[queue("default")])
    worker = rl.create_delivery_worker(concurrency=4)
    consumer_ready(worker)
    handles = rl.trigger_many(flaky, list(range(30)))
    wait_until(
        lambda: runs.counts() == {"failed": 30},
        timeout=30,
        what="30 failed runs",
        state=runs.counts,
    )
    assert rl.retry_runs(task=flaky) == BulkResult(30, 30)
    wait_until(
        lambda: runs.counts() == {"completed": 30},
        timeout=30,
        what="the bulk-retried runs delivered and completed",
        state=runs.counts,
    )
    assert [rl.get_run(h.id).output for h in handles] == list(range(30))
    assert runs.one("select count(*) from {schema}.outbox") == (0,)


def test_bulk_actions_leave_other_environments_alone(
    make_runlane: RunlaneFactory, runs: Runs
) -> None:
    runs.insert(3, "failed", environment="staging")
    runs.insert(2, "failed")
    staging = make_runlane(environment="staging")
    assert staging.retry_runs(all=True) == BulkResult(3, 3)
    assert runs.counts() == {"queued": 3, "failed": 2}


def _queued_in_statistics(runs: Runs) -> bool:
    row = runs.one(
        "select coalesce('queued' = any(most_common_vals::text::text[]), false)"
        " from pg_stats where schemaname = %s and tablename = 'runs' and attname = 'status'",
        runs.schema,
    )
    return bool(row[0])


@pytest.mark.parametrize("threshold", [600, 5_000])
def test_a_large_bulk_retry_refreshes_the_statistics_claims_are_planned_with(
    operator: Runlane, runs: Runs, monkeypatch: pytest.MonkeyPatch, threshold: int
) -> None:
    # Statistics taken while every run was failed say queued runs are rare; a claim planned
    # with them reads its queue through runs_listing_by_status and sorts the whole retried
    # backlog. The retry analyses runs once it has moved ANALYZE_AFTER runs into queued.
    monkeypatch.setattr("runlane.postgres._bulk.ANALYZE_AFTER", threshold)
    runs.insert(1_200, "failed", queue="held")
    runs.run("analyze {schema}.runs")
    assert not _queued_in_statistics(runs)
    result = operator.retry_runs(status="failed")
    assert result.changed == 1_200
    assert _queued_in_statistics(runs) is (threshold <= 1_200)


def test_a_count_that_would_take_too_long_gives_the_databases_estimate(
    operator: Runlane, runs: Runs
) -> None:
    from runlane.storage import BulkFilter  # noqa: PLC0415

    runs.insert(30_000, "queued", queue="big")
    runs.insert(10, "queued", queue="small")
    runs.run("analyze {schema}.runs")
    storage = operator._life.storage
    big = BulkFilter(environment="default", statuses=(RunStatus.QUEUED,), queue="big")
    small = BulkFilter(environment="default", statuses=(RunStatus.QUEUED,), queue="small")
    assert storage.run_bulk_count_within(small, 10_001, 5.0) == (10, True)
    assert storage.run_bulk_count_within(big, 10_001, 5.0) == (10_001, True)
    # one millisecond is not enough to count 30,000 runs: the planner's estimate instead,
    # of every match (not bounded by the limit), read without a scan
    estimate, exact = storage.run_bulk_count_within(big, 10_001, 0.001)
    assert not exact
    assert 15_000 <= estimate <= 60_000
    # the connection is usable afterwards: the timeout was the count's transaction's own
    assert storage.run_bulk_count_within(small, 10_001, 5.0) == (10, True)
