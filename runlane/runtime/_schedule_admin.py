"""Operating schedules: list them with their next fire time, pause and resume them, fire one
now, and find the late ones for ``status()``.

It works on a runtime that defines no tasks (the operator CLI's, built from a database URL):
maintenance stores each schedule's task, queue, payload and budget with its state. Schedules
this runtime defines but maintenance has not stored yet are listed, paused and fired too.
Time is the database's: a resumed schedule awaits the first slot after its ``now()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs

from runlane import _telemetry
from runlane._ids import new_run_id
from runlane._limits import NAME_PATTERN
from runlane._validation import check_idempotency_key
from runlane.errors import ConfigurationError
from runlane.maintenance import BANDS, MaintenancePhase, ScheduleEntry
from runlane.models import RunHandle, ScheduleInfo
from runlane.runtime._audit import AuditTrail
from runlane.runtime._backend import Opened
from runlane.schedules import next_slot
from runlane.storage import InsertedRun, NewRuns, ScheduleState, Storage
from runlane.toolkit import shown

__all__ = ["LATE_AFTER", "ScheduleAdmin", "late_schedules"]

# a schedule whose awaited slot is further past than this (database time) is late: a minute
# (a band's owner may die and its lease pass to another replica) plus one pass interval
LATE_AFTER = timedelta(minutes=1) + next(
    band.interval for band in BANDS if MaintenancePhase.SCHEDULES in band.phases
)
# status() names at most this many late schedules, the most overdue first
LATE_LIST_LIMIT = 100


def _unknown(environment: str, schedule_id: object) -> ConfigurationError:
    return ConfigurationError(
        f"no schedule {shown(schedule_id)} in environment {environment!r}: list the "
        "schedules with `runlane schedules list` (or Runlane.list_schedules()); a schedule "
        "is stored by the first maintenance pass of an application that defines it"
    )


def _check_id(environment: str, schedule_id: object) -> str:
    if not isinstance(schedule_id, str):
        raise ConfigurationError(
            f"a schedule id is a string (the id given to schedule(id=...)), got "
            f"{shown(schedule_id)}; list the schedules with `runlane schedules list`"
        )
    if not NAME_PATTERN.fullmatch(schedule_id):  # no schedule can have it: nothing to look up
        raise _unknown(environment, schedule_id)
    return schedule_id


def _defined(entries: Sequence[ScheduleEntry], schedule_id: str) -> ScheduleEntry | None:
    return next((e for e in entries if e.schedule.id == schedule_id), None)


def _zone(name: str) -> tzinfo:
    """The schedule's zone; UTC for a stored name this machine's time zone data lacks."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return UTC


def _local(instant: datetime | None, name: str) -> datetime | None:
    return None if instant is None else instant.astimezone(_zone(name))


def _store(storage: Storage, environment: str, entry: ScheduleEntry) -> None:
    """Store a schedule this runtime defines as its first maintenance pass would."""
    sched = entry.schedule
    following = next_slot(sched.cron, sched.zone, storage.database_now())
    state = ScheduleState(sched.id, sched.cron, sched.timezone, following)
    storage.schedule_state_reset(environment, state, definition=entry.definition)


