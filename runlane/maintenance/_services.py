"""Supervised maintenance loops, one thread per band, each band owned by one replica.

Ownership of a band is a row in ``maintenance_leases``: owner, a fencing number that only
grows, and an expiry computed by the database. A replica acquires the band only when the row
is free or expired, refreshes it several times per lease period with its current token, and
checks the token inside every write transaction of the band (``Storage`` methods take the
fence). When a refresh is refused or raises, or no refresh succeeded before the local
deadline (monotonic time of the last good refresh + lease - margin; a refresh stuck in a
statement), the replica stops acting for the band at once, reports it, and competes for it
again like any other replica.

A schema that is missing or does not match (``SchemaNotMigrated``, ``IncompatibleSchema``) and
a closed runtime (``RunlaneClosed``) are fatal: retrying cannot help, so the failing band
reports the error, every band stops, and ``wait_until_closed()`` raises ``ServiceFailed``
chained to it. Every other failure is reported and retried.

Band state machine (per replica)::

    candidate --acquire ok--> owner --refresh ok--> owner
        ^                       |
        +-- refresh refused or ---+
            raising, local deadline passed, or a write reported StaleLease
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

from runlane._limits import MAX_LEASE, MIN_LEASE
from runlane.errors import (
    IncompatibleSchema,
    RunlaneClosed,
    SchemaNotMigrated,
    ServiceFailed,
    StaleLease,
)
from runlane.maintenance._board import Board, ServiceErrorCallback
from runlane.maintenance._pass import MaintenanceScope, run_phase
from runlane.maintenance._types import MaintenanceLimits, MaintenancePhase, ServiceErrorInfo
from runlane.storage import MaintenanceFence
from runlane.toolkit import as_timedelta, as_wait_timeout, wait_event

__all__ = ["BANDS", "Band", "ServiceErrorCallback", "Services"]

# a private generator: the global one belongs to the application (and to test tools)
_random = random.Random()

log = logging.getLogger("runlane.services")

_numbers = iter(range(1, 1 << 62))

# errors no retry can cure: the services stop and wait_until_closed() raises ServiceFailed
_FATAL: tuple[type[BaseException], ...] = (SchemaNotMigrated, IncompatibleSchema, RunlaneClosed)


class _Fatal(Exception):
    """Carries a fatal error out of a band loop once it has been reported."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


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
    Band("stats", (MaintenancePhase.STATS,), timedelta(seconds=10)),
)


# A band whose passes change nothing for IDLE_GRACE seconds waits twice as long after each
# further empty pass, up to IDLE_CAP between passes (never less than its interval); a pass
# that changes something, or fails, brings it back to its interval. An idle replica then
# makes a few statements every IDLE_CAP seconds instead of several a second, and a run that
# comes due (a retry, a delayed run, a wait token's timeout) in a quiet process is found up
# to IDLE_CAP late (benchmarks/connections.py, docs/scaling.md).
IDLE_GRACE = 10.0
IDLE_CAP = 10.0


def idle_interval(interval: float, empty_passes: int) -> float:
    """Seconds until a band's next pass: ``interval`` until its passes have changed nothing
    for ``IDLE_GRACE`` seconds, then doubling with each of the ``empty_passes`` past that
    (none before it), capped at ``IDLE_CAP`` (a band slower than the cap keeps its
    interval)."""
    if not empty_passes or interval >= IDLE_CAP:
        return interval
    return min(IDLE_CAP, interval * 2.0 ** min(empty_passes, 16))


