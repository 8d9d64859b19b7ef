"""Least privilege held by the database, not only by the API: a role logged in with raw SQL
can take none of the actions ``docs/security.md`` says its job may not take.

Each role is created and granted as ``test_grants.py`` does (``runlane grant``); the runs it
tries to change are written by the owner in every status. A statement a role may not run
fails with ``InsufficientPrivilege`` (a missing grant, or migration 14's guard triggers) or a
table check, and every row is left as it was. A property test (hypothesis) then tries every
status change with the columns it needs, as each job and as an operator role still holding
the grants of releases before schema version 14.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from runlane import RunContext, RunStatus, task
from runlane.postgres import apply_postgres_storage_migrations, grant_postgres_role
from runlane.postgres._compat import marker_of
from runlane.postgres._migrations import _checksum
from runlane.postgres._sql import load_migration_files, render
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb

RoleMaker = Callable[..., str]
STATUSES = (
    "queued",
    "running",
    "retrying",
    "released",
    "waiting",
    "cancellation_requested",
    "completed",
    "failed",
    "cancelled",
)
TERMINAL = ("completed", "failed", "cancelled")
LEASED = ("running", "cancellation_requested")
# what an attempt ends in, besides completed and cancelled
ENDS = ("failed", "retrying", "released", "waiting")
# what maintenance's expiry makes of an attempt whose lease lapsed
EXPIRED = ("failed", "retrying", "cancelled")
REFUSED = (
    psycopg.errors.InsufficientPrivilege,
    psycopg.errors.CheckViolation,
    psycopg.errors.NotNullViolation,
)

# what an operator role was granted on runs and attempts before schema version 14
OLD_OPERATOR_GRANTS = """
grant update (status, due_at, releases, error, output, finished_at, lease_token,
              lease_expires_at, wait_kind, wait_token_id, wait_run_id, updated_at)
    on {schema}.runs to {role};
grant delete on {schema}.runs to {role};
grant update (payload, pruned_at, remaining_children) on {schema}.runs to {role};
grant delete on {schema}.attempts to {role};
"""


def stale_operator(make_role: Callable[[], tuple[str, str]], db: Conn, schema: str) -> str:
    """A role holding what the operator job was granted on runs before schema version 14
    (and what reads them); its conninfo."""
    name, conninfo = make_role()
    grants = OLD_OPERATOR_GRANTS.replace("{schema}", "{s}").replace("{role}", "{r}")
    db.execute(
        sql.SQL(grants + "grant usage on schema {s} to {r}; grant select on {s}.runs to {r};")
        .format(s=sql.Identifier(schema), r=sql.Identifier(name))
    )  # fmt: skip
    return conninfo


class Runs(SchemaDb):
    """One run in each status (and one running whose lease lapsed), written by the owner."""

    def make(self, status: str, *, lapsed: bool = False) -> uuid.UUID:
        run_id = uuid.uuid4()
        leased = status in LEASED
        self.run(
            "insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
            "output, max_attempts, due_at, attempt, lease_token, lease_expires_at, "
            "finished_at, wait_kind) "
            "values (%s, 'default', 'grants.leaf', 'default', %s, '{{\"n\": 1}}', %s, 3, now(), "
            "%s, %s, now() + %s * interval '1 minute', %s, %s)",
            run_id,
            status,
            '"real"' if status == "completed" else None,
            1 if leased or status in TERMINAL else 0,
            uuid.uuid4() if leased else None,
            (-1 if lapsed else 5) if leased else None,
            "2026-01-01" if status in TERMINAL else None,
            "sleep" if status == "waiting" else None,
        )
        self.run(
            "insert into {schema}.attempts (run_id, attempt, lease_token, outcome, started_at) "
            "select id, 1, gen_random_uuid(), 'failed', now() from {schema}.runs "
            "where id = %s and status in ('completed', 'failed', 'cancelled')",
            run_id,
        )
        return run_id

    def snapshot(self) -> list[tuple[Any, ...]]:
        return self.all(
            "select r::text from {schema}.runs as r "
            "union all select a::text from {schema}.attempts as a order by 1"
        )


@pytest.fixture
def runs(db: Conn, schema: str) -> Runs:
    return Runs(db, schema)


def refused(conninfo: str, schema: str, statement: str, *params: Any) -> None:
    """The role's statement fails for lack of a privilege or on a table check."""
    text = sql.SQL(statement).format(schema=sql.Identifier(schema))
    with psycopg.connect(conninfo, autocommit=True) as conn, pytest.raises(REFUSED):
        conn.execute(text, params)


def function_call(
    conninfo: str, schema: str, function: str, run_id: uuid.UUID, action: str | None = None
) -> list[Any]:
    """The function on one run, in a transaction of its own (with ``action``: the overload
    of schema version 24 naming the audit action; a call that changes a run then needs the
    record)."""
    named = sql.SQL("") if action is None else sql.SQL(", {}").format(sql.Literal(action))
    text = sql.SQL("select * from {}.{}('default', %s, false{})").format(
        sql.Identifier(schema), sql.Identifier(function), named
    )
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return conn.execute(text, ([run_id],)).fetchall()


FORGE = "update {schema}.runs set status = 'completed', output = '\"forged\"', "
FINISH = "finished_at = now(), lease_token = null, lease_expires_at = null where id = %s"


