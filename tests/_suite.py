"""How the whole suite runs: in parallel worker processes (pytest-xdist), in random order
(pytest-randomly), on a throw-away PostgreSQL that need not reach the disk. conftest.py's
hooks call these; the options themselves are in pyproject.toml (``-n auto --dist loadfile``).

- ``pytest`` alone (the README's and CI's command) runs the suite on ``WORKERS`` processes,
  each with its own embedded PostgreSQL and its own RabbitMQ node (every node has its own
  ports, data directory and epmd; every test its own schema and broker queues).
  ``pytest tests/test_x.py`` (any explicit selection) runs in this one process, as before.
  So does a run on ``RUNLANE_TEST_DATABASE_URL`` (one server the workers would share).
  ``-n N`` or ``PYTEST_XDIST_AUTO_NUM_WORKERS=N`` overrides these.
- ``--dist loadfile`` sends each test file to one worker whole, so a module-scoped fixture (a
  three-node broker cluster, a browser, a server of the module's own) is set up once, not
  once per worker. (``--dist loadgroup`` would balance better, but pytest-xdist 3.8 cannot
  group tests under pytest 9.2: it renames a test id pytest no longer reads.) The files are
  handed out longest first, by the seconds ``tests/durations.json`` records for each
  (``--no-loadscope-reorder`` keeps that order: xdist would otherwise hand out the files
  with the most tests first); ``pytest --record-durations`` writes it again after a run
  that passed.
- pytest-randomly shuffles the order (modules, then the tests in each) with a seed printed
  in the header: ``pytest --randomly-seed=N`` repeats a run's order (``--randomly-seed=last``
  the last run's), ``pytest -p no:randomly`` keeps the collected order (the longest files
  still first).
"""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest

__all__ = [
    "CLUSTER_TIMEOUT",
    "DURATIONS",
    "WORKERS",
    "DurationRecorder",
    "auto_workers",
    "cluster_timeouts",
    "encodable",
    "longest_files_first",
    "recorded_durations",
    "restore_interrupts",
    "skip_disk_flushes",
    "uses_broker",
]

ROOT = Path(__file__).resolve().parent.parent  # the project root, where pytest runs

# Worker processes for the whole suite. Most tests wait (for a broker, a lease, a thread, a
# subprocess) more than they compute, so two more workers than the machine has cores keep
# the cores busy while the timing assertions still hold on a 2-core machine (4 workers
# there: 4:00 for the whole suite, against 4:30 with 3, on 2026-12-05).
WORKERS = (os.cpu_count() or 1) + 2


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


# A test using the three-node broker cluster gets this timeout (seconds) unless it has its
# own: its set-up counts, and the cluster's boot shares the cores with the other workers
# (it took over the suite's 120 s on a loaded 2-core machine).
CLUSTER_TIMEOUT = 300


def cluster_timeouts(items: list[pytest.Item]) -> None:
    """Give each test that uses ``rabbitmq_cluster`` ``CLUSTER_TIMEOUT``, unless it has a
    timeout of its own."""
    for item in items:
        if "rabbitmq_cluster" in getattr(item, "fixturenames", ()) and (
            item.get_closest_marker("timeout") is None
        ):
            item.add_marker(pytest.mark.timeout(CLUSTER_TIMEOUT))


# Each test file's seconds in a whole-suite run (setup, call and teardown of its tests, under
# the load of the other workers), written by ``pytest --record-durations``. Only the order
# of handing files out reads it: a stale or missing entry costs balance, never a result.
DURATIONS = Path(__file__).with_name("durations.json")

# A file missing from DURATIONS (a new one) is taken to last this long, or longer when it
# holds a test marked ``slow``.
UNKNOWN_SECONDS = 4.0
UNKNOWN_SLOW_SECONDS = 30.0


def recorded_durations(path: Path = DURATIONS) -> dict[str, float]:
    """The seconds ``path`` records for each file (its path relative to the project root);
    empty when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(name): float(seconds)
        for name, seconds in data.items()
        if isinstance(seconds, int | float) and not isinstance(seconds, bool)
    }


def duration_class(seconds: float) -> int:
    """Files whose recorded seconds are within a factor of two of each other share a class
    (``floor(log2)``, everything under a second in one): the order between them stays
    random."""
    return max(0, math.floor(math.log2(seconds))) if seconds >= 1.0 else 0


def longest_files_first(items: list[pytest.Item], durations: Mapping[str, float]) -> None:
    """Sort the files by their recorded duration, longest first, keeping pytest-randomly's
    order within each class of ``duration_class`` and the tests' order within each file:
    ``--dist loadfile`` hands files out in this order, so the run ends on short files
    rather than on one long file running alone while the other workers idle (a tail of
    14 s in one run with the files in random order)."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}

    def seconds(path: Path) -> float:
        try:
            name = path.relative_to(ROOT).as_posix()
        except ValueError:
            name = path.as_posix()
        known = durations.get(name)
        if known is not None:
            return known
        return UNKNOWN_SLOW_SECONDS if path in slow else UNKNOWN_SECONDS

    classes = {path: duration_class(seconds(path)) for path in {item.path for item in items}}
    items.sort(key=lambda item: -classes[item.path])


class DurationRecorder:
    """``pytest --record-durations``: sums each file's test reports (setup, call and
    teardown; the reports of every xdist worker reach the controller) and writes them to
    ``DURATIONS`` at the end of a run that passed. Registered in the controller (or the one
    process of a run without workers) only."""

    def __init__(self, path: Path = DURATIONS) -> None:
        self.path = path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = report.nodeid.split("::", 1)[0]
        self.seconds[name] = self.seconds.get(name, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus != 0 or not self.seconds:
            return
        ordered = {name: round(self.seconds[name], 1) for name in sorted(self.seconds)}
        self.path.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf-8")


# Fixtures through which a test reaches a RabbitMQ broker (whose queues the lane names after
# the test's schema)
BROKER_FIXTURES = frozenset({"rabbitmq_url", "rabbitmq_node", "rabbitmq_cluster", "rabbit_runtime"})


def uses_broker(request: pytest.FixtureRequest) -> bool:
    """Whether the test may have declared broker queues named after its schema: it asked for
    a broker fixture (``fixturenames`` counts those fetched with ``getfixturevalue`` too), or
    it is a parametrization on the RabbitMQ lane. Its schema is then not handed on."""
    if BROKER_FIXTURES.intersection(request.fixturenames):
        return True
    # the parametrization's id, never str() of its values (a test may pass one whose str()
    # raises, or an integer of 5,000 digits)
    callspec = getattr(request.node, "callspec", None)
    return callspec is not None and "rabbit" in str(callspec.id).lower()


def restore_interrupts() -> None:
    """Let SIGINT interrupt again when pytest was started with it ignored (a background job
    of a non-interactive shell is, and ``nohup`` or a CI runner may start it so): an ignored
    signal stays ignored across ``exec``, so every subprocess the tests start as a user would
    (the guide's ``flask run``, stopped with Ctrl-C) ignored it, and the test waited 60 s
    before killing it. A handler of Python's own is reset to the default at ``exec``."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
