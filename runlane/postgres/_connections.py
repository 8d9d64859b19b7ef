"""Where the Postgres storage gets its connections: a shared pool, or one dedicated connection."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import psycopg
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

__all__ = ["Conn", "ConnectionSource", "DedicatedSource", "PoolSource"]

Conn = psycopg.Connection[TupleRow]


class ConnectionSource(Protocol):
    def open(self) -> None: ...

    def close(self) -> None: ...

    def connection(self) -> AbstractContextManager[Conn]: ...


class PoolSource:
    """A psycopg pool shared by every thread of a runtime (producers, reads, drain)."""

    def __init__(self, conninfo: str, *, min_size: int, max_size: int, name: str, timeout: float):
        self._timeout = timeout
        self._pool: ConnectionPool[Conn] = ConnectionPool(
            conninfo,
            min_size=min_size,
            max_size=max_size,
            open=False,
            name=name,
            kwargs={"autocommit": True, "application_name": name[:63]},
            timeout=timeout,
        )

    def open(self) -> None:
        self._pool.open(wait=True, timeout=self._timeout)

    def close(self) -> None:
        self._pool.close()

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        with self._pool.connection() as conn:
            yield conn


class DedicatedSource:
    """One connection owned by one thread (a worker slot, the lifecycle writer).

    Opened on first use and again after it breaks, so a server restart costs one failed
    statement, not the owner.
    """

    def __init__(
        self, conninfo: str, *, timeout: float, name: str, synchronous_commit: bool = True
    ) -> None:
        self._conninfo = conninfo
        self._timeout = timeout
        self._name = name
        self._options: dict[str, Any] = (
            {} if synchronous_commit else {"options": "-c synchronous_commit=off"}
        )
        self._lock = threading.Lock()
        self._conn: Conn | None = None
        self._closed = False

    def open(self) -> None:
        """Connections open lazily; nothing to do."""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        with self._lock:
            if self._closed:
                raise psycopg.OperationalError(f"{self._name}: connection source closed")
            conn = self._conn
            if conn is None or conn.closed or conn.broken:
                if conn is not None:
                    conn.close()
                conn = self._conn = psycopg.connect(
                    self._conninfo,
                    autocommit=True,
                    connect_timeout=max(1, int(self._timeout)),
                    application_name=self._name[:63],
                    **self._options,
                )
        try:
            yield conn
        except psycopg.OperationalError:
            if conn.broken:
                with self._lock:
                    if self._conn is conn:
                        self._conn = None
                conn.close()
            raise