@pytest.mark.parametrize("job", ["producer", "worker", "maintenance", "operator"])
def test_no_role_forges_cancels_retries_or_deletes_through_sql(
    job: str, schema: str, granted: RoleMaker, runs: Runs
) -> None:
    conninfo = granted(job)
    queued = runs.make("queued")
    running = runs.make("running")
    waiting = runs.make("waiting")
    failed = runs.make("failed")
    completed = runs.make("completed")
    before = runs.snapshot()

    # complete a run that nobody claimed, with an output of its choosing
    refused(conninfo, schema, FORGE + FINISH, queued)
    # rewrite a completed run's output, or a queued run's payload
    refused(
        conninfo, schema, "update {schema}.runs set output = '\"forged\"' where id = %s", completed
    )
    refused(
        conninfo, schema, "update {schema}.runs set payload = '{{\"n\": 2}}' where id = %s", queued
    )
    # cancel a run, or ask a running one to stop: the operator's, through its function
    refused(
        conninfo,
        schema,
        "update {schema}.runs set status = 'cancelled', finished_at = now() where id = %s",
        queued,
    )
    refused(
        conninfo,
        schema,
        "update {schema}.runs set status = 'cancelled', finished_at = now(), wait_kind = null "
        "where id = %s",
        waiting,
    )
    refused(
        conninfo,
        schema,
        "update {schema}.runs set status = 'cancellation_requested' where id = %s",
        running,
    )
    # retry a failed run (or bring a completed one back)
    for finished in (failed, completed):
        refused(
            conninfo,
            schema,
            "update {schema}.runs set status = 'queued', finished_at = null, error = null, "
            "output = null where id = %s",
            finished,
        )
    # start a run that is not queued (a claim of a failed run would re-run it)
    refused(
        conninfo,
        schema,
        "update {schema}.runs set status = 'running', attempt = attempt + 1, "
        "lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute', "
        "finished_at = null where id = %s",
        failed,
    )
    # delete runs, live or finished, or their attempts; tombstone a live run
    for doomed in (queued, running, completed):
        refused(conninfo, schema, "delete from {schema}.runs where id = %s", doomed)
    refused(conninfo, schema, "delete from {schema}.attempts where run_id = %s", completed)
    refused(
        conninfo,
        schema,
        "update {schema}.runs set pruned_at = now(), remaining_children = 0, "
        "payload = 'null' where id = %s",
        queued,
    )
    if job != "worker":
        # complete or fail an attempt whose lease is live: only the worker job's (it claims)
        refused(conninfo, schema, FORGE + FINISH, running)
        refused(
            conninfo,
            schema,
            "update {schema}.runs set status = 'failed', error = '{{}}', " + FINISH,
            running,
        )
        # claim a queued run
        refused(
            conninfo,
            schema,
            "update {schema}.runs set status = 'running', attempt = attempt + 1, "
            "lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute' "
            "where id = %s",
            queued,
        )
    # the operator's functions: not for the producer and the worker; maintenance may only
    # delete (cleanup, the unaudited 3-argument function), the operator only through the
    # overloads naming the audit action (schema version 24); no caller deletes a live run
    # or retries a completed one
    for function in ("runlane_cancel_runs", "runlane_retry_runs", "runlane_delete_runs"):
        if not (job == "maintenance" and function == "runlane_delete_runs"):
            refused(
                conninfo,
                schema,
                "select * from {schema}." + function + "('default', %s, false)",
                [queued],
            )
        if job != "operator":
            single = function.split("_")[1]  # cancel, retry, delete
            refused(
                conninfo,
                schema,
                "select * from {schema}." + function + "('default', %s, false, %s)",
                [queued],
                single,
            )
    if job == "maintenance":
        assert function_call(conninfo, schema, "runlane_delete_runs", queued) == [(0, 0, 0)]
        assert function_call(conninfo, schema, "runlane_delete_runs", running) == [(0, 0, 0)]
    if job == "operator":  # changing nothing, they owe no record
        assert function_call(conninfo, schema, "runlane_delete_runs", queued, "delete") == [
            (0, 0, 0)
        ]
        assert function_call(conninfo, schema, "runlane_delete_runs", running, "delete") == [
            (0, 0, 0)
        ]
        assert function_call(conninfo, schema, "runlane_retry_runs", completed, "retry") == [
            (completed, "completed", False, False)
        ]
    assert runs.snapshot() == before


CHILD = (
    "insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
    "max_attempts, due_at, parent_run_id, idempotency_key) "
    "values (gen_random_uuid(), 'default', 'grants.leaf', 'default', 'queued', "
    "'{{\"forged\": true}}', 1, now(), %s, %s)"
)


