"""Durable steps, wait tokens, durable sleeps, releases and child runs (SPEC section 4).

Everything goes through the public API against a real database, with a real delivery worker
or ``drain`` executing handlers and ``run_maintenance_once`` (or the services) doing what
maintenance does. Handlers are module-level tasks steered by their payload; what they observe
is recorded in ``JOURNAL`` under keys that contain the run id, so tests never share state.
Background work is observed by polling against a deadline; every wait is bounded.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs
import psycopg
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from psycopg import sql

from runlane import (
    ChildRunFailed,
    ConfigurationError,
    MaintenanceResult,
    NonRetryableError,
    RunContext,
    RunHandle,
    Runlane,
    RunNotFound,
    RunStatus,
    StaleLease,
    WaitToken,
    WaitTokenNotFound,
    WaitTokenStatus,
    WaitTokenTimedOut,
    queue,
    task,
)
from runlane._validation import TriggerOptions
from runlane.context import TaskRef
from runlane.storage import ClaimedRun, LeaseRef, StepStored, Storage
from runlane.testing import MovableClock
from tests.conftest import RunlaneFactory
from tests.helpers import (
    HOUR_RETRY,
    ONE_ATTEMPT,
    attempt_rows,
    handler_key,
    listener_ready,
    q,
    run_row,
    storage_of,
    wait_for_status,
    wait_until,
)

# -- what handlers saw -----------------------------------------------------------------------


class Journal:
    """Counters, lists and events written by handlers, keyed by strings; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._items: defaultdict[str, list[Any]] = defaultdict(list)

    def bump(self, key: str) -> int:
        with self._lock:
            self._counts[key] += 1
            return self._counts[key]

    def count(self, key: str) -> int:
        with self._lock:
            return self._counts[key]

    def append(self, key: str, value: Any) -> None:
        with self._lock:
            self._items[key].append(value)

    def items(self, key: str) -> list[Any]:
        with self._lock:
            return list(self._items[key])


JOURNAL = Journal()


# -- tasks -----------------------------------------------------------------------------------

kids = queue("kids")


@attrs.frozen
class Point:
    x: int
    y: int


@task(id="waits.workflow")
def workflow(payload: dict[str, Any], context: RunContext) -> dict[str, Any]:
    """A step, then a token wait: replayed from the top after the resume."""
    JOURNAL.bump(handler_key(context.run_id))

    def compute() -> dict[str, int]:
        JOURNAL.bump(f"step:{context.run_id}")
        return {"n": 41}

    value = context.step("compute", compute)
    out = context.wait_for_token(payload["token"])
    return {"step": value, "token": out}


@task(id="waits.typed_step")
def typed_step(payload: dict[str, Any], context: RunContext) -> dict[str, Any]:
    """A typed and an untyped step; the first attempt releases so the second replays them."""
    JOURNAL.bump(handler_key(context.run_id))

    def make_point() -> Point:
        JOURNAL.bump(f"step:{context.run_id}")
        return Point(x=payload["x"], y=2)

    point = context.step("point", make_point, output_type=Point)
    plain = context.step("plain", lambda: {"x": payload["x"], "y": 2})
    JOURNAL.append(f"seen:{context.run_id}", (context.attempt, point, plain))
    if context.attempt == 1:
        context.release()
    return {"point": attrs.asdict(point), "plain": plain}


@task(id="waits.bad_step", retry=HOUR_RETRY)
def bad_step(payload: dict[str, Any], context: RunContext) -> str:
    """A step whose output is not JSON: the step raises, and so does the handler."""
    JOURNAL.bump(handler_key(context.run_id))

    def unserializable() -> object:
        JOURNAL.bump(f"step:{context.run_id}")
        return {"when": object()}

    context.step("unserializable", unserializable)
    return "unreachable"


@task(id="waits.step_names")
def step_names(payload: dict[str, Any], context: RunContext) -> dict[str, str]:
    """Tries each rejected step name and reports what happened."""
    outcomes: dict[str, str] = {}
    for label, name in (
        ("empty", ""),
        ("reserved", "runlane.mine"),
        ("reserved_sleep", "runlane.sleep:1"),
        ("too_long", "s" * 501),
        ("not_a_string", 42),
    ):

        def fn(label: str = label) -> str:
            JOURNAL.bump(f"called:{context.run_id}:{label}")
            return label

        try:
            context.step(name, fn)  # type: ignore[arg-type]  # the int is on purpose
        except ConfigurationError:
            outcomes[label] = "ConfigurationError"
        else:
            outcomes[label] = "stored"
    outcomes["fine"] = context.step("s" * 500, lambda: "ok")
    return outcomes


@task(id="waits.await_token")
def await_token(payload: dict[str, Any], context: RunContext) -> dict[str, Any]:
    """Waits on ``payload["token"]`` and reports its outcome."""
    JOURNAL.bump(handler_key(context.run_id))
    try:
        out = context.wait_for_token(payload["token"])
    except WaitTokenTimedOut as exc:
        return {"outcome": "timed_out", "token": str(exc.token_id)}
    except WaitTokenNotFound:
        return {"outcome": "not_found"}
    return {"outcome": "completed", "output": out}


@task(id="waits.sleeper")
def sleeper(payload: dict[str, Any], context: RunContext) -> dict[str, Any]:
    JOURNAL.bump(handler_key(context.run_id))
    context.sleep(payload["seconds"])
    JOURNAL.bump(f"after_sleep:{context.run_id}")
    return {"slept": payload["seconds"], "attempt": context.attempt}


@task(id="waits.releaser", retry=ONE_ATTEMPT)
def releaser(payload: dict[str, Any], context: RunContext) -> dict[str, int]:
    JOURNAL.bump(handler_key(context.run_id))
    if context.attempt == 1:
        context.release(delay=payload["delay"])
    return {"attempt": context.attempt, "max_attempts": context.max_attempts}


