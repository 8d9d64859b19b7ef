"""Group commit: concurrent trigger() calls share one statement and one commit.

Each test holds a lock on the runs table so that a first call's statement stays in flight,
queues the other calls behind it, then lets go: the queued calls are written by one shared
statement (one transaction: one xmin), and each must come back with its own handle or its
own error.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from benchmarks._statements import counting_statements
from runlane import RunContext, RunHandle, RunlaneError, queue, task
from runlane._ids import new_run_ids
from runlane.postgres import PostgresStorage
from runlane.postgres._eager import eager_item_id
from runlane.postgres._group import GROUP_ROW_CHARS, GroupCommit, groupable
from runlane.storage import InsertedRun, NewRuns, OutboxItem
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, Greet, q, run_row, run_together, storage_of, wait_until

# every test runs with the statements sent through libpq and through the cursor API
pytestmark = pytest.mark.usefixtures("statement_path")


@task(id="greet", schema=Greet)
def greet(payload: Greet, context: RunContext) -> None:
    return None


@task(id="anything")
def anything(payload: Any, context: RunContext) -> None:
    return None


@task(id="mail", schema=Greet, queue="email")
def mail(payload: Greet, context: RunContext) -> None:
    return None


@contextlib.contextmanager
def runs_locked(database_url: str, schema: str) -> Iterator[None]:
    """Inserts into the test's runs table wait while this is held."""
    with psycopg.connect(database_url) as conn:
        conn.execute(q("lock table {s}.runs in share mode", schema))
        yield
        conn.rollback()


def grouped(
    database_url: str, schema: str, group: GroupCommit, calls: Sequence[Callable[[], Any]]
) -> list[Any]:
    """Run ``calls[0]`` with its statement held in flight, queue the others behind it, let
    go; each call's result, or the exception it raised."""
    results: list[Any] = [None] * len(calls)

    def runner(index: int) -> None:
        try:
            results[index] = calls[index]()
        except Exception as exc:
            results[index] = exc

    threads = [
        threading.Thread(target=runner, args=(i,), name=f"group-caller-{i}")
        for i in range(len(calls))
    ]
    with runs_locked(database_url, schema):
        threads[0].start()
        wait_until(lambda: group._in_flight == 1, timeout=10, what="the first statement")
        for thread in threads[1:]:
            thread.start()
        wait_until(
            lambda: len(group._queue) == len(calls) - 1,
            timeout=10,
            what="the other calls to queue",
            state=lambda: len(group._queue),
        )
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), f"{thread.name} did not return"
    return results


def commits(db: Conn, schema: str) -> int:
    """How many transactions wrote the runs there are."""
    row = db.execute(q("select count(distinct xmin::text) from {s}.runs", schema)).fetchone()
    assert row is not None
    return int(row[0])


def new_runs(payload: str = '{"name": "x"}', **changes: Any) -> NewRuns:
    fields: dict[str, Any] = {
        "environment": "default",
        "task_id": "greet",
        "queue": "default",
        "ids": new_run_ids(1),
        "payloads": [payload],
        "idempotency_keys": [None],
        "priority": 0,
        "max_attempts": 1,
        "delay": timedelta(0),
        "run_at": None,
    }
    fields.update(changes)
    return NewRuns(**fields)


def test_queued_triggers_share_one_statement_each_with_its_own_options(
    make_runlane: RunlaneFactory, database_url: str, db: Conn, schema: str
) -> None:
    rl = make_runlane(
        tasks=[greet, mail], queues=[queue("email")], lane_options={"pool_min_size": 2}
    )
    rl.start()
    group = storage_of(rl)._runs.group  # type: ignore[attr-defined]
    later = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    options: list[dict[str, Any]] = [
        {},
        {"priority": 7, "max_attempts": 3},
        {"delay": 3600},
        {"run_at": later},
        {"queue": "email", "idempotency_key": "k1"},
        {"priority": -5},
        {},
    ]
    tasks = [greet, greet, greet, greet, greet, mail, mail]
    calls = [
        functools.partial(rl.trigger, t, Greet(name=f"n{i}"), **o)
        for i, (t, o) in enumerate(zip(tasks, options, strict=True))
    ]
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(sql.SQL("listen {}").format(sql.Identifier(f"runlane.{schema}")))
        handles = grouped(database_url, schema, group, calls)
        heard = {n.payload for n in listener.notifies(timeout=0.5)}
    assert all(isinstance(h, RunHandle) and h.created for h in handles), handles
    assert len({h.id for h in handles}) == len(calls)
    assert commits(db, schema) == 2  # the first call alone, the six others together
    # the insert trigger announced the shared statement's queues due now, at its commit
    assert heard == {"default|default", "default|email"}
    for i, (handle, t, o) in enumerate(zip(handles, tasks, options, strict=True)):
        row = run_row(db, schema, handle.id)
        assert row["task_id"] == t.id == handle.task_id
        assert row["payload"] == {"name": f"n{i}"}
        assert row["queue"] == handle.queue == o.get("queue", t.queue or "default")
        assert row["priority"] == o.get("priority", 0)
        assert row["max_attempts"] == o.get("max_attempts", t.retry.max_attempts)
        assert row["idempotency_key"] == o.get("idempotency_key")
        assert row["status"] == "queued"
        assert row["trace_context"] is None
        if "run_at" in o:
            assert row["due_at"] == later
        elif "delay" in o:
            ahead = row["due_at"] - row["created_at"]
            assert timedelta(seconds=3599) < ahead <= timedelta(seconds=3601)
        else:
            assert row["due_at"] == row["created_at"]


