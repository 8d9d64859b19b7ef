"""Least-privilege roles: ``grant_postgres_role`` / ``runlane grant`` give each job only what it
needs, and the runtime works under each role for its job.

Roles are cluster-global: each test creates LOGIN roles with unique names and passwords,
connects as them with a conninfo built from the test URL, and drops them at teardown
(``DROP OWNED BY`` first: their grants on the test's schema).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from runlane import (
    ConfigurationError,
    RetryPolicy,
    RunContext,
    Runlane,
    RunlaneError,
    RunStatus,
    SchemaNotMigrated,
    Task,
    create_runlane,
    queue,
    schedule,
    task,
)
from runlane.cli import main
from runlane.maintenance import RetentionPolicy
from runlane.models import WaitTokenStatus
from runlane.postgres import (
    GRANT_JOBS,
    GRANT_LANES,
    PostgresStorage,
    apply_postgres_storage_migrations,
    grant_postgres_role,
    postgres_grant_sql,
    postgres_polling_lane,
)
from runlane.postgres._sql import statements
from runlane.storage import Completion
from tests.helpers import Conn, SchemaDb, elapse, logged, wait_until

# (job, lane="polling") -> the conninfo of a role created for this test and granted the job
RoleMaker = Callable[..., str]

DENIED = psycopg.errors.InsufficientPrivilege


@pytest.fixture
def runtimes() -> Iterator[Callable[[Runlane], Runlane]]:
    """Closes the runtimes a test registers."""
    made: list[Runlane] = []

    def keep(runtime: Runlane) -> Runlane:
        made.append(runtime)
        return runtime

    yield keep
    for runtime in made:
        runtime.close(timeout=10)


def denied(conninfo: str, statement: sql.Composed | str, params: Any = None) -> str:
    """Run one statement as the role; it must fail for lack of a privilege. The message."""
    if isinstance(params, dict):
        params = {"now": None, **params}  # the moved time the storage adds: none
    with psycopg.connect(conninfo, autocommit=True) as conn, pytest.raises(DENIED) as caught:
        conn.execute(statement, params)
    return str(caught.value)


# -- tasks --------------------------------------------------------------------------------------

journal: list[str] = []
release_blocker = threading.Event()


@task(id="grants.leaf")
def leaf(payload: dict[str, Any], context: RunContext) -> str:
    def side_effect() -> int:
        journal.append(f"side:{payload['n']}")
        return int(payload["n"])

    return f"leaf-{context.step('side', side_effect)}"


@task(id="grants.approve")
def approve(payload: dict[str, Any], context: RunContext) -> str:
    decision = context.wait_for_token(payload["token"])
    return f"approved by {decision['by']}"


@task(id="grants.parent")
def parent(payload: dict[str, Any], context: RunContext) -> str:
    child = context.trigger_child(leaf, {"n": payload["n"]})
    return f"parent of {context.wait_for_run(child.id)}"


@task(id="grants.napper")
def napper(payload: dict[str, Any], context: RunContext) -> str:
    context.sleep(timedelta(milliseconds=100))
    return "rested"


@task(id="grants.slow")
def slow(payload: dict[str, Any], context: RunContext) -> str:
    time.sleep(payload["seconds"])  # longer than the lease: only extensions keep it
    return "slow done"


@task(id="grants.flaky", retry=RetryPolicy(max_attempts=2, initial_delay=timedelta(0), jitter=0))
def flaky(payload: dict[str, Any], context: RunContext) -> int:
    if context.attempt == 1:
        raise RuntimeError("first attempt fails")
    return context.attempt


@task(id="grants.doomed", retry=RetryPolicy(max_attempts=1))
def doomed(payload: dict[str, Any], context: RunContext) -> None:
    raise RuntimeError("always fails")


@task(id="grants.blocker")
def blocker(payload: dict[str, Any], context: RunContext) -> str:
    context.cancelled.wait(20)
    context.raise_if_stopped()
    return "not stopped"


TASKS: list[Task[Any, Any]] = [leaf, approve, parent, napper, slow, flaky, doomed, blocker]
QUEUES = [queue("default", default=True)]


def runtime_as(conninfo: str, schema: str, **options: Any) -> Runlane:
    """A runtime connecting as the role: QUEUES and TASKS unless ``options`` say otherwise."""
    lane_options = options.pop("lane_options", {})
    return create_runlane(
        lane=postgres_polling_lane(connection_string=conninfo, schema=schema, **lane_options),
        **{"queues": QUEUES, "tasks": TASKS, **options},
    )


def operator_as(conninfo: str, schema: str) -> Runlane:
    """What the operator CLI builds, connecting as the role: no tasks, queues or schedules."""
    return create_runlane(lane=postgres_polling_lane(connection_string=conninfo, schema=schema))


# -- the SQL ------------------------------------------------------------------------------------


@pytest.mark.parametrize("lane", GRANT_LANES)
@pytest.mark.parametrize("job", GRANT_JOBS)
def test_the_sql_only_grants(job: str, lane: str) -> None:
    text = postgres_grant_sql(job=job, role="App-Role", schema="rl_app", lane=lane)
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    statements_ = [s.strip() for s in code.split(";") if s.strip()]
    assert statements_
    # what earlier releases granted and no job holds now is taken back first
    # (and, since schema versions 24 and 26, the operator's unaudited functions: the old delete
    # through a function that leaves it to a role holding the maintenance job)
    revoke_delete = 'select "rl_app".runlane_revoke_unaudited_delete(\'"App-Role"\'::regrole)'
    revokes = [s for s in statements_ if s.startswith("revoke ") or s == revoke_delete]
    assert [" ".join(s.split()) for s in revokes] == [
        'revoke delete on "rl_app".runs from "App-Role"',
        'revoke delete on "rl_app".attempts from "App-Role"',
        'revoke update (payload, pruned_at, remaining_children) on "rl_app".runs from "App-Role"',
        'revoke execute on function "rl_app".runlane_run_schedule(text, text, uuid, text, jsonb) '
        'from "App-Role"',
        'revoke execute on function "rl_app".runlane_retry_runs(text, uuid[], boolean) '
        'from "App-Role"',
        'revoke execute on function "rl_app".runlane_cancel_runs(text, uuid[], boolean) '
        'from "App-Role"',
        'revoke execute on function "rl_app".runlane_reschedule_runs( text, uuid[], '
        'timestamptz, timestamptz, boolean) from "App-Role"',
        revoke_delete,
        'revoke all on "rl_app".audit_owed from "App-Role"',
    ]
    statements_ = [s for s in statements_ if s not in revokes]
    for statement in statements_:
        assert statement.startswith("grant "), statement
        assert statement.endswith(' to "App-Role"'), statement
        assert " all " not in f" {statement} "
        for word in ("truncate", "references", "trigger", "create", "drop", "alter"):
            assert not re.search(rf"\b{word}\b", statement), statement

    def deletes(table: str) -> bool:
        target = f' on "rl_app".{table} to '
        return any(re.match(r"grant [^(]*\bdelete\b", s) and target in s for s in statements_)

    assert deletes("outbox") is (lane == "rabbitmq")
    # cleanup and the operator's delete_runs delete runs (and their attempts) only through
    # runlane_delete_runs, which takes finished runs alone: no job deletes them directly
    assert not deletes("runs")
    assert not deletes("attempts")
    assert ("runlane_delete_runs" in code) is (job in ("maintenance", "operator"))
    assert deletes("workers") is (job == "maintenance")
    assert not deletes("queue_states")
    assert not any(deletes(t) for t in ("steps", "wait_tokens", "schedules"))


def test_every_table_of_the_schema_is_granted_to_some_job_and_there_are_no_sequences(
    schema: str, db: Conn
) -> None:
    tables = {
        name
        for (name,) in db.execute(
            "select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace "
            "where n.nspname = %s and c.relkind in ('r', 'p')",
            (schema,),
        )
    }
    text = "\n".join(postgres_grant_sql(job=job, role="r", schema=schema) for job in GRANT_JOBS)
    for table in tables:
        assert f'"{schema}".{table} ' in text, f"no job is granted anything on {table}"
    sequences = db.execute(
        "select count(*) from pg_class c join pg_namespace n on n.oid = c.relnamespace "
        "where n.nspname = %s and c.relkind = 'S'",
        (schema,),
    ).fetchone()
    assert sequences == (0,), "a sequence appeared: grant USAGE on it to the jobs that insert"


# -- producer -----------------------------------------------------------------------------------


def test_producer_triggers_reads_and_completes_tokens(
    schema: str, granted: RoleMaker, runtimes: Callable[[Runlane], Runlane]
) -> None:
    producer_conninfo = granted("producer")
    producer = runtimes(runtime_as(producer_conninfo, schema))
    worker_rl = runtimes(runtime_as(granted("worker"), schema))

    first = producer.trigger(leaf, {"n": 1}, idempotency_key="k-1")
    again = producer.trigger(leaf, {"n": 1}, idempotency_key="k-1")
    assert again.id == first.id
    assert not again.created
    batch = producer.trigger_many(leaf, [{"n": 2}, {"n": 3}], delay=timedelta(0))
    assert len({h.id for h in batch}) == 2
    with psycopg.connect(producer_conninfo) as conn:  # the caller's own transaction
        inside = producer.trigger(leaf, {"n": 4}, connection=conn)
        conn.commit()
    assert producer.get_run(inside.id).status is RunStatus.QUEUED

    token = producer.create_wait_token(timeout=timedelta(minutes=5), idempotency_key="tok")
    assert producer.get_wait_token(token.id).status is WaitTokenStatus.PENDING
    waiting = producer.trigger(approve, {"token": str(token.id)})

    assert worker_rl.drain().runs_executed == 5
    assert producer.get_run(waiting.id).status is RunStatus.WAITING
    completed = producer.complete_wait_token(token.id, {"by": "ada"})
    assert completed.status is WaitTokenStatus.COMPLETED
    # the producer's resume pass queued the waiting run at once
    assert producer.get_run(waiting.id).status is RunStatus.QUEUED
    worker_rl.drain()
    for handle in (first, *batch, inside, waiting):
        assert producer.wait_for_run(handle.id, timeout=10).status is RunStatus.COMPLETED
    assert producer.get_run(waiting.id).output == "approved by ada"


def test_a_producer_cannot_claim_complete_or_delete_runs(
    database_url: str,
    schema: str,
    granted: RoleMaker,
    runtimes: Callable[[Runlane], Runlane],
    db: Conn,
) -> None:
    conninfo = granted("producer")
    producer = runtimes(runtime_as(conninfo, schema))
    run = producer.trigger(leaf, {"n": 1})
    text = statements(schema)
    denied(
        conninfo,
        text["run_claim"],
        {
            "environment": "default",
            "queues": ["default"],
            "limit": 10,
            "lease_seconds": 30,
            "concurrency_limit": None,
            "worker_id": None,
        },
    )
    # owner claims, so a completion would have a lease to match
    owner_storage = PostgresStorage(connection_string=database_url, schema=schema)
    try:
        [claimed] = owner_storage.run_claim("default", ["default"], 1, timedelta(seconds=30))
    finally:
        owner_storage.close()
    denied(
        conninfo,
        text["run_complete_many"],
        {
            "ids": [claimed.id],
            "attempts": [claimed.attempt],
            "lease_tokens": [claimed.lease_token],
            "outputs": '["forged"]',  # one JSON array, as the storage sends them
        },
    )
    denied(
        conninfo,
        text["run_fail_many"],
        {
            "ids": [claimed.id],
            "attempts": [claimed.attempt],
            "lease_tokens": [claimed.lease_token],
            "errors": ['{"type": "x", "message": "forged"}'],
            "retry_delay_seconds": [None],
        },
    )
    runs = sql.SQL("{}.runs").format(sql.Identifier(schema))
    denied(conninfo, sql.SQL("delete from {} where id = %s").format(runs), (run.id,))
    denied(conninfo, sql.SQL("truncate {}").format(runs))
    denied(
        conninfo,
        sql.SQL("update {} set status = 'completed', output = '1', finished_at = now()").format(
            runs
        ),
    )
    denied(conninfo, sql.SQL("update {} set lease_expires_at = now()").format(runs))
    # through runlane: a clear error naming the grant, not a driver exception
    storage = PostgresStorage(connection_string=conninfo, schema=schema)
    try:
        with pytest.raises(ConfigurationError, match=r"lacks a privilege.*runlane grant"):
            storage.run_claim("default", ["default"], 1, timedelta(seconds=30))
        with pytest.raises(ConfigurationError, match="lacks a privilege"):
            storage.run_complete_many(
                [Completion(claimed.id, claimed.attempt, claimed.lease_token, '"forged"')]
            )
    finally:
        storage.close()
    row = SchemaDb(db, schema).one("select status, output from {schema}.runs where id = %s", run.id)
    assert row == ("running", None)


# -- worker -------------------------------------------------------------------------------------


def test_a_worker_role_executes_steps_token_waits_child_runs_sleeps_and_retries(
    schema: str, granted: RoleMaker, runtimes: Callable[[Runlane], Runlane], db: Conn
) -> None:
    producer = runtimes(runtime_as(granted("producer"), schema))
    operator = runtimes(runtime_as(granted("operator"), schema))
    maintenance = runtimes(runtime_as(granted("maintenance"), schema))
    worker_rl = runtimes(
        runtime_as(granted("worker"), schema, lane_options={"lease_duration": timedelta(seconds=2)})
    )
    journal.clear()
    release_blocker.clear()
    token = producer.create_wait_token()
    handles = {
        "leaf": producer.trigger(leaf, {"n": 7}),
        "approve": producer.trigger(approve, {"token": str(token.id)}),
        "parent": producer.trigger(parent, {"n": 8}),
        "napper": producer.trigger(napper, {}),
        "slow": producer.trigger(slow, {"seconds": 3.5}),
        "flaky": producer.trigger(flaky, {}),
        "cancelled": producer.trigger(blocker, {}),
    }
    # `runlane worker` and `runlane maintenance` read status() before starting
    assert worker_rl.status().environment == maintenance.status().environment == "default"
    stop = threading.Event()

    def maintain() -> None:  # due retries and sleeps come back through maintenance
        while not stop.is_set():
            maintenance.run_maintenance_once()
            stop.wait(0.1)

    keeper = threading.Thread(target=maintain, name="grants-maintenance")
    keeper.start()
    try:
        with worker_rl.create_delivery_worker(concurrency=8) as worker:
            wait_until(
                lambda: producer.get_run(handles["approve"].id).status is RunStatus.WAITING,
                timeout=15,
                what="the token wait to suspend",
            )
            producer.complete_wait_token(token.id, {"by": "grace"})
            wait_until(
                lambda: producer.get_run(handles["cancelled"].id).status is RunStatus.RUNNING,
                timeout=15,
                what="the blocker to run",
            )
            operator.cancel(handles["cancelled"].id)  # the worker observes it
            expected = {
                "leaf": "leaf-7",
                "approve": "approved by grace",
                "parent": "parent of leaf-8",
                "napper": "rested",
                "slow": "slow done",  # kept alive by lease extensions past 2 s leases
                "flaky": 2,
            }
            for name, output in expected.items():
                snapshot = producer.wait_for_run(handles[name].id, timeout=30)
                assert (snapshot.status, snapshot.output) == (RunStatus.COMPLETED, output), name
            snapshot = producer.wait_for_run(handles["cancelled"].id, timeout=30)
            assert snapshot.status is RunStatus.CANCELLED

            # a run still executing when the worker closes is handed back unspent
            held = producer.trigger(blocker, {})
            wait_until(
                lambda: producer.get_run(held.id).status is RunStatus.RUNNING,
                timeout=15,
                what="the held run to start",
            )
            worker.close(timeout=10)
            worker.wait_until_closed(timeout=10)
    finally:
        stop.set()
        keeper.join(30)
    assert producer.get_run(held.id).status is RunStatus.QUEUED
    history = operator.get_run_history(held.id)
    assert [a.outcome for a in history.attempts] == ["released"]
    assert sorted(journal) == ["side:7", "side:8"]


def test_a_worker_role_cannot_migrate_drop_truncate_or_alter(
    database_url: str,
    schema: str,
    granted: RoleMaker,
    db: Conn,
    make_role: Callable[[], tuple[str, str]],
) -> None:
    conninfo = granted("worker")
    with pytest.raises(ConfigurationError, match=r"may not migrate schema.*owner"):
        apply_postgres_storage_migrations(connection_string=conninfo, schema=schema)
    fresh = f"t_{uuid.uuid4().hex[:16]}"
    with pytest.raises(ConfigurationError, match="may not migrate"):
        apply_postgres_storage_migrations(connection_string=conninfo, schema=fresh)
    assert db.execute(
        "select count(*) from pg_namespace where nspname = %s", (fresh,)
    ).fetchone() == (0,)
    s = sql.Identifier(schema)
    for statement in (
        sql.SQL("drop table {}.runs").format(s),
        sql.SQL("drop table {}.runlane_migrations").format(s),
        sql.SQL("drop schema {} cascade").format(s),
        sql.SQL("truncate {}.runs").format(s),
        sql.SQL("truncate {}.attempts").format(s),
        sql.SQL("alter table {}.runs add column x int").format(s),
        sql.SQL("alter table {}.runs disable trigger all").format(s),
        sql.SQL("create table {}.intruder (id int)").format(s),
        sql.SQL("create index on {}.runs (payload)").format(s),
        sql.SQL("drop function {}.runlane_announce(text, text, text)").format(s),
        sql.SQL("delete from {}.runs").format(s),
        sql.SQL("delete from {}.runlane_migrations").format(s),
        sql.SQL("update {}.runs set payload = '{{}}'").format(s),
    ):
        denied(conninfo, statement)
    # nor grant itself anything
    with pytest.raises(ConfigurationError, match="may not grant"):
        grant_postgres_role(
            connection_string=conninfo,
            schema=schema,
            job="maintenance",
            role=str(conninfo_to_dict(conninfo)["user"]),
        )
    # nor pass its own privileges on (it holds them without the grant option: PostgreSQL
    # only warns and grants nothing, which runlane turns into an error)
    other, _ = make_role()
    with pytest.raises(ConfigurationError, match="may not grant everything the worker job"):
        grant_postgres_role(connection_string=conninfo, schema=schema, job="worker", role=other)
    assert db.execute(
        "select has_schema_privilege(%s, %s, 'usage')", (other, schema)
    ).fetchone() == (False,)
    ledger = SchemaDb(db, schema).one("select count(*) from {schema}.runlane_migrations")
    assert ledger[0] >= 4


# -- maintenance --------------------------------------------------------------------------------


@task(id="grants.tick")
def tick(payload: dict[str, Any], context: RunContext) -> None:
    return None


def test_a_maintenance_role_runs_passes_and_services(
    database_url: str,
    schema: str,
    granted: RoleMaker,
    runtimes: Callable[[Runlane], Runlane],
    db: Conn,
) -> None:
    every_second = schedule(id="grants.every-second", task=tick, cron="* * * * * *")
    retention = RetentionPolicy(completed=timedelta(days=1))
    producer = runtimes(runtime_as(granted("producer"), schema))
    worker_conninfo = granted("worker")
    worker_rl = runtimes(runtime_as(worker_conninfo, schema))
    maintenance = runtimes(
        runtime_as(
            granted("maintenance"),
            schema,
            tasks=[*TASKS, tick],
            schedules=[every_second],
            retention=retention,
        )
    )
    data = SchemaDb(db, schema)
    # an old completed parent with a step, and its completed child: cleanup deletes both,
    # their attempts and steps going with them through the foreign keys
    old = producer.trigger(parent, {"n": 1})
    worker_rl.drain()
    worker_rl.drain()
    assert producer.get_run(old.id).status is RunStatus.COMPLETED
    data.run(
        "update {schema}.runs set finished_at = now() - interval '3 days' "
        "where status = 'completed'"
    )
    # an attempt whose lease lapses: claimed by a worker role that then says nothing
    lapsing = producer.trigger(leaf, {"n": 2})
    claims = PostgresStorage(connection_string=worker_conninfo, schema=schema)
    try:
        [claimed] = claims.run_claim("default", ["default"], 1, timedelta(seconds=1))
    finally:
        claims.close()
    assert claimed.id == lapsing.id
    # a token that times out, with a run waiting on it
    token = producer.create_wait_token(timeout=timedelta(seconds=1))
    waiter = producer.trigger(approve, {"token": str(token.id)})
    worker_rl.drain()
    assert producer.get_run(waiter.id).status is RunStatus.WAITING
    # the lease and the token's timeout lapse (1.3 s of the database's clock, not waited for)
    elapse(db, schema, 1.3, "runs.lease_expires_at", "wait_tokens.timeout_at")

    first = maintenance.run_maintenance_once()  # sees the schedule first: waits for a slot
    assert first.attempts_expired == 1
    assert first.wait_tokens_timed_out == 1
    assert first.wait_token_runs_resumed == 1
    # the child is deleted (its step and attempt with it), the parent becomes a tombstone
    assert (first.runs_pruned, first.runs_tombstoned) == (1, 1)
    assert producer.get_run(lapsing.id).status is RunStatus.RETRYING
    assert data.one("select count(*) from {schema}.steps") == (0,)
    # the next schedule slot, and the expired attempt's retry, come due (1.3 s more)
    elapse(db, schema, 1.3, "schedules.next_slot_at", "runs.due_at")
    second = maintenance.run_maintenance_once()
    assert second.schedules_created == 1
    assert second.runs_pruned == 1  # the tombstone, its children gone
    assert data.one("select count(*) from {schema}.runs where id = %s", old.id) == (0,)
    assert data.one("select count(*) from {schema}.attempts where run_id = %s", old.id) == (0,)
    assert second.due_runs_delivered >= 1  # the expired attempt's retry came due
    assert data.one("select count(*) from {schema}.runs where task_id = 'grants.tick'") == (1,)

    # the services: bands leased, refreshed and released under the maintenance role
    with maintenance.start_services() as services:
        wait_until(
            lambda: data.one("select count(*) from {schema}.maintenance_leases")[0] > 0,
            timeout=15,
            what="the maintenance bands to be leased",
        )
        # every phase made a pass under the role (the sleep this replaced let them run)
        assert services.wait_for(lambda: all(services.passes.values()), timeout=15)
        services.close(timeout=10)
        services.wait_until_closed(timeout=10)


# -- operator -----------------------------------------------------------------------------------


def test_an_operator_role_inspects_retries_and_cancels(
    schema: str, granted: RoleMaker, runtimes: Callable[[Runlane], Runlane]
) -> None:
    conninfo = granted("operator")
    producer = runtimes(runtime_as(granted("producer"), schema))
    worker_rl = runtimes(runtime_as(granted("worker"), schema))
    operator = runtimes(runtime_as(conninfo, schema))
    failed = producer.trigger(doomed, {})
    done = producer.trigger(leaf, {"n": 3})
    worker_rl.drain()
    token = producer.create_wait_token()
    waiting = producer.trigger(approve, {"token": str(token.id)})
    worker_rl.drain()
    queued = producer.trigger(leaf, {"n": 4})

    page = operator.list_runs(limit=10)
    assert {r.id for r in page.runs} == {failed.id, done.id, queued.id, waiting.id}
    assert [r.id for r in operator.list_runs(status="failed").runs] == [failed.id]
    history = operator.get_run_history(done.id)
    assert [a.outcome for a in history.attempts] == ["completed"]
    assert [s.name for s in history.steps] == ["side"]
    report = operator.status()
    assert report.waiting == 1

    retried = operator.retry_run(failed.id)
    assert retried.status is RunStatus.QUEUED
    assert operator.cancel(queued.id).status is RunStatus.CANCELLED
    assert operator.cancel(waiting.id).status is RunStatus.CANCELLED
    assert operator.retry_run(queued.id).status is RunStatus.QUEUED

    # an operator does not trigger, claim or complete runs
    with pytest.raises(ConfigurationError, match="lacks a privilege"):
        operator.trigger(leaf, {"n": 5})
    with pytest.raises(ConfigurationError, match="lacks a privilege"):
        operator.drain()


# -- the outbox of RabbitMQ-lane environments ----------------------------------------------------


def test_triggers_write_outbox_items_under_the_producer_role(
    schema: str, granted: RoleMaker, runtimes: Callable[[Runlane], Runlane], db: Conn
) -> None:
    """An environment delivered through RabbitMQ has an outbox_environments row; the insert
    trigger then writes an outbox item with the producer's privileges. No broker needed."""
    data = SchemaDb(db, schema)
    data.run("insert into {schema}.outbox_environments values ('default', 300)")
    polling_producer = granted("producer")
    producer = runtimes(runtime_as(polling_producer, schema))
    handle = producer.trigger(leaf, {"n": 1})
    with psycopg.connect(polling_producer) as conn:
        inside = producer.trigger(leaf, {"n": 2}, connection=conn)
    items = data.all("select run_id, claim_token from {schema}.outbox order by created_at")
    assert {row[0] for row in items} == {handle.id, inside.id}

    # publishing is the RabbitMQ lane's grant: a polling-lane producer may not claim items
    storage = PostgresStorage(connection_string=polling_producer, schema=schema)
    try:
        with pytest.raises(ConfigurationError, match="lacks a privilege"):
            storage.outbox_claim_page("default", 10, timedelta(seconds=30))
    finally:
        storage.close()
    publisher = PostgresStorage(
        connection_string=granted("producer", lane="rabbitmq"), schema=schema
    )
    try:
        publisher.outbox_enable("default", timedelta(seconds=60))
        page = publisher.outbox_claim_page("default", 10, timedelta(seconds=30))
        assert {item.run_id for item in page} == {handle.id, inside.id}
        first, second = page
        assert publisher.outbox_published([first]) == {first.id}
        assert publisher.outbox_failed([second], "broker down", timedelta(0)) == {second.id}
        assert publisher.outbox_next_due("default") is not None
    finally:
        publisher.close()


