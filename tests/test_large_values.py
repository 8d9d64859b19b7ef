"""Values within runlane's byte limits that Postgres cannot hold in one jsonb value.

Postgres caps a jsonb value at 256 MiB, and jsonb can take six times the JSON text (a small
number is 2 bytes of text, 12 of jsonb). So:

- a ``trigger_many`` batch travels as one jsonb array, and one of payloads each within
  ``max_payload_bytes`` used to fail as a whole with an "unexpected database error"; a large
  batch is now split into several statements, one round trip, one transaction. The first
  test writes such a batch for real; the others lower the split size
  (``_batches.STATEMENT_BYTES``) so that small batches take the same path;
- a single payload, a handler's return value, a step output or a wait token output within
  the limits (here 64 MiB) can still be too much for jsonb: a payload is refused as
  invalid, a return value fails its run (not retried, as over ``max_output_bytes``; it used
  to kill the worker's lifecycle writer), a step or token output raises
  ``ConfigurationError``. Nothing is half-written.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import attrs
import psycopg
import pytest

from runlane import (
    ConfigurationError,
    PayloadValidationError,
    RetryPolicy,
    RunContext,
    Runlane,
    RunlaneError,
    RunStatus,
    StorageUnavailable,
    WaitTokenStatus,
    task,
)
from runlane.postgres import _batches, _eager, _runs
from runlane.storage import Completion, NewRuns, Storage
from runlane.worker import _lifecycle
from runlane.worker._leases import LeaseTracker
from runlane.worker._lifecycle import LifecycleWriter, _Pending
from tests.conftest import RabbitRuntimes, RunlaneFactory
from tests.helpers import (
    Conn,
    Executions,
    Greet,
    consumer_ready,
    consumer_stats,
    count_runs,
    outbox_count,
    q,
    race_keyed_batches,
    storage_of,
)

# tens of megabytes through Postgres per test: minutes for the file, handed out first
pytestmark = pytest.mark.slow


@task(id="greet", schema=Greet)
def greet(payload: Greet, context: RunContext) -> str:
    return f"Greet:{payload.name}"


@task(id="numbers")
def numbers(payload: Any, context: RunContext) -> int:
    return len(payload)


# An array of more than 2**24 values, which Postgres cannot parse as jsonb: its parser then
# asks for 1 GiB at once (and fails in mcxt.c). Its values are empty strings: 50 MB of JSON
# text, within a 64 MiB limit. Of the values with the shortest text, "" costs the server
# half what 0 does to parse (no numeric to make) and the client less to encode: the same
# refusal for about 2 CPU-s less each time.
DENSE = 2**24 + 1
BIG_LIMITS = {"max_payload_bytes": 64 * 1024 * 1024, "max_output_bytes": 64 * 1024 * 1024}


@task(id="dense", retry=RetryPolicy(max_attempts=3))
def dense(payload: Any, context: RunContext) -> Any:
    return [""] * DENSE if payload == "return" else payload


@pytest.fixture
def small_statements(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Batches go in statements of at most about three ``Greet`` payloads; yields the number
    of statements of each insert, and checks at the end that some insert was split."""
    size = 3 * (len('{"name":"n00"}') + 40)
    monkeypatch.setattr(_batches, "STATEMENT_BYTES", size)
    statements: list[int] = []

    def counted(conn: Any, statement: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        statements.append(len(params))
        return _batches.pipelined(conn, statement, params)

    for module in (_eager, _runs):
        monkeypatch.setattr(module, "pipelined", counted)
    yield statements
    assert max(statements, default=0) > 1, "no batch was split"


def _fail_on(db: Conn, schema: str, name: str) -> None:
    """A trigger in the test's schema that refuses the run whose payload names ``name``."""
    db.execute(
        q(
            "create function {s}.refuse() returns trigger language plpgsql as $$ begin "
            f"if new.payload ->> 'name' = '{name}' then raise exception 'refused {name}'; "
            "end if; return new; end $$",
            schema,
        )
    )
    db.execute(
        q(
            "create trigger refuse before insert on {s}.runs for each row "
            "execute function {s}.refuse()",
            schema,
        )
    )


def test_a_batch_beyond_the_jsonb_limit_is_written_whole(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    # 90 payloads of 500 KB of JSON text: each within max_payload_bytes, together 270 MB
    # as one jsonb array (a small number is 2 bytes of text, 12 of jsonb): over 256 MiB
    runlane = make_runlane(tasks=[numbers])
    payload = [0] * 250_000
    handles = runlane.trigger_many(numbers, [payload] * 90)
    assert len({h.id for h in handles}) == 90
    assert all(h.created for h in handles)
    assert count_runs(db, schema) == 90
    row = db.execute(
        q("select count(*), min(jsonb_array_length(payload)) from {s}.runs", schema)
    ).fetchone()
    assert row == (90, 250_000)


def test_a_payload_postgres_cannot_hold_is_refused_as_invalid(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    runlane = make_runlane(tasks=[numbers], **BIG_LIMITS)
    with pytest.raises(PayloadValidationError, match="too large for Postgres to store"):
        runlane.trigger(numbers, [""] * DENSE)
    assert count_runs(db, schema) == 0


def test_a_return_value_postgres_cannot_hold_fails_its_run_and_the_worker_goes_on(
    make_runlane: RunlaneFactory,
) -> None:
    runlane = make_runlane(tasks=[dense], **BIG_LIMITS)
    worker = runlane.create_delivery_worker(concurrency=2)
    big = runlane.trigger(dense, "return")
    failed = runlane.wait_for_run(big.id, timeout=60)
    assert failed.status is RunStatus.FAILED
    assert failed.attempt == 1  # not retried: the handler would return it again
    assert failed.error is not None
    assert failed.error.type == "runlane._codec.OutputTooLarge"
    assert "too large for Postgres to store" in failed.error.message
    assert not failed.error.retryable
    # the worker's lifecycle writer survived it
    after = runlane.trigger(dense, "after")
    assert runlane.wait_for_run(after.id, timeout=15).output == "after"
    assert worker.stats.failed == 1
    worker.close(timeout=10)


class _OutageOnce:
    """A runtime's real storage, counting completion statements; the ``fail_at``-th fails
    as a lost connection would, before reaching the database."""

    def __init__(self, storage: Storage, fail_at: int = 0) -> None:
        self._storage = storage
        self._fail_at = fail_at
        self.calls: list[list[uuid.UUID]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    def run_complete_many(self, completions: Sequence[Completion]) -> set[uuid.UUID]:
        self.calls.append([c.run_id for c in completions])
        if len(self.calls) == self._fail_at:
            raise StorageUnavailable("injected: the connection was lost")
        return self._storage.run_complete_many(completions)


def _claimed_completions(runlane: Runlane, outputs: list[str]) -> list[Completion]:
    """One run per output, claimed; their completions, in the order of ``outputs``."""
    ids = [runlane.trigger(dense, i).id for i in range(len(outputs))]
    claimed = storage_of(runlane).run_claim("default", ["default"], len(ids), timedelta(minutes=5))
    by_id = {c.id: c for c in claimed}
    return [
        Completion(run_id=i, attempt=by_id[i].attempt, lease_token=by_id[i].lease_token, output=o)
        for i, o in zip(ids, outputs, strict=True)
    ]


def _writer(storage: Any) -> LifecycleWriter:
    return LifecycleWriter(
        storage,
        LeaseTracker(timedelta(minutes=5)),
        environment="default",
        name="test-lifecycle",
        on_timeout=lambda tracked: None,
        on_fatal=lambda exc: None,
    )


@pytest.mark.parametrize("together", [False, True], ids=["bounded", "one-statement"])
def test_a_refused_output_in_a_batch_of_completions_leaves_the_others_written(
    make_runlane: RunlaneFactory, monkeypatch: pytest.MonkeyPatch, together: bool
) -> None:
    runlane = make_runlane(tasks=[dense], **BIG_LIMITS)
    a, big, c = _claimed_completions(runlane, ['"a"', "[" + '"",' * (DENSE - 1) + '""]', '"c"'])
    ids = [a.run_id, big.run_id, c.run_id]
    if together:
        # one statement could take all three: it is refused, and they go one by one
        monkeypatch.setattr(_lifecycle, "_STATEMENT_OUTPUT_CHARS", 2**30)
        calls, fail_at = [ids, ids[:1], ids[1:2], ids[2:], ids[2:]], 4
    else:
        # the big output, over the statement bound alone, goes alone
        calls, fail_at = [ids[:1], ids[1:2], ids[2:], ids[2:]], 3
    # ... and c meets an outage once
    storage = _OutageOnce(storage_of(runlane), fail_at=fail_at)
    writer = _writer(storage)
    writer._write_until_done(_Pending(completions=[a, big, c]))
    assert storage.calls == calls
    assert attrs.asdict(writer.stats) == {
        "completed": 2,
        "failed": 1,
        "released": 0,
        "stale": 0,  # a written before the outage is not written (nor counted) again
        "batches": 1,
        "beats_alone": 0,
        "beats_with_extensions": 0,
        "progress": 0,
        "marked_started": 0,
    }
    assert [runlane.get_run(i).output for i in (a.run_id, c.run_id)] == ["a", "c"]
    failed = runlane.get_run(big.run_id)
    assert failed.status is RunStatus.FAILED
    assert failed.error is not None
    assert failed.error.type == "runlane._codec.OutputTooLarge"
    assert not failed.error.retryable


def test_completions_go_in_statements_of_bounded_output(
    make_runlane: RunlaneFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_lifecycle, "_STATEMENT_OUTPUT_CHARS", 10)
    runlane = make_runlane(tasks=[dense])
    completions = _claimed_completions(runlane, ['"aaaa"', '"' + "b" * 12 + '"', '"c"', '"d"'])
    storage = _OutageOnce(storage_of(runlane))
    writer = _writer(storage)
    writer._write_until_done(_Pending(completions=list(completions)))
    ids = [c.run_id for c in completions]
    # a first; b alone, over the bound by itself; c and d together
    assert storage.calls == [ids[:1], ids[1:2], ids[2:]]
    assert writer.stats.completed == 4
    assert [runlane.get_run(i).output for i in ids] == ["aaaa", "b" * 12, "c", "d"]


def test_a_wait_token_output_postgres_cannot_hold_raises_configuration_error(
    make_runlane: RunlaneFactory,
) -> None:
    # a step's output is written by the same storage call path, translated the same way
    runlane = make_runlane(tasks=[dense], **BIG_LIMITS)
    token = runlane.create_wait_token()
    with pytest.raises(ConfigurationError, match="too large for Postgres to store"):
        runlane.complete_wait_token(token.id, [""] * DENSE)
    assert runlane.get_wait_token(token.id).status is WaitTokenStatus.PENDING


@pytest.mark.usefixtures("small_statements")
def test_split_batches_keep_keys_order_and_handles(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    earlier = runlane.trigger(greet, Greet(name="n99"), idempotency_key="k07")
    names = [f"n{i:02d}" for i in range(20)]
    # keys out of order, one repeated within the batch, one taken before, some missing
    keys: list[str | None] = [None if i % 5 == 0 else f"k{(i * 7) % 13:02d}" for i in range(20)]
    handles = runlane.trigger_many(greet, [Greet(name=n) for n in names], idempotency_keys=keys)
    assert count_runs(db, schema) == 1 + len({k for k in keys if k is not None} - {"k07"}) + 4
    first: dict[str, uuid.UUID] = {}
    for handle, name, key in zip(handles, names, keys, strict=True):
        if key == "k07":
            assert (handle.id, handle.created) == (earlier.id, False)
        elif key is not None and key in first:
            assert (handle.id, handle.created) == (first[key], False)
        else:
            assert handle.created
            assert runlane.get_run(handle.id).payload == {"name": name}
            if key is not None:
                first[key] = handle.id
    assert runlane.drain().runs_executed == count_runs(db, schema)


@pytest.mark.usefixtures("small_statements")
def test_a_split_batch_failing_late_writes_nothing(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    _fail_on(db, schema, "n19")  # the last piece, in lock order (keyless: by id)
    with pytest.raises(RunlaneError, match="refused n19"):
        runlane.trigger_many(greet, [Greet(name=f"n{i:02d}") for i in range(20)])
    assert count_runs(db, schema) == 0


@pytest.mark.usefixtures("small_statements")
@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "transaction"])
def test_a_split_batch_on_the_callers_connection_is_one_write(
    make_runlane: RunlaneFactory, database_url: str, db: Conn, schema: str, autocommit: bool
) -> None:
    runlane = make_runlane(tasks=[greet])
    payloads = [Greet(name=f"n{i:02d}") for i in range(12)]
    with psycopg.connect(database_url, autocommit=autocommit) as conn:
        handles = runlane.trigger_many(greet, payloads, connection=conn)
        if not autocommit:  # the caller's transaction holds the runs until it commits
            assert count_runs(db, schema) == 0
            conn.commit()
    assert count_runs(db, schema) == 12
    assert [runlane.get_run(h.id).payload["name"] for h in handles] == [p.name for p in payloads]

    _fail_on(db, schema, "m11")
    more = [Greet(name=f"m{i:02d}") for i in range(12)]
    with psycopg.connect(database_url, autocommit=autocommit) as conn:
        with pytest.raises(RunlaneError, match="refused m11"):
            runlane.trigger_many(greet, more, connection=conn)
        if not autocommit:
            conn.rollback()
    assert count_runs(db, schema) == 12


@pytest.mark.usefixtures("small_statements")
def test_a_split_batch_rolls_back_with_the_callers_transaction(
    make_runlane: RunlaneFactory, database_url: str, db: Conn, schema: str
) -> None:
    runlane = make_runlane(tasks=[greet])
    with psycopg.connect(database_url) as conn:
        runlane.trigger_many(greet, [Greet(name=f"n{i:02d}") for i in range(12)], connection=conn)
        conn.rollback()
    assert count_runs(db, schema) == 0


@pytest.mark.usefixtures("small_statements")
def test_split_batches_with_overlapping_keys_do_not_deadlock(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    runlane = make_runlane(tasks=[greet], lane_options={"pool_min_size": 3})
    runlane.start()
    for rounds in range(5):
        # keys whose "C" order differs from most locales' (case, accents)
        keys = [f"{c}{rounds}-{i:02d}" for i in range(10) for c in ("a", "B", "é")]
        # two split batches in opposite orders race one small enough for one statement
        assert race_keyed_batches(runlane, "greet", [keys, keys[::-1], [keys[1], keys[0]]]) == []
    assert count_runs(db, schema) == 5 * 30


def test_split_runs_cuts_in_lock_order_within_the_size() -> None:
    keys = ["b", None, "a", "B", "é", None, "a"]
    runs = NewRuns(
        environment="e",
        task_id="t",
        queue="q",
        ids=[uuid.UUID(int=i) for i in (7, 6, 5, 4, 3, 2, 1)],
        payloads=["x" * 10, "y" * 10, "z" * 100, "{}", "[]", "1", "2"],
        idempotency_keys=keys,
        priority=0,
        max_attempts=1,
        delay=timedelta(0),
        run_at=None,
    )
    assert _batches.split_runs(runs, max_bytes=10_000) == [runs]
    pieces = _batches.split_runs(runs, max_bytes=100)
    flat = [
        (key, run_id.int)
        for piece in pieces
        for key, run_id in zip(piece.idempotency_keys, piece.ids, strict=True)
    ]
    # keys in the "C" collation (B < a < b < é), equal keys by id, keyless rows last by id
    assert flat == [("B", 4), ("a", 1), ("a", 5), ("b", 7), ("é", 3), (None, 2), (None, 6)]
    # each piece within 100 bytes (payload, key and 40 a row), but a payload larger alone
    assert [len(p.ids) for p in pieces] == [2, 1, 2, 2]
    assert [len(p) for p in pieces[1].payloads] == [100]
    for piece in pieces:
        for run_id, payload in zip(piece.ids, piece.payloads, strict=True):
            assert runs.payloads[runs.ids.index(run_id)] == payload


@pytest.mark.usefixtures("small_statements")
def test_a_split_eager_batch_on_the_rabbitmq_lane_is_published_once(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    executions = Executions()

    @task(id="lane.split", schema=Greet)
    def split(payload: Greet, context: RunContext) -> str:
        executions.add(context)
        return payload.name

    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[split])
    worker = rl.create_delivery_worker(concurrency=4)
    consumer_ready(worker)
    keys = [f"k{i % 9}" for i in range(12)]  # three repeated within the batch
    payloads = [Greet(name=f"n{i:02d}") for i in range(12)]
    handles = rl.trigger_many(split, payloads, idempotency_keys=keys)
    assert [h.created for h in handles] == [True] * 9 + [False] * 3
    assert [h.id for h in handles[9:]] == [h.id for h in handles[:3]]
    for i, handle in enumerate(handles[:9]):
        assert rl.wait_for_run(handle.id, timeout=15).output == f"n{i:02d}"
    worker.close(timeout=10)
    assert set(executions.runs) == {h.id for h in handles[:9]}
    assert not executions.more_than_once()
    assert outbox_count(db, schema) == 0
    assert consumer_stats(worker).unknown == 0
    assert consumer_stats(worker).duplicates == 0
