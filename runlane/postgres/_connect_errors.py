"""Why a connection could not be made, said precisely: libpq's message for a connection that
failed while it was being established, read for its cause (a host name that does not resolve,
nothing listening, no answer, a refused password, a missing database or role, ...), and the
one sentence that names the cause and the fix.

The server's messages are read in English (its ``lc_messages``); anything not recognised
falls back to the generic "unavailable" message of :mod:`runlane.postgres._connections`.
"""

from __future__ import annotations

import re

import psycopg

__all__ = ["connect_cause", "establishing", "waiting_helps"]

# psycopg's prefixes for an error raised while a connection was being made
_ESTABLISHING = ("connection failed:", "connection is bad:", "failed to resolve host")


def establishing(exc: BaseException) -> bool:
    """Whether ``exc`` failed to make a connection (as opposed to a statement failing, or a
    connection breaking later)."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    text = str(exc)
    return text.startswith(_ESTABLISHING) or "timeout expired" in text


# a host name that does not resolve (psycopg's words, then libpq's)
_UNRESOLVED = (
    r"failed to resolve host '(?P<host>[^']+)'|could not translate host name "
    r'"(?P<name>[^"]+)"'
)

# (pattern searched in libpq's message, case-insensitive; the sentence, formatted with the
# pattern's named groups, ``target`` and ``timeout``), the first match wins
_CAUSES: tuple[tuple[str, str], ...] = (
    (
        _UNRESOLVED,
        "the host name {host_or_name!r} does not resolve (DNS): check the host in the "
        "connection string",
    ),
    (
        r'password authentication failed for user "(?P<user>[^"]+)"',
        "the server at {target} refused the password of user {user!r}: check the user name "
        "and password in the connection string",
    ),
    (
        r"no password supplied|fe_sendauth",
        "the server at {target} asks for a password and none was given: add it to the "
        "connection string (or to ~/.pgpass, or PGPASSWORD)",
    ),
    (
        r'database "(?P<database>[^"]+)" does not exist',
        "the server at {target} has no database {database!r}: create it (createdb "
        "{database}, or CREATE DATABASE), or fix the database name in the connection string",
    ),
    (
        r'role "(?P<role>[^"]+)" does not exist',
        "the server at {target} has no role (user) {role!r}: fix the user name in the "
        "connection string, or create the role",
    ),
    (
        r"no pg_hba\.conf entry",
        "the server at {target} does not allow this connection (no pg_hba.conf entry for this "
        "host, user and database): ask its administrator, or check the user and database",
    ),
    (
        r'too many connections for role "(?P<limited>[^"]+)"',
        "the server at {target} refuses more connections of role {limited!r} (its "
        "CONNECTION LIMIT is reached): close idle clients, lower pool_max_size, or raise "
        "the role's limit (ALTER ROLE ... CONNECTION LIMIT)",
    ),
    (
        r"too many clients|remaining connection slots are reserved",
        "the server at {target} has no free connection slot (max_connections reached): close "
        "idle clients, lower pool_max_size, or raise max_connections",
    ),
    (
        r"the database system is starting up",
        "the server at {target} is still starting up: try again in a moment",
    ),
    (
        r"the database system is shutting down|in recovery mode",
        "the server at {target} is shutting down or recovering: try again once it is up",
    ),
    (
        r"connection refused",
        "nothing accepts connections at {target} (connection refused): is PostgreSQL running "
        "there, on that port?",
    ),
    (
        r'socket "(?P<socket>[^"]+)" failed: no such file or directory',
        "there is no PostgreSQL socket at {socket}: is the server running (for the "
        "development database: runlane dev-db status)?",
    ),
    (
        r"timeout expired|timed out",
        "no answer from {target} within the connect timeout ({timeout:g} s): a wrong "
        "address, a firewall dropping the packets, or a server too busy to answer "
        "(connect_timeout= on the lane sets the wait)",
    ),
    (
        r"failed: (?P<detail>.*ssl.*)",
        "the TLS negotiation with {target} failed ({detail}): is it a PostgreSQL server, and "
        "does sslmode in the connection string match what it offers?",
    ),
)


def connect_cause(exc: psycopg.OperationalError, target: str, timeout: float) -> str | None:
    """The cause of a failed connection to ``target`` (host:port or a socket) and its fix, in
    one sentence; None when the message is not one this knows."""
    text = " ".join(str(exc).split())
    for pattern, sentence in _CAUSES:
        found = re.search(pattern, text, re.IGNORECASE)
        if found is None:
            continue
        groups = {k: v for k, v in found.groupdict().items() if v is not None}
        host_or_name = groups.get("host") or groups.get("name") or target
        return sentence.format(target=target, timeout=timeout, host_or_name=host_or_name, **groups)
    return None


# SQLSTATEs of a server that is there but not serving now: cannot_connect_now (starting up,
# shutting down, in recovery), too_many_connections, admin_shutdown, crash_shutdown
_TRANSIENT_SQLSTATES = frozenset({"57P03", "53300", "57P01", "57P02"})
# ... and of errors no wait fixes: a refused password or login, a missing database
_PERMANENT_SQLSTATES = frozenset({"28P01", "28000", "3D000"})
# libpq's words (the server's, in English) for a server that is restarting, starting up,
# refusing connections or out of slots, or a connection it dropped on the way down
_TRANSIENT_MESSAGES = re.compile(
    r'connection refused|\.s\.PGSQL\.\d+" failed: no such file or directory'
    r"|the database system is starting up"
    r"|the database system is shutting down|in recovery mode|not yet accepting connections"
    r"|too many clients|remaining connection slots are reserved|too many connections for role"
    r"|server closed the connection unexpectedly|terminating connection due to administrator"
    r"|connection reset by peer|broken pipe|could not receive data from server"
    r"|could not send data to server|ssl connection has been closed unexpectedly"
    r"|eof detected|timeout expired|timed out|pool initialization incomplete"
    r"|couldn't get a connection",
    re.IGNORECASE,
)


def waiting_helps(exc: psycopg.Error) -> bool:
    """Whether waiting may fix ``exc``, a driver error at the storage boundary: True for a
    server that is restarting, starting up, shutting down, refusing connections (nothing
    listens, no socket), out of connection slots, too slow to answer, or that dropped the
    connection; False for what no wait fixes (a host name that does not resolve, a refused
    password or login, a missing database or role, a TLS mismatch) and for anything not
    known. The one classification of connection errors; what a service's
    ``wait_for_database`` waits out (``StorageUnavailable.transient``)."""
    if exc.sqlstate in _PERMANENT_SQLSTATES:
        return False
    if exc.sqlstate in _TRANSIENT_SQLSTATES or (exc.sqlstate or "").startswith("08"):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    text = " ".join(str(exc).split())
    if re.search(_UNRESOLVED, text, re.IGNORECASE):
        return False
    return _TRANSIENT_MESSAGES.search(text) is not None
