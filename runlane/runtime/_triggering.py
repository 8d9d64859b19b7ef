"""Triggering: a trigger call's task and queue resolved, its options checked, its payloads
encoded and its runs stored; the same for the runs a schedule makes and a handler's child
runs (through ``Backend``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import attrs

from runlane import _telemetry
from runlane._codec import encode_payload
from runlane._ids import new_run_ids
from runlane._validation import (
    DEFAULT_OPTIONS,
    TriggerOptions,
    as_duration,
    as_int32,
    as_run_at,
    check_idempotency_key,
)
from runlane.context import TaskRef
from runlane.errors import ConfigurationError, PayloadValidationError, TaskNotFound
from runlane.flow import check_run_key
from runlane.maintenance import ScheduleEntry
from runlane.models import RunHandle
from runlane.runtime._backend import Opened
from runlane.schedules import Schedule
from runlane.storage import NewRuns
from runlane.tasks import Queue, Task
from runlane.toolkit import shown

__all__ = ["Triggering"]


@attrs.frozen
class _Plan:
    """A trigger's options checked for one task (Triggering.plan)."""

    task: Task[Any, Any]
    queue: str
    max_attempts: int
    delay: timedelta


@attrs.define(eq=False)
class Triggering:
    """Runs checked against this runtime's tasks and queues, then stored through the
    storage ``opened()`` returns."""

    _environment: str
    _tasks: Mapping[str, Task[Any, Any]]
    _queues: Mapping[str, Queue]
    _default_queue: str
    _max_payload_bytes: int
    _opened: Opened
    # the checked plan of each task's triggers with default options (see plan)
    _default_plans: dict[TaskRef | str, _Plan] = attrs.field(init=False, factory=dict)

    def resolve_task(self, task: TaskRef | str) -> Task[Any, Any]:
        task_id = task if isinstance(task, str) else getattr(task, "id", None)
        registered = self._tasks.get(task_id) if isinstance(task_id, str) else None
        if registered is None or (isinstance(task, Task) and registered is not task):
            raise TaskNotFound(
                f"task {shown(task_id or task)} is not registered with this runtime: pass it in "
                f"create_runlane(tasks=[...]) (registered: {sorted(self._tasks) or 'none'})"
            )
        return registered

    def resolve_queue(self, task: Task[Any, Any], queue: str | None) -> str:
        if queue is not None and not isinstance(queue, str):
            raise ConfigurationError(
                f"queue must be a queue name (a string) or None, got {type(queue).__name__} "
                f"{shown(queue)}"
            )
        name = queue if queue is not None else task.queue or self._default_queue
        if name not in self._queues:
            raise ConfigurationError(
                f"queue {shown(name)} is not registered with this runtime: pass "
                f"queue({shown(name)}) in create_runlane(queues=[...]) (registered: "
                f"{sorted(self._queues)})"
            )
        return name

    def schedule_entry(self, sched: Schedule) -> ScheduleEntry:
        """A registered schedule with what its runs need, checked at start-up."""
        if not isinstance(sched, Schedule):
            raise ConfigurationError(
                f"schedules takes schedule(...) definitions, got {shown(sched)}"
            )
        try:
            task = self.resolve_task(sched.task)
        except TaskNotFound as exc:
            raise ConfigurationError(
                f"schedule {sched.id!r} runs task {sched.task.id!r}, which is not registered: "
                "add it to create_runlane(tasks=[...])"
            ) from exc
        try:
            payload = encode_payload(task.id, task.schema, sched.payload, self._max_payload_bytes)
        except PayloadValidationError as exc:
            raise ConfigurationError(f"schedule {sched.id!r}: {exc}") from exc
        return ScheduleEntry(
            schedule=sched,
            queue=self.resolve_queue(task, sched.queue),
            payload=payload,
            max_attempts=task.retry.max_attempts,
        )

    def plan(self, task: TaskRef | str, options: TriggerOptions) -> _Plan:
        """``options`` checked for runs of ``task``: its task, queue, attempts and due time.

        A call with every option at its default gets the plan its task's first such call
        made (the checks depend on nothing else), so the common trigger checks nothing
        twice; anything else is checked on every call."""
        defaults = options is DEFAULT_OPTIONS
        if defaults:
            try:
                plan = self._default_plans.get(task)
            except TypeError:  # an unhashable "task": the checks below refuse it
                plan = None
            if plan is not None:
                return plan
        resolved = self.resolve_task(task)
        queue_name = self.resolve_queue(resolved, options.queue)
        check_run_key(self._queues[queue_name], options.concurrency_key)
        delay_delta = as_duration("delay", options.delay)
        if options.run_at is not None:
            if options.delay is not None:
                raise ConfigurationError("pass either delay or run_at, not both")
            as_run_at(options.run_at)
        as_int32("priority", options.priority)
        attempts = (
            resolved.retry.max_attempts if options.max_attempts is None else options.max_attempts
        )
        as_int32("max_attempts", attempts, minimum=1)
        plan = _Plan(resolved, queue_name, attempts, delay_delta)
        # kept for the registered task itself and its id only: the map stays as small as the
        # catalog (another object naming a registered id is checked each time)
        if defaults and (task is resolved or type(task) is str):
            self._default_plans[task] = plan
        return plan

    def new_runs(
        self,
        task: TaskRef | str,
        payloads: Iterable[Any],
        idempotency_keys: Sequence[str | None] | None,
        options: TriggerOptions,
        *,
        batch: bool = False,
    ) -> NewRuns:
        plan = self.plan(task, options)
        resolved = plan.task
        limit = self._max_payload_bytes
        encoded: list[str]
        if batch:
            encoded = []
            for index, payload in enumerate(payloads):
                try:
                    encoded.append(encode_payload(resolved.id, resolved.schema, payload, limit))
                except PayloadValidationError as exc:
                    raise PayloadValidationError(
                        resolved.id,
                        [f"payloads[{index}] (nothing was written): {p}" for p in exc.problems],
                    ) from exc
        else:
            encoded = [encode_payload(resolved.id, resolved.schema, p, limit) for p in payloads]
        keys: list[str | None]
        if idempotency_keys is None:
            keys = [None] * len(encoded)
        else:
            if isinstance(idempotency_keys, str | bytes):
                raise ConfigurationError(
                    "idempotency_keys takes one key (or None) per payload, got a single string"
                )
            keys = list(idempotency_keys)
            if len(keys) != len(encoded):
                raise ConfigurationError(
                    f"got {len(keys)} idempotency keys for {len(encoded)} payloads; "
                    "give one per payload"
                )
            for key in keys:  # a child's was checked by trigger_child, or is runlane's own
                if key is not None and options.parent_run_id is None:
                    check_idempotency_key(key)
        return NewRuns(
            environment=self._environment,
            task_id=resolved.id,
            queue=plan.queue,
            ids=new_run_ids(len(encoded)),
            payloads=encoded,
            idempotency_keys=keys,
            priority=options.priority,
            max_attempts=plan.max_attempts,
            delay=plan.delay,
            run_at=options.run_at,
            parent_run_id=options.parent_run_id,
            concurrency_key=options.concurrency_key,
        )

    def one(
        self,
        task: TaskRef | str,
        payload: Any,
        idempotency_key: str | None,
        options: TriggerOptions,
        connection: Any,
    ) -> RunHandle:
        keys = None if idempotency_key is None else [idempotency_key]
        (handle,) = self.runs(task, [payload], keys, options, connection)
        return handle

    def runs(
        self,
        task: TaskRef | str,
        payloads: list[Any],
        idempotency_keys: Sequence[str | None] | None,
        options: TriggerOptions,
        connection: Any = None,
        *,
        batch: bool = False,
    ) -> list[RunHandle]:
        """Store the runs of one call (``connection``: the caller's transaction), checked
        first: nothing is written when a check fails."""
        runs = self.new_runs(task, payloads, idempotency_keys, options, batch=batch)
        if not runs.ids:
            return []
        storage = self._opened()
        inserted = _telemetry.trigger(
            runs, lambda batch: storage.run_insert_many(batch, connection=connection)
        )
        return [
            RunHandle(id=row.id, task_id=runs.task_id, queue=row.queue, created=row.created)
            for row in inserted
        ]
