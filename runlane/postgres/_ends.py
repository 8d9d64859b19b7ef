"""Wake-ups on runs ending, for ``wait_for_run`` (migration 9 announces them).

A runtime subscribes to its process's shared LISTEN connection (postgres/_listen_hub.py) on
the schema's ends channel while some ``wait_for_run`` waits: the channel is LISTENed with the
first waiter and UNLISTENed when the last one leaves (the connection stays while the runtime,
or any other subscriber, is open), so an idle process hears no run ends. Each waiter registers
the run it waits for and gets an event that is set when that run's id is announced, and each
time the channel is LISTENed anew (what was sent before is lost, so every waiter looks again).

It LISTENs where a worker's listener does (postgres/_lane.py's listen_target): on
``listen_connection_string=`` when the lane has one, else on the lane's own connection
string, which with ``pooler="auto"`` is first checked for a transaction pooler. Through one,
LISTEN would hear nothing, so the listener says so once (a WARNING) and stops: ``connected``
stays False and ``wait_for_run`` reads the run at its polling interval instead.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from runlane.postgres._listen_hub import SharedListener
from runlane.postgres._sql import notify_channel

__all__ = ["RunEnds", "ends_channel"]

log = logging.getLogger("runlane.listener")


def ends_channel(schema: str) -> str:
    """The channel migration 9's trigger announces ended runs on."""
    return f"runlane-ends.{notify_channel(schema)[len('runlane.') :]}"[:63]


class RunEnds:
    """Events set when watched runs end. Thread-safe."""

    def __init__(
        self,
        *,
        connection_string: str,
        schema: str,
        environment: str,
        connect_timeout: float,
        name: str,
        via: str = "the lane's connection string",
        check_pooler: bool = False,
    ) -> None:
        self._listener = SharedListener(
            connection_string=connection_string,
            channel=ends_channel(schema),
            environment=environment,
            on_wake=self._on_wake,
            name=name,
            connect_timeout=connect_timeout,
            via=via,
            check_pooler=check_pooler,
        )
        # reentrant: resuming a channel already LISTENed tells _on_wake at once, on this thread
        self._lock = threading.RLock()
        self._waiters: dict[uuid.UUID, list[threading.Event]] = {}
        self._started = False
        self._closed = False

    @property
    def connected(self) -> bool:
        """True while the ends channel is LISTENed (then a polling fallback can be slow);
        never after the listener found a transaction pooler on its way and gave up."""
        return self._listener.connected.is_set()

    @contextmanager
    def watch(self, run_id: uuid.UUID) -> Iterator[threading.Event]:
        """An event set when ``run_id`` is announced as ended (or the listener reconnected);
        the caller clears it before each look at the run."""
        event = threading.Event()
        with self._lock:
            first = not any(self._waiters.values())
            self._waiters.setdefault(run_id, []).append(event)
            if first and not self._closed:
                # under the lock, so a pause of the last waiter and this are not reordered
                if self._started:
                    self._listener.resume()
                else:
                    self._started = True
                    self._listener.start()
        try:
            yield event
        finally:
            with self._lock:
                events = self._waiters.get(run_id, [])
                if event in events:
                    events.remove(event)
                if not events:
                    self._waiters.pop(run_id, None)
                if not self._waiters and self._started and not self._closed:
                    self._listener.pause()  # nobody waits: UNLISTEN unless others need it

    def _on_wake(self, payload: str | None) -> None:
        with self._lock:
            if payload is None:
                events = [e for waiting in self._waiters.values() for e in waiting]
            else:
                events = []
                for text in payload.split(","):
                    try:
                        run_id = uuid.UUID(text)
                    except ValueError:
                        log.debug("runlane: ignoring a malformed run-end payload %r", payload)
                        continue
                    events.extend(self._waiters.get(run_id, ()))
        for event in events:
            event.set()

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            self._closed = True
            started = self._started
        if started:
            self._listener.close(timeout)