class _BandLoop:
    """One band's thread: acquires, refreshes and releases its lease, runs its phases, and
    reports to the services' board."""

    def __init__(self, services: Services, board: Board, band: Band) -> None:
        self.services = services
        self.board = board
        self.band = band
        self.fence: MaintenanceFence | None = None
        self.deadline = 0.0  # monotonic time after which an unrefreshed owner stops acting
        self.last_refresh = 0.0
        self.next_pass = 0.0
        # since when (monotonic) its passes changed nothing, and how many did after the grace
        self.idle_since: float | None = None
        self.empty_passes = 0
        self.thread = threading.Thread(
            target=self.main, name=f"{services.name}-{band.name}", daemon=True
        )

    def main(self) -> None:
        board = self.board
        try:
            while not board.stop.is_set():
                self.step()
                board.stop.wait(self.wait_time())
            self.release()
        except _Fatal as fatal:
            self.release()
            if board.close_started:  # the runtime closed under a closing band: a clean close
                log.debug("runlane: band %s closing: %s", self.band.name, fatal)
            else:
                # the message says what to do; a traceback would add nothing
                log.error(  # noqa: TRY400
                    "runlane: maintenance band %s stopped the services: %s",
                    self.band.name,
                    fatal,
                )
                board.fail(fatal.error)
        except BaseException as exc:
            log.exception("runlane: maintenance band %s failed", self.band.name)
            board.fail(exc)
        finally:
            board.loop_exited()

    def wait_time(self) -> float:
        s = self.services
        now = time.monotonic()
        if self.fence is None:
            return s.acquire_interval * _random.uniform(0.8, 1.2)
        refresh_at = self.last_refresh + s.refresh_interval
        return max(0.0, min(self.next_pass, refresh_at) - now)

    def report(self, error: BaseException, phase: MaintenancePhase, operation: str) -> None:
        """Hand ``error`` to the observer; a fatal one then stops every band."""
        closing = self.board.close_started and isinstance(error, RunlaneClosed)
        if not closing:  # a runtime closed while this band closes is no failure to report
            self.board.report(error, ServiceErrorInfo(phase, self.band.name, operation))
        if isinstance(error, _FATAL):
            raise _Fatal(error) from error

    def lose(self, error: BaseException, operation: str) -> None:
        log.warning("runlane: lost maintenance band %s: %s", self.band.name, error)
        self.fence = None
        self.board.set_owned(self.band.name, None)
        self.report(error, self.band.phases[0], operation)

    def step(self) -> None:
        s = self.services
        now = time.monotonic()
        if self.fence is None:
            try:
                fencing = s.scope.storage.maintenance_lease_acquire(
                    s.scope.environment, self.band.name, s.owner, s.lease
                )
            except Exception as exc:  # reported, then retried (unless fatal)
                self.report(exc, self.band.phases[0], "acquire")
                return
            if fencing is None:  # another replica holds it; wake waiters that watch for that
                self.board.set_owned(self.band.name, None)
                return
            self.fence = MaintenanceFence(s.scope.environment, self.band.name, s.owner, fencing)
            # the first refresh comes up to half an interval early, at random: bands acquired
            # together would otherwise refresh together for good, each needing a pooled
            # connection at the same moment (the pool then never shrinks while idle)
            self.last_refresh = now - _random.uniform(0.0, s.refresh_interval / 2)
            self.deadline = now + s.lease_seconds - s.margin
            self.next_pass = now
            self.board.set_owned(self.band.name, fencing)
            log.info("runlane: %s owns band %s (fencing %d)", s.name, self.band.name, fencing)
        elif now - self.last_refresh >= s.refresh_interval:
            try:
                refreshed = s.scope.storage.maintenance_lease_refresh(self.fence, s.lease)
            except Exception as exc:
                # seed: "if refresh fails, that replica stops the band" at once, as when the
                # refresh is refused; the lease lapses (or is taken again by this replica's
                # next acquisition once it is free) and the error is reported
                self.lose(exc, "refresh")
                return
            if refreshed:
                self.last_refresh = now
                self.deadline = now + s.lease_seconds - s.margin
            else:
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
            self.schedule_after(self.run_phases())

    def schedule_after(self, changed: bool) -> None:
        """Set the next pass after one that ``changed`` something, or not."""
        now = time.monotonic()
        if changed:
            self.idle_since, self.empty_passes = None, 0
        elif self.idle_since is None:
            self.idle_since = now
        elif now - self.idle_since >= IDLE_GRACE:
            self.empty_passes += 1
        interval = self.band.interval.total_seconds()
        wait = idle_interval(interval, self.empty_passes)
        if wait > interval:  # spaced out: spread the idle bands' passes apart (as above)
            wait = max(interval, wait * _random.uniform(0.8, 1.0))
        self.next_pass = now + wait

    def run_phases(self) -> bool:
        """Run the band's phases; True when one changed something or failed (the band
        keeps its interval), False when all ran and found nothing to do."""
        s = self.services
        busy = False
        for phase in self.band.phases:
            if self.fence is None or self.board.stop.is_set():
                return True
            try:
                result = run_phase(s.scope, phase, s.limits, self.fence)
            except StaleLease as exc:
                self.lose(exc, "pass")
                return True
            except Exception as exc:  # every failed pass reaches the callback
                self.report(exc, phase, "pass")
                busy = True
            else:
                self.board.count(phase, result.total)
                # queues woken are no records changed, but say work is there
                busy = busy or result.total > 0 or result.lane.queues_woken > 0
        return busy

    def release(self) -> None:
        if self.fence is None:
            return
        fence, self.fence = self.fence, None
        self.board.set_owned(self.band.name, None)
        try:
            self.services.scope.storage.maintenance_lease_release(fence)
        except Exception as exc:  # the lease then simply expires
            if self.board.close_started and isinstance(exc, RunlaneClosed):
                # close gave up on this band (it named it, and said its lease lapses), then
                # the runtime closed its connections: not a failure to report once more
                log.debug("runlane: band %s closing: its lease lapses (%s)", self.band.name, exc)
                return
            self.board.report(exc, ServiceErrorInfo(self.band.phases[0], self.band.name, "release"))


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
        as_timedelta("lease_duration", lease, MIN_LEASE, MAX_LEASE)
        self.name = f"runlane-services-{next(_numbers)}"
        self.scope = scope
        self.limits = limits
        self.lease = lease
        self.lease_seconds = lease.total_seconds()
        # three refreshes a lease period (a refused or failed one stops the band at once; the
        # deadline, lease - margin after the last good one, bounds one that hangs)
        self.refresh_interval = self.lease_seconds / 3
        self.acquire_interval = self.lease_seconds / 6
        self.margin = self.lease_seconds / 10
        self.owner = uuid.uuid4()
        self._board = Board(on_service_error, len(bands))
        self._close_lock = threading.Lock()
        self._started = False
        # per phase: passes made and rows changed (the board's counters)
        self.changed: dict[MaintenancePhase, int] = self._board.changed
        self.passes: dict[MaintenancePhase, int] = self._board.passes
        self._loops = [_BandLoop(self, self._board, band) for band in bands]

    def start(self) -> None:
        with self._close_lock:
            if self._started or self._board.close_started:
                return
            self._started = True
        # the threads start outside the lock: Thread.start() waits, and a close() made on
        # this thread meanwhile (a signal handler runs wherever the main thread was) must not
        # wait for a lock its own thread holds (it did: a SIGTERM during start_services hung)
        for index, loop in enumerate(self._loops):
            if self._board.stop.is_set():
                # closed (or failed) meanwhile: the loops not started have nothing to stop,
                # and count as exited, so the board closes when the started ones have
                for _ in self._loops[index:]:
                    self._board.loop_exited()
                return
            loop.thread.start()

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called or a fatal failure stopped the loops."""
        return self._board.stop.is_set()

    def owned_bands(self) -> dict[str, int]:
        """The bands this replica owns now, with their fencing numbers."""
        return self._board.owned_bands()

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until ``predicate()`` holds; False when ``timeout`` passed first.

        ``predicate`` is checked at once, then again after every pass, attempt to acquire
        a band, band lost, reported failure and stop: a signal for tests and health checks
        instead of polling. It runs in the calling thread, without any lock of the services
        held."""
        return self._board.wait_for(predicate, timeout)

    def wait_until_closed(self, timeout: float | None = None) -> bool:
        """Block until closed; False when ``timeout`` passed first. Raises ServiceFailed when
        a band failed fatally: a missing or incompatible schema, a closed runtime, or an
        error raised by ``on_service_error`` that is not an ``Exception``. Other storage
        failures are reported to ``on_service_error`` and retried, not fatal."""
        timeout = as_wait_timeout("timeout", timeout)
        if not wait_event(self._board.closed, timeout):  # in slices: see runlane.toolkit
            return False
        failure = self._board.failure
        if failure is not None:
            raise ServiceFailed(
                f"{self.name} stopped after a fatal failure: {failure}; "
                "fix the cause and restart the process"
            ) from failure
        return True

    def close(self, timeout: float | None = None) -> None:
        """Stop every band and release the leases held, within ``timeout`` seconds (None:
        as long as it takes); idempotent, safe from any thread. A band thread still busy
        (a statement in flight) when the timeout passes is named in a warning and left to
        finish in the background; its lease then lapses if it cannot release it."""
        timeout = as_wait_timeout("timeout", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._close_lock:
            first = not self._board.close_started
            self._board.close_started = True
        if not first:
            self._board.closed.wait(timeout)
            return
        self._board.stop.set()
        try:
            self._board.notify()
            stuck: list[str] = []
            for loop in self._loops:
                thread = loop.thread
                if thread is threading.current_thread() or thread.ident is None:
                    continue
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                thread.join(remaining)
                if thread.is_alive():
                    stuck.append(thread.name)
            if stuck:
                log.warning(
                    "runlane: %s closed after %.1fs without waiting for %s (still in a "
                    "statement); its band leases lapse if they cannot be released",
                    self.name,
                    timeout,
                    ", ".join(stuck),
                )
        finally:
            self._board.closed.set()

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
