"""One LISTEN connection per process for each server and channel, shared by its listeners.

Every runtime, worker and publisher of a process that listens on the same channel of the
same server (the same connection string, pooler check and connect timeout) subscribes to one
:class:`~runlane.postgres._listener.PostgresListener` started by the first and closed with the
last (``SharedListener``). Each subscriber keeps its own environment filter and callback, and
is told ``None`` ("something may have been missed") after every reconnect, and once when it
joins a listener already connected (as if it had just connected itself). The shared
connection is named after its first subscriber.

A forked child inherits the parent's listeners but not their threads: it forgets them (their
connections are the parent's: they are kept, never closed, so the parent's sessions are left
alone) and its first subscriber starts a listener of its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from runlane.postgres._listener import PostgresListener

__all__ = ["SharedListener", "shared_listeners"]

_Key = tuple[str, str, bool, float]


class _Hub:
    """One channel's listener and its subscribers."""

    def __init__(self, make: Callable[[Callable[[str | None], None]], PostgresListener]) -> None:
        self.subscribers: list[SharedListener] = []
        self.listener = make(self.dispatch)

    def dispatch(self, payload: str | None) -> None:
        for subscriber in list(self.subscribers):
            subscriber.deliver(payload)


class _Hubs:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hubs: dict[_Key, _Hub] = {}
        self.forgotten: list[_Hub] = []  # a forked child's inherited hubs, never closed

    def subscribe(self, key: _Key, subscriber: SharedListener) -> PostgresListener:
        with self.lock:
            hub = self.hubs.get(key)
            fresh = hub is None
            if hub is None:
                hub = self.hubs[key] = _Hub(subscriber.inner)
            hub.subscribers.append(subscriber)
            listener = hub.listener
            if fresh:
                listener.start()
            joined_connected = not fresh and listener.connected.is_set()
        if joined_connected:
            subscriber.deliver(None)
        return listener

    def unsubscribe(self, key: _Key, subscriber: SharedListener, timeout: float | None) -> None:
        with self.lock:
            hub = self.hubs.get(key)
            if hub is None or subscriber not in hub.subscribers:
                return
            hub.subscribers.remove(subscriber)
            if hub.subscribers:
                return
            del self.hubs[key]
        hub.listener.close(timeout)  # outside the lock: a join

    def count(self) -> int:
        with self.lock:
            return len(self.hubs)

    def forget(self) -> None:
        """In a forked child: the inherited hubs' threads are gone and their connections are
        the parent's; keep them referenced (closing one would end the parent's session)."""
        self.lock = threading.Lock()
        self.forgotten.extend(self.hubs.values())
        self.hubs = {}


_hubs = _Hubs()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_hubs.forget)


def shared_listeners() -> int:
    """How many shared LISTEN connections this process holds (for tests and status)."""
    return _hubs.count()


class SharedListener(PostgresListener):
    """A subscriber to the process's listener on its channel: the same ``start``, ``close``,
    ``connected`` and ``gave_up`` as a listener of its own (those two are the shared one's
    once started)."""

    def _key(self) -> _Key:
        return (self._conninfo, self._channel, self._check_pooler, self._connect_timeout)

    def inner(self, on_wake: Callable[[str | None], None]) -> PostgresListener:
        """A listener like this one passing every payload to ``on_wake`` (the hub's)."""
        return PostgresListener(
            connection_string=self._conninfo,
            channel=self._channel,
            environment=None,
            on_wake=on_wake,
            name=self._name,
            connect_timeout=self._connect_timeout,
            via=self._via,
            check_pooler=self._check_pooler,
        )

    def start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.current_thread()  # marks it started; nothing to join
        listener = _hubs.subscribe(self._key(), self)
        self.connected = listener.connected
        self.gave_up = listener.gave_up

    def close(self, timeout: float | None = None) -> None:
        self._stop.set()
        _hubs.unsubscribe(self._key(), self, timeout)

    def deliver(self, payload: str | None) -> None:
        """A payload of the channel (None: reconnected): this subscriber's environment's
        go to its callback, without the environment."""
        if self._stop.is_set():
            return
        if payload is None:
            self._on_wake(None)
            return
        prefix = f"{self._environment}|"
        if payload.startswith(prefix):
            self._on_wake(payload[len(prefix) :])