def test_rabbitmq_lane_runtimes_run_under_their_grants(
    schema: str,
    granted: RoleMaker,
    runtimes: Callable[[Runlane], Runlane],
    rabbitmq_url: str,
) -> None:
    """Every runtime of the RabbitMQ lane enables its environment's outbox and publishes:
    each job's grant with lane="rabbitmq" covers it, and the consumer's claim by id."""
    from runlane.rabbitmq import rabbitmq_lane  # noqa: PLC0415 - needs pika

    conninfos: dict[str, str] = {}

    def runtime(job: str) -> Runlane:
        conninfos[job] = granted(job, lane="rabbitmq")
        lane = rabbitmq_lane(
            connection_string=conninfos[job],
            schema=schema,
            amqp_url=rabbitmq_url,
            connect_timeout=3.0,
        )
        return runtimes(create_runlane(lane=lane, queues=QUEUES, tasks=TASKS))

    producer, worker_rl, maintenance, operator = (
        runtime(job) for job in ("producer", "worker", "maintenance", "operator")
    )
    with worker_rl.create_delivery_worker(concurrency=2):
        eager = producer.trigger(leaf, {"n": 1})  # published by the producer after commit
        with psycopg.connect(conninfos["producer"]) as conn:  # stored unclaimed, swept
            swept = producer.trigger(leaf, {"n": 2}, connection=conn)
        failing = producer.trigger(doomed, {})
        for handle in (eager, swept):
            assert producer.wait_for_run(handle.id, timeout=30).status is RunStatus.COMPLETED
        assert producer.wait_for_run(failing.id, timeout=30).status is RunStatus.FAILED
        assert operator.retry_run(failing.id).status is RunStatus.QUEUED
        again = producer.wait_for_run(failing.id, timeout=30)
        assert (again.status, again.attempt) == (RunStatus.FAILED, 2)
        maintenance.run_maintenance_once()  # publishes pending items, recovers deliveries
        assert operator.status().outbox_pending == 0