def test_a_payload_of_null_is_written_by_the_shared_statement_as_a_lone_call_writes_it(
    make_runlane: RunlaneFactory, database_url: str, db: Conn, schema: str
) -> None:
    """JSON null reads as SQL NULL in json_to_recordset: the shared statement stores it as
    the jsonb null a lone call stores, instead of failing the group (whose calls would then
    each write alone) on the column's not-null rule."""
    rl = make_runlane(tasks=[anything], lane_options={"pool_min_size": 2})
    group = storage_of(rl)._runs.group  # type: ignore[attr-defined]
    payloads: list[Any] = [None, None, {"n": None}, None]
    calls = [functools.partial(rl.trigger, anything, p) for p in payloads]
    handles = grouped(database_url, schema, group, calls)
    assert all(isinstance(h, RunHandle) for h in handles), handles
    assert commits(db, schema) == 2  # the first call alone, the three others together
    for handle, payload in zip(handles, payloads, strict=True):
        stored = db.execute(
            q("select payload, jsonb_typeof(payload) from {s}.runs where id = %s", schema),
            [handle.id],
        ).fetchone()
        assert stored == (payload, "null" if payload is None else "object")


def test_one_key_in_a_group_makes_one_run_and_a_stored_key_resolves(
    make_runlane: RunlaneFactory, database_url: str, db: Conn, schema: str
) -> None:
    rl = make_runlane(
        tasks=[greet, mail], queues=[queue("email")], lane_options={"pool_min_size": 2}
    )
    rl.start()
    stored = rl.trigger(greet, Greet(name="before"), idempotency_key="old")
    group = storage_of(rl)._runs.group  # type: ignore[attr-defined]
    calls: list[Callable[[], RunHandle]] = [lambda: rl.trigger(greet, Greet(name="first"))]
    calls += [
        functools.partial(rl.trigger, greet, Greet(name=f"s{i}"), idempotency_key="same")
        for i in range(5)
    ]
    calls.append(lambda: rl.trigger(greet, Greet(name="again"), idempotency_key="old"))
    # the same key for another task is another run
    calls.append(lambda: rl.trigger(mail, Greet(name="m"), idempotency_key="same"))
    handles = grouped(database_url, schema, group, calls)
    same = handles[1:6]
    assert sum(h.created for h in same) == 1
    assert len({h.id for h in same}) == 1
    assert run_row(db, schema, same[0].id)["idempotency_key"] == "same"
    assert handles[6].id == stored.id
    assert not handles[6].created
    assert handles[7].created
    assert handles[7].task_id == "mail"
    assert handles[7].id != same[0].id
    rows = db.execute(q("select count(*) from {s}.runs", schema)).fetchone()
    assert rows is not None
    assert rows[0] == 4


