"""The maintenance phases, each one bounded, and one pass over all of them.

Every write goes through the storage in a statement that re-checks its own condition, so a
run that changed between a candidate being found and written is left alone. When run by the
services, each write also carries the band's fence (see ``_services.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import attrs

from runlane._codec import dump_json
from runlane._ids import new_run_id
from runlane.errors import LeaseExpired
from runlane.maintenance._types import (
    LaneMaintenance,
    MaintenanceLimits,
    MaintenancePhase,
    MaintenanceResult,
    RetentionPolicy,
)
from runlane.models import RunStatus
from runlane.retry import RetryPolicy, next_retry_delay
from runlane.schedules import Schedule, due_slots, next_slot
from runlane.storage import (
    Expiration,
    ExpiredAttempt,
    MaintenanceFence,
    ScheduleDefinition,
    ScheduledRun,
    ScheduleState,
    Storage,
)
from runlane.tasks import Task

__all__ = ["MaintenanceScope", "ScheduleEntry", "run_maintenance_pass", "run_phase"]

_PRUNE_BATCH = 500
# how far back the first stats pass of an environment starts (later passes go on from where
# the last stopped: docs/observability.md)
STATS_LOOKBACK = timedelta(minutes=5)


@attrs.frozen
class ScheduleEntry:
    """A registered schedule with what its runs need, resolved once at start-up."""

    schedule: Schedule
    queue: str
    payload: str  # JSON text, validated against the task's schema
    max_attempts: int

    @property
    def definition(self) -> ScheduleDefinition:
        """What is stored with the schedule's state (and what its runs are made of)."""
        return ScheduleDefinition(
            task_id=self.schedule.task.id,
            queue=self.queue,
            payload=self.payload,
            priority=self.schedule.priority,
            max_attempts=self.max_attempts,
        )


@attrs.frozen
class MaintenanceScope:
    """What maintenance of one environment works with."""

    storage: Storage
    environment: str
    tasks: Mapping[str, Task[Any, Any]]
    schedules: Sequence[ScheduleEntry]
    retention: RetentionPolicy
    # the lane's DELIVERY_RECOVERY work: (environment, limits, fence) -> what it did (the
    # polling lane announces queues whose delayed runs came due)
    recover_delivery: Callable[[str, MaintenanceLimits, MaintenanceFence | None], LaneMaintenance]
    # schedule id -> digest of a stored definition found equal to this runtime's: while the
    # row's digest stays the same the definition is not compared (nor written) again
    stored_definitions: dict[str, bytes] = attrs.field(factory=dict)


def _schedules(scope: MaintenanceScope, limit: int, fence: MaintenanceFence | None) -> int:
    if not scope.schedules or limit == 0:
        return 0
    storage = scope.storage
    now = storage.database_now()
    ids = [entry.schedule.id for entry in scope.schedules]
    states = {s.schedule_id: s for s in storage.schedule_state_list(scope.environment, ids)}
    created = 0
    for entry in scope.schedules:
        sched = entry.schedule
        zone = sched.zone
        state = states.get(sched.id)
        following = next_slot(sched.cron, zone, now)
        if state is None or (state.cron, state.timezone) != (sched.cron, sched.timezone):
            # first sighting, or the definition changed: wait for the next slot
            fresh = ScheduleState(sched.id, sched.cron, sched.timezone, following)
            storage.schedule_state_reset(
                scope.environment, fresh, definition=entry.definition, fence=fence
            )
            continue
        _store_definition(scope, entry, state, fence)
        if state.paused or state.next_slot_at > now:
            continue  # a paused schedule fires nothing (resuming skips what it missed)
        slots = due_slots(sched.cron, zone, state.next_slot_at, now, 1 + sched.catch_up)
        for index, slot in enumerate(slots):
            if created >= limit:
                return created  # the next pass picks up where this one stopped
            last = index == len(slots) - 1
            run = ScheduledRun(
                environment=scope.environment,
                schedule_id=sched.id,
                slot_at=slot,
                run_id=new_run_id(),
                task_id=sched.task.id,
                queue=entry.queue,
                priority=sched.priority,
                payload=entry.payload,
                max_attempts=entry.max_attempts,
            )
            created += storage.schedule_fire(
                run,
                next_slot_at=following if last else state.next_slot_at,
                expected_slot_at=state.next_slot_at,
                fence=fence,
            )
    return created


def _store_definition(
    scope: MaintenanceScope,
    entry: ScheduleEntry,
    state: ScheduleState,
    fence: MaintenanceFence | None,
) -> None:
    """Store the schedule's definition when the row may hold another one: once per runtime
    and schedule, and again only after the row's definition changed (another deploy)."""
    known = scope.stored_definitions.get(entry.schedule.id)
    if known is not None and known == state.definition_digest:
        return
    digest = scope.storage.schedule_define(
        scope.environment, entry.schedule.id, entry.definition, fence=fence
    )
    if digest is not None:
        scope.stored_definitions[entry.schedule.id] = digest


_DEFAULT_POLICY = RetryPolicy()


