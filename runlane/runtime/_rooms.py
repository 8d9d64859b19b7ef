"""The rooms a ``Runlane`` hands its calls to, wired together for one runtime."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from runlane import _telemetry
from runlane.lanes import Lane
from runlane.maintenance import RetentionPolicy
from runlane.models import RunSnapshot
from runlane.runtime._actions import RunActions
from runlane.runtime._audit import AuditTrail
from runlane.runtime._lifetime import Lifetime
from runlane.runtime._queue_admin import QueueAdmin
from runlane.runtime._reads import Reads
from runlane.runtime._schedule_admin import ScheduleAdmin
from runlane.runtime._services import ServiceStarts
from runlane.runtime._stats import StatsReads
from runlane.runtime._triggering import Triggering
from runlane.runtime._waiting import Waits
from runlane.schedules import Schedule
from runlane.storage import Storage
from runlane.tasks import Queue, Task
from runlane.worker import Middleware

__all__ = ["Rooms", "wire_rooms"]


@attrs.frozen
class Rooms:
    """One runtime's rooms; ``life`` opens and closes what they work through."""

    life: Lifetime
    triggering: Triggering
    reads: Reads
    stats: StatsReads
    audit: AuditTrail
    actions: RunActions
    queue_admin: QueueAdmin
    schedule_admin: ScheduleAdmin
    waits: Waits
    services: ServiceStarts


def wire_rooms(
    runtime: _telemetry.StatusSource,
    get_run: Callable[[Any], RunSnapshot],
    *,
    lane: Lane,
    queues: dict[str, Queue],
    tasks: dict[str, Task[Any, Any]],
    schedules: Sequence[Schedule],
    retention: RetentionPolicy,
    environment: str,
    limits: tuple[int, int],
    middleware: Sequence[Middleware],
) -> Rooms:
    """The rooms of ``runtime``, connected to a fresh storage; ``limits`` is
    (max_payload_bytes, max_output_bytes)."""
    max_payload_bytes, max_output_bytes = limits

    def connected(storage: Storage) -> None:
        reads.connect(storage)
        services.connect(storage)

    life = Lifetime(lane, environment, runtime, connected)
    opened = life.opened
    default_queue = next(q.name for q in queues.values() if q.default)
    triggering = Triggering(environment, tasks, queues, default_queue, max_payload_bytes, opened)
    entries = [triggering.schedule_entry(s) for s in schedules]
    reads = Reads(environment, lane, queues, opened)
    audit = AuditTrail(environment, opened)
    services = ServiceStarts(
        environment=environment,
        lane=lane,
        tasks=tasks,
        queues=queues,
        schedules=entries,
        retention=retention,
        middleware=tuple(middleware),
        max_output_bytes=max_output_bytes,
        trigger=triggering.runs,
        life=life,
    )
    rooms = Rooms(
        life=life,
        triggering=triggering,
        reads=reads,
        stats=StatsReads(environment, opened),
        audit=audit,
        actions=RunActions(environment, opened, audit),
        queue_admin=QueueAdmin(environment, queues, opened, audit),
        schedule_admin=ScheduleAdmin(environment, entries, opened, audit),
        waits=Waits(environment, max_output_bytes, opened, get_run, life.end_watcher),
        services=services,
    )
    life.connect()
    return rooms
