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

import attrs

from runlane._limits import check_name as check_any_name
from runlane.errors import ConfigurationError
from runlane.models import QueueInfo, RunStatus
from runlane.runtime._audit import AuditTrail, check_reason
from runlane.runtime._backend import Opened
from runlane.storage import Storage
from runlane.tasks import Queue
from runlane.toolkit import shown

__all__ = ["QueueAdmin", "check_name"]

# list_queues counts these; terminal runs are history (list_runs pages through them)
_COUNTED = tuple(s.value for s in RunStatus if not s.is_terminal)


def check_name(name: object) -> str:
    return check_any_name("queue name", name)


@attrs.define(eq=False)
class QueueAdmin:
    """The queues of one environment: those this runtime defines and those the database
    knows, through the storage ``opened()`` returns."""

    _environment: str
    _queues: Mapping[str, Queue]
    _opened: Opened
    _trail: AuditTrail

    def _check_known(self, storage: Storage, name: str) -> None:
        if name in self._queues or storage.queue_known(self._environment, name):
            return
        defined = sorted(self._queues)
        raise ConfigurationError(
            f"queue {shown(name)} is unknown in environment {self._environment!r}: no code of "
            "this runtime defines it and the database has no runs or state for it"
            + (f" (this runtime defines {defined})" if defined else "")
            + "; check the name (`runlane queues list` shows every known queue), or define it "
            "with queue(...) in create_runlane(queues=[...]) to pause it before its first run"
        )

    def pause(self, name: object, reason: object) -> bool:
        """Pause ``name``; True when it was not paused before."""
        storage = self._opened()
        queue_name = check_name(name)
        text = check_reason(reason)
        self._check_known(storage, queue_name)
        return self._trail.record(
            self._trail.entry("pause_queue", queue_name, text, {}),
            lambda view: view.queue_pause(self._environment, queue_name, text),
            lambda changed: (None, changed),
        )

    def resume(self, name: object, reason: object = None) -> bool:
        """Resume ``name``; True when it was paused."""
        storage = self._opened()
        queue_name = check_name(name)
        self._check_known(storage, queue_name)
        return self._trail.record(
            self._trail.entry("resume_queue", queue_name, reason, {}),
            lambda view: view.queue_resume(self._environment, queue_name),
            lambda changed: (None, changed),
        )

    def infos(self) -> list[QueueInfo]:
        """Every queue this runtime defines and every one the database knows, by name."""
        rows = {str(row["queue"]): row for row in self._opened().queue_list(self._environment)}
        infos = []
        for name in sorted(set(rows) | set(self._queues)):
            row: Mapping[str, Any] = rows.get(name, {})
            defined = self._queues.get(name)
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
