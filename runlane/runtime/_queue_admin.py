"""Queue operator actions behind ``Runlane.pause_queue``, ``resume_queue`` and ``list_queues``.

A pause is a row of ``queue_states``: every claim statement leaves paused queues out, so it
holds on every worker from its commit, and it outlives every process. A queue name is
accepted when this runtime defines it or the database knows it (a queue_states row, or runs
of it), so an operator working from a database URL alone can pause any real queue, while a
typo is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from runlane._limits import check_name as check_any_name
from runlane._validation import check_text
from runlane.errors import ConfigurationError
from runlane.models import QueueInfo, RunStatus
from runlane.storage import Storage
from runlane.tasks import Queue
from runlane.toolkit import shown

__all__ = [
    "MAX_REASON_CHARS",
    "check_name",
    "check_reason",
    "list_queues",
    "pause_queue",
    "resume_queue",
]

# a pause's reason is a note for other operators, not a document
MAX_REASON_CHARS = 500
# list_queues counts these; terminal runs are history (list_runs pages through them)
_COUNTED = tuple(s.value for s in RunStatus if not s.is_terminal)


def check_name(name: object) -> str:
    return check_any_name("queue name", name)


def check_reason(reason: object) -> str | None:
    if reason is None:
        return None
    return check_text("reason", reason, MAX_REASON_CHARS)


def _check_known(
    storage: Storage, environment: str, queues: Mapping[str, Queue], name: str
) -> None:
    if name in queues or storage.queue_known(environment, name):
        return
    defined = sorted(queues)
    raise ConfigurationError(
        f"queue {shown(name)} is unknown in environment {environment!r}: no code of this "
        "runtime defines it and the database has no runs or state for it"
        + (f" (this runtime defines {defined})" if defined else "")
        + "; check the name (`runlane queues list` shows every known queue), or define it "
        "with queue(...) in create_runlane(queues=[...]) to pause it before its first run"
    )


def pause_queue(
    storage: Storage,
    environment: str,
    queues: Mapping[str, Queue],
    name: object,
    reason: object,
) -> bool:
    """Pause ``name``; True when it was not paused before."""
    queue_name = check_name(name)
    text = check_reason(reason)
    _check_known(storage, environment, queues, queue_name)
    return storage.queue_pause(environment, queue_name, text)


def resume_queue(
    storage: Storage, environment: str, queues: Mapping[str, Queue], name: object
) -> bool:
    """Resume ``name``; True when it was paused."""
    queue_name = check_name(name)
    _check_known(storage, environment, queues, queue_name)
    return storage.queue_resume(environment, queue_name)


def list_queues(storage: Storage, environment: str, queues: Mapping[str, Queue]) -> list[QueueInfo]:
    """Every queue ``queues`` defines and every one the database knows, by name."""
    rows = {str(row["queue"]): row for row in storage.queue_list(environment)}
    infos = []
    for name in sorted(set(rows) | set(queues)):
        row: Mapping[str, Any] = rows.get(name, {})
        defined = queues.get(name)
        age = row.get("oldest_queued_age")
        counts = {status: int(row.get(status, 0)) for status in _COUNTED}
        claimed = int(row.get("claimed", 0))
        infos.append(
            QueueInfo(
                name=name,
                paused=bool(row.get("paused", False)),
                paused_reason=row.get("paused_reason"),
                paused_at=row.get("paused_at"),
                concurrency_limit=None if defined is None else defined.concurrency_limit,
                rate_limit=getattr(defined, "rate_limit", None),
                key_concurrency_limit=getattr(defined, "key_concurrency_limit", None),
                counts=counts,
                oldest_queued_age=None if age is None else max(0.0, float(age)),
                defined=defined is not None,
                running=counts["running"] - claimed + counts["cancellation_requested"],
                claimed=claimed,
            )
        )
    return infos
