"""One bad run must not stop a worker, nor be delivered again without end.

Each case used to kill the worker that took the run (the run then waited out its lease and
killed the next worker) or hand it back unspent forever. Now each fails its run, with the
cause in the run's error, and the worker goes on with the next run.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs
import psycopg
import pytest

from runlane import (
    ConfigurationError,
    RetryPolicy,
    RunContext,
    RunInterrupted,
    Runlane,
    RunStatus,
    StopReason,
    WorkerFailed,
    schedule,
    task,
)
from runlane.retry import next_retry_delay
from runlane.worker import Worker
from tests.conftest import RunlaneFactory
from tests.helpers import count_runs, q, wait_for_status, wait_until

if TYPE_CHECKING:
    from decimal import Decimal  # only for type checkers: at run time the name is unknown


@attrs.frozen
class Order:
    amount: int


@attrs.frozen
class OrderV2:
    amount: Amount  # type: ignore[name-defined]  # noqa: F821 - gone since v1 was stored


@attrs.frozen
class Invoice:
    total: Decimal


class Rows(dict[str, int]):
    """A mapping read through items(), as the JSON encoder reads a dict subclass."""

    def items(self) -> Any:
        raise RuntimeError("cursor closed")


class Weird(Exception):
    pass


Weird.__qualname__ = "Weird\x00Error"

TWICE = RetryPolicy(max_attempts=2, initial_delay=timedelta(0))


@task(id="ok")
def ok(payload: Any, context: RunContext) -> str:
    return "ok"


def _goes_on(runlane: Runlane, worker: Worker) -> None:
    """The worker is still up, and runs the next run."""
    assert runlane.wait_for_run(runlane.trigger(ok, None).id, timeout=15).output == "ok"
    assert not worker.closed
    worker.close(timeout=10)


def test_a_handler_that_stops_itself_consumes_its_attempts(make_runlane: RunlaneFactory) -> None:
    calls: list[int] = []

    @task(id="self.stop", retry=RetryPolicy(max_attempts=1))
    def self_stop(payload: str, context: RunContext) -> None:
        calls.append(context.attempt)
        if payload == "event":
            context.cancelled.set()  # its own stop flag
            context.raise_if_stopped()
        raise RunInterrupted(StopReason.SHUTDOWN, "pretend")

    runlane = make_runlane(tasks=[self_stop, ok])
    runs = [runlane.trigger(self_stop, kind).id for kind in ("event", "raise")]
    worker = runlane.create_delivery_worker(concurrency=2)
    for run_id in runs:
        failed = runlane.wait_for_run(run_id, timeout=15)
        assert failed.status is RunStatus.FAILED
        assert failed.error is not None
        assert failed.error.type == "runlane.RunInterrupted"
        assert failed.attempt == 1
    assert calls == [1, 1]  # not handed back unspent, again and again
    _goes_on(runlane, worker)


@pytest.mark.parametrize(
    ("returned", "cause"),
    [
        (lambda: Invoice(total=5), "NameError"),  # type: ignore[arg-type]  # an annotation imported for type checkers
        (lambda: Rows(a=1), "RuntimeError: cursor closed"),
    ],
    ids=["unresolved-annotation", "iteration-fails"],
)
def test_a_return_value_that_cannot_be_converted_fails_its_run(
    make_runlane: RunlaneFactory, returned: Any, cause: str
) -> None:
    @task(id="result", retry=TWICE)
    def result(payload: Any, context: RunContext) -> Any:
        return returned()

    runlane = make_runlane(tasks=[result, ok])
    worker = runlane.create_delivery_worker(concurrency=2)
    failed = runlane.wait_for_run(runlane.trigger(result, None).id, timeout=15)
    assert failed.status is RunStatus.FAILED
    assert failed.attempt == 1  # the handler would return it again
    assert failed.error is not None
    assert failed.error.type == "runlane._codec.OutputNotSerializable"
    assert cause in failed.error.message
    _goes_on(runlane, worker)


def test_a_stored_payload_the_new_schema_cannot_structure_fails_its_run(
    make_runlane: RunlaneFactory,
) -> None:
    old = make_runlane(tasks=[task(id="order", schema=Order)(lambda p, c: None)])
    stored = old.trigger("order", Order(amount=5)).id

    @task(id="order", schema=OrderV2, retry=TWICE)
    def order(payload: OrderV2, context: RunContext) -> None:
        raise AssertionError("the handler must not run")

    runlane = make_runlane(tasks=[order, ok])
    worker = runlane.create_delivery_worker(concurrency=2)
    failed = runlane.wait_for_run(stored, timeout=15)
    assert failed.status is RunStatus.FAILED
    assert failed.error is not None
    assert failed.error.type == "runlane.PayloadValidationError"
    assert "NameError: name 'Amount' is not defined" in failed.error.message
    _goes_on(runlane, worker)


def test_an_exception_type_whose_name_postgres_cannot_hold_is_stored_escaped(
    make_runlane: RunlaneFactory,
) -> None:
    @task(id="weird", retry=RetryPolicy(max_attempts=1))
    def weird(payload: Any, context: RunContext) -> None:
        raise Weird("boom")

    runlane = make_runlane(tasks=[weird, ok])
    worker = runlane.create_delivery_worker(concurrency=1)
    failed = runlane.wait_for_run(runlane.trigger(weird, None).id, timeout=15)
    assert failed.error is not None
    assert failed.error.type == "tests.test_poison.Weird\\x00Error"
    assert failed.error.message == "boom"
    _goes_on(runlane, worker)


def test_a_retry_delay_past_a_century_is_capped(make_runlane: RunlaneFactory) -> None:
    forever = RetryPolicy(
        max_attempts=3, initial_delay=timedelta(days=300_000_000), max_delay=timedelta.max
    )
    century = timedelta(days=36_525)
    for delay in (forever.delay_after(1), next_retry_delay(forever, 1, 3)):
        assert delay is not None
        assert century * (1 - forever.jitter) <= delay <= century

    @task(id="flaky", retry=forever)
    def flaky(payload: Any, context: RunContext) -> None:
        raise RuntimeError("later")

    runlane = make_runlane(tasks=[flaky, ok])
    worker = runlane.create_delivery_worker(concurrency=1)
    run_id = runlane.trigger(flaky, None).id
    wait_until(
        lambda: runlane.get_run(run_id).status is RunStatus.RETRYING,
        timeout=15,
        what="the failure to be written",
    )
    _goes_on(runlane, worker)


def test_handlers_that_ignore_their_timeout_hold_at_most_one_extra_slot_each(
    make_runlane: RunlaneFactory,
) -> None:
    release = threading.Event()

    @task(id="stuck", timeout=timedelta(milliseconds=200), retry=RetryPolicy(max_attempts=1))
    def stuck(payload: Any, context: RunContext) -> None:
        release.wait(30)  # ignores context.cancelled

    runlane = make_runlane(tasks=[stuck, ok])
    worker = runlane.create_delivery_worker(concurrency=2)
    stuck_runs = [runlane.trigger(stuck, n).id for n in range(8)]

    def slot_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith(f"{worker.name}-slot-")]

    # two slots abandoned and replaced; their replacements abandoned, and not replaced
    wait_until(
        lambda: sum(runlane.get_run(r).status is RunStatus.FAILED for r in stuck_runs) >= 4,
        timeout=15,
        what="four attempts to time out",
    )
    assert len(slot_threads()) == 4
    release.set()  # the handlers return: their slots close, the withheld ones start
    ended = [runlane.wait_for_run(run_id, timeout=30).status for run_id in stuck_runs]
    assert ended.count(RunStatus.FAILED) == 4  # timed out; the others returned in time
    assert ended.count(RunStatus.COMPLETED) == 4
    assert runlane.wait_for_run(runlane.trigger(ok, None).id, timeout=15).output == "ok"
    wait_until(lambda: len(slot_threads()) == 2, timeout=15, what="the extra slots to end")
    assert not worker.closed
    worker.close(timeout=10)
    assert slot_threads() == []


class Boom(BaseException):
    """A BaseException of the user's own, not an Exception."""


