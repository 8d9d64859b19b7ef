"""The console's charts over time (``/charts``): throughput, wait and run time per queue and
task over 1 h / 24 h / 7 d, read from ``Runlane.stats`` (the rollup maintenance keeps, never
a scan of ``runs``) and drawn on the server (``_charts.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

import attrs
from flask import render_template, request

from runlane.errors import ConfigurationError
from runlane.stats import Histogram, StatsBucket
from runlane.toolkit import shown
from runlane.web._charts import LineChart, line_chart
from runlane.web._console import Console, Route
from runlane.web._filters import text_arg

__all__ = ["RANGES", "OverTime"]

# range name -> (window, bucket as Runlane.stats takes it)
RANGES: dict[str, tuple[timedelta, str]] = {
    "1h": (timedelta(hours=1), "1m"),
    "24h": (timedelta(hours=24), "15m"),
    "7d": (timedelta(days=7), "1h"),
}
# each bucket size as the page says it: "per minute", "buckets of a minute"
_PER = {"1m": "minute", "15m": "15 minutes", "1h": "hour"}
_OF = {"1m": "a minute", "15m": "15 minutes", "1h": "an hour"}
_COUNTS = ("completed", "failed", "retried", "cancelled", "triggered")
_QUANTILES = (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))


@attrs.frozen
class _Shown:
    title: str
    chart: LineChart
    note: str | None = None


class OverTime:
    """``GET /charts?queue=&task=&range=1h|24h|7d`` (endpoint ``runlane.charts``)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.runlane = console.runlane

    def routes(self) -> Iterable[Route]:
        return [("/charts", "charts", ["GET"], self.charts)]

    def charts(self) -> str:
        span = text_arg(request.args, "range") or "1h"
        if span not in RANGES:
            raise ConfigurationError(f"range {shown(span, 20)} is not one of {', '.join(RANGES)}")
        queue = text_arg(request.args, "queue")
        task = text_arg(request.args, "task")
        window, bucket = RANGES[span]
        until = self.console.storage().database_now()
        stats = self.runlane.stats(
            queue=queue, task=task, since=until - window, until=until, bucket=bucket
        )
        buckets = stats.buckets
        totals = stats.totals
        starts = [b.start for b in buckets]
        throughput = line_chart(
            "throughput",
            starts,
            [
                (name, [float(getattr(b, name)) for b in buckets], getattr(totals, name))
                for name in _COUNTS
            ],
            unit="runs",
        )
        args = {k: v for k, v in (("queue", queue), ("task", task)) if v is not None}
        return render_template(
            "runlane/charts.html",
            page="charts",
            span=span,
            ranges=list(RANGES),
            queue=queue,
            task=task,
            args=args,
            queues=[q.name for q in self.runlane.list_queues()],
            since=stats.since,
            until=stats.until,
            buckets=len(buckets),
            bucket_label=_OF[bucket],
            charts=[
                _Shown(f"Runs per {_PER[bucket]}", throughput),
                _Shown(
                    "Wait (due to start)",
                    _latency("wait", starts, buckets, totals, lambda b: b.wait),
                    "Of the runs that completed or failed in each bucket: from their due time "
                    "to the start of their final attempt.",
                ),
                _Shown(
                    "Run time",
                    _latency("run-time", starts, buckets, totals, lambda b: b.run_time),
                    "The final attempt's run time of the runs that completed or failed.",
                ),
            ],
        )


def _latency(
    chart_id: str,
    starts: list[datetime],
    buckets: tuple[StatsBucket, ...],
    totals: StatsBucket,
    of: Callable[[StatsBucket], Histogram],
) -> LineChart:
    return line_chart(
        chart_id,
        starts,
        [
            (name, [of(b).percentile(q) for b in buckets], of(totals).percentile(q))
            for name, q in _QUANTILES
        ],
        unit="s",
    )
