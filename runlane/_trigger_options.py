"""One trigger call's options, carried whole through the trigger path.

``trigger``, ``trigger_many`` and ``context.trigger_child`` take these as keyword arguments
(their public signatures); inside, one frozen ``TriggerOptions`` carries them to where they
are checked and turned into rows, so the list of options is written once. The options a
call leaves at their defaults are the shared ``DEFAULT_OPTIONS``, which lets the runtime
check a task's defaults once and reuse the result (see ``Runlane._plan``).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import TypedDict

import attrs

from runlane.errors import ConfigurationError

__all__ = [
    "DEFAULT_OPTIONS",
    "ChildTriggerOptions",
    "TriggerOptions",
    "call_options",
    "child_options",
]


@attrs.frozen
class TriggerOptions:
    """What a trigger call says about its runs besides the payloads and idempotency keys
    (one key per payload): every run of the call shares these. Values are as the caller
    gave them; the runtime checks them (``Runlane._plan``) before anything is written."""

    queue: str | None = None
    delay: timedelta | float | None = None
    run_at: datetime | None = None
    priority: int = 0
    max_attempts: int | None = None
    concurrency_key: str | None = None
    # set by context.trigger_child: the run that triggers (not a caller's option)
    parent_run_id: uuid.UUID | None = None


#: the options of a call that gave none
DEFAULT_OPTIONS = TriggerOptions()


def call_options(
    *,
    queue: str | None,
    delay: timedelta | float | None,
    run_at: datetime | None,
    priority: int,
    max_attempts: int | None,
    concurrency_key: str | None,
) -> TriggerOptions:
    """The options of a ``trigger``/``trigger_many`` call: the shared ``DEFAULT_OPTIONS``
    when every one is at its default (a bool priority is not: the checks refuse it), so the
    runtime's plan for the task's defaults is found again."""
    if (
        queue is None
        and delay is None
        and run_at is None
        and max_attempts is None
        and concurrency_key is None
        and type(priority) is int
        and priority == 0
    ):
        return DEFAULT_OPTIONS
    return TriggerOptions(
        queue=queue,
        delay=delay,
        run_at=run_at,
        priority=priority,
        max_attempts=max_attempts,
        concurrency_key=concurrency_key,
    )


class ChildTriggerOptions(TypedDict, total=False):
    """The keyword arguments ``context.trigger_child`` takes: ``trigger``'s, without
    ``connection`` (a child is written on the runtime's own connections)."""

    queue: str | None
    delay: timedelta | float | None
    run_at: datetime | None
    idempotency_key: str | None
    priority: int
    max_attempts: int | None
    concurrency_key: str | None


_CHILD_KEYS = frozenset(ChildTriggerOptions.__annotations__) - {"idempotency_key"}


def child_options(options: Mapping[str, object], parent_run_id: uuid.UUID) -> TriggerOptions:
    """The TriggerOptions of a ``trigger_child`` call (its ``idempotency_key`` taken out
    already); an option it does not take raises ConfigurationError, nothing written."""
    unknown = sorted(set(options) - _CHILD_KEYS)
    if unknown:
        raise ConfigurationError(
            f"trigger_child got unknown options {unknown}; it takes "
            f"{sorted(_CHILD_KEYS | {'idempotency_key'})}"
        )
    return TriggerOptions(parent_run_id=parent_run_id, **options)  # type: ignore[arg-type]