# -- bad input ----------------------------------------------------------------------------------


def _acls(db: Conn, schema: str) -> list[tuple[Any, ...]]:
    return db.execute(
        "select c.relname, c.relacl::text, "
        "(select array_agg(attacl::text order by attnum) from pg_attribute "
        " where attrelid = c.oid and attacl is not null) "
        "from pg_class c join pg_namespace n on n.oid = c.relnamespace "
        "where n.nspname = %s order by c.relname",
        (schema,),
    ).fetchall()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"job": "admin"},
            "unknown job 'admin': grant one of producer, worker, maintenance, operator",
        ),
        ({"job": "Producer"}, "unknown job"),
        ({"job": None}, "unknown job"),
        ({"role": 'x"; drop table runs; --'}, "role name .* is not valid"),
        ({"role": "x; drop table runs"}, "is not valid"),
        ({"role": ""}, "is not valid"),
        ({"role": "a" * 64}, "is not valid"),
        ({"role": "bad\x00role"}, "is not valid"),
        ({"role": "public"}, "reserved"),
        ({"role": "pg_monitor"}, "reserved"),
        ({"role": "CURRENT_USER"}, "reserved"),
        ({"lane": "kafka"}, "unknown lane"),
        ({"schema": "rl; drop schema public"}, "schema name .* is not valid"),
        ({"schema": "pg_catalog"}, "reserved"),
    ],
)
def test_bad_input_is_refused_before_anything_is_granted(
    database_url: str, schema: str, db: Conn, options: dict[str, Any], message: str
) -> None:
    before = _acls(db, schema)
    arguments = {"schema": schema, "job": "producer", "role": "someone", **options}
    with pytest.raises(ConfigurationError, match=message):
        postgres_grant_sql(**arguments)
    with pytest.raises(ConfigurationError, match=message):
        grant_postgres_role(connection_string=database_url, **arguments)
    assert _acls(db, schema) == before


