"""What a console page reads from its query string or form: the runs filters, a run id."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import attrs
from flask import abort

from runlane._operator.bulk import filter_time_field, filter_time_text, parse_filter_time
from runlane.errors import ConfigurationError
from runlane.models import RunStatus
from runlane.toolkit import shown

__all__ = ["FIRST_ID", "Position", "RunFilters", "run_filters", "run_id_arg", "text_arg"]

FIRST_ID = uuid.UUID(int=0)


@attrs.frozen
class Position:
    """Where a runs page starts: what ``encode_cursor`` reads of a run."""

    created_at: datetime
    id: uuid.UUID


@attrs.frozen
class RunFilters:
    status: str | None
    task: str | None
    queue: str | None
    created_after: datetime | None
    created_before: datetime | None

    @property
    def any(self) -> bool:
        return any(v is not None for v in attrs.astuple(self, recurse=False))

    def args(self) -> dict[str, str]:
        """As query arguments (for links and hidden fields)."""
        pairs = {
            "status": self.status,
            "task": self.task,
            "queue": self.queue,
            "created_after": _time_text(self.created_after),
            "created_before": _time_text(self.created_before),
        }
        return {k: v for k, v in pairs.items() if v is not None}

    def field(self, name: str) -> str:
        """The value of the form's ``datetime-local`` input for ``name`` (a time filter)."""
        value = getattr(self, name)
        return "" if value is None else filter_time_field(value)


def _time_text(value: datetime | None) -> str | None:
    return None if value is None else filter_time_text(value)


def text_arg(source: Any, name: str) -> str | None:
    """A stripped text argument; None when absent or empty."""
    value = source.get(name, "")
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value or None


def _time(source: Any, name: str) -> datetime | None:
    value = text_arg(source, name)
    if value is None:
        return None
    return parse_filter_time(name.replace("_", " "), value, naive_is_utc=True)


def run_filters(source: Any) -> RunFilters:
    status = text_arg(source, "status")
    if status is not None and status not in {s.value for s in RunStatus}:
        raise ConfigurationError(
            f"status {shown(status, 40)} is not a run status; use one of: "
            + ", ".join(s.value for s in RunStatus)
        )
    return RunFilters(
        status=status,
        task=text_arg(source, "task"),
        queue=text_arg(source, "queue"),
        created_after=_time(source, "created_after"),
        created_before=_time(source, "created_before"),
    )


def run_id_arg(value: str) -> uuid.UUID:
    """A run id from a URL; 404 when it is not one."""
    try:
        return uuid.UUID(value)
    except ValueError:
        abort(404)
