"""Cancellation in every status (SPEC sections 1 and 2): ``Runlane.cancel``.

Queued, retrying, released and waiting runs are cancelled at once; a running run becomes
``cancellation_requested``, its handler is told (NOTIFY, or the lease extension when nothing
listens) and the run ends ``cancelled`` when the handler stops (raises, suspends) or, if its
worker died, when maintenance finalizes the lapsed lease; a handler that returns normally has
completed its run, whatever stop was asked. Everything runs against a real database with a real
worker, ``drain`` or maintenance; every wait is bounded.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from runlane import (
    CancelResult,
    ChildRunFailed,
    NonRetryableError,
    RunContext,
    Runlane,
    RunNotFound,
    RunStatus,
    WaitTokenStatus,
    queue,
    task,
)
from runlane.storage import Completion
from runlane.testing import MovableClock
from tests.conftest import RunlaneFactory
from tests.helpers import (
    HOUR_RETRY,
    attempt_rows,
    handler_key,
    listener_ready,
    q,
    run_row,
    storage_of,
    wait_for_status,
    wait_until,
)

# past every delay the runs of these tests have (moved on the runtime's clock)
DAY = 86400.0


class Boom(Exception):
    pass


# -- what handlers saw -----------------------------------------------------------------------


class Journal:
    """Counters, values and events written by handlers, keyed by strings; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._values: dict[str, Any] = {}
        self._events: dict[str, threading.Event] = {}

    def bump(self, key: str) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def count(self, key: str) -> int:
        with self._lock:
            return self._counts.get(key, 0)

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._values[key] = value

    def get(self, key: str) -> Any:
        with self._lock:
            return self._values[key]

    def event(self, key: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(key, threading.Event())


JOURNAL = Journal()


# -- tasks -----------------------------------------------------------------------------------

kids = queue("kids")


@task(id="cancel.noop")
def noop(payload: dict[str, Any], context: RunContext) -> str:
    JOURNAL.bump(handler_key(context.run_id))
    return "done"


@task(id="cancel.refuse")
def refuse(payload: dict[str, Any], context: RunContext) -> None:
    raise NonRetryableError("never")


@task(id="cancel.flaky", retry=HOUR_RETRY)
def flaky(payload: dict[str, Any], context: RunContext) -> None:
    JOURNAL.bump(handler_key(context.run_id))
    raise Boom("try again in an hour")


@task(id="cancel.releaser")
def releaser(payload: dict[str, Any], context: RunContext) -> None:
    JOURNAL.bump(handler_key(context.run_id))
    context.release(delay=60)


@task(id="cancel.await_token")
def await_token(payload: dict[str, Any], context: RunContext) -> Any:
    JOURNAL.bump(handler_key(context.run_id))
    return context.wait_for_token(payload["token"])


@task(id="cancel.sleeper")
def sleeper(payload: dict[str, Any], context: RunContext) -> str:
    JOURNAL.bump(handler_key(context.run_id))
    context.sleep(60)
    return "woke"


@task(id="cancel.long")
def long_handler(payload: dict[str, Any], context: RunContext) -> dict[str, Any]:
    """Waits (at most 10 s) to be cancelled, notes when, then waits to be let go and, when
    the payload says so, stops as asked (``raise_if_stopped``) or calls a durable operation
    while its cancellation is pending; else it returns normally."""
    JOURNAL.bump(handler_key(context.run_id))
    JOURNAL.event(f"started:{context.run_id}").set()
    seen = context.cancelled.wait(10)
    JOURNAL.put(f"seen:{context.run_id}", (seen, time.monotonic()))
    JOURNAL.event(f"seen:{context.run_id}").set()
    JOURNAL.event(f"let_go:{context.run_id}").wait(10)
    then = payload.get("then")
    if then == "stop":
        context.raise_if_stopped()
    elif then == "wait_for_token":
        context.wait_for_token(payload["token"])
    elif then == "sleep":
        context.sleep(60)
    elif then == "release":
        context.release(delay=60)
    return {"cancelled_seen": seen}


@task(id="cancel.child", queue="kids")
def child(payload: dict[str, Any], context: RunContext) -> str:
    return "child output"


@task(id="cancel.parent")
def parent(payload: dict[str, Any], context: RunContext) -> dict[str, Any]:
    JOURNAL.bump(handler_key(context.run_id))
    handle = context.trigger_child(child, {})
    JOURNAL.put(f"child:{context.run_id}", handle.id)
    try:
        out = context.wait_for_run(handle.id)
    except ChildRunFailed as exc:
        return {"failed": exc.status, "run": str(exc.run_id)}
    return {"output": out}


# -- helpers ---------------------------------------------------------------------------------


def assert_cancelled_at_once(rl: Runlane, run_id: uuid.UUID, previous: RunStatus) -> None:
    result = rl.cancel(run_id)
    assert result == CancelResult(
        run_id=run_id, previous=previous, status=RunStatus.CANCELLED, changed=True
    )
    snap = rl.get_run(run_id)
    assert snap.status is RunStatus.CANCELLED
    assert snap.finished_at is not None


def assert_nothing_runs_it(rl: Runlane, run_id: uuid.UUID) -> None:
    """Neither maintenance nor a drain brings a cancelled run back."""
    before = rl.get_run(run_id)
    result = rl.run_maintenance_once()
    assert result.due_runs_delivered == 0
    assert result.wait_token_runs_resumed == 0
    assert rl.drain().runs_executed == 0
    assert rl.get_run(run_id) == before


# -- runs that are not executing: cancelled at once ------------------------------------------


@pytest.mark.parametrize("delay", [None, 3600], ids=["due", "delayed"])
def test_cancel_a_queued_run(
    make_runlane: RunlaneFactory,
    db: psycopg.Connection[Any],
    schema: str,
    delay: int | None,
    clock: MovableClock,
) -> None:
    rl = make_runlane(tasks=[noop])
    handle = rl.trigger(noop, {}, delay=delay)
    assert_cancelled_at_once(rl, handle.id, RunStatus.QUEUED)
    clock.advance(DAY)
    assert_nothing_runs_it(rl, handle.id)
    assert JOURNAL.count(handler_key(handle.id)) == 0
    assert attempt_rows(db, schema, handle.id) == []
    snap = rl.get_run(handle.id)
    assert (snap.attempt, snap.output, snap.error, snap.started_at) == (0, None, None, None)


def test_cancel_a_retrying_run(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, clock: MovableClock
) -> None:
    rl = make_runlane(tasks=[flaky])
    handle = rl.trigger(flaky, {})
    assert rl.drain().runs_executed == 1
    assert rl.get_run(handle.id).status is RunStatus.RETRYING
    assert_cancelled_at_once(rl, handle.id, RunStatus.RETRYING)
    snap = rl.get_run(handle.id)
    assert snap.error is not None
    assert snap.error.type.endswith("Boom")  # the last attempt's error is kept
    clock.advance(DAY)
    assert_nothing_runs_it(rl, handle.id)
    assert JOURNAL.count(handler_key(handle.id)) == 1
    assert attempt_rows(db, schema, handle.id) == [(1, "retrying")]


def test_cancel_a_released_run(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, clock: MovableClock
) -> None:
    rl = make_runlane(tasks=[releaser])
    handle = rl.trigger(releaser, {})
    assert rl.drain().runs_executed == 1
    assert rl.get_run(handle.id).status is RunStatus.RELEASED
    assert_cancelled_at_once(rl, handle.id, RunStatus.RELEASED)
    clock.advance(DAY)
    assert_nothing_runs_it(rl, handle.id)
    assert JOURNAL.count(handler_key(handle.id)) == 1


def test_cancel_a_run_waiting_on_a_token(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[await_token])
    token = rl.create_wait_token(timeout=timedelta(minutes=5))
    handle = rl.trigger(await_token, {"token": str(token.id)})
    assert rl.drain().runs_executed == 1
    assert rl.get_run(handle.id).status is RunStatus.WAITING
    assert rl.get_wait_token(token.id).waiting_runs == 1

    assert_cancelled_at_once(rl, handle.id, RunStatus.WAITING)
    row = run_row(db, schema, handle.id)
    assert (row["wait_kind"], row["wait_token_id"]) == (None, None)
    assert rl.get_wait_token(token.id).waiting_runs == 0

    # the token still completes, but the cancelled run is not resumed by it
    done = rl.complete_wait_token(token.id, {"late": True})
    assert done.status is WaitTokenStatus.COMPLETED
    assert rl.get_run(handle.id).status is RunStatus.CANCELLED
    assert_nothing_runs_it(rl, handle.id)
    assert JOURNAL.count(handler_key(handle.id)) == 1
    assert attempt_rows(db, schema, handle.id) == [(1, "suspended")]


def test_cancel_a_sleeping_run(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, clock: MovableClock
) -> None:
    rl = make_runlane(tasks=[sleeper])
    handle = rl.trigger(sleeper, {})
    assert rl.drain().runs_executed == 1
    assert run_row(db, schema, handle.id)["wait_kind"] == "sleep"
    assert_cancelled_at_once(rl, handle.id, RunStatus.WAITING)
    clock.advance(DAY)  # its wake-up time passes
    assert_nothing_runs_it(rl, handle.id)
    assert JOURNAL.count(handler_key(handle.id)) == 1


# -- running runs ----------------------------------------------------------------------------


@pytest.mark.parametrize("handler_then", ["returns", "stops"])
def test_cancel_a_running_run_tells_its_handler_through_notify(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, handler_then: str
) -> None:
    # the default 30 s lease is extended every 10 s: only NOTIFY can tell the handler in ~1 s
    rl = make_runlane(tasks=[long_handler])
    with rl.create_delivery_worker(concurrency=1) as worker:
        assert worker.idle_signal.wait(10)
        wait_until(lambda: listener_ready(db, worker), timeout=10, what="the LISTEN connection")
        handle = rl.trigger(long_handler, {"then": "stop"} if handler_then == "stops" else {})
        assert JOURNAL.event(f"started:{handle.id}").wait(10)
        asked_at = time.monotonic()
        result = rl.cancel(handle.id)
        assert result == CancelResult(
            run_id=handle.id,
            previous=RunStatus.RUNNING,
            status=RunStatus.CANCELLATION_REQUESTED,
            changed=True,
        )
        assert JOURNAL.event(f"seen:{handle.id}").wait(15)
        seen, seen_at = JOURNAL.get(f"seen:{handle.id}")
        assert seen, "context.cancelled was never set"
        assert seen_at - asked_at < 1.5, f"told after {seen_at - asked_at:.2f}s"

        # until the handler returns the run stays cancellation_requested, and saying it again
        # changes nothing
        snap = rl.get_run(handle.id)
        assert snap.status is RunStatus.CANCELLATION_REQUESTED
        assert snap.finished_at is None
        assert rl.cancel(handle.id) == CancelResult(
            run_id=handle.id,
            previous=RunStatus.CANCELLATION_REQUESTED,
            status=RunStatus.CANCELLATION_REQUESTED,
            changed=False,
        )
        JOURNAL.event(f"let_go:{handle.id}").set()
        final = rl.wait_for_run(handle.id, timeout=10)

    assert final.finished_at is not None
    assert JOURNAL.count(handler_key(handle.id)) == 1
    if handler_then == "stops":  # raise_if_stopped: the cancellation ends the run
        assert final.status is RunStatus.CANCELLED
        assert final.output is None
        assert attempt_rows(db, schema, handle.id) == [(1, "cancelled")]
    else:
        # it saw the cancellation and returned normally all the same: a handler that
        # returns normally has completed its run, whatever stop was asked (SPEC), its
        # output kept
        assert final.status is RunStatus.COMPLETED
        assert final.output == {"cancelled_seen": True}
        assert attempt_rows(db, schema, handle.id) == [(1, "completed")]


def test_a_cancellation_whose_announcement_was_missed_is_seen_when_the_listener_reconnects(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    """Announcements sent while the worker's listener is away are lost (one sent before its
    LISTEN, or during an outage): on reconnecting it has the worker extend its leases at
    once, which reads each run's status, rather than at the next extension (10 s here)."""
    rl = make_runlane(tasks=[long_handler])
    with rl.create_delivery_worker(concurrency=1) as worker:
        wait_until(lambda: listener_ready(db, worker), timeout=10, what="the LISTEN connection")
        handle = rl.trigger(long_handler, {"then": "stop"})
        assert JOURNAL.event(f"started:{handle.id}").wait(10)
        # what cancel() writes for a running run, with its announcing trigger silenced
        # (replica mode skips ordinary triggers): the announcement is missed
        with db.transaction():
            db.execute("set local session_replication_role = replica")
            db.execute(
                q(
                    "update {s}.runs set status = 'cancellation_requested', "
                    "updated_at = now() where id = %s and status = 'running'",
                    schema,
                ),
                (handle.id,),
            )
        assert not JOURNAL.event(f"seen:{handle.id}").wait(0.3), "an announcement got through"
        lost_at = time.monotonic()
        db.execute(
            "select pg_terminate_backend(pid) from pg_stat_activity where application_name = %s",
            (f"{worker.name}-listener",),
        )
        assert JOURNAL.event(f"seen:{handle.id}").wait(15)
        seen, seen_at = JOURNAL.get(f"seen:{handle.id}")
        assert seen, "context.cancelled was never set"
        assert seen_at - lost_at < 5, f"told {seen_at - lost_at:.2f}s after the reconnect"
        JOURNAL.event(f"let_go:{handle.id}").set()
        final = rl.wait_for_run(handle.id, timeout=10)
    assert final.status is RunStatus.CANCELLED
    assert attempt_rows(db, schema, handle.id) == [(1, "cancelled")]


def test_cancel_a_running_drain_handler_through_the_lease_extension(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    # drain listens to nothing: its lease keeper (every 1/3 s with a 1 s lease) finds out
    rl = make_runlane(tasks=[long_handler], lane_options={"lease_duration": timedelta(seconds=1)})
    handle = rl.trigger(long_handler, {"then": "stop"})
    results: list[CancelResult] = []
    asked: list[float] = []
    errors: list[BaseException] = []

    def cancel_when_started() -> None:
        try:
            assert JOURNAL.event(f"started:{handle.id}").wait(10)
            asked.append(time.monotonic())
            results.append(rl.cancel(handle.id))
            assert JOURNAL.event(f"seen:{handle.id}").wait(15)
        except BaseException as exc:
            errors.append(exc)
        finally:
            JOURNAL.event(f"let_go:{handle.id}").set()

    canceller = threading.Thread(target=cancel_when_started)
    canceller.start()
    try:
        assert rl.drain(max_runs=1).runs_executed == 1
    finally:
        canceller.join(timeout=30)
    assert not canceller.is_alive()
    assert errors == []
    assert [r.status for r in results] == [RunStatus.CANCELLATION_REQUESTED]
    seen, seen_at = JOURNAL.get(f"seen:{handle.id}")
    assert seen, "context.cancelled was never set"
    assert seen_at - asked[0] < 2.0, f"told after {seen_at - asked[0]:.2f}s"
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.CANCELLED
    assert snap.finished_at is not None
    assert attempt_rows(db, schema, handle.id) == [(1, "cancelled")]


@pytest.mark.parametrize("then", ["wait_for_token", "sleep", "release"])
def test_a_cancellation_requested_run_that_suspends_ends_cancelled(
    make_runlane: RunlaneFactory,
    db: psycopg.Connection[Any],
    schema: str,
    then: str,
    clock: MovableClock,
) -> None:
    rl = make_runlane(tasks=[long_handler])
    token = rl.create_wait_token(timeout=timedelta(minutes=5))
    with rl.create_delivery_worker(concurrency=1):
        handle = rl.trigger(long_handler, {"then": then, "token": str(token.id)})
        assert JOURNAL.event(f"started:{handle.id}").wait(10)
        assert rl.cancel(handle.id).status is RunStatus.CANCELLATION_REQUESTED
        assert JOURNAL.event(f"seen:{handle.id}").wait(15)
        JOURNAL.event(f"let_go:{handle.id}").set()
        snap = rl.wait_for_run(handle.id, timeout=10)
    assert snap.status is RunStatus.CANCELLED
    assert snap.finished_at is not None
    row = run_row(db, schema, handle.id)
    assert (row["wait_kind"], row["lease_token"]) == (None, None)
    assert attempt_rows(db, schema, handle.id) == [(1, "cancelled")]
    assert rl.get_wait_token(token.id).waiting_runs == 0
    rl.complete_wait_token(token.id, "late")
    clock.advance(DAY)
    assert_nothing_runs_it(rl, handle.id)


def test_cancel_a_run_whose_worker_died_is_finalized_by_maintenance(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[noop])
    handle = rl.trigger(noop, {})
    # a worker claims the run and is never heard from again
    (claimed,) = storage_of(rl).run_claim(rl.environment, ["default"], 1, timedelta(seconds=30))
    result = rl.cancel(handle.id)
    assert result == CancelResult(
        run_id=handle.id,
        previous=RunStatus.RUNNING,
        status=RunStatus.CANCELLATION_REQUESTED,
        changed=True,
    )
    # the lease is still live: maintenance leaves the attempt alone
    assert rl.run_maintenance_once().cancellations_finalized == 0
    assert rl.get_run(handle.id).status is RunStatus.CANCELLATION_REQUESTED
    assert rl.status().stuck_cancellations == 0

    db.execute(
        q(
            "update {s}.runs set lease_expires_at = now() - interval '1 second' where id = %s",
            schema,
        ),
        (handle.id,),
    )
    assert rl.status().stuck_cancellations == 1
    finalized = rl.run_maintenance_once()
    assert finalized.cancellations_finalized == 1
    assert finalized.attempts_expired == 0
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.CANCELLED
    assert snap.finished_at is not None
    assert snap.error is None
    assert attempt_rows(db, schema, handle.id) == [(1, "expired")]
    assert rl.status().stuck_cancellations == 0

    # the dead worker's late completion is fenced off
    late = Completion(
        run_id=handle.id, attempt=claimed.attempt, lease_token=claimed.lease_token, output='"x"'
    )
    assert storage_of(rl).run_complete_many([late]) == set()
    assert rl.get_run(handle.id) == snap
    assert_nothing_runs_it(rl, handle.id)


# -- runs that cannot be cancelled -----------------------------------------------------------


@pytest.mark.parametrize("ending", ["completed", "failed", "cancelled"])
def test_cancelling_a_terminal_run_changes_nothing(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, ending: str
) -> None:
    rl = make_runlane(tasks=[noop, refuse])
    if ending == "cancelled":
        handle = rl.trigger(noop, {})
        rl.cancel(handle.id)
    else:
        handle = rl.trigger(noop if ending == "completed" else refuse, {})
        assert rl.drain().runs_executed == 1
    before = rl.get_run(handle.id)
    status = RunStatus(ending)
    assert before.status is status
    attempts_before = attempt_rows(db, schema, handle.id)

    result = rl.cancel(str(handle.id))
    assert result == CancelResult(run_id=handle.id, previous=status, status=status, changed=False)
    assert rl.get_run(handle.id) == before  # not even updated_at moved
    assert attempt_rows(db, schema, handle.id) == attempts_before


def test_cancelling_an_unknown_run_raises_run_not_found(make_runlane: RunlaneFactory) -> None:
    rl = make_runlane(tasks=[noop])
    with pytest.raises(RunNotFound):
        rl.cancel(uuid.uuid4())
    with pytest.raises(RunNotFound):
        rl.cancel("not-a-run-id")
    # a run of another environment is unknown here, and left alone
    other = make_runlane(tasks=[noop], environment="other")
    foreign = other.trigger(noop, {})
    with pytest.raises(RunNotFound):
        rl.cancel(foreign.id)
    assert other.get_run(foreign.id).status is RunStatus.QUEUED


# -- child runs ------------------------------------------------------------------------------


def test_cancelling_a_child_resumes_its_waiting_parent_with_child_run_failed(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(queues=[kids], tasks=[parent, child])
    # the worker does not poll "kids": the child stays queued until it is cancelled
    with rl.create_delivery_worker(concurrency=2, queues=["default"]):
        handle = rl.trigger(parent, {})
        wait_for_status(rl, handle.id, RunStatus.WAITING)
        child_id: uuid.UUID = JOURNAL.get(f"child:{handle.id}")
        assert run_row(db, schema, handle.id)["wait_run_id"] == child_id

        assert_cancelled_at_once(rl, child_id, RunStatus.QUEUED)
        # the cancel statement itself resumed the parent; no maintenance ran
        assert rl.get_run(handle.id).status is not RunStatus.WAITING
        snap = rl.wait_for_run(handle.id, timeout=10)

    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {"failed": "cancelled", "run": str(child_id)}
    assert JOURNAL.count(handler_key(handle.id)) == 2
    assert attempt_rows(db, schema, handle.id) == [(1, "suspended"), (2, "completed")]


def test_cancelling_a_child_wakes_workers_for_its_parent(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any]
) -> None:
    # with a 30 s poll, only a notification gets the resumed parent claimed within seconds
    rl = make_runlane(
        queues=[kids], tasks=[parent, child], lane_options={"poll_interval": timedelta(seconds=30)}
    )
    with rl.create_delivery_worker(concurrency=2, queues=["default"]) as worker:
        assert worker.idle_signal.wait(10)
        wait_until(lambda: listener_ready(db, worker), timeout=10, what="the LISTEN connection")
        handle = rl.trigger(parent, {})
        wait_for_status(rl, handle.id, RunStatus.WAITING)
        rl.cancel(JOURNAL.get(f"child:{handle.id}"))
        assert rl.get_run(handle.id).status is not RunStatus.WAITING  # resumed eagerly
        snap = rl.wait_for_run(handle.id, timeout=5)
    assert snap.status is RunStatus.COMPLETED
