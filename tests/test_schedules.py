"""Cron schedules: the pure slot arithmetic, definition-time validation, and the SCHEDULES
phase against the real database (first sighting, due slots, racing replicas, downtime,
catch-up, a changed definition)."""

from __future__ import annotations

import itertools
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import attrs
import pytest

from runlane import (
    ConfigurationError,
    MaintenanceLimits,
    MaintenanceResult,
    RunContext,
    Runlane,
    RunStatus,
    queue,
    schedule,
    task,
)
from runlane.schedules import due_slots, next_slot
from runlane.storage import ScheduledRun, ScheduleState
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb, run_together, storage_of

UTC_ZONE = ZoneInfo("UTC")
PARIS = ZoneInfo("Europe/Paris")


def at(  # noqa: PLR0917 - literal instants read best positionally
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, us: int = 0
) -> datetime:
    """A literal UTC instant."""
    return datetime(year, month, day, hour, minute, second, us, tzinfo=UTC)


@attrs.frozen
class Report:
    name: str


@task(id="report", schema=Report)
def report(payload: Report, context: RunContext) -> str:
    return payload.name


@task(id="tick")
def tick(payload: Any, context: RunContext) -> None:
    return None


@task(id="not-registered")
def stray(payload: Any, context: RunContext) -> None:
    return None


# -- due_slots / next_slot: pure, with literal instants ----------------------------------------


def test_only_the_latest_due_slot_by_default() -> None:
    slots = due_slots("*/5 * * * *", UTC_ZONE, at(2024, 1, 1, 10, 0), at(2024, 1, 1, 10, 17, 30), 1)
    assert slots == [at(2024, 1, 1, 10, 15)]


def test_catch_up_keeps_the_latest_k_slots_oldest_first() -> None:
    waiting = at(2024, 1, 1, 10, 0)
    now = at(2024, 1, 1, 10, 17, 30)
    assert due_slots("*/5 * * * *", UTC_ZONE, waiting, now, 3) == [
        at(2024, 1, 1, 10, 5),
        at(2024, 1, 1, 10, 10),
        at(2024, 1, 1, 10, 15),
    ]
    # more room than missed slots: every slot from the awaited one on, never earlier
    assert due_slots("*/5 * * * *", UTC_ZONE, waiting, now, 50) == [
        at(2024, 1, 1, 10, 0),
        at(2024, 1, 1, 10, 5),
        at(2024, 1, 1, 10, 10),
        at(2024, 1, 1, 10, 15),
    ]
    # the awaited slot itself bounds the result even when it is not a slot boundary
    assert due_slots("*/5 * * * *", UTC_ZONE, at(2024, 1, 1, 10, 6), now, 50) == [
        at(2024, 1, 1, 10, 10),
        at(2024, 1, 1, 10, 15),
    ]


def test_nothing_due() -> None:
    # the awaited slot lies in the future
    assert (
        due_slots("*/5 * * * *", UTC_ZONE, at(2024, 1, 1, 10, 20), at(2024, 1, 1, 10, 19), 5) == []
    )
    # awaited slot passed but no slot lies between it and now
    assert (
        due_slots("0 * * * *", UTC_ZONE, at(2024, 1, 1, 10, 0, 1), at(2024, 1, 1, 10, 59, 59), 5)
        == []
    )
    # keep=0 asks for nothing
    assert due_slots("* * * * *", UTC_ZONE, at(2024, 1, 1, 10, 0), at(2024, 1, 1, 11, 0), 0) == []


def test_exact_boundary_now_is_due() -> None:
    slot = at(2024, 1, 1, 10, 20)
    assert due_slots("*/5 * * * *", UTC_ZONE, slot, slot, 1) == [slot]
    assert due_slots("*/5 * * * *", UTC_ZONE, at(2024, 1, 1, 10, 15), slot, 5) == [
        at(2024, 1, 1, 10, 15),
        slot,
    ]
    # one microsecond before the slot it is not due yet
    before = slot - timedelta(microseconds=1)
    assert due_slots("*/5 * * * *", UTC_ZONE, slot, before, 1) == []
    # next_slot is strictly after its argument
    assert next_slot("*/5 * * * *", UTC_ZONE, slot) == at(2024, 1, 1, 10, 25)
    assert next_slot("*/5 * * * *", UTC_ZONE, before) == slot