@pytest.mark.parametrize("job", ["producer", "worker", "maintenance"])
def test_only_a_running_parents_worker_writes_its_children(
    job: str, schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """trigger_child's rows name their parent and take the key runlane.child:<parent>:<n>,
    which the parent adopts: a role that could write them first would forge the child's
    result. Only a role that may claim (the worker job) writes a run naming a running
    parent, and no role a key in runlane's prefix but that parent's child keys."""
    conninfo = granted(job)
    parent = runs.make("running")
    finished = runs.make("completed")
    before = runs.snapshot()
    key = f"runlane.child:{parent}:1"
    if job != "worker":
        refused(conninfo, schema, CHILD, parent, key)
        refused(conninfo, schema, CHILD, parent, None)
    refused(conninfo, schema, CHILD, finished, f"runlane.child:{finished}:1")
    refused(conninfo, schema, CHILD, parent, f"runlane.child:{finished}:1")
    refused(conninfo, schema, CHILD, None, f"runlane.child:{parent}:1")
    refused(conninfo, schema, CHILD, None, "runlane.anything")
    assert runs.snapshot() == before
    if job == "worker":
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(sql.SQL(CHILD).format(schema=sql.Identifier(schema)), (parent, key))
        assert runs.one("select count(*) from {schema}.runs where parent_run_id = %s", parent) == (
            1,
        )


@pytest.mark.parametrize("job", ["worker", "maintenance"])
def test_no_role_ends_a_run_that_has_no_attempt_or_rewrites_a_finished_one(
    job: str, schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """A queued or waiting run fails, retries, is released or suspends only from an attempt
    (a role that could fail it could then delete it as finished); a finished run keeps its
    error and finish time (a finish time in 1970 would have cleanup delete it early)."""
    conninfo = granted(job)
    queued = runs.make("queued")
    waiting = runs.make("waiting")
    failed = runs.make("failed")
    before = runs.snapshot()
    for live in (queued, waiting):
        refused(
            conninfo,
            schema,
            "update {schema}.runs set status = 'failed', finished_at = now(), "
            'error = \'{{"message": "forged"}}\', wait_kind = null where id = %s',
            live,
        )
        refused(
            conninfo,
            schema,
            "update {schema}.runs set status = 'retrying', wait_kind = null where id = %s",
            live,
        )
    refused(
        conninfo,
        schema,
        "update {schema}.runs set finished_at = '1970-01-01' where id = %s",
        failed,
    )
    refused(
        conninfo,
        schema,
        "update {schema}.runs set error = '{{\"forged\": 2}}' where id = %s",
        failed,
    )
    assert runs.snapshot() == before


def test_maintenance_ends_a_lapsed_attempt_only_as_expiry_does(
    schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """Expiry ends a lapsed attempt failed, retrying or cancelled: not parked waiting on a
    token that does not exist, not handed back; a cancellation asked for is not undone; and
    no error is written on a run but by ending a lapsed attempt."""
    conninfo = granted("maintenance")
    lapsed = runs.make("running", lapsed=True)
    stopping = runs.make("cancellation_requested", lapsed=True)
    queued = runs.make("queued")
    before = runs.snapshot()
    refused(
        conninfo,
        schema,
        "update {schema}.runs set status = 'waiting', wait_kind = 'token', "
        "wait_token_id = gen_random_uuid(), lease_token = null, lease_expires_at = null "
        "where id = %s",
        lapsed,
    )
    refused(
        conninfo,
        schema,
        "update {schema}.runs set status = 'queued', lease_token = null, "
        "lease_expires_at = null where id = %s",
        stopping,
    )
    refused(
        conninfo,
        schema,
        'update {schema}.runs set error = \'{{"message": "forged"}}\' where id = %s',
        queued,
    )
    assert runs.snapshot() == before


def test_maintenance_cannot_lapse_a_live_lease_to_end_its_attempt(
    schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """Expiry ends attempts whose lease lapsed: maintenance may not write a lease itself (move
    it into the past, or take it over) to make a live attempt look lapsed."""
    conninfo = granted("maintenance")
    running = runs.make("running")
    before = runs.snapshot()
    refused(
        conninfo,
        schema,
        "update {schema}.runs set lease_expires_at = now() - interval '1 second' where id = %s",
        running,
    )
    refused(
        conninfo,
        schema,
        "update {schema}.runs set lease_token = gen_random_uuid() where id = %s",
        running,
    )
    assert runs.snapshot() == before


@pytest.mark.parametrize("job", ["producer", "worker", "maintenance"])
def test_runs_are_written_queued_and_tokens_without_runlanes_keys(
    job: str, schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """A run inserted cancellation_requested (no lease) was one nothing could expire, cancel,
    retry or delete; a wait token's key in runlane's prefix is runlane's own."""
    conninfo = granted(job)
    before = runs.snapshot()
    for status in ("cancellation_requested", "retrying", "running", "completed"):
        refused(
            conninfo,
            schema,
            "insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
            "max_attempts, due_at, finished_at) values (gen_random_uuid(), 'default', 't', "
            "'default', %s, '{{}}', 3, now(), "
            "case when %s in ('completed') then now() end)",
            status,
            status,
        )
    refused(
        conninfo,
        schema,
        "insert into {schema}.wait_tokens (id, environment, status, idempotency_key) "
        "values (gen_random_uuid(), 'default', 'pending', 'runlane.token')",
    )
    assert runs.snapshot() == before


def test_maintenance_ends_only_attempts_whose_lease_lapsed(
    schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """Expiry is maintenance's: an attempt whose lease lapsed may end (failed, retrying);
    one whose lease is live may not, and no attempt completes."""
    conninfo = granted("maintenance")
    lapsed = runs.make("running", lapsed=True)
    refused(conninfo, schema, FORGE + FINISH, lapsed)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "update {}.runs set status = 'failed', error = '{{}}', finished_at = now(), "
                "lease_token = null, lease_expires_at = null where id = %s"
            ).format(sql.Identifier(schema)),
            (lapsed,),
        )
    assert runs.one("select status from {schema}.runs where id = %s", lapsed) == ("failed",)


def test_an_operator_role_still_holding_old_grants_can_do_no_harm(
    schema: str, make_role: Callable[[], tuple[str, str]], granted: RoleMaker, runs: Runs, db: Conn
) -> None:
    """A role granted the operator job by a release before schema version 14 kept UPDATE and
    DELETE on runs until it is granted again: the guard triggers refuse what they allowed."""
    conninfo = stale_operator(make_role, db, schema)
    queued = runs.make("queued")
    completed = runs.make("completed")
    before = runs.snapshot()
    refused(conninfo, schema, FORGE + FINISH, queued)
    refused(conninfo, schema, "delete from {schema}.runs where id = %s", queued)
    refused(conninfo, schema, "delete from {schema}.runs where id = %s", completed)
    refused(conninfo, schema, "delete from {schema}.attempts where run_id = %s", completed)
    refused(conninfo, schema, "update {schema}.runs set payload = 'null' where id = %s", queued)
    assert runs.snapshot() == before


def _statement(target: str, output: bool) -> str:
    """An UPDATE moving a run to ``target`` with the columns its table checks want."""
    sets = [f"status = '{target}'"]
    sets.append("finished_at = now()" if target in TERMINAL else "finished_at = null")
    if target in LEASED:
        sets.append("lease_token = gen_random_uuid()")
        sets.append("lease_expires_at = now() + interval '1 minute'")
    else:
        sets.append("lease_token = null, lease_expires_at = null")
    sets.append("wait_kind = 'sleep'" if target == "waiting" else "wait_kind = null")
    if target == "running":
        sets.append("attempt = attempt + 1")
    if output:
        sets.append("output = '\"forged\"'")
    return "update {schema}.runs set " + ", ".join(sets) + " where id = %s"


def forbidden(source: str, target: str, *, live: bool, claims: bool, output: bool) -> bool:
    """What migration 14 refuses a role that is not the owner (claims: the worker job). The
    statement writes a new lease for a leased target, clears it otherwise, and sets the
    finish time of a finished target (so a finished run kept finished is rewritten)."""
    completes = target == "completed" and source in LEASED
    ends_live_attempt = source in LEASED and target not in LEASED and live
    return (
        (target == "completed" != source and (source not in LEASED or not claims))
        or (target == "running" != source and (source != "queued" or not claims))
        or (target in ENDS and target != source and source not in LEASED)
        or (not claims and (target in LEASED or ends_live_attempt))
        or (not claims and source in LEASED and target not in (*LEASED, *EXPIRED))
        or (source == "cancellation_requested" and target not in (source, "cancelled", "completed"))
        or source in TERMINAL
        or (target == "cancelled" and source not in ("cancellation_requested", "cancelled"))
        or (target == "cancellation_requested" and source != target)
        or (output and not completes)
    )


@pytest.fixture
def role_conns(
    schema: str, granted: RoleMaker, make_role: Callable[[], tuple[str, str]], db: Conn
) -> Iterator[dict[str, psycopg.Connection[Any]]]:
    conninfos = {job: granted(job) for job in ("producer", "worker", "maintenance")}
    conninfos["stale operator"] = stale_operator(make_role, db, schema)
    conns = {job: psycopg.connect(info) for job, info in conninfos.items()}
    yield conns
    for conn in conns.values():
        conn.close()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    job=st.sampled_from(["producer", "worker", "maintenance", "stale operator"]),
    source=st.sampled_from(STATUSES),
    target=st.sampled_from(STATUSES),
    lapsed=st.booleans(),
    output=st.booleans(),
)
def test_every_status_change_a_role_makes_is_one_its_job_may_make(
    schema: str,
    runs: Runs,
    role_conns: dict[str, psycopg.Connection[Any]],
    *,
    job: str,
    source: str,
    target: str,
    lapsed: bool,
    output: bool,
) -> None:
    run_id = runs.make(source, lapsed=lapsed)
    conn = role_conns[job]
    text = sql.SQL(_statement(target, output)).format(schema=sql.Identifier(schema))
    try:
        with conn.transaction(force_rollback=True):
            conn.execute(text, (run_id,))
            (after,) = conn.execute(
                sql.SQL("select status from {}.runs where id = %s").format(sql.Identifier(schema)),
                (run_id,),
            ).fetchone() or (None,)
            assert after == target
    except REFUSED:
        changed = False
    else:
        changed = True
    if changed:
        live = source in LEASED and not lapsed
        assert not forbidden(source, target, live=live, claims=job == "worker", output=output), (
            job,
            source,
            target,
        )


@task(id="grants_enforced.echo")
def echo(payload: dict[str, Any], context: RunContext) -> Any:
    return payload


@pytest.mark.parametrize("job", ["worker", "maintenance"])
def test_a_forged_attempt_row_stalls_no_completion(
    job: str, schema: str, granted: RoleMaker, make_runlane: RunlaneFactory, runs: Runs
) -> None:
    """Worker and maintenance write attempt history. A row written ahead through SQL, for an
    attempt that has not run, used to fail every completion (and expiry) of its batch on the
    attempts key; the batch now completes, the forged row left as it is."""
    conninfo = granted(job)
    runtime = make_runlane(tasks=[echo])
    first = runtime.trigger(echo, {"n": 1})
    second = runtime.trigger(echo, {"n": 2})
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "insert into {}.attempts (run_id, attempt, lease_token, outcome, started_at) "
                "values (%s, 1, gen_random_uuid(), 'completed', now())"
            ).format(sql.Identifier(schema)),
            (first.id,),
        )
    assert runtime.drain().runs_executed == 2
    for handle, n in ((first, 1), (second, 2)):
        run = runtime.get_run(handle.id)
        assert (run.status, run.output) == (RunStatus.COMPLETED, {"n": n})


def test_a_malformed_error_written_through_sql_breaks_no_read(
    schema: str, granted: RoleMaker, make_runlane: RunlaneFactory, runs: Runs
) -> None:
    """The worker role may write a run's error (a failed attempt writes one): a value runlane
    would not write (no type, not an object) is read as far as it goes; get_run, list_runs
    and get_run_history used to fail on it with a KeyError, for every reader of the run."""
    conninfo = granted("worker")
    runtime = make_runlane(tasks=[echo])
    queued = runtime.trigger(echo, {"n": 1})
    waiting = runs.make("queued")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for run_id, value in ((queued.id, '{"message": "x"}'), (waiting, '"just text"')):
            conn.execute(
                sql.SQL("update {}.runs set error = %s::jsonb where id = %s").format(
                    sql.Identifier(schema)
                ),
                (value, run_id),
            )
    error = runtime.get_run(queued.id).error
    assert error is not None
    assert (error.type, error.message) == ("unknown", "x")
    other = runtime.get_run(waiting).error
    assert other is not None
    assert other.message == '"just text"'
    assert {run.id for run in runtime.list_runs().runs} >= {queued.id, waiting}
    assert runtime.get_run_history(queued.id).run.error == error


STATS_ROW = (
    "insert into {schema}.stats_rollup (environment, span, minute, queue, task_id, completed, "
    "wait_counts, run_counts) values ('default', 1, %s, 'default', 'grants.leaf', %s, "
    "array_fill(0, array[54]), array_fill(0, array[54]))"
)


@pytest.mark.parametrize("job", ["producer", "worker", "maintenance", "operator"])
def test_only_maintenance_writes_the_rollup_and_only_operators_read_it(
    job: str, schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """The per-minute rollup (migration 20) is the stats band's: no other job writes it
    nor moves its fold's mark; the operator job reads it (Runlane.stats, the console,
    /metrics), producers and workers have no use for it and cannot read it."""
    conninfo = granted(job)
    runs.run(STATS_ROW, "2026-01-01T00:00:00Z", 7)
    runs.run("insert into {schema}.stats_folds values ('default', '2026-01-01T00:05:00Z')")
    snapshot = (
        "select s::text from {schema}.stats_rollup as s "
        "union all select f::text from {schema}.stats_folds as f order by 1"
    )
    before = runs.all(snapshot)
    refused(conninfo, schema, "truncate {schema}.stats_rollup")
    if job != "maintenance":
        refused(conninfo, schema, "update {schema}.stats_rollup set completed = 1000")
        refused(conninfo, schema, "delete from {schema}.stats_rollup")
        refused(conninfo, schema, STATS_ROW, "2026-01-01T00:01:00Z", 1000)
        refused(conninfo, schema, "update {schema}.stats_folds set folded_until = now()")
        refused(conninfo, schema, "insert into {schema}.stats_folds values ('other', now())")
    if job in ("producer", "worker"):
        refused(conninfo, schema, "select completed from {schema}.stats_rollup")
    else:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            text = sql.SQL("select completed from {}.stats_rollup").format(sql.Identifier(schema))
            assert conn.execute(text).fetchall() == [(7,)]
    assert runs.all(snapshot) == before


AUDIT_ROW = (
    "insert into {schema}.audit_log (id, action_id, environment, via, action, changed) "
    "values (%s, %s, 'default', 'api', 'cancel', true)"
)
RESCHEDULED = (
    "insert into {schema}.audit_log (id, action_id, environment, via, action, target, changed) "
    "values (%s, %s, 'default', 'api', 'reschedule', %s, true)"
)


@pytest.mark.parametrize("job", ["producer", "worker", "maintenance", "operator"])
def test_the_audit_trail_is_append_only_and_names_its_writer(
    job: str, schema: str, granted: RoleMaker, runs: Runs, db: Conn
) -> None:
    """No role rewrites or deletes a record, nor writes its time or database role; only the
    operator job writes records, and maintenance deletes only old ones (retention's
    function). runlane_reschedule_runs moves a queued run's due time and nothing else."""
    conninfo = granted(job)
    mine = uuid.uuid4()
    runs.run(AUDIT_ROW, mine, mine)
    before = runs.all("select a::text from {schema}.audit_log as a")
    refused(conninfo, schema, "update {schema}.audit_log set reason = 'forged'")
    refused(conninfo, schema, "update {schema}.audit_log set runs = 0, changed = false")
    refused(conninfo, schema, "delete from {schema}.audit_log")
    refused(conninfo, schema, "truncate {schema}.audit_log")
    forged = uuid.uuid4()
    refused(
        conninfo,
        schema,
        "insert into {schema}.audit_log (id, action_id, environment, via, action, changed, "
        "db_role, at) values (%s, %s, 'default', 'api', 'cancel', true, 'someone', "
        "'2000-01-01')",
        forged,
        forged,
    )
    if job != "maintenance":
        refused(conninfo, schema, "select {schema}.runlane_prune_audit('default', '1 day', 10)")
    else:  # retention keeps a day at least, whatever it is asked
        prune = "select {schema}.runlane_prune_audit('default', '0 seconds', 10)"
        with psycopg.connect(conninfo, autocommit=True) as conn:
            text = sql.SQL(prune).format(schema=sql.Identifier(schema))
            assert conn.execute(text).fetchone() == (0,)
    if job != "operator":
        refused(conninfo, schema, AUDIT_ROW, forged, forged)
    assert runs.all("select a::text from {schema}.audit_log as a") == before
    running = runs.make("running")
    completed = runs.make("completed")
    queued = runs.make("queued")
    moved = (
        "select * from {schema}.runlane_reschedule_runs('default', %s, now() + interval "
        "'1 day', now(), false, 'reschedule')"
    )
    if job != "operator":
        refused(conninfo, schema, moved, [queued])
        return
    with psycopg.connect(conninfo) as conn:  # one transaction: the move with its record
        text = sql.SQL(moved).format(schema=sql.Identifier(schema))
        for run_id, status in ((running, "running"), (completed, "completed")):
            assert conn.execute(text, ([run_id],)).fetchall() == [(run_id, status, False)]
        assert conn.execute(text, ([queued],)).fetchall() == [(queued, "queued", True)]
        # and its own records: written, with its name and the database's time
        conn.execute(
            sql.SQL(RESCHEDULED).format(schema=sql.Identifier(schema)),
            (forged, forged, str(queued)),
        )
    role = psycopg.conninfo.conninfo_to_dict(conninfo)["user"]
    (written,) = runs.all(
        "select db_role from {schema}.audit_log where id = %s and at > now() - interval '1 minute'",
        forged,
    )
    assert written == (role,)


ABSURD_DUE = ("-infinity", "infinity", "1900-01-01T00:00:00Z", "2300-01-01T00:00:00Z")
RESCHEDULE = (
    "select * from {schema}.runlane_reschedule_runs('default', %s, %s::timestamptz, now(), false, "
    "'reschedule')"
)
DUE_INSERT = (
    "insert into {schema}.runs (id, environment, task_id, queue, status, payload, max_attempts, "
    "due_at) values (%s, 'default', 'grants.leaf', 'default', 'queued', '{{}}', 3, %s)"
)


@pytest.mark.parametrize("job", ["producer", "worker", "maintenance", "operator"])
def test_no_role_wedges_a_queue_with_a_due_time_or_moves_one_unaudited(
    job: str, schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """A due time out of range (-infinity, infinity, before 1970, centuries ahead) broke every
    claim and every read of the queue's runs: no role writes one, through SQL or
    runlane_reschedule_runs (migration 23). A producer moves a due time only by resuming a
    waiting run (its resume pass after a completed wait token); workers and maintenance
    still move the due times their jobs move."""
    conninfo = granted(job)
    queued = runs.make("queued")
    retrying = runs.make("retrying")
    waiting = runs.make("waiting")
    before = runs.snapshot()
    for due in ABSURD_DUE:
        if job == "operator":
            text = sql.SQL(RESCHEDULE).format(schema=sql.Identifier(schema))
            for run_id in (queued, retrying):
                with (
                    psycopg.connect(conninfo, autocommit=True) as conn,
                    pytest.raises(psycopg.errors.InvalidParameterValue, match="1970 to 100 years"),
                ):
                    conn.execute(text, ([run_id], due))
        else:
            refused(conninfo, schema, "update {schema}.runs set due_at = %s where id = %s", due,
                    queued)  # fmt: skip
            refused(conninfo, schema, DUE_INSERT, uuid.uuid4(), due)
    if job in ("producer", "operator"):  # an unaudited reschedule
        later = "update {schema}.runs set due_at = now() + interval '1 day' where id = %s"
        refused(conninfo, schema, later, queued)
        refused(conninfo, schema, later, retrying)
    assert runs.snapshot() == before
    with psycopg.connect(conninfo, autocommit=True) as conn:
        if job == "producer":  # the resume pass
            conn.execute(
                sql.SQL(
                    "update {}.runs set status = 'queued', due_at = now(), wait_kind = null "
                    "where id = %s"
                ).format(sql.Identifier(schema)),
                (waiting,),
            )
            assert runs.one("select status from {schema}.runs where id = %s", waiting) == (
                "queued",
            )
        elif job in ("worker", "maintenance"):  # a retry's back-off, a due delivery
            conn.execute(
                sql.SQL("update {}.runs set due_at = now() + interval '1 hour' where id = %s")
                .format(sql.Identifier(schema)),
                (retrying,),
            )  # fmt: skip
            assert runs.one(
                "select due_at > now() + interval '59 minutes' from {schema}.runs where id = %s",
                retrying,
            ) == (True,)
        else:  # with its record (schema version 24)
            text = sql.SQL(RESCHEDULE).format(schema=sql.Identifier(schema))
            with conn.transaction():
                assert conn.execute(text, ([queued], "2030-01-01T00:00:00Z")).fetchall() == [
                    (queued, "queued", True)
                ]
                conn.execute(
                    sql.SQL(RESCHEDULED).format(schema=sql.Identifier(schema)),
                    (uuid.uuid4(), uuid.uuid4(), str(queued)),
                )


AUDIT_PART = (
    "insert into {schema}.audit_log (id, action_id, part, environment, via, actor, action, "
    "runs, changed) values (%s, %s, %s, %s, 'api', %s, 'bulk_retry', 999999, true)"
)


def test_an_audit_part_follows_its_action_written_by_the_same_role(
    schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """A bulk action's later parts count its runs: an operator role added a part 7 of another
    environment to an action and the listing summed it. A part follows the part before it,
    of the same action, environment, actor and database role (migration 23)."""
    mine, theirs = granted("operator"), granted("operator")
    action = uuid.uuid4()

    def part(
        conninfo: str,
        n: int,
        environment: str = "default",
        actor: str = "ann",
        of: uuid.UUID = action,
    ) -> None:
        text = sql.SQL(AUDIT_PART).format(schema=sql.Identifier(schema))
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(text, (uuid.uuid4(), of, n, environment, actor))

    part(mine, 0)
    snapshot = "select count(*) from {schema}.audit_log"
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        part(mine, 7)
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        part(mine, 1, environment="other")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        part(mine, 1, actor="bob")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        part(theirs, 1)
    with pytest.raises(psycopg.errors.InsufficientPrivilege):  # a part with no action
        part(theirs, 1, of=uuid.uuid4())
    assert runs.one(snapshot) == (1,)
    part(mine, 1)
    part(mine, 2)
    assert runs.one(snapshot) == (3,)


AUDITED = "insert into {schema}.audit_log (id, action_id, environment, via, action, target, "
AUDITED += "changed) values (gen_random_uuid(), gen_random_uuid(), 'default', 'api', %s, %s, true)"


def test_a_pause_or_resume_commits_only_with_its_audit_record(
    schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """The operator role writes queue_states and a schedule's pause itself (no function):
    through raw SQL it paused a queue and left no record. Since schema version 23 such a
    write commits only with the record of that action, for that queue or schedule, written
    in the same transaction; maintenance's writes of schedules are not asked."""
    runs.run(
        "insert into {schema}.schedules (environment, schedule_id, cron, timezone, "
        "next_slot_at) values ('default', 'nightly', '0 3 * * *', 'UTC', now())"
    )
    operator, maintenance = granted("operator"), granted("maintenance")
    pause_queue = (
        "insert into {schema}.queue_states (environment, queue, paused, updated_at) "
        "values ('default', 'q', true, now())"
    )
    pause_schedule = "update {schema}.schedules set paused = true where schedule_id = 'nightly'"
    skip_slots = (
        "update {schema}.schedules set next_slot_at = now() + interval '1 year' "
        "where schedule_id = 'nightly'"
    )
    state = (
        "select (select count(*) from {schema}.queue_states), "
        "(select paused from {schema}.schedules), (select count(*) from {schema}.audit_log)"
    )
    refused(operator, schema, pause_queue)
    refused(operator, schema, pause_schedule)
    refused(operator, schema, skip_slots)
    assert runs.one(state) == (0, False, 0)

    # a record of another action, or of another queue, is not its record
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        in_one_transaction(operator, schema, (AUDITED, ("cancel", "q")), (pause_queue, ()))
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        in_one_transaction(operator, schema, (pause_queue, ()), (AUDITED, ("pause_queue", "other")))
    assert runs.one(state) == (0, False, 0)
    in_one_transaction(operator, schema, (pause_queue, ()), (AUDITED, ("pause_queue", "q")))
    in_one_transaction(
        operator, schema, (pause_schedule, ()), (AUDITED, ("pause_schedule", "nightly"))
    )
    assert runs.one(state) == (1, True, 2)
    with psycopg.connect(maintenance, autocommit=True) as conn:  # its slot advances
        conn.execute(sql.SQL(skip_slots).format(schema=sql.Identifier(schema)))


OPERATOR_CALLS = {
    # action: the call, on %s (the runs' ids)
    "retry": "select * from {schema}.runlane_retry_runs('default', %s, false, %s)",
    "cancel": "select * from {schema}.runlane_cancel_runs('default', %s, false, %s)",
    "delete": "select * from {schema}.runlane_delete_runs('default', %s, false, %s)",
    "reschedule": "select * from {schema}.runlane_reschedule_runs('default', %s, now() + "
    "interval '1 hour', now(), false, %s)",
    "run now": "select * from {schema}.runlane_reschedule_runs('default', %s, now(), now(), "
    "false, %s)",
}
RECORD = (
    "insert into {schema}.audit_log (id, action_id, environment, via, action, target, changed) "
    "values (gen_random_uuid(), gen_random_uuid(), %s, 'api', %s, %s, true)"
)


def in_one_transaction(
    conninfo: str, schema: str, *statements: tuple[str, tuple[Any, ...]]
) -> None:
    """The statements in one transaction of the role, committed (checked at the commit)."""
    with psycopg.connect(conninfo) as conn:
        for text, params in statements:
            conn.execute(sql.SQL(text).format(schema=sql.Identifier(schema)), params)
        conn.commit()


def test_the_operators_functions_commit_only_with_their_audit_record(
    schema: str,
    granted: RoleMaker,
    runs: Runs,
    make_role: Callable[[], tuple[str, str]],
    database_url: str,
) -> None:
    """The operator role retried, cancelled, deleted and rescheduled runs by calling the
    SECURITY DEFINER functions with raw SQL, and no record was written. Since schema version
    24 it holds only their overloads naming the audit action, which commit only with that
    action's record (of that run, for a single-run action) written in the same transaction;
    maintenance's cleanup still deletes through the old function without one."""
    operator, maintenance = granted("operator"), granted("maintenance")
    target = {
        "retry": runs.make("failed"),
        "cancel": runs.make("queued"),
        "delete": runs.make("completed"),
        "reschedule": runs.make("queued"),
        "run now": runs.make("retrying"),
    }
    other = runs.make("cancelled")
    before = runs.snapshot()
    # the old signatures: not the operator's once granted
    for old in (
        "select * from {schema}.runlane_retry_runs('default', %s, false)",
        "select * from {schema}.runlane_cancel_runs('default', %s, false)",
        "select * from {schema}.runlane_delete_runs('default', %s, false)",
        "select * from {schema}.runlane_reschedule_runs('default', %s, now(), now(), false)",
    ):
        refused(operator, schema, old, [other])
    for name, call in OPERATOR_CALLS.items():
        action = "reschedule" if name == "run now" else name
        run_id = target[name]
        act = (call, ([run_id], action))
        # alone, with a record of another run or another action, or one written before
        for record in (None, (action, str(other)), ("pause_queue", str(run_id))):
            extra = () if record is None else ((RECORD, ("default", *record)),)
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="audit record"):
                in_one_transaction(operator, schema, act, *extra)
        in_one_transaction(operator, schema, (RECORD, ("default", action, str(run_id))))
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="audit record"):
            in_one_transaction(operator, schema, act)
        assert runs.snapshot() == before, name
    # a single-run action takes one run; a function takes its own actions only
    cancel = OPERATOR_CALLS["cancel"]
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="takes one run"):
        in_one_transaction(operator, schema, (cancel, ([target["cancel"], other], "cancel")))
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="records the action"):
        in_one_transaction(operator, schema, (cancel, ([target["cancel"]], "retry")))
    # with its record, each commits
    for name, call in OPERATOR_CALLS.items():
        action = "reschedule" if name == "run now" else name
        run_id = target[name]
        in_one_transaction(
            operator, schema, (call, ([run_id], action)), (RECORD, ("default", action, str(run_id)))
        )
    status = "select status, due_at > now() from {schema}.runs where id = %s"
    assert runs.one(status, target["retry"]) == ("queued", False)
    assert runs.one(status, target["cancel"])[0] == "cancelled"
    assert runs.all(status, target["delete"]) == []
    assert runs.one(status, target["reschedule"]) == ("queued", True)
    assert runs.one(status, target["run now"]) == ("queued", False)
    # a bulk action's batch: its record names the action, not each run
    bulk = (OPERATOR_CALLS["delete"], ([other], "bulk_delete"))
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="audit record"):
        in_one_transaction(operator, schema, bulk)
    in_one_transaction(operator, schema, bulk, (RECORD, ("default", "bulk_delete", "all")))
    assert runs.all(status, other) == []
    # no obligation outlives its transaction
    assert runs.one("select count(*) from {schema}.audit_owed") == (0,)
    # cleanup: maintenance deletes a finished run through the old function, unrecorded
    finished = runs.make("completed")
    assert function_call(maintenance, schema, "runlane_delete_runs", finished) == [(1, 0, 0)]
    # a role holding both jobs keeps cleanup's function, whichever is granted last
    for jobs in (("maintenance", "operator"), ("operator", "maintenance")):
        name, _ = make_role()
        for job in jobs:
            grant_postgres_role(connection_string=database_url, schema=schema, job=job, role=name)
        assert runs.one(
            "select has_function_privilege(%s, '{schema}.runlane_delete_runs(text, uuid[], "
            "boolean)', 'execute')",
            name,
        ) == (True,)