@attrs.define(eq=False)
class ScheduleAdmin:
    """The schedules of one environment: those stored and those this runtime defines
    (``entries``), through the storage ``opened()`` returns."""

    _environment: str
    _entries: Sequence[ScheduleEntry]
    _opened: Opened
    _trail: AuditTrail

    def infos(self) -> list[ScheduleInfo]:
        """Every stored schedule of the environment and every one this runtime defines, by id."""
        storage = self._opened()
        stored = {row.schedule_id: row for row in storage.schedule_list(self._environment)}
        defined = {entry.schedule.id: entry for entry in self._entries}
        # a schedule not stored yet awaits what its first sighting will set: the next slot
        now = storage.database_now() if defined.keys() - stored.keys() else None
        infos: list[ScheduleInfo] = []
        for schedule_id in sorted(stored.keys() | defined.keys()):
            row = stored.get(schedule_id)
            entry = defined.get(schedule_id)
            if row is None:
                assert entry is not None
                assert now is not None
                sched = entry.schedule
                infos.append(
                    ScheduleInfo(
                        id=schedule_id,
                        cron=sched.cron,
                        timezone=sched.timezone,
                        task_id=sched.task.id,
                        queue=entry.queue,
                        paused=False,
                        next_fire_at=next_slot(sched.cron, sched.zone, now).astimezone(sched.zone),
                        last_fired_at=None,
                        last_run_id=None,
                        defined=True,
                    )
                )
                continue
            # a row stored before definitions were: this runtime's definition, if it has one
            own = None if entry is None else entry.definition
            infos.append(
                ScheduleInfo(
                    id=schedule_id,
                    cron=row.cron,
                    timezone=row.timezone,
                    task_id=row.task_id if row.task_id is not None or own is None else own.task_id,
                    queue=row.queue if row.queue is not None or own is None else own.queue,
                    paused=row.paused,
                    next_fire_at=None if row.paused else _local(row.next_slot_at, row.timezone),
                    last_fired_at=_local(row.last_fired_at, row.timezone),
                    last_run_id=row.last_run_id,
                    defined=entry is not None,
                )
            )
        return infos

    def pause(self, schedule_id: object, reason: object = None) -> bool:
        """Pause; True when it was not paused before."""
        sid = _check_id(self._environment, schedule_id)
        return self._trail.record(
            self._trail.entry("pause_schedule", sid, reason, {}),
            lambda storage: self._pause(storage, sid),
            lambda changed: (None, changed),
        )

    def _pause(self, storage: Storage, sid: str) -> bool:
        was_paused = storage.schedule_pause(self._environment, sid)
        if was_paused is None:
            entry = _defined(self._entries, sid)
            if entry is None:
                raise _unknown(self._environment, sid)
            _store(storage, self._environment, entry)
            was_paused = storage.schedule_pause(self._environment, sid)
            if was_paused is None:  # removed again meanwhile
                raise _unknown(self._environment, sid)
        return not was_paused

    def resume(self, schedule_id: object, reason: object = None) -> bool:
        """Resume, awaiting the first slot after the database's now; True when it was
        paused."""
        sid = _check_id(self._environment, schedule_id)
        return self._trail.record(
            self._trail.entry("resume_schedule", sid, reason, {}),
            lambda storage: self._resume(storage, sid),
            lambda changed: (None, changed),
        )

    def _resume(self, storage: Storage, sid: str) -> bool:
        while True:
            row = storage.schedule_get(self._environment, sid)
            if row is None:
                if _defined(self._entries, sid) is None:
                    raise _unknown(self._environment, sid)
                return False  # defined here and never stored: never paused
            if not row.paused:
                return False
            try:
                zone = ZoneInfo(row.timezone)
            except (ZoneInfoNotFoundError, ValueError) as exc:
                raise ConfigurationError(
                    f"schedule {sid!r} is stored with time zone {row.timezone!r}, which this "
                    "machine's time zone data lacks: install or update the tzdata package, or "
                    "resume it from the application that defines it"
                ) from exc
            following = next_slot(row.cron, zone, storage.database_now())
            # guarded by what it was computed from: a concurrent redefinition is read again
            if storage.schedule_resume(self._environment, sid, row.cron, row.timezone, following):
                return True

    def run_now(
        self, schedule_id: object, idempotency_key: str | None, reason: object = None
    ) -> RunHandle:
        """One run of the schedule's task, queue and payload, due now; its slots are untouched.

        A stored definition is used through the storage's ``schedule_run_now`` (on Postgres a
        function the operator role may execute: it cannot insert runs of its own); a schedule
        this runtime defines that is not stored yet is triggered like any run."""
        sid = _check_id(self._environment, schedule_id)
        if idempotency_key is not None:
            check_idempotency_key(idempotency_key)
        return self._trail.record(
            self._trail.entry("run_schedule_now", sid, reason, {}),
            lambda storage: self._run_now(storage, sid, idempotency_key),
            lambda handle: (int(handle.created), handle.created),
        )

    def _run_now(self, storage: Storage, sid: str, idempotency_key: str | None) -> RunHandle:
        row = storage.schedule_get(self._environment, sid)
        entry = _defined(self._entries, sid)
        insert: Callable[[NewRuns], list[InsertedRun]]
        if row is not None and row.definition is not None:
            definition = row.definition

            def insert(runs: NewRuns) -> list[InsertedRun]:
                inserted = storage.schedule_run_now(
                    self._environment, sid, runs.ids[0], idempotency_key, runs.trace_context
                )
                if inserted is None:  # removed (or its definition) since it was read
                    raise _unknown(self._environment, sid)
                return [inserted]

        elif entry is not None:
            definition = entry.definition
            insert = storage.run_insert_many
        elif row is None:
            raise _unknown(self._environment, sid)
        else:
            raise ConfigurationError(
                f"schedule {sid!r} has no stored task, queue and payload yet (a runtime older "
                "than schema version 6 stored it): the next maintenance pass of an application "
                "that defines it stores them; or run it from that application"
            )
        runs = NewRuns(
            environment=self._environment,
            task_id=definition.task_id,
            queue=definition.queue,
            ids=[new_run_id()],
            payloads=[definition.payload],
            idempotency_keys=[idempotency_key],
            priority=definition.priority,
            max_attempts=definition.max_attempts,
            delay=timedelta(0),
            run_at=None,
        )
        (inserted,) = _telemetry.trigger(runs, insert)
        return RunHandle(
            id=inserted.id,
            task_id=definition.task_id,
            queue=inserted.queue,
            created=inserted.created,
        )


def late_schedules(storage: Storage, environment: str) -> tuple[str, ...]:
    """Unpaused schedules whose awaited slot is more than LATE_AFTER past, most overdue
    first (at most LATE_LIST_LIMIT)."""
    return tuple(storage.schedule_list_late(environment, LATE_AFTER, LATE_LIST_LIMIT))
