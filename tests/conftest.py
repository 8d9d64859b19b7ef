"""Fixtures: one PostgreSQL server per test session, one migrated schema of its own per test;
RabbitMQ brokers on loopback (one shared per session, one lent to a fault test at a time, a
three-node cluster per module)."""

from __future__ import annotations

import os
import secrets
import socket
import sys
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from runlane import Queue, Runlane, Task, create_runlane
from runlane.cli._rabbit_host import rabbitmq_available, rabbitmq_test_verdict
from runlane.cli._rabbit_nodes import (
    RabbitNode,
    create_rabbitmq_node,
    start_rabbitmq_cluster,
    start_rabbitmq_node,
)
from runlane.postgres import (
    _pq,
    apply_postgres_storage_migrations,
    grant_postgres_role,
    postgres_polling_lane,
)
from runlane.pytest_plugin import runlane_database_url  # noqa: F401 - registers the fixture
from runlane.testing import MovableClock
from tests._bytecode import compile_checkout
from tests._schemas import SchemaPool, new_schema_name
from tests._shared_broker import WORKERINPUT_KEY, SharedBroker, wait_for_shared_broker
from tests._suite import (
    DurationRecorder,
    auto_workers,
    cluster_timeouts,
    encodable,
    longest_files_first,
    recorded_durations,
    restore_interrupts,
    skip_disk_flushes,
    uses_broker,
)

RunlaneFactory = Callable[..., Runlane]
RabbitRuntimes = Callable[..., Runlane]

