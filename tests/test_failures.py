"""Failing handlers: retries, backoff, terminal failures, bad outputs and due delivery."""

from __future__ import annotations

import random
import uuid
from datetime import timedelta
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from runlane import (
    ConfigurationError,
    MaintenanceLimits,
    MaintenanceResult,
    NonRetryableError,
    RetryPolicy,
    RunContext,
    RunStatus,
    Task,
    task,
)
from runlane.testing import MovableClock
from tests.conftest import RunlaneFactory
from tests.helpers import run_row

NO_DELAY = RetryPolicy(
    max_attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0), jitter=0.0
)
HOUR_DELAY = RetryPolicy(
    max_attempts=3, initial_delay=timedelta(hours=1), max_delay=timedelta(hours=1), jitter=0.0
)


@attrs.frozen
class Job:
    name: str


class Boom(Exception):
    pass


class Fatal(NonRetryableError):
    pass


def attempt_records(
    db: psycopg.Connection[Any], schema: str, run_id: uuid.UUID
) -> list[dict[str, Any]]:
    """Every column of every attempt of the run, in order; ``tests.helpers.attempt_rows``
    reads only ``(attempt, outcome)``."""
    with db.cursor(row_factory=dict_row) as cur:
        cur.execute(
            sql.SQL("select * from {}.attempts where run_id = %s order by attempt").format(
                sql.Identifier(schema)
            ),
            (run_id,),
        )
        return cur.fetchall()


def failing_task(
    attempts: list[int], retry: RetryPolicy, *, succeed_on: int | None = None
) -> Task[Job, str]:
    """A task that raises Boom on every attempt before ``succeed_on``."""

    @task(id="flaky", schema=Job, retry=retry)
    def flaky(payload: Job, context: RunContext) -> str:
        attempts.append(context.attempt)
        if succeed_on is not None and context.attempt >= succeed_on:
            return f"ok on {context.attempt}"
        raise Boom(f"boom {payload.name} #{context.attempt}")

    return flaky


# -- retrying -------------------------------------------------------------------------------


