"""A service's start waits for a database that is restarting, starting up, refusing
connections or out of connection slots, instead of failing (a failover or a database
deploy would otherwise stop its workers).

The start repeats its first connection and schema check with backoff, a log line per
retry, for up to ``wait_for_database`` seconds; what no wait fixes fails at once (the
storage says which: ``StorageUnavailable.transient``). ``close()`` from another thread
ends the wait; on the main thread Ctrl-C raises ``KeyboardInterrupt``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from runlane.errors import RunlaneError, StorageUnavailable
from runlane.storage import Storage
from runlane.toolkit import Backoff, Deadline, as_wait_timeout, wait_event

__all__ = ["DEFAULT_WAIT_FOR_DATABASE", "DatabaseWait"]

log = logging.getLogger("runlane.runtime")

# how long a service's start waits for its database unless told (seconds): longer than a
# managed database's failover (one to two minutes) and a restart after a crash
DEFAULT_WAIT_FOR_DATABASE = 120.0
# the retries' delays: from about a second, doubling up to about 5 s (each spread over its
# lower half), so a server back in a moment is met soon and a long outage costs a line a few
# seconds apart
_FIRST_DELAY = 1.0
_MAX_DELAY = 5.0


class DatabaseWait:
    """The waits for the database of one runtime's service starts: ``start`` opens the
    runtime (its storage and lane), a first statement on ``storage`` checks the schema.
    ``end()`` (the runtime's close) ends the waits under way, which raise ``closed()``."""

    def __init__(
        self, start: Callable[[], object], storage: Storage, closed: Callable[[], RunlaneError]
    ) -> None:
        self._start = start
        self._storage = storage
        self._closed = closed
        self._ended = threading.Event()

    def end(self) -> None:
        self._ended.set()

    def _ready(self) -> None:
        self._start()
        self._storage.database_now()  # a first statement: the schema is checked too

    def until_ready(self, wait_for_database: object, what: str) -> None:
        """Open the runtime and check the schema; while that raises a transient
        :class:`StorageUnavailable`, log one line and try again after a backoff, for up to
        ``wait_for_database`` seconds (None: as long as it takes; 0: once). The last error
        is raised unchanged once the time is spent, and any other error at once."""
        seconds = as_wait_timeout("wait_for_database", wait_for_database)
        deadline = Deadline(seconds)
        backoff = Backoff(first=_FIRST_DELAY, cap=_MAX_DELAY)
        began = time.monotonic()
        retries = 0
        while True:
            try:
                self._ready()
            except StorageUnavailable as exc:
                if self._ended.is_set():  # closed while it connected: a stop, not a failure
                    raise self._closed() from exc
                left = deadline.left()
                if not exc.transient:
                    raise
                if left is not None and left <= 0:
                    if retries:
                        log.warning(
                            "runlane: %s: gave up waiting for the database after %.0f s "
                            "(wait_for_database=%g)",
                            what,
                            time.monotonic() - began,
                            seconds,
                        )
                    raise
                delay = backoff.next() if left is None else min(backoff.next(), left)
                retries += 1
                log.warning(
                    "runlane: %s: waiting for the database (%s); retry %d in %.1f s%s",
                    what,
                    _one_line(exc),
                    retries,
                    delay,
                    "" if left is None else f", giving up in {left:.0f} s",
                )
                if wait_event(self._ended, delay):
                    raise self._closed() from exc
                continue
            if retries:
                log.info(
                    "runlane: %s: the database answered after %.1f s; starting",
                    what,
                    time.monotonic() - began,
                )
            return


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