def test_a_row_postgres_refuses_fails_its_own_call_only(
    make_runlane: RunlaneFactory, database_url: str, db: Conn, schema: str
) -> None:
    """A payload jsonb cannot hold and a priority beyond integer: each of those calls gets
    its own error, and every other call of the group its run."""
    rl = make_runlane(tasks=[greet], lane_options={"pool_min_size": 2})
    storage = storage_of(rl)
    group = storage._runs.group  # type: ignore[attr-defined]
    batches = [new_runs() for _ in range(3)]
    batches.insert(1, new_runs('{"n": 1e1000000}'))  # numeric overflow: refused
    batches.append(new_runs(priority=2**31))
    batches.append(new_runs(trace_context='{"traceparent": "00-ab-cd-01"}'))
    results = grouped(
        database_url,
        schema,
        group,
        [functools.partial(storage.run_insert_many, b) for b in batches],
    )
    assert isinstance(results[1], RunlaneError)
    assert isinstance(results[4], RunlaneError)
    for i in (0, 2, 3, 5):
        assert results[i] == [InsertedRun(id=batches[i].ids[0], queue="default", created=True)]
    ids = {row[0] for row in db.execute(q("select id from {s}.runs", schema)).fetchall()}
    assert ids == {batches[i].ids[0] for i in (0, 2, 3, 5)}
    assert run_row(db, schema, batches[5].ids[0])["trace_context"] == {"traceparent": "00-ab-cd-01"}


