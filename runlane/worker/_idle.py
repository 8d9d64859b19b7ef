"""A worker thread's own connection, held while it is busy and let go while it is idle.

The lifecycle writer keeps a connection of its own while it has leases to extend or writes
to make (a statement every few milliseconds under load); an idle worker makes a statement
now and then (a heartbeat, a maintenance check), which the runtime's pool serves instead,
so an idle process holds no connection for it (docs/scaling.md).
"""

from __future__ import annotations

import threading
import time

from runlane.storage import Storage

__all__ = ["IDLE_GRACE", "IdleConnection"]

# seconds without work after which the own connection is closed
IDLE_GRACE = 10.0


class IdleConnection:
    """``get(busy)``: the owner's dedicated view (made on first need) while it is busy or
    was within ``grace`` seconds; else ``shared``, and the dedicated view is closed."""

    def __init__(self, shared: Storage, name: str, *, grace: float | None = None) -> None:
        self._shared = shared
        self._name = name
        self._grace = IDLE_GRACE if grace is None else grace
        self._lock = threading.Lock()
        self._own: Storage | None = None
        # a worker just made is about to work: busy until a grace after it was made (its
        # registration goes on the own connection, as its first claims do)
        self._busy_at = time.monotonic()
        self._closed = False

    @property
    def held(self) -> bool:
        """Whether the own connection's view exists now (for tests and status)."""
        with self._lock:
            return self._own is not None

    def get(self, busy: bool) -> Storage:
        now = time.monotonic()
        if busy:
            self._busy_at = now
        with self._lock:
            if self._closed:
                return self._shared
            if busy or now - self._busy_at < self._grace:
                if self._own is None:
                    self._own = self._shared.dedicated(self._name)
                return self._own
            own, self._own = self._own, None
        if own is not None:
            own.close()
        return self._shared

    def release_if_idle(self) -> None:
        """Close the own connection once ``grace`` seconds passed without work (the owner
        calls this on its ticks, so an idle owner lets go without making a statement)."""
        with self._lock:
            if self._own is None or time.monotonic() - self._busy_at < self._grace:
                return
            own, self._own = self._own, None
        own.close()

    def interrupt(self) -> None:
        """Cancel the statement in flight on the own connection, if any."""
        with self._lock:
            own = self._own
        if own is not None:
            own.interrupt()

    def close(self) -> None:
        """Close the own connection; later calls of ``get`` get the shared storage."""
        with self._lock:
            self._closed = True
            own, self._own = self._own, None
        if own is not None:
            own.close()