def _raise_cancelled() -> None:
    raise asyncio.CancelledError("leaked by a library's event loop")


def _raise_generator_exit() -> None:
    raise GeneratorExit("closed")


def _raise_boom() -> None:
    raise Boom("not an Exception")


LEAKS = pytest.mark.parametrize(
    ("leak", "error_type"),
    [
        (_raise_cancelled, "asyncio.exceptions.CancelledError"),
        (_raise_generator_exit, "GeneratorExit"),
        (_raise_boom, "tests.test_poison.Boom"),
    ],
    ids=["cancelled-error", "generator-exit", "own-base-exception"],
)


def _base_exception_task(leak: Callable[[], None], calls: list[int]) -> Any:
    @task(id="leaks", retry=TWICE)
    def leaks(payload: Any, context: RunContext) -> None:
        calls.append(context.attempt)
        leak()

    return leaks


def _failed_by(snapshot: Any, error_type: str) -> None:
    assert snapshot.status is RunStatus.FAILED
    assert snapshot.attempt == 2  # retried per its policy, like an exception
    assert snapshot.error is not None
    assert snapshot.error.type == error_type
    assert snapshot.error.retryable
    assert snapshot.error.traceback is not None
    assert "in leaks" in snapshot.error.traceback


@LEAKS
def test_a_base_exception_from_a_handler_fails_its_attempt_not_the_worker(
    make_runlane: RunlaneFactory, leak: Callable[[], None], error_type: str
) -> None:
    calls: list[int] = []
    leaks = _base_exception_task(leak, calls)
    runlane = make_runlane(tasks=[leaks, ok])
    bad = runlane.trigger(leaks, None, priority=10).id  # claimed first
    others = [runlane.trigger(ok, n).id for n in range(10)]
    worker = runlane.create_delivery_worker(concurrency=1)
    wait_for_status(runlane, bad, RunStatus.RETRYING, timeout=15)
    assert runlane.run_maintenance_once().due_runs_delivered == 1  # the retry is due at once
    _failed_by(runlane.wait_for_run(bad, timeout=15), error_type)
    assert calls == [1, 2]
    for run_id in others:
        assert runlane.wait_for_run(run_id, timeout=15).status is RunStatus.COMPLETED
    assert not worker.closed
    assert worker.failure is None
    worker.close(timeout=10)
    assert worker.wait_until_closed(timeout=10)  # a clean close: WorkerFailed is not raised