def test_next_slot_returns_utc() -> None:
    found = next_slot("0 9 * * *", PARIS, at(2024, 7, 1, 12))
    assert found == at(2024, 7, 2, 7)  # 09:00 CEST
    assert found.utcoffset() == timedelta(0)
    winter = next_slot("0 9 * * *", PARIS, at(2024, 1, 10, 12))
    assert winter == at(2024, 1, 11, 8)  # 09:00 CET


def test_six_field_expression_has_second_resolution() -> None:
    waiting = at(2024, 1, 1, 10, 0, 34)
    now = at(2024, 1, 1, 10, 0, 36, 500_000)
    assert due_slots("* * * * * *", UTC_ZONE, waiting, now, 1) == [at(2024, 1, 1, 10, 0, 36)]
    assert due_slots("* * * * * *", UTC_ZONE, waiting, now, 10) == [
        at(2024, 1, 1, 10, 0, 34),
        at(2024, 1, 1, 10, 0, 35),
        at(2024, 1, 1, 10, 0, 36),
    ]
    assert next_slot("* * * * * *", UTC_ZONE, now) == at(2024, 1, 1, 10, 0, 37)
    assert next_slot("* * * * * *", UTC_ZONE, at(2024, 1, 1, 10, 0, 37)) == at(
        2024, 1, 1, 10, 0, 38
    )


def test_six_field_seconds_field_is_the_first_one() -> None:
    """Six fields put the seconds first, as node-cron and croner do: "30 * * * * *" is second
    30 of every minute, and "*/20 * * * * *" every twenty seconds."""
    assert next_slot("30 * * * * *", UTC_ZONE, at(2024, 1, 1, 10, 0, 0)) == at(
        2024, 1, 1, 10, 0, 30
    )
    assert due_slots(
        "30 * * * * *", UTC_ZONE, at(2024, 1, 1, 10, 0), at(2024, 1, 1, 10, 2, 45), 5
    ) == [
        at(2024, 1, 1, 10, 0, 30),
        at(2024, 1, 1, 10, 1, 30),
        at(2024, 1, 1, 10, 2, 30),
    ]
    assert due_slots(
        "*/20 * * * * *", UTC_ZONE, at(2024, 1, 1, 10, 0), at(2024, 1, 1, 10, 0, 45), 5
    ) == [at(2024, 1, 1, 10, 0, 0), at(2024, 1, 1, 10, 0, 20), at(2024, 1, 1, 10, 0, 40)]


def test_five_field_expression_ignores_seconds_of_now() -> None:
    # now at 10:15:59.999 is still the 10:15 slot, and 10:15:00 exactly is due
    assert due_slots(
        "*/5 * * * *", UTC_ZONE, at(2024, 1, 1, 10, 15), at(2024, 1, 1, 10, 15, 59, 999_999), 1
    ) == [at(2024, 1, 1, 10, 15)]


def test_dst_spring_forward_in_paris() -> None:
    """2024-03-31: at 02:00 CET (01:00 UTC) Paris clocks jump to 03:00 CEST."""
    # an hourly schedule has one slot per real hour; local 02:00 does not exist
    assert due_slots("0 * * * *", PARIS, at(2024, 3, 30, 23), at(2024, 3, 31, 3, 30), 10) == [
        at(2024, 3, 30, 23),  # 00:00 CET
        at(2024, 3, 31, 0),  # 01:00 CET
        at(2024, 3, 31, 1),  # 03:00 CEST
        at(2024, 3, 31, 2),  # 04:00 CEST
        at(2024, 3, 31, 3),  # 05:00 CEST
    ]
    # a daily 02:30 job still runs once that day (at 03:00 CEST), and its next slot and the
    # backwards walk agree on that instant
    first = next_slot("30 2 * * *", PARIS, at(2024, 3, 30, 12))
    assert first == at(2024, 3, 31, 1)
    assert due_slots("30 2 * * *", PARIS, first, at(2024, 3, 31, 5), 5) == [first]
    assert next_slot("30 2 * * *", PARIS, first) == at(2024, 4, 1, 0, 30)  # 02:30 CEST