def test_raising_handler_is_retrying_with_delay_from_policy(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    attempts: list[int] = []
    policy = RetryPolicy(
        max_attempts=3,
        initial_delay=timedelta(seconds=30),
        max_delay=timedelta(minutes=5),
        jitter=0.0,
    )
    flaky = failing_task(attempts, policy)
    runlane = make_runlane(tasks=[flaky])
    handle = runlane.trigger(flaky, Job(name="x"))
    assert runlane.drain().runs_executed == 1
    assert attempts == [1]

    row = run_row(db, schema, handle.id)
    assert row["status"] == "retrying"
    # due_at and updated_at are both the database's now() of the failing write
    assert row["due_at"] - row["updated_at"] == timedelta(seconds=30)
    assert row["due_at"] > row["db_now"]
    assert row["lease_token"] is None
    assert row["lease_expires_at"] is None

    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.RETRYING
    assert snap.attempt == 1
    assert snap.finished_at is None
    assert snap.output is None
    assert snap.error is not None
    assert snap.error.type == f"{__name__}.Boom"
    assert snap.error.message == "boom x #1"
    assert snap.error.traceback is not None
    assert "Boom: boom x #1" in snap.error.traceback
    assert "raise Boom" in snap.error.traceback
    assert snap.error.retryable is True
    # a not-yet-due retry keeps nothing running
    assert runlane.drain().runs_executed == 0


def test_retry_delay_is_jittered_within_bounds(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    attempts: list[int] = []
    policy = RetryPolicy(
        max_attempts=2,
        initial_delay=timedelta(seconds=100),
        max_delay=timedelta(hours=1),
        jitter=0.2,
    )
    flaky = failing_task(attempts, policy)
    runlane = make_runlane(tasks=[flaky])
    handles = runlane.trigger_many(flaky, [Job(name=str(i)) for i in range(5)])
    assert runlane.drain().runs_executed == 5
    for handle in handles:
        row = run_row(db, schema, handle.id)
        assert row["status"] == "retrying"
        waited = row["due_at"] - row["updated_at"]
        assert timedelta(seconds=80) <= waited <= timedelta(seconds=120)


def test_retry_delay_grows_per_attempt_and_is_capped(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, clock: MovableClock
) -> None:
    attempts: list[int] = []
    policy = RetryPolicy(
        max_attempts=4,
        initial_delay=timedelta(seconds=30),
        max_delay=timedelta(seconds=100),
        multiplier=3.0,
        jitter=0.0,
    )
    flaky = failing_task(attempts, policy)
    runlane = make_runlane(tasks=[flaky])
    handle = runlane.trigger(flaky, Job(name="x"))
    waits = []
    for _ in range(3):
        assert runlane.drain().runs_executed == 1
        row = run_row(db, schema, handle.id)
        assert row["status"] == "retrying"
        waits.append(row["due_at"] - row["updated_at"])
        clock.advance(waits[-1].total_seconds())
        assert runlane.run_maintenance_once().due_runs_delivered == 1
    assert waits == [timedelta(seconds=30), timedelta(seconds=90), timedelta(seconds=100)]
    assert attempts == [1, 2, 3]


def test_maintenance_delivers_due_retry_and_drain_runs_attempt_two(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    attempts: list[int] = []
    flaky = failing_task(attempts, NO_DELAY, succeed_on=2)
    runlane = make_runlane(tasks=[flaky])
    handle = runlane.trigger(flaky, Job(name="x"))
    assert runlane.drain().runs_executed == 1
    assert runlane.get_run(handle.id).status is RunStatus.RETRYING
    # drain does not deliver retries itself
    assert runlane.drain().runs_executed == 0

    result = runlane.run_maintenance_once()
    assert isinstance(result, MaintenanceResult)
    assert result.due_runs_delivered == 1
    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.QUEUED
    assert snap.attempt == 1

    assert runlane.drain().runs_executed == 1
    assert attempts == [1, 2]
    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.attempt == 2
    assert snap.output == "ok on 2"
    assert snap.error is None
    assert snap.finished_at is not None
    assert runlane.run_maintenance_once().due_runs_delivered == 0


def test_run_fails_after_max_attempts(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    attempts: list[int] = []
    flaky = failing_task(attempts, NO_DELAY)
    runlane = make_runlane(tasks=[flaky])
    handle = runlane.trigger(flaky, Job(name="x"))
    for expected_attempt in (1, 2):
        assert runlane.drain().runs_executed == 1
        assert runlane.get_run(handle.id).status is RunStatus.RETRYING
        assert runlane.get_run(handle.id).attempt == expected_attempt
        assert runlane.run_maintenance_once().due_runs_delivered == 1
    assert runlane.drain().runs_executed == 1
    assert attempts == [1, 2, 3]

    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.FAILED
    assert snap.is_terminal
    assert snap.attempt == 3
    assert snap.finished_at is not None
    assert snap.error is not None
    assert snap.error.message == "boom x #3"
    row = run_row(db, schema, handle.id)
    assert row["finished_at"] <= row["db_now"]
    assert row["lease_token"] is None

    assert runlane.run_maintenance_once().due_runs_delivered == 0
    assert runlane.drain().runs_executed == 0
    assert attempts == [1, 2, 3]


def test_max_attempts_override_of_one_fails_at_once(make_runlane: RunlaneFactory) -> None:
    attempts: list[int] = []
    flaky = failing_task(attempts, NO_DELAY)
    runlane = make_runlane(tasks=[flaky])
    handle = runlane.trigger(flaky, Job(name="x"), max_attempts=1)
    assert runlane.drain().runs_executed == 1
    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.FAILED
    assert snap.attempt == 1
    assert snap.finished_at is not None
    assert runlane.run_maintenance_once().due_runs_delivered == 0


@pytest.mark.parametrize("exc_type", [NonRetryableError, Fatal], ids=lambda t: t.__name__)
def test_non_retryable_error_fails_at_once(
    make_runlane: RunlaneFactory,
    db: psycopg.Connection[Any],
    schema: str,
    exc_type: type[NonRetryableError],
) -> None:
    attempts: list[int] = []

    @task(id="doomed", schema=Job, retry=RetryPolicy(max_attempts=5))
    def doomed(payload: Job, context: RunContext) -> None:
        attempts.append(context.attempt)
        raise exc_type("card declined")

    runlane = make_runlane(tasks=[doomed])
    handle = runlane.trigger(doomed, Job(name="x"))
    before = run_row(db, schema, handle.id)
    assert runlane.drain().runs_executed == 1
    assert attempts == [1]
    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.FAILED
    assert snap.attempt == 1
    assert snap.max_attempts == 5
    assert snap.finished_at is not None
    assert snap.due_at == before["due_at"]
    assert snap.error is not None
    assert snap.error.type.endswith(exc_type.__name__)
    assert snap.error.message == "card declined"
    assert snap.error.retryable is False
    assert snap.error.traceback is not None
    assert runlane.run_maintenance_once().due_runs_delivered == 0
    assert runlane.drain().runs_executed == 0
    assert attempts == [1]


@attrs.frozen
class JobV2:
    title: str


def test_stored_payload_that_no_longer_fits_fails_without_running(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    calls: list[str] = []

    @task(id="evolving", schema=Job)
    def v1(payload: Job, context: RunContext) -> None:
        calls.append("v1")

    @task(id="evolving", schema=JobV2)
    def v2(payload: JobV2, context: RunContext) -> None:
        calls.append("v2")

    old = make_runlane(tasks=[v1])
    new = make_runlane(tasks=[v2])
    handle = old.trigger(v1, Job(name="x"), max_attempts=5)
    assert new.drain().runs_executed == 0  # no handler ran
    assert calls == []
    snap = new.get_run(handle.id)
    assert snap.status is RunStatus.FAILED
    assert snap.attempt == 1
    assert snap.error is not None
    assert "PayloadValidationError" in snap.error.type
    assert "evolving" in snap.error.message
    assert snap.error.retryable is False
    assert new.run_maintenance_once().due_runs_delivered == 0


# -- outputs that cannot be stored ----------------------------------------------------------


@pytest.mark.parametrize(
    "bad_output",
    [object(), {object()}, float("nan"), float("inf"), {"ok": [1, object()]}],
    ids=["object", "set-of-objects", "nan", "inf", "nested-object"],
)
def test_unserializable_output_fails_the_run_and_drain_goes_on(
    make_runlane: RunlaneFactory, bad_output: Any
) -> None:
    @task(id="bad.output", schema=Job, retry=RetryPolicy(max_attempts=5))
    def bad(payload: Job, context: RunContext) -> Any:
        return bad_output

    @task(id="good.output", schema=Job)
    def good(payload: Job, context: RunContext) -> dict[str, str]:
        return {"name": payload.name}

    runlane = make_runlane(tasks=[bad, good])
    bad_handle = runlane.trigger(bad, Job(name="b"))
    good_handle = runlane.trigger(good, Job(name="g"))
    assert runlane.drain().runs_executed == 2

    snap = runlane.get_run(bad_handle.id)
    assert snap.status is RunStatus.FAILED
    assert snap.attempt == 1
    assert snap.output is None
    assert snap.error is not None
    assert "OutputNotSerializable" in snap.error.type
    assert "cannot be stored as JSON" in snap.error.message
    assert type(bad_output).__name__ in snap.error.message
    assert runlane.get_run(good_handle.id).status is RunStatus.COMPLETED
    assert runlane.get_run(good_handle.id).output == {"name": "g"}


def test_output_with_nul_character_fails_the_run_and_drain_goes_on(
    make_runlane: RunlaneFactory,
) -> None:
    @task(id="nul.output", schema=Job)
    def nul(payload: Job, context: RunContext) -> str:
        return "a\x00b"

    @task(id="good.output", schema=Job)
    def good(payload: Job, context: RunContext) -> str:
        return "fine"

    runlane = make_runlane(tasks=[nul, good])
    nul_handle = runlane.trigger(nul, Job(name="n"))
    good_handle = runlane.trigger(good, Job(name="g"))
    assert runlane.drain().runs_executed == 2
    assert runlane.get_run(nul_handle.id).status is RunStatus.FAILED
    assert runlane.get_run(good_handle.id).status is RunStatus.COMPLETED


def test_error_message_with_nul_character_is_recorded(make_runlane: RunlaneFactory) -> None:
    @task(id="nul.error", schema=Job, retry=NO_DELAY)
    def nul(payload: Job, context: RunContext) -> None:
        raise Boom("bad\x00byte")

    runlane = make_runlane(tasks=[nul])
    handle = runlane.trigger(nul, Job(name="n"))
    assert runlane.drain().runs_executed == 1
    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.RETRYING
    assert snap.error is not None
    assert snap.error.message.startswith("bad")


# -- due delivery ---------------------------------------------------------------------------


def test_retry_not_yet_due_is_not_delivered(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, clock: MovableClock
) -> None:
    attempts: list[int] = []
    flaky = failing_task(attempts, HOUR_DELAY)
    runlane = make_runlane(tasks=[flaky])
    handle = runlane.trigger(flaky, Job(name="x"))
    assert runlane.drain().runs_executed == 1
    assert runlane.run_maintenance_once().due_runs_delivered == 0
    assert runlane.get_run(handle.id).status is RunStatus.RETRYING
    assert runlane.drain().runs_executed == 0
    assert attempts == [1]
    # once its time has come, the same pass delivers it
    clock.advance(HOUR_DELAY.initial_delay.total_seconds())
    assert runlane.run_maintenance_once().due_runs_delivered == 1
    assert runlane.get_run(handle.id).status is RunStatus.QUEUED


def test_due_delivery_limit(make_runlane: RunlaneFactory) -> None:
    attempts: list[int] = []
    flaky = failing_task(attempts, NO_DELAY)
    runlane = make_runlane(tasks=[flaky])
    handles = runlane.trigger_many(flaky, [Job(name="a"), Job(name="b")])
    assert runlane.drain().runs_executed == 2

    zero = MaintenanceLimits(due_delivery_limit=0)
    assert runlane.run_maintenance_once(zero).due_runs_delivered == 0
    assert all(runlane.get_run(h.id).status is RunStatus.RETRYING for h in handles)
    one = MaintenanceLimits(due_delivery_limit=1)
    assert runlane.run_maintenance_once(one).due_runs_delivered == 1
    states = sorted(runlane.get_run(h.id).status for h in handles)
    assert states == [RunStatus.QUEUED, RunStatus.RETRYING]
    assert runlane.run_maintenance_once(one).due_runs_delivered == 1
    assert runlane.run_maintenance_once(one).due_runs_delivered == 0
    assert all(runlane.get_run(h.id).status is RunStatus.QUEUED for h in handles)


def test_maintenance_is_scoped_to_its_environment(make_runlane: RunlaneFactory) -> None:
    attempts: list[int] = []
    flaky = failing_task(attempts, NO_DELAY)
    blue = make_runlane(tasks=[flaky], environment="blue")
    green = make_runlane(tasks=[flaky], environment="green")
    handle = blue.trigger(flaky, Job(name="x"))
    assert blue.drain().runs_executed == 1
    assert green.run_maintenance_once().due_runs_delivered == 0
    assert blue.get_run(handle.id).status is RunStatus.RETRYING
    assert blue.run_maintenance_once().due_runs_delivered == 1


@pytest.mark.parametrize("field", [f.name for f in attrs.fields(MaintenanceLimits)])
@pytest.mark.parametrize("limit", [-1, True, 1.5, "10"], ids=repr)
def test_invalid_maintenance_limits(field: str, limit: Any) -> None:
    with pytest.raises(ConfigurationError, match=field):
        MaintenanceLimits(**{field: limit})


def test_run_maintenance_once_rejects_other_limits(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane()
    with pytest.raises(ConfigurationError, match="MaintenanceLimits"):
        runlane.run_maintenance_once({"due_delivery_limit": 1})  # type: ignore[arg-type]


# -- attempt history ------------------------------------------------------------------------


def test_attempts_table_has_one_row_per_finished_attempt(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    attempts: list[int] = []
    flaky = failing_task(attempts, NO_DELAY, succeed_on=3)

    @task(id="fatal", schema=Job)
    def fatal(payload: Job, context: RunContext) -> None:
        raise Fatal("no")

    runlane = make_runlane(tasks=[flaky, fatal])
    handle = runlane.trigger(flaky, Job(name="x"))
    doomed = runlane.trigger(fatal, Job(name="y"))
    assert attempt_records(db, schema, handle.id) == []

    assert runlane.drain().runs_executed == 2
    assert runlane.run_maintenance_once().due_runs_delivered == 1
    assert runlane.drain().runs_executed == 1
    assert runlane.run_maintenance_once().due_runs_delivered == 1
    assert runlane.drain().runs_executed == 1
    assert runlane.get_run(handle.id).status is RunStatus.COMPLETED

    rows = attempt_records(db, schema, handle.id)
    assert [(r["attempt"], r["outcome"]) for r in rows] == [
        (1, "retrying"),
        (2, "retrying"),
        (3, "completed"),
    ]
    assert len({r["lease_token"] for r in rows}) == 3
    assert all(r["started_at"] <= r["finished_at"] for r in rows)
    assert rows[0]["error"]["message"] == "boom x #1"
    assert rows[1]["error"]["message"] == "boom x #2"
    assert rows[2]["error"] is None
    assert rows[0]["finished_at"] <= rows[1]["started_at"]
    assert rows[1]["finished_at"] <= rows[2]["started_at"]

    doomed_rows = attempt_records(db, schema, doomed.id)
    assert [(r["attempt"], r["outcome"]) for r in doomed_rows] == [(1, "failed")]
    assert doomed_rows[0]["error"]["type"].endswith("Fatal")


# -- RetryPolicy ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": -3}, "max_attempts"),
        ({"initial_delay": timedelta(seconds=-1)}, "initial_delay"),
        ({"initial_delay": timedelta(minutes=2), "max_delay": timedelta(minutes=1)}, "max_delay"),
        ({"jitter": 1.5}, "jitter"),
        ({"jitter": -0.1}, "jitter"),
        ({"jitter": float("nan")}, "jitter"),
        ({"multiplier": 0.5}, "multiplier"),
    ],
    ids=[
        "max_attempts-0",
        "max_attempts-negative",
        "negative-delay",
        "max-below-initial",
        "jitter-above-1",
        "jitter-negative",
        "jitter-nan",
        "multiplier-below-1",
    ],
)
def test_retry_policy_validation(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        RetryPolicy(**options)


@pytest.mark.parametrize(
    "options",
    [
        {"max_attempts": 2.5},
        {"max_attempts": True},
        {"initial_delay": 5},
        {"multiplier": float("nan")},
    ],
    ids=["float-attempts", "bool-attempts", "number-delay", "nan-multiplier"],
)
def test_retry_policy_rejects_wrong_types(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(**options)


def test_retry_policy_validation_applies_to_evolve() -> None:
    with pytest.raises(ConfigurationError, match="max_attempts"):
        attrs.evolve(RetryPolicy(), max_attempts=0)


def test_retry_policy_boundaries_are_accepted() -> None:
    policy = RetryPolicy(
        max_attempts=1,
        initial_delay=timedelta(0),
        max_delay=timedelta(0),
        multiplier=1.0,
        jitter=1.0,
    )
    assert policy.delay_after(1, random.Random(0)) == timedelta(0)


def test_delay_after_is_exponential_and_capped() -> None:
    policy = RetryPolicy(
        max_attempts=10,
        initial_delay=timedelta(seconds=1),
        max_delay=timedelta(seconds=10),
        multiplier=2.0,
        jitter=0.0,
    )
    rng = random.Random(1234)
    delays = [policy.delay_after(n, rng) for n in range(1, 7)]
    assert delays == [timedelta(seconds=s) for s in (1, 2, 4, 8, 10, 10)]
    assert policy.delay_after(10_000, rng) == timedelta(seconds=10)


def test_delay_after_with_multiplier_one_is_constant() -> None:
    policy = RetryPolicy(initial_delay=timedelta(seconds=3), multiplier=1.0, jitter=0.0)
    assert {policy.delay_after(n) for n in range(1, 20)} == {timedelta(seconds=3)}


def test_delay_after_jitter_is_bounded_and_seeded() -> None:
    policy = RetryPolicy(
        initial_delay=timedelta(seconds=10),
        max_delay=timedelta(hours=1),
        multiplier=2.0,
        jitter=0.5,
    )
    first = [policy.delay_after(n, random.Random(7)) for n in range(1, 6)]
    again = [policy.delay_after(n, random.Random(7)) for n in range(1, 6)]
    assert first == again
    for n, delay in enumerate(first, start=1):
        base = 10 * 2 ** (n - 1)
        assert timedelta(seconds=base * 0.5) <= delay <= timedelta(seconds=base * 1.5)
    rng = random.Random(99)
    spread = {policy.delay_after(1, rng) for _ in range(50)}
    assert len(spread) > 1
    assert all(timedelta(seconds=5) <= d <= timedelta(seconds=15) for d in spread)


def test_delay_after_jitter_never_exceeds_the_cap() -> None:
    policy = RetryPolicy(
        initial_delay=timedelta(seconds=10), max_delay=timedelta(seconds=10), jitter=1.0
    )
    rng = random.Random(3)
    assert all(policy.delay_after(n, rng) <= timedelta(seconds=10) for n in range(1, 200))


@pytest.mark.parametrize("attempt", [0, -1])
def test_delay_after_rejects_attempts_below_one(attempt: int) -> None:
    with pytest.raises(ValueError, match="attempt"):
        RetryPolicy().delay_after(attempt)


def test_delay_after_large_multiplier_is_capped_not_overflowing() -> None:
    policy = RetryPolicy(
        max_attempts=100,
        initial_delay=timedelta(seconds=1),
        max_delay=timedelta(hours=1),
        multiplier=1e6,
        jitter=0.0,
    )
    assert policy.delay_after(60) == timedelta(hours=1)