@LEAKS
def test_a_base_exception_from_a_handler_fails_its_attempt_in_a_drain(
    make_runlane: RunlaneFactory, leak: Callable[[], None], error_type: str
) -> None:
    calls: list[int] = []
    leaks = _base_exception_task(leak, calls)
    runlane = make_runlane(tasks=[leaks, ok])
    bad = runlane.trigger(leaks, None, priority=10).id
    others = [runlane.trigger(ok, n).id for n in range(10)]
    result = runlane.drain()  # does not raise
    assert (result.completed, result.retried, result.failed) == (10, 1, 0)
    assert runlane.run_maintenance_once().due_runs_delivered == 1  # the retry is due at once
    assert runlane.drain().failed == 1
    assert calls == [1, 2]
    _failed_by(runlane.get_run(bad), error_type)
    assert all(runlane.get_run(r).status is RunStatus.COMPLETED for r in others)


def test_keyboard_interrupt_from_a_handler_still_stops_the_worker(
    make_runlane: RunlaneFactory,
) -> None:
    @task(id="interrupted", retry=TWICE)
    def interrupted(payload: Any, context: RunContext) -> None:
        raise KeyboardInterrupt

    runlane = make_runlane(tasks=[interrupted, ok])
    runlane.trigger(interrupted, None)
    worker = runlane.create_delivery_worker(concurrency=1)
    with pytest.raises(WorkerFailed):
        worker.wait_until_closed(timeout=15)
    assert isinstance(worker.failure, KeyboardInterrupt)


# -- a producer must not pose as a child run (issue 26) ---------------------------------------


@task(id="pay.child", retry=RetryPolicy(max_attempts=1))
def pay_child(payload: dict[str, int], context: RunContext) -> dict[str, int]:
    return {"charged": payload["amount"]}


@task(id="pay.parent", retry=RetryPolicy(max_attempts=1))
def pay_parent(payload: dict[str, Any], context: RunContext) -> Any:
    """Charges through a child run (its key derived, or ``payload["key"]``) and waits."""
    options = {} if payload.get("key") is None else {"idempotency_key": payload["key"]}
    child = context.trigger_child(pay_child, {"amount": 10}, **options)
    return context.wait_for_run(child.id)


def children_of(db: psycopg.Connection[Any], schema: str, run_id: uuid.UUID) -> int:
    found = db.execute(
        q("select count(*) from {s}.runs where parent_run_id = %s", schema), (run_id,)
    )
    row = found.fetchone()
    assert row is not None
    return int(row[0])


def _forged_key(parent_id: uuid.UUID) -> str:
    return f"runlane.child:{parent_id}:1"


