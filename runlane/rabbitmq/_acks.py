"""Acknowledging a worker's deliveries once the WAL is flushed past their claims.

Claims by id commit asynchronously (``synchronous_commit=off``) so handlers start at once,
but a delivery acknowledged before its claim is durable would be lost with a server crash.
``runlane-worker-N-acks`` waits for one synchronous flush sent after the claims returned
(``Outbox.wal_flush``), then acknowledges them all; a failed flush requeues them instead (a
surviving claim makes the redelivery a duplicate, dropped; a lost one is claimed again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from runlane.errors import RunlaneError

__all__ = ["AckAfterFlush"]

log = logging.getLogger("runlane.rabbitmq.consumer")

D = TypeVar("D")


class AckAfterFlush(Generic[D]):
    """Deliveries waiting for the WAL flush that makes their claims durable, and the thread
    that waits for it. ``flush`` returns once the WAL is flushed past every commit made
    before it was called; ``settle(deliveries, ack)`` acknowledges them (or returns them to
    the broker, ``ack=False``)."""

    def __init__(
        self,
        name: str,
        flush: Callable[[], None],
        settle: Callable[[list[D], bool], None],
    ) -> None:
        self._flush = flush
        self._settle = settle
        self._cond = threading.Condition()
        self._pending: list[D] = []
        self._busy = False  # a flush is in flight for deliveries taken from _pending
        self._closing = False
        self.flushes = 0  # flushes made (each acknowledged everything waiting before it)
        self.failures = 0  # flushes that failed: their deliveries were returned
        self._thread = threading.Thread(target=self._run, name=f"{name}-acks", daemon=True)
        self._started = False

    def add(self, deliveries: list[D]) -> None:
        """Acknowledge ``deliveries`` once the WAL is flushed past every commit made before
        this call (their claims and deferrals have committed: call it after them)."""
        if not deliveries:
            return
        with self._cond:
            if not self._started:  # started on first use
                self._started = True
                self._thread.start()
            self._pending.extend(deliveries)
            self._cond.notify()

    def idle(self) -> bool:
        """Nothing waits for a flush (tests)."""
        with self._cond:
            return not self._pending and not self._busy

    def close(self, timeout: float | None) -> None:
        """Flush and settle what waits, then stop the thread (within ``timeout``)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            started = self._started
        if started:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "runlane: %s did not stop in time; its deliveries go back to the broker "
                    "with the connection",
                    self._thread.name,
                )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                batch, self._pending = self._pending, []
                self._busy = True
            try:
                self._flush_and_settle(batch)
            finally:
                with self._cond:
                    self._busy = False

    def _flush_and_settle(self, batch: list[D]) -> None:
        try:
            self._flush()
        except RunlaneError as exc:
            self.failures += 1
            log.warning(
                "runlane: %s: the WAL flush that makes %d claim(s) durable failed (%s); their "
                "deliveries go back to the broker",
                self._thread.name,
                len(batch),
                exc,
            )
            self._settle(batch, False)
            return
        except BaseException:
            self.failures += 1
            log.exception("runlane: %s: the WAL flush failed", self._thread.name)
            self._settle(batch, False)
            return
        self.flushes += 1
        self._settle(batch, True)
