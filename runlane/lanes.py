"""The lane interface: how runs are stored and delivered.

A runtime is built on one lane (``create_runlane(lane=...)``); the engine imports no
database or broker driver, and everything lane-specific lives behind these protocols: the
storage, the delivery path (:class:`Acquirer`), the lane's maintenance and status, and
whether it supports ``drain()``. Every lane must pass :mod:`runlane.testing.conformance`;
docs/lanes.md describes the contract and how to write a lane.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Protocol, runtime_checkable

import attrs

from runlane.maintenance import NOT_RECORDS, LaneMaintenance, MaintenanceLimits
from runlane.models import LaneStatus
from runlane.storage import ClaimedRun, MaintenanceFence, Storage
from runlane.tasks import Queue

__all__ = [
    "NOT_RECORDS",
    "Acquirer",
    "AcquirerOptions",
    "ChecksQueueNames",
    "Lane",
    "LaneMaintenance",
    "LaneStatus",
    "RunEndWatcher",
]


@attrs.frozen
class AcquirerOptions:
    """What a worker tells its lane's acquirer."""

    environment: str
    queues: Sequence[Queue]
    name: str  # thread-name prefix of the worker, e.g. "runlane-worker-3"
    lease: timedelta
    # True for drain(): it never waits for work, so start no listener or consumer
    drain: bool
    concurrency: int = 1  # the worker's slots
    # the most one claim takes (create_delivery_worker's claim_batch): a broker consumer's
    # prefetch, so it can feed every slot and claim ahead as the polling lane does
    claim_batch: int = 1
    # the delivery worker's registration id, recorded by every claim (None: drain)
    worker_id: uuid.UUID | None = None


class Acquirer(Protocol):
    """One worker's delivery path. Called by one slot at a time (the pool's acquirer)."""

    def start(self) -> None:
        """Start background threads (a listener, a broker consumer); idempotent."""

    def acquire(self, want: int, for_bounded: int) -> list[ClaimedRun]:
        """Claim up to ``want`` runs now (at most ``for_bounded`` of them from bounded queues,
        which never claim ahead of free slots); ``[]`` when nothing is due. Raises
        :class:`runlane.StorageUnavailable` when storage cannot be reached (the pool backs
        off and asks again). Every run returned holds a fresh lease the caller now owns."""

    def wait_for_work(self) -> None:
        """Block until work may be due: announced, the lane's poll interval passed, or
        ``interrupt()`` was called (an announcement since the last ``acquire`` began counts)."""

    def interrupt(self) -> None:
        """Wake an ``acquire`` blocked waiting for work (close, freed local capacity)."""

    def abort(self) -> None:
        """Cancel a claim statement in flight (close gave up waiting for it); the claim
        either fails with nothing claimed or returns its runs to the caller as usual."""

    def close(self, timeout: float | None) -> None:
        """Stop background threads and release connections, within ``timeout``."""

    def wait_ready(self, timeout: float) -> bool:
        """Block until an announcement (a trigger, a cancel) would reach this acquirer at
        once rather than at its next poll: its listener is connected, its consumer
        consuming. True once ready (at once when there is nothing to wait for: a poll-only
        or drain acquirer), False when ``timeout`` passed first. Readiness comes and goes
        with connections; it is a snapshot, not a promise."""

    @property
    def rate_wait(self) -> float | None:
        """Seconds until a rate limit that held due runs back in the last ``acquire`` lets
        the next one start (None: none did). ``drain()`` waits this long and claims again
        instead of reporting the queue empty; a lane without drain support returns None."""


class RunEndWatcher(Protocol):
    """Wake-ups on runs ending (``wait_for_run``); a hint, polling stays the fallback."""

    @property
    def connected(self) -> bool:
        """True while announcements arrive (a slow fallback poll is then enough)."""

    def watch(self, run_id: uuid.UUID) -> AbstractContextManager[threading.Event]:
        """An event set when the run is announced as ended, or when announcements may have
        been missed; the caller clears it before each look at the run."""

    def close(self, timeout: float | None = None) -> None: ...


@runtime_checkable
class ChecksQueueNames(Protocol):
    """A lane's optional part: ``create_runlane`` calls ``check_queue_names`` with the
    runtime's environment and every registered queue, to refuse a name the lane's transport
    cannot carry (the RabbitMQ lane's 255-byte queue names) with ``ConfigurationError``."""

    def check_queue_names(self, environment: str, queue_names: Sequence[str]) -> None: ...


class Lane(Protocol):
    """How a runtime stores and delivers runs; ``postgres_polling_lane`` makes one. A lane
    whose transport limits queue names is also a :class:`ChecksQueueNames`."""

    @property
    def name(self) -> str:
        """A short name for logs and errors, e.g. ``"postgres-polling"``."""

    @property
    def lease_duration(self) -> timedelta: ...

    @property
    def drain_unsupported(self) -> str | None:
        """None when ``drain()`` works on this lane, else why it cannot (for the error)."""

    def create_storage(self) -> Storage: ...

    def prepare(self, storage: Storage, environment: str) -> None:
        """Called once per runtime (and again after it is reopened) before its first
        operation on ``storage``: a transport lane enables its outbox for the environment."""

    def watch_run_ends(self, environment: str, name: str) -> RunEndWatcher | None:
        """What ``wait_for_run`` waits on (a thread named ``name`` once started), or None
        when the lane announces no ends (``wait_for_run`` then polls)."""

    def create_acquirer(
        self,
        storage: Storage,
        options: AcquirerOptions,
        on_cancel: Callable[[uuid.UUID | None], None],
    ) -> Acquirer:
        """The delivery path of one worker (or one drain) over ``storage``."""

    def recover_delivery(
        self,
        storage: Storage,
        environment: str,
        limits: MaintenanceLimits,
        fence: MaintenanceFence | None,
    ) -> LaneMaintenance:
        """The lane's part of ``DELIVERY_RECOVERY``: announce again what may have been missed
        (the polling lane wakes queues whose delayed runs came due; a transport lane
        publishes pending outbox items and re-announces runs lost by the broker). Returns
        what it did (``MaintenanceResult.lane``)."""

    def status(self, storage: Storage, environment: str) -> LaneStatus:
        """The lane's part of ``Runlane.status()`` (``StatusReport.lane``): its outbox, and
        whatever else it checks (a subclass of :class:`LaneStatus`)."""