def test_an_unknown_role_or_schema_is_a_clear_error(
    database_url: str,
    schema: str,
    db: Conn,
    make_role: Callable[[], tuple[str, str]],
) -> None:
    before = _acls(db, schema)
    missing = f"nobody_{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigurationError, match=f"role '{missing}' does not exist.*CREATE ROLE"):
        grant_postgres_role(
            connection_string=database_url, schema=schema, job="worker", role=missing
        )
    name, _ = make_role()
    with pytest.raises(ConfigurationError, match=f"case-sensitive: there is a role '{name}'"):
        grant_postgres_role(
            connection_string=database_url, schema=schema, job="worker", role=name.upper()
        )
    assert _acls(db, schema) == before
    with pytest.raises(SchemaNotMigrated, match=r"does not exist.*runlane migrate"):
        grant_postgres_role(
            connection_string=database_url, schema="t_never_made", job="worker", role=name
        )
    # granting twice, or several jobs to one role, is fine
    for job in ("worker", "worker", "maintenance"):
        result = grant_postgres_role(
            connection_string=database_url, schema=schema, job=job, role=name
        )
        assert (result.role, result.job, result.schema) == (name, job, schema)


def test_grants_into_an_unmigrated_schema_say_to_migrate(
    database_url: str, fresh_schema: str, db: Conn, make_role: Callable[[], tuple[str, str]]
) -> None:
    name, _ = make_role()
    db.execute(sql.SQL("create schema {}").format(sql.Identifier(fresh_schema)))
    with pytest.raises(SchemaNotMigrated, match="runlane migrate"):
        grant_postgres_role(
            connection_string=database_url, schema=fresh_schema, job="producer", role=name
        )


