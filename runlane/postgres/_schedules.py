"""The schedules repository: the SCHEDULES phase's state, definitions and
fires, and the operator's list, pause, resume and late check. The statements are in
``sql/schedules.sql`` (and ``status_late_schedules`` in ``sql/status.sql``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import attrs

from runlane.postgres._audit import audited
from runlane.postgres._connections import Conn
from runlane.postgres._executor import Executor
from runlane.storage import (
    InsertedRun,
    MaintenanceFence,
    ScheduleDefinition,
    ScheduledRun,
    ScheduleState,
    StoredSchedule,
)

__all__ = ["ScheduleRepository"]


def _definition_params(definition: ScheduleDefinition | None) -> dict[str, Any]:
    if definition is None:
        return dict.fromkeys(("task_id", "queue", "payload", "priority", "max_attempts"))
    return attrs.asdict(definition)


class ScheduleRepository:
    """Schedule statements."""

    def __init__(self, db: Executor) -> None:
        self._db = db
        self._sql = db.sql

    # -- maintenance ---------------------------------------------------------------------

    def schedule_state_list(
        self, environment: str, schedule_ids: Sequence[str]
    ) -> list[ScheduleState]:
        params = {"environment": environment, "schedule_ids": list(schedule_ids)}
        return self._db.run(
            lambda conn: [
                ScheduleState(
                    schedule_id=row[0],
                    cron=row[1],
                    timezone=row[2],
                    next_slot_at=row[3],
                    paused=row[4],
                    definition_digest=row[5],
                )
                for row in conn.execute(self._sql["schedule_state_list"], params)
            ]
        )

    def schedule_state_reset(
        self,
        environment: str,
        state: ScheduleState,
        *,
        definition: ScheduleDefinition | None = None,
        fence: MaintenanceFence | None = None,
    ) -> None:
        params = {
            "environment": environment,
            "schedule_id": state.schedule_id,
            "cron": state.cron,
            "timezone": state.timezone,
            "next_slot_at": state.next_slot_at,
            **_definition_params(definition),
        }
        self._db.fenced(fence, lambda conn: conn.execute(self._sql["schedule_state_reset"], params))

    def schedule_define(
        self,
        environment: str,
        schedule_id: str,
        definition: ScheduleDefinition,
        *,
        fence: MaintenanceFence | None = None,
    ) -> bytes | None:
        params = {
            "environment": environment,
            "schedule_id": schedule_id,
            **_definition_params(definition),
        }

        def define(conn: Conn) -> bytes | None:
            row = conn.execute(self._sql["schedule_define"], params).fetchone()
            if row is None:  # already stored (or no such row): read what is there
                row = conn.execute(self._sql["schedule_definition_digest"], params).fetchone()
            return None if row is None else bytes(row[0])

        return self._db.fenced(fence, define)

    def schedule_fire(
        self,
        run: ScheduledRun,
        next_slot_at: datetime,
        expected_slot_at: datetime,
        *,
        fence: MaintenanceFence | None = None,
    ) -> bool:
        params = {**attrs.asdict(run), "expected_slot_at": expected_slot_at}
        advance = {
            "environment": run.environment,
            "schedule_id": run.schedule_id,
            "next_slot_at": next_slot_at,
            "expected_slot_at": expected_slot_at,
        }

        def fire(conn: Conn) -> bool:
            with conn.transaction():
                created = conn.execute(self._sql["schedule_fire"], params).fetchone() is not None
                conn.execute(self._sql["schedule_advance"], advance)
            return created

        return self._db.fenced(fence, fire)

    # -- operators -----------------------------------------------------------------------

    def schedule_list(self, environment: str) -> list[StoredSchedule]:
        params = {"environment": environment}
        return self._db.run(
            lambda conn: [
                StoredSchedule(*row) for row in conn.execute(self._sql["schedule_list"], params)
            ]
        )

    def schedule_get(self, environment: str, schedule_id: str) -> StoredSchedule | None:
        params = {"environment": environment, "schedule_id": schedule_id}

        def get(conn: Conn) -> StoredSchedule | None:
            row = conn.execute(self._sql["schedule_get"], params).fetchone()
            if row is None:
                return None
            definition = None
            task_id, queue, payload, priority, max_attempts = row[5], row[6], *row[9:]
            if None not in (task_id, queue, payload, priority, max_attempts):
                definition = ScheduleDefinition(task_id, queue, payload, priority, max_attempts)
            (schedule_id, cron, timezone, next_slot_at, paused) = row[:5]
            return StoredSchedule(
                schedule_id=schedule_id,
                cron=cron,
                timezone=timezone,
                next_slot_at=next_slot_at,
                paused=paused,
                task_id=task_id,
                queue=queue,
                last_fired_at=row[7],
                last_run_id=row[8],
                definition=definition,
            )

        return self._db.run(get)

    def schedule_pause(self, environment: str, schedule_id: str) -> bool | None:
        params = {"environment": environment, "schedule_id": schedule_id}

        def pause(conn: Conn) -> bool | None:
            row = conn.execute(self._sql["schedule_pause"], params).fetchone()
            return None if row is None else bool(row[0])

        return self._db.run(pause)

    def schedule_resume(
        self, environment: str, schedule_id: str, cron: str, timezone: str, next_slot_at: datetime
    ) -> bool:
        params = {
            "environment": environment,
            "schedule_id": schedule_id,
            "cron": cron,
            "timezone": timezone,
            "next_slot_at": next_slot_at,
        }
        return self._db.run(
            lambda conn: conn.execute(self._sql["schedule_resume"], params).fetchone() is not None
        )

    def schedule_run_now(
        self,
        environment: str,
        schedule_id: str,
        run_id: uuid.UUID,
        idempotency_key: str | None,
        trace_context: str | None,
    ) -> InsertedRun | None:
        statement, extra = audited(self._db, "schedule_run_now")
        params = {
            "environment": environment,
            "schedule_id": schedule_id,
            "run_id": run_id,
            "idempotency_key": idempotency_key,
            "trace_context": trace_context,
            **extra,
        }

        def run_now(conn: Conn) -> InsertedRun | None:
            row = conn.execute(self._sql[statement], params).fetchone()
            if row is None or row[0] is None:
                return None
            return InsertedRun(id=row[0], queue=row[2], created=bool(row[3]))

        return self._db.run(run_now)

    def schedule_list_late(self, environment: str, late: timedelta, limit: int) -> list[str]:
        params = {
            "environment": environment,
            "late_seconds": late.total_seconds(),
            "limit": limit,
        }
        return self._db.run(
            lambda conn: [
                row[0] for row in conn.execute(self._sql["status_late_schedules"], params)
            ]
        )
