"""What ``Runlane.stats`` returns: the rollup of an environment over time, in buckets.

Each figure is read from the per-minute rollup the maintenance band ``stats`` keeps
(docs/observability.md, "Metrics over time"). The wait and run time distributions are
histograms over :data:`HISTOGRAM_BOUNDS`: fixed, log-spaced upper bounds in seconds, so
percentiles interpolate within a bucket (a factor of sqrt(2) wide) and a Prometheus
histogram is the same counts, cumulated.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

import attrs

__all__ = ["BUCKETS", "HISTOGRAM_BOUNDS", "Histogram", "Stats", "StatsBucket", "histogram_index"]

# upper bounds in seconds: 1 ms * sqrt(2)**k for k = 0..52 (1 ms to about 18.6 hours); a
# value above the last bound counts in one more bucket (+Inf)
HISTOGRAM_BOUNDS: tuple[float, ...] = tuple(0.001 * 2 ** (k / 2) for k in range(53))

# the bucket sizes Runlane.stats accepts, by name
BUCKETS: dict[str, timedelta] = {
    "1m": timedelta(minutes=1),
    "5m": timedelta(minutes=5),
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "1d": timedelta(days=1),
}


def histogram_index(seconds: float) -> int:
    """The bucket of ``seconds``: the first whose upper bound is at least it (Prometheus'
    ``le``), ``len(HISTOGRAM_BOUNDS)`` above the last bound."""
    return bisect_left(HISTOGRAM_BOUNDS, seconds)


def _counts(value: Iterable[int]) -> tuple[int, ...]:
    counts = tuple(int(n) for n in value)
    if len(counts) != len(HISTOGRAM_BOUNDS) + 1:
        raise ValueError(f"a histogram has {len(HISTOGRAM_BOUNDS) + 1} counts, got {len(counts)}")
    return counts


def _zeros() -> tuple[int, ...]:
    return (0,) * (len(HISTOGRAM_BOUNDS) + 1)


@attrs.frozen
class Histogram:
    """Counts per bucket of :data:`HISTOGRAM_BOUNDS` (one more, the last, above the last
    bound) and the sum of the values counted, in seconds."""

    counts: tuple[int, ...] = attrs.field(factory=_zeros, converter=_counts)
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def percentile(self, q: float) -> float | None:
        """The ``q``-quantile (0 < q <= 1; 0.99 for p99), interpolated linearly within its
        bucket; None without values. Above the last bound it answers that bound."""
        if not 0 < q <= 1:
            raise ValueError(f"a quantile is within (0, 1], got {q!r}")
        total = self.count
        if total == 0:
            return None
        rank = q * total
        seen = 0
        for index, n in enumerate(self.counts):
            if n and seen + n >= rank:
                if index >= len(HISTOGRAM_BOUNDS):
                    return HISTOGRAM_BOUNDS[-1]
                low = HISTOGRAM_BOUNDS[index - 1] if index else 0.0
                high = HISTOGRAM_BOUNDS[index]
                return low + (high - low) * (rank - seen) / n
            seen += n
        return HISTOGRAM_BOUNDS[-1]  # pragma: no cover - rank <= total always lands above

    def cumulative(self) -> list[tuple[float, int]]:
        """``(le, count of values <= le)`` per bound, then ``(inf, count)``: a Prometheus
        histogram's buckets."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*HISTOGRAM_BOUNDS, math.inf), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def __add__(self, other: Histogram) -> Histogram:
        return Histogram(
            tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
            self.sum + other.sum,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "sum": self.sum,
            "p50": self.percentile(0.5),
            "p95": self.percentile(0.95),
            "p99": self.percentile(0.99),
            "counts": list(self.counts),
        }


@attrs.frozen
class StatsBucket:
    """What happened in ``[start, start + bucket)``: runs triggered, attempts started,
    attempts that ended in a retry (counted at their start), runs completed, failed and
    cancelled; ``wait`` (due to start) and ``run_time`` of the final attempt of each run
    that completed or failed in it."""

    start: datetime
    triggered: int = 0
    started: int = 0
    retried: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    wait: Histogram = Histogram()
    run_time: Histogram = Histogram()

    def __add__(self, other: StatsBucket) -> StatsBucket:
        """Figures summed; the earlier start."""
        return StatsBucket(
            start=min(self.start, other.start),
            triggered=self.triggered + other.triggered,
            started=self.started + other.started,
            retried=self.retried + other.retried,
            completed=self.completed + other.completed,
            failed=self.failed + other.failed,
            cancelled=self.cancelled + other.cancelled,
            wait=self.wait + other.wait,
            run_time=self.run_time + other.run_time,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start.isoformat(),
            "triggered": self.triggered,
            "started": self.started,
            "retried": self.retried,
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "wait": self.wait.to_dict(),
            "run_time": self.run_time.to_dict(),
        }


@attrs.frozen
class Stats:
    """The rollup of one environment over ``[since, until)``, optionally of one queue and
    one task, in ``buckets`` of ``bucket`` each (every bucket of the window, empty ones
    too, oldest first; the first starts at ``since`` rounded down to a whole bucket)."""

    environment: str
    queue: str | None
    task: str | None
    since: datetime
    until: datetime
    bucket: timedelta
    buckets: tuple[StatsBucket, ...]

    @property
    def totals(self) -> StatsBucket:
        """Every bucket summed (``start`` is the first bucket's)."""
        total = StatsBucket(start=self.buckets[0].start if self.buckets else self.since)
        for bucket in self.buckets:
            total += bucket
        return total

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (``runlane stats --json``)."""
        return {
            "environment": self.environment,
            "queue": self.queue,
            "task": self.task,
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "bucket_seconds": int(self.bucket.total_seconds()),
            "histogram_bounds": list(HISTOGRAM_BOUNDS),
            "totals": self.totals.to_dict(),
            "buckets": [b.to_dict() for b in self.buckets],
        }