def test_a_runtime_under_a_role_without_grants_says_what_to_do(
    schema: str, make_role: Callable[[], tuple[str, str]], runtimes: Callable[[Runlane], Runlane]
) -> None:
    _, conninfo = make_role()
    bare = runtimes(runtime_as(conninfo, schema))
    with pytest.raises(RunlaneError, match=r"lacks a privilege.*runlane grant"):
        bare.trigger(leaf, {"n": 1})


def test_the_documented_revoke_takes_every_job_away(
    database_url: str, schema: str, db: Conn, make_role: Callable[[], tuple[str, str]]
) -> None:
    name, _ = make_role()
    for job in GRANT_JOBS:
        grant_postgres_role(
            connection_string=database_url, schema=schema, job=job, role=name, lane="rabbitmq"
        )
    s, r = sql.Identifier(schema), sql.Identifier(name)
    db.execute(sql.SQL("revoke all on all tables in schema {} from {}").format(s, r))
    db.execute(sql.SQL("revoke all on all functions in schema {} from {}").format(s, r))
    db.execute(sql.SQL("revoke all on schema {} from {}").format(s, r))
    left = db.execute(
        "select count(*) from pg_class c join pg_namespace n on n.oid = c.relnamespace "
        "where n.nspname = %s and c.relkind = 'r' and (has_any_column_privilege(%s, c.oid, "
        "'select, insert, update, references') or has_table_privilege(%s, c.oid, 'delete'))",
        (schema, name, name),
    ).fetchone()
    assert left == (0,)
    assert db.execute(
        "select has_schema_privilege(%s, %s, 'usage')", (name, schema)
    ).fetchone() == (False,)