def _expiration(scope: MaintenanceScope, lapsed: ExpiredAttempt) -> Expiration:
    """How one lapsed attempt ends: the same retry arithmetic as a raised exception, with
    the policy of its task (the default policy for a task this runtime does not know)."""
    task = scope.tasks.get(lapsed.task_id)
    policy = task.retry if task is not None else _DEFAULT_POLICY
    error = {
        "type": f"{LeaseExpired.__module__}.{LeaseExpired.__qualname__}",
        "message": (
            f"attempt {lapsed.attempt} lost its lease (expired at {lapsed.lease_expires_at}): "
            "its worker crashed, froze, or lost its database connection"
        ),
        "traceback": None,
        "retryable": True,
    }
    return Expiration(
        run_id=lapsed.run_id,
        attempt=lapsed.attempt,
        lease_token=lapsed.lease_token,
        error=dump_json(error),
        retry_delay=next_retry_delay(policy, lapsed.attempts_consumed, lapsed.max_attempts),
    )


def _expire(
    scope: MaintenanceScope, limit: int, fence: MaintenanceFence | None
) -> MaintenanceResult:
    if limit == 0:
        return MaintenanceResult()
    lapsed = scope.storage.run_list_expired(scope.environment, limit)
    if not lapsed:
        return MaintenanceResult()
    # the write re-checks each lease: one extended or finished since the listing is kept
    applied = scope.storage.run_expire_many(
        [_expiration(scope, attempt) for attempt in lapsed], fence=fence
    )
    cancelled = sum(1 for row in applied if row.status is RunStatus.CANCELLED)
    return MaintenanceResult(
        attempts_expired=len(applied) - cancelled, cancellations_finalized=cancelled
    )


def _cleanup(
    scope: MaintenanceScope, limit: int, fence: MaintenanceFence | None
) -> MaintenanceResult:
    retention = {
        RunStatus.COMPLETED: scope.retention.completed,
        RunStatus.FAILED: scope.retention.failed,
        RunStatus.CANCELLED: scope.retention.cancelled,
    }
    deleted = tombstoned = 0
    remaining = limit
    while remaining > 0:
        batch = min(remaining, _PRUNE_BATCH)
        result = scope.storage.run_prune(scope.environment, retention, batch, fence=fence)
        deleted += result.deleted
        tombstoned += result.tombstoned
        done = result.deleted + result.tombstoned
        remaining -= done
        if done < batch:
            break
    # rows of stopped and lost workers: few (one per worker started), one bounded statement
    workers = (
        scope.storage.worker_prune(scope.environment, scope.retention.workers, limit, fence=fence)
        if limit
        else 0
    )
    audit = (
        scope.storage.audit_prune(
            scope.environment, scope.retention.audit.total_seconds(), limit, fence=fence
        )
        if limit
        else 0
    )
    return MaintenanceResult(
        runs_pruned=deleted, runs_tombstoned=tombstoned, workers_pruned=workers, audit_pruned=audit
    )


def _stats(
    scope: MaintenanceScope, limits: MaintenanceLimits, fence: MaintenanceFence | None
) -> MaintenanceResult:
    """Fold the recent minutes into the rollup and prune it past retention. The fold
    counts nothing (its rows are not records changed); pruning counts."""
    storage = scope.storage
    if limits.stats_minutes:
        storage.stats_fold(scope.environment, STATS_LOOKBACK, limits.stats_minutes, fence=fence)
    pruned = (
        storage.stats_prune(
            scope.environment, scope.retention.stats, limits.cleanup_limit, fence=fence
        )
        if limits.cleanup_limit
        else 0
    )
    return MaintenanceResult(stats_pruned=pruned)


def run_phase(
    scope: MaintenanceScope,
    phase: MaintenancePhase,
    limits: MaintenanceLimits,
    fence: MaintenanceFence | None = None,
) -> MaintenanceResult:
    """Run one phase within its limit; returns what it changed."""
    storage = scope.storage
    env = scope.environment
    if phase is MaintenancePhase.SCHEDULES:
        return MaintenanceResult(schedules_created=_schedules(scope, limits.schedule_limit, fence))
    if phase is MaintenancePhase.DUE_DELIVERY:
        delivered = (
            storage.run_deliver_due(env, limits.due_delivery_limit, fence=fence)
            if limits.due_delivery_limit
            else 0
        )
        return MaintenanceResult(due_runs_delivered=delivered)
    if phase is MaintenancePhase.WAIT_TOKEN_RESOLUTION:
        timed_out = (
            storage.wait_token_time_out_due(env, limits.wait_token_timeout_limit, fence=fence)
            if limits.wait_token_timeout_limit
            else 0
        )
        # runs linked to resolved tokens, and runs waiting on runs that ended
        resumed = (
            storage.run_resume_waiters(env, limits.wait_token_resume_limit, fence=fence)
            if limits.wait_token_resume_limit
            else 0
        )
        return MaintenanceResult(wait_tokens_timed_out=timed_out, wait_token_runs_resumed=resumed)
    if phase is MaintenancePhase.ATTEMPT_EXPIRY:
        return _expire(scope, limits.attempt_expiry_limit, fence)
    if phase is MaintenancePhase.DELIVERY_RECOVERY:
        return MaintenanceResult(lane=scope.recover_delivery(env, limits, fence))
    if phase is MaintenancePhase.CLEANUP:
        return _cleanup(scope, limits.cleanup_limit, fence)
    if phase is MaintenancePhase.STATS:
        return _stats(scope, limits, fence)
    raise AssertionError(f"unknown phase {phase!r}")


def run_maintenance_pass(scope: MaintenanceScope, limits: MaintenanceLimits) -> MaintenanceResult:
    """Run every phase once, in order; the first failure propagates (nothing is swallowed)."""
    result = MaintenanceResult()
    for phase in MaintenancePhase:
        result += run_phase(scope, phase, limits)
    return result