def test_a_producer_cannot_take_a_child_runs_key(
    make_runlane: RunlaneFactory, database_url: str, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[pay_parent, pay_child])
    parent = runlane.trigger(pay_parent, {}, delay=3600).id
    key = _forged_key(parent)
    forged = {"amount": 999999}
    with psycopg.connect(database_url) as conn:
        attempts: list[Callable[[], object]] = [
            lambda: runlane.trigger(pay_child, forged, idempotency_key=key),
            lambda: runlane.trigger_many(pay_child, [forged], idempotency_keys=[key]),
            lambda: runlane.trigger(pay_child, forged, idempotency_key=key, connection=conn),
            lambda: runlane.trigger_many(
                pay_child, [{"amount": 1}, forged], idempotency_keys=["mine", key], connection=conn
            ),
            lambda: runlane.trigger(pay_child, forged, idempotency_key="runlane."),
        ]
        for attempt in attempts:
            with pytest.raises(ConfigurationError, match="reserved for runlane's own keys"):
                attempt()
        conn.commit()
    assert count_runs(db, schema) == 1  # the parent only: nothing was written


# a schedule of the child's task whose slot is months away
forged_schedule = schedule(id="pay.forged", task=pay_child, cron="0 0 1 1 *", payload={"amount": 9})


def test_run_now_cannot_take_a_child_runs_key(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    """Issue 37: an operator who knows a parent's id ran a schedule of the child's task now
    under the parent's derived key first; the parent's trigger_child then failed on every
    attempt. Both paths of trigger_schedule_now refuse the key and write nothing."""
    app = make_runlane(tasks=[pay_parent, pay_child], schedules=[forged_schedule])
    parent = app.trigger(pay_parent, {}).id
    key = _forged_key(parent)
    # defined by this runtime but not stored yet: triggered like any run
    with pytest.raises(ConfigurationError, match="reserved for runlane's own keys"):
        app.trigger_schedule_now("pay.forged", idempotency_key=key)
    app.run_maintenance_once()  # stores the definition (fires nothing: the slot is months away)
    operator = make_runlane()  # as the operator CLI builds it: a database URL and nothing else
    for attempt in (key, "runlane."):
        with pytest.raises(ConfigurationError, match="reserved for runlane's own keys"):
            operator.trigger_schedule_now("pay.forged", idempotency_key=attempt)
    assert count_runs(db, schema) == 1  # the parent only: nothing was written
    app.drain()  # the parent waits for its child, the child runs, the parent re-runs
    app.drain()
    assert app.get_run(parent).output == {"charged": 10}
    assert operator.trigger_schedule_now("pay.forged", idempotency_key="incident-7").created


def test_the_run_now_function_refuses_a_child_runs_key_through_raw_sql(
    make_runlane: RunlaneFactory,
    db: psycopg.Connection[Any],
    schema: str,
    granted: Callable[[str], str],
) -> None:
    """The operator role may execute runlane_run_schedule itself (schema version 14; since
    version 26 its overload naming the audit action, which commits with the record)."""
    app = make_runlane(tasks=[pay_parent, pay_child], schedules=[forged_schedule])
    parent = app.trigger(pay_parent, {}, delay=3600).id
    app.run_maintenance_once()
    run_now = q(
        "select * from {s}.runlane_run_schedule('default', %s, %s, %s, null, 'run_schedule_now')",
        schema,
    )
    record = q(
        "insert into {s}.audit_log (id, action_id, environment, via, action, target, changed) "
        "values (gen_random_uuid(), gen_random_uuid(), 'default', 'api', 'run_schedule_now', "
        "'pay.forged', true)",
        schema,
    )
    with psycopg.connect(granted("operator"), autocommit=True) as conn:
        for key in (_forged_key(parent), "runlane."):
            with pytest.raises(psycopg.errors.InvalidParameterValue, match="reserved"):
                conn.execute(run_now, ("pay.forged", uuid.uuid4(), key))
        assert count_runs(db, schema) == 1  # the parent only: nothing was written
        with conn.transaction():
            made = conn.execute(run_now, ("pay.forged", uuid.uuid4(), "incident-8")).fetchall()
            conn.execute(record)
    assert [row[1:] for row in made] == [("pay.child", "default", True)]


def test_create_wait_token_refuses_runlanes_keys(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane()
    for key in ("runlane.child:x:1", "runlane."):
        with pytest.raises(ConfigurationError, match="reserved for runlane's own keys"):
            runlane.create_wait_token(idempotency_key=key)
    assert db.execute(q("select count(*) from {s}.wait_tokens", schema)).fetchone() == (0,)
    assert runlane.create_wait_token(idempotency_key="runlane-mine").status.value == "pending"


@pytest.mark.parametrize("forged_parent", ["none", "another run"])
def test_a_run_holding_a_childs_derived_key_is_not_adopted(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, forged_parent: str
) -> None:
    runlane = make_runlane(tasks=[pay_parent, pay_child, ok])
    parent = runlane.trigger(pay_parent, {}).id
    other = runlane.trigger(ok, None, delay=3600).id
    forged = runlane.trigger(pay_child, {"amount": 999999}, delay=3600).id
    # written straight into the table (as a row written before runlane reserved its keys)
    db.execute(
        q("update {s}.runs set idempotency_key = %s, parent_run_id = %s where id = %s", schema),
        (_forged_key(parent), other if forged_parent == "another run" else None, forged),
    )
    runlane.drain()
    snap = runlane.get_run(parent)
    assert snap.status is RunStatus.FAILED
    assert snap.error is not None
    assert snap.error.type == "runlane.RunStateConflict"
    assert f"did not adopt run {forged}" in snap.error.message
    assert runlane.get_run(forged).status is RunStatus.QUEUED  # never charged as the child
    assert children_of(db, schema, parent) == 0


def test_trigger_child_does_not_adopt_a_producers_run_with_the_same_key(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[pay_parent, pay_child])
    theirs = runlane.trigger(pay_child, {"amount": 999999}, idempotency_key="order-1", delay=3600)
    parent = runlane.trigger(pay_parent, {"key": "order-1"}).id
    runlane.drain()
    snap = runlane.get_run(parent)
    assert snap.status is RunStatus.FAILED
    assert snap.error is not None
    assert snap.error.type == "runlane.RunStateConflict"
    assert f"did not adopt run {theirs.id}" in snap.error.message
    assert children_of(db, schema, parent) == 0


def test_a_child_run_is_still_found_again_on_a_re_run(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[pay_parent, pay_child])
    for key in (None, "order-2"):
        parent = runlane.trigger(pay_parent, {"key": key}).id
        runlane.drain()  # the parent waits for its child, the child runs, the parent re-runs
        runlane.drain()
        assert runlane.get_run(parent).output == {"charged": 10}
        assert children_of(db, schema, parent) == 1


# -- names and keys a handler gives its context (issue 26) ------------------------------------

BAD_NAMES = [
    ("", "non-empty string"),
    ("a\x00b", "NUL character"),
    ("a\ud800b", "lone surrogate"),
    ("x" * 10_000, "a string of 10,000 characters"),
    (object(), "non-empty string"),
    (7, "non-empty string"),
]


def _named_calls(context: RunContext, name: Any) -> list[Callable[[], object]]:
    return [
        lambda: context.step(name, lambda: 1),
        lambda: context.sleep(0, name=name),
        lambda: context.trigger_child(ok, None, idempotency_key=name),
    ]


@task(id="bad.names", retry=RetryPolicy(max_attempts=1))
def bad_names(payload: str, context: RunContext) -> list[str]:
    refused: list[str] = []
    for name, _ in BAD_NAMES:
        for call in _named_calls(context, name):
            try:
                call()
            except ConfigurationError as exc:
                refused.append(str(exc))
            else:
                refused.append("accepted")
    for call in (
        lambda: context.step("runlane.mine", lambda: 1),
        lambda: context.trigger_child(ok, None, idempotency_key="runlane.child:x:1"),
    ):
        try:
            call()
        except ConfigurationError as exc:
            refused.append(str(exc))
    return refused


def test_bad_step_sleep_and_child_names_are_refused_at_call_time(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[bad_names, ok])
    run_id = runlane.trigger(bad_names, "").id
    assert runlane.drain(queues=["default"]).completed == 1
    refused = runlane.get_run(run_id).output
    assert len(refused) == 3 * len(BAD_NAMES) + 2
    for index, (_, words) in enumerate(BAD_NAMES):
        for message in refused[3 * index : 3 * index + 3]:
            assert words in message, message
            assert len(message) < 600  # a 10,000-character name is not repeated whole
    assert "reserved for runlane's own steps" in refused[-2]
    assert "reserved for runlane's own keys" in refused[-1]
    assert count_runs(db, schema) == 1  # no child
    steps = db.execute(q("select count(*) from {s}.steps where run_id = %s", schema), (run_id,))
    assert steps.fetchone() == (0,)  # no step, no sleep stored
