"""The LISTEN side of wake-ups: one thread, one connection, reconnecting forever.

Notifications are hints. Triggers, due deliveries and hand-backs send ``environment|queue``
on the schema's channel; the listener passes the queue to a callback. After every
(re)connect it calls the callback with ``None`` ("something may have been missed"), because
notifications sent while it was away are lost. A quiet connection is probed now and then, so
a half-open one is noticed and replaced.

It says once, at INFO, where it LISTENs (``via``: the lane's connection string, or its
``listen_connection_string=`` straight to the primary). A LISTEN through a pooler in
transaction mode would hear nothing reliably (the server session changes hands after each
transaction): when the lane's own connection string turns out to go through one
(``check_pooler``, postgres/_pooler.py), the listener says so in one WARNING line and stops;
its owner polls (``gave_up``).
"""

from __future__ import annotations

import logging
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
        self.connected = threading.Event()  # set while LISTEN is active; for tests and status

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        self._stop.set()
        with self._lock:
            # under the lock: the thread closes its connection only after clearing _conn
            if self._conn is not None:
                shut_down(self._conn)  # ends a notifies() wait now
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
            if not through:
                conn.execute(sql.SQL("listen {}").format(sql.Identifier(self._channel)))
        except BaseException:
            conn.close()
            raise
        if through:
            conn.close()
            raise _ThroughPooler
        return conn

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
            self.connected.set()
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
                self._on_wake(None)  # whatever was sent while we were away is lost
                self._listen(conn)
            except psycopg.Error as exc:
                if not self._stop.is_set():
                    log.warning("runlane listener: connection lost (%s); reconnecting", exc)
            finally:
                self.connected.clear()
                with self._lock:
                    self._conn = None
                conn.close()

    def _listen(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        # environment None: every payload as it is (a shared listener's, _listen_hub.py)
        prefix = "" if self._environment is None else f"{self._environment}|"
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            for notify in conn.notifies(timeout=_WAIT_SLICE):
                quiet_since = time.monotonic()
                if notify.payload.startswith(prefix):
                    self._on_wake(notify.payload[len(prefix) :])
            if time.monotonic() - quiet_since >= _PROBE_EVERY and not self._stop.is_set():
                conn.execute("select 1")
                quiet_since = time.monotonic()