_SHARED_BROKER = SharedBroker()  # the xdist controller's (pytest_configure_node)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="after a run that passed, write each test file's seconds to tests/durations.json "
        "(the order the whole suite hands files out in: tests/_suite.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    compile_checkout(config)  # once, before the xdist workers start (tests/_bytecode.py)
    restore_interrupts()  # before any subprocess starts (the xdist workers included)
    if config.getoption("record_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(), "runlane-durations")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject.toml): parallel workers for the whole suite only (tests/_suite)."""
    return auto_workers(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cluster_timeouts(items)
    longest_files_first(items, recorded_durations())  # after pytest-randomly's shuffle


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(
    config: pytest.Config, report: pytest.CollectReport | pytest.TestReport
) -> Generator[None, dict[str, Any] | None, dict[str, Any] | None]:
    """A worker's report, sendable to the controller whatever the test logged."""
    data = yield
    return None if data is None else encodable(data)


@pytest.fixture(autouse=True)
def _forget_cliapp() -> Iterator[None]:
    """Tests write a ``cliapp.py`` of their own and import it in this process: no test meets
    another's module (test_cli after test_wait_for_database got its closed runtime)."""
    yield
    sys.modules.pop("cliapp", None)


@pytest.fixture(scope="session")
def database_url(runlane_database_url: str) -> str:  # noqa: F811 - the fixture, by name
    """RUNLANE_TEST_DATABASE_URL when set, else an embedded server for the session (one per
    xdist worker): the server users get from runlane's pytest plugin
    (``runlane_database_url``), told not to flush to disk."""
    if not os.environ.get("RUNLANE_TEST_DATABASE_URL"):
        skip_disk_flushes(runlane_database_url)
    return runlane_database_url


@pytest.fixture
def fresh_schema(database_url: str) -> Iterator[str]:
    """A schema name unique to this test, not migrated; dropped afterwards from a
    RUNLANE_TEST_DATABASE_URL server. The embedded server's are left to go with its data
    directory at the end of the session: a drop cost a fifth of what the migration did."""
    name = new_schema_name()
    yield name
    if os.environ.get("RUNLANE_TEST_DATABASE_URL"):
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def schema_pool(database_url: str) -> Iterator[SchemaPool | None]:
    """This process's migrated schemas, handed from one test to the next (tests/_schemas.py);
    None on a RUNLANE_TEST_DATABASE_URL server, whose schemas are each dropped after use."""
    if os.environ.get("RUNLANE_TEST_DATABASE_URL"):
        yield None
        return
    pool = SchemaPool(database_url)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def schema(request: pytest.FixtureRequest, database_url: str) -> Iterator[str]:
    """A migrated schema that is this test's alone, holding no rows: fresh, or emptied after
    an earlier test that changed nothing but its rows (tests/_schemas.py). A test that also
    asks for ``fresh_schema`` gets that name migrated."""
    pool: SchemaPool | None = request.getfixturevalue("schema_pool")
    if pool is None or "fresh_schema" in request.fixturenames:
        name: str = request.getfixturevalue("fresh_schema")
        apply_postgres_storage_migrations(connection_string=database_url, schema=name)
        yield name
        return
    name = pool.take()
    yield name
    if not uses_broker(request):
        pool.give_back(name)


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for test assertions and set-up."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def clock() -> MovableClock:
    """Time the test moves instead of sleeping: the runtimes make_runlane builds in a test
    that asks for it read it as now."""
    return MovableClock()


@pytest.fixture
def make_runlane(
    request: pytest.FixtureRequest, database_url: str, schema: str
) -> Iterator[RunlaneFactory]:
    """Build runtimes on this test's schema (on the test's ``clock``, if it asks for one) as
    the owner (or as ``connection_string``'s role); every one is closed at teardown."""
    made: list[Runlane] = []
    moved = request.getfixturevalue("clock") if "clock" in request.fixturenames else None

    def make(**kwargs: Any) -> Runlane:
        lane_options = {"clock": moved, **kwargs.pop("lane_options", {})}
        lane = postgres_polling_lane(
            connection_string=kwargs.pop("connection_string", database_url),
            schema=kwargs.pop("schema", schema),
            **lane_options,
        )
        runtime = create_runlane(lane=lane, **kwargs)
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.close()


@pytest.fixture
def cli_target(
    database_url: str, schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """The CLI's options naming the test's schema, run from an empty directory (no
    RUNLANE_DATABASE_URL, RUNLANE_SCHEMA or RUNLANE_ENVIRONMENT from the environment)."""
    monkeypatch.chdir(tmp_path)
    for name in ("RUNLANE_DATABASE_URL", "RUNLANE_SCHEMA", "RUNLANE_ENVIRONMENT"):
        monkeypatch.delenv(name, raising=False)
    return ["--database-url", database_url, "--schema", schema]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback TCP port something listens on for the test (an address in use)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield int(held.getsockname()[1])


def require_rabbitmq(reason: str | None, environ: Mapping[str, str] | None = None) -> None:
    """Skip the test when no broker can be started here (``reason`` from
    ``rabbitmq_available()``), or fail it under ``CI=true``, where a skip would hide it."""
    verdict, message = rabbitmq_test_verdict(reason, environ)
    if verdict == "skip":
        pytest.skip(message)
    if verdict == "fail":
        pytest.fail(message, pytrace=False)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist's controller, as it sets up each worker: one RabbitMQ node for them all
    (tests/_shared_broker.py), booting while the workers start. When it cannot be made, each
    worker boots its own, as a run without workers does."""
    if os.environ.get("RUNLANE_TEST_AMQP_URL") or rabbitmq_available() is not None:
        return
    try:
        node.workerinput[WORKERINPUT_KEY] = _SHARED_BROKER.for_workers()
    except (OSError, RuntimeError) as exc:
        print(f"no shared RabbitMQ node ({exc}): each worker boots its own", file=sys.stderr)


def pytest_unconfigure(config: pytest.Config) -> None:
    _SHARED_BROKER.close()  # the controller's; nothing in a worker


@pytest.fixture(scope="session")
def rabbitmq_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """RUNLANE_TEST_AMQP_URL when set, else a private RabbitMQ node on loopback: the one the
    xdist controller booted for every worker (tests/_shared_broker.py), or one of this
    session's own (about 5 s to start). Tests sharing it use queue names of their own."""
    configured = os.environ.get("RUNLANE_TEST_AMQP_URL")
    if configured:
        yield configured
        return
    require_rabbitmq(rabbitmq_available())
    try:
        shared = wait_for_shared_broker(getattr(request.config, "workerinput", {}))
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    if shared is not None:
        yield shared
        return
    url, node = start_rabbitmq_node()
    try:
        yield url
    finally:
        node.cleanup()


@pytest.fixture(scope="session")
def spare_rabbitmq_node() -> Iterator[RabbitNode]:
    """The node ``rabbitmq_node`` lends, one per test process, made (not started) when a
    test first asks for it."""
    require_rabbitmq(rabbitmq_available())
    node = create_rabbitmq_node()
    try:
        yield node
    finally:
        node.cleanup()


@pytest.fixture
def rabbitmq_node(spare_rabbitmq_node: RabbitNode) -> RabbitNode:
    """A private, running RabbitMQ node for this test alone, to stop, kill and start again:
    not the session's ``rabbitmq_url`` broker, which other tests share. It is lent to one
    test at a time (the tests of a process run one after another) and started again for
    the next one if a test left it down, rather than booted afresh for each test (a boot
    costs about 5 CPU-seconds). Tests on it name their queues after their schema or a
    fresh id, as on the shared broker."""
    require_rabbitmq(rabbitmq_available())
    if not spare_rabbitmq_node.running:
        spare_rabbitmq_node.start()
    return spare_rabbitmq_node


@pytest.fixture(scope="module")
def rabbitmq_cluster() -> Iterator[list[RabbitNode]]:
    """Three RabbitMQ nodes joined into one cluster on loopback, for the module (about 15 s to
    start). A test that stops or kills a node starts it again before it ends."""
    require_rabbitmq(rabbitmq_available())
    nodes = start_rabbitmq_cluster(3)
    try:
        yield nodes
    finally:
        for node in nodes:
            node.cleanup()


@pytest.fixture
def rabbit_runtime(database_url: str, schema: str) -> Iterator[RabbitRuntimes]:
    """Build runtimes on the RabbitMQ lane and this test's schema; closed at teardown.
    ``amqp_url`` is required; other keywords go to ``rabbitmq_lane`` except ``tasks``,
    ``queues`` and ``environment``."""
    from runlane.rabbitmq import rabbitmq_lane  # noqa: PLC0415 - needs pika

    made: list[Runlane] = []

    def make(
        *,
        amqp_url: str,
        tasks: list[Task[Any, Any]],
        queues: Sequence[Queue] = (),
        environment: str = "default",
        **lane: Any,
    ) -> Runlane:
        lane.setdefault("connect_timeout", 3.0)
        runtime = create_runlane(
            lane=rabbitmq_lane(
                connection_string=database_url, schema=schema, amqp_url=amqp_url, **lane
            ),
            environment=environment,
            tasks=tasks,
            queues=queues,
        )
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.close(timeout=10)


# -- least-privilege roles (tests/test_grants.py, tests/test_grants_enforced.py) ------------


@pytest.fixture
def make_role(
    database_url: str, db: psycopg.Connection[Any]
) -> Iterator[Callable[[], tuple[str, str]]]:
    """Create LOGIN roles with unique names and passwords; ``(name, conninfo)`` of each.
    Dropped at teardown with what they were granted."""
    made: list[str] = []

    def make() -> tuple[str, str]:
        name = f"rl_{uuid.uuid4().hex[:12]}"
        password = secrets.token_urlsafe(16)
        db.execute(
            sql.SQL("create role {} login password {}").format(
                sql.Identifier(name), sql.Literal(password)
            )
        )
        made.append(name)
        return name, make_conninfo(database_url, user=name, password=password)

    yield make
    for name in made:
        db.execute(
            "select pg_terminate_backend(pid) from pg_stat_activity where usename = %s", (name,)
        )
        db.execute(sql.SQL("drop owned by {}").format(sql.Identifier(name)))
        db.execute(sql.SQL("drop role {}").format(sql.Identifier(name)))


@pytest.fixture
def granted(
    database_url: str, schema: str, make_role: Callable[[], tuple[str, str]]
) -> Callable[..., str]:
    """A fresh role granted ``job`` on this test's schema (by the owner); its conninfo."""

    def grant(job: str, lane: str = "polling") -> str:
        name, conninfo = make_role()
        grant_postgres_role(
            connection_string=database_url, schema=schema, job=job, role=name, lane=lane
        )
        return conninfo

    return grant


# -- the two paths of postgres/_pq.py (libpq directly; psycopg's public cursor API) ---------


@pytest.fixture(params=["libpq", "cursor"])
def statement_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the trigger statements sent through libpq directly (where this
    psycopg is a release that path was tested with) and through psycopg's public cursor
    API (every other release): runlane chooses one when it loads (postgres/_pq.py)."""
    if request.param == "libpq" and not _pq.RAW_PATH:
        pytest.skip(
            f"psycopg {psycopg.__version__} is not a release the libpq path was tested with "
            f"({_pq.TESTED_PSYCOPG}), or RUNLANE_PSYCOPG_LIBPQ=0: the cursor path runs"
        )
    monkeypatch.setattr(_pq, "RAW_PATH", request.param == "libpq")
    return str(request.param)