def test_dst_fall_back_hourly_in_paris() -> None:
    """2024-10-27: at 03:00 CEST (01:00 UTC) Paris clocks go back to 02:00 CET. An hourly
    schedule has one slot per real hour, so local 02:00 happens twice."""
    assert due_slots("0 * * * *", PARIS, at(2024, 10, 26, 23), at(2024, 10, 27, 3, 30), 10) == [
        at(2024, 10, 26, 23),  # 01:00 CEST
        at(2024, 10, 27, 0),  # 02:00 CEST
        at(2024, 10, 27, 1),  # 02:00 CET
        at(2024, 10, 27, 2),  # 03:00 CET
        at(2024, 10, 27, 3),  # 04:00 CET
    ]
    walked = [at(2024, 10, 26, 22, 30)]
    for _ in range(5):
        walked.append(next_slot("0 * * * *", PARIS, walked[-1]))
    assert walked[1:] == [at(2024, 10, 26, 23), *(at(2024, 10, 27, h) for h in range(4))]


def test_dst_fall_back_daily_job_runs_once_in_paris() -> None:
    first = next_slot("30 2 * * *", PARIS, at(2024, 10, 26, 12))
    assert first == at(2024, 10, 27, 0, 30)  # 02:30 CEST
    # the next slot after it is the following day's 02:30 CET, not the repeated wall time
    assert next_slot("30 2 * * *", PARIS, first) == at(2024, 10, 28, 1, 30)


def test_long_outage_of_a_minutely_schedule_is_cheap() -> None:
    """Four years of missed minutely slots (about two million): choosing the latest few
    walks backwards from now, so it costs `keep` steps."""
    waiting = at(2020, 1, 1)
    now = at(2024, 1, 1, 0, 0, 30)
    started = time.perf_counter()
    latest = due_slots("* * * * *", UTC_ZONE, waiting, now, 1)
    caught_up = due_slots("* * * * *", UTC_ZONE, waiting, now, 4)
    elapsed = time.perf_counter() - started
    assert latest == [at(2024, 1, 1)]
    assert caught_up == [
        at(2023, 12, 31, 23, 57),
        at(2023, 12, 31, 23, 58),
        at(2023, 12, 31, 23, 59),
        at(2024, 1, 1),
    ]
    assert elapsed < 0.5, f"choosing slots after a long outage took {elapsed:.2f}s"


# -- schedule(...) validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    "cron", ["", "* * * *", "60 * * * *", "*/0 * * * *", "a b c d e", "* * * * * * * *"]
)
def test_bad_cron_is_a_configuration_error(cron: str) -> None:
    with pytest.raises(ConfigurationError, match="cron"):
        schedule(id="s", task=report, cron=cron, payload=Report("x"))


def test_non_string_cron_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        schedule(id="s", task=report, cron=5, payload=Report("x"))  # type: ignore[arg-type]


def test_cron_that_never_fires_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        schedule(id="s", task=report, cron="0 0 31 2 *", payload=Report("x"))


def test_seven_field_cron_is_rejected() -> None:
    with pytest.raises(ConfigurationError, match="not a valid cron expression"):
        schedule(id="s", task=tick, cron="* * * * * * *")


@pytest.mark.parametrize("zone", ["Mars/Olympus", "", "Europe/../UTC", "utc+2"])
def test_unknown_timezone_is_a_configuration_error(zone: str) -> None:
    with pytest.raises(ConfigurationError, match="timezone"):
        schedule(id="s", task=report, cron="* * * * *", payload=Report("x"), timezone=zone)


@pytest.mark.parametrize("catch_up", [-1, 1001, 10**9, True, 1.5, "3"])
def test_bad_catch_up_is_a_configuration_error(catch_up: Any) -> None:
    with pytest.raises(ConfigurationError, match="catch_up"):
        schedule(id="s", task=report, cron="* * * * *", payload=Report("x"), catch_up=catch_up)


def test_catch_up_bounds_are_accepted() -> None:
    assert schedule(id="s", task=tick, cron="* * * * *", catch_up=0).catch_up == 0
    assert schedule(id="s", task=tick, cron="* * * * *", catch_up=1000).catch_up == 1000