# -- the command line ---------------------------------------------------------------------------


def test_cli_grant_and_print(
    database_url: str,
    schema: str,
    db: Conn,
    make_role: Callable[[], tuple[str, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    name, conninfo = make_role()
    assert main(["grant", "producer", name, "--schema", schema, "--print"]) == 0
    printed = capsys.readouterr().out
    assert printed == postgres_grant_sql(job="producer", role=name, schema=schema)
    assert _acls(db, schema) == _acls(db, schema)  # --print changed nothing (no connection)

    code = main(["grant", "producer", name, "--schema", schema, "--database-url", database_url])
    assert code == 0
    assert f"granted the producer job (polling lane) to role {name}" in capsys.readouterr().out
    with psycopg.connect(conninfo) as conn:  # the role can now read runs
        conn.execute(sql.SQL("select count(*) from {}.runs").format(sql.Identifier(schema)))

    missing = f"nobody_{uuid.uuid4().hex[:8]}"
    code = main(["grant", "worker", missing, "--schema", schema, "--database-url", database_url])
    assert code == 2
    assert f"runlane: error: role '{missing}' does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["grant", "admin", name, "--print"])
    assert exited.value.code == 2
    assert "invalid choice: 'admin'" in capsys.readouterr().err
    assert main(["grant", "worker", 'x"; drop table runs', "--print"]) == 2
    assert "is not valid" in capsys.readouterr().err


# -- delivery workers' rows ------------------------------------------------------------------------


def test_workers_register_under_the_worker_role_and_are_listed_and_pruned_by_the_others(
    schema: str, granted: RoleMaker, runtimes: Callable[[Runlane], Runlane]
) -> None:
    producer = runtimes(runtime_as(granted("producer"), schema))
    worker_conninfo = granted("worker")
    worker_rl = runtimes(runtime_as(worker_conninfo, schema))
    operator_conninfo = granted("operator")
    operator = runtimes(operator_as(operator_conninfo, schema))
    maintenance = runtimes(
        runtime_as(granted("maintenance"), schema, retention=RetentionPolicy(workers=timedelta(0)))
    )
    handle = producer.trigger(leaf, {"n": 1})
    # the worker role registers, heartbeats, records itself on claims and attempts, stops
    with worker_rl.create_delivery_worker(concurrency=1) as worker:
        wait_until(
            lambda: [w.worker_id for w in operator.list_workers()] == [worker.worker_id],
            timeout=10,
            what="the worker's registration",
        )
        wait_until(
            lambda: producer.get_run(handle.id).status is RunStatus.COMPLETED,
            timeout=10,
            what="the run to complete",
        )
    assert worker.wait_until_closed(0) is True
    (attempt,) = operator.get_run_history(handle.id).attempts
    assert attempt.worker_id == worker.worker_id
    assert attempt.host is not None
    (row,) = operator.list_workers(include_stopped=True)
    assert row.state.value == "stopped"
    # only maintenance deletes rows; neither a worker nor an operator can
    s = sql.Identifier(schema)
    denied(worker_conninfo, sql.SQL("delete from {}.workers").format(s))
    denied(operator_conninfo, sql.SQL("delete from {}.workers").format(s))
    denied(operator_conninfo, sql.SQL("update {}.workers set state = 'stopped'").format(s))
    denied(worker_conninfo, sql.SQL("update {}.workers set host = 'elsewhere'").format(s))
    assert maintenance.run_maintenance_once().workers_pruned == 1
    assert operator.list_workers(include_stopped=True) == []


# -- progress and bulk actions (issue 19) --------------------------------------------------------


@task(id="grants.reports")
def reports(payload: dict[str, Any], context: RunContext) -> str:
    context.report_progress(fraction=1.0, message="all done", data={"n": 1})
    return "reported"


def test_a_worker_reports_progress_and_an_operator_runs_bulk_actions(
    schema: str, granted: RoleMaker, runtimes: Callable[[Runlane], Runlane]
) -> None:
    worker_rl = runtimes(
        runtime_as(granted("worker"), schema, tasks=[reports, doomed, parent, leaf])
    )
    operator = runtimes(operator_as(granted("operator"), schema))
    reported = worker_rl.trigger(reports, {})
    failed = [worker_rl.trigger(doomed, {}) for _ in range(2)]
    family = worker_rl.trigger(parent, {"n": 1})
    while worker_rl.drain().runs_executed:
        pass
    progress = operator.get_run(reported.id).progress
    assert progress == {"fraction": 1.0, "message": "all done", "data": {"n": 1}}
    assert operator.get_run(family.id).status is RunStatus.COMPLETED

    assert operator.retry_runs(status="failed").changed == 2
    assert operator.cancel_runs(status="queued").changed == 2
    assert {operator.get_run(r.id).status for r in failed} == {RunStatus.CANCELLED}
    # the parent and its child (completed) go in one batch: the parent as a tombstone
    deleted = operator.delete_runs(status=["completed", "cancelled"])
    assert (deleted.matched, deleted.changed) == (5, 5)
    assert operator.list_runs(limit=10).runs[0].id == family.id  # the tombstone


# -- schedules ----------------------------------------------------------------------------------


def test_an_operator_role_lists_pauses_resumes_and_runs_schedules(
    schema: str, granted: RoleMaker, runtimes: Callable[[Runlane], Runlane], db: Conn
) -> None:
    """From a database URL alone (no tasks): the operator runs a schedule as stored, through
    a function it may execute, and still cannot insert runs of its own making."""
    hourly = schedule(id="grants.hourly", task=tick, cron="0 * * * *", payload={"n": 1})
    maintenance = runtimes(
        runtime_as(granted("maintenance"), schema, tasks=[tick], schedules=[hourly])
    )
    maintenance.run_maintenance_once()  # stores the schedule and its definition
    conninfo = granted("operator")
    operator = runtimes(operator_as(conninfo, schema))
    (info,) = operator.list_schedules()
    assert (info.id, info.task_id, info.paused) == ("grants.hourly", "grants.tick", False)
    assert operator.pause_schedule("grants.hourly") is True
    assert operator.status().late_schedules == ()
    assert operator.resume_schedule("grants.hourly") is True
    handle = operator.trigger_schedule_now("grants.hourly", idempotency_key="k")
    assert handle.created is True
    assert operator.trigger_schedule_now("grants.hourly", idempotency_key="k").id == handle.id
    data = SchemaDb(db, schema)
    assert data.one("select task_id, payload from {schema}.runs where id = %s", handle.id) == (
        "grants.tick",
        {"n": 1},
    )
    # nothing else: no runs of its own, no schedule definitions, no slots
    s = sql.Identifier(schema)
    denied(
        conninfo,
        sql.SQL(
            "insert into {}.runs (id, environment, task_id, queue, status, priority, payload, "
            "max_attempts, due_at) values (gen_random_uuid(), 'default', 'grants.tick', "
            "'default', 'queued', 0, '{{}}', 1, now())"
        ).format(s),
    )
    denied(conninfo, sql.SQL("update {}.schedules set payload = '{{}}'").format(s))
    denied(conninfo, sql.SQL("update {}.schedules set last_run_id = null").format(s))
    denied(conninfo, sql.SQL("delete from {}.schedule_slots").format(s))
    # and the function is not for every role: a worker may not execute it
    worker_conninfo = granted("worker")
    denied(
        worker_conninfo,
        sql.SQL(
            "select * from {}.runlane_run_schedule('default', 'grants.hourly', "
            "gen_random_uuid(), null, null)"
        ).format(s),
    )


# -- the operator CLI ---------------------------------------------------------------------------


def test_the_operator_cli_runs_under_the_operator_role_alone(
    *,
    schema: str,
    granted: RoleMaker,
    runtimes: Callable[[Runlane], Runlane],
    db: Conn,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every operator command, from a database URL of a role granted only ``operator``; the
    role still cannot trigger runs or claim them."""
    hourly = schedule(id="grants.hourly", task=tick, cron="0 * * * *", payload={"n": 1})
    app = runtimes(runtime_as(granted("worker"), schema, tasks=[leaf, doomed, tick]))
    maintenance = runtimes(
        runtime_as(granted("maintenance"), schema, tasks=[tick], schedules=[hourly])
    )
    maintenance.run_maintenance_once()
    failed = [app.trigger(doomed, {}).id for _ in range(3)]
    done = app.trigger(leaf, {"n": 1}).id
    while app.drain().runs_executed:
        pass
    queued = [app.trigger(leaf, {"n": 2}).id for _ in range(2)]
    worker = app.create_delivery_worker(concurrency=1, queues=["default"])
    worker.close(10)  # its row stays, stopped
    # the environment delivers through an outbox (as on the RabbitMQ lane): a resume and a
    # retry under the operator role write outbox items
    data = SchemaDb(db, schema)
    data.run(
        "insert into {schema}.outbox_environments (environment, claim_seconds)"
        " values ('default', 30)"
    )

    conninfo = granted("operator")

    def cli(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        code = main([*argv, "--database-url", conninfo, "--schema", schema])
        captured = capsys.readouterr()
        assert "lacks a privilege" not in captured.err, captured.err
        return code, captured.out

    code, out = cli("status")
    assert code in (0, 1)
    assert "workers" in out
    code, out = cli("runs", "list", "--json")
    assert (code, len(json.loads(out)["runs"])) == (0, 6)
    code, out = cli("runs", "show", str(done), "--json")
    assert (code, json.loads(out)["run"]["status"]) == (0, "completed")
    assert cli("runs", "retry", str(failed[0]))[0] == 0
    assert cli("runs", "retry", "--status", "failed", "--yes")[1].endswith(
        "2 of 2 matching runs retried\n"
    )
    assert cli("runs", "cancel", "--status", "queued", "--yes")[0] == 0
    assert {app.get_run(i).status for i in [*failed, *queued]} == {RunStatus.CANCELLED}
    code, out = cli("runs", "delete", "--status", "cancelled", "--yes")
    assert (code, out.splitlines()[-1]) == (0, "5 of 5 matching runs deleted")
    items = data.one("select count(*) from {schema}.outbox")[0]
    assert items >= 3  # the retried runs became queued in an outbox environment

    app.trigger(leaf, {"n": 3})
    assert cli("queues", "pause", "default", "--reason", "grants")[0] == 0
    data.run("delete from {schema}.outbox")  # as a consumer acknowledging a paused delivery
    assert cli("queues", "resume", "default")[0] == 0
    assert data.one("select count(*) from {schema}.outbox")[0] == 1  # announced again
    code, out = cli("queues", "list", "--json")
    assert (code, [q["paused"] for q in json.loads(out)]) == (0, [False])
    code, out = cli("workers", "--all", "--json")
    assert (code, [w["state"] for w in json.loads(out)]) == (0, ["stopped"])
    code, out = cli("schedules", "list", "--json")
    assert (code, [s["id"] for s in json.loads(out)]) == (0, ["grants.hourly"])
    assert cli("schedules", "pause", "grants.hourly")[0] == 0
    assert cli("schedules", "resume", "grants.hourly")[0] == 0
    code, out = cli("schedules", "run", "grants.hourly")
    assert code == 0
    assert app.get_run(out.split()[1]).task_id == "grants.tick"

    # and nothing more: no runs of its own, no claims, no attempts
    operator = runtimes(runtime_as(conninfo, schema))
    with pytest.raises(ConfigurationError, match="lacks a privilege"):
        operator.trigger(leaf, {"n": 5})
    with pytest.raises(ConfigurationError, match="lacks a privilege"):
        operator.drain()
    s = sql.Identifier(schema)
    denied(
        conninfo,
        sql.SQL("update {}.runs set attempt = attempt + 1, started_at = now()").format(s),
    )
    denied(
        conninfo,
        sql.SQL(
            "insert into {}.attempts (run_id, attempt, lease_token, outcome, started_at) "
            "select id, 1, gen_random_uuid(), 'completed', now() from {}.runs"
        ).format(s, s),
    )
    denied(conninfo, sql.SQL("delete from {}.queue_states").format(s))
    denied(conninfo, sql.SQL("update {}.workers set state = 'stopped'").format(s))


def test_a_worker_role_granted_before_handler_starts_were_recorded_keeps_working(
    schema: str,
    granted: RoleMaker,
    runtimes: Callable[[Runlane], Runlane],
    db: Conn,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A role granted the worker job before runs.started_attempt existed (migration 10) may
    not record handler starts: its worker warns once, keeps executing, and status() counts
    its running runs as claimed, not started."""
    conninfo = granted("worker")
    role = conninfo_to_dict(conninfo)["user"]
    db.execute(
        sql.SQL("revoke update (started_attempt) on {}.runs from {}").format(
            sql.Identifier(schema), sql.Identifier(str(role))
        )
    )
    producer = runtimes(runtime_as(granted("producer"), schema))
    operator = runtimes(runtime_as(granted("operator"), schema))
    worker_rl = runtimes(runtime_as(conninfo, schema))
    held = producer.trigger(blocker, {})
    with (
        caplog.at_level(logging.WARNING, logger="runlane.lifecycle"),
        logged("cannot record") as warned,
    ):
        worker = worker_rl.create_delivery_worker(concurrency=1)
        assert warned.wait(15), "no warning"
        report = operator.status()
        assert (report.running, report.claimed_not_started) == (1, 1)
        assert not producer.get_run(held.id).executing
        worker.close(timeout=10)  # the blocker is asked to stop: handed back
    assert worker.wait_until_closed(timeout=1) is True  # never a worker failure
    assert producer.get_run(held.id).status is RunStatus.QUEUED
    warnings = [r for r in caplog.records if "cannot record" in r.getMessage()]
    assert len(warnings) == 1
    assert "runlane grant worker ROLE" in warnings[0].getMessage()
