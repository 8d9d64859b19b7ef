"""Inspection and operator actions: list_runs (keyset pages served by an index), a run's
history, retry_run, and bad input to them and to trigger (each a clear error, nothing
written)."""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from runlane import (
    AttemptRecord,
    ConfigurationError,
    PayloadValidationError,
    RetryPolicy,
    RunContext,
    RunHandle,
    RunHistory,
    RunNotFound,
    RunPage,
    RunSnapshot,
    RunStateConflict,
    RunStatus,
    StepRecord,
    queue,
    task,
)
from runlane._operator.runs import encode_cursor
from runlane.postgres import PostgresStorage
from runlane.storage import Completion, Failure, LeaseRef, NewRuns, RunListQuery
from tests.conftest import RunlaneFactory
from tests.helpers import (
    Conn,
    Greet,
    SchemaDb,
    count_runs,
    poll,
    wait_for_status,
    wait_until,
)

NO_DELAY = RetryPolicy(
    max_attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0), jitter=0.0
)


@attrs.frozen
class Inner:
    n: int


@attrs.frozen
class Nested:
    name: str
    inner: Inner


class Boom(Exception):
    pass


@task(id="inspect.greet", schema=Greet)
def greet(payload: Greet, context: RunContext) -> str:
    return f"hello {payload.name}"


@task(id="inspect.other", queue="other")
def other(payload: Any, context: RunContext) -> Any:
    return payload


@task(id="inspect.nested", schema=Nested)
def nested(payload: Nested, context: RunContext) -> None:
    pass


def _runtime(make_runlane: RunlaneFactory, **kwargs: Any) -> Any:
    return make_runlane(
        queues=[queue("default", default=True), queue("other")],
        tasks=[greet, other, nested, *kwargs.pop("tasks", [])],
        **kwargs,
    )


def _all_pages(rl: Any, **filters: Any) -> list[RunSnapshot]:
    seen: list[RunSnapshot] = []
    cursor = None
    for _ in range(100):
        page = rl.list_runs(cursor=cursor, **filters)
        assert isinstance(page, RunPage)
        seen.extend(page.runs)
        if page.next_cursor is None:
            return seen
        cursor = page.next_cursor
    pytest.fail("list_runs never reached its last page")


def _expected(db: Conn, schema: str, where: str = "true", *params: Any) -> list[uuid.UUID]:
    return [
        row[0]
        for row in SchemaDb(db, schema).all(
            "select id from {schema}.runs where environment = 'default' and "
            + where
            + " order by created_at desc, id desc",
            *params,
        )
    ]


# -- list_runs ---------------------------------------------------------------------------------


