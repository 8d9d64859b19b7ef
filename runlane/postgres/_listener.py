"""The LISTEN side of wake-ups: one thread, one connection, reconnecting forever.

Notifications are hints. Triggers, due deliveries and hand-backs send ``environment|queue``
on the schema's channel; the listener passes the queue to a callback. After every
(re)connect it calls the callback with ``None`` ("something may have been missed"), because
notifications sent while it was away are lost. A quiet connection is probed now and then, so
a half-open one is noticed and replaced.

The thread waits on the connection's socket and on a socket pair of its own, so ``poke()``
wakes it at once to bring its LISTENs up to date (``_sync``: a shared listener carries the
channels its subscribers need, postgres/_listen_hub.py).

It says once, at INFO, where it LISTENs (``via``: the lane's connection string, or its
``listen_connection_string=`` straight to the primary). A LISTEN through a pooler in
transaction mode would hear nothing reliably (the server session changes hands after each
transaction): when the lane's own connection string turns out to go through one
(``check_pooler``, postgres/_pooler.py), the listener says so in one WARNING line and stops;
its owner polls (``gave_up``).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg import sql

from runlane.postgres._connections import (
    DEFAULT_CONNECT_TIMEOUT,
    connect_timeout_option,
    describe_target,
)
from runlane.postgres._pooler import behind_pooler
from runlane.postgres._sockets import shut_down
from runlane.toolkit import Backoff

__all__ = ["PostgresListener"]

log = logging.getLogger("runlane.listener")

_PROBE_EVERY = 5.0  # seconds of silence before "select 1" checks the connection
_WAIT_SLICE = 1.0  # longest single wait; close() normally interrupts it sooner


class _ThroughPooler(Exception):
    """The LISTEN connection goes through a transaction-mode pooler."""


class PostgresListener:
    def __init__(
        self,
        *,
        connection_string: str,
        channel: str,
        environment: str | None,
        on_wake: Callable[[str | None], None],
        name: str,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        via: str = "the lane's connection string",
        check_pooler: bool = False,
    ) -> None:
        self._conninfo = connection_string
        self._via = via
        self._check_pooler = check_pooler
        self._announced = False
        self.gave_up = threading.Event()  # set when a pooler made LISTEN useless: poll only
        self._channel = channel
        self._environment = environment
        self._on_wake = on_wake
        self._name = name
        self._connect_timeout = connect_timeout
        self._stop = threading.Event()
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._poke_r: socket.socket | None = None
        self._poke_w: socket.socket | None = None
        self.connected = threading.Event()  # set while LISTEN is active; for tests and status

    def start(self) -> None:
        self._poke_r, self._poke_w = socket.socketpair()
        self._poke_r.setblocking(False)
        self._poke_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Wake the thread now (it brings its LISTENs up to date, ``_sync``)."""
        if self._poke_w is None:
            return
        # full (a wake-up is pending anyway) or closed with the thread: nothing to do
        with contextlib.suppress(OSError):
            self._poke_w.send(b"!")

    def close(self, timeout: float | None = None) -> None:
        self._stop.set()
        with self._lock:
            # under the lock: the thread closes its connection only after clearing _conn
            if self._conn is not None:
                shut_down(self._conn)  # ends a wait on its socket now
        self.poke()
        if self._thread is not None:
            self._thread.join(timeout)

    def _connect(self) -> psycopg.Connection[tuple[object, ...]]:
        conn = psycopg.connect(
            self._conninfo,
            autocommit=True,
            **connect_timeout_option(self._conninfo, self._connect_timeout),
            application_name=self._name[:63],
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=3,
        )
        try:
            through = self._check_pooler and behind_pooler(conn)
        except BaseException:
            conn.close()
            raise
        if through:
            conn.close()
            raise _ThroughPooler
        return conn

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            for end in (self._poke_r, self._poke_w):
                if end is not None:
                    end.close()

    def _loop(self) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            try:
                conn = self._connect()
            except _ThroughPooler:
                log.warning(
                    "runlane listener %s: %s goes through a connection pooler, where LISTEN "
                    "hears nothing reliably: polling only. Pass listen_connection_string= "
                    "(straight to the primary) to be woken at once, or listen=False",
                    self._name,
                    describe_target(self._conninfo),
                )
                self.gave_up.set()
                return
            except psycopg.Error as exc:
                if self._stop.is_set():  # closed while connecting: close gave up on the wait
                    log.debug("runlane listener: connect failed after close (%s)", exc)
                    return
                log.warning("runlane listener: connect failed (%s); retrying", exc)
                self._stop.wait(backoff.next())
                continue
            with self._lock:
                self._conn = conn
            backoff.reset()
            if not self._announced:
                self._announced = True
                log.info(
                    "runlane listener %s: LISTEN on %s (%s)",
                    self._name,
                    describe_target(self._conninfo),
                    self._via,
                )
            try:
                self._sync(conn, fresh=True)
                self._listen(conn)
            except (psycopg.Error, OSError) as exc:
                if not self._stop.is_set():
                    log.warning("runlane listener: connection lost (%s); reconnecting", exc)
            finally:
                self.connected.clear()
                self._lost()
                with self._lock:
                    self._conn = None
                conn.close()

    def _sync(self, conn: psycopg.Connection[tuple[object, ...]], fresh: bool) -> None:
        """Bring the connection's LISTENs up to date: here, LISTEN on the one channel once
        connected and say ``None`` (whatever was sent while we were away is lost)."""
        if fresh:
            conn.execute(sql.SQL("listen {}").format(sql.Identifier(self._channel)))
            self.connected.set()
            self._on_wake(None)

    def _deliver(self, channel: str, payload: str) -> None:
        """A notification: this listener's environment's go to its callback without it
        (environment None: every payload as it is)."""
        prefix = "" if self._environment is None else f"{self._environment}|"
        if payload.startswith(prefix):
            self._on_wake(payload[len(prefix) :])

    def _lost(self) -> None:
        """The connection is gone (its LISTENs with it)."""

    def _listen(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        assert self._poke_r is not None
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            # notifications read by the last statement, then what the socket holds now
            for notify in conn.notifies(timeout=0):
                quiet_since = time.monotonic()
                self._deliver(notify.channel, notify.payload)
            if self._stop.is_set():
                return
            poke = self._poke_r.fileno()
            ready, _, _ = select.select([conn.fileno(), poke], [], [], _WAIT_SLICE)
            if poke in ready:
                _drain(self._poke_r)
                self._sync(conn, fresh=False)
            elif not ready and time.monotonic() - quiet_since >= _PROBE_EVERY:
                conn.execute("select 1")
                quiet_since = time.monotonic()


def _drain(end: socket.socket) -> None:
    try:
        while end.recv(4096):
            pass
    except BlockingIOError:
        pass
