"""The lane conformance suite run by a lane kept outside runlane, as its author would: a
throw-away project holding a lane package (the polling lane wrapped behind the Lane
protocol, written against public names only) and a test module subclassing
``LaneConformance``, run by pytest in a subprocess with runlane's plugin fixtures. A broken
variant of the lane (its idle worker deaf to announcements) fails the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LANE_PACKAGE = '''
"""A lane of its own: the polling lane behind the Lane protocol, public names only."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta

from runlane.lanes import Acquirer, AcquirerOptions, LaneMaintenance, LaneStatus, RunEndWatcher
from runlane.maintenance import MaintenanceLimits
from runlane.postgres import PostgresPollingLane
from runlane.storage import ClaimedRun, MaintenanceFence, Storage


class WrappedLane:
    def __init__(self, inner: PostgresPollingLane, *, deaf: bool = False) -> None:
        self.inner = inner
        self.deaf = deaf

    @property
    def name(self) -> str:
        return "wrapped-polling"

    @property
    def lease_duration(self) -> timedelta:
        return self.inner.lease_duration

    @property
    def drain_unsupported(self) -> str | None:
        return self.inner.drain_unsupported

    def create_storage(self) -> Storage:
        return self.inner.create_storage()

    def prepare(self, storage: Storage, environment: str) -> None:
        self.inner.prepare(storage, environment)

    def watch_run_ends(self, environment: str, name: str) -> RunEndWatcher | None:
        return self.inner.watch_run_ends(environment, name)

    def create_acquirer(
        self,
        storage: Storage,
        options: AcquirerOptions,
        on_cancel: Callable[[uuid.UUID | None], None],
    ) -> Acquirer:
        acquirer = self.inner.create_acquirer(storage, options, on_cancel)
        return DeafAcquirer(acquirer) if self.deaf and not options.drain else acquirer

    def recover_delivery(
        self,
        storage: Storage,
        environment: str,
        limits: MaintenanceLimits,
        fence: MaintenanceFence | None,
    ) -> LaneMaintenance:
        return self.inner.recover_delivery(storage, environment, limits, fence)

    def status(self, storage: Storage, environment: str) -> LaneStatus:
        return self.inner.status(storage, environment)


class DeafAcquirer:
    """A broken delivery path: an idle worker waits out its poll interval, whatever is
    announced (only close wakes it)."""

    def __init__(self, inner: Acquirer) -> None:
        self.inner = inner
        self.woken = threading.Event()

    def start(self) -> None:
        self.inner.start()

    def acquire(self, want: int, for_bounded: int) -> list[ClaimedRun]:
        self.woken.clear()
        return self.inner.acquire(want, for_bounded)

    def wait_for_work(self) -> None:
        self.woken.wait(30)

    def interrupt(self) -> None:
        self.woken.set()

    def abort(self) -> None:
        self.inner.abort()

    def close(self, timeout: float | None) -> None:
        self.woken.set()
        self.inner.close(timeout)

    def wait_ready(self, timeout: float) -> bool:
        return self.inner.wait_ready(timeout)

    @property
    def rate_wait(self) -> float | None:
        return self.inner.rate_wait
