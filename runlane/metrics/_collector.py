"""The collector: runlane's figures read from its database at scrape time.

Nothing is counted in the process: every scrape asks PostgreSQL, so any number of processes
(gunicorn workers, console replicas, `runlane metrics`) report the same figures, and none
keeps state between scrapes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runlane.models import QueueInfo, WorkerState
from runlane.runtime import Runlane

__all__ = ["RunlaneCollector"]


class RunlaneCollector(Collector):
    """Queue depth by status, oldest queued age, pauses, workers by state and maintenance
    bands of one runtime's environment, each labelled with it."""

    def __init__(self, runlane: Runlane) -> None:
        self._runlane = runlane

    def describe(self) -> list[Metric]:
        # registering a collector asks describe(), else collect(): no database read then
        return []

    def collect(self) -> Iterator[Metric]:
        env = self._runlane.environment
        queues = self._runlane.list_queues()
        yield from self._queues(env, queues)
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
