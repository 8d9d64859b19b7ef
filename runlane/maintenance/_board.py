"""What the maintenance bands of one ``Services`` share: the stop signal, the bands owned,
the counters, the failure that stopped them, and the waiters of ``Services.wait_for``.

The band loops report here and ``Services`` reads from here; neither reaches into the other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from runlane.maintenance._types import MaintenancePhase, ServiceErrorInfo
from runlane.toolkit import as_wait_timeout

__all__ = ["Board", "ServiceErrorCallback"]

log = logging.getLogger("runlane.services")

ServiceErrorCallback = Callable[[BaseException, ServiceErrorInfo], None]


class Board:
    """The shared state of a ``Services``' band loops."""

    def __init__(self, on_error: ServiceErrorCallback | None, loops: int) -> None:
        self.stop = threading.Event()  # set by close() or a fatal failure: every band stops
        self.closed = threading.Event()  # set once the last loop exited after the stop
        self.close_started = False  # close() was called (set under the services' lock)
        self.failure: BaseException | None = None
        self._on_error = on_error
        self._owned: dict[str, int] = {}
        # guards what follows; notified on every change a waiter may look for
        self._progress = threading.Condition()
        self._generation = 0
        self._running = loops
        self.changed: dict[MaintenancePhase, int] = dict.fromkeys(MaintenancePhase, 0)
        self.passes: dict[MaintenancePhase, int] = dict.fromkeys(MaintenancePhase, 0)

    def owned_bands(self) -> dict[str, int]:
        with self._progress:
            return dict(self._owned)

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """See ``Services.wait_for``."""
        timeout = as_wait_timeout("timeout", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._progress:
                seen = self._generation
            if predicate():
                return True
            with self._progress:
                while self._generation == seen:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._progress.wait(remaining)

    def _changed(self) -> None:
        """Wake the waiters of ``wait_for``; call with ``_progress`` held."""
        self._generation += 1
        self._progress.notify_all()

    def notify(self) -> None:
        """Wake the waiters of ``wait_for`` (something they may look for changed)."""
        with self._progress:
            self._changed()

    def set_owned(self, band: str, fencing: int | None) -> None:
        with self._progress:
            if fencing is None:
                self._owned.pop(band, None)
            else:
                self._owned[band] = fencing
            self._changed()

    def count(self, phase: MaintenancePhase, changed: int) -> None:
        with self._progress:
            self.passes[phase] += 1
            self.changed[phase] += changed
            self._changed()

    def report(self, error: BaseException, info: ServiceErrorInfo) -> None:
        try:
            if self._on_error is None:
                log.error(
                    "runlane maintenance %s (%s) failed: %r", info.phase, info.operation, error
                )
                return
            try:
                self._on_error(error, info)
            except Exception:
                log.exception("runlane: on_service_error raised")
        finally:
            self.notify()

    def fail(self, exc: BaseException) -> None:
        """A band failed fatally: record why and stop every band; the last loop to exit
        marks the services closed."""
        with self._progress:
            if self.failure is None:
                self.failure = exc
            self._changed()
        self.stop.set()

    def loop_exited(self) -> None:
        with self._progress:
            self._running -= 1
            last = self._running == 0
            self._changed()
        if last and self.stop.is_set():
            self.closed.set()