def test_list_runs_pages_newest_first_with_ties_and_filters(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl = _runtime(make_runlane)
    # one trigger_many shares its created_at (transaction time): the id breaks ties
    batch = rl.trigger_many(greet, [{"name": str(i)} for i in range(5)])
    singles = [rl.trigger(other, i) for i in range(4)]
    late = rl.trigger(greet, {"name": "late"}, delay=3600)
    rl.cancel(singles[0].id)
    elsewhere = make_runlane(tasks=[greet], environment="elsewhere")
    elsewhere.trigger(greet, {"name": "not listed"})

    everything = _all_pages(rl, limit=3)
    assert [r.id for r in everything] == _expected(db, schema)
    assert len(everything) == 10
    assert len({r.id for r in everything}) == 10
    assert all(r.environment == "default" for r in everything)
    first = rl.list_runs(limit=3)
    assert first.next_cursor is not None
    assert len(first.runs) == 3
    assert first.runs[0].id == late.id  # the newest
    # one page exactly as large as what is left ends the listing
    assert rl.list_runs(limit=10).next_cursor is None
    assert [r.id for r in rl.list_runs().runs] == [r.id for r in everything]

    assert {r.id for r in _all_pages(rl, task="inspect.greet", limit=2)} == {
        *(h.id for h in batch),
        late.id,
    }
    assert [r.id for r in _all_pages(rl, task=greet, limit=2)] == _expected(
        db, schema, "task_id = %s", "inspect.greet"
    )
    assert [r.id for r in _all_pages(rl, queue="other", limit=2)] == [
        h.id for h in reversed(singles)
    ]
    assert [r.id for r in _all_pages(rl, status="cancelled")] == [singles[0].id]
    assert [r.id for r in _all_pages(rl, status=RunStatus.QUEUED, queue="other", limit=1)] == [
        h.id for h in reversed(singles[1:])
    ]
    assert _all_pages(rl, status="queued", task="inspect.other", queue="default") == []
    assert _all_pages(rl, task="no.such.task") == []


def test_a_cursor_keeps_its_place_when_runs_are_added(make_runlane: RunlaneFactory) -> None:
    rl = _runtime(make_runlane)
    handles = [rl.trigger(other, i) for i in range(4)]
    first = rl.list_runs(limit=2)
    assert [r.id for r in first.runs] == [handles[3].id, handles[2].id]
    rl.trigger(other, "newer")  # newer than the cursor: on no later page
    second = rl.list_runs(limit=2, cursor=first.next_cursor)
    assert [r.id for r in second.runs] == [handles[1].id, handles[0].id]
    # the cursor of a page's last run, when nothing older is left
    assert rl.list_runs(cursor=encode_cursor(second.runs[-1])).runs == ()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"limit": 0}, "limit must be an integer from 1 to 1000, got 0"),
        ({"limit": -5}, "limit must be an integer from 1 to 1000, got -5"),
        ({"limit": 1001}, "limit must be an integer from 1 to 1000, got 1001"),
        ({"limit": True}, "limit must be an integer from 1 to 1000"),
        ({"limit": "10"}, "limit must be an integer from 1 to 1000"),
        ({"status": "bogus"}, "status 'bogus' is not a run status; use one of: queued, running"),
        ({"status": 3}, "is not a run status; use one of: queued, running, retrying, released"),
        ({"task": 5}, "task must be a non-empty string (or None), got 5"),
        ({"task": ""}, "task must be a non-empty string"),
        ({"queue": ["a"]}, "queue must be a non-empty string (or None), got ['a']"),
        ({"cursor": "garbage"}, "cursor 'garbage' is not a runs cursor"),
        ({"cursor": "r1.!!!"}, "is not a runs cursor"),
        ({"cursor": "r1.bm90IGpzb24"}, "is not a runs cursor"),  # "not json"
        ({"cursor": 12}, "cursor 12 is not a runs cursor"),
    ],
)
def test_list_runs_rejects_bad_input(
    make_runlane: RunlaneFactory, db: Conn, schema: str, arguments: dict[str, Any], message: str
) -> None:
    rl = _runtime(make_runlane)
    rl.trigger(other, 1)
    before = count_runs(db, schema)
    with pytest.raises(ConfigurationError) as raised:
        rl.list_runs(**arguments)
    assert message in str(raised.value)
    assert count_runs(db, schema) == before


def test_a_cursor_must_name_an_aware_time_and_a_uuid(make_runlane: RunlaneFactory) -> None:
    rl = _runtime(make_runlane)
    naive = json.dumps(["2024-01-01T00:00:00", str(uuid.uuid4())])
    for body in (naive, '["2024-01-01T00:00:00+00:00", 1]'):
        cursor = "r1." + base64.urlsafe_b64encode(body.encode()).decode()
        with pytest.raises(ConfigurationError, match="is not a runs cursor"):
            rl.list_runs(cursor=cursor)


# -- the index serves listing ---------------------------------------------------------------


@pytest.fixture
def many_runs(database_url: str, schema: str, db: Conn) -> Iterator[PostgresStorage]:
    """30,000 runs in 4 statuses and 3 tasks in two environments, analysed; a storage."""
    SchemaDb(db, schema).run(
        """
        insert into {schema}.runs (id, environment, task_id, queue, status, payload,
                                   max_attempts, due_at, created_at, finished_at)
        select gen_random_uuid(), case when i %% 5 = 0 then 'other' else 'default' end,
               'task.' || (i %% 3), 'default', s.status, 'null', 3, now(),
               now() - i * interval '1 second',
               case when s.status in ('completed', 'failed') then now() end
        from generate_series(1, 30000) as i
        cross join lateral (select (array['queued', 'completed', 'failed', 'retrying'])[
                                       1 + (i %% 4)] as status) as s
        """
    )
    SchemaDb(db, schema).run("analyze {schema}.runs")
    storage = PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=1)
    yield storage
    storage.close()


