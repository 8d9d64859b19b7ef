"""Where the Postgres storage gets its connections (a shared pool, or one dedicated
connection), and the one place where driver errors become runlane errors."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import psycopg
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from runlane.errors import ConfigurationError, RunlaneClosed, RunlaneError, StorageUnavailable
from runlane.postgres import _pool_log  # noqa: F401 - files psycopg.pool's records of runlane's pools
from runlane.postgres._connect_errors import connect_cause, establishing, waiting_helps
from runlane.postgres._pooler import Pooling, pooler_refusal
from runlane.postgres._sockets import dup_socket, shut_down_socket
from runlane.toolkit import shown

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "Conn",
    "ConnectionSource",
    "DedicatedSource",
    "PoolExhausted",
    "PoolSource",
    "StatementInterrupted",
    "check_conninfo",
    "connect_seconds",
    "connect_timeout_option",
    "connection_failed",
    "connection_lost",
    "describe_target",
    "own_transaction",
    "storage_error",
]

log = logging.getLogger("runlane.postgres")

Conn = psycopg.Connection[TupleRow]

# TCP keepalives for connections held for a long time (as the listener's): a half-open
# connection is noticed after about keepalives_idle + interval * count seconds of silence
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}
# how long a new connection may take (seconds), unless the lane or the connection string
# says otherwise: a wrong address fails within it, with one line naming the cause
DEFAULT_CONNECT_TIMEOUT = 5.0
# unacknowledged data older than this breaks the connection (libpq 12+, Linux)
_TCP_USER_TIMEOUT_MS = 20_000
# what a pool close gives its threads when its caller sets no timeout (psycopg_pool's default)
_POOL_CLOSE_SECONDS = 5.0
# the pool's connection-making threads (psycopg_pool's default); with its scheduler, the
# threads its close joins one after the other, each with the timeout it is given
_POOL_WORKERS = 3
# a pooled connection unused this long is closed, one every this many seconds, down to the
# pool's min_size: a burst's connections do not stay open while the process idles
_POOL_MAX_IDLE = 15.0
# how long interrupt() waits for a cancel request (a connection of its own, which a stalled
# server never answers) before it shuts the connection's socket down under the blocked call
_CANCEL_SECONDS = 0.25


def own_transaction(conn: psycopg.Connection[Any]) -> AbstractContextManager[object]:
    """A transaction of its own on an idle autocommit connection; else nothing: the
    caller's transaction (a fenced maintenance write's), which the caller ends."""
    own = conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE
    return conn.transaction() if own else contextlib.nullcontext()


def check_conninfo(connection_string: object) -> dict[str, Any]:
    """The parsed connection string; :class:`ConfigurationError` when it is not one.

    The message never repeats the string (it may hold a password), nor libpq's complaint
    (which quotes it)."""
    if not isinstance(connection_string, str) or not connection_string.strip():
        raise ConfigurationError(
            "the connection string is empty: pass a PostgreSQL URI such as "
            "postgresql://user@host:5432/dbname, or key=value pairs such as "
            "'host=... port=5432 dbname=...'"
        )
    params: dict[str, Any] | None = None
    # raised below, outside any handler: libpq's message, chained, would quote the string
    with contextlib.suppress(psycopg.Error):
        params = conninfo_to_dict(connection_string)
    if params is None:
        raise ConfigurationError(
            "the connection string is not a valid PostgreSQL connection string (libpq could "
            "not parse it; it is not repeated here because it may hold a password): pass a URI "
            "such as postgresql://user@host:5432/dbname, or key=value pairs such as "
            "'host=... port=5432 dbname=...'"
        )
    port = params.get("port")
    if port is not None and not all(p.strip().isdigit() for p in str(port).split(",") if p):
        raise ConfigurationError(
            f"the connection string's port {shown(port)} is not a number: use e.g. port=5432"
        )
    return params


def describe_target(connection_string: str) -> str:
    """``host:port`` of a connection string (never its password), for error messages."""
    try:
        params = conninfo_to_dict(connection_string)
    except psycopg.Error:
        return "the configured server"
    host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    return f"{host}:{port}"


def connection_failed(exc: BaseException) -> bool:
    """A failure of the connection (refused, timed out, broken, cancelled), not a statement
    error: these become :class:`StorageUnavailable` once retries are spent."""
    if isinstance(exc, psycopg_pool.PoolTimeout | psycopg_pool.PoolClosed):
        return True
    if isinstance(exc, psycopg_pool.TooManyRequests | psycopg.errors.QueryCanceled):
        return True
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return False
    if isinstance(exc, psycopg.OperationalError):
        return exc.sqlstate is None or exc.sqlstate.startswith(("08", "57P"))
    return False


def connection_lost(exc: psycopg.OperationalError) -> bool:
    """A failure of the connection itself, worth repeating the statement on a new one: not
    a cancelled statement (close() interrupted it, or statement_timeout), and not a pool
    that already waited its whole timeout for a connection."""
    if isinstance(
        exc,
        psycopg.errors.QueryCanceled
        | StatementInterrupted
        | psycopg.errors.LockNotAvailable
        | psycopg_pool.PoolTimeout
        | psycopg_pool.PoolClosed
        | psycopg_pool.TooManyRequests,
    ):
        return False
    if pooler_refusal(exc) is not None:  # the pooler waited already, or takes no more
        return False
    return exc.sqlstate is None or exc.sqlstate.startswith(("08", "57P"))


# a password at least this long is masked wherever it stands in a message
_BARE_MASK_LENGTH = 8


def _scrubbed(text: str, connection_string: str) -> str:
    """``text`` without the connection string's password: masked where a connection string
    is echoed (``password=...``, ``user:...@``), and anywhere only when it is long enough not
    to be part of ordinary words (a password "a" masked everywhere garbled every message and
    showed where its letter stood)."""
    try:
        password = conninfo_to_dict(connection_string).get("password")
    except psycopg.Error:
        return "(detail withheld)"
    if not password:
        return text
    secret = re.escape(str(password))
    text = re.sub(rf"(password\s*=\s*'?){secret}|(:){secret}(?=@)", r"\1\2***", text)
    if len(str(password)) >= _BARE_MASK_LENGTH:
        text = text.replace(str(password), "***")
    return text


def storage_error(
    exc: psycopg.Error,
    connection_string: str,
    what: str,
    *,
    connect_timeout: float | None = None,
) -> RunlaneError:
    """The runlane error a driver error becomes at the storage boundary (raise it ``from``
    the driver error). A connection that could not be made says why, in one sentence
    (:mod:`runlane.postgres._connect_errors`)."""
    detail = _scrubbed(str(exc).strip() or type(exc).__name__, connection_string)
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return _cancelled(exc, detail, what)
    if isinstance(exc, PoolExhausted):
        return StorageUnavailable(f"runlane could not {what}: {exc}", transient=True)
    refusal = pooler_refusal(exc)
    if refusal is not None:
        target = describe_target(connection_string)
        said = f"the connection pooler at {target} {refusal}"
        return StorageUnavailable(f"runlane could not {what}: {said}", transient=True)
    if isinstance(exc, psycopg.OperationalError) and establishing(exc):
        timeout = _conninfo_timeout(connection_string, connect_timeout)
        cause = connect_cause(exc, describe_target(connection_string), timeout)
        if cause is not None:
            said = _scrubbed(cause, connection_string)
            return StorageUnavailable(
                f"runlane could not {what}: {said}", transient=waiting_helps(exc)
            )
    if connection_failed(exc):
        target = describe_target(connection_string)
        cause = f"{type(exc).__name__}: {detail}"
        return StorageUnavailable(
            f"runlane could not {what}: the database at {target} is unavailable ({cause}). "
            f"Is PostgreSQL running at {target} and reachable from here? Check the "
            "connection string, the firewall, and max_connections",
            transient=waiting_helps(exc),
        )
    return RunlaneError(
        f"unexpected database error while trying to {what} ({type(exc).__name__}: {detail})"
    )


def _conninfo_timeout(connection_string: str, configured: float | None) -> float:
    """The connect timeout a connection waited: the connection string's connect_timeout
    (it wins over the lane's), else the configured one, else the default."""
    fallback = DEFAULT_CONNECT_TIMEOUT if configured is None else configured
    try:
        given = conninfo_to_dict(connection_string).get("connect_timeout")
        return float(given) if given is not None else fallback
    except (psycopg.Error, ValueError):
        return fallback


def _cancelled(exc: psycopg.errors.QueryCanceled, detail: str, what: str) -> StorageUnavailable:
    """A statement the database cancelled (SQLSTATE 57014): it answered, so it is up; what
    stopped the statement was a statement_timeout or a cancel request."""
    # the server's message is in English unless lc_messages says otherwise
    if "statement timeout" in (exc.diag.message_primary or ""):
        return StorageUnavailable(
            f"runlane could not {what}: the statement ran past the connection's "
            f"statement_timeout and the database cancelled it ({detail}); the database is up. "
            "Raise statement_timeout for this work (SET LOCAL statement_timeout = ... in the "
            "caller's transaction, or on the role), or find what holds it up (locks, load)"
        )
    return StorageUnavailable(
        f"runlane could not {what}: the database cancelled the statement ({detail}); the "
        "database is up. A statement_timeout, or a cancel request (pg_cancel_backend, a "
        "driver's cancel), stopped it: check what cancels statements on this connection"
    )


def connect_seconds(timeout: float) -> int:
    """libpq's connect_timeout (whole seconds, at least 1) for a timeout in seconds."""
    return max(1, round(timeout))


def connect_timeout_option(conninfo: str, timeout: float) -> dict[str, Any]:
    """``connect_timeout`` for ``psycopg.connect``: the configured one, unless the
    connection string sets its own (which wins, as the docs say)."""
    if "connect_timeout" in conninfo_to_dict(conninfo):
        return {}
    return {"connect_timeout": connect_seconds(timeout)}


class PoolExhausted(psycopg_pool.PoolTimeout):
    """Every connection of a pool was in use for the whole wait (the database is up)."""


class StatementInterrupted(psycopg.OperationalError):
    """A statement that ``interrupt()`` ended by shutting its connection's socket down (the
    server did not take a cancel request in time): a failure of the connection, but not one
    to repeat on a new connection, as a cancelled statement is not."""


class ConnectionSource(Protocol):
    def open(self) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...

    def connection(self) -> AbstractContextManager[Conn]: ...

    def interrupt(self) -> None: ...


class PoolSource:
    """A psycopg pool shared by every thread of a runtime (producers, reads, drain).

    A pool that failed to open, or that could not hand out a connection within its timeout
    (the database is down), is thrown away: the next use builds a fresh one, which connects
    at once when the database is back. A failed first use therefore does not poison the
    runtime, and recovery after an outage does not wait out the pool's reconnect backoff."""

    def __init__(
        self,
        conninfo: str,
        *,
        min_size: int,
        max_size: int,
        name: str,
        timeout: float,
        pooling: Pooling | None = None,
    ):
        self._conninfo = conninfo
        self._pooling = pooling or Pooling()
        self._min_size = min_size
        self._max_size = max_size
        self._name = name
        self._timeout = timeout
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Conn] | None = None
        self._closed = False
        self._building = threading.Lock()
        self._sweeping = threading.Lock()
        self._lent: dict[int, int] = {}  # connections out with callers, by pool (id)

    def open(self) -> None:
        self._current()

    def _current(self) -> ConnectionPool[Conn]:
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._pool is not None:
                return self._pool
        # one build at a time, without the state lock: a build waits up to twice the connect
        # timeout for a server that does not answer, and close() must not wait behind it
        with self._building:
            with self._lock:
                if self._closed:
                    raise self._closed_error()
                if self._pool is not None:
                    return self._pool
            pool = self._build()
            with self._lock:
                if not self._closed:
                    self._pool = pool
                    return pool
            pool.close(timeout=0)  # closed while it was being built
            raise self._closed_error()

    def _build(self) -> ConnectionPool[Conn]:
        kwargs: dict[str, Any] = {
            "autocommit": True,
            "application_name": self._name[:63],
            **connect_timeout_option(self._conninfo, self._timeout),
        }
        # one connection first, made here: a wrong host, port, password or database fails
        # within the connect timeout with libpq's own reason (the pool would retry it in
        # its thread, logging each try, until its timeout, and report only the timeout);
        # it also tells whether the connections go through a pooler (_pooler.py)
        with psycopg.connect(self._conninfo, **kwargs) as probe:
            self._pooling.learn(probe)
        del kwargs["application_name"]
        kwargs.update(self._pooling.connect_options(self._name))
        pool: ConnectionPool[Conn] = ConnectionPool(
            self._conninfo,
            min_size=self._min_size,
            max_size=self._max_size,
            open=False,
            name=self._name,
            kwargs=kwargs,
            timeout=self._timeout,
            num_workers=_POOL_WORKERS,
            max_idle=_POOL_MAX_IDLE,
        )
        try:
            pool.open(wait=True, timeout=self._timeout)
        except BaseException:
            pool.close(timeout=0)  # its threads end with their connect attempts
            raise
        return pool

    def _closed_error(self) -> psycopg_pool.PoolClosed:
        return psycopg_pool.PoolClosed(f"the pool {self._name!r} was closed")

    def _discard(self, pool: ConnectionPool[Conn]) -> None:
        with self._lock:
            if self._pool is not pool:
                return
            self._pool = None
        # connections in use stay usable until returned; waiters fail with PoolClosed
        pool.close(timeout=0)

    def close(self, timeout: float | None = None) -> None:
        """Close the pool; its threads get ``timeout`` seconds in all to end (None: the
        pool's own 5 s each), after which it is closed anyway. A pool being built meanwhile
        is closed by its builder when the build ends; close does not wait for it."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is None:
            return
        if timeout is None:
            pool.close(timeout=_POOL_CLOSE_SECONDS)
        else:
            # psycopg_pool joins its threads one after the other, each with the whole
            # timeout: its scheduler and workers share this close's timeout instead
            pool.close(timeout=timeout / (_POOL_WORKERS + 1))

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        """A pooled connection for the block. getconn/putconn rather than the pool's
        ``connection()``: its ``with conn`` commits or rolls back at the end, which on these
        autocommit connections does nothing but costs a lock and a wait per use; a
        connection handed back mid-transaction is rolled back by ``putconn``."""
        pool = self._current()
        try:
            conn = pool.getconn()
        except psycopg_pool.PoolTimeout as exc:  # only acquiring raises it
            with self._lock:
                lent = self._lent.get(id(pool), 0)
            # every connection was lent to a caller all along: the pool is fine, only busy;
            # otherwise its connections are being made again (an outage just ended) and a
            # fresh pool connects at once instead of waiting out the pool's reconnect backoff
            if lent >= self._max_size:
                raise PoolExhausted(
                    f"all {self._max_size} connections of its pool {self._name!r} were in use "
                    f"for {self._timeout:g}s (connect_timeout), and none came free; nothing "
                    "was written. Raise pool_max_size (and the pooler's or the server's "
                    "connection budget), or make fewer calls at once"
                ) from exc
            self._discard(pool)
            raise
        with self._lock:
            self._lent[id(pool)] = self._lent.get(id(pool), 0) + 1
        try:
            yield conn
        except psycopg.OperationalError as exc:
            if connection_lost(exc):
                self._sweep(pool)
            raise
        finally:
            with self._lock:
                left = self._lent.pop(id(pool)) - 1
                if left:
                    self._lent[id(pool)] = left
            pool.putconn(conn)

    def _sweep(self, pool: ConnectionPool[Conn]) -> None:
        """A pooled connection broke (server restart, ``pg_terminate_backend``): the idle
        ones very likely broke with it, and the pool does not test connections it hands out.
        Test them now (one empty statement each) and replace the dead ones, so the caller's
        retry gets a live connection instead of the next dead one. One sweep at a time."""
        if not self._sweeping.acquire(blocking=False):
            return
        try:
            pool.check()
        except Exception:  # best effort: the retry reports what still fails
            log.debug("%s: checking the pooled connections failed", self._name, exc_info=True)
        finally:
            self._sweeping.release()

    def interrupt(self) -> None:
        """Pooled connections are shared: nothing to interrupt."""


class DedicatedSource:
    """One connection owned by one thread (a worker slot, the lifecycle writer).

    Opened on first use and again after it breaks, so a server restart costs one failed
    statement, not the owner. TCP keepalives, ``tcp_user_timeout`` and ``statement_timeout``
    make a half-open connection or a statement blocked for too long fail instead of hanging;
    ``interrupt()`` cancels the statement in flight from another thread.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        timeout: float,
        name: str,
        synchronous_commit: bool = True,
        statement_timeout: float | None = 60.0,
        pooling: Pooling | None = None,
    ) -> None:
        self._conninfo = conninfo
        self._pooling = pooling or Pooling()
        self._timeout = timeout
        self._name = name
        settings = []
        if not synchronous_commit:
            settings.append("-c synchronous_commit=off")
        if statement_timeout is not None:
            settings.append(f"-c statement_timeout={max(1, round(statement_timeout * 1000))}")
        self._options: dict[str, Any] = dict(KEEPALIVES)
        if psycopg.pq.version() >= 120000:
            self._options["tcp_user_timeout"] = _TCP_USER_TIMEOUT_MS
        if settings:
            self._options["options"] = " ".join(settings)
        self._lock = threading.Lock()
        self._conn: Conn | None = None
        self._busy = False
        self._shut: Conn | None = None  # the connection interrupt() shut down under a call
        self._closed = False

    def open(self) -> None:
        """Connections open lazily; nothing to do."""

    def close(self, timeout: float | None = None) -> None:
        """Close the connection (nothing to wait for: ``timeout`` is not needed)."""
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def interrupt(self) -> None:
        """End the statement in flight on this connection, if any (from another thread),
        within about a quarter of a second: a cancel request first (the statement fails with
        QueryCanceled); when the server does not take it in time (it does not answer), the
        connection's socket is shut down under the blocked call, which then fails as a lost
        connection. Errors of the cancel itself are ignored. A connection still being made
        is not interrupted (the connect timeout ends it)."""
        with self._lock:
            conn = self._conn if self._busy else None
            # a duplicate of its socket, taken while the connection is surely open: the
            # owner closes it only after clearing _conn under this lock
            sock = dup_socket(conn) if conn is not None else None
        if conn is None or sock is None:
            return
        with sock:
            try:
                conn.cancel_safe(timeout=min(self._timeout, _CANCEL_SECONDS))
            except Exception:  # best effort: the statement may have ended meanwhile
                log.debug("%s: the cancel request failed", self._name, exc_info=True)
            else:
                return
            with self._lock:
                still = self._busy and self._conn is conn
                if still:
                    self._shut = conn
            if still:
                log.debug("%s: the cancel was not taken in time; shutting the socket", self._name)
                shut_down_socket(sock)

    def _connect(self) -> Conn:
        """A new connection; through a transaction pooler without startup settings (which
        the pooler refuses, and which would not last past a transaction), application name
        or prepared statements (_pooler.py). Unknown yet: a plain connection tells first."""
        plain = {k: v for k, v in self._options.items() if k != "options"}
        common = {"autocommit": True, **connect_timeout_option(self._conninfo, self._timeout)}
        if not self._pooling.known:
            with psycopg.connect(self._conninfo, **common, **plain) as probe:
                self._pooling.learn(probe)
        mode = self._pooling.connect_options(self._name)
        options = plain if self._pooling.transaction else self._options
        return psycopg.connect(self._conninfo, **common, **mode, **options)

    def _closed_error(self) -> RunlaneClosed:
        return RunlaneClosed(
            f"{self._name}: this storage view was closed; its owner (a worker slot or a "
            "writer) has shut down"
        )

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        with self._lock:
            if self._closed:
                raise self._closed_error()
            conn = self._conn
            stale = conn is not None and (conn.closed or conn.broken)
            if stale:
                self._conn = None
        if stale and conn is not None:
            conn.close()
        if conn is None or stale:
            conn = self._connect()  # outside the lock: close() and interrupt() do not wait
        with self._lock:
            if self._closed:
                conn.close()
                raise self._closed_error()
            self._conn = conn
            self._busy = True
        try:
            yield conn
        except psycopg.OperationalError as exc:
            with self._lock:
                shut = self._shut is conn
                if conn.broken and self._conn is conn:
                    self._conn = None
            if conn.broken:
                conn.close()
            if shut:
                raise StatementInterrupted(
                    f"{self._name}: the statement was interrupted (the server did not answer "
                    "a cancel request in time)"
                ) from exc
            raise
        finally:
            with self._lock:
                self._busy = False
                self._shut = None
