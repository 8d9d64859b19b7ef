"""A wrong host, port, password or database (and a server that never answers) fails a CLI
one-shot and a first ``trigger()`` within the connect timeout, with one line naming the cause;
nothing from the connection pool reaches the log at WARNING."""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from runlane import StorageUnavailable, create_runlane, queue, task
from runlane.cli import EXIT_FAILURE, main
from runlane.postgres import postgres_polling_lane

CONNECT_TIMEOUT = 2.0  # libpq's smallest
RESOLVER_TRY = 5.0  # glibc's resolver: seconds a try before it gives up on a server


@task(id="connect.noop")
def noop(payload: Any, context: Any) -> None:
    return None


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP port that accepts connections into its backlog and never answers a byte."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


@pytest.fixture
def password_role(database_url: str, db: psycopg.Connection[Any]) -> Iterator[str]:
    """A role that must give its password ('right'), whatever the server's other rules: a
    first line in the server's pg_hba.conf for it alone, removed afterwards."""
    role = f"pw_{uuid.uuid4().hex[:8]}"
    (hba_file,) = db.execute("show hba_file").fetchone() or ("",)
    hba = Path(hba_file)
    try:
        original = hba.read_text()
    except OSError as exc:
        pytest.skip(f"pg_hba.conf of the test server is not readable here ({exc})")
    db.execute(sql.SQL("create role {} login password 'right'").format(sql.Identifier(role)))
    method = "host all {role} all scram-sha-256\nlocal all {role} scram-sha-256\n"
    hba.write_text(method.format(role=role) + original)
    db.execute("select pg_reload_conf()")
    try:
        yield role
    finally:
        hba.write_text(original)
        db.execute("select pg_reload_conf()")
        db.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


def _with(database_url: str, **changes: Any) -> str:
    return make_conninfo(database_url, **changes)


def _wrong_url(cause: str, database_url: str, request: pytest.FixtureRequest) -> str:
    if cause == "host":
        return _with(database_url, host="no-such-host.invalid", port="5432")
    if cause == "port":
        return _with(database_url, host="127.0.0.1", port="1")
    if cause == "database":
        return _with(database_url, dbname="no_such_database")
    if cause == "password":
        role = request.getfixturevalue("password_role")
        return _with(database_url, user=role, password="Xyzzy-not-it")
    port = request.getfixturevalue("silent_server")
    return _with(database_url, host="127.0.0.1", port=str(port), sslmode="disable")


CAUSES = {
    "host": "the host name 'no-such-host.invalid' does not resolve (DNS)",
    "port": "nothing accepts connections at 127.0.0.1:1 (connection refused)",
    "database": "has no database 'no_such_database': create it",
    "password": "refused the password of user",
    "silence": f"within the connect timeout ({CONNECT_TIMEOUT:g} s)",
}


@pytest.mark.parametrize("cause", list(CAUSES))
def test_a_wrong_target_fails_fast_in_one_line(
    cause: str,
    database_url: str,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = _wrong_url(cause, database_url, request)
    caplog.set_level(logging.INFO)  # what a worker logs by default: INFO and up

    # the CLI one-shot: `runlane status --database-url URL`
    started = time.monotonic()
    code = main(["status", "--database-url", _with(url, connect_timeout="2")])
    took = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == EXIT_FAILURE
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("runlane: error: runlane could not connect to the database: ")
    assert CAUSES[cause] in lines[0], lines[0]
    assert "Xyzzy" not in lines[0]  # the password is never shown
    # a name that does not resolve takes the system resolver's time, which libpq's
    # connect_timeout does not bound (5 s a try by resolv.conf's default; a clean-clone run
    # met one at 5.02 s)
    limit = CONNECT_TIMEOUT + 3 + (RESOLVER_TRY if cause == "host" else 0)
    assert took < limit, took

    # a first trigger() in a process (a web request): the same line, as StorageUnavailable
    runtime = create_runlane(
        lane=postgres_polling_lane(
            connection_string=url, schema="runlane", connect_timeout=CONNECT_TIMEOUT
        ),
        queues=[queue("default", default=True)],
        tasks=[noop],
    )
    try:
        started = time.monotonic()
        with pytest.raises(StorageUnavailable) as raised:
            runtime.trigger(noop, None)
        took = time.monotonic() - started
    finally:
        runtime.close()
    message = str(raised.value)
    assert "\n" not in message
    assert CAUSES[cause] in message, message
    assert took < limit, took
    # the pool never retried in the background: nothing at WARNING or above
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_pool_records_of_runlane_pools_stay_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """psycopg.pool's reconnect warnings about runlane's own pools go to
    runlane.postgres.pool at DEBUG (shown only when asked); other pools' records pass."""
    import runlane.postgres._connections  # noqa: F401, PLC0415 - installs the filter

    pool_log = logging.getLogger("psycopg.pool")
    caplog.set_level(logging.INFO)
    pool_log.warning("error connecting in %r: %s", "runlane-runlane", "refused")
    pool_log.warning("error connecting in %r: %s", "app-pool", "refused")
    assert [(r.name, r.levelname) for r in caplog.records] == [("psycopg.pool", "WARNING")]
    assert "app-pool" in caplog.records[0].getMessage()

    caplog.clear()
    caplog.set_level(logging.DEBUG)
    # an earlier test in this process may have set the runlane logger's level (the CLI's
    # --log-level does): ask for DEBUG where the record goes, as a user would
    caplog.set_level(logging.DEBUG, logger="runlane.postgres.pool")
    pool_log.warning("error connecting in %r: %s", "runlane-runlane", "refused")
    assert [(r.name, r.levelname) for r in caplog.records] == [("runlane.postgres.pool", "DEBUG")]
    assert "error connecting in 'runlane-runlane': refused" in caplog.records[0].getMessage()


def test_asking_psycopg_pool_for_debug_shows_its_records_unchanged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import runlane.postgres._connections  # noqa: F401, PLC0415 - installs the filter

    pool_log = logging.getLogger("psycopg.pool")
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="psycopg.pool")
    pool_log.warning("error connecting in %r: %s", "runlane-runlane", "refused")
    assert [(r.name, r.levelname) for r in caplog.records] == [("psycopg.pool", "WARNING")]