def _plan(storage: PostgresStorage, db: Conn, query: RunListQuery, *, generic: bool = False) -> str:
    """EXPLAIN of the statement run_list executes, with its parameters: as planned for these
    values, or as the generic plan psycopg's prepared statement uses after a few runs."""
    statement, params = storage.run_list_statement(query)
    if not generic:
        rows = db.execute(sql.SQL("explain ") + sql.SQL(statement), params).fetchall()
        return "\n".join(row[0] for row in rows)
    used = {name: value for name, value in params.items() if f"%({name})s" in statement}
    for index, name in enumerate(used, start=1):
        statement = statement.replace(f"%({name})s", f"${index}")
    with db.transaction():
        db.execute("set local plan_cache_mode = force_generic_plan")
        db.execute(sql.SQL("prepare listing as ") + sql.SQL(statement))
        arguments = sql.SQL(", ").join(sql.Literal(v) for v in used.values())
        rows = db.execute(sql.SQL("explain execute listing({})").format(arguments)).fetchall()
        db.execute("deallocate listing")
    return "\n".join(row[0] for row in rows)


@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
def test_listing_is_served_by_the_listing_index(
    many_runs: PostgresStorage, db: Conn, generic: bool
) -> None:
    before = (datetime.now(UTC) - timedelta(hours=2), uuid.uuid4())
    cases = [
        (None, None, None),
        (None, None, before),
        (None, "task.1", before),
        (RunStatus.FAILED, None, None),
        (RunStatus.FAILED, None, before),
        (RunStatus.QUEUED, "task.2", before),
    ]
    for status, task_id, cursor in cases:
        query = RunListQuery(
            environment="default",
            status=status,
            task_id=task_id,
            queue=None,
            limit=101,
            before=cursor,
        )
        plan = _plan(many_runs, db, query, generic=generic)
        assert "Index Scan using runs_listing_by_status on " in plan, plan
        assert "Seq Scan" not in plan, plan
        if status is None:
            # one walk per status, each stopping at the page size; the only sort is of the
            # pages the walks return (at most nine pages), never of the table
            _, _, walks = plan.partition("Nested Loop")
            assert "Function Scan on unnest" in walks, plan
            assert "Sort" not in walks, plan
            assert "Limit" in walks.split("Function Scan on unnest")[1], plan
        else:
            assert "Sort" not in plan, plan
        # the keyset condition is an index condition, not a filter over the walk
        assert "Index Cond:" in plan
        assert "(created_at, id) <" in plan.split("Index Cond:")[1].split("\n")[0], plan


# -- history ---------------------------------------------------------------------------------


def test_history_lists_attempts_and_steps(make_runlane: RunlaneFactory, schema: str) -> None:
    calls: list[int] = []

    @task(id="inspect.flaky", retry=RetryPolicy(max_attempts=3, initial_delay=timedelta(0)))
    def flaky(payload: Any, context: RunContext) -> str:
        calls.append(context.attempt)
        context.step("fetch", lambda: {"rows": 42})
        if context.attempt < 3:
            raise Boom(f"attempt {context.attempt} broke")
        context.step("store", lambda: "stored")
        return "done"

    rl = _runtime(make_runlane, tasks=[flaky])
    handle = rl.trigger(flaky, None)
    fresh = rl.get_run_history(handle.id)
    assert isinstance(fresh, RunHistory)
    assert fresh.run.status is RunStatus.QUEUED
    assert (fresh.attempts, fresh.steps) == ((), ())
    for _ in range(3):
        rl.drain()
        rl.run_maintenance_once()
    assert calls == [1, 2, 3]
    history = rl.get_run_history(str(handle.id))
    assert history.run.status is RunStatus.COMPLETED
    assert history.run.output == "done"
    assert [(a.number, a.outcome) for a in history.attempts] == [
        (1, "retrying"),
        (2, "retrying"),
        (3, "completed"),
    ]
    first = history.attempts[0]
    assert isinstance(first, AttemptRecord)
    assert first.error is not None
    assert first.error.type.endswith("Boom")
    assert first.error.message == "attempt 1 broke"
    assert history.attempts[2].error is None
    assert all(a.started_at <= a.finished_at for a in history.attempts)
    assert history.attempts[0].finished_at <= history.attempts[1].started_at
    assert [(s.name, s.output, s.attempt) for s in history.steps] == [
        ("fetch", {"rows": 42}, 1),
        ("store", "stored", 3),
    ]
    assert all(isinstance(s, StepRecord) for s in history.steps)
    assert history.steps[0].created_at <= history.steps[1].created_at


