"""A moved clock reaches the triggers a statement fires (schema version 19): they read
``runlane_now()``, the moment the lane's statements read as now; the guard trigger keeps the
server's time, which no session chooses."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from runlane import RunContext, RunStatus, task
from runlane.testing import MovableClock
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb

HOUR = 3600.0


@task(id="moved.echo")
def echo(payload: Any, context: RunContext) -> Any:
    return payload


def _server_now(db: Conn) -> datetime:
    row = db.execute("select now()").fetchone()
    assert row is not None
    moment: datetime = row[0]
    return moment


@pytest.mark.usefixtures("statement_path")
def test_the_insert_trigger_reads_the_moved_clock(
    make_runlane: RunlaneFactory, clock: MovableClock, db: Conn, schema: str
) -> None:
    """A run due in ten minutes, triggered an hour ahead on the moved clock, is due to the
    insert trigger: its outbox item is available from the moved now (on the server's now()
    it was available only at its due time)."""
    rl = make_runlane(tasks=[echo])
    at = SchemaDb(db, schema)
    at.run("insert into {schema}.outbox_environments values ('default', 30)")
    clock.advance(HOUR)
    due_at = _server_now(db) + timedelta(minutes=10)
    handle = rl.trigger(echo, None, run_at=due_at)
    moved = clock()
    (available_at,) = at.one(
        "select available_at from {schema}.outbox where run_id = %s", handle.id
    )
    assert available_at > due_at + timedelta(minutes=30)
    assert abs((available_at - moved).total_seconds()) < 60


def test_the_update_trigger_resumes_a_waiter_at_the_moved_now(
    make_runlane: RunlaneFactory, clock: MovableClock, db: Conn, schema: str
) -> None:
    """A run waiting on another resumes, when that one ends, due at the moved now."""
    rl = make_runlane(tasks=[echo])
    waiter, target = rl.trigger(echo, 1), rl.trigger(echo, 2)
    at = SchemaDb(db, schema)
    at.run(  # as the owner: a flow's wait, without a handler to make it
        "update {schema}.runs set status = 'waiting', wait_kind = 'run', wait_run_id = %s "
        "where id = %s",
        target.id,
        waiter.id,
    )
    clock.advance(HOUR)
    assert rl.cancel(target.id).status is RunStatus.CANCELLED
    resumed = rl.get_run(waiter.id)
    assert resumed.status is RunStatus.QUEUED
    assert resumed.due_at > _server_now(db) + timedelta(minutes=50)


def test_a_session_setting_the_time_passes_no_guard(granted: Any, db: Conn, schema: str) -> None:
    """The guard trigger reads the server's time: a role that may not claim sets runlane.now
    an hour ahead and still may not end an attempt whose lease is live."""
    at = SchemaDb(db, schema)
    conninfo = granted("maintenance")
    run_id = at.one(
        "insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
        "max_attempts, attempt, lease_token, lease_expires_at, due_at) values ("
        "gen_random_uuid(), "
        "'default', 'moved.echo', 'default', 'running', 'null', 3, 1, gen_random_uuid(), "
        "now() + interval '5 minutes', now()) returning id"
    )[0]
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("select set_config('runlane.now', (now() + interval '1 hour')::text, false)")
        assert conn.execute(f'select "{schema}".runlane_now() > now()').fetchone() == (True,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(
                f"update \"{schema}\".runs set status = 'failed', lease_token = null, "
                "lease_expires_at = null where id = %s",
                (run_id,),
            )
    assert at.one("select status from {schema}.runs where id = %s", run_id) == ("running",)
