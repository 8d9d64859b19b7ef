"""The creation-time filters an operator types: ``runlane runs retry|cancel|delete
--created-after/--created-before`` and the console's *Created after* / *Created before*.

One parser for both (ISO 8601; the CLI wants the offset, the console reads a time without
one as UTC), and the text the console puts back in its links and forms. Any time
``datetime`` can hold is a filter, also one whose UTC instant falls outside Python's years 1
to 9999 (``9999-12-31T23:59:59-14:00`` is 10000-01-01 in UTC): Postgres compares it as given,
so it matches every run (or none), and nothing converts it to UTC in Python, where it would
raise ``OverflowError``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from runlane._display import shown
from runlane.errors import ConfigurationError

__all__ = ["filter_time_field", "filter_time_text", "parse_filter_time"]


def parse_filter_time(label: str, text: str, *, naive_is_utc: bool) -> datetime:
    """``text`` as a timezone-aware datetime, or a ConfigurationError naming ``label``.
    A time without an offset is UTC when ``naive_is_utc``, else refused. A space may stand
    for the ``T``."""
    value = text.strip()
    try:
        parsed = datetime.fromisoformat(value.replace(" ", "T", 1))
    except ValueError:
        how = "UTC unless it gives an offset" if naive_is_utc else "with its UTC offset"
        raise ConfigurationError(
            f"{label} must be a time like 2026-12-01T09:00:00+00:00 (ISO 8601, {how}), "
            f"got {shown(value, 40)}"
        ) from None
    if parsed.utcoffset() is not None:
        return parsed
    if naive_is_utc:
        return parsed.replace(tzinfo=UTC)
    raise ConfigurationError(
        f"{label} {shown(value, 40)} has no UTC offset: add one (e.g. +00:00 or Z)"
    )


def filter_time_text(value: datetime) -> str:
    """``value`` as the console writes a filter back (links, hidden fields): UTC without an
    offset, to the microsecond when it has a fraction (a bulk action's form must act on the
    runs its confirmation counted), or as given, with its offset, when its UTC instant is
    outside years 1 to 9999."""
    try:
        moment = value.astimezone(UTC)
    except OverflowError:
        return value.isoformat()
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f" if moment.microsecond else "%Y-%m-%dT%H:%M:%S")


def filter_time_field(value: datetime) -> str:
    """``value`` for a ``datetime-local`` input with ``step=1`` (UTC, whole seconds); empty
    when its UTC instant is outside years 1 to 9999 (the links keep it)."""
    try:
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")
    except OverflowError:
        return ""
