"""One LISTEN connection per process and server, carrying every channel its listeners need.

Every runtime, worker, publisher and ``wait_for_run`` of a process that listens on the same
server (the same connection string, pooler check and connect timeout) subscribes to one
connection (a ``_HubListener``) started by the first and closed with the last
(``SharedListener``). The connection LISTENs on each channel some active subscriber needs,
and UNLISTENs a channel once its last subscriber left or paused (``pause()``: a run-end
watcher with nobody waiting). Notifications go to the subscribers of their channel, each
with its own environment filter and callback. A subscriber is told ``None`` ("something may
have been missed") once its channel is LISTENed (after every reconnect, and when it joins
or resumes on a channel already LISTENed, as if it had just connected itself); its
``connected`` is set while its channel is. The shared connection and its thread are named
after the first subscriber, and after another once that one leaves (a closed worker leaves
no thread or backend named after it).

A forked child inherits the parent's listeners but not their threads: it forgets them (their
connections are the parent's: they are kept, never closed, so the parent's sessions are left
alone) and its first subscriber starts a listener of its own.
"""

from __future__ import annotations

import logging
import os
import threading

import psycopg
from psycopg import sql

from runlane.postgres._listener import PostgresListener

__all__ = ["SharedListener", "shared_listeners"]

log = logging.getLogger("runlane.listener")

# a hub's server: (connection string, pooler check, connect timeout), what its listener uses
_Key = tuple[str, bool, float]


class _Hub:
    """One server's LISTEN connection and its subscribers, by channel."""

    def __init__(self, key: _Key, first: SharedListener) -> None:
        self.lock = threading.Lock()
        self.members: list[SharedListener] = []
        self.channels: dict[str, list[SharedListener]] = {}  # the active subscribers
        self.listened: set[str] = set()  # LISTENed on the current connection
        self.listener = _HubListener(self, key, first)
        self.named_by = first

    def activate(self, subscriber: SharedListener) -> None:
        with self.lock:
            subscribers = self.channels.setdefault(subscriber.channel, [])
            if subscriber in subscribers:
                return
            subscribers.append(subscriber)
            listened = subscriber.channel in self.listened
            if listened:
                subscriber.connected.set()
        if listened:
            subscriber.deliver(None)
        else:
            self.listener.poke()

    def deactivate(self, subscriber: SharedListener) -> None:
        with self.lock:
            subscribers = self.channels.get(subscriber.channel, [])
            if subscriber not in subscribers:
                return
            subscribers.remove(subscriber)
            subscriber.connected.clear()
            if subscribers:
                return
            del self.channels[subscriber.channel]
        self.listener.poke()  # to UNLISTEN it

    def sync(self, conn: psycopg.Connection[tuple[object, ...]], fresh: bool) -> None:
        """LISTEN the channels active subscribers need, UNLISTEN the others. A channel is
        marked unlistened before its UNLISTEN and listened after its LISTEN, so a
        subscriber is never told it hears a channel the connection does not."""
        with self.lock:
            if fresh:
                self.listened = set()
            drop = sorted(self.listened - self.channels.keys())
            self.listened.difference_update(drop)
            add = sorted(self.channels.keys() - self.listened)
        for channel in drop:
            conn.execute(sql.SQL("unlisten {}").format(sql.Identifier(channel)))
        for channel in add:
            conn.execute(sql.SQL("listen {}").format(sql.Identifier(channel)))
            with self.lock:
                self.listened.add(channel)
                told = list(self.channels.get(channel, ()))
                for subscriber in told:
                    subscriber.connected.set()
            for subscriber in told:
                subscriber.deliver(None)  # whatever was sent before is lost to it

    def dispatch(self, channel: str, payload: str) -> None:
        with self.lock:
            subscribers = list(self.channels.get(channel, ()))
        for subscriber in subscribers:
            subscriber.deliver(payload)

    def lost(self) -> None:
        with self.lock:
            self.listened = set()
            for group in self.channels.values():
                for subscriber in group:
                    subscriber.connected.clear()