def test_a_schedule_run_by_the_operator_commits_only_with_its_audit_record(
    schema: str, granted: RoleMaker, runs: Runs
) -> None:
    """trigger_schedule_now's function (migration 6's runlane_run_schedule, a run of the
    stored definition) made runs by raw SQL with no record. Since schema version 26 the
    operator holds only its overload naming the action, which commits a run it made only
    with the record of run_schedule_now for that schedule; a call that made none (the
    idempotency key's run exists) owes nothing."""
    runs.run(
        "insert into {schema}.schedules (environment, schedule_id, cron, timezone, "
        "next_slot_at, task_id, queue, payload, priority, max_attempts) values ('default', "
        "'nightly', '0 3 * * *', 'UTC', now(), 'grants.leaf', 'default', '{{}}', 0, 3)"
    )
    operator = granted("operator")
    run_now = (
        "select created from {schema}.runlane_run_schedule('default', 'nightly', %s, 'k', null, %s)"
    )
    refused(
        operator,
        schema,
        "select * from {schema}.runlane_run_schedule('default', 'nightly', %s, null, null)",
        uuid.uuid4(),
    )
    first = uuid.uuid4()
    act = (run_now, (first, "run_schedule_now"))
    for record in (None, ("run_schedule_now", "other"), ("pause_schedule", "nightly")):
        extra = () if record is None else ((AUDITED, record),)
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="audit record"):
            in_one_transaction(operator, schema, act, *extra)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="records the action"):
        in_one_transaction(operator, schema, (run_now, (first, "retry")))
    count = "select count(*) from {schema}.runs"
    assert runs.one(count) == (0,)
    in_one_transaction(operator, schema, act, (AUDITED, ("run_schedule_now", "nightly")))
    assert runs.one("select id from {schema}.runs") == (first,)
    # the key's run exists: nothing made, nothing owed
    in_one_transaction(operator, schema, (run_now, (uuid.uuid4(), "run_schedule_now")))
    assert runs.one(count) == (1,)
    assert runs.one("select count(*) from {schema}.audit_owed") == (0,)


