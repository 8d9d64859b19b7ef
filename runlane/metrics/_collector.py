"""The collector: runlane's figures read from its database at scrape time.

Nothing is counted in the process: every scrape asks PostgreSQL, so any number of processes
(gunicorn workers, console replicas, `runlane metrics`) report the same figures, and none
keeps state between scrapes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runlane.models import QueueInfo, WorkerState
from runlane.runtime import Runlane
from runlane.stats import Histogram, StatsBucket

__all__ = ["EVENTS", "WINDOW", "RunlaneCollector"]

# throughput and the histograms cover this many whole minutes of the rollup, ending where
# the database's current minute begins
WINDOW = timedelta(minutes=5)
# what the rollup counts per queue, as runlane_queue_window_runs's event label
EVENTS = ("triggered", "started", "retried", "completed", "failed", "cancelled")
# every second of the rollup's bounds (1 ms * 2**k): cumulative counts are exact at any
# subset of them, and 28 buckets a histogram are plenty for alerts and heatmaps
_EVERY = 2


class RunlaneCollector(Collector):
    """Queue depth by status, oldest queued age, pauses, throughput and wait and run time
    histograms over :data:`WINDOW` (from ``Runlane.stats``), workers by state and
    maintenance bands of one runtime's environment, each labelled with it."""

    def __init__(self, runlane: Runlane) -> None:
        self._runlane = runlane

    def describe(self) -> list[Metric]:
        # registering a collector asks describe(), else collect(): no database read then
        return []

    def collect(self) -> Iterator[Metric]:
        env = self._runlane.environment
        queues = self._runlane.list_queues()
        yield from self._queues(env, queues)
        yield from self._window(env, queues)
        yield self._workers(env)
        yield from self._bands(env)

    def _queues(self, env: str, queues: list[QueueInfo]) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "runlane_queue_runs",
            "Unfinished runs in a queue by status (claimed ones are in running).",
            labels=["environment", "queue", "status"],
        )
        claimed = GaugeMetricFamily(
            "runlane_queue_claimed_runs",
            "Runs a worker claimed whose handler has not started yet (part of running).",
            labels=["environment", "queue"],
        )
        oldest = GaugeMetricFamily(
            "runlane_queue_oldest_queued_age_seconds",
            "Seconds since the oldest due queued run became due (0: none is waiting).",
            labels=["environment", "queue"],
        )
        paused = GaugeMetricFamily(
            "runlane_queue_paused",
            "1 while the queue is paused (its runs are not claimed), else 0.",
            labels=["environment", "queue"],
        )
        for info in queues:
            for status, count in info.counts.items():
                depth.add_metric([env, info.name, status], count)
            claimed.add_metric([env, info.name], info.claimed)
            oldest.add_metric([env, info.name], info.oldest_queued_age or 0.0)
            paused.add_metric([env, info.name], 1 if info.paused else 0)
        yield from (depth, claimed, oldest, paused)

    def _window(self, env: str, queues: list[QueueInfo]) -> Iterator[Metric]:
        minutes = int(WINDOW.total_seconds() // 60)
        runs = GaugeMetricFamily(
            "runlane_queue_window_runs",
            f"Runs per event over the last {minutes} whole minutes of the rollup (triggered; "
            "attempts started; attempts ended in a retry; runs completed, failed, cancelled).",
            labels=["environment", "queue", "event"],
        )
        wait = GaugeHistogramMetricFamily(
            "runlane_queue_wait_seconds",
            "Due to start of the final attempt, of runs finished over the last "
            f"{minutes} whole minutes.",
            labels=["environment", "queue"],
        )
        run_time = GaugeHistogramMetricFamily(
            "runlane_queue_run_seconds",
            "Run time of the final attempt, of runs finished over the last "
            f"{minutes} whole minutes.",
            labels=["environment", "queue"],
        )
        # the whole minutes before the current one: the same span at every scrape
        now = self._runlane.opened_storage().database_now()
        until = now.replace(second=0, microsecond=0)
        for info in queues:
            totals = self._runlane.stats(
                queue=info.name, since=until - WINDOW, until=until, bucket="1m"
            ).totals
            for event in EVENTS:
                runs.add_metric([env, info.name, event], _event(totals, event))
            wait.add_metric([env, info.name], _buckets(totals.wait), totals.wait.sum)
            run_time.add_metric([env, info.name], _buckets(totals.run_time), totals.run_time.sum)
        yield from (runs, wait, run_time)

    def _workers(self, env: str) -> Metric:
        workers = GaugeMetricFamily(
            "runlane_workers",
            "Delivery workers by state (lost: unseen for three heartbeats; stopped until "
            "retention removes them).",
            labels=["environment", "state"],
        )
        states = Counter(w.state for w in self._runlane.list_workers(include_stopped=True))
        for state in WorkerState:
            workers.add_metric([env, state.value], states[state])
        return workers

    def _bands(self, env: str) -> Iterator[Metric]:
        live = GaugeMetricFamily(
            "runlane_maintenance_band_live",
            "1 while a maintenance band's lease is held and not expired, else 0.",
            labels=["environment", "band"],
        )
        expires = GaugeMetricFamily(
            "runlane_maintenance_band_lease_expiry_timestamp_seconds",
            "When the band's current lease expires (Unix time, the database's clock).",
            labels=["environment", "band"],
        )
        fencing = GaugeMetricFamily(
            "runlane_maintenance_band_fencing_token",
            "The band's fencing token: it grows by one at each takeover of an expired lease.",
            labels=["environment", "band"],
        )
        for row in self._runlane.opened_storage().maintenance_lease_list(env):
            live.add_metric([env, row.band], 1 if row.live else 0)
            expires.add_metric([env, row.band], row.expires_at.timestamp())
            fencing.add_metric([env, row.band], row.fencing)
        yield from (live, expires, fencing)


def _event(totals: StatsBucket, event: str) -> int:
    count: int = getattr(totals, event)
    return count


def _buckets(histogram: Histogram) -> list[tuple[str, float]]:
    """The cumulative buckets Prometheus reads (``le`` as its text), every second bound
    and +Inf."""
    pairs = histogram.cumulative()
    kept = [*pairs[:-1:_EVERY], pairs[-1]]
    return [("+Inf" if math.isinf(le) else repr(le), float(n)) for le, n in kept]
