"""How the whole suite runs: in parallel worker processes (pytest-xdist), in random order
(pytest-randomly), on a throw-away PostgreSQL that need not reach the disk. conftest.py's
hooks call these; the options themselves are in pyproject.toml (``-n auto --dist loadgroup``).

- ``pytest`` alone (the README's and CI's command) runs the suite on ``WORKERS`` processes,
  each with its own embedded PostgreSQL and its own RabbitMQ node (every node has its own
  ports, data directory and epmd; every test its own schema and broker queues).
  ``pytest tests/test_x.py`` (any explicit selection) runs in this one process, as before.
  So does a run on ``RUNLANE_TEST_DATABASE_URL`` (one server the workers would share).
  ``-n N`` or ``PYTEST_XDIST_AUTO_NUM_WORKERS=N`` overrides these.
- A test using a module-scoped fixture (a three-node broker cluster, a browser, a server of
  the module's own) runs in the same worker as the rest of its module, so the fixture is set
  up once, not once per worker.
- pytest-randomly shuffles the order (modules, then the tests in each) with a seed printed
  in the header: ``pytest --randomly-seed=N`` repeats a run's order (``--randomly-seed=last``
  the last run's), ``pytest -p no:randomly`` keeps the file order.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
import pytest

__all__ = ["WORKERS", "auto_workers", "encodable", "group_module_fixtures", "skip_disk_flushes"]

# Worker processes for the whole suite. Most tests wait (for a broker, a lease, a thread, a
# subprocess) more than they compute, so one more worker than the machine has cores keeps
# the cores busy while the timing assertions still hold on a 2-core machine.
WORKERS = (os.cpu_count() or 1) + 1


def auto_workers(config: pytest.Config) -> int:
    """``-n auto``: ``PYTEST_XDIST_AUTO_NUM_WORKERS`` when set; ``WORKERS`` when pytest runs
    the configured test paths (the whole suite); 0 (no workers: this process) when the
    command line names what to run, or when ``RUNLANE_TEST_DATABASE_URL`` names one server
    for them all."""
    configured = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").strip()
    if configured:
        return int(configured)
    if config.args_source is not pytest.Config.ArgsSource.TESTPATHS:
        return 0
    if os.environ.get("RUNLANE_TEST_DATABASE_URL"):
        # one server for every worker: tests that count what the whole server holds
        # (schemas, roles, backends, advisory locks) would see each other's
        return 0
    return WORKERS


def group_module_fixtures(items: list[pytest.Item]) -> None:
    """Put each test that uses a module-scoped fixture in its module's xdist group: under
    ``--dist loadgroup`` a group runs in one worker, so the fixture is set up once."""
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        definitions = item._fixtureinfo.name2fixturedefs.values()
        if any(defs and defs[-1].scope == "module" for defs in definitions):
            item.add_marker(pytest.mark.xdist_group(name=item.module.__name__))


def skip_disk_flushes(url: str) -> None:
    """Tell a throw-away server not to flush to disk (``fsync``, ``full_page_writes``,
    ``synchronous_commit`` off): a commit then costs a write, not a 5 ms flush. Nothing the
    tests do depends on a flush: a server they restart shuts down cleanly first, and one
    the machine loses is thrown away anyway. Never for ``RUNLANE_TEST_DATABASE_URL``."""
    with psycopg.connect(url, autocommit=True) as conn:
        for setting in ("fsync", "full_page_writes", "synchronous_commit"):
            conn.execute(f"alter system set {setting} = off")
        conn.execute("select pg_reload_conf()")


def encodable(value: Any) -> Any:
    """``value`` (a test report as xdist sends it from a worker: dicts, lists and strings)
    with every string UTF-8 can encode: a lone surrogate, which a test may log on purpose,
    becomes its ``\\udXXX`` escape. Unchanged, it made the worker crash sending the report."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {encodable(k): encodable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(encodable(v) for v in value)
    return value