OLD_FUNCTIONS = (
    "runlane_retry_runs(text, uuid[], boolean)",
    "runlane_cancel_runs(text, uuid[], boolean)",
    "runlane_delete_runs(text, uuid[], boolean)",
    "runlane_reschedule_runs(text, uuid[], timestamptz, timestamptz, boolean)",
)
AUDITED_FUNCTIONS = (
    "runlane_retry_runs(text, uuid[], boolean, text)",
    "runlane_cancel_runs(text, uuid[], boolean, text)",
    "runlane_delete_runs(text, uuid[], boolean, text)",
    "runlane_reschedule_runs(text, uuid[], timestamptz, timestamptz, boolean, text)",
)


def test_upgrading_to_version_24_keeps_operators_acting_until_granted_again(
    database_url: str, fresh_schema: str, db: Conn, make_role: Callable[[], tuple[str, str]]
) -> None:
    """Migration 24 gives an operator role of version 23 the overloads (an upgraded runtime
    acts at once) and leaves it the old functions (a runtime of version 23 keeps acting);
    this release's operator grant then takes the old ones back."""
    s = sql.Identifier(fresh_schema)
    db.execute(sql.SQL("create schema {}").format(s))
    db.execute(
        sql.SQL(
            "create table {}.runlane_migrations (version integer primary key, name text not "
            "null, checksum text not null, applied_at timestamptz not null default now(), "
            "compatibility text)"
        ).format(s)
    )
    for version, name, text in load_migration_files()[:23]:
        db.execute(render(text, fresh_schema).encode("utf-8"))
        db.execute(
            sql.SQL("insert into {}.runlane_migrations values (%s, %s, %s, now(), %s)").format(s),
            (version, name, _checksum(text), marker_of(text)),
        )
    role, _ = make_role()
    r = sql.Identifier(role)
    db.execute(sql.SQL("grant usage on schema {} to {}").format(s, r))
    for function in OLD_FUNCTIONS:  # what version 23's operator grant gave
        db.execute(sql.SQL(f"grant execute on function {{}}.{function} to {{}}").format(s, r))

    def may(functions: tuple[str, ...]) -> list[bool]:
        return [
            db.execute(
                "select has_function_privilege(%s, %s, 'execute')", (role, f"{fresh_schema}.{f}")
            ).fetchone()
            == (True,)
            for f in functions
        ]

    assert (
        apply_postgres_storage_migrations(
            connection_string=database_url, schema=fresh_schema
        ).applied[0]
        == 24
    )
    assert may(OLD_FUNCTIONS) == [True] * 4
    assert may(AUDITED_FUNCTIONS) == [True] * 4
    grant_postgres_role(
        connection_string=database_url, schema=fresh_schema, job="operator", role=role
    )
    assert may(OLD_FUNCTIONS) == [False] * 4
    assert may(AUDITED_FUNCTIONS) == [True] * 4
