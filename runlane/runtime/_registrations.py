"""The checks ``create_runlane`` makes of what an application registers (its lane, queues,
tasks, schedules, retention, environment, size limits and middleware) before a runtime is
built: each refusal a ConfigurationError saying what to change."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runlane._limits import check_limit, check_name
from runlane._validation import with_default_queue
from runlane.errors import ConfigurationError
from runlane.lanes import ChecksQueueNames, Lane
from runlane.maintenance import RetentionPolicy
from runlane.schedules import Schedule
from runlane.tasks import Queue, Task
from runlane.toolkit import shown
from runlane.worker import Middleware, check_middleware

__all__ = ["check_registrations"]


def check_registrations(
    *,
    lane: Lane,
    queues: Sequence[Queue],
    tasks: Sequence[Task[Any, Any]],
    schedules: Sequence[Schedule],
    retention: RetentionPolicy | None,
    environment: str,
    limits: tuple[int, int],
    middleware: Sequence[Middleware],
) -> tuple[list[Queue], tuple[Middleware, ...]]:
    """The queues (with the default one added) and the middleware, checked; ``limits`` is
    (max_payload_bytes, max_output_bytes)."""
    max_payload_bytes, max_output_bytes = limits
    check_name("environment", environment)
    checked_middleware = check_middleware(middleware)
    check_limit("max_payload_bytes", max_payload_bytes)
    check_limit("max_output_bytes", max_output_bytes)
    if retention is not None and not isinstance(retention, RetentionPolicy):
        raise ConfigurationError(f"retention must be a RetentionPolicy, got {shown(retention)}")
    schedule_ids = [getattr(s, "id", s) for s in schedules]
    repeated = sorted({str(i) for i in schedule_ids if schedule_ids.count(i) > 1})
    if repeated:
        raise ConfigurationError(f"schedules registered twice: {repeated}")
    queue_list = with_default_queue(queues)
    registered = {q.name for q in queue_list}
    task_ids: set[str] = set()
    for t in tasks:
        if not isinstance(t, Task):
            raise ConfigurationError(f"tasks takes @task-decorated functions, got {shown(t)}")
        if t.id in task_ids:
            raise ConfigurationError(f"two tasks share the id {t.id!r}")
        task_ids.add(t.id)
        if t.queue is not None and t.queue not in registered:
            raise ConfigurationError(
                f"task {t.id!r} names queue {t.queue!r}, which is not registered: add "
                f"queue({t.queue!r}) to create_runlane(queues=[...])"
            )
    # a lane whose transport limits names (RabbitMQ's 255-byte queue names) refuses them here
    if isinstance(lane, ChecksQueueNames):
        lane.check_queue_names(environment, [q.name for q in queue_list])
    return queue_list, checked_middleware
