"""Driver errors end at the storage boundary: StorageUnavailable naming host:port (never the
password), ConfigurationError for a connection string that is not one, RunlaneClosed on a
closed storage, no poisoning after a failed open, and interrupt() ending a statement that a
row lock blocks. Real sockets and a real server; nothing is mocked."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import psycopg
import psycopg_pool
import pytest

from runlane import ConfigurationError, RunlaneClosed, RunlaneError, StorageUnavailable
from runlane.postgres import (
    PostgresStorage,
    apply_postgres_storage_migrations,
    postgres_polling_lane,
)
from runlane.postgres._connections import _scrubbed
from runlane.storage import Completion, NewRuns
from tests._proxy import TcpProxy, tcp_proxy
from tests.helpers import Conn, q, wait_until

PASSWORD = "hunter2-sekrit"
ENV = "env"


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def assert_clean(exc: BaseException) -> None:
    """No password in the error or anything chained to it, and no driver type at the top."""
    assert not isinstance(exc, psycopg.Error)
    seen: BaseException | None = exc
    while seen is not None:
        assert PASSWORD not in str(seen), f"password leaked in {type(seen).__name__}: {seen}"
        seen = seen.__cause__ or seen.__context__


def new_runs() -> NewRuns:
    return NewRuns(ENV, "t", "q", [uuid.uuid4()], ["null"], [None], 0, 1, timedelta(0), None)


def test_a_closed_port_is_storage_unavailable_naming_host_and_port(schema: str) -> None:
    port = unused_port()
    url = f"postgresql://runlane:{PASSWORD}@127.0.0.1:{port}/app"
    storage = PostgresStorage(connection_string=url, schema=schema, connect_timeout=1)
    try:
        calls: list[Callable[[], object]] = [
            storage.open,
            lambda: storage.run_get(ENV, uuid.uuid4()),
        ]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(StorageUnavailable) as info:
                call()
            assert time.monotonic() - started < 5
            message = str(info.value)
            assert f"127.0.0.1:{port}" in message
            assert "is postgresql running" in message.lower()
            # the cause, precisely: no firewall or max_connections hints for a refused port
            assert "(connection refused)" in message
            assert "max_connections" not in message
            assert isinstance(info.value.__cause__, psycopg.Error)
            assert_clean(info.value)
    finally:
        storage.close()


def test_migrations_against_a_closed_port_are_storage_unavailable(fresh_schema: str) -> None:
    port = unused_port()
    url = f"host=127.0.0.1 port={port} password={PASSWORD} connect_timeout=1"
    with pytest.raises(StorageUnavailable, match=f"127.0.0.1:{port}") as info:
        apply_postgres_storage_migrations(connection_string=url, schema=fresh_schema)
    assert_clean(info.value)


@pytest.mark.parametrize(
    "url",
    [
        f"host=db password={PASSWORD} oops",
        f"postgresql://u:{PASSWORD}@[::1",
        f"nonsense={PASSWORD}",
        f"postgresql://u:{PASSWORD}@db:notaport/app",
        "",
    ],
    ids=["no-equals", "bad-uri", "unknown-option", "bad-port", "empty"],
)
def test_a_malformed_connection_string_is_a_configuration_error(url: str) -> None:
    calls: list[Callable[[], object]] = [
        lambda: postgres_polling_lane(connection_string=url),
        lambda: apply_postgres_storage_migrations(connection_string=url, schema="runlane"),
        lambda: PostgresStorage(connection_string=url, schema="runlane"),
    ]
    for call in calls:
        with pytest.raises(ConfigurationError) as info:
            call()
        assert_clean(info.value)
        assert info.value.__cause__ is None


@pytest.fixture
def proxy(database_url: str) -> Iterator[TcpProxy]:
    with tcp_proxy(database_url) as p:
        yield p


def test_a_failed_first_open_does_not_poison_the_storage(
    database_url: str, schema: str, proxy: TcpProxy
) -> None:
    storage = PostgresStorage(
        connection_string=f"{proxy.url_for(database_url)} password={PASSWORD}",
        schema=schema,
        connect_timeout=1,
    )
    try:
        for _ in range(2):  # the database is down: the same clear error each time
            with pytest.raises(StorageUnavailable, match=f"127.0.0.1:{proxy.port}") as info:
                storage.run_insert_many(new_runs())
            assert not isinstance(info.value, psycopg_pool.PoolClosed)
            assert_clean(info.value)
        proxy.up()
        inserted = storage.run_insert_many(new_runs())  # back: works without a new storage
        assert storage.run_get(ENV, inserted[0].id) is not None
        proxy.down()  # an outage after a good start: unavailable, then fine again
        with pytest.raises(StorageUnavailable):
            storage.run_get(ENV, inserted[0].id)
        proxy.up()
        assert storage.run_get(ENV, inserted[0].id) is not None
    finally:
        storage.close()


def test_a_closed_storage_and_a_closed_view_raise_runlane_closed(
    database_url: str, schema: str
) -> None:
    storage = PostgresStorage(connection_string=database_url, schema=schema)
    view = storage.dedicated("test-view")
    assert view.run_get(ENV, uuid.uuid4()) is None
    view.close()
    with pytest.raises(RunlaneClosed):
        view.run_get(ENV, uuid.uuid4())
    storage.open()
    storage.close()
    calls: list[Callable[[], object]] = [storage.open, lambda: storage.run_get(ENV, uuid.uuid4())]
    for call in calls:
        with pytest.raises(RunlaneClosed, match="closed"):
            call()
    storage.interrupt()  # a no-op, never an error


def test_other_database_errors_are_runlane_errors(database_url: str, schema: str) -> None:
    storage = PostgresStorage(connection_string=database_url, schema=schema)
    try:
        bad = NewRuns(
            ENV, "t", "q", [uuid.uuid4()], ["{not json"], [None], 0, 1, timedelta(0), None
        )
        with pytest.raises(RunlaneError, match="unexpected database error") as info:
            storage.run_insert_many(bad)
        assert not isinstance(info.value, StorageUnavailable)
        assert isinstance(info.value.__cause__, psycopg.Error)
    finally:
        storage.close()


# -- a statement blocked by a row lock ----------------------------------------------------------


@pytest.fixture
def locked_run(
    database_url: str, schema: str, db: Conn
) -> Iterator[tuple[PostgresStorage, Completion]]:
    """A running run whose row another connection holds locked, and the storage it runs on."""
    storage = PostgresStorage(connection_string=database_url, schema=schema)
    runs = new_runs()
    storage.run_insert_many(runs)
    (claimed,) = storage.run_claim(ENV, ["q"], 1, timedelta(seconds=60))
    done = Completion(claimed.id, claimed.attempt, claimed.lease_token, "1")
    with psycopg.connect(database_url) as holder:
        holder.execute(q("select 1 from {s}.runs where id = %s for update", schema), (claimed.id,))
        try:
            yield storage, done
        finally:
            holder.rollback()
            storage.close()


def test_interrupt_ends_a_write_blocked_by_a_row_lock(
    locked_run: tuple[PostgresStorage, Completion], db: Conn, schema: str
) -> None:
    storage, done = locked_run
    view = storage.dedicated("test-writer")
    view.interrupt()  # idle: nothing to cancel, nothing happens
    errors: list[BaseException] = []

    def write() -> None:
        try:
            view.run_complete_many([done])
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    wait_until(  # a signal, not a pause: the writer's backend waits on the lock
        lambda: (
            db.execute(
                "select count(*) from pg_stat_activity "
                "where application_name = 'test-writer' and wait_event_type = 'Lock'"
            ).fetchone()
            == (1,)
        ),
        timeout=10,
        what="the write to wait on the row lock",
    )
    assert writer.is_alive(), "the write was not blocked by the row lock"
    started = time.monotonic()
    view.interrupt()
    writer.join(5)
    took = time.monotonic() - started
    assert not writer.is_alive()
    assert took < 1.0, f"interrupt took {took:.2f}s"
    (error,) = errors
    assert isinstance(error, StorageUnavailable)
    assert "cancel" in str(error)
    # nothing was written, and the view works again once the lock is gone
    status = db.execute(q("select status from {s}.runs where id = %s", schema), (done.run_id,))
    assert status.fetchone() == ("running",)
    view.close()


def test_a_dedicated_statement_timeout_ends_a_blocked_write(
    database_url: str, schema: str, locked_run: tuple[PostgresStorage, Completion]
) -> None:
    _, done = locked_run
    storage = PostgresStorage(connection_string=database_url, schema=schema, statement_timeout=0.5)
    view = storage.dedicated("test-timeout")
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match="statement timeout"):
        view.run_complete_many([done])
    assert 0.4 < time.monotonic() - started < 3
    view.close()
    storage.close()


def test_a_short_password_is_masked_where_a_connection_string_shows_and_garbles_nothing() -> None:
    """A password masked wherever its text stood garbled every message when it was short
    ("a": "the server ***t /tmp/d***t***") and showed where its letters were; it is masked
    where a connection string is echoed, and anywhere only when long."""
    short = "host=/tmp/data password=a"
    message = "the server at /tmp/data:5432 is unreachable: is a server running there?"
    assert _scrubbed(message, short) == message
    echoed = "conninfo 'host=x password=a user=u'; url postgresql://u:a@h/db"
    assert _scrubbed(echoed, short) == (
        "conninfo 'host=x password=*** user=u'; url postgresql://u:***@h/db"
    )
    long = f"host=/tmp password={PASSWORD}"
    assert PASSWORD not in _scrubbed(f"before {PASSWORD} after", long)