@pytest.mark.parametrize("bad_id", ["", " s", "-s", "a b", "x" * 201, "é", 7, None])
def test_bad_schedule_id_is_a_configuration_error(bad_id: Any) -> None:
    with pytest.raises(ConfigurationError, match="id"):
        schedule(id=bad_id, task=tick, cron="* * * * *")


def test_task_must_be_a_task() -> None:
    def plain(payload: Any, context: RunContext) -> None:
        return None

    with pytest.raises(ConfigurationError, match="task"):
        schedule(id="s", task=plain, cron="* * * * *")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="task"):
        schedule(id="s", task="tick", cron="* * * * *")  # type: ignore[arg-type]


def test_bad_priority_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="priority"):
        schedule(id="s", task=tick, cron="* * * * *", priority="high")  # type: ignore[arg-type]


def test_valid_schedule_keeps_its_definition() -> None:
    made = schedule(
        id="reports.daily",
        task=report,
        cron="30 2 * * *",
        payload=Report("daily"),
        timezone="Europe/Paris",
        catch_up=2,
        priority=5,
    )
    assert (made.id, made.task, made.cron, made.timezone) == (
        "reports.daily",
        report,
        "30 2 * * *",
        "Europe/Paris",
    )
    assert (made.catch_up, made.priority, made.payload) == (2, 5, Report("daily"))
    assert made.zone == PARIS


# -- create_runlane(schedules=...) validation ----------------------------------------------------


def test_schedule_for_an_unregistered_task(make_runlane: RunlaneFactory) -> None:
    sched = schedule(id="s", task=stray, cron="* * * * *")
    with pytest.raises(ConfigurationError, match="not registered"):
        make_runlane(tasks=[tick], schedules=[sched])


def test_schedule_payload_invalid_for_the_task_schema(make_runlane: RunlaneFactory) -> None:
    sched = schedule(id="s", task=report, cron="* * * * *", payload={"nope": 1})
    with pytest.raises(ConfigurationError, match="'s'"):
        make_runlane(tasks=[report], schedules=[sched])
    missing = schedule(id="s2", task=report, cron="* * * * *")  # payload None
    with pytest.raises(ConfigurationError):
        make_runlane(tasks=[report], schedules=[missing])
    # a mapping cattrs can structure is fine
    fine = schedule(id="s3", task=report, cron="* * * * *", payload={"name": "ok"})
    make_runlane(tasks=[report], schedules=[fine])


def test_duplicate_schedule_ids(make_runlane: RunlaneFactory) -> None:
    one = schedule(id="dup", task=tick, cron="* * * * *")
    two = schedule(id="dup", task=tick, cron="*/5 * * * *")
    with pytest.raises(ConfigurationError, match="dup"):
        make_runlane(tasks=[tick], schedules=[one, two])


def test_schedule_queue_must_be_registered(make_runlane: RunlaneFactory) -> None:
    sched = schedule(id="s", task=tick, cron="* * * * *", queue="elsewhere")
    with pytest.raises(ConfigurationError, match="elsewhere"):
        make_runlane(tasks=[tick], schedules=[sched])


def test_schedules_takes_schedule_definitions(make_runlane: RunlaneFactory) -> None:
    with pytest.raises(ConfigurationError):
        make_runlane(tasks=[tick], schedules=["* * * * *"])


# -- the SCHEDULES phase against the database ----------------------------------------------------