@task(id="waits.catches_exception", retry=ONE_ATTEMPT)
def catches_exception(payload: dict[str, Any], context: RunContext) -> dict[str, Any]:
    """Suspends (``payload["op"]``: a token wait, a child-run wait, a sleep or, on its first
    attempt, a release) inside ``try: ... except Exception``, as user code wrapping its calls
    does; journals what it caught and whether it went on past the call."""
    JOURNAL.bump(handler_key(context.run_id))
    op = payload["op"]
    got: Any
    try:
        if op == "token":
            got = context.wait_for_token(payload["token"])
        elif op == "run":
            got = context.wait_for_run(payload["run"])
        elif op == "sleep":
            context.sleep(30)  # the test moves the database clock rather than wait
            got = "slept"
        else:
            if context.attempt == 1:
                context.release(delay=30)
            got = "released"
    except Exception as exc:  # the point: a suspension must not land here
        JOURNAL.append(f"caught:{context.run_id}", repr(exc))
        got = f"caught {type(exc).__name__}"
    JOURNAL.append(f"went_on:{context.run_id}", context.attempt)
    return {"got": got, "attempt": context.attempt}


@task(id="waits.bad_durations")
def bad_durations(payload: dict[str, Any], context: RunContext) -> dict[str, str]:
    """Negative and malformed sleep and release durations, each reported."""
    attempts: dict[str, Callable[[], object]] = {
        "sleep_negative": lambda: context.sleep(-0.5),
        "sleep_negative_delta": lambda: context.sleep(timedelta(seconds=-1)),
        "sleep_string": lambda: context.sleep("soon"),  # type: ignore[arg-type]
        "release_negative": lambda: context.release(delay=-1),
    }
    outcomes: dict[str, str] = {}
    for label, call in attempts.items():
        try:
            call()
        except ConfigurationError:
            outcomes[label] = "ConfigurationError"
        else:
            outcomes[label] = "accepted"
    return outcomes


@task(id="waits.child", queue="kids", retry=ONE_ATTEMPT)
def child(payload: dict[str, Any], context: RunContext) -> dict[str, int]:
    if payload["fail"]:
        raise NonRetryableError(f"child {payload['x']} refuses")
    return {"doubled": payload["x"] * 2}


@task(id="waits.parent")
def parent(payload: dict[str, Any], context: RunContext) -> dict[str, Any]:
    """Triggers one child (on the ``kids`` queue) and waits for it."""
    JOURNAL.bump(handler_key(context.run_id))
    handle = context.trigger_child(child, {"x": payload["x"], "fail": payload["fail"]})
    JOURNAL.append(f"children:{context.run_id}", handle.id)
    try:
        out = context.wait_for_run(handle.id)
    except ChildRunFailed as exc:
        return {
            "failed": exc.status,
            "run": str(exc.run_id),
            "error": None if exc.error is None else getattr(exc.error, "type", None),
        }
    return {"child": str(handle.id), "output": out}


@task(id="waits.typo_parent")
def typo_parent(payload: dict[str, Any], context: RunContext) -> dict[str, str | None]:
    """Misspells a trigger_child option (``dealy``) and reports the error."""
    try:
        context.trigger_child(child, {"x": 1, "fail": False}, dealy=5)  # type: ignore[call-arg]
    except ConfigurationError:
        return {"error": "ConfigurationError"}
    return {"error": None}


@task(id="waits.watcher")
def watcher(payload: dict[str, Any], context: RunContext) -> dict[str, str]:
    """Waits for ``payload["run"]`` ("self" for itself) and reports an error, if any."""
    JOURNAL.bump(handler_key(context.run_id))
    target = context.run_id if payload["run"] == "self" else payload["run"]
    try:
        out = context.wait_for_run(target)
    except RunNotFound:
        return {"error": "RunNotFound"}
    except ConfigurationError:
        return {"error": "ConfigurationError"}
    return {"output": str(out)}


@task(id="waits.noop")
def noop(payload: dict[str, Any], context: RunContext) -> str:
    return "done"


# -- helpers ---------------------------------------------------------------------------------


def stored_steps(db: psycopg.Connection[Any], schema: str, run_id: uuid.UUID) -> dict[str, Any]:
    rows = db.execute(
        q("select name, output from {s}.steps where run_id = %s", schema), (run_id,)
    ).fetchall()
    return {str(name): output for name, output in rows}


def count(db: psycopg.Connection[Any], query: sql.Composed, *params: object) -> int:
    row = db.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def children_of(db: psycopg.Connection[Any], schema: str, run_id: uuid.UUID) -> int:
    return count(db, q("select count(*) from {s}.runs where parent_run_id = %s", schema), run_id)


def maintain_until_delivered(rl: Runlane, clock: MovableClock, due_at: Any) -> list[bool]:
    """Run a maintenance pass, then move the clock past ``due_at`` (a second past it) and run
    another, which must deliver the due run; returns, for every pass, whether the runtime's
    clock had reached the due time when the pass ended. A pass that ended before it must not
    have delivered anything."""
    passes: list[bool] = []
    for moved in (False, True):
        if moved:
            clock.advance((due_at - storage_of(rl).database_now()).total_seconds() + 1)
        result = rl.run_maintenance_once()
        after = storage_of(rl).database_now()
        passes.append(after >= due_at)
        if result.due_runs_delivered:
            assert result.due_runs_delivered == 1
            assert after >= due_at, "delivered before it was due"
            return passes
    pytest.fail(f"nothing was delivered once the clock passed {due_at}")


