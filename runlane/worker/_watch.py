"""A worker's watch on maintenance: retries and releases only become due again through the
maintenance services, so a worker that sees them past due while no maintenance band has a
live owner says so (a WARNING at most once a minute)."""

from __future__ import annotations

import logging
import time

from runlane.storage import Storage

__all__ = ["MaintenanceWatch"]

log = logging.getLogger("runlane.worker")

# how often a worker asks, and how often it may warn (tests shorten both)
CHECK_SECONDS = 30.0
WARN_SECONDS = 60.0


class MaintenanceWatch:
    """Called on every tick of the worker's lifecycle writer; queries at most once every
    ``CHECK_SECONDS`` (one indexed statement on the runtime's pool)."""

    def __init__(self, storage: Storage, environment: str) -> None:
        self._storage = storage
        self._environment = environment
        self._next_check = time.monotonic() + CHECK_SECONDS
        self._next_warning = 0.0
        self.warnings = 0

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_SECONDS
        try:
            missing = self._storage.maintenance_missing(self._environment)
        except Exception as exc:  # the writer reports connection trouble itself
            log.debug("runlane: maintenance check failed: %r", exc)
            return
        if not missing or now < self._next_warning:
            return
        self._next_warning = now + WARN_SECONDS
        self.warnings += 1
        log.warning(
            "runlane: retries or releases of environment %r are past due and no maintenance "
            "band has a live owner: maintenance is not running. Run `runlane maintenance APP` "
            "(or `runlane worker APP --with-maintenance`, or Runlane.start_services()) in at "
            "least one process",
            self._environment,
        )
