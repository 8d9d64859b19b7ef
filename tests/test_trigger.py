"""Producing runs: trigger, trigger_many, idempotency, transactions, get_run, environments."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import attrs
import psycopg
import pytest
from psycopg.rows import dict_row

from runlane import (
    ConfigurationError,
    PayloadValidationError,
    RetryPolicy,
    RunContext,
    RunHandle,
    RunNotFound,
    RunStatus,
    TaskNotFound,
    queue,
    task,
)
from runlane._ids import new_run_ids
from runlane.storage import NewRuns
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, Greet, count_runs, race_keyed_batches, run_row, storage_of

# every test runs with the statements sent through libpq and through the cursor API
pytestmark = pytest.mark.usefixtures("statement_path")


@attrs.frozen
class Other:
    name: str


@attrs.frozen
class Tagged:
    name: str
    tags: list[str]


@task(id="greet", schema=Greet, retry=RetryPolicy(max_attempts=4))
def greet(payload: Greet, context: RunContext) -> str:
    return f"{type(payload).__name__}:{payload.name}"


@task(id="greet", schema=Greet)
def greet_shadow(payload: Greet, context: RunContext) -> str:
    """Same id as ``greet`` but a different task object."""
    return payload.name


@task(id="mail.send", schema=Greet, queue="email")
def send_mail(payload: Greet, context: RunContext) -> None:
    return None


@task(id="tagged", schema=Tagged)
def tagged(payload: Tagged, context: RunContext) -> None:
    return None


# -- payloads and validation ----------------------------------------------------------------


def test_trigger_with_attrs_instance(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    handle = runlane.trigger(greet, Greet(name="ada"))
    assert isinstance(handle, RunHandle)
    assert handle.created is True
    assert handle.task_id == "greet"
    assert handle.queue == "default"
    snap = runlane.get_run(handle.id)
    assert snap.id == handle.id
    assert snap.status is RunStatus.QUEUED
    assert snap.payload == {"name": "ada"}
    assert snap.attempt == 0
    assert snap.max_attempts == 4  # from the task's RetryPolicy
    assert snap.priority == 0
    assert snap.idempotency_key is None
    assert snap.environment == "default"
    assert snap.output is None
    assert snap.error is None
    assert snap.started_at is None
    assert snap.finished_at is None
    assert count_runs(db, schema) == 1


def test_trigger_with_mapping_is_structured_for_the_handler(
    make_runlane: RunlaneFactory,
) -> None:
    runlane = make_runlane(tasks=[greet])
    handle = runlane.trigger(greet, {"name": "bob"})
    assert runlane.get_run(handle.id).payload == {"name": "bob"}
    assert runlane.drain().runs_executed == 1
    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED
    # the handler received a Greet instance, not the mapping
    assert snap.output == "Greet:bob"


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param({"name": 5}, id="int-for-str"),
        pytest.param({"name": "ada", "nmae": "typo"}, id="unknown-key"),
        pytest.param({}, id="missing-field"),
        pytest.param(Other(name="ada"), id="wrong-attrs-class"),
        pytest.param(Greet(name=5), id="instance-holding-int"),  # type: ignore[arg-type]
        pytest.param({"name": True}, id="bool-for-str"),
        pytest.param(None, id="none"),
        pytest.param(["ada"], id="list"),
    ],
)
def test_invalid_payload_raises_and_writes_nothing(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, payload: Any
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(PayloadValidationError) as info:
        runlane.trigger(greet, payload)
    assert info.value.task_id == "greet"
    assert info.value.problems
    assert "greet" in str(info.value)
    assert count_runs(db, schema) == 0


def test_string_for_list_field_is_rejected(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[tagged])
    with pytest.raises(PayloadValidationError):
        runlane.trigger(tagged, {"name": "ada", "tags": "abc"})
    assert count_runs(db, schema) == 0


@pytest.mark.parametrize("name", ["a\x00b", "a\ud800b", "\udfff"])
def test_payload_jsonb_cannot_hold_is_a_validation_error(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, name: str
) -> None:
    """NUL and lone surrogates are valid Python strings but not storable jsonb text."""
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(PayloadValidationError):
        runlane.trigger(greet, {"name": name})
    with pytest.raises(ConfigurationError):
        runlane.complete_wait_token(runlane.create_wait_token().id, {"v": name})
    assert count_runs(db, schema) == 0


def test_non_ascii_text_round_trips(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(tasks=[greet])
    handle = runlane.trigger(greet, {"name": "Zoë 日本 😀 \u2028"})
    assert runlane.get_run(handle.id).payload == {"name": "Zoë 日本 😀 \u2028"}


def test_unregistered_task_object_raises_and_writes_nothing(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(TaskNotFound, match=r"mail\.send"):
        runlane.trigger(send_mail, Greet(name="ada"))
    # a different task object that merely shares a registered id is not the registered task
    with pytest.raises(TaskNotFound):
        runlane.trigger(greet_shadow, Greet(name="ada"))
    with pytest.raises(TaskNotFound, match="nope"):
        runlane.trigger("nope", {"name": "ada"})
    assert count_runs(db, schema) == 0


def test_trigger_by_task_id_string(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(tasks=[greet])
    handle = runlane.trigger("greet", {"name": "cy"})
    assert handle.task_id == "greet"
    assert runlane.get_run(handle.id).task_id == "greet"
    assert runlane.drain().runs_executed == 1
    assert runlane.get_run(handle.id).output == "Greet:cy"


def test_trigger_by_task_id_string_still_validates(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(PayloadValidationError):
        runlane.trigger("greet", {"name": 1})
    assert count_runs(db, schema) == 0


# -- queues ---------------------------------------------------------------------------------


def test_unknown_queue_raises_and_writes_nothing(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(ConfigurationError, match="nowhere"):
        runlane.trigger(greet, Greet(name="ada"), queue="nowhere")
    assert count_runs(db, schema) == 0


def test_queue_override(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(queues=[queue("email"), queue("bulk")], tasks=[send_mail])
    handle = runlane.trigger(send_mail, Greet(name="ada"), queue="bulk")
    assert handle.queue == "bulk"
    assert runlane.get_run(handle.id).queue == "bulk"
    assert run_row(db, schema, handle.id)["queue"] == "bulk"
    assert runlane.drain(queues=["email"]).runs_executed == 0
    assert runlane.drain(queues=["bulk"]).runs_executed == 1


def test_task_queue_is_used_when_no_override(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(queues=[queue("main", default=True), queue("email")], tasks=[send_mail])
    handle = runlane.trigger(send_mail, Greet(name="ada"))
    assert handle.queue == "email"
    assert runlane.get_run(handle.id).queue == "email"


def test_default_queue_added_when_none_is_registered(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(tasks=[greet])
    assert "default" in runlane.queues
    assert runlane.queues["default"].default
    handle = runlane.trigger(greet, Greet(name="ada"))
    assert handle.queue == "default"
    assert runlane.get_run(handle.id).queue == "default"


def test_task_without_queue_goes_to_the_registered_default(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(queues=[queue("main", default=True)], tasks=[greet])
    assert "default" not in runlane.queues
    handle = runlane.trigger(greet, Greet(name="ada"))
    assert handle.queue == "main"
    assert runlane.get_run(handle.id).queue == "main"


# -- timing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "delay", [timedelta(seconds=-1), timedelta(microseconds=-1), -0.5, -1], ids=repr
)
def test_negative_delay_is_rejected(
    make_runlane: RunlaneFactory,
    db: psycopg.Connection[Any],
    schema: str,
    delay: timedelta | float,
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(ConfigurationError, match="delay"):
        runlane.trigger(greet, Greet(name="ada"), delay=delay)
    assert count_runs(db, schema) == 0


@pytest.mark.parametrize("delay", [float("nan"), float("inf")], ids=repr)
def test_non_finite_delay_is_a_configuration_error(
    make_runlane: RunlaneFactory, delay: float
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(ConfigurationError):
        runlane.trigger(greet, Greet(name="ada"), delay=delay)


def test_delay_and_run_at_together_are_rejected(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(ConfigurationError, match="delay or run_at"):
        runlane.trigger(
            greet,
            Greet(name="ada"),
            delay=timedelta(seconds=5),
            run_at=datetime.now(UTC) + timedelta(minutes=1),
        )
    assert count_runs(db, schema) == 0


def test_naive_run_at_is_rejected(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    naive = datetime(2100, 1, 1, 12, 0, 0)  # naive on purpose
    with pytest.raises(ConfigurationError, match="timezone-aware"):
        runlane.trigger(greet, Greet(name="ada"), run_at=naive)
    assert count_runs(db, schema) == 0


@pytest.mark.parametrize(
    ("delay", "expected"),
    [
        (timedelta(seconds=30), timedelta(seconds=30)),
        (1.5, timedelta(seconds=1.5)),
        (7, timedelta(seconds=7)),
    ],
    ids=["timedelta", "float", "int"],
)
def test_delay_sets_due_at_by_database_time(
    make_runlane: RunlaneFactory,
    db: psycopg.Connection[Any],
    schema: str,
    delay: timedelta | float,
    expected: timedelta,
) -> None:
    runlane = make_runlane(tasks=[greet])
    handle = runlane.trigger(greet, Greet(name="ada"), delay=delay)
    row = run_row(db, schema, handle.id)
    # both stamps come from the database in the same statement
    assert abs((row["due_at"] - row["created_at"]) - expected) < timedelta(milliseconds=1)
    assert row["due_at"] > row["db_now"]
    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.QUEUED
    assert snap.due_at == row["due_at"]
    assert runlane.drain().runs_executed == 0


def test_no_delay_means_due_at_creation(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    handle = runlane.trigger(greet, Greet(name="ada"))
    row = run_row(db, schema, handle.id)
    assert row["due_at"] == row["created_at"]
    assert row["due_at"] <= row["db_now"]


def test_run_at_is_honoured(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(tasks=[greet])
    run_at = datetime(2100, 1, 2, 3, 4, 5, 678000, tzinfo=timezone(timedelta(hours=5)))
    handle = runlane.trigger(greet, Greet(name="ada"), run_at=run_at)
    snap = runlane.get_run(handle.id)
    assert snap.due_at == run_at
    assert snap.due_at.utcoffset() is not None
    assert runlane.drain().runs_executed == 0


def test_run_at_in_the_past_is_due_now(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(tasks=[greet])
    run_at = datetime(2000, 1, 1, tzinfo=UTC)
    handle = runlane.trigger(greet, Greet(name="ada"), run_at=run_at)
    assert runlane.get_run(handle.id).due_at == run_at
    assert runlane.drain().runs_executed == 1
    assert runlane.get_run(handle.id).status is RunStatus.COMPLETED


# -- priority and attempts ------------------------------------------------------------------


@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, 10**20, 1.5, True, "1", None], ids=repr)
def test_invalid_priority_is_rejected(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, priority: Any
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(ConfigurationError, match="priority"):
        runlane.trigger(greet, Greet(name="ada"), priority=priority)
    assert count_runs(db, schema) == 0


@pytest.mark.parametrize("priority", [2**31 - 1, -5, 0, 7])
def test_valid_priority_is_stored(make_runlane: RunlaneFactory, priority: int) -> None:
    runlane = make_runlane(tasks=[greet])
    handle = runlane.trigger(greet, Greet(name="ada"), priority=priority)
    assert runlane.get_run(handle.id).priority == priority


def test_lowest_int32_priority_is_accepted(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(tasks=[greet])
    handle = runlane.trigger(greet, Greet(name="ada"), priority=-(2**31))
    assert runlane.get_run(handle.id).priority == -(2**31)


def test_max_attempts_override_is_stored(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    default = runlane.trigger(greet, Greet(name="a"))
    override = runlane.trigger(greet, Greet(name="b"), max_attempts=9)
    assert runlane.get_run(default.id).max_attempts == 4
    assert runlane.get_run(override.id).max_attempts == 9
    assert run_row(db, schema, override.id)["max_attempts"] == 9


@pytest.mark.parametrize("max_attempts", [0, -1, True, 2.0, 2**31], ids=repr)
def test_invalid_max_attempts_is_rejected(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, max_attempts: Any
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(ConfigurationError, match="max_attempts"):
        runlane.trigger(greet, Greet(name="ada"), max_attempts=max_attempts)
    assert count_runs(db, schema) == 0


# -- idempotency ----------------------------------------------------------------------------


def test_idempotency_key_returns_the_same_run(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(queues=[queue("email"), queue("bulk")], tasks=[send_mail])
    first = runlane.trigger(send_mail, Greet(name="ada"), idempotency_key="k-1")
    again = runlane.trigger(send_mail, Greet(name="zed"), idempotency_key="k-1", queue="bulk")
    assert first.created is True
    assert again.created is False
    assert again.id == first.id
    assert again.queue == "email"  # the existing run's queue, not the ignored override
    assert count_runs(db, schema) == 1
    snap = runlane.get_run(first.id)
    assert snap.idempotency_key == "k-1"
    assert snap.payload == {"name": "ada"}
    other = runlane.trigger(send_mail, Greet(name="ada"), idempotency_key="k-2")
    assert other.created is True
    assert other.id != first.id
    assert count_runs(db, schema) == 2


def test_idempotency_key_is_scoped_to_the_task(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(queues=[queue("email")], tasks=[greet, send_mail])
    a = runlane.trigger(greet, Greet(name="ada"), idempotency_key="same")
    b = runlane.trigger(send_mail, Greet(name="ada"), idempotency_key="same")
    assert a.created
    assert b.created
    assert a.id != b.id
    assert count_runs(db, schema) == 2


def test_idempotency_key_survives_completion(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(tasks=[greet])
    first = runlane.trigger(greet, Greet(name="ada"), idempotency_key="once")
    assert runlane.drain().runs_executed == 1
    again = runlane.trigger(greet, Greet(name="ada"), idempotency_key="once")
    assert again.id == first.id
    assert again.created is False
    assert runlane.drain().runs_executed == 0


@pytest.mark.parametrize("key", ["", "x" * 1001], ids=["empty", "too-long"])
def test_invalid_idempotency_key_is_rejected(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, key: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(ConfigurationError, match="idempotency_key"):
        runlane.trigger(greet, Greet(name="ada"), idempotency_key=key)
    assert count_runs(db, schema) == 0


def test_concurrent_triggers_with_one_idempotency_key_create_one_run(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet], lane_options={"pool_min_size": 8})
    runlane.start()
    threads = 8
    barrier = threading.Barrier(threads)

    def one(index: int) -> RunHandle:
        barrier.wait(timeout=10)
        return runlane.trigger(greet, Greet(name=f"n{index}"), idempotency_key="race")

    with ThreadPoolExecutor(max_workers=threads) as pool:
        handles = list(pool.map(one, range(threads)))
    assert sum(h.created for h in handles) == 1
    assert len({h.id for h in handles}) == 1
    assert count_runs(db, schema) == 1


def test_concurrent_batches_with_overlapping_keys_do_not_deadlock(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet], lane_options={"pool_min_size": 2})
    runlane.start()
    errors: list[Exception] = []
    rounds = 0
    while rounds < 10 and not errors:
        keys = [f"r{rounds}-{i:03d}" for i in range(300)]
        errors = race_keyed_batches(runlane, "greet", [keys, keys[::-1]])
        rounds += 1
    assert errors == []
    assert count_runs(db, schema) == 300 * rounds


# -- connection= ----------------------------------------------------------------------------


def test_trigger_in_committed_transaction(
    make_runlane: RunlaneFactory, database_url: str, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    with psycopg.connect(database_url) as conn:
        conn.execute("select 1")  # the caller's transaction is open
        handle = runlane.trigger(greet, Greet(name="ada"), connection=conn)
        assert handle.created
        # not visible outside the transaction until it commits
        with pytest.raises(RunNotFound):
            runlane.get_run(handle.id)
        assert count_runs(db, schema) == 0
        conn.commit()
    assert runlane.get_run(handle.id).status is RunStatus.QUEUED
    assert count_runs(db, schema) == 1


def test_trigger_in_rolled_back_transaction(
    make_runlane: RunlaneFactory, database_url: str, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    with psycopg.connect(database_url) as conn:
        handle = runlane.trigger(greet, Greet(name="ada"), connection=conn)
        handles = runlane.trigger_many(greet, [Greet(name="b"), Greet(name="c")], connection=conn)
        conn.rollback()
    with pytest.raises(RunNotFound):
        runlane.get_run(handle.id)
    for h in handles:
        with pytest.raises(RunNotFound):
            runlane.get_run(h.id)
    assert count_runs(db, schema) == 0
    assert runlane.drain().runs_executed == 0


def test_trigger_with_transaction_block_rolled_back_by_exception(
    make_runlane: RunlaneFactory, database_url: str, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    handles: list[RunHandle] = []

    def trigger_then_fail(conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            handles.append(runlane.trigger(greet, Greet(name="ada"), connection=conn))
            raise LookupError("abort the caller's transaction")

    with psycopg.connect(database_url, autocommit=True) as conn:
        with pytest.raises(LookupError, match="abort"):
            trigger_then_fail(conn)
        with conn.transaction():
            handles.append(runlane.trigger(greet, Greet(name="bob"), connection=conn))
    with pytest.raises(RunNotFound):
        runlane.get_run(handles[0].id)
    assert runlane.get_run(handles[1].id).payload == {"name": "bob"}
    assert count_runs(db, schema) == 1


def test_idempotency_key_inside_caller_transaction(
    make_runlane: RunlaneFactory, database_url: str, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    existing = runlane.trigger(greet, Greet(name="ada"), idempotency_key="tx")
    # the caller's connection may use any row factory
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        again = runlane.trigger(greet, Greet(name="ada"), idempotency_key="tx", connection=conn)
        conn.commit()
    assert again.id == existing.id
    assert again.created is False
    assert count_runs(db, schema) == 1


# -- trigger_many ---------------------------------------------------------------------------


def test_trigger_many_writes_a_batch_in_payload_order(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    names = [f"n{i}" for i in range(6)]
    payloads: list[Any] = [Greet(name=n) if i % 2 else {"name": n} for i, n in enumerate(names)]
    handles = runlane.trigger_many(greet, payloads, priority=3, max_attempts=2)
    assert len(handles) == len(names)
    assert len({h.id for h in handles}) == len(names)
    assert all(h.created and h.task_id == "greet" and h.queue == "default" for h in handles)
    assert count_runs(db, schema) == len(names)
    for handle, name in zip(handles, names, strict=True):
        snap = runlane.get_run(handle.id)
        assert snap.payload == {"name": name}
        assert snap.priority == 3
        assert snap.max_attempts == 2
    # one batch, one priority: drained first-in first-out
    assert runlane.drain().runs_executed == len(names)
    finished = [runlane.get_run(h.id) for h in handles]
    assert [s.output for s in finished] == [f"Greet:{n}" for n in names]
    started = [s.started_at for s in finished]
    assert all(s is not None for s in started)
    assert started == sorted(started, key=lambda d: d or datetime.min.replace(tzinfo=UTC))


def test_trigger_many_accepts_a_generator(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(tasks=[greet])
    handles = runlane.trigger_many(greet, (Greet(name=str(i)) for i in range(3)))
    assert [runlane.get_run(h.id).payload["name"] for h in handles] == ["0", "1", "2"]


def test_trigger_many_idempotency_keys(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    earlier = runlane.trigger(greet, Greet(name="earlier"), idempotency_key="k1")
    handles = runlane.trigger_many(
        greet,
        [Greet(name="a"), Greet(name="b"), Greet(name="c"), Greet(name="d"), Greet(name="e")],
        idempotency_keys=["k1", "k2", None, "k2", None],
    )
    assert [h.created for h in handles] == [False, True, True, False, True]
    assert handles[0].id == earlier.id
    assert handles[3].id == handles[1].id  # a duplicate within the batch resolves to the first
    assert len({handles[1].id, handles[2].id, handles[4].id, earlier.id}) == 4
    assert runlane.get_run(handles[1].id).payload == {"name": "b"}
    assert runlane.get_run(earlier.id).payload == {"name": "earlier"}
    assert count_runs(db, schema) == 4


def test_trigger_many_key_count_must_match(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(ConfigurationError, match="idempotency keys"):
        runlane.trigger_many(greet, [Greet(name="a"), Greet(name="b")], idempotency_keys=["k"])
    assert count_runs(db, schema) == 0


def test_trigger_many_rejects_a_string_of_keys(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(ConfigurationError):
        runlane.trigger_many(greet, [Greet(name="a"), Greet(name="b")], idempotency_keys="ab")
    assert count_runs(db, schema) == 0


@pytest.mark.parametrize("bad_index", [0, 2, 4])
def test_trigger_many_with_one_invalid_payload_writes_nothing(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str, bad_index: int
) -> None:
    runlane = make_runlane(tasks=[greet])
    payloads: list[Any] = [Greet(name=str(i)) for i in range(5)]
    payloads[bad_index] = {"name": bad_index}
    with pytest.raises(PayloadValidationError):
        runlane.trigger_many(greet, payloads)
    assert count_runs(db, schema) == 0


def test_trigger_many_empty_returns_empty_list(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    assert runlane.trigger_many(greet, []) == []
    assert runlane.trigger_many(greet, [], idempotency_keys=[]) == []
    assert count_runs(db, schema) == 0


# -- reading --------------------------------------------------------------------------------


@pytest.mark.parametrize("as_str", [False, True], ids=["uuid", "str"])
def test_get_run_of_unknown_id(make_runlane: RunlaneFactory, as_str: bool) -> None:
    runlane = make_runlane(tasks=[greet])
    runlane.trigger(greet, Greet(name="ada"))
    unknown = uuid.uuid4()
    with pytest.raises(RunNotFound, match=str(unknown)):
        runlane.get_run(str(unknown) if as_str else unknown)


@pytest.mark.parametrize("run_id", ["not-a-uuid", "", "1234", "z" * 36], ids=repr)
def test_get_run_of_malformed_id(make_runlane: RunlaneFactory, run_id: str) -> None:
    runlane = make_runlane(tasks=[greet])
    with pytest.raises(RunNotFound):
        runlane.get_run(run_id)


def test_get_run_accepts_string_id(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(tasks=[greet])
    handle = runlane.trigger(greet, Greet(name="ada"))
    assert runlane.get_run(str(handle.id)).id == handle.id


# -- environments ---------------------------------------------------------------------------


def test_environments_are_isolated(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    calls: list[str] = []

    @task(id="env.record", schema=Greet)
    def record(payload: Greet, context: RunContext) -> None:
        calls.append(f"{context.environment}:{payload.name}")

    staging = make_runlane(tasks=[record], environment="staging")
    prod = make_runlane(tasks=[record], environment="prod")
    handle = staging.trigger(record, Greet(name="s"), idempotency_key="shared")

    with pytest.raises(RunNotFound, match="prod"):
        prod.get_run(handle.id)
    assert prod.drain().runs_executed == 0
    assert calls == []
    assert staging.get_run(handle.id).status is RunStatus.QUEUED

    # the same idempotency key in another environment is another run
    prod_handle = prod.trigger(record, Greet(name="p"), idempotency_key="shared")
    assert prod_handle.created
    assert prod_handle.id != handle.id
    assert count_runs(db, schema) == 2

    assert prod.drain().runs_executed == 1
    assert calls == ["prod:p"]
    assert staging.get_run(handle.id).status is RunStatus.QUEUED
    assert staging.drain().runs_executed == 1
    assert calls == ["prod:p", "staging:s"]
    assert staging.get_run(handle.id).environment == "staging"
    with pytest.raises(RunNotFound):
        staging.get_run(prod_handle.id)


@pytest.mark.parametrize("count", [1, 3], ids=["trigger", "trigger_many"])
@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "keys"])
def test_an_insert_repeated_after_its_answer_was_lost_finds_its_runs(
    make_runlane: RunlaneFactory, db: Conn, schema: str, count: int, keyed: bool
) -> None:
    """The storage repeats a statement whose connection broke before the answer came; the
    first may have committed. The repeat (the same client-made ids) creates nothing more and
    reports the runs as created, with or without idempotency keys (without them the insert
    has no conflict handling: the key violation itself tells the repeat)."""
    rl = make_runlane(tasks=[greet])
    storage = storage_of(rl)
    runs = NewRuns(
        environment="default",
        task_id="greet",
        queue="default",
        ids=new_run_ids(count),
        payloads=[f'{{"name": "n{i}"}}' for i in range(count)],
        idempotency_keys=[f"k{i}" if keyed else None for i in range(count)],
        priority=0,
        max_attempts=1,
        delay=timedelta(0),
        run_at=None,
    )
    first = storage.run_insert_many(runs)
    again = storage.run_insert_many(runs)
    assert first == again
    assert [row.id for row in again] == list(runs.ids)
    assert all(row.created for row in again)
    assert count_runs(db, schema) == count
