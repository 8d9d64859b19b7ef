"""How the console shows values: times, durations, stored JSON, the throughput chart.

Everything here returns plain text or numbers; the templates escape all of it (Jinja's
autoescape), so a stored value is always shown as text, never read as markup.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs

from runlane.stats import Stats

__all__ = [
    "MAX_SHOWN",
    "Chart",
    "ago",
    "duration",
    "throughput_chart",
    "trace_id",
    "when",
]

# characters of one stored value (payload, output, traceback) a page shows
MAX_SHOWN = 20_000
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def when(value: datetime | None) -> str:
    """A time in UTC, to the second; "-" for none."""
    if value is None:
        return "-"
    if value.tzinfo is None:
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def ago(seconds: float | None) -> str:
    """A duration as "2h 5m", "3m 20s", "4.2s"; "-" for none."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s"


def duration(run: Any, now: datetime | None = None) -> float | None:
    """Seconds from a run's latest start to its end (to ``now`` while it runs); None for a
    run never started, or a row that does not say (a child row)."""
    started = getattr(run, "started_at", None)
    if not isinstance(started, datetime):
        return None
    finished = getattr(run, "finished_at", None)
    if not isinstance(finished, datetime):
        if getattr(run, "is_terminal", True):
            return None  # ended without an attempt's end recorded (cancelled while queued)
        finished = now or datetime.now(UTC)
    return max(0.0, (finished - started).total_seconds())


def pretty(value: Any, limit: int = MAX_SHOWN) -> tuple[str, int]:
    """Stored JSON as indented text, cut to ``limit`` characters: (text, characters cut)."""
    if isinstance(value, str) and "\n" in value:
        text = value
    else:
        try:
            text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)
        except (TypeError, ValueError, RecursionError):
            text = repr(value)
    return _cut(text, limit)


def cut(text: str | None, limit: int = MAX_SHOWN) -> tuple[str, int]:
    """Text cut to ``limit`` characters: (text, characters cut)."""
    return _cut(text or "", limit)


def _cut(text: str, limit: int) -> tuple[str, int]:
    if len(text) <= limit:
        return text, 0
    return text[:limit], len(text) - limit


def trace_id(trace_context: Any) -> str | None:
    """The W3C trace id of a stored trace context (its ``traceparent``), if it has one."""
    if not isinstance(trace_context, dict):
        return None
    parent = trace_context.get("traceparent")
    if not isinstance(parent, str):
        return None
    match = _TRACEPARENT.match(parent.strip())
    return match.group(1) if match else None


@attrs.frozen
class Bar:
    x: float
    width: float
    completed_y: float
    completed_h: float
    failed_y: float
    failed_h: float
    label: str  # the bar's tooltip: its minute and counts


@attrs.frozen
class Chart:
    width: int
    height: int
    bars: tuple[Bar, ...]
    top: int  # the count the chart's top stands for
    completed: int  # totals over the hour
    failed: int
    cancelled: int


CHART_WIDTH = 600
CHART_HEIGHT = 120


def throughput_chart(stats: Stats) -> Chart:
    """The overview's bars of runs finished per minute over the last hour, completed with
    failed on top, from ``Runlane.stats`` in minutes (the rollup maintenance keeps, not a scan
    of runs): the 60 minutes up to the one ``stats`` ends in."""
    now_minute = stats.until.astimezone(UTC).replace(second=0, microsecond=0)
    by_minute = {
        b.start.astimezone(UTC): (b.completed, b.failed, b.cancelled) for b in stats.buckets
    }
    first = now_minute - timedelta(minutes=59)
    slots = [first + timedelta(minutes=i) for i in range(60)]
    counts = [by_minute.get(slot, (0, 0, 0)) for slot in slots]
    top = max([c + f for c, f, _ in counts] + [1])
    step = CHART_WIDTH / 60
    bars = []
    for i, (slot, (completed, failed, cancelled)) in enumerate(zip(slots, counts, strict=True)):
        completed_h = CHART_HEIGHT * completed / top
        failed_h = CHART_HEIGHT * failed / top
        bars.append(
            Bar(
                x=round(i * step + 1, 2),
                width=round(step - 2, 2),
                completed_y=round(CHART_HEIGHT - completed_h, 2),
                completed_h=round(completed_h, 2),
                failed_y=round(CHART_HEIGHT - completed_h - failed_h, 2),
                failed_h=round(failed_h, 2),
                label=(
                    f"{slot:%H:%M} UTC: {completed} completed, {failed} failed, "
                    f"{cancelled} cancelled"
                ),
            )
        )
    return Chart(
        width=CHART_WIDTH,
        height=CHART_HEIGHT,
        bars=tuple(bars),
        top=top,
        completed=sum(c for c, _, _ in counts),
        failed=sum(f for _, f, _ in counts),
        cancelled=sum(x for _, _, x in counts),
    )
