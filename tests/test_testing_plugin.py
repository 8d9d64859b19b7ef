"""runlane.testing for users: the pytest plugin's fixtures (run through pytester, as a user's
test file would use them) and run_until_idle (due retries, releases, waits and children run;
future work does not keep it spinning; lanes without drain refuse it)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from runlane import (
    ConfigurationError,
    RetryPolicy,
    RunContext,
    RunStatus,
    create_runlane,
    queue,
    task,
)
from runlane.rabbitmq import rabbitmq_lane
from runlane.testing import run_until_idle
from tests.conftest import RunlaneFactory
from tests.helpers import HOUR_RETRY, Greet

pytest_plugins = ["pytester"]

USER_TEST_FILE = """
from datetime import timedelta

import attrs

from runlane import RetryPolicy, RunContext, RunStatus, task
from runlane.testing import run_until_idle

pytest_plugins = ["runlane.pytest_plugin"]

calls = []


@attrs.frozen
class Charge:
    amount: int


@task(id="billing.charge", schema=Charge,
      retry=RetryPolicy(max_attempts=3, initial_delay=timedelta(0)))
def charge(payload: Charge, context: RunContext) -> int:
    calls.append(context.attempt)
    if context.attempt == 1:
        raise ConnectionError("the payment API timed out")
    return payload.amount


def test_a_retried_run_completes(runlane_factory):
    runlane = runlane_factory(tasks=[charge])
    handle = runlane.trigger(charge, {"amount": 42})

    result = run_until_idle(runlane)

    run = runlane.get_run(handle.id)
    assert run.status is RunStatus.COMPLETED
    assert run.output == 42
    assert run.attempt == 2
    assert calls == [1, 2]
    assert result.retried == 1 and result.completed == 1


def test_each_test_gets_its_own_schema(runlane_factory, runlane_schema):
    runlane = runlane_factory(tasks=[charge])
    assert runlane.list_runs().runs == ()
    assert runlane_schema.startswith("runlane_test_")
"""


def test_a_users_test_file_runs_with_the_plugin(
    pytester: pytest.Pytester, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNLANE_TEST_DATABASE_URL", database_url)
    pytester.makepyfile(test_billing=USER_TEST_FILE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


ZERO_DELAY = RetryPolicy(max_attempts=4, initial_delay=timedelta(0))


def test_due_retries_and_releases_run_until_the_run_completes(
    make_runlane: RunlaneFactory,
) -> None:
    attempts: list[int] = []

    @task(id="flaky", schema=Greet, retry=ZERO_DELAY)
    def flaky(payload: Greet, context: RunContext) -> str:
        attempts.append(context.attempt)
        if context.attempt == 1:
            context.release()  # handed back, due now: the next pass runs it again
        if context.attempt < 4:
            raise RuntimeError("not yet")
        return f"hi {payload.name}"

    rl = make_runlane(tasks=[flaky])
    handle = rl.trigger(flaky, {"name": "ada"})
    result = run_until_idle(rl)
    run = rl.get_run(handle.id)
    assert (run.status, run.output) == (RunStatus.COMPLETED, "hi ada")
    assert attempts == [1, 2, 3, 4]
    assert (result.completed, result.retried, result.runs_executed) == (1, 2, 4)
    assert result.maintenance.due_runs_delivered >= 1


def test_children_and_completed_tokens_resume_their_parents(make_runlane: RunlaneFactory) -> None:
    @task(id="child", schema=Greet)
    def child(payload: Greet, context: RunContext) -> str:
        return payload.name.upper()

    @task(id="parent", schema=Greet)
    def parent(payload: Greet, context: RunContext) -> str:
        kid = context.trigger_child(child, {"name": payload.name})
        return str(context.wait_for_run(kid.id))

    rl = make_runlane(tasks=[child, parent])
    handle = rl.trigger(parent, {"name": "ada"})
    run_until_idle(rl)
    assert rl.get_run(handle.id).output == "ADA"


def test_future_work_does_not_keep_it_running(make_runlane: RunlaneFactory) -> None:
    @task(id="always-fails", schema=Greet, retry=HOUR_RETRY)
    def always_fails(payload: Greet, context: RunContext) -> None:
        raise RuntimeError("down")

    rl = make_runlane(tasks=[always_fails])
    handle = rl.trigger(always_fails, {"name": "x"})
    later = rl.trigger(always_fails, {"name": "y"}, delay=timedelta(hours=1))
    began = time.monotonic()
    result = run_until_idle(rl, due_within=0.5)
    assert time.monotonic() - began < 10
    assert result.runs_executed == 1
    assert rl.get_run(handle.id).status is RunStatus.RETRYING
    assert rl.get_run(later.id).status is RunStatus.QUEUED


def test_due_within_waits_for_short_retry_delays(make_runlane: RunlaneFactory) -> None:
    # 1.5 s: the first run_until_idle must end before the retry is due; at 300 ms it did not
    # always, on a 2-core machine running the suite's workers
    short = RetryPolicy(max_attempts=2, initial_delay=timedelta(seconds=1.5), jitter=0.0)

    @task(id="short-retry", schema=Greet, retry=short)
    def short_retry(payload: Greet, context: RunContext) -> int:
        if context.attempt == 1:
            raise RuntimeError("once")
        return context.attempt

    rl = make_runlane(tasks=[short_retry])
    first = rl.trigger(short_retry, {"name": "a"})
    run_until_idle(rl)  # the retry is due later than now: left for later
    assert rl.get_run(first.id).status is RunStatus.RETRYING
    run_until_idle(rl, due_within=5)
    assert rl.get_run(first.id).status is RunStatus.COMPLETED


def test_endless_work_is_an_error_not_a_hang(make_runlane: RunlaneFactory) -> None:
    @task(id="again", schema=Greet)
    def again(payload: Greet, context: RunContext) -> None:
        context.release()

    rl = make_runlane(tasks=[again])
    rl.trigger(again, {"name": "x"})
    with pytest.raises(RuntimeError, match="after 3 passes"):
        run_until_idle(rl, max_passes=3)


def test_bad_arguments_and_lanes_without_drain(database_url: str, schema: str) -> None:
    rl = create_runlane(
        lane=rabbitmq_lane(
            connection_string=database_url, schema=schema, amqp_url="amqp://127.0.0.1:1/"
        ),
        queues=[queue("default", default=True)],
    )
    try:
        with pytest.raises(ConfigurationError, match="drain"):
            run_until_idle(rl)
        with pytest.raises(ConfigurationError, match="max_passes"):
            run_until_idle(rl, max_passes=0)
        with pytest.raises(ConfigurationError, match="timeout"):
            run_until_idle(rl, timeout=0)
        with pytest.raises(ConfigurationError, match="due_within"):
            run_until_idle(rl, due_within=-1)
        # refused here, not a crash in threading.Timer (inf overflows it, NaN is no time)
        for timeout in (float("inf"), float("nan"), 10**400):
            with pytest.raises(ConfigurationError, match="timeout"):
                run_until_idle(rl, timeout=timeout)
        for due_within in (float("nan"), float("inf")):
            with pytest.raises(ConfigurationError, match="due_within"):
                run_until_idle(rl, due_within=due_within)
    finally:
        rl.close()