class Tables(SchemaDb):
    """Reads of the test schema's schedule tables."""

    def now(self) -> datetime:
        row = self.conn.execute("select clock_timestamp()").fetchone()
        assert row is not None
        value: datetime = row[0]
        return value

    def state(self, schedule_id: str) -> tuple[str, str, datetime]:
        row = self.conn.execute(
            self.q(
                "select cron, timezone, next_slot_at from {schema}.schedules where schedule_id = %s"
            ),
            (schedule_id,),
        ).fetchone()
        assert row is not None, f"schedule {schedule_id} has no state row"
        return row[0], row[1], row[2]

    def slots(self, schedule_id: str) -> list[tuple[datetime, Any]]:
        return [
            (row[0], row[1])
            for row in self.conn.execute(
                self.q(
                    "select slot_at, run_id from {schema}.schedule_slots "
                    "where schedule_id = %s order by slot_at"
                ),
                (schedule_id,),
            )
        ]

    def runs(self, task_id: str) -> list[tuple[Any, str, Any, int]]:
        return [
            (row[0], row[1], row[2], row[3])
            for row in self.conn.execute(
                self.q(
                    "select id, status, payload, priority from {schema}.runs "
                    "where task_id = %s order by created_at, id"
                ),
                (task_id,),
            )
        ]

    def move_next_slot(self, schedule_id: str, by: timedelta) -> None:
        self.conn.execute(
            self.q(
                "update {schema}.schedules set next_slot_at = next_slot_at + %s "
                "where schedule_id = %s"
            ),
            (by, schedule_id),
        )

    def advance(self, schedule_id: str, by: timedelta) -> None:
        """Move the schedule's clock ``by`` forward: its awaited slot and its fired slots move
        that far into the past, as if that much database time had passed (no sleeping)."""
        for shift in (-timedelta(days=3650), timedelta(days=3650) - by):  # no key collisions
            self.conn.execute(
                self.q(
                    "update {schema}.schedule_slots set slot_at = slot_at + %s "
                    "where schedule_id = %s"
                ),
                (shift, schedule_id),
            )
        self.move_next_slot(schedule_id, -by)


@pytest.fixture
def tables(db: Conn, schema: str) -> Tables:
    return Tables(db, schema)


def every_second(**options: Any) -> Any:
    return schedule(
        id="every-second", task=report, cron="* * * * * *", payload=Report("s"), **options
    )


