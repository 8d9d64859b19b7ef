"""Keeps the leases of running attempts alive while their handlers run.

One background thread extends every tracked lease in a single fenced batch a few times per
lease period. When an extension is refused (the lease was lost or expired), when the run
asks to be cancelled, or when the task's timeout has passed, the attempt's
``context.cancelled`` is set; past the timeout the lease is no longer extended, so it lapses
and maintenance finalizes the attempt.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import timedelta

import attrs

from runlane.context import RunContext
from runlane.models import RunStatus
from runlane.storage import LeaseRef, Storage

__all__ = ["LeaseKeeper"]

log = logging.getLogger("runlane.leases")

# Extend this many times per lease period, so one slow round trip never lets a lease lapse.
_EXTENSIONS_PER_LEASE = 3


@attrs.define
class _Tracked:
    ref: LeaseRef
    context: RunContext
    deadline: float | None  # time.monotonic() after which the lease is left to lapse


class LeaseKeeper:
    def __init__(self, storage: Storage, lease: timedelta, *, name: str) -> None:
        self._storage = storage
        self._lease = lease
        self._interval = lease.total_seconds() / _EXTENSIONS_PER_LEASE
        self._name = name
        self._lock = threading.Lock()
        self._tracked: dict[uuid.UUID, _Tracked] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, ref: LeaseRef, context: RunContext, timeout: timedelta | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        with self._lock:
            self._tracked[ref.run_id] = _Tracked(ref, context, deadline)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()

    def untrack(self, run_id: uuid.UUID) -> None:
        with self._lock:
            self._tracked.pop(run_id, None)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.extend_once()
            except Exception:
                # a failed round trip is retried next tick; the lease period allows several
                log.exception("runlane: extending leases failed")

    def extend_once(self) -> None:
        now = time.monotonic()
        with self._lock:
            tracked = list(self._tracked.values())
        live = []
        for item in tracked:
            if item.deadline is not None and now >= item.deadline:
                if not item.context.cancelled.is_set():
                    log.warning(
                        "run %s attempt %d passed its task timeout; its lease will lapse",
                        item.ref.run_id,
                        item.ref.attempt,
                    )
                item.context.cancelled.set()
            else:
                live.append(item)
        if not live:
            return
        applied = self._storage.run_extend_leases([item.ref for item in live], self._lease)
        for item in live:
            status = applied.get(item.ref.run_id)
            if status is None:
                log.warning(
                    "run %s attempt %d lost its lease; signalling its handler to stop",
                    item.ref.run_id,
                    item.ref.attempt,
                )
                item.context.cancelled.set()
            elif status is RunStatus.CANCELLATION_REQUESTED:
                item.context.cancelled.set()
