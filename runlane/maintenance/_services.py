"""Supervised maintenance loops, one thread per band, each band owned by one replica.

Ownership of a band is a row in ``maintenance_leases``: owner, a fencing number that only
grows, and an expiry computed by the database. A replica acquires the band only when the row
is free or expired, refreshes it several times per lease period with its current token, and
checks the token inside every write transaction of the band (``Storage`` methods take the
fence). When a refresh fails, or no refresh succeeded before the local deadline (monotonic
time of the last good refresh + lease - margin), the replica stops acting for the band,
reports it, and competes for it again like any other replica.

Band state machine (per replica)::

    candidate --acquire ok--> owner --refresh ok--> owner
        ^                       |
        +-- refresh refused, ---+
            local deadline passed, or a write reported StaleLease
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import attrs

from runlane.errors import ConfigurationError, ServiceFailed, StaleLease
from runlane.maintenance._pass import MaintenanceScope, run_phase
from runlane.maintenance._types import MaintenanceLimits, MaintenancePhase, ServiceErrorInfo
from runlane.storage import MaintenanceFence

__all__ = ["BANDS", "Band", "ServiceErrorCallback", "Services"]

# a private generator: the global one belongs to the application (and to test tools)
_random = random.Random()

log = logging.getLogger("runlane.services")

ServiceErrorCallback = Callable[[BaseException, ServiceErrorInfo], None]

_numbers = iter(range(1, 1 << 62))


@attrs.frozen
class Band:
    name: str
    phases: tuple[MaintenancePhase, ...]
    interval: timedelta


BANDS = (
    Band("schedules", (MaintenancePhase.SCHEDULES,), timedelta(seconds=1)),
    Band(
        "delivery",
        (
            MaintenancePhase.DUE_DELIVERY,
            MaintenancePhase.WAIT_TOKEN_RESOLUTION,
            MaintenancePhase.DELIVERY_RECOVERY,
        ),
        timedelta(milliseconds=500),
    ),
    Band("recovery", (MaintenancePhase.ATTEMPT_EXPIRY,), timedelta(seconds=1)),
    Band("cleanup", (MaintenancePhase.CLEANUP,), timedelta(seconds=60)),
)


class _BandLoop:
    def __init__(self, services: Services, band: Band) -> None:
        self.services = services
        self.band = band
        self.fence: MaintenanceFence | None = None
        self.deadline = 0.0  # monotonic time after which an unrefreshed owner stops acting
        self.last_refresh = 0.0
        self.next_pass = 0.0
        self.thread = threading.Thread(
            target=self.main, name=f"{services.name}-{band.name}", daemon=True
        )

    def main(self) -> None:
        try:
            while not self.services._stop.is_set():
                self.step()
                self.services._stop.wait(self.wait_time())
            self.release()
        except BaseException as exc:
            log.exception("runlane: maintenance band %s failed", self.band.name)
            self.services._fail(exc)

    def wait_time(self) -> float:
        s = self.services
        now = time.monotonic()
        if self.fence is None:
            return s.acquire_interval * _random.uniform(0.8, 1.2)
        refresh_at = self.last_refresh + s.refresh_interval
        return max(0.0, min(self.next_pass, refresh_at) - now)

    def report(self, error: BaseException, phase: MaintenancePhase, operation: str) -> None:
        self.services._report(error, ServiceErrorInfo(phase, self.band.name, operation))

    def lose(self, error: BaseException, operation: str) -> None:
        log.warning("runlane: lost maintenance band %s: %s", self.band.name, error)
        self.fence = None
        self.services._owned.pop(self.band.name, None)
        self.report(error, self.band.phases[0], operation)

    def step(self) -> None:
        s = self.services
        now = time.monotonic()
        if self.fence is None:
            try:
                fencing = s.scope.storage.maintenance_lease_acquire(
                    s.scope.environment, self.band.name, s.owner, s.lease
                )
            except Exception as exc:  # reported, then retried
                self.report(exc, self.band.phases[0], "acquire")
                return
            if fencing is None:
                return
            self.fence = MaintenanceFence(s.scope.environment, self.band.name, s.owner, fencing)
            self.last_refresh = now
            self.deadline = now + s.lease_seconds - s.margin
            self.next_pass = now
            s._owned[self.band.name] = fencing
            log.info("runlane: %s owns band %s (fencing %d)", s.name, self.band.name, fencing)
        elif now - self.last_refresh >= s.refresh_interval:
            try:
                refreshed = s.scope.storage.maintenance_lease_refresh(self.fence, s.lease)
            except Exception as exc:  # reported; the local deadline decides
                self.report(exc, self.band.phases[0], "refresh")
                refreshed = None
            if refreshed:
                self.last_refresh = now
                self.deadline = now + s.lease_seconds - s.margin
            elif refreshed is False:
                self.lose(
                    StaleLease(
                        f"refresh of band {self.band.name!r} (fencing {self.fence.fencing}) "
                        "was refused: the lease expired or another replica took it"
                    ),
                    "refresh",
                )
                return
        if time.monotonic() >= self.deadline:
            self.lose(
                StaleLease(
                    f"band {self.band.name!r}: no successful refresh within the lease; "
                    "stopping before another replica may take over"
                ),
                "refresh",
            )
            return
        if time.monotonic() >= self.next_pass:
            self.run_phases()
            self.next_pass = time.monotonic() + self.band.interval.total_seconds()

    def run_phases(self) -> None:
        s = self.services
        for phase in self.band.phases:
            if self.fence is None or s._stop.is_set():
                return
            try:
                result = run_phase(s.scope, phase, s.limits, self.fence)
            except StaleLease as exc:
                self.lose(exc, "pass")
                return
            except Exception as exc:  # every failed pass reaches the callback
                self.report(exc, phase, "pass")
            else:
                s._count(phase, result.total)

    def release(self) -> None:
        if self.fence is None:
            return
        try:
            self.services.scope.storage.maintenance_lease_release(self.fence)
        except Exception as exc:  # the lease then simply expires
            self.report(exc, self.band.phases[0], "release")
        self.fence = None
        self.services._owned.pop(self.band.name, None)


class Services:
    """Maintenance loops in background threads; make them with ``Runlane.start_services``."""

    def __init__(
        self,
        scope: MaintenanceScope,
        *,
        limits: MaintenanceLimits,
        lease: timedelta,
        on_service_error: ServiceErrorCallback | None,
        bands: tuple[Band, ...] = BANDS,
    ) -> None:
        if lease < timedelta(seconds=1):
            raise ConfigurationError(f"maintenance lease must be at least 1 second, got {lease}")
        self.name = f"runlane-services-{next(_numbers)}"
        self.scope = scope
        self.limits = limits
        self.lease = lease
        self.lease_seconds = lease.total_seconds()
        self.refresh_interval = self.lease_seconds / 4
        self.acquire_interval = self.lease_seconds / 6
        self.margin = self.lease_seconds / 10
        self.owner = uuid.uuid4()
        self._on_error = on_service_error
        self._stop = threading.Event()
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._close_started = False
        self._failure: BaseException | None = None
        self._owned: dict[str, int] = {}
        self._lock = threading.Lock()
        self.changed: dict[MaintenancePhase, int] = dict.fromkeys(MaintenancePhase, 0)
        self.passes: dict[MaintenancePhase, int] = dict.fromkeys(MaintenancePhase, 0)
        self._loops = [_BandLoop(self, band) for band in bands]

    def start(self) -> None:
        for loop in self._loops:
            loop.thread.start()

    def owned_bands(self) -> dict[str, int]:
        """The bands this replica owns now, with their fencing numbers."""
        return dict(self._owned)

    def _count(self, phase: MaintenancePhase, changed: int) -> None:
        with self._lock:
            self.passes[phase] += 1
            self.changed[phase] += changed

    def _report(self, error: BaseException, info: ServiceErrorInfo) -> None:
        if self._on_error is None:
            log.error("runlane maintenance %s (%s) failed: %r", info.phase, info.operation, error)
            return
        try:
            self._on_error(error, info)
        except Exception:
            log.exception("runlane: on_service_error raised")

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc
        threading.Thread(target=self.close, name=f"{self.name}-closer", daemon=True).start()

    def wait_until_closed(self, timeout: float | None = None) -> bool:
        """Block until closed; False when ``timeout`` passed first. Raises ServiceFailed when
        a band's thread failed fatally (storage failures are reported, not fatal)."""
        if not self._closed.wait(timeout):
            return False
        if self._failure is not None:
            raise ServiceFailed(
                f"{self.name} stopped after a fatal failure: {self._failure!r}; restart the process"
            ) from self._failure
        return True

    def close(self, timeout: float | None = None) -> None:
        """Stop every band, release the leases held; idempotent, safe from any thread."""
        with self._close_lock:
            first = not self._close_started
            self._close_started = True
        if not first:
            self._closed.wait(timeout)
            return
        self._stop.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for loop in self._loops:
            if loop.thread is threading.current_thread() or not loop.thread.is_alive():
                continue
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            loop.thread.join(remaining)
        self._closed.set()

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