def test_history_of_an_unknown_run(make_runlane: RunlaneFactory) -> None:
    rl = _runtime(make_runlane)
    with pytest.raises(RunNotFound, match="no run"):
        rl.get_run_history(uuid.uuid4())
    with pytest.raises(RunNotFound, match="is not a run id"):
        rl.get_run_history("nope")
    handle = rl.trigger(other, 1)
    elsewhere = make_runlane(tasks=[other], queues=[queue("other")], environment="elsewhere")
    with pytest.raises(RunNotFound):
        elsewhere.get_run_history(handle.id)


# -- retry_run -------------------------------------------------------------------------------


def _failing_task(fail: threading.Event) -> Any:
    @task(id="inspect.fails", retry=NO_DELAY)
    def fails(payload: Any, context: RunContext) -> str:
        if fail.is_set():
            raise Boom(f"attempt {context.attempt}")
        return f"ok at {context.attempt}"

    return fails


def _run_out(rl: Any, run_id: uuid.UUID) -> RunSnapshot:
    """Drain and deliver due retries until the run is terminal."""
    for _ in range(10):
        rl.drain()
        rl.run_maintenance_once()
        snapshot: RunSnapshot = rl.get_run(run_id)
        if snapshot.is_terminal:
            return snapshot
    pytest.fail(f"run {run_id} did not end")


def _failed_run(make_runlane: RunlaneFactory) -> tuple[Any, RunHandle, threading.Event]:
    """A runtime with a run of ``inspect.fails`` that failed for good, and the event that
    makes the task fail (set; clear it for the next attempts to succeed)."""
    fail = threading.Event()
    fail.set()
    fails = _failing_task(fail)
    rl = _runtime(make_runlane, tasks=[fails])
    handle = rl.trigger(fails, None)
    _run_out(rl, handle.id)
    return rl, handle, fail


