"""The audit trail and reschedule (SPEC section 10, "Audit trail", "More operator actions"):
every operator action is recorded in its own transaction with who, when, what, how many
runs and why; a repeat is recorded as what it did; reschedule moves only a queued or
retrying run, through a SECURITY DEFINER function the operator role may execute."""

from __future__ import annotations

import getpass
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from runlane import (
    ConfigurationError,
    RetryPolicy,
    RunContext,
    Runlane,
    RunNotFound,
    RunStateConflict,
    RunStatus,
    Task,
    queue,
    schedule,
    task,
)
from runlane._operator import bulk
from runlane.models import AuditRecord
from runlane.runtime import acting_as
from tests.conftest import RunlaneFactory
from tests.helpers import Cli, Conn, in_process_cli, run_row

ONCE = RetryPolicy(max_attempts=1)
LATER = RetryPolicy(
    max_attempts=3, initial_delay=timedelta(hours=1), max_delay=timedelta(hours=1), jitter=0.0
)


@task(id="audit.fails", retry=ONCE)
def fails(payload: Any, context: RunContext) -> None:
    raise RuntimeError("no")


@task(id="audit.retries", retry=LATER)
def retries(payload: Any, context: RunContext) -> None:
    raise RuntimeError("later")


@task(id="audit.ok")
def ok(payload: Any, context: RunContext) -> str:
    return "done"


TASKS: list[Task[Any, Any]] = [fails, retries, ok]
NIGHTLY = schedule(id="audit.nightly", cron="0 3 * * *", task=ok, payload={})


@pytest.fixture
def rl(make_runlane: RunlaneFactory) -> Runlane:
    return make_runlane(tasks=TASKS, queues=[queue("default", default=True)], schedules=[NIGHTLY])


def newest(rl: Runlane) -> AuditRecord:
    return rl.list_audit(limit=1).items[0]


def failed_run(rl: Runlane) -> uuid.UUID:
    handle = rl.trigger(fails, {})
    rl.drain()
    assert rl.get_run(handle.id).status is RunStatus.FAILED
    return handle.id


def test_single_run_actions_are_recorded_with_who_what_how_many_and_why(rl: Runlane) -> None:
    run_id = failed_run(rl)
    rl.retry_run(run_id, reason="the card processor is back")
    record = newest(rl)
    assert (record.action, record.target, record.runs, record.changed) == (
        "retry",
        str(run_id),
        1,
        True,
    )
    assert record.reason == "the card processor is back"
    assert record.via == "api"
    assert record.actor is None
    assert record.os_user == getpass.getuser()
    assert record.db_role  # the database's current_user, written by the database
    assert abs(record.at - datetime.now(UTC)) < timedelta(minutes=1)

    assert rl.cancel(run_id, reason="not today").changed
    assert (newest(rl).action, newest(rl).runs, newest(rl).reason) == ("cancel", 1, "not today")
    # a repeat is safe and recorded as what it did: nothing
    assert not rl.cancel(run_id).changed
    assert (newest(rl).action, newest(rl).runs, newest(rl).changed) == ("cancel", 0, False)

    assert rl.delete_run(run_id, reason="test data")
    assert (newest(rl).action, newest(rl).runs) == ("delete", 1)
    with pytest.raises(RunNotFound):
        rl.get_run(run_id)


def test_refused_and_unknown_actions_leave_no_record(rl: Runlane) -> None:
    live = rl.trigger(ok, {}).id
    with pytest.raises(RunStateConflict, match="failed or cancelled"):
        rl.retry_run(live)
    with pytest.raises(RunStateConflict, match="cancel it first"):
        rl.delete_run(live)
    with pytest.raises(RunNotFound):
        rl.cancel(uuid.uuid4())
    with pytest.raises(ConfigurationError, match="reason"):
        rl.cancel(live, reason="x" * 501)
    assert rl.get_run(live).status is RunStatus.QUEUED
    assert rl.list_audit().items == ()


