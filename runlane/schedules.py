"""Cron schedules: definitions, validation, and the pure slot arithmetic.

A schedule's *slots* are the instants its cron expression names in its timezone. Maintenance
creates one run per slot (a unique key on schedule and slot makes racing replicas harmless).
After downtime only the latest missed slot runs, unless ``catch_up`` asks for up to that many
earlier missed slots as well. Cron parsing is croniter's; only the choice of slots is ours.

Expressions have five fields (minute hour day-of-month month day-of-week) or six with a
leading seconds field (``*/5 * * * * *``: every five seconds), or an alias such as
``@hourly``. When a daylight-saving change repeats an hour, a schedule with a fixed hour runs
once, at the first occurrence, as cron does; one whose hour field varies runs at both.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs
from croniter import CroniterBadDateError, croniter

from runlane._limits import check_name
from runlane.errors import ConfigurationError
from runlane.tasks import Task
from runlane.toolkit import as_int, as_int32, shown

__all__ = ["Schedule", "due_slots", "next_slot", "schedule"]

_MAX_CATCH_UP = 1000


@attrs.frozen(eq=False)
class Schedule:
    """A cron schedule creating runs of ``task``; make one with :func:`schedule`."""

    id: str
    task: Task[Any, Any]
    cron: str
    payload: Any
    timezone: str
    catch_up: int
    priority: int
    queue: str | None

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)


def schedule(
    *,
    id: str,
    task: Task[Any, Any],
    cron: str,
    payload: Any = None,
    timezone: str = "UTC",
    catch_up: int = 0,
    priority: int = 0,
    queue: str | None = None,
) -> Schedule:
    """Run ``task`` with ``payload`` at every slot of ``cron`` (5 fields, or 6 with seconds)
    in ``timezone``. ``catch_up`` is how many missed slots before the latest one also run
    after downtime (default 0: only the latest). Bad input is a ConfigurationError here.
    """
    check_name("schedule id", id)
    if not isinstance(task, Task):
        raise ConfigurationError(f"schedule {id!r}: task must be a @task, got {task!r}")
    if not isinstance(cron, str) or not _valid_cron(cron):
        raise ConfigurationError(
            f"schedule {id!r}: {cron!r} is not a valid cron expression (five fields: minute "
            "hour day-of-month month day-of-week, e.g. '*/5 * * * *'; or six with a leading "
            "seconds field; or an alias such as '@hourly')"
        )
    try:
        _walker(cron, datetime.now(UTC)).get_next(datetime)
    except CroniterBadDateError as exc:
        raise ConfigurationError(f"schedule {id!r}: {cron!r} never fires") from exc
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"schedule {id!r}: unknown timezone {timezone!r}; use an IANA name such as "
            "'UTC' or 'Europe/Paris'"
        ) from exc
    as_int(f"schedule {shown(id)}: catch_up", catch_up, 0, _MAX_CATCH_UP)
    as_int32(f"schedule {shown(id)}: priority", priority)
    if queue is not None and not isinstance(queue, str):
        raise ConfigurationError(
            f"schedule {id!r}: queue must be a queue name (a string) or None, got {queue!r}"
        )
    return Schedule(
        id=id,
        task=task,
        cron=cron,
        payload=payload,
        timezone=timezone,
        catch_up=catch_up,
        priority=priority,
        queue=queue,
    )


def _fields(cron: str) -> int:
    return 0 if cron.strip().startswith("@") else len(cron.split())


def _valid_cron(cron: str) -> bool:
    return _fields(cron) in (0, 5, 6) and bool(croniter.is_valid(cron, second_at_beginning=True))


def _walker(cron: str, start: datetime) -> croniter:
    return croniter(cron, start, second_at_beginning=True)


def _hour_fixed(cron: str) -> bool:
    fields = cron.split()
    if _fields(cron) == 0:
        return cron.strip() not in ("@hourly",)
    hour = fields[1] if len(fields) == 5 else fields[2]
    return not any(mark in hour for mark in "*/-,")


def _repeated_wall_time(slot: datetime, zone: ZoneInfo) -> bool:
    """True for the second occurrence of a wall-clock time repeated by a DST change."""
    wall = slot.astimezone(zone).replace(tzinfo=None)
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    return first != second and slot.astimezone(UTC) == second


def _keep(cron: str, zone: ZoneInfo, slot: datetime) -> bool:
    return not (_hour_fixed(cron) and _repeated_wall_time(slot, zone))


def next_slot(cron: str, zone: ZoneInfo, after: datetime) -> datetime:
    """The first slot strictly after ``after`` (an aware datetime), in UTC."""
    walker = _walker(cron, after.astimezone(zone))
    while True:
        slot: datetime = walker.get_next(datetime).astimezone(UTC)
        if _keep(cron, zone, slot):
            return slot


def due_slots(
    cron: str, zone: ZoneInfo, waiting_for: datetime, now: datetime, keep: int
) -> list[datetime]:
    """The slots from ``waiting_for`` (inclusive) to ``now`` (inclusive), at most the latest
    ``keep`` of them, oldest first, in UTC. Walks backwards from ``now``, so a long outage of
    a frequent schedule costs ``keep`` steps, not one per missed slot."""
    if keep < 1 or waiting_for > now:
        return []
    # the latest instant at the expression's resolution (seconds with six fields, else
    # minutes) is a slot itself when it matches; get_prev only finds slots strictly before
    local_now = now.astimezone(zone).replace(microsecond=0)
    if _fields(cron) != 6:
        local_now = local_now.replace(second=0)
    found: list[datetime] = []
    if croniter.match(cron, local_now, second_at_beginning=True):
        found.append(local_now.astimezone(UTC))
    walker = _walker(cron, local_now)
    while len(found) < keep:
        slot: datetime = walker.get_prev(datetime).astimezone(UTC)
        if slot < waiting_for:
            break
        found.append(slot)
    return sorted(s for s in found if s >= waiting_for and _keep(cron, zone, s))
