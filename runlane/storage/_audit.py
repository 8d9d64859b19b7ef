"""The records of the audit trail's part of the storage contract (``AuditStore``)."""

from __future__ import annotations

import uuid
from typing import Any

import attrs

from runlane.models import RunStatus

__all__ = ["AuditEntry", "Rescheduled"]


@attrs.frozen
class AuditEntry:
    """What an operator action's record says, before the action tells how many runs it
    changed. ``part`` numbers a bulk action's batches under one ``action_id`` (0 heads it)."""

    id: uuid.UUID
    action_id: uuid.UUID
    part: int
    environment: str
    via: str
    actor: str | None
    os_user: str | None
    action: str
    target: str | None
    reason: str | None
    details: dict[str, Any]


@attrs.frozen
class Rescheduled:
    """``run_reschedule``'s answer for one run: its status before, whether it moved."""

    previous: RunStatus
    moved: bool