def test_reschedule_moves_a_delayed_run_and_runs_a_retrying_one_now(rl: Runlane) -> None:
    delayed = rl.trigger(ok, {}, delay=timedelta(hours=2)).id
    later = datetime.now(UTC) + timedelta(days=1)
    moved = rl.reschedule_run(delayed, run_at=later, reason="after the migration")
    assert moved.status is RunStatus.QUEUED
    assert abs(moved.due_at - later) < timedelta(seconds=1)
    record = newest(rl)
    assert (record.action, record.target, record.runs, record.reason) == (
        "reschedule",
        str(delayed),
        1,
        "after the migration",
    )
    assert record.details["run_at"] == later.isoformat()
    # run now: due at once, drained at once
    assert rl.reschedule_run(delayed, run_at=None).due_at <= datetime.now(UTC) + timedelta(
        seconds=5
    )
    retrying = rl.trigger(retries, {}).id
    assert (rl.drain().completed, rl.get_run(retrying).status) == (1, RunStatus.RETRYING)
    now = rl.reschedule_run(retrying, run_at=None)
    assert now.status is RunStatus.QUEUED  # not left for maintenance to deliver
    assert rl.drain().retried == 1
    assert rl.get_run(retrying).attempt == 2
    assert [r.details["run_at"] for r in rl.list_audit().items[:2]] == ["now", "now"]


def test_reschedule_refuses_what_it_cannot_move(rl: Runlane, db: Conn, schema: str) -> None:
    done = rl.trigger(ok, {}).id
    rl.drain()
    with pytest.raises(RunStateConflict, match="completed: only a queued"):
        rl.reschedule_run(done, run_at=None)
    with pytest.raises(RunNotFound):
        rl.reschedule_run(uuid.uuid4(), run_at=None)
    with pytest.raises(RunNotFound, match="not a run id"):
        rl.reschedule_run("nope", run_at=None)
    queued = rl.trigger(ok, {}).id
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        rl.reschedule_run(queued, run_at=datetime(2030, 1, 1))
    with pytest.raises(ConfigurationError, match="1970 to 100 years"):
        rl.reschedule_run(queued, run_at=datetime(3000, 1, 1, tzinfo=UTC))
    # a running run is not moved (fenced by its status, under the run's lock)
    db.execute(
        sql.SQL(
            "update {}.runs set status = 'running', attempt = 1, lease_token = gen_random_uuid(), "
            "lease_expires_at = now() + interval '1 minute' where id = %s"
        ).format(sql.Identifier(schema)),
        (queued,),
    )
    before = run_row(db, schema, queued)["due_at"]
    with pytest.raises(RunStateConflict, match="running"):
        rl.reschedule_run(queued, run_at=datetime.now(UTC) + timedelta(hours=1))
    assert run_row(db, schema, queued)["due_at"] == before
    assert rl.list_audit().items == ()


def test_a_bulk_action_is_one_record_summing_its_batches(
    rl: Runlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk, "BATCH_SIZE", 2)  # three batches for five runs
    ids = [rl.trigger(fails, {"n": n}).id for n in range(5)]
    rl.drain()
    result = rl.retry_runs(task=fails, reason="after the outage")
    assert (result.matched, result.changed) == (5, 5)
    record = newest(rl)
    assert (record.action, record.runs, record.changed, record.reason) == (
        "bulk_retry",
        5,
        True,
        "after the outage",
    )
    assert record.target == "statuses=['failed', 'cancelled'], task=audit.fails"
    assert len(rl.list_audit().items) == 1  # its parts are summed, not listed
    # a repeat matches nothing and says so
    assert rl.retry_runs(task=fails).changed == 0
    assert (newest(rl).action, newest(rl).runs, newest(rl).changed) == ("bulk_retry", 0, False)
    # a dry run changes nothing and is not an action
    rl.cancel_runs(task=fails, dry_run=True)
    assert len(rl.list_audit().items) == 2
    assert {rl.get_run(i).status for i in ids} == {RunStatus.QUEUED}


def test_queue_and_schedule_actions_are_recorded(rl: Runlane) -> None:
    rl.pause_queue("default", reason="deploy")
    rl.pause_queue("default", reason="deploy")
    rl.resume_queue("default", reason="deployed")
    rl.pause_schedule("audit.nightly", reason="holiday")
    rl.resume_schedule("audit.nightly")
    handle = rl.trigger_schedule_now("audit.nightly", idempotency_key="k1", reason="catch up")
    rl.trigger_schedule_now("audit.nightly", idempotency_key="k1")
    records = [(r.action, r.target, r.runs, r.changed, r.reason) for r in rl.list_audit().items]
    assert records == [
        ("run_schedule_now", "audit.nightly", 0, False, None),
        ("run_schedule_now", "audit.nightly", 1, True, "catch up"),
        ("resume_schedule", "audit.nightly", None, True, None),
        ("pause_schedule", "audit.nightly", None, True, "holiday"),
        ("resume_queue", "default", None, True, "deployed"),
        ("pause_queue", "default", None, False, "deploy"),
        ("pause_queue", "default", None, True, "deploy"),
    ]
    assert rl.get_run(handle.id).task_id == "audit.ok"