def test_first_sighting_creates_nothing_then_one_run_per_due_slot(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    rl = make_runlane(tasks=[report], schedules=[every_second(priority=3)])
    before = tables.now()
    first = rl.run_maintenance_once()
    assert first.schedules_created == 0
    assert tables.runs("report") == []
    assert tables.slots("every-second") == []
    cron, zone, awaited = tables.state("every-second")
    assert (cron, zone) == ("* * * * * *", "UTC")
    # the first sighting records the next slot: a whole second, after the pass began
    assert awaited.microsecond == 0
    assert before < awaited <= before + timedelta(seconds=2)

    # two seconds pass: the awaited slot (at most two seconds ahead) is due
    tables.advance("every-second", timedelta(seconds=2))
    awaited -= timedelta(seconds=2)
    second = rl.run_maintenance_once()
    assert second.schedules_created == 1
    assert second.total == 1
    slots = tables.slots("every-second")
    assert len(slots) == 1
    slot_at, run_id = slots[0]
    assert slot_at >= awaited
    assert slot_at <= tables.now()
    assert tables.runs("report") == [(run_id, "queued", {"name": "s"}, 3)]
    # the awaited slot moved past the fired one
    _, _, following = tables.state("every-second")
    assert following > slot_at

    # the run is an ordinary run: a drain executes it with the schedule's payload
    assert rl.drain().runs_executed == 1
    snap = rl.get_run(run_id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.output == "s"


def test_repeated_passes_never_fire_a_slot_twice(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    rl = make_runlane(tasks=[report], schedules=[every_second()])
    rl.run_maintenance_once()
    created = 0
    started = time.monotonic()
    for _ in range(3):
        tables.advance("every-second", timedelta(seconds=1))  # one second passes
        for _ in range(5):  # and several passes run within it
            created += rl.run_maintenance_once().schedules_created
    # one slot per second passed: three moved, plus any real second boundary crossed
    real_seconds = time.monotonic() - started
    slots = tables.slots("every-second")
    runs = tables.runs("report")
    assert created == len(slots) == len(runs)
    assert 3 <= created <= 3 + int(real_seconds) + 1
    assert {run_id for _, run_id in slots} == {run[0] for run in runs}
    # distinct whole-second slots, in order
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(slots)]
    assert all(gap >= timedelta(seconds=1) for gap in gaps), gaps


def test_racing_replicas_create_exactly_one_run_per_slot(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    replicas: list[Runlane] = [
        make_runlane(tasks=[report], schedules=[every_second()]) for _ in range(6)
    ]
    for rl in replicas:
        rl.start()

    def race() -> list[MaintenanceResult]:
        return run_together([rl.run_maintenance_once for rl in replicas])

    def one_run_per_slot(total: int) -> None:
        slots = tables.slots("every-second")
        runs = tables.runs("report")
        assert len(slots) == len(runs) == total, (slots, runs)
        assert len({slot for slot, _ in slots}) == len(slots)
        assert {run_id for _, run_id in slots} == {run[0] for run in runs}

    # six first sightings at once: one state row, and no run unless the race outlasted the
    # awaited slot (the next whole second after the first pass began: it can be a moment
    # away, and on a loaded machine six passes can take a second or more)
    started = time.monotonic()
    total = sum(r.schedules_created for r in race())
    assert total <= 1 + int(time.monotonic() - started)
    assert len(tables.conn.execute(tables.q("select * from {schema}.schedules")).fetchall()) == 1
    one_run_per_slot(total)
    for _ in range(3):
        tables.advance("every-second", timedelta(seconds=1))
        round_created = sum(r.schedules_created for r in race())
        assert round_created >= 1
        total += round_created
        one_run_per_slot(total)


def test_after_downtime_only_the_latest_missed_slot_runs(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    minutely = schedule(id="minutely", task=tick, cron="* * * * *")
    rl = make_runlane(tasks=[tick], schedules=[minutely])
    assert rl.run_maintenance_once().schedules_created == 0
    tables.move_next_slot("minutely", -timedelta(minutes=10))  # ten minutes of downtime
    result = rl.run_maintenance_once()
    assert result.schedules_created == 1
    ((slot_at, _),) = tables.slots("minutely")
    now = tables.now()
    assert (slot_at.second, slot_at.microsecond) == (0, 0)
    assert now - timedelta(minutes=1) < slot_at <= now  # the latest slot, not an old one
    _, _, following = tables.state("minutely")
    assert following == slot_at + timedelta(minutes=1)
    # nothing more is due
    assert rl.run_maintenance_once().schedules_created == 0
    assert len(tables.runs("tick")) == 1


@pytest.mark.parametrize(("catch_up", "expected"), [(3, 4), (30, None)])
def test_after_downtime_catch_up_runs_a_bounded_number(
    make_runlane: RunlaneFactory, tables: Tables, catch_up: int, expected: int | None
) -> None:
    minutely = schedule(id="minutely", task=tick, cron="* * * * *", catch_up=catch_up)
    rl = make_runlane(tasks=[tick], schedules=[minutely])
    rl.run_maintenance_once()
    _, _, awaited = tables.state("minutely")
    tables.move_next_slot("minutely", -timedelta(minutes=10))
    missed_from = awaited - timedelta(minutes=10)
    result = rl.run_maintenance_once()
    slots = [slot for slot, _ in tables.slots("minutely")]
    now = tables.now()
    if expected is None:
        # more room than missed slots: every missed slot from the awaited one runs (10 or 11,
        # depending on whether a minute boundary passed between the passes)
        assert slots[0] == missed_from
        assert len(slots) in (10, 11)
    else:
        assert len(slots) == expected
    assert result.schedules_created == len(slots) == len(tables.runs("tick"))
    assert now - timedelta(minutes=1) < slots[-1] <= now
    gaps = {b - a for a, b in itertools.pairwise(slots)}
    assert gaps == {timedelta(minutes=1)}
    assert rl.run_maintenance_once().schedules_created == 0


def test_schedule_limit_bounds_a_pass_and_the_next_pass_continues(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    minutely = schedule(id="minutely", task=tick, cron="* * * * *", catch_up=3)
    rl = make_runlane(tasks=[tick], schedules=[minutely])
    rl.run_maintenance_once()
    tables.move_next_slot("minutely", -timedelta(minutes=10))
    first = rl.run_maintenance_once(MaintenanceLimits(schedule_limit=2))
    assert first.schedules_created == 2
    assert len(tables.slots("minutely")) == 2
    rest = rl.run_maintenance_once()
    assert rest.schedules_created == 2
    slots = [slot for slot, _ in tables.slots("minutely")]
    assert len(slots) == 4
    assert {b - a for a, b in itertools.pairwise(slots)} == {timedelta(minutes=1)}
    assert rl.run_maintenance_once(MaintenanceLimits(schedule_limit=0)).schedules_created == 0


def test_a_changed_cron_resets_the_state(make_runlane: RunlaneFactory, tables: Tables) -> None:
    old = make_runlane(tasks=[tick], schedules=[schedule(id="s", task=tick, cron="* * * * *")])
    old.run_maintenance_once()
    tables.move_next_slot("s", -timedelta(minutes=10))  # a slot of the old definition is due
    new = make_runlane(tasks=[tick], schedules=[schedule(id="s", task=tick, cron="0 0 1 1 *")])
    assert new.run_maintenance_once().schedules_created == 0
    cron, zone, awaited = tables.state("s")
    assert (cron, zone) == ("0 0 1 1 *", "UTC")
    now = tables.now()
    assert awaited == datetime(now.year + 1, 1, 1, tzinfo=UTC)
    assert tables.runs("tick") == []
    # a changed timezone resets it too
    paris = make_runlane(
        tasks=[tick],
        schedules=[schedule(id="s", task=tick, cron="0 0 1 1 *", timezone="Europe/Paris")],
    )
    assert paris.run_maintenance_once().schedules_created == 0
    cron, zone, awaited = tables.state("s")
    assert (cron, zone) == ("0 0 1 1 *", "Europe/Paris")
    assert awaited == datetime(now.year + 1, 1, 1, tzinfo=PARIS)
    assert tables.runs("tick") == []
    # the unchanged definition does not reset again
    tables.move_next_slot("s", -timedelta(days=400))
    assert paris.run_maintenance_once().schedules_created == 1


def test_schedule_uses_its_queue_and_environment(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    reports = queue("reports")
    sched = schedule(id="s", task=tick, cron="* * * * *", queue="reports")
    rl = make_runlane(tasks=[tick], queues=[reports], schedules=[sched], environment="prod")
    other = make_runlane(tasks=[tick], environment="staging")
    rl.run_maintenance_once()
    tables.move_next_slot("s", -timedelta(minutes=2))
    assert other.run_maintenance_once().schedules_created == 0  # no schedule there
    assert rl.run_maintenance_once().schedules_created == 1
    row = tables.conn.execute(
        tables.q("select environment, queue from {schema}.runs where task_id = 'tick'")
    ).fetchall()
    assert row == [("prod", "reports")]
    assert other.drain().runs_executed == 0
    assert rl.drain(queues=["default"]).runs_executed == 0
    assert rl.drain(queues=["reports"]).runs_executed == 1


def test_stale_replica_writes_cannot_move_a_schedule_back(
    make_runlane: RunlaneFactory, tables: Tables
) -> None:
    """Storage guards against replicas acting on an old read of the schedule: a first
    sighting does not overwrite a known state, and a slot fired from an old read does not
    move the awaited slot."""
    rl = make_runlane(tasks=[tick], schedules=[schedule(id="m", task=tick, cron="* * * * *")])
    rl.run_maintenance_once()
    _, _, awaited = tables.state("m")
    stale = ScheduleState("m", "* * * * *", "UTC", awaited - timedelta(hours=1))
    storage_of(rl).schedule_state_reset(rl.environment, stale)
    assert tables.state("m")[2] == awaited

    tables.move_next_slot("m", -timedelta(minutes=10))
    old_read = awaited - timedelta(minutes=10)
    assert rl.run_maintenance_once().schedules_created == 1
    ((fired, _),) = tables.slots("m")
    _, _, current = tables.state("m")
    assert current == fired + timedelta(minutes=1)
    # a replica that read the schedule before that pass fires the same slot and tries to
    # advance from what it read: no second run, and the awaited slot stays
    late = ScheduledRun(rl.environment, "m", fired, uuid.uuid4(), "tick", "default", 0, "null", 3)
    assert (
        storage_of(rl).schedule_fire(late, next_slot_at=old_read, expected_slot_at=old_read)
        is False
    )
    assert tables.state("m")[2] == current
    assert len(tables.runs("tick")) == 1