class _HubListener(PostgresListener):
    """The shared connection: LISTENs what its hub's subscribers need."""

    def __init__(self, hub: _Hub, key: _Key, first: SharedListener) -> None:
        conninfo, check_pooler, connect_timeout = key
        super().__init__(
            connection_string=conninfo,
            channel="",
            environment=None,
            on_wake=lambda payload: None,
            name=first.name,
            connect_timeout=connect_timeout,
            via=first.via,
            check_pooler=check_pooler,
        )
        self._hub = hub
        self._renamed = False

    def rename(self, name: str) -> None:
        """Take the name of another subscriber (the one it had left): the thread now, the
        connection's application_name at the next sync."""
        with self._lock:
            self._name = name
            self._renamed = True
            if self._thread is not None:
                self._thread.name = name
        self.poke()

    def _sync(self, conn: psycopg.Connection[tuple[object, ...]], fresh: bool) -> None:
        with self._lock:
            renamed, self._renamed = self._renamed and not fresh, False
            name = self._name
        if renamed:
            conn.execute(
                "select pg_catalog.set_config('application_name', %s, false)", (name[:63],)
            )
        self._hub.sync(conn, fresh)
        self.connected.set()

    def _deliver(self, channel: str, payload: str) -> None:
        self._hub.dispatch(channel, payload)

    def _lost(self) -> None:
        self._hub.lost()


class _Hubs:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hubs: dict[_Key, _Hub] = {}
        self.forgotten: list[_Hub] = []  # a forked child's inherited hubs, never closed

    def join(self, key: _Key, subscriber: SharedListener) -> _Hub:
        with self.lock:
            hub = self.hubs.get(key)
            fresh = hub is None
            if hub is None:
                hub = self.hubs[key] = _Hub(key, subscriber)
            hub.members.append(subscriber)
            if fresh:
                hub.listener.start()
        return hub

    def leave(self, key: _Key, subscriber: SharedListener, timeout: float | None) -> None:
        with self.lock:
            hub = self.hubs.get(key)
            if hub is None or subscriber not in hub.members:
                return
            hub.members.remove(subscriber)
            if hub.members:
                if hub.named_by is subscriber:  # its name goes with it (threads, backends)
                    hub.named_by = hub.members[0]
                    hub.listener.rename(hub.named_by.name)
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
    """A subscriber to the process's LISTEN connection to its server, on its channel: the
    same ``start``, ``close``, ``connected`` and ``gave_up`` as a listener of its own
    (``connected``: while its channel is LISTENed; ``gave_up``: the shared connection's)."""

    _hub: _Hub | None = None

    @property
    def channel(self) -> str:
        return self._channel

    @property
    def name(self) -> str:
        return self._name

    @property
    def via(self) -> str:
        return self._via

    def _key(self) -> _Key:
        return (self._conninfo, self._check_pooler, self._connect_timeout)

    def start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.current_thread()  # marks it started; nothing to join
        hub = self._hub = _hubs.join(self._key(), self)
        self.gave_up = hub.listener.gave_up
        hub.activate(self)

    def pause(self) -> None:
        """Stop hearing the channel for now (UNLISTENed once no other subscriber needs it);
        the shared connection stays."""
        if self._hub is not None:
            self._hub.deactivate(self)

    def resume(self) -> None:
        """Hear the channel again after ``pause()``; told ``None`` once it is LISTENed."""
        if self._hub is not None and not self._stop.is_set():
            self._hub.activate(self)

    def close(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._hub is not None:
            self._hub.deactivate(self)
        _hubs.leave(self._key(), self, timeout)

    def deliver(self, payload: str | None) -> None:
        """A payload of the channel (None: LISTENed anew): this subscriber's environment's
        go to its callback, without the environment."""
        if self._stop.is_set():
            return
        try:
            if payload is None:
                self._on_wake(None)
            else:
                self._deliver(self._channel, payload)
        except Exception:
            # one subscriber's failure must not end the thread every other one listens on
            log.exception(
                "runlane: %s failed on a notification; the others still listen", self._name
            )