def test_acting_as_names_the_actor_and_pages_go_back_in_time(rl: Runlane) -> None:
    with acting_as("alice@example.com"):
        rl.pause_queue("default")
    with acting_as(lambda: "bob", via="cli"):
        rl.resume_queue("default")
    first = rl.list_audit(limit=1)
    assert [(r.actor, r.via) for r in first.items] == [("bob", "cli")]
    assert first.next_cursor is not None
    second = rl.list_audit(limit=1, cursor=first.next_cursor)
    assert [(r.actor, r.via) for r in second.items] == [("alice@example.com", "console")]
    assert second.next_cursor is None
    assert rl.list_audit(since=datetime.now(UTC) + timedelta(minutes=5)).items == ()
    with pytest.raises(ConfigurationError, match="not one list_audit gave"):
        rl.list_audit(cursor="garbage")
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        rl.list_audit(since=datetime(2026, 1, 1))
    with pytest.raises(ConfigurationError, match="actor"), acting_as(""):
        pass


def test_an_action_whose_record_cannot_be_written_does_not_happen(
    schema: str, granted: Callable[..., str], make_runlane: RunlaneFactory, db: Conn
) -> None:
    conninfo = granted("operator")
    role = psycopg.conninfo.conninfo_to_dict(conninfo)["user"]
    db.execute(
        sql.SQL("revoke insert on {}.audit_log from {}").format(
            sql.Identifier(schema), sql.Identifier(str(role))
        )
    )
    owner = make_runlane(tasks=TASKS, schedules=[NIGHTLY])
    operator = make_runlane(connection_string=conninfo, tasks=TASKS)
    run_id = owner.trigger(ok, {}).id
    with pytest.raises(ConfigurationError, match="lacks a privilege"):
        operator.cancel(run_id)
    assert owner.get_run(run_id).status is RunStatus.QUEUED  # rolled back with its record
    with pytest.raises(ConfigurationError, match="lacks a privilege"):
        operator.pause_queue("default")
    assert not any(q.paused for q in owner.list_queues())
    assert owner.list_audit().items == ()


def test_the_operator_role_acts_and_is_named_by_the_database(
    granted: Callable[..., str], make_runlane: RunlaneFactory
) -> None:
    conninfo = granted("operator")
    role = psycopg.conninfo.conninfo_to_dict(conninfo)["user"]
    owner = make_runlane(tasks=TASKS, schedules=[NIGHTLY])
    operator = make_runlane(connection_string=conninfo, tasks=TASKS)
    run_id = owner.trigger(ok, {}, delay=timedelta(hours=1)).id
    operator.reschedule_run(run_id, run_at=None, reason="now please")
    record = operator.list_audit().items[0]
    assert (record.action, record.db_role, record.reason) == ("reschedule", role, "now please")
    assert owner.drain().completed == 1