'''

LANE_TESTS = """
from datetime import timedelta

import pytest

from runlane.postgres import postgres_polling_lane
from runlane.testing.conformance import LaneConformance, LaneHarness
from wrapped_lane import WrappedLane


class WrappedHarness(LaneHarness):
    name = "wrapped-polling"

    def __init__(self, database_url: str, schema: str, *, deaf: bool = False) -> None:
        self.database_url = database_url
        self.schema = schema
        self.deaf = deaf
        self.started = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.started = False

    def build_lane(self, *, lease_duration: timedelta, poll_interval: timedelta) -> WrappedLane:
        assert self.started, "the suite builds lanes between start() and stop()"
        inner = postgres_polling_lane(
            connection_string=self.database_url,
            schema=self.schema,
            lease_duration=lease_duration,
            poll_interval=poll_interval,
        )
        return WrappedLane(inner, deaf=self.deaf)


class TestWrappedLane(LaneConformance):
    deaf = False

    @pytest.fixture
    def lane_harness(self, runlane_database_url: str, runlane_schema: str) -> WrappedHarness:
        return WrappedHarness(runlane_database_url, runlane_schema, deaf=self.deaf)


class TestDeafLane(TestWrappedLane):
    \"\"\"The broken variant: its idle worker deaf to announcements.\"\"\"

    deaf = True
"""

# a handful of the suite: delivery, the idle wake-up, the hand-back, drain and shutdown
PICKED = (
    "exactly_once or promptly or hands_an_interrupted_run_back or drain_executes "
    "or drain_on_a_lane_without or close_ends_every_thread"
)
# and, for the deaf variant, the test that must catch it: both in one pytest process, the
# deaf class last (file order), after every test of the sound one
SELECTED = f"(TestWrappedLane and ({PICKED})) or (TestDeafLane and idle_worker_starts)"


_PLUGINS_OFF = ("-p", "no:randomly", "-p", "no:xdist")


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "wrapped-lane"
    project.mkdir()
    (project / "wrapped_lane.py").write_text(LANE_PACKAGE)
    (project / "test_wrapped_lane.py").write_text(LANE_TESTS)
    return project


@pytest.fixture(scope="module")
def lane_suite(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> str:
    """The output of one pytest run of the project: ``SELECTED``, every outcome reported."""
    project = _project(tmp_path_factory.mktemp("outside"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RUNLANE_"))}
    env["RUNLANE_TEST_DATABASE_URL"] = database_url
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_PLUGINS_OFF]
    done = subprocess.run(
        [*argv, "-k", SELECTED, "-rA"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = done.stdout + done.stderr
    assert "1 failed, 6 passed, 1 skipped, 18 deselected" in out, out
    return out


def _outcomes(out: str, cls: str) -> list[str]:
    """The ``-rA`` lines of ``cls``'s tests: "PASSED test_...", "FAILED test_... - why"."""
    mark = f"test_wrapped_lane.py::{cls}::"
    return [line for line in out.splitlines() if mark in line and not line.startswith(" ")]


def test_a_lane_outside_runlane_runs_the_conformance_suite(lane_suite: str) -> None:
    outcomes = _outcomes(lane_suite, "TestWrappedLane")
    assert sum(line.startswith("PASSED ") for line in outcomes) == 6, lane_suite
    assert not any(line.startswith(("FAILED ", "ERROR ")) for line in outcomes), lane_suite
    # one is the other half of drain support (this lane drains): skipped
    (skipped,) = [line for line in lane_suite.splitlines() if line.startswith("SKIPPED ")]
    assert "supports drain() (the other half's test)" in skipped, lane_suite


def test_the_suite_fails_a_lane_whose_idle_worker_misses_announcements(lane_suite: str) -> None:
    (failed,) = _outcomes(lane_suite, "TestDeafLane")
    assert failed.startswith("FAILED test_wrapped_lane.py::TestDeafLane::test_"), lane_suite
    assert "idle_worker_starts" in failed, lane_suite
    assert "after its trigger (poll is 30 s)" in lane_suite or "did not start in 5" in lane_suite


IMPORTED = ("runlane", "runlane.testing", "runlane.lanes", "runlane.testing.conformance")


@pytest.fixture(scope="module")
def imports_without_pytest() -> dict[str, str]:
    """Each of ``IMPORTED``, in order, imported by one interpreter in which ``import pytest``
    fails: the module's name to "ok" or the error its import raised. (One process for all:
    pytest is missing for each import alike, and an interpreter costs about 0.5 CPU-s.)"""
    code = (
        "import json, sys, traceback\n"
        "sys.modules['pytest'] = None\n"
        "found = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except BaseException:\n"
        "        found[name] = traceback.format_exc()\n"
        "    else:\n"
        "        found[name] = 'ok'\n"
        "print(json.dumps(found))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *IMPORTED],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, str] = json.loads(done.stdout)
    assert list(found) == list(IMPORTED), done.stdout
    return found


@pytest.mark.parametrize("module", IMPORTED[:3])
def test_runlane_imports_without_pytest(
    module: str, imports_without_pytest: dict[str, str]
) -> None:
    # pytest stays an optional dependency (the testing extra): only the conformance suite
    # and the plugin need it
    assert imports_without_pytest[module] == "ok", imports_without_pytest[module]


def test_the_conformance_suite_says_it_needs_pytest(imports_without_pytest: dict[str, str]) -> None:
    error = imports_without_pytest["runlane.testing.conformance"]
    assert error != "ok"
    assert "pytest" in error.strip().splitlines()[-1], error  # the exception's own line
