"""Whether a lane's connections reach the primary directly or through a pooler in
transaction mode (PgBouncer ``pool_mode=transaction``, RDS Proxy, pgcat): then nothing that
lives on a server session may be relied on past the transaction that made it.

Through such a pooler runlane prepares no statement by name (psycopg's
``prepare_threshold=None``; the libpq path of ``_pq.py`` sends its statements unprepared),
sends no startup settings (the pooler refuses PostgreSQL's ``options``: a dedicated
connection's ``statement_timeout`` and asynchronous commits are left to the role's settings)
and no application name (see ``connect_options``), and does not LISTEN (a lane's
``listen_connection_string=`` sends LISTEN to the primary, ``listen=False`` polls only).
Every setting and advisory lock in ``sql/`` is already transaction-level
(``set_config(..., true)``, ``pg_advisory_xact_lock``), and the moved clock of tests is a
statement parameter (``_now.py``), so they need nothing here.

``pooler="auto"`` (the default) finds out on the first connection: a pooler answers the
startup with a cancel key of its own, so the backend process id the connection was given
is not the one ``pg_backend_pid()`` reports."""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg

__all__ = ["POOLERS", "Pooling", "behind_pooler", "pooler_refusal"]

log = logging.getLogger("runlane.postgres")

#: What a lane may be told of its connections: ``auto`` (find out), ``transaction``
#: (through a transaction-mode pooler), ``session`` (through a session-mode pooler, which
#: keeps sessions: as direct), ``none`` (straight to the primary).
POOLERS = ("auto", "transaction", "session", "none")


def pooler_refusal(exc: BaseException) -> str | None:
    """What a pooler's refusal means, for a message saying so (None for anything else):
    PgBouncer's ``query_wait_timeout`` (no server connection came free for the client's
    transaction, which therefore never began: worth no retry, the pooler waited already)
    and ``max_client_conn`` (it takes no more clients)."""
    text = str(exc)
    if "query_wait_timeout" in text:
        return (
            "had no server connection free for its query_wait_timeout, so nothing was "
            "written: raise its pool (PgBouncer's default_pool_size) within the server's "
            "max_connections, or make fewer calls at once"
        )
    if "max_client_conn" in text:
        return (
            "takes no more client connections (max_client_conn): raise it above the sum of "
            "every process's connections (pool_max_size, and per worker its claims, its "
            "writer and its slots), or lower pool_max_size"
        )
    return None


def behind_pooler(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn`` goes through a pooler: its server reports a process id other than
    the one the connection was told at startup."""
    row = conn.execute("select pg_backend_pid()", prepare=False).fetchone()
    return row is None or int(row[0]) != conn.info.backend_pid


class Pooling:
    """What a storage's connections go through: told, or learnt from the first connection
    (shared by a storage and its dedicated views). Thread-safe."""

    def __init__(self, pooler: str = "auto") -> None:
        if pooler not in POOLERS:
            raise ValueError(f"pooler must be one of {', '.join(POOLERS)}, got {pooler!r}")
        self._lock = threading.Lock()
        self._transaction: bool | None = None if pooler == "auto" else pooler == "transaction"

    @property
    def known(self) -> bool:
        return self._transaction is not None

    @property
    def transaction(self) -> bool:
        """True when session state must not outlive a transaction (unknown yet: True)."""
        return self._transaction is not False

    def learn(self, conn: psycopg.Connection[Any]) -> None:
        """Find out from ``conn`` whether the connections go through a transaction-mode
        pooler (only when ``auto`` and not known yet)."""
        if self._transaction is not None:
            return
        through = behind_pooler(conn)
        with self._lock:
            if self._transaction is None:
                self._transaction = through
                if through:
                    log.info(
                        "runlane: the database connection goes through a pooler: no named "
                        "prepared statements or session settings (pooler='transaction'; "
                        "pooler='session' or 'none' if it keeps sessions)"
                    )

    def connect_options(self, name: str) -> dict[str, Any]:
        """What ``psycopg.connect`` is given for this mode: ``name`` as the application name
        when direct; through a transaction pooler no statement prepared by name, and no
        application name (the pooler would send ``SET application_name`` before each
        transaction of a client whose name differs from its server connection's, which
        costs a statement and, in a pipeline, reached the client as its result)."""
        if self.transaction:
            return {"prepare_threshold": None}
        return {"application_name": name[:63]}