class ManualBackend:
    """What a hand-built RunContext needs: the storage, and no child triggers."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def trigger_child(
        self,
        task: TaskRef | str,
        payload: Any,
        *,
        idempotency_key: str,
        options: TriggerOptions,
    ) -> RunHandle:
        raise AssertionError("no child runs in this test")


def manual_context(
    rl: Runlane, claimed: ClaimedRun, lease_token: uuid.UUID | None = None
) -> RunContext:
    """A context for ``claimed`` as a worker would build it, optionally with another token."""
    return RunContext(
        run_id=claimed.id,
        task_id=claimed.task_id,
        queue=claimed.queue,
        attempt=claimed.attempt,
        max_attempts=claimed.max_attempts,
        environment=rl.environment,
        backend=ManualBackend(storage_of(rl)),
        lease_token=claimed.lease_token if lease_token is None else lease_token,
    )


def recorder(calls: list[str], value: str) -> Callable[[], str]:
    """A step function that notes each call in ``calls`` and returns ``value``."""

    def fn() -> str:
        calls.append(value)
        return value

    return fn


def ref(claimed: ClaimedRun) -> LeaseRef:
    return LeaseRef(claimed.id, claimed.attempt, claimed.lease_token)


# -- a workflow end to end -------------------------------------------------------------------


def test_step_then_token_wait_resumes_and_completes_with_one_step_call(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[workflow])
    token = rl.create_wait_token(timeout=timedelta(minutes=5))
    assert token.waiting_runs == 0
    with rl.create_delivery_worker(concurrency=2):
        handle = rl.trigger(workflow, {"token": str(token.id)})
        wait_for_status(rl, handle.id, RunStatus.WAITING)
        row = run_row(db, schema, handle.id)
        assert (row["wait_kind"], row["wait_token_id"]) == ("token", token.id)
        assert row["lease_token"] is None
        assert rl.get_wait_token(token.id).waiting_runs == 1
        assert JOURNAL.count(handler_key(handle.id)) == 1
        assert JOURNAL.count(f"step:{handle.id}") == 1
        assert stored_steps(db, schema, handle.id) == {"compute": {"n": 41}}

        # the completion commits, then its eager pass resumes the run (no maintenance here)
        completed = rl.complete_wait_token(token.id, {"ok": True})
        assert completed.status is WaitTokenStatus.COMPLETED
        assert completed.output == {"ok": True}
        assert completed.waiting_runs == 0
        snap = rl.wait_for_run(handle.id, timeout=10)

    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {"step": {"n": 41}, "token": {"ok": True}}
    assert snap.attempt == 2
    assert JOURNAL.count(handler_key(handle.id)) == 2
    assert JOURNAL.count(f"step:{handle.id}") == 1
    assert rl.get_wait_token(token.id).waiting_runs == 0
    # the suspension did not consume an attempt and left one history row
    assert attempt_rows(db, schema, handle.id) == [(1, "suspended"), (2, "completed")]
    assert run_row(db, schema, handle.id)["releases"] == 1


# -- steps -----------------------------------------------------------------------------------


def test_step_replay_returns_stored_output_structured_on_first_run_and_replay(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[typed_step])
    handle = rl.trigger(typed_step, {"x": 7})
    assert rl.drain().runs_executed == 1
    assert rl.get_run(handle.id).status is RunStatus.RELEASED
    assert stored_steps(db, schema, handle.id) == {
        "point": {"x": 7, "y": 2},
        "plain": {"x": 7, "y": 2},
    }
    # release(delay=None) is due at once; maintenance hands it back
    assert rl.run_maintenance_once().due_runs_delivered == 1
    assert rl.drain().runs_executed == 1

    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {"point": {"x": 7, "y": 2}, "plain": {"x": 7, "y": 2}}
    assert JOURNAL.count(handler_key(handle.id)) == 2
    assert JOURNAL.count(f"step:{handle.id}") == 1  # fn ran on the first attempt only
    seen = JOURNAL.items(f"seen:{handle.id}")
    assert seen == [
        (1, Point(x=7, y=2), {"x": 7, "y": 2}),
        (2, Point(x=7, y=2), {"x": 7, "y": 2}),
    ]
    for _, point, plain in seen:
        assert type(point) is Point  # structured both times, never the raw dict
        assert type(plain) is dict


def test_unserializable_step_output_raises_configuration_error_and_stores_nothing(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[bad_step])
    handle = rl.trigger(bad_step, {})
    assert rl.drain().runs_executed == 1

    snap = rl.get_run(handle.id)
    # the handler let ConfigurationError escape: an ordinary failure, retried per its policy
    assert snap.status is RunStatus.RETRYING
    assert snap.error is not None
    assert snap.error.type == "runlane.ConfigurationError"
    assert "unserializable" in snap.error.message
    assert snap.error.retryable
    assert JOURNAL.count(f"step:{handle.id}") == 1
    assert stored_steps(db, schema, handle.id) == {}
    assert count(db, q("select count(*) from {s}.steps", schema)) == 0
    assert attempt_rows(db, schema, handle.id) == [(1, "retrying")]


def test_reserved_or_malformed_step_names_are_rejected_before_fn_runs(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[step_names])
    handle = rl.trigger(step_names, {})
    assert rl.drain().runs_executed == 1
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {
        "empty": "ConfigurationError",
        "reserved": "ConfigurationError",
        "reserved_sleep": "ConfigurationError",
        "too_long": "ConfigurationError",
        "not_a_string": "ConfigurationError",
        "fine": "ok",
    }
    for label in ("empty", "reserved", "reserved_sleep", "too_long", "not_a_string"):
        assert JOURNAL.count(f"called:{handle.id}:{label}") == 0, label
    assert stored_steps(db, schema, handle.id) == {"s" * 500: "ok"}


def test_stale_attempt_cannot_store_a_step(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[noop])
    handle = rl.trigger(noop, {})
    (first,) = storage_of(rl).run_claim(rl.environment, ["default"], 1, timedelta(seconds=30))
    assert first.id == handle.id

    # a token that never was this attempt's
    forged = manual_context(rl, first, lease_token=uuid.uuid4())
    with pytest.raises(StaleLease):
        forged.step("s", lambda: "forged")
    assert forged.cancelled.is_set()
    assert stored_steps(db, schema, handle.id) == {}

    # the current attempt stores; then it is handed back and the run is claimed again
    current = manual_context(rl, first)
    assert current.step("s", lambda: "one") == "one"
    assert storage_of(rl).run_release_many(rl.environment, [ref(first)]) == {handle.id}
    (second,) = storage_of(rl).run_claim(rl.environment, ["default"], 1, timedelta(seconds=30))
    assert (second.id, second.attempt) == (handle.id, 2)
    assert second.lease_token != first.lease_token

    # the old attempt can still read what it stored, but can store nothing new
    calls: list[str] = []
    assert current.step("s", recorder(calls, "again")) == "one"
    assert calls == []
    with pytest.raises(StaleLease):
        current.step("t", lambda: "late")
    assert current.cancelled.is_set()
    assert storage_of(rl).step_store(ref(first), "u", '"late"') == StepStored(
        fenced=False, output=None
    )
    assert stored_steps(db, schema, handle.id) == {"s": "one"}
    assert not manual_context(rl, second).cancelled.is_set()


def test_first_step_writer_wins(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[noop])
    handle = rl.trigger(noop, {})
    (first,) = storage_of(rl).run_claim(rl.environment, ["default"], 1, timedelta(seconds=30))
    ctx1 = manual_context(rl, first)

    # another writer of the same attempt stores between the step's read and its write
    def racing() -> str:
        stored = storage_of(rl).step_store(ref(first), "s", '"first"')
        assert stored == StepStored(fenced=True, output="first")
        return "second"

    assert ctx1.step("s", racing) == "first"

    assert storage_of(rl).run_release_many(rl.environment, [ref(first)]) == {handle.id}
    (second,) = storage_of(rl).run_claim(rl.environment, ["default"], 1, timedelta(seconds=30))
    assert second.attempt == 2
    # a later attempt writing a different value gets the first value back
    assert storage_of(rl).step_store(ref(second), "s", '"third"') == StepStored(
        fenced=True, output="first"
    )
    calls: list[str] = []
    assert manual_context(rl, second).step("s", recorder(calls, "fourth")) == "first"
    assert calls == []
    rows = db.execute(
        q("select name, output, attempt from {s}.steps where run_id = %s", schema), (handle.id,)
    ).fetchall()
    assert rows == [("s", "first", 1)]


# -- wait tokens -----------------------------------------------------------------------------


def test_token_timeout_raises_wait_token_timed_out_unlike_a_none_output(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, clock: MovableClock
) -> None:
    rl = make_runlane(tasks=[await_token])
    timed = rl.create_wait_token(timeout=0.3)
    empty = rl.create_wait_token(timeout=timedelta(minutes=5))
    waits_timed = rl.trigger(await_token, {"token": str(timed.id)})
    waits_empty = rl.trigger(await_token, {"token": str(empty.id)})
    assert rl.drain().runs_executed == 2
    assert rl.get_run(waits_timed.id).status is RunStatus.WAITING
    assert rl.get_wait_token(timed.id).waiting_runs == 1

    assert timed.timeout_at is not None
    deadline = timed.timeout_at
    clock.advance(1)  # the timeout passes
    assert storage_of(rl).database_now() > deadline
    result = rl.run_maintenance_once()
    assert result.wait_tokens_timed_out == 1
    assert result.wait_token_runs_resumed == 1

    after = rl.get_wait_token(timed.id)
    assert after.status is WaitTokenStatus.TIMED_OUT
    assert after.output is None
    assert after.resolved_at is not None
    assert after.resolved_at >= deadline
    assert after.waiting_runs == 0
    assert rl.get_run(waits_timed.id).status is RunStatus.QUEUED
    assert rl.get_run(waits_empty.id).status is RunStatus.WAITING  # its token is pending

    # a None output is a completion, not a timeout
    assert rl.complete_wait_token(empty.id).status is WaitTokenStatus.COMPLETED
    assert rl.drain().runs_executed == 2
    assert rl.get_run(waits_timed.id).output == {"outcome": "timed_out", "token": str(timed.id)}
    assert rl.get_run(waits_empty.id).output == {"outcome": "completed", "output": None}
    for handle in (waits_timed, waits_empty):
        assert rl.get_run(handle.id).status is RunStatus.COMPLETED
        assert JOURNAL.count(handler_key(handle.id)) == 2
        assert attempt_rows(db, schema, handle.id) == [(1, "suspended"), (2, "completed")]

    # nothing is left to time out or resume; a late completion changes nothing
    assert rl.run_maintenance_once() == MaintenanceResult()
    late = rl.complete_wait_token(timed.id, "late")
    assert late.status is WaitTokenStatus.TIMED_OUT
    assert late.output is None
    assert late.resolved_at == after.resolved_at


def test_token_completed_before_the_wait_returns_without_suspending(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[await_token])
    token = rl.create_wait_token()
    assert token.timeout_at is None
    rl.complete_wait_token(token.id, [1, "two", {"three": 3.5}])
    handle = rl.trigger(await_token, {"token": str(token.id)})
    assert rl.drain().runs_executed == 1
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {"outcome": "completed", "output": [1, "two", {"three": 3.5}]}
    assert snap.attempt == 1
    assert JOURNAL.count(handler_key(handle.id)) == 1
    assert attempt_rows(db, schema, handle.id) == [(1, "completed")]
    suspended = q("select count(*) from {s}.attempts where outcome = 'suspended'", schema)
    assert count(db, suspended) == 0


def test_completing_a_token_twice_keeps_the_first_output(make_runlane: RunlaneFactory) -> None:
    rl = make_runlane()
    token = rl.create_wait_token(timeout=timedelta(minutes=1))
    first = rl.complete_wait_token(token.id, {"v": 1})
    second = rl.complete_wait_token(str(token.id), {"v": 2})
    assert first.status is second.status is WaitTokenStatus.COMPLETED
    assert first.output == second.output == {"v": 1}
    assert first.resolved_at is not None
    assert second.resolved_at == first.resolved_at
    assert rl.get_wait_token(token.id) == second


REFUSED = "resume refused by the test's trigger"


def test_a_failed_eager_resume_leaves_the_completion_to_maintenance(
    make_runlane: RunlaneFactory,
    db: psycopg.Connection[Any],
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SPEC section 4: completing a token commits first, then one pass resumes its waiters;
    if that pass fails the completion stands and maintenance resumes them.

    The pass fails in the database: a trigger on the schema's runs table raises when a
    waiting run is set queued, so ``run_resume_waiters``' real statement errors (a row lock
    would not do: the statement skips locked rows without failing). The completion, in its
    own statement before it, is untouched by the trigger (it writes wait_tokens)."""
    rl = make_runlane(tasks=[await_token])
    token = rl.create_wait_token(timeout=timedelta(minutes=5))
    handle = rl.trigger(await_token, {"token": str(token.id)})
    assert rl.drain().runs_executed == 1
    assert rl.get_run(handle.id).status is RunStatus.WAITING

    db.execute(
        q(
            "create function {s}.refuse_resume() returns trigger language plpgsql as $$"
            " begin raise exception 'resume refused by the test''s trigger'; end $$;"
            " create trigger refuse_resume before update on {s}.runs for each row"
            " when (old.status = 'waiting' and new.status = 'queued')"
            " execute function {s}.refuse_resume()",
            schema,
        )
    )
    try:
        with caplog.at_level(logging.WARNING, logger="runlane"):
            done = rl.complete_wait_token(token.id, {"paid": True})
    finally:
        db.execute(q("drop trigger refuse_resume on {s}.runs", schema))
        db.execute(q("drop function {s}.refuse_resume()", schema))

    # complete_wait_token returned the committed completion; the run still waits
    assert done.status is WaitTokenStatus.COMPLETED
    assert done.output == {"paid": True}
    assert done.waiting_runs == 1
    assert rl.get_wait_token(token.id) == done
    row = run_row(db, schema, handle.id)
    assert (row["status"], row["wait_kind"], row["wait_token_id"]) == ("waiting", "token", token.id)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(token.id) in warnings[0].getMessage()
    assert "maintenance will resume" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None
    assert REFUSED in str(warnings[0].exc_info[1])  # the database's error, not another
    assert rl.drain().runs_executed == 0  # nothing resumed it behind maintenance's back

    # maintenance resumes it; the run completes with the token's output
    assert rl.run_maintenance_once().wait_token_runs_resumed == 1
    assert rl.get_run(handle.id).status is RunStatus.QUEUED
    assert rl.drain().runs_executed == 1
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {"outcome": "completed", "output": {"paid": True}}
    assert JOURNAL.count(handler_key(handle.id)) == 2
    assert attempt_rows(db, schema, handle.id) == [(1, "suspended"), (2, "completed")]
    assert rl.get_wait_token(token.id).waiting_runs == 0


