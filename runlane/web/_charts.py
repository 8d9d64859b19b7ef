"""Line charts drawn on the server as inline SVG (no script, no external asset: the CSP
holds): the geometry of each line from a series of values per bucket.

Everything here returns numbers and plain text; the template draws them and escapes the
text. A bucket without a value (no run finished there: no wait or run time to show) breaks
its line instead of drawing it down to zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime

import attrs

__all__ = ["CHART_HEIGHT", "CHART_WIDTH", "Line", "LineChart", "Point", "line_chart"]

CHART_WIDTH = 720
CHART_HEIGHT = 150


@attrs.frozen
class Point:
    x: float
    y: float
    label: str  # its tooltip: the bucket's start and the value


@attrs.frozen
class Line:
    name: str  # what the legend says, and the CSS class (l-<name>)
    segments: tuple[str, ...]  # each an SVG polyline's points, "x,y x,y ..."
    points: tuple[Point, ...]
    legend: str  # what the legend shows beside the name (the window's sum or percentile)


@attrs.frozen
class LineChart:
    id: str
    width: int
    height: int
    lines: tuple[Line, ...]
    top: float  # the value the chart's top line stands for
    top_label: str
    first_label: str  # the first bucket's start, under the chart's left end
    buckets: int


def _nice_top(peak: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``peak`` (1 for none)."""
    if peak <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(peak))
    for step in (1, 2, 5, 10):
        if peak <= step * power:
            return float(step * power)
    return float(10 * power)  # pragma: no cover - the loop ends at 10


def line_chart(
    chart_id: str,
    starts: Sequence[datetime],
    series: Sequence[tuple[str, Sequence[float | None], float | None]],
    *,
    unit: str,
) -> LineChart:
    """A chart of one line per ``(name, values, overall)`` of ``series`` over the buckets
    starting at ``starts`` (each value None or a number of ``unit``); the legend shows
    ``overall`` beside each name (the window's sum, or its percentile)."""
    count = len(starts)
    present = [v for _, values, _ in series for v in values if v is not None]
    top = _nice_top(max(present, default=0.0))
    step = CHART_WIDTH / max(count, 1)
    lines = []
    for name, values, overall in series:
        if len(values) != count:
            raise ValueError(f"{name}: {len(values)} values for {count} buckets")
        segments: list[str] = []
        points: list[Point] = []
        run: list[str] = []
        for i, (start, value) in enumerate(zip(starts, values, strict=True)):
            if value is None:
                if run:
                    segments.append(" ".join(run))
                run = []
                continue
            point = Point(
                x=round(i * step + step / 2, 2),
                y=round(CHART_HEIGHT - CHART_HEIGHT * value / top, 2),
                label=f"{_stamp(start)}: {name} {_number(value, unit)}",
            )
            points.append(point)
            run.append(f"{point.x},{point.y}")
        if run:
            segments.append(" ".join(run))
        legend = "-" if overall is None else _number(overall, unit)
        lines.append(Line(name, tuple(segments), tuple(points), legend))
    return LineChart(
        id=chart_id,
        width=CHART_WIDTH,
        height=CHART_HEIGHT,
        lines=tuple(lines),
        top=top,
        top_label=_number(top, unit),
        first_label=_stamp(starts[0]) if starts else "",
        buckets=count,
    )


def _stamp(start: datetime) -> str:
    return start.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _number(value: float, unit: str) -> str:
    """``value`` in ``unit`` as the legend and tooltips show it: whole runs, or seconds
    to three significant digits ("0.0421 s", "12.5 s", "3,600 s")."""
    if unit == "runs":
        return f"{value:,.0f} runs" if value != 1 else "1 run"
    if value >= 100:
        return f"{value:,.0f} {unit}"
    return f"{value:.3g} {unit}"
