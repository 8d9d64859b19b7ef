"""Operating schedules: the definition stored with each schedule's state, listing with the
next fire time in the schedule's zone, pause and resume (durable, no catch-up), running a
schedule now from a runtime with no tasks, unknown ids, and late schedules in status().

Time is moved by rewriting the stored awaited slot (database time), never by sleeping."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import attrs
import pytest

from runlane import (
    ConfigurationError,
    RunContext,
    Runlane,
    RunStatus,
    queue,
    schedule,
    task,
)
from runlane._operator.status import format_report, unhealthy
from runlane.schedules import next_slot
from runlane.storage import ScheduledRun
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb, storage_of

PARIS = ZoneInfo("Europe/Paris")


@attrs.frozen
class Report:
    name: str


@task(id="report", schema=Report, queue="reports")
def report(payload: Report, context: RunContext) -> str:
    return f"report {payload.name}"


reports = queue("reports")


def minutely(**options: Any) -> Any:
    options.setdefault("payload", Report("m"))
    return schedule(id="minutely", task=report, cron="* * * * *", **options)


class Tables(SchemaDb):
    def now(self) -> datetime:
        value: datetime = self.one("select now()")[0]
        return value

    def row(self, schedule_id: str) -> dict[str, Any]:
        cur = self.conn.execute(
            self.q(
                "select task_id, queue, payload, priority, max_attempts, paused, next_slot_at, "
                "last_fired_at, last_run_id, xmin::text as version "
                "from {schema}.schedules where schedule_id = %s"
            ),
            (schedule_id,),
        )
        row = cur.fetchone()
        assert row is not None, f"schedule {schedule_id} is not stored"
        assert cur.description is not None
        return dict(zip([c.name for c in cur.description], row, strict=True))

    def await_slot_ago(self, schedule_id: str, ago: timedelta) -> None:
        """The schedule awaits a slot ``ago`` in the past (database time), as if maintenance
        had not run for that long."""
        self.conn.execute(
            self.q(
                "update {schema}.schedules set next_slot_at = date_trunc('minute', now()) - %s "
                "where schedule_id = %s"
            ),
            (ago, schedule_id),
        )

    def runs(self) -> list[tuple[Any, ...]]:
        return self.all("select id, task_id, queue, payload, priority from {schema}.runs")

    def slots(self) -> list[tuple[Any, ...]]:
        return self.all("select slot_at, run_id from {schema}.schedule_slots")


@pytest.fixture
def tables(db: Conn, schema: str) -> Tables:
    return Tables(db, schema)


@pytest.fixture
def operator(make_runlane: RunlaneFactory) -> Callable[..., Runlane]:
    """A runtime built as the operator CLI builds it: a database URL and nothing else."""

    def make(environment: str = "default") -> Runlane:
        return make_runlane(environment=environment)

    return make


def app(make_runlane: RunlaneFactory, *schedules: Any, **options: Any) -> Runlane:
    return make_runlane(tasks=[report], queues=[reports], schedules=list(schedules), **options)


# -- stored definitions --------------------------------------------------------------------------


def test_a_maintenance_pass_stores_the_definition_once(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    rl = app(make_runlane, minutely(payload=Report("daily"), priority=7))
    rl.run_maintenance_once()
    row = tables.row("minutely")
    assert (row["task_id"], row["queue"], row["payload"], row["priority"]) == (
        "report",
        "reports",
        {"name": "daily"},
        7,
    )
    assert row["max_attempts"] == report.retry.max_attempts
    assert (row["paused"], row["last_fired_at"], row["last_run_id"]) == (False, None, None)
    # later passes with nothing changed do not write the row again
    rl.run_maintenance_once()
    version = tables.row("minutely")["version"]
    for _ in range(3):
        rl.run_maintenance_once()
    assert tables.row("minutely")["version"] == version


def test_a_changed_definition_is_stored_again_without_resetting_the_slot(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    app(make_runlane, minutely(payload=Report("old"))).run_maintenance_once()
    awaited = tables.row("minutely")["next_slot_at"]
    newer = app(make_runlane, minutely(payload=Report("new"), priority=3))
    newer.run_maintenance_once()
    row = tables.row("minutely")
    assert (row["payload"], row["priority"], row["next_slot_at"]) == ({"name": "new"}, 3, awaited)
    # and again when someone else changed it behind this runtime's back
    tables.conn.execute(tables.q("update {schema}.schedules set payload = '{{}}'::jsonb"))
    newer.run_maintenance_once()
    assert tables.row("minutely")["payload"] == {"name": "new"}


def test_a_fired_slot_is_remembered(make_runlane: RunlaneFactory, tables: Tables) -> None:
    rl = app(make_runlane, minutely())
    rl.run_maintenance_once()
    tables.await_slot_ago("minutely", timedelta(minutes=3))
    assert rl.run_maintenance_once().schedules_created == 1
    ((slot_at, run_id),) = tables.slots()
    row = tables.row("minutely")
    assert (row["last_fired_at"], row["last_run_id"]) == (slot_at, run_id)
    (info,) = rl.list_schedules()
    assert (info.last_fired_at, info.last_run_id) == (slot_at, run_id)


# -- listing -------------------------------------------------------------------------------------


def test_list_shows_the_next_fire_time_in_the_schedules_zone(
    make_runlane: RunlaneFactory, tables: Tables, operator: Any
) -> None:
    daily = schedule(
        id="daily", task=report, cron="0 9 * * *", timezone="Europe/Paris", payload=Report("d")
    )
    rl = app(make_runlane, daily)
    # defined here, not stored yet: listed with the slot its first pass will await
    (before,) = rl.list_schedules()
    now = tables.now()
    expected = next_slot("0 9 * * *", PARIS, now)
    assert before.next_fire_at == expected
    assert before.next_fire_at is not None
    assert before.next_fire_at.tzinfo == PARIS
    assert (before.next_fire_at.hour, before.next_fire_at.minute) == (9, 0)
    assert (before.defined, before.paused, before.task_id, before.queue) == (
        True,
        False,
        "report",
        "reports",
    )
    assert operator().list_schedules() == []

    rl.run_maintenance_once()
    (stored,) = operator().list_schedules()
    assert stored.id == "daily"
    assert (stored.cron, stored.timezone) == ("0 9 * * *", "Europe/Paris")
    assert (stored.task_id, stored.queue, stored.paused, stored.defined) == (
        "report",
        "reports",
        False,
        False,
    )
    assert stored.next_fire_at == expected
    assert stored.next_fire_at is not None
    assert stored.next_fire_at.tzinfo == PARIS
    assert stored.next_fire_at.hour == 9
    assert rl.list_schedules() == [attrs.evolve(stored, defined=True)]
    # another environment's schedules are not listed
    assert operator("staging").list_schedules() == []


# -- pause and resume ----------------------------------------------------------------------------


def test_a_paused_schedule_fires_nothing(
    make_runlane: RunlaneFactory, tables: Tables, operator: Any
) -> None:
    rl = app(make_runlane, minutely(catch_up=5))
    rl.run_maintenance_once()
    op = operator()
    assert op.pause_schedule("minutely") is True
    assert op.pause_schedule("minutely") is False  # idempotent
    tables.await_slot_ago("minutely", timedelta(minutes=10))
    assert rl.run_maintenance_once().schedules_created == 0
    assert tables.runs() == []
    (info,) = op.list_schedules()
    assert (info.paused, info.next_fire_at) == (True, None)
    # the pause is durable: a runtime started later sees it
    later = app(make_runlane, minutely(catch_up=5))
    assert later.run_maintenance_once().schedules_created == 0
    assert tables.runs() == []


def test_a_maintenance_read_from_before_a_pause_fires_nothing(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    """A replica that read the schedule unpaused and fires after the pause committed: the
    fire statement itself checks the pause."""
    rl = app(make_runlane, minutely())
    rl.run_maintenance_once()
    tables.await_slot_ago("minutely", timedelta(minutes=2))
    (state,) = storage_of(rl).schedule_state_list(rl.environment, ["minutely"])
    assert state.paused is False
    rl.pause_schedule("minutely")
    slot = state.next_slot_at + timedelta(minutes=1)
    late = ScheduledRun(
        rl.environment, "minutely", slot, uuid.uuid4(), "report", "reports", 0, "{}", 3
    )
    fired = storage_of(rl).schedule_fire(
        late, next_slot_at=slot + timedelta(minutes=1), expected_slot_at=state.next_slot_at
    )
    assert fired is False
    assert (tables.runs(), tables.slots()) == ([], [])
    assert tables.row("minutely")["next_slot_at"] == state.next_slot_at


def test_resume_does_not_catch_up(
    make_runlane: RunlaneFactory, tables: Tables, operator: Any
) -> None:
    rl = app(make_runlane, minutely(catch_up=5))
    rl.run_maintenance_once()
    op = operator()
    op.pause_schedule("minutely")
    tables.await_slot_ago("minutely", timedelta(minutes=10))
    assert op.resume_schedule("minutely") is True
    assert op.resume_schedule("minutely") is False  # idempotent
    now = tables.now()
    row = tables.row("minutely")
    assert row["paused"] is False
    assert now < row["next_slot_at"] <= now + timedelta(minutes=1)
    assert rl.run_maintenance_once().schedules_created == 0
    assert tables.runs() == []
    (info,) = op.list_schedules()
    assert (info.paused, info.next_fire_at) == (False, row["next_slot_at"])
    # it fires again from the resume on
    tables.await_slot_ago("minutely", timedelta(0))
    assert rl.run_maintenance_once().schedules_created == 1


def test_pausing_a_schedule_defined_here_but_not_stored_stores_it(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    rl = app(make_runlane, minutely())
    assert rl.resume_schedule("minutely") is False  # never stored: never paused
    assert rl.pause_schedule("minutely") is True
    row = tables.row("minutely")
    assert (row["paused"], row["task_id"]) == (True, "report")
    tables.await_slot_ago("minutely", timedelta(minutes=2))
    assert rl.run_maintenance_once().schedules_created == 0


# -- run now -------------------------------------------------------------------------------------


def test_run_now_from_a_runtime_with_no_tasks(
    make_runlane: RunlaneFactory, tables: Tables, operator: Any
) -> None:
    rl = app(make_runlane, minutely(payload=Report("now"), priority=4))
    rl.run_maintenance_once()
    before = tables.row("minutely")
    op = operator()
    handle = op.trigger_schedule_now("minutely")
    assert (handle.task_id, handle.queue, handle.created) == ("report", "reports", True)
    assert tables.runs() == [(handle.id, "report", "reports", {"name": "now"}, 4)]
    # the schedule's slots are untouched
    after = tables.row("minutely")
    assert (after["next_slot_at"], after["last_fired_at"], after["last_run_id"]) == (
        before["next_slot_at"],
        None,
        None,
    )
    assert tables.slots() == []
    # a worker of the application runs it
    assert rl.drain().runs_executed == 1
    done = rl.get_run(handle.id)
    assert (done.status, done.output) == (RunStatus.COMPLETED, "report now")
    # each plain call is a new run; a key makes a repeated call return the first one
    assert op.trigger_schedule_now("minutely").id != handle.id
    keyed = op.trigger_schedule_now("minutely", idempotency_key="incident-42")
    again = op.trigger_schedule_now("minutely", idempotency_key="incident-42")
    assert (again.id, again.created, keyed.created) == (keyed.id, False, True)
    assert len(tables.runs()) == 3
    # a paused schedule can still be run by hand
    op.pause_schedule("minutely")
    assert op.trigger_schedule_now("minutely").created is True


def test_run_now_of_a_schedule_defined_here_but_not_stored(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    rl = app(make_runlane, minutely(payload=Report("fresh")))
    handle = rl.trigger_schedule_now("minutely")
    assert tables.runs() == [(handle.id, "report", "reports", {"name": "fresh"}, 0)]
    assert rl.drain().runs_executed == 1


def test_run_now_of_a_row_without_a_stored_definition_says_what_to_do(
    make_runlane: RunlaneFactory, tables: Tables, operator: Any
) -> None:
    app(make_runlane, minutely()).run_maintenance_once()
    # as a runtime of the previous release left it
    tables.conn.execute(
        tables.q(
            "update {schema}.schedules set task_id = null, queue = null, payload = null, "
            "priority = null, max_attempts = null"
        )
    )
    with pytest.raises(ConfigurationError, match="maintenance pass of an application"):
        operator().trigger_schedule_now("minutely")
    assert tables.runs() == []


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["pause_schedule", "resume_schedule", "trigger_schedule_now"])
@pytest.mark.parametrize("bad", ["nope", "x" * 10_000, "bad\x00id", ""])
def test_unknown_ids_say_what_to_do(
    make_runlane: RunlaneFactory, tables: Tables, operator: Any, action: str, bad: str
) -> None:
    app(make_runlane, minutely()).run_maintenance_once()
    before = tables.row("minutely")
    with pytest.raises(ConfigurationError, match="runlane schedules list") as caught:
        getattr(operator(), action)(bad)
    assert len(str(caught.value)) < 500
    assert tables.row("minutely") == before
    assert tables.runs() == []


@pytest.mark.parametrize("bad", [None, 3, b"minutely"])
def test_an_id_that_is_not_a_string_is_refused(operator: Any, bad: object) -> None:
    with pytest.raises(ConfigurationError, match="schedule id is a string"):
        operator().pause_schedule(bad)


def test_a_bad_idempotency_key_is_refused(
    make_runlane: RunlaneFactory, tables: Tables, operator: Any
) -> None:
    app(make_runlane, minutely()).run_maintenance_once()
    with pytest.raises(ConfigurationError, match="idempotency_key"):
        operator().trigger_schedule_now("minutely", idempotency_key="")
    assert tables.runs() == []


# -- status --------------------------------------------------------------------------------------


def test_a_late_schedule_shows_in_status(
    make_runlane: RunlaneFactory, tables: Tables, operator: Any
) -> None:
    app(make_runlane, minutely()).run_maintenance_once()
    op = operator()
    report_now = op.status()
    assert report_now.late_schedules == ()
    assert not any(" late, " in line for line in unhealthy(report_now))
    # a slot just past is due, not late: maintenance fires it within a pass
    tables.await_slot_ago("minutely", timedelta(seconds=0))
    assert op.status().late_schedules == ()
    tables.await_slot_ago("minutely", timedelta(minutes=5))
    late = op.status()
    assert late.late_schedules == ("minutely",)
    (problem,) = [line for line in unhealthy(late) if "1 schedule is late, its next" in line]
    assert "minutely" in problem
    assert any("late schedules" in line and "minutely" in line for line in format_report(late))
    # a paused schedule is not late
    op.pause_schedule("minutely")
    assert op.status().late_schedules == ()