def test_unknown_or_malformed_tokens_and_bad_arguments(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane()
    with pytest.raises(WaitTokenNotFound):
        rl.complete_wait_token(uuid.uuid4(), "x")
    with pytest.raises(WaitTokenNotFound):
        rl.get_wait_token(uuid.uuid4())
    for malformed in ("not-a-uuid", "", "1234"):
        with pytest.raises(WaitTokenNotFound):
            rl.complete_wait_token(malformed)
        with pytest.raises(WaitTokenNotFound):
            rl.get_wait_token(malformed)
    with pytest.raises(ConfigurationError):
        rl.create_wait_token(timeout=-0.1)
    with pytest.raises(ConfigurationError):
        rl.create_wait_token(timeout=timedelta(seconds=-1))
    with pytest.raises(ConfigurationError):
        rl.create_wait_token(timeout="soon")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        rl.create_wait_token(idempotency_key="")
    assert count(db, q("select count(*) from {s}.wait_tokens", schema)) == 0

    token = rl.create_wait_token()
    with pytest.raises(ConfigurationError):
        rl.complete_wait_token(token.id, {"when": object()})
    with pytest.raises(ConfigurationError):
        rl.complete_wait_token(token.id, {"nul": "a\x00b"})  # jsonb cannot hold NUL
    with pytest.raises(ConfigurationError):
        rl.complete_wait_token(token.id, float("nan"))
    assert rl.get_wait_token(token.id).status is WaitTokenStatus.PENDING


def test_wait_token_fields_idempotency_and_environment_scope(
    make_runlane: RunlaneFactory,
) -> None:
    rl = make_runlane()
    token = rl.create_wait_token(timeout=timedelta(seconds=90), idempotency_key="order-17")
    assert token.status is WaitTokenStatus.PENDING
    assert token.output is None
    assert token.idempotency_key == "order-17"
    assert token.timeout_at is not None
    assert token.timeout_at - token.created_at == timedelta(seconds=90)
    assert token.resolved_at is None
    assert token.waiting_runs == 0
    assert rl.get_wait_token(token.id) == token
    assert rl.get_wait_token(str(token.id)) == token

    again = rl.create_wait_token(timeout=timedelta(seconds=5), idempotency_key="order-17")
    assert again == token  # the first token, its timeout unchanged
    other_key = rl.create_wait_token(idempotency_key="order-18")
    assert other_key.id != token.id
    assert rl.create_wait_token().id not in (token.id, other_key.id)

    # another environment on the same schema neither sees nor completes it
    elsewhere = make_runlane(environment="other")
    with pytest.raises(WaitTokenNotFound):
        elsewhere.get_wait_token(token.id)
    with pytest.raises(WaitTokenNotFound):
        elsewhere.complete_wait_token(token.id, "hijack")
    assert elsewhere.create_wait_token(idempotency_key="order-17").id != token.id
    assert rl.get_wait_token(token.id).status is WaitTokenStatus.PENDING

    done = rl.complete_wait_token(token.id, {"paid": True})
    assert done.status is WaitTokenStatus.COMPLETED
    assert done.output == {"paid": True}
    assert done.resolved_at is not None
    assert done.resolved_at >= done.created_at
    assert (done.id, done.idempotency_key, done.timeout_at, done.created_at) == (
        token.id,
        token.idempotency_key,
        token.timeout_at,
        token.created_at,
    )


def test_waiting_on_a_token_of_another_environment_is_not_found(
    make_runlane: RunlaneFactory,
) -> None:
    rl = make_runlane(tasks=[await_token])
    foreign = make_runlane(environment="other").create_wait_token()
    handle = rl.trigger(await_token, {"token": str(foreign.id)})
    assert rl.drain().runs_executed == 1
    assert rl.get_run(handle.id).output == {"outcome": "not_found"}


# -- completion racing the timeout -----------------------------------------------------------

# Postgres jsonb cannot hold NUL, so outputs containing it are rejected up front
# valid Unicode only: NUL and lone surrogates are rejected before writing (test_trigger)
json_text = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=6)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | json_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(json_text, inner, max_size=3),
    max_leaves=6,
)