def test_retry_gives_a_failed_run_a_fresh_budget_and_keeps_its_history(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    fail = threading.Event()
    fail.set()
    fails = _failing_task(fail)
    rl = _runtime(make_runlane, tasks=[fails])
    handle = rl.trigger(fails, None)
    failed = _run_out(rl, handle.id)
    assert (failed.status, failed.attempt) == (RunStatus.FAILED, 2)

    queued = rl.retry_run(handle.id)
    assert queued.status is RunStatus.QUEUED
    assert (queued.error, queued.output, queued.finished_at) == (None, None, None)
    assert queued.attempt == 2  # numbers keep growing from here
    assert queued.max_attempts == 2
    row = SchemaDb(db, schema).one(
        "select due_at <= now(), releases, lease_token from {schema}.runs where id = %s",
        handle.id,
    )
    assert row == (True, 2, None)
    # a fresh budget: two more attempts, then failed again
    again = _run_out(rl, handle.id)
    assert (again.status, again.attempt) == (RunStatus.FAILED, 4)
    # and once more, succeeding now
    fail.clear()
    rl.retry_run(str(handle.id))
    done = _run_out(rl, handle.id)
    assert (done.status, done.output, done.attempt) == (RunStatus.COMPLETED, "ok at 5", 5)
    history = rl.get_run_history(handle.id)
    assert [(a.number, a.outcome) for a in history.attempts] == [
        (1, "retrying"),
        (2, "failed"),
        (3, "retrying"),
        (4, "failed"),
        (5, "completed"),
    ]


def test_retry_returns_the_run_as_queued_even_when_a_claim_follows_at_once(
    make_runlane: RunlaneFactory, db: Conn, database_url: str, schema: str
) -> None:
    """retry_run's answer is the run as the retry left it, read in its transaction: a claim
    that waited for the row and takes it the moment the retry commits does not show through
    (it did: the run was read again afterwards, and came back running)."""
    rl, handle, _ = _failed_run(make_runlane)
    runs = sql.SQL("{}.runs").format(sql.Identifier(schema))
    answers: list[Any] = []
    with (
        psycopg.connect(database_url) as holder,
        psycopg.connect(database_url, autocommit=True) as claimer,
    ):
        # hold the row, so the retry and then a rival's claim queue up behind it, in order
        holder.execute(
            sql.SQL("select 1 from {} where id = %s for update").format(runs), [handle.id]
        )
        retry = threading.Thread(target=lambda: answers.append(rl.retry_run(handle.id)))
        retry.start()
        wait_for_lock_waiters(db, 1)
        claim = threading.Thread(
            target=claimer.execute,
            args=(
                sql.SQL(
                    # matches the row whatever its status, so it waits for the lock; the
                    # status is read again once the row is free (the retry committed)
                    "update {} set"
                    " status = case when status = 'queued' then 'running' else status end,"
                    " lease_token = case when status = 'queued' then gen_random_uuid()"
                    "  else lease_token end,"
                    " lease_expires_at = case when status = 'queued'"
                    "  then now() + interval '1 minute' else lease_expires_at end"
                    " where id = %s"
                ).format(runs),
                [handle.id],
            ),
        )
        claim.start()
        wait_for_lock_waiters(db, 2)
        holder.rollback()  # the retry goes first; the claim takes the run as it commits
        retry.join(timeout=10)
        claim.join(timeout=10)
    assert not retry.is_alive()
    assert not claim.is_alive()
    assert rl.get_run(handle.id).status is RunStatus.RUNNING  # the claim did follow at once
    assert answers[0].status is RunStatus.QUEUED
    assert (answers[0].error, answers[0].finished_at) == (None, None)


def wait_for_lock_waiters(db: Conn, count: int) -> None:
    """Until ``count`` backends wait for a lock (a moment: each is already on its way)."""
    wait_until(
        lambda: (
            db.execute(
                "select count(*) from pg_stat_activity where wait_event_type = 'Lock'"
                " and datname = current_database()"
            ).fetchone()
            == (count,)
        ),
        timeout=10,
        what=f"{count} backends waiting for a lock",
    )


def test_a_retried_run_is_announced_and_a_worker_picks_it_up(
    make_runlane: RunlaneFactory,
) -> None:
    rl, handle, fail = _failed_run(make_runlane)
    cancelled = rl.trigger("inspect.fails", None, delay=3600)
    assert rl.cancel(cancelled.id).status is RunStatus.CANCELLED
    fail.clear()
    # a long poll interval: the worker hears of retried runs through the announcement
    with rl.create_delivery_worker(concurrency=2) as worker:
        assert worker is not None
        rl.retry_run(handle.id)
        rl.retry_run(cancelled.id)
        done = rl.wait_for_run(handle.id, timeout=20)
        assert (done.status, done.output) == (RunStatus.COMPLETED, "ok at 3")
        revived = rl.wait_for_run(cancelled.id, timeout=20)
        assert (revived.status, revived.output, revived.attempt) == (
            RunStatus.COMPLETED,
            "ok at 1",
            1,
        )


def test_retry_refuses_other_statuses_and_changes_nothing(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    entered = threading.Event()
    release = threading.Event()

    @task(id="inspect.blocks")
    def blocks(payload: Any, context: RunContext) -> None:
        entered.set()
        release.wait(20)
        # cancelled meanwhile: the worker hears it by the update's announcement (or its next
        # lease extension), not always before the test releases the handler
        poll(lambda: context.stop_reason is not None, timeout=20)
        context.raise_if_stopped()  # stops as asked

    rl = _runtime(make_runlane, tasks=[blocks])
    dbx = SchemaDb(db, schema)

    def row(run_id: uuid.UUID) -> tuple[Any, ...]:
        return dbx.one("select * from {schema}.runs where id = %s", run_id)

    queued = rl.trigger(other, 1)
    completed = rl.trigger(greet, {"name": "x"})
    rl.drain(queues=["default"])
    retrying = rl.trigger(other, 2)
    dbx.run("update {schema}.runs set status = 'retrying' where id = %s", retrying.id)
    cases = [
        (queued.id, "it is queued", "already waiting for a worker"),
        (completed.id, "it is completed", "trigger a new run"),
        (retrying.id, "it is retrying", "already scheduled for its next attempt"),
    ]
    with rl.create_delivery_worker(concurrency=1, queues=["default"]):
        running = rl.trigger(blocks, None)
        assert entered.wait(20)
        cases.append((running.id, "it is running", "cancel it first"))
        for run_id, status, advice in cases:
            before = row(run_id)
            with pytest.raises(RunStateConflict) as raised:
                rl.retry_run(run_id)
            text = str(raised.value)
            assert status in text
            assert "only failed or cancelled runs can be retried" in text
            assert advice in text
            assert row(run_id) == before
        rl.cancel(running.id)
        with pytest.raises(RunStateConflict, match=r"cancellation_requested.*wait until"):
            rl.retry_run(running.id)
        release.set()
        wait_for_status(rl, running.id, RunStatus.CANCELLED)
    with pytest.raises(RunNotFound):
        rl.retry_run(uuid.uuid4())
    # a pruned tombstone keeps only its place as a parent
    dbx.run(
        "update {schema}.runs set status = 'failed', finished_at = now(), pruned_at = now(), "
        "remaining_children = 1 where id = %s",
        queued.id,
    )
    before = row(queued.id)
    with pytest.raises(RunStateConflict, match="was pruned"):
        rl.retry_run(queued.id)
    assert row(queued.id) == before


def test_retry_keeps_fencing_and_writes_an_outbox_item_on_transport_lanes(
    database_url: str, schema: str, db: Conn
) -> None:
    storage = PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=2)
    storage.open()
    try:
        storage.outbox_enable("env", timedelta(minutes=5))
        run_id = uuid.uuid4()
        storage.run_insert_many(
            NewRuns(
                environment="env",
                task_id="t",
                queue="q",
                ids=[run_id],
                payloads=["null"],
                idempotency_keys=[None],
                priority=0,
                max_attempts=1,
                delay=timedelta(0),
                run_at=None,
            )
        )
        page = storage.outbox_claim_page("env", 10, timedelta(minutes=5))
        storage.outbox_published(page)
        (claimed,) = storage.run_claim_ids("env", [run_id], timedelta(minutes=1))
        old = LeaseRef(run_id, claimed.attempt, claimed.lease_token)
        error = '{"type": "Boom", "message": "no"}'
        storage.run_fail_many([Failure(run_id, old.attempt, old.lease_token, error, None)])
        dbx = SchemaDb(db, schema)
        assert dbx.all("select run_id from {schema}.outbox") == []
        outcome = storage.run_retry("env", run_id)
        assert (outcome.previous, outcome.retried) == (RunStatus.FAILED, True)
        # every transition into queued writes an item: the retry's is pending, unclaimed
        assert dbx.all("select run_id, claim_token from {schema}.outbox") == [(run_id, None)]
        # the old attempt's lease can change nothing; the next claim is a new attempt
        assert storage.run_complete_many([]) == set()
        stale = Completion(run_id, old.attempt, old.lease_token, '"zombie"')
        assert storage.run_complete_many([stale]) == set()
        (again,) = storage.run_claim_ids("env", [run_id], timedelta(minutes=1))
        assert (again.attempt, again.attempts_consumed) == (2, 1)
        assert again.lease_token != old.lease_token
        assert storage.run_complete_many([stale]) == set()
        assert storage.run_extend_leases([old], timedelta(minutes=1)) == {}
        # a second retry of a run that is running now is refused
        refused = storage.run_retry("env", run_id)
        assert (refused.previous, refused.retried) == (RunStatus.RUNNING, False)
        assert storage.run_retry("other-env", run_id).previous is None
    finally:
        storage.close()


# -- bad input to trigger --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "payload", "message"),
    [
        (greet, [1, 2], "payload: expected an object with the fields of Greet, got a list"),
        (greet, None, "payload: expected an object with the fields of Greet, got null"),
        (greet, "ann", "payload: expected an object with the fields of Greet, got a str"),
        (greet, 5, "payload: expected an object with the fields of Greet, got an int"),
        (nested, {"name": "x", "inner": [1]}, "expected Inner @ payload.inner"),
        (nested, {"name": "x", "inner": None}, "expected Inner @ payload.inner"),
    ],
)
def test_a_payload_of_the_wrong_shape_is_a_clear_validation_error(
    make_runlane: RunlaneFactory, db: Conn, schema: str, *, target: Any, payload: Any, message: str
) -> None:
    rl = _runtime(make_runlane)
    rl.trigger(other, 1)
    before = count_runs(db, schema)
    with pytest.raises(PayloadValidationError) as raised:
        rl.trigger(target, payload)
    assert message in str(raised.value)
    assert "keys" not in str(raised.value)
    with pytest.raises(PayloadValidationError):
        rl.trigger_many(target, [{"name": "fine"}, payload])
    assert count_runs(db, schema) == before


@pytest.mark.parametrize(
    ("delay", "shown"),
    [(-5, "-5 seconds"), (-0.5, "-0.5 seconds"), (timedelta(seconds=-5), "-5 seconds")],
)
def test_a_negative_delay_is_refused(
    make_runlane: RunlaneFactory, db: Conn, schema: str, delay: Any, shown: str
) -> None:
    rl = _runtime(make_runlane)
    before = count_runs(db, schema)
    with pytest.raises(ConfigurationError) as raised:
        rl.trigger(greet, {"name": "x"}, delay=delay)
    assert str(raised.value) == f"delay must not be negative, got {shown}"
    assert "day" not in str(raised.value)
    assert count_runs(db, schema) == before