def test_the_operator_roles_actions_each_commit_with_their_record(
    schema: str,
    granted: Callable[..., str],
    make_runlane: RunlaneFactory,
    db: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under the operator role, whose functions commit only with their record (schema
    versions 24 and 26): each single-run action, a refused one (no record, no refusal by
    the database), bulk actions in several parts (one record per batch's transaction), and
    a run of a stored schedule."""
    monkeypatch.setattr(bulk, "BATCH_SIZE", 2)
    owner = make_runlane(tasks=TASKS, schedules=[NIGHTLY])
    operator = make_runlane(connection_string=granted("operator"), tasks=TASKS)
    failed = [owner.trigger(fails, {"n": n}).id for n in range(5)]
    owner.drain()
    delayed = owner.trigger(ok, {}, delay=timedelta(hours=1)).id
    with pytest.raises(RunStateConflict, match="failed or cancelled"):
        operator.retry_run(delayed)
    later = datetime.now(UTC) + timedelta(days=1)
    assert abs(operator.reschedule_run(delayed, run_at=later).due_at - later) < timedelta(seconds=1)
    assert operator.cancel(delayed).changed
    assert operator.delete_run(delayed)
    assert operator.retry_run(failed[0]).status is RunStatus.QUEUED
    assert operator.cancel_runs(task=ok.id).changed == 0  # recorded alone: no batch
    assert operator.retry_runs(task=fails.id).changed == 4
    assert operator.cancel_runs(task=fails.id).changed == 5
    assert operator.delete_runs(task=fails.id, status="cancelled").changed == 5
    records = operator.list_audit().items
    assert [(r.action, r.runs) for r in records] == [
        ("bulk_delete", 5),
        ("bulk_cancel", 5),
        ("bulk_retry", 4),
        ("bulk_cancel", 0),
        ("retry", 1),
        ("delete", 1),
        ("cancel", 1),
        ("reschedule", 1),
    ]
    parts = (
        "select max(part) from {}.audit_log where action like 'bulk_%%' "
        "group by action_id order by 1"
    )
    last = [part for (part,) in db.execute(sql.SQL(parts).format(sql.Identifier(schema)))]
    # the empty action is one record; each that changed runs was written in 3 parts or more
    assert last[:1] == [0], last
    assert [part >= 2 for part in last[1:]] == [True, True, True], last
    # a run of a stored schedule (schema version 26), made and then not made again
    owner.run_maintenance_once()  # stores the schedule's definition
    made = operator.trigger_schedule_now(NIGHTLY.id, idempotency_key="once")
    again = operator.trigger_schedule_now(NIGHTLY.id, idempotency_key="once")
    assert (made.created, again.created, again.id) == (True, False, made.id)
    records = operator.list_audit().items[:2]
    assert [(r.action, r.target, r.runs) for r in records] == [
        ("run_schedule_now", NIGHTLY.id, 0),
        ("run_schedule_now", NIGHTLY.id, 1),
    ]
    owed = "select count(*) from {}.audit_owed"
    assert db.execute(sql.SQL(owed).format(sql.Identifier(schema))).fetchone() == (0,)


@pytest.fixture
def cli(cli_target: list[str], capsys: pytest.CaptureFixture[str]) -> Cli:
    """``runlane *argv --database-url URL --schema S`` in this process."""
    cli = in_process_cli(capsys)
    return lambda *argv: cli(*argv, *cli_target)


def test_the_cli_reschedules_and_lists_the_trail_as_its_own(
    rl: Runlane, cli: Callable[..., tuple[int, str, str]]
) -> None:
    run_id = rl.trigger(ok, {}, delay=timedelta(hours=3)).id
    code, out, _ = cli("runs", "reschedule", str(run_id), "--in", "60", "--reason", "sooner")
    assert code == 0
    assert f"run {run_id} is queued, due" in out
    due = rl.get_run(run_id).due_at
    assert timedelta(seconds=30) < due - datetime.now(UTC) < timedelta(seconds=90)
    code, _, err = cli("runs", "reschedule", str(run_id), "--at", "2030-01-01T00:00:00")
    assert (code, err.count("\n")) == (2, 1)
    assert "has no UTC offset" in err
    assert cli("runs", "cancel", str(run_id), "--reason", "not needed")[0] == 0
    code, _, err = cli("runs", "reschedule", str(run_id))
    assert code == 1
    assert "cancelled: only a queued" in err
    code, out, _ = cli("audit", "--json")
    records = json.loads(out)["records"]
    assert [(r["action"], r["via"], r["reason"]) for r in records] == [
        ("cancel", "cli", "not needed"),
        ("reschedule", "cli", "sooner"),
    ]
    code, out, _ = cli("audit")
    assert out.splitlines()[0].split() == ["AT", "WHO", "VIA", "ACTION", "TARGET", "RUNS", "REASON"]
    assert "reschedule" in out
    assert f"({records[0]['db_role']})" in out


def test_retention_prunes_old_records_only(rl: Runlane, db: Conn, schema: str) -> None:
    rl.pause_queue("default")
    old = uuid.uuid4()
    db.execute(
        sql.SQL(
            "insert into {}.audit_log (id, action_id, environment, via, action, changed, at) "
            "values (%s, %s, 'default', 'api', 'cancel', true, now() - interval '400 days')"
        ).format(sql.Identifier(schema)),
        (old, old),
    )
    assert len(rl.list_audit().items) == 2
    assert rl.run_maintenance_once().audit_pruned == 1  # RetentionPolicy.audit: a year
    assert [r.action for r in rl.list_audit().items] == ["pause_queue"]


def test_running_a_schedule_no_pass_stored_yet_is_recorded(rl: Runlane) -> None:
    # made from this runtime's definition (run_insert_many) inside the record's transaction
    handle = rl.trigger_schedule_now("audit.nightly", reason="first")
    assert rl.drain().completed == 1
    assert rl.get_run(handle.id).status is RunStatus.COMPLETED
    record = newest(rl)
    assert (record.action, record.runs, record.reason) == ("run_schedule_now", 1, "first")


def test_a_reason_is_one_line_of_printable_text(rl: Runlane) -> None:
    """A newline or an escape sequence in a reason forged lines in `runlane audit`: refused
    at the API, for every operator action, with nothing done or recorded."""
    live = rl.trigger(ok, {}).id
    for reason in ("fine\n2026-01-01 00:00 admin cli cancel", "\x1b[2Jcleared", "tab\there"):
        with pytest.raises(ConfigurationError, match="one line of printable text") as caught:
            rl.cancel(live, reason=reason)
        assert "\n" not in str(caught.value)
        with pytest.raises(ConfigurationError, match="printable"):
            rl.pause_queue("default", reason=reason)
    assert rl.get_run(live).status is RunStatus.QUEUED
    assert rl.list_queues()[0].paused is False
    assert rl.list_audit().items == ()
    rl.cancel(live, reason="été, 5 €")
    assert newest(rl).reason == "été, 5 €"


def test_runlane_audit_shows_control_characters_escaped(
    rl: Runlane, db: Conn, schema: str, cli: Callable[..., tuple[int, str, str]]
) -> None:
    """What the client writes (actor, OS user, reason: raw SQL writes anything, getpass reads
    $USER) is shown on one line with its control characters as \\xNN."""
    forged = uuid.uuid4()
    db.execute(
        sql.SQL(
            "insert into {}.audit_log (id, action_id, environment, via, actor, os_user, "
            "action, target, changed, reason) values (%s, %s, 'default', 'api', %s, %s, "
            "'cancel', 'x', true, %s)"
        ).format(sql.Identifier(schema)),
        (forged, forged, "eve\n2026-01-01 00:00 admin", "\x1b[31mroot", "why\r\x1b[2Kok"),
    )
    code, out, _ = cli("audit")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 2, out
    assert "\x1b" not in out
    assert "\r" not in out
    assert "eve\\x0a2026-01-01 00:00 admin" in lines[1]
    assert "why\\x0d\\x1b[2Kok" in lines[1]
    db.execute(
        sql.SQL("update {}.audit_log set actor = null where id = %s").format(
            sql.Identifier(schema)
        ),
        (forged,),
    )
    assert "\\x1b[31mroot (" in cli("audit")[1]


def test_the_listing_sums_only_the_parts_of_its_actions_environment_and_role(
    rl: Runlane, db: Conn, schema: str
) -> None:
    """A part written under an action's id in another environment or by another role (rows
    of schema 22, or the owner's) is not summed into the action's runs."""
    failed_run(rl)
    rl.retry_runs(task=fails, reason="once")
    record = newest(rl)
    assert (record.action, record.runs) == ("bulk_retry", 1)
    (action_id,) = db.execute(
        sql.SQL("select action_id from {}.audit_log where id = %s").format(sql.Identifier(schema)),
        (record.id,),
    ).fetchone() or (None,)
    for part, environment, role in ((7, "other", None), (8, "default", "someone")):
        db.execute(
            sql.SQL(
                "insert into {}.audit_log (id, action_id, part, environment, via, action, "
                "runs, changed, db_role) values (%s, %s, %s, %s, 'api', 'bulk_retry', 999999, "
                "true, coalesce(%s, current_user))"
            ).format(sql.Identifier(schema)),
            (uuid.uuid4(), action_id, part, environment, role),
        )
    assert newest(rl).runs == 1