@attrs.frozen
class RacePlan:
    completers: tuple[int, ...]  # busy-loop iterations before each completion
    timers: tuple[tuple[bool, int], ...]  # (through a full maintenance pass?, iterations)
    value: Any


race_plans = st.builds(
    RacePlan,
    completers=st.lists(st.integers(0, 20_000), min_size=1, max_size=3).map(tuple),
    timers=st.lists(st.tuples(st.booleans(), st.integers(0, 20_000)), min_size=1, max_size=2).map(
        tuple
    ),
    value=json_values,
)


def spin(iterations: int) -> None:
    """A short busy wait that shifts a thread's start without sleeping."""
    for _ in range(iterations):
        pass


def test_completion_racing_timeout_has_one_winner_and_resumes_once(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    # Handlers run in ``drain`` between the races: a worker's background threads draw from
    # the global ``random`` while Hypothesis generates examples, which it rejects. Each
    # example has an environment of its own, so a failing one leaves nothing to the next.

    @settings(max_examples=60, deadline=None, database=None)
    @given(plan=race_plans)
    def race(plan: RacePlan) -> None:
        rl = make_runlane(tasks=[await_token], environment=f"race-{uuid.uuid4().hex[:12]}")
        try:
            race_in(rl, plan)
        finally:
            rl.close()

    def race_in(rl: Runlane, plan: RacePlan) -> None:
        # timeout 0: the token is due at once, but stays pending until a pass times it out
        token = rl.create_wait_token(timeout=0)
        handle = rl.trigger(await_token, {"token": str(token.id)})
        assert rl.drain().runs_executed == 1
        assert rl.get_run(handle.id).status is RunStatus.WAITING
        assert rl.get_wait_token(token.id).waiting_runs == 1

        barrier = threading.Barrier(len(plan.completers) + len(plan.timers), timeout=10)
        completions: dict[int, WaitToken] = {}
        timed_out: dict[int, int] = {}
        resumed_by_passes: dict[int, int] = {}
        errors: list[BaseException] = []

        def complete(index: int, iterations: int) -> None:
            try:
                barrier.wait()
                spin(iterations)
                output = {"by": index, "value": plan.value}
                completions[index] = rl.complete_wait_token(token.id, output)
            except BaseException as exc:
                errors.append(exc)

        def time_out(index: int, full_pass: bool, iterations: int) -> None:
            try:
                barrier.wait()
                spin(iterations)
                if full_pass:
                    result = rl.run_maintenance_once()
                    timed_out[index] = result.wait_tokens_timed_out
                    resumed_by_passes[index] = result.wait_token_runs_resumed
                else:
                    timed_out[index] = storage_of(rl).wait_token_time_out_due(rl.environment, 100)
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=complete, args=(i, n)) for i, n in enumerate(plan.completers)
        ] + [
            threading.Thread(target=time_out, args=(i, full, n))
            for i, (full, n) in enumerate(plan.timers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == []

        final = rl.get_wait_token(token.id)
        assert final.resolved_at is not None
        event(f"the token {final.status}")
        if final.status is WaitTokenStatus.COMPLETED:
            assert sum(timed_out.values()) == 0
            assert isinstance(final.output, dict)
            assert final.output == {"by": final.output["by"], "value": plan.value}
            assert final.output["by"] in completions
            for seen in completions.values():  # every completer saw the same winner
                assert seen.status is WaitTokenStatus.COMPLETED
                assert seen.output == final.output
            expected = {"outcome": "completed", "output": final.output}
        else:
            assert final.status is WaitTokenStatus.TIMED_OUT
            assert sum(timed_out.values()) == 1
            assert final.output is None
            for seen in completions.values():
                assert seen.status is WaitTokenStatus.TIMED_OUT
                assert seen.output is None
            expected = {"outcome": "timed_out", "token": str(token.id)}

        # a bare time-out leaves the resume to the next pass; give it one
        follow_up = rl.run_maintenance_once()
        assert follow_up.wait_tokens_timed_out == 0
        resumed_by_maintenance = sum(resumed_by_passes.values())
        resumed_by_maintenance += follow_up.wait_token_runs_resumed
        if final.status is WaitTokenStatus.TIMED_OUT:
            assert resumed_by_maintenance == 1  # no completion could resume it
        else:
            assert resumed_by_maintenance <= 1  # else the completion's own pass did

        row = run_row(db, schema, handle.id)
        assert (row["status"], row["attempt"], row["wait_kind"]) == ("queued", 1, None)
        assert rl.drain().runs_executed == 1
        snap = rl.get_run(handle.id)
        assert snap.status is RunStatus.COMPLETED
        assert snap.output == expected
        # claimed exactly twice: suspended once, resumed once
        assert snap.attempt == 2
        assert attempt_rows(db, schema, handle.id) == [(1, "suspended"), (2, "completed")]
        assert JOURNAL.count(handler_key(handle.id)) == 2
        again = rl.run_maintenance_once()
        assert (again.wait_tokens_timed_out, again.wait_token_runs_resumed) == (0, 0)
        assert rl.get_run(handle.id).status is RunStatus.COMPLETED
        assert rl.get_wait_token(token.id) == attrs.evolve(final, waiting_runs=0)

    race()


# -- durable sleep ---------------------------------------------------------------------------


def test_sleep_suspends_until_due_and_is_not_repeated(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, clock: MovableClock
) -> None:
    rl = make_runlane(tasks=[sleeper])
    # 30 s: the first maintenance pass comes before the due time however loaded the machine
    # is; the test then moves the clock rather than wait
    handle = rl.trigger(sleeper, {"seconds": 30})
    assert rl.drain().runs_executed == 1

    row = run_row(db, schema, handle.id)
    assert (row["status"], row["wait_kind"]) == ("waiting", "sleep")
    due_at = row["due_at"]
    assert due_at > row["db_now"]
    assert JOURNAL.count(f"after_sleep:{handle.id}") == 0
    steps = stored_steps(db, schema, handle.id)
    assert list(steps) == ["runlane.sleep:1"]
    assert steps["runlane.sleep:1"]["wake_at"] == due_at.isoformat()

    passes = maintain_until_delivered(rl, clock, due_at)
    assert passes[0] is False  # at least one pass came before the due time and left it alone
    assert rl.get_run(handle.id).status is RunStatus.QUEUED

    assert rl.drain().runs_executed == 1
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED  # the re-run did not sleep again
    assert snap.output == {"slept": 30, "attempt": 2}
    assert JOURNAL.count(handler_key(handle.id)) == 2
    assert JOURNAL.count(f"after_sleep:{handle.id}") == 1
    assert attempt_rows(db, schema, handle.id) == [(1, "suspended"), (2, "completed")]
    assert list(stored_steps(db, schema, handle.id)) == ["runlane.sleep:1"]


def test_sleep_and_release_with_a_worker_and_services(
    make_runlane: RunlaneFactory, clock: MovableClock
) -> None:
    """The worker's storages and the services' read one moved clock: half a minute passes
    for both at once, not waited for (the bands' leases outlast it)."""
    rl = make_runlane(tasks=[sleeper, releaser])
    errors: list[BaseException] = []
    with (
        rl.create_delivery_worker(concurrency=2),
        rl.start_services(
            lease_duration=timedelta(minutes=2), on_service_error=lambda e, _: errors.append(e)
        ),
    ):
        slept = rl.trigger(sleeper, {"seconds": 30})
        released = rl.trigger(releaser, {"delay": 30})
        wait_until(
            lambda: (
                {rl.get_run(slept.id).status, rl.get_run(released.id).status}
                == {RunStatus.WAITING, RunStatus.RELEASED}
            ),
            timeout=15,
            what="both handed back",
        )
        clock.advance(31)
        slept_snap = rl.wait_for_run(slept.id, timeout=15)
        released_snap = rl.wait_for_run(released.id, timeout=15)
    assert errors == []
    assert slept_snap.status is RunStatus.COMPLETED
    assert slept_snap.output == {"slept": 30, "attempt": 2}
    assert released_snap.status is RunStatus.COMPLETED
    assert released_snap.output == {"attempt": 2, "max_attempts": 1}
    for snap in (slept_snap, released_snap):
        assert snap.finished_at is not None
        assert snap.started_at is not None
        assert snap.finished_at - snap.started_at >= timedelta(seconds=30)


def test_release_hands_the_run_back_without_consuming_an_attempt(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, clock: MovableClock
) -> None:
    rl = make_runlane(tasks=[releaser])
    handle = rl.trigger(releaser, {"delay": 30})  # the clock is moved, not waited for
    assert rl.drain().runs_executed == 1

    row = run_row(db, schema, handle.id)
    assert row["status"] == "released"
    assert (row["attempt"], row["releases"], row["max_attempts"]) == (1, 1, 1)
    assert row["lease_token"] is None
    assert row["finished_at"] is None
    assert row["due_at"] > row["db_now"]
    assert attempt_rows(db, schema, handle.id) == [(1, "released")]
    assert rl.drain().runs_executed == 0  # released runs are not claimable until delivered

    passes = maintain_until_delivered(rl, clock, row["due_at"])
    assert passes[0] is False
    assert rl.get_run(handle.id).status is RunStatus.QUEUED

    assert rl.drain().runs_executed == 1
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED  # with max_attempts=1 it still ran again
    assert snap.output == {"attempt": 2, "max_attempts": 1}
    assert JOURNAL.count(handler_key(handle.id)) == 2
    assert attempt_rows(db, schema, handle.id) == [(1, "released"), (2, "completed")]


def test_negative_or_malformed_durations_are_configuration_errors(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[bad_durations])
    handle = rl.trigger(bad_durations, {})
    assert rl.drain().runs_executed == 1
    snap = rl.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {
        "sleep_negative": "ConfigurationError",
        "sleep_negative_delta": "ConfigurationError",
        "sleep_string": "ConfigurationError",
        "release_negative": "ConfigurationError",
    }
    assert stored_steps(db, schema, handle.id) == {}
    assert attempt_rows(db, schema, handle.id) == [(1, "completed")]


# -- a suspension unwinds through ``except Exception`` ----------------------------------------


@pytest.mark.parametrize("op", ["token", "run", "sleep", "release"])
def test_a_suspension_unwinds_through_except_exception(
    make_runlane: RunlaneFactory,
    db: psycopg.Connection[Any],
    schema: str,
    op: str,
    clock: MovableClock,
) -> None:
    """SPEC section 4: a suspended handler unwinds by a ``BaseException`` user code should
    not catch, so ``except Exception`` around ``wait_for_token``, ``wait_for_run``, ``sleep``
    or ``release`` does not stop it: the run suspends (``waiting``, or ``released``) without
    the handler going on past the call, and once resumed it re-runs from the top, where the
    call returns."""
    rl = make_runlane(queues=[kids], tasks=[catches_exception, child])
    payload: dict[str, Any] = {"op": op}
    if op == "token":
        token = rl.create_wait_token(timeout=timedelta(minutes=5))
        payload["token"] = str(token.id)
    elif op == "run":
        target = rl.trigger(child, {"x": 21, "fail": False})  # on "kids": not drained yet
        payload["run"] = str(target.id)
    handle = rl.trigger(catches_exception, payload)
    assert rl.drain(queues=["default"]).runs_executed == 1

    row = run_row(db, schema, handle.id)
    suspended = {
        "token": ("waiting", "token", "suspended"),
        "run": ("waiting", "run", "suspended"),
        "sleep": ("waiting", "sleep", "suspended"),
        "release": ("released", None, "released"),
    }
    status, wait_kind, outcome = suspended[op]
    assert (row["status"], row["wait_kind"]) == (status, wait_kind)
    assert row["lease_token"] is None
    assert JOURNAL.items(f"caught:{handle.id}") == []
    assert JOURNAL.items(f"went_on:{handle.id}") == []  # it unwound at the call
    assert attempt_rows(db, schema, handle.id) == [(1, outcome)]

    if op == "token":
        rl.complete_wait_token(token.id, {"ok": True})  # its eager pass resumes the run
    elif op == "run":
        assert rl.drain(queues=["kids"]).runs_executed == 1  # its completion resumes it
    else:
        maintain_until_delivered(rl, clock, row["due_at"])
    assert rl.get_run(handle.id).status is RunStatus.QUEUED
    assert rl.drain(queues=["default"]).runs_executed == 1

    snap = rl.get_run(handle.id)
    got = {"token": {"ok": True}, "run": {"doubled": 42}, "sleep": "slept", "release": "released"}
    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {"got": got[op], "attempt": 2}
    assert JOURNAL.count(handler_key(handle.id)) == 2
    assert JOURNAL.items(f"caught:{handle.id}") == []
    assert JOURNAL.items(f"went_on:{handle.id}") == [2]
    assert attempt_rows(db, schema, handle.id) == [(1, outcome), (2, "completed")]


# -- child runs ------------------------------------------------------------------------------


def start_parent(rl: Runlane, payload: dict[str, Any]) -> tuple[RunHandle, uuid.UUID]:
    """Trigger a parent (executed by a worker on "default") and wait until it waits for its
    child; returns the parent and the child's id."""
    handle = rl.trigger(parent, payload)
    wait_for_status(rl, handle.id, RunStatus.WAITING)
    children = JOURNAL.items(f"children:{handle.id}")
    assert len(children) == 1
    child_id: uuid.UUID = children[0]
    return handle, child_id


def test_parent_resumes_when_its_child_completes_and_gets_its_output(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(queues=[kids], tasks=[parent, child])
    with rl.create_delivery_worker(concurrency=2, queues=["default"]):
        handle, child_id = start_parent(rl, {"x": 21, "fail": False})
        row = run_row(db, schema, handle.id)
        assert (row["wait_kind"], row["wait_run_id"]) == ("run", child_id)
        kid = rl.get_run(child_id)
        assert (kid.parent_run_id, kid.queue, kid.status) == (handle.id, "kids", RunStatus.QUEUED)

        assert rl.drain(queues=["kids"]).runs_executed == 1
        # the child's completion statement itself resumed the parent: no maintenance ran
        assert rl.get_run(handle.id).status is not RunStatus.WAITING
        snap = rl.wait_for_run(handle.id, timeout=10)

    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {"child": str(child_id), "output": {"doubled": 42}}
    assert JOURNAL.count(handler_key(handle.id)) == 2
    # the replay's trigger_child returned the child the first run created
    assert JOURNAL.items(f"children:{handle.id}") == [child_id, child_id]
    assert children_of(db, schema, handle.id) == 1
    assert attempt_rows(db, schema, handle.id) == [(1, "suspended"), (2, "completed")]


def test_parent_waiting_on_a_failing_child_gets_child_run_failed(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(queues=[kids], tasks=[parent, child])
    with rl.create_delivery_worker(concurrency=2, queues=["default"]):
        handle, child_id = start_parent(rl, {"x": 5, "fail": True})
        assert rl.drain(queues=["kids"]).runs_executed == 1
        kid = rl.get_run(child_id)
        assert kid.status is RunStatus.FAILED
        assert rl.get_run(handle.id).status is not RunStatus.WAITING  # resumed eagerly
        snap = rl.wait_for_run(handle.id, timeout=10)

    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {
        "failed": "failed",
        "run": str(child_id),
        "error": "runlane.NonRetryableError",
    }
    assert JOURNAL.items(f"children:{handle.id}") == [child_id, child_id]
    assert children_of(db, schema, handle.id) == 1


@pytest.mark.parametrize("fail", [False, True], ids=["child-completes", "child-fails"])
def test_parent_resumed_by_its_child_wakes_listening_workers(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], fail: bool
) -> None:
    # with a 30 s poll, only a notification gets the resumed parent claimed within seconds
    rl = make_runlane(
        queues=[kids],
        tasks=[parent, child],
        lane_options={"poll_interval": timedelta(seconds=30)},
    )
    with rl.create_delivery_worker(concurrency=2, queues=["default"]) as worker:
        assert worker.idle_signal.wait(10)
        wait_until(lambda: listener_ready(db, worker), timeout=10, what="the LISTEN connection")
        handle, _ = start_parent(rl, {"x": 1, "fail": fail})
        assert rl.drain(queues=["kids"]).runs_executed == 1
        assert rl.get_run(handle.id).status is not RunStatus.WAITING  # resumed eagerly
        snap = rl.wait_for_run(handle.id, timeout=5)
    assert snap.status is RunStatus.COMPLETED


def test_trigger_child_with_an_unknown_option_writes_nothing(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(queues=[kids], tasks=[typo_parent, child])
    handle = rl.trigger(typo_parent, {})
    assert rl.drain(queues=["default"]).runs_executed == 1
    assert rl.get_run(handle.id).output == {"error": "ConfigurationError"}
    assert children_of(db, schema, handle.id) == 0


def test_waiting_on_a_run_of_another_environment_or_on_itself(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    rl = make_runlane(tasks=[watcher])
    other = make_runlane(tasks=[noop], environment="other")
    foreign = other.trigger(noop, {})
    with pytest.raises(RunNotFound):
        rl.get_run(foreign.id)

    across = rl.trigger(watcher, {"run": str(foreign.id)})
    itself = rl.trigger(watcher, {"run": "self"})
    malformed = rl.trigger(watcher, {"run": "not-a-run-id"})
    assert rl.drain().runs_executed == 3
    assert rl.get_run(across.id).output == {"error": "RunNotFound"}
    assert rl.get_run(itself.id).output == {"error": "ConfigurationError"}
    assert rl.get_run(malformed.id).output == {"error": "RunNotFound"}
    for handle in (across, itself, malformed):
        assert rl.get_run(handle.id).status is RunStatus.COMPLETED
        assert attempt_rows(db, schema, handle.id) == [(1, "completed")]
    assert other.get_run(foreign.id).status is RunStatus.QUEUED