def test_a_group_repeated_after_its_answer_was_lost_finds_its_runs(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    """The shared statement, repeated with the same client-made ids (as the storage does
    when the connection broke before the answer), reports every run as created."""
    rl = make_runlane(tasks=[greet])
    storage = storage_of(rl)
    batches = [new_runs(), new_runs(idempotency_keys=["k"]), new_runs()]
    first = storage._runs.insert_together(batches)  # type: ignore[attr-defined]
    again = storage._runs.insert_together(batches)  # type: ignore[attr-defined]
    assert first == again == [[InsertedRun(b.ids[0], "default", True)] for b in batches]
    assert commits(db, schema) == 1
    # without any key the statement has no conflict handling: its ids are met, then read
    fresh = [new_runs(), new_runs(queue="other")]
    first = storage._runs.insert_together(fresh)  # type: ignore[attr-defined]
    again = storage._runs.insert_together(fresh)  # type: ignore[attr-defined]
    assert first == again == [[InsertedRun(b.ids[0], b.queue, True)] for b in fresh]
    assert commits(db, schema) == 2


def test_a_call_written_alone_repeated_after_its_answer_was_lost_finds_its_run(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    """A lone call's statement (run_insert_one through libpq), repeated with its client-made
    id, reports its run as created; its options are stored as a cursor stored them."""
    storage = storage_of(make_runlane(tasks=[greet]))
    later = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    parent = new_run_ids(1)[0]
    cases = [
        new_runs(),
        new_runs(idempotency_keys=["k"], priority=-3, max_attempts=4),
        new_runs(run_at=later, parent_run_id=parent, trace_context='{"traceparent": "t"}'),
        new_runs('{"n": 1.5, "s": "z\u00fcrich"}', delay=timedelta(seconds=90)),
    ]
    for runs in cases:
        first = storage._runs.insert_one(runs)  # type: ignore[attr-defined]
        again = storage._runs.insert_one(runs)  # type: ignore[attr-defined]
        assert first == again == [InsertedRun(runs.ids[0], "default", True)]
    assert commits(db, schema) == len(cases)
    rows = [run_row(db, schema, runs.ids[0]) for runs in cases]
    assert (rows[1]["idempotency_key"], rows[1]["priority"], rows[1]["max_attempts"]) == (
        "k",
        -3,
        4,
    )
    assert rows[2]["due_at"] == later
    assert rows[2]["parent_run_id"] == parent
    assert rows[2]["trace_context"] == {"traceparent": "t"}
    assert rows[3]["payload"] == {"n": 1.5, "s": "zürich"}
    assert (
        timedelta(seconds=89) < rows[3]["due_at"] - rows[3]["created_at"] <= timedelta(seconds=91)
    )
    # the same key under a new id resolves to the stored run, not created
    other = storage._runs.insert_one(new_runs(idempotency_keys=["k"]))  # type: ignore[attr-defined]
    assert other == [InsertedRun(cases[1].ids[0], "default", False)]


def test_a_latin1_client_encoding_stores_text_as_a_cursor_does(
    make_runlane: RunlaneFactory, database_url: str, db: Conn, schema: str
) -> None:
    """The statements sent through libpq encode their text in the session's encoding: with
    client_encoding=latin1 a lone call, a shared statement and a cursor's statement store
    the same characters, and an idempotency key written by either path meets the other."""
    separator = "&" if "?" in database_url else "?"
    url = f"{database_url}{separator}client_encoding=latin1"
    storage = PostgresStorage(connection_string=url, schema=schema)
    try:
        payload = '{"s": "zürich"}'
        lone = new_runs(payload, idempotency_keys=["clé"])
        shared = [new_runs(payload), new_runs(payload, idempotency_keys=["schön"])]
        assert storage._runs.insert_one(lone) == [InsertedRun(lone.ids[0], "default", True)]
        storage._runs.insert_together(shared)
        rows = [run_row(db, schema, r.ids[0]) for r in (lone, *shared)]
        assert [r["payload"] for r in rows] == [{"s": "zürich"}] * 3
        assert [r["idempotency_key"] for r in rows] == ["clé", None, "schön"]
        # the cursor path (a batch of two) meets both keys; the libpq path meets its own
        direct = new_runs(
            payloads=[payload, payload], ids=new_run_ids(2), idempotency_keys=["clé", "schön"]
        )
        met = storage._runs.insert_direct(direct)
        assert [(m.id, m.created) for m in met] == [
            (lone.ids[0], False),
            (shared[1].ids[0], False),
        ]
        again = storage._runs.insert_one(new_runs(idempotency_keys=["schön"]))
        assert again == [InsertedRun(shared[1].ids[0], "default", False)]
    finally:
        storage.close()


def test_the_statement_count_sees_the_shared_insert(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    """benchmarks.run prints statements per run: the shared insert, sent through libpq past
    the cursor layer (postgres/_pq.py), is counted, with its one preparation a connection."""
    storage = storage_of(make_runlane(tasks=[greet]))
    batches = [new_runs(), new_runs()]
    with counting_statements() as count:
        made = storage._runs.insert_together(batches)  # type: ignore[attr-defined]
        first = count.value
        storage._runs.insert_together([new_runs(), new_runs()])  # type: ignore[attr-defined]
    assert made == [[InsertedRun(b.ids[0], "default", True)] for b in batches]
    # the first also prepared it on its connection (and checked the schema, once)
    assert first >= 2
    assert count.value - first == 1
    assert db.execute(q("select count(*) from {s}.runs", schema)).fetchone() == (4,)


def test_a_lone_call_and_large_or_batched_calls_do_not_wait_for_a_group() -> None:
    """Without a statement in flight a call writes alone at once; trigger_many batches
    and large payloads never join a group."""
    seen: list[str] = []

    def alone(runs: NewRuns) -> list[InsertedRun]:
        seen.append("alone")
        return [InsertedRun(runs.ids[0], runs.queue, True)]

    def together(groups: Any, *_: Any) -> list[list[InsertedRun]]:
        raise AssertionError("no group expected")

    group = GroupCommit(alone, together)
    runs = new_runs()
    assert group.insert(runs) == [InsertedRun(runs.ids[0], "default", True)]
    assert group.insert(runs) == [InsertedRun(runs.ids[0], "default", True)]
    assert seen == ["alone", "alone"]
    assert group._in_flight == 0
    assert group._queue == []

    assert groupable(runs)
    assert not groupable(new_runs("[" + "1," * GROUP_ROW_CHARS + "1]"))
    two = new_runs(ids=new_run_ids(2), payloads=["1", "2"], idempotency_keys=[None, None])
    assert not groupable(two)


def test_a_lone_call_holds_no_one_and_teaches_no_pace() -> None:
    """A call that wrote alone with nobody queued behind it leaves no hold for the next
    statement (a call from another thread right after writes alone at once, gathering no
    one) and leaves the crowd's learned pace as it was: one thread coming back is no crowd."""
    seen: list[str] = []

    def alone(runs: NewRuns) -> list[InsertedRun]:
        seen.append(threading.current_thread().name)
        return [InsertedRun(runs.ids[0], runs.queue, True)]

    def together(groups: Any, *_: Any) -> list[list[InsertedRun]]:
        raise AssertionError("no group expected")

    group = GroupCommit(alone, together, hold_fraction=1e6, max_hold=30.0)
    group._pace = 0.004
    for _ in range(3):
        runs = new_runs()
        assert group.insert(runs) == [InsertedRun(runs.ids[0], "default", True)]
        assert group._returning == set()
        assert group._pace == 0.004
    other = threading.Thread(target=lambda: group.insert(new_runs()), name="other-caller")
    other.start()
    other.join(10)
    assert not other.is_alive()
    assert seen[-1] == "other-caller"
    assert not group._gathering
    assert group._pace == 0.004
    assert group._in_flight == 0
    assert group._queue == []


def test_a_failed_leader_still_wakes_its_group() -> None:
    """A shared statement that raises (here: the leader's thread is told to stop) leaves
    no call waiting: each writes its run alone."""
    gate = threading.Event()
    started = threading.Event()
    written: list[uuid.UUID] = []

    def alone(runs: NewRuns) -> list[InsertedRun]:
        if runs.payloads[0] == '"first"':
            started.set()
            assert gate.wait(10)
        written.append(runs.ids[0])
        return [InsertedRun(runs.ids[0], runs.queue, True)]

    def together(groups: Any, *_: Any) -> list[list[InsertedRun]]:
        raise RuntimeError("the shared statement failed")

    group = GroupCommit(alone, together)
    first = new_runs('"first"')
    others = [new_runs() for _ in range(4)]
    out: dict[int, list[InsertedRun]] = {}
    threads = [threading.Thread(target=lambda: out.__setitem__(0, group.insert(first)))]
    threads += [
        threading.Thread(target=lambda i=i, r=r: out.__setitem__(i, group.insert(r)))
        for i, r in enumerate(others, start=1)
    ]
    threads[0].start()
    assert started.wait(10)
    for thread in threads[1:]:
        thread.start()
    wait_until(lambda: len(group._queue) == 4, timeout=10, what="four queued calls")
    gate.set()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    assert sorted(written) == sorted([first.ids[0], *(r.ids[0] for r in others)])
    assert out[3] == [InsertedRun(others[2].ids[0], "default", True)]
    assert group._in_flight == 0
    assert group._queue == []


def test_many_threads_triggering_at_once_each_get_their_run(
    make_runlane: RunlaneFactory, database_url: str, db: Conn, schema: str
) -> None:
    """16 threads, 25 triggers each, no lock held: every call returns its own run, already
    committed (another connection reads it), and the statements were shared."""
    rl = make_runlane(tasks=[greet], lane_options={"pool_min_size": 2})
    rl.start()
    threads = 16
    barrier = threading.Barrier(threads)
    handles: list[list[RunHandle]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            with psycopg.connect(database_url, autocommit=True) as reader:
                barrier.wait(10)
                for j in range(25):
                    handle = rl.trigger(greet, Greet(name=f"{index}-{j}"))
                    row = run_row(reader, schema, handle.id)
                    assert row["payload"] == {"name": f"{index}-{j}"}
                    handles[index].append(handle)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(60)
        assert not thread.is_alive()
    assert errors == []
    assert len({h.id for hs in handles for h in hs}) == threads * 25
    assert commits(db, schema) < threads * 25


class Collector:
    """An eager publisher that remembers each hand-over."""

    def __init__(self) -> None:
        self.handed: list[list[OutboxItem]] = []

    def submit(self, items: Sequence[OutboxItem], claimed_at: float | None = None) -> None:
        assert claimed_at is not None
        self.handed.append(list(items))

    def close(self, timeout: float | None = None) -> None:
        pass


def test_eager_triggers_share_a_statement_and_one_claim_for_their_items(
    database_url: str, db: Conn, schema: str
) -> None:
    """On a transport lane the queued calls' runs go in one statement whose items of runs
    due now are claimed by one token and handed to the publisher at once; a delayed run's
    item waits unclaimed, and a repeated key's call gets the run without an item."""
    storage = PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=3)
    collector = Collector()
    storage.attach_eager_publisher(collector)
    eager = storage._runs.eager
    assert eager is not None
    try:
        storage.outbox_enable("default", timedelta(minutes=5))
        batches = [new_runs() for _ in range(4)]
        batches.append(new_runs(delay=timedelta(hours=1)))
        batches.append(new_runs(idempotency_keys=["k"]))
        batches.append(new_runs(idempotency_keys=["k"], queue="other"))
        results = grouped(
            database_url,
            schema,
            eager.group,
            [functools.partial(storage.run_insert_many, b) for b in batches],
        )
        assert commits(db, schema) == 2
        for i in range(6):
            assert results[i] == [InsertedRun(batches[i].ids[0], "default", True)]
        assert results[6] == [InsertedRun(batches[5].ids[0], "default", False)]
        lone, group = collector.handed
        assert [item.run_id for item in lone] == [batches[0].ids[0]]
        assert sorted(item.run_id for item in group) == sorted(
            b.ids[0] for b in (*batches[1:4], batches[5])
        )
        (token,) = {item.claim_token for item in group}
        assert all(item.id == eager_item_id(token, item.run_id) for item in group)
        stored = dict(
            db.execute(q("select run_id, claim_token from {s}.outbox", schema)).fetchall()
        )
        assert stored[batches[4].ids[0]] is None  # delayed: unclaimed, for a later sweep
        assert all(stored[item.run_id] == token for item in group)
        assert len(stored) == 6
    finally:
        storage.close()


def test_an_eager_group_without_keys_is_written_fresh_and_survives_a_repeat(
    database_url: str, db: Conn, schema: str
) -> None:
    """Eager calls without idempotency keys share run_insert_group_claimed_fresh (no
    conflict handling): the due runs' items are claimed and handed over, a delayed one's
    waits; the statement repeated after its answer was lost meets its ids, reports every
    run as created and hands nothing over again (the first claim's items stay for the
    sweeps once it expires)."""
    storage = PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=3)
    collector = Collector()
    storage.attach_eager_publisher(collector)
    eager = storage._runs.eager
    assert eager is not None
    try:
        storage.outbox_enable("default", timedelta(minutes=5))
        batches = [new_runs(), new_runs(queue="other"), new_runs(delay=timedelta(hours=1))]
        first = eager.insert_together(batches)
        assert first == [[InsertedRun(b.ids[0], b.queue, True)] for b in batches]
        (handed,) = collector.handed
        assert sorted(i.run_id for i in handed) == sorted(b.ids[0] for b in batches[:2])
        assert {i.queue for i in handed} == {"default", "other"}
        again = eager.insert_together(batches)
        assert again == first
        assert len(collector.handed) == 1  # nothing handed over twice
        stored = dict(
            db.execute(q("select run_id, claim_token from {s}.outbox", schema)).fetchall()
        )
        assert stored[batches[2].ids[0]] is None
        (token,) = {i.claim_token for i in handed}
        assert stored[batches[0].ids[0]] == stored[batches[1].ids[0]] == token
        assert len(stored) == 3
    finally:
        storage.close()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_a_queued_call_interrupted_by_a_signal_leaves_no_one_waiting() -> None:
    """Ctrl-C (a signal's exception in the main thread) while a call waits in the queue:
    the call leaves the queue, the statement in flight ends normally, and later calls are
    not left waiting for the one that left."""
    gate = threading.Event()
    started = threading.Event()

    class Interrupted(Exception):
        pass

    def alone(runs: NewRuns) -> list[InsertedRun]:
        if runs.payloads[0] == '"first"':
            started.set()
            assert gate.wait(10)
        return [InsertedRun(runs.ids[0], runs.queue, True)]

    def together(groups: Any, *_: Any) -> list[list[InsertedRun]]:
        return [[InsertedRun(r.ids[0], r.queue, True)] for r in groups]

    group = GroupCommit(alone, together)
    first = threading.Thread(target=group.insert, args=(new_runs('"first"'),))
    first.start()
    assert started.wait(10)

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            group.insert(new_runs())  # queued behind the first, then interrupted
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert group._queue == []
    gate.set()
    first.join(10)
    assert not first.is_alive()
    later: list[list[InsertedRun]] = []
    runs = new_runs()
    after = threading.Thread(target=lambda: later.append(group.insert(runs)))
    after.start()
    after.join(10)
    assert not after.is_alive(), "a later call waits for the call that left"
    assert later == [[InsertedRun(runs.ids[0], "default", True)]]
    assert group._in_flight == 0


def test_a_follower_interrupted_in_a_formed_group_still_wakes_the_ones_after_it() -> None:
    """Followers wake one another in turn (the leader wakes only the first): one that stops
    waiting (Ctrl-C in the main thread) while its group's statement is in flight passes
    the wake-up on, so the calls after it are not left waiting for it."""
    lone_gate, group_gate = threading.Event(), threading.Event()
    lone_started, group_started = threading.Event(), threading.Event()

    class Interrupted(Exception):
        pass

    def alone(runs: NewRuns) -> list[InsertedRun]:
        if runs.payloads[0] == '"first"':
            lone_started.set()
            assert lone_gate.wait(10)
        return [InsertedRun(runs.ids[0], runs.queue, True)]

    def together(groups: Any, rows: str, committed: Callable[[], None]) -> Any:
        group_started.set()
        assert group_gate.wait(10)
        committed()
        return [[InsertedRun(r.ids[0], r.queue, True)] for r in groups]

    group = GroupCommit(alone, together)
    out: dict[str, list[InsertedRun]] = {}
    leader_runs, last_runs = new_runs('"leader"'), new_runs('"last"')
    first = threading.Thread(target=group.insert, args=(new_runs('"first"'),))
    leader = threading.Thread(target=lambda: out.__setitem__("leader", group.insert(leader_runs)))

    def last_call() -> None:
        wait_until(lambda: len(group._queue) == 2, timeout=10, what="the main thread to queue")
        out["last"] = group.insert(last_runs)

    last = threading.Thread(target=last_call)
    first.start()
    assert lone_started.wait(10)
    leader.start()
    wait_until(lambda: len(group._queue) == 1, timeout=10, what="the leader to queue")
    last.start()

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    def release_when_grouped() -> None:
        wait_until(lambda: len(group._queue) == 3, timeout=10, what="three queued calls")
        lone_gate.set()
        assert group_started.wait(10)
        signal.setitimer(signal.ITIMER_REAL, 0.1)  # the main thread: a follower, waiting

    helper = threading.Thread(target=release_when_grouped)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        helper.start()
        with pytest.raises(Interrupted):
            group.insert(new_runs('"main"'))
        last.join(10)
        assert not last.is_alive(), "the call after the interrupted follower was not woken"
        assert out["last"] == [InsertedRun(last_runs.ids[0], "default", True)]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        lone_gate.set()
        group_gate.set()
    for thread in (first, leader, helper):
        thread.join(10)
        assert not thread.is_alive()
    assert out["leader"] == [InsertedRun(leader_runs.ids[0], "default", True)]
    assert group._in_flight == 0
    assert group._queue == []


def test_a_crowd_that_calls_again_at_once_is_gathered_into_every_statement() -> None:
    """Threads that trigger in a loop call again as soon as their statement commits: the
    next statement waits for them (within its hold) instead of leaving without them, so
    every statement carries the whole crowd, not half of it in turns."""
    threads, rounds = 6, 5
    gate, started = threading.Event(), threading.Event()
    sizes: list[int] = []

    def alone(runs: NewRuns) -> list[InsertedRun]:
        sizes.append(1)
        if runs.payloads[0] == '"first"':
            started.set()
            assert gate.wait(10)
        return [InsertedRun(runs.ids[0], runs.queue, True)]

    def together(groups: Any, rows: str, committed: Callable[[], None]) -> Any:
        sizes.append(len(groups))
        committed()
        return [[InsertedRun(r.ids[0], r.queue, True)] for r in groups]

    # a hold long enough for any machine: the calls come back long before it ends
    group = GroupCommit(alone, together, hold_fraction=1e6, max_hold=30.0)
    errors: list[BaseException] = []

    def loop(first: bool) -> None:
        try:
            if first:
                group.insert(new_runs('"first"'))
            for _ in range(rounds):
                group.insert(new_runs())
        except BaseException as exc:
            errors.append(exc)

    crowd = [threading.Thread(target=loop, args=(i == 0,)) for i in range(threads)]
    crowd[0].start()
    assert started.wait(10)
    for thread in crowd[1:]:
        thread.start()
    wait_until(lambda: len(group._queue) == threads - 1, timeout=10, what="the crowd to queue")
    gate.set()
    for thread in crowd:
        thread.join(30)
        assert not thread.is_alive()
    assert errors == []
    # the first call alone, then the five others with it (once it came back), then all six
    # in each statement
    assert sizes == [1] + [threads] * rounds
    assert group._in_flight == 0
    assert group._queue == []


def test_a_crowd_slower_to_come_back_than_the_hold_is_waited_for_once_its_pace_is_known() -> None:
    """Callers that do some work between their calls come back later than a quarter of the
    statement's time: the first hold misses them, but their pace is learned as they come
    back, and the next holds wait for them, so the statements carry the whole crowd again
    instead of one call alone, then the rest (alternating 1 and 3)."""
    threads, rounds, statement, work = 4, 8, 0.04, 0.015
    sizes: list[int] = []

    def alone(runs: NewRuns) -> list[InsertedRun]:
        sizes.append(1)
        time.sleep(statement)  # the statement's own time, of which the old hold was a quarter
        return [InsertedRun(runs.ids[0], runs.queue, True)]

    def together(groups: Any, rows: str, committed: Callable[[], None]) -> Any:
        sizes.append(len(groups))
        time.sleep(statement)
        committed()
        return [[InsertedRun(r.ids[0], r.queue, True)] for r in groups]

    group = GroupCommit(alone, together, max_hold=1.0)

    def loop() -> None:
        for _ in range(rounds):
            group.insert(new_runs())
            time.sleep(work)  # the caller's own work before its next call

    run_together([loop] * threads, timeout=10, join_timeout=60)
    assert sum(sizes) == threads * rounds
    # with the hold a quarter of the statement (10 ms < 15 ms of work) no statement after
    # the first ones carried all four; once the pace is known, most do
    later = sizes[3:]
    assert later.count(threads) >= len(later) // 2, sizes
    assert group._pace > 0
    assert group._in_flight == 0
    assert group._queue == []


def test_the_pace_halves_when_no_call_comes_back_within_the_longest_hold() -> None:
    """A statement's calls that do not come back (each web request triggers once) teach no
    pace; each statement after which none came back halves it, so the hold falls back to a
    quarter of the statement."""
    group = GroupCommit(lambda runs: [], lambda groups, rows, committed: [])
    group._pace = 0.004
    for expected in (0.004, 0.002, 0.001):
        with group._lock:
            group._in_flight = 1
        began = time.monotonic()
        group._hand_over({-1, -2, -3}, began - 0.001)  # nobody of these ever calls again
        assert group._pace == expected
        # the hold: twice the pace a call for three calls, at most twice the statement
        assert group._hold_until - began <= 0.002 + 0.1
    with group._lock:
        group._in_flight = 1
    group._hand_over(set(), time.monotonic())
    assert group._pace == 0.0005
    assert group._in_flight == 0


def test_a_crowd_that_does_not_come_back_holds_the_next_call_only_for_the_hold() -> None:
    """The calls of a statement end there (a web request's one trigger): the next call waits
    for them at most the hold, then writes alone."""
    sizes: list[int] = []

    def alone(runs: NewRuns) -> list[InsertedRun]:
        sizes.append(1)
        return [InsertedRun(runs.ids[0], runs.queue, True)]

    def together(groups: Any, rows: str, committed: Callable[[], None]) -> Any:
        sizes.append(len(groups))
        committed()
        return [[InsertedRun(r.ids[0], r.queue, True)] for r in groups]

    group = GroupCommit(alone, together)
    began = time.monotonic()
    with group._lock:  # a statement of two calls that never call again has just committed
        group._returning = {-1, -2}
        group._hold_until = began + 0.2
    runs = new_runs()
    assert group.insert(runs) == [InsertedRun(runs.ids[0], "default", True)]
    waited = time.monotonic() - began
    assert 0.19 <= waited < 10, waited
    assert sizes == [1]
    assert group._in_flight == 0
    assert group._queue == []
    # the hold is over and the caller is back: the next call writes alone at once
    group.insert(new_runs())
    assert sizes == [1, 1]


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_a_gathering_call_interrupted_by_a_signal_passes_the_statement_on() -> None:
    """The call that gathers a crowd coming back is interrupted (Ctrl-C in the main thread)
    while it waits: it leaves, the call queued behind it leads instead without waiting for
    anyone, and the group commit is left idle, not held."""

    class Interrupted(Exception):
        pass

    def alone(runs: NewRuns) -> list[InsertedRun]:
        return [InsertedRun(runs.ids[0], runs.queue, True)]

    def together(groups: Any, rows: str, committed: Callable[[], None]) -> Any:
        raise AssertionError("no group expected")

    group = GroupCommit(alone, together)
    with group._lock:  # a statement whose other call never calls again has just committed
        group._returning = {-1}
        group._hold_until = time.monotonic() + 30
    out: dict[str, list[InsertedRun]] = {}
    later = new_runs()

    def queue_behind_and_interrupt() -> None:
        wait_until(lambda: group._gathering, timeout=10, what="the main thread to gather")
        behind = threading.Thread(target=lambda: out.__setitem__("later", group.insert(later)))
        behind.start()
        wait_until(lambda: len(group._queue) == 2, timeout=10, what="a call queued behind")
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        behind.join(10)

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    helper = threading.Thread(target=queue_behind_and_interrupt)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        helper.start()
        with pytest.raises(Interrupted):
            group.insert(new_runs())  # gathers: waits for the other call, which never comes
        helper.join(10)
        assert not helper.is_alive(), "the call queued behind the interrupted one was left"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert out["later"] == [InsertedRun(later.ids[0], "default", True)]
    assert group._in_flight == 0
    assert group._queue == []
    assert not group._gathering
