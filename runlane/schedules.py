"""Cron schedules: definitions, validation, and the pure slot arithmetic.

A schedule's *slots* are the instants its cron expression names in its timezone. Maintenance
creates one run per slot (a unique key on schedule and slot makes racing replicas harmless).
After downtime only the latest missed slot runs, unless ``catch_up`` asks for up to that many
earlier missed slots as well. Cron parsing is croniter's; only the choice of slots is ours.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs
from croniter import croniter

from runlane.errors import ConfigurationError
from runlane.tasks import Task

__all__ = ["Schedule", "due_slots", "next_slot", "schedule"]

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-/]{0,199}$")
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
    if not isinstance(id, str) or not _ID.fullmatch(id):
        raise ConfigurationError(
            f"schedule id {id!r} is not valid: use 1-200 characters from letters, digits and "
            "'_.:-/', starting with a letter or digit"
        )
    if not isinstance(task, Task):
        raise ConfigurationError(f"schedule {id!r}: task must be a @task, got {task!r}")
    if not isinstance(cron, str) or not croniter.is_valid(cron):
        raise ConfigurationError(
            f"schedule {id!r}: {cron!r} is not a valid cron expression "
            "(five fields: minute hour day-of-month month day-of-week, e.g. '*/5 * * * *')"
        )
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"schedule {id!r}: unknown timezone {timezone!r}; use an IANA name such as "
            "'UTC' or 'Europe/Paris'"
        ) from exc
    if (
        isinstance(catch_up, bool)
        or not isinstance(catch_up, int)
        or not (0 <= catch_up <= _MAX_CATCH_UP)
    ):
        raise ConfigurationError(
            f"schedule {id!r}: catch_up must be an integer from 0 to {_MAX_CATCH_UP}, "
            f"got {catch_up!r}"
        )
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigurationError(f"schedule {id!r}: priority must be an integer")
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


def next_slot(cron: str, zone: ZoneInfo, after: datetime) -> datetime:
    """The first slot strictly after ``after`` (an aware datetime)."""
    result: datetime = croniter(cron, after.astimezone(zone)).get_next(datetime)
    return result.astimezone(UTC)


def due_slots(
    cron: str, zone: ZoneInfo, waiting_for: datetime, now: datetime, keep: int
) -> list[datetime]:
    """The slots from ``waiting_for`` (inclusive) to ``now`` (inclusive), at most the latest
    ``keep`` of them, oldest first. Walks backwards from ``now``, so a long outage of a
    frequent schedule costs ``keep`` steps, not one per missed slot."""
    if keep < 1 or waiting_for > now:
        return []
    # the latest instant at the expression's resolution (seconds with six fields, else
    # minutes) is a slot itself when it matches; get_prev only finds slots strictly before
    seconds = len(cron.split()) == 6
    local_now = now.astimezone(zone).replace(microsecond=0)
    if not seconds:
        local_now = local_now.replace(second=0)
    found: list[datetime] = []
    if croniter.match(cron, local_now):
        found.append(local_now)
    walker = croniter(cron, local_now)
    while len(found) < keep:
        slot: datetime = walker.get_prev(datetime)
        if slot < waiting_for:
            break
        found.append(slot)
    return sorted(slot.astimezone(UTC) for slot in found if slot >= waiting_for)
