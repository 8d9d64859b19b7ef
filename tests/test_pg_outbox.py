"""The outbox of transport lanes (migration 3), on the storage with a real database.

Every transition of a run into ``queued`` in an outbox environment writes an item in the
same transaction (from the runs triggers): a trigger, a due retry or release, a resume, a
hand-back, a schedule. An eager trigger stores its items already claimed; anything else
stores them unclaimed and announces ``env|outbox|<queue>`` at commit. Environments of the
polling lane get no items.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql

from runlane.postgres import PostgresStorage
from runlane.postgres._eager import eager_item_id
from runlane.storage import ClaimedRun, Failure, LeaseRef, NewRuns, OutboxItem
from tests.helpers import Conn, SchemaDb

# every test runs with the statements sent through libpq and through the cursor API
pytestmark = pytest.mark.usefixtures("statement_path")

ENV = "env"
LEASE = timedelta(seconds=60)
CLAIM = timedelta(minutes=5)


class Collector:
    """An eager publisher that only remembers what it was handed."""

    def __init__(self) -> None:
        self.items: list[OutboxItem] = []
        self.claimed_at: list[float | None] = []

    def submit(self, items: Sequence[OutboxItem], claimed_at: float | None = None) -> None:
        self.items.extend(items)
        self.claimed_at.append(claimed_at)

    def close(self, timeout: float | None = None) -> None:
        pass


@pytest.fixture
def storage(database_url: str, schema: str) -> Iterator[PostgresStorage]:
    store = PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=2)
    store.open()
    store.outbox_enable(ENV, CLAIM)
    yield store
    store.close()


@pytest.fixture
def dbx(db: Conn, schema: str) -> SchemaDb:
    return SchemaDb(db, schema)


@pytest.fixture
def listener(database_url: str, schema: str) -> Iterator[Conn]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("listen {}").format(sql.Identifier(f"runlane.{schema}")))
        yield conn


def new_runs(count: int = 1, *, environment: str = ENV, delay: timedelta = timedelta(0)) -> NewRuns:
    return NewRuns(
        environment=environment,
        task_id="t",
        queue="q",
        ids=[uuid.uuid4() for _ in range(count)],
        payloads=["null"] * count,
        idempotency_keys=[None] * count,
        priority=0,
        max_attempts=3,
        delay=delay,
        run_at=None,
    )


def items(dbx: SchemaDb) -> list[tuple[uuid.UUID, bool, bool]]:
    """(run id, claimed, available now) of every outbox item."""
    rows = dbx.all(
        "select run_id, claim_token is not null, available_at <= now() from {schema}.outbox "
        "order by created_at, run_id"
    )
    return [(r[0], bool(r[1]), bool(r[2])) for r in rows]


def claim_one(storage: PostgresStorage, run_id: uuid.UUID) -> ClaimedRun:
    (claimed,) = storage.run_claim_ids(ENV, [run_id], LEASE)
    return claimed


def test_an_eager_trigger_stores_its_items_claimed_under_ids_the_producer_knows(
    storage: PostgresStorage, dbx: SchemaDb, listener: Conn
) -> None:
    collector = Collector()
    storage.attach_eager_publisher(collector)
    now = new_runs(2)
    later = new_runs(1, delay=timedelta(hours=1))
    before = time.monotonic()
    storage.run_insert_many(now)
    after = time.monotonic()
    storage.run_insert_many(later)
    handed = {item.run_id: item for item in collector.items}
    assert set(handed) == set(now.ids)  # only runs due now are published eagerly
    # with the monotonic time taken before the claiming statement was sent
    assert collector.claimed_at[0] is not None
    assert before <= collector.claimed_at[0] <= after
    token = collector.items[0].claim_token
    for run_id, item in handed.items():
        assert item.id == eager_item_id(token, run_id)
        assert item.claim_token == token
    stored = dbx.all("select id, run_id, claim_token from {schema}.outbox")
    by_run = {run_id: (item_id, claim) for item_id, run_id, claim in stored}
    for run_id in now.ids:
        assert by_run[run_id] == (handed[run_id].id, token)
    assert by_run[later.ids[0]][1] is None  # the delayed run's item waits, unclaimed
    assert [n.payload for n in listener.notifies(timeout=0.3)] == [f"{ENV}|q"]
    # a live claim keeps the eager items from other publishers
    assert storage.outbox_claim_page(ENV, 10, CLAIM) == []
    assert storage.outbox_published(collector.items) == {i.id for i in collector.items}
    assert [r[0] for r in items(dbx)] == later.ids


def test_a_trigger_on_the_callers_connection_is_unclaimed_and_announced_at_commit(
    storage: PostgresStorage, dbx: SchemaDb, database_url: str, listener: Conn
) -> None:
    storage.attach_eager_publisher(Collector())
    with psycopg.connect(database_url) as conn:
        runs = new_runs(1)
        storage.run_insert_many(runs, connection=conn)
        assert [n.payload for n in listener.notifies(timeout=0.2)] == []
        conn.rollback()
    assert items(dbx) == []
    with psycopg.connect(database_url) as conn:
        runs = new_runs(1)
        storage.run_insert_many(runs, connection=conn)
        conn.commit()
    assert items(dbx) == [(runs.ids[0], False, True)]
    heard = [n.payload for n in listener.notifies(timeout=0.3)]
    assert sorted(heard) == [f"{ENV}|outbox|q", f"{ENV}|q"]


def test_polling_environments_get_no_items(storage: PostgresStorage, dbx: SchemaDb) -> None:
    storage.run_insert_many(new_runs(3, environment="polling"))
    assert items(dbx) == []


def test_every_transition_into_queued_writes_an_item(
    storage: PostgresStorage, dbx: SchemaDb
) -> None:
    runs = new_runs(5)
    storage.run_insert_many(runs)
    published = storage.outbox_claim_page(ENV, 10, CLAIM)
    assert storage.outbox_published(published) == {i.id for i in published}
    a, b, c, d, waiter = runs.ids
    # a run waiting on another (suspended: waiting is not queued)
    waiting = claim_one(storage, waiter)
    lease = LeaseRef(waiter, waiting.attempt, waiting.lease_token)
    assert storage.run_suspend(lease, ENV, run_id=d).suspended
    assert items(dbx) == []
    # a failed attempt retried: retrying is not queued, due delivery makes it queued
    first = claim_one(storage, a)
    storage.run_fail_many(
        [Failure(a, first.attempt, first.lease_token, '{"type": "X"}', timedelta(0))]
    )
    assert items(dbx) == []
    assert storage.run_deliver_due(ENV, 10) == 1
    # a hand-back (worker shutdown)
    second = claim_one(storage, b)
    storage.run_release_many(ENV, [LeaseRef(b, second.attempt, second.lease_token)])
    # a release by the handler, delivered when due
    third = claim_one(storage, c)
    assert storage.run_release(LeaseRef(c, third.attempt, third.lease_token), timedelta(0))
    assert storage.run_deliver_due(ENV, 10) == 1
    # the awaited run fails for good: the update trigger resumes its waiter
    fourth = claim_one(storage, d)
    storage.run_fail_many([Failure(d, fourth.attempt, fourth.lease_token, '{"type": "X"}', None)])
    assert sorted(r[0] for r in items(dbx)) == sorted([a, b, c, waiter])
    assert all(not claimed and now for _, claimed, now in items(dbx))


def test_published_and_failed_are_fenced_by_the_claim_token(
    storage: PostgresStorage, dbx: SchemaDb
) -> None:
    runs = new_runs(2)
    storage.run_insert_many(runs)
    page = storage.outbox_claim_page(ENV, 10, CLAIM)
    assert len(page) == 2
    assert len({i.claim_token for i in page}) == 2  # a fresh token per item
    stale = [OutboxItem(i.id, i.run_id, i.environment, i.queue, uuid.uuid4()) for i in page]
    assert storage.outbox_published(stale) == set()
    assert storage.outbox_failed(stale, "nope", timedelta(0)) == set()
    assert storage.outbox_failed(page[:1], "broker down", timedelta(hours=1)) == {page[0].id}
    row = dbx.one(
        "select failures, last_error, claim_token from {schema}.outbox where id = %s", page[0].id
    )
    assert row == (1, "broker down", None)
    assert storage.outbox_claim_page(ENV, 10, CLAIM) == []  # backed off, the other still claimed
    assert storage.outbox_published(page[1:]) == {page[1].id}
    next_due = storage.outbox_next_due(ENV)
    assert next_due is not None
    assert 3500 < next_due <= 3600


def test_deferring_and_recovering(storage: PostgresStorage, dbx: SchemaDb, listener: Conn) -> None:
    runs = new_runs(2)
    storage.run_insert_many(runs)
    storage.outbox_published(storage.outbox_claim_page(ENV, 10, CLAIM))
    listener.notifies(timeout=0.2)
    assert storage.outbox_defer(ENV, runs.ids[:1], timedelta(seconds=30)) == 1
    assert f"{ENV}|outbox|q" in [n.payload for n in listener.notifies(timeout=0.3)]
    assert items(dbx) == [(runs.ids[0], False, False)]
    # the other run lost its message: after the threshold, recovery announces it again
    dbx.run(
        "update {schema}.runs set due_at = now() - interval '1 hour', "
        "updated_at = now() - interval '1 hour' where id = %s",
        runs.ids[1],
    )
    assert storage.outbox_recover(ENV, timedelta(minutes=5), 10) == 1
    assert storage.outbox_recover(ENV, timedelta(minutes=5), 10) == 0  # not twice
    assert sorted(r[0] for r in items(dbx)) == sorted(runs.ids)
    status = storage.outbox_status(ENV)
    assert status.pending == 2
    assert status.oldest_age_seconds is not None
    assert status.oldest_age_seconds >= 0


def test_unclaim_releases_only_under_the_current_claim_and_counts_no_failure(
    storage: PostgresStorage, dbx: SchemaDb
) -> None:
    """A publisher that will not publish under a claim about to expire gives the items back
    for a sweep at once; a claim already lost changes nothing."""
    storage.run_insert_many(new_runs(2))
    first = storage.outbox_claim_page(ENV, 10, CLAIM)
    assert len(first) == 2
    dbx.run("update {schema}.outbox set claim_expires_at = now() - interval '1 second'")
    second = storage.outbox_claim_page(ENV, 10, CLAIM)  # another publisher, after expiry
    assert storage.outbox_unclaim(first) == set()  # the first publisher's claim is gone
    assert storage.outbox_claim_page(ENV, 10, CLAIM) == []  # still the second's
    assert storage.outbox_unclaim(second[:1]) == {second[0].id}
    rows = dbx.all("select id, claim_token, failures, last_error from {schema}.outbox")
    by_id = {row[0]: row[1:] for row in rows}
    assert by_id[second[0].id] == (None, 0, None)
    assert by_id[second[1].id] == (second[1].claim_token, 0, None)
    assert [i.id for i in storage.outbox_claim_page(ENV, 10, CLAIM)] == [second[0].id]


def test_failing_queues_are_read_from_the_failing_index(
    storage: PostgresStorage, dbx: SchemaDb
) -> None:
    """status()'s broker problems come from outbox_failing_queues: per queue, items that
    failed twice or more, the worst one's error; read through the outbox_failing index
    (migration 11), not the whole pending outbox."""
    dbx.run(
        "insert into {schema}.outbox (id, environment, run_id, queue, available_at, failures, "
        "last_error, created_at) "
        "select gen_random_uuid(), %s, gen_random_uuid(), 'q' || (n %% 3), now(), "
        "case when n %% 3 = 0 and n < 30 then 1 + n / 10 else 0 end, "
        "case when n %% 3 = 0 and n < 30 then 'error ' || n end, now() - n * interval '1 second' "
        "from generate_series(0, 4999) as n",
        ENV,
    )
    dbx.run("analyze {schema}.outbox")
    rows = storage.outbox_failing_queues(ENV)
    # q0 items 0, 3, ..., 27 failed 1 + n // 10 times: n 12..27 (6 items) failed 2 or 3 times
    assert [(r.queue, r.items, r.failures, r.last_error) for r in rows] == [
        ("q0", 6, 3, "error 27")
    ]
    assert rows[0].oldest_age_seconds >= 26
    assert storage.outbox_failing_queues("another") == []
    plan = "\n".join(
        str(row[0])
        for row in dbx.all(
            "explain "
            + storage._db.sql["outbox_failing_queues"]
            .replace("%(environment)s", "%s")
            .replace("%(now)s", "null"),
            ENV,
        )
    )
    assert "outbox_failing" in plan, plan


def test_a_publisher_claims_and_reads_only_its_own_environments_items(
    storage: PostgresStorage, dbx: SchemaDb
) -> None:
    """SPEC section 2: an environment never sees another's runs. Claims and the next due
    time are read per environment, and a write naming an item under another environment
    than its own changes nothing."""
    other = "other"
    storage.outbox_enable(other, CLAIM)
    mine, theirs = new_runs(2), new_runs(3, environment=other)
    storage.run_insert_many(theirs)
    storage.run_insert_many(mine)
    page = storage.outbox_claim_page(ENV, 10, CLAIM)
    assert sorted(i.run_id for i in page) == sorted(mine.ids)
    assert {i.environment for i in page} == {ENV}
    assert storage.outbox_published(page) == {i.id for i in page}
    assert storage.outbox_next_due(ENV) is None  # the other environment's are due
    due = storage.outbox_next_due(other)
    assert due is not None
    assert due <= 0
    taken = storage.outbox_claim_page(other, 10, CLAIM)
    assert sorted(i.run_id for i in taken) == sorted(theirs.ids)
    forged = [OutboxItem(i.id, i.run_id, ENV, i.queue, i.claim_token) for i in taken]
    assert storage.outbox_extend(forged, CLAIM) == set()
    assert storage.outbox_published(forged) == set()
    assert storage.outbox_unclaim(forged) == set()
    assert storage.outbox_failed(forged, "nope", timedelta(0)) == set()
    assert dbx.all("select count(*) from {schema}.outbox where claim_token is not null") == [(3,)]


def test_extending_keeps_only_claims_still_held_in_database_time(
    storage: PostgresStorage, dbx: SchemaDb
) -> None:
    """outbox_extend renews, from database now, the claims still the publisher's and
    unexpired; an expired one (not taken yet) and one another publisher took are left out
    and unchanged."""
    storage.run_insert_many(new_runs(3))
    held, expired, taken = storage.outbox_claim_page(ENV, 10, timedelta(seconds=30))
    expire = (
        "update {schema}.outbox set claim_expires_at = now() - interval '1 second' where id = %s"
    )
    dbx.run(expire, taken.id)
    (retaken,) = storage.outbox_claim_page(ENV, 10, CLAIM)  # another publisher's claim
    assert retaken.id == taken.id
    dbx.run(expire, expired.id)
    assert storage.outbox_extend([held, expired, taken], CLAIM) == {held.id}
    rows = dbx.all(
        "select id, claim_token, extract(epoch from claim_expires_at - now()) from {schema}.outbox"
    )
    by_id = {row[0]: (row[1], float(row[2])) for row in rows}
    assert by_id[held.id][0] == held.claim_token
    assert CLAIM.total_seconds() - 5 < by_id[held.id][1] <= CLAIM.total_seconds()  # renewed
    assert by_id[expired.id][0] == expired.claim_token
    assert by_id[expired.id][1] < 0  # still expired: a sweep takes it
    assert by_id[taken.id][0] == retaken.claim_token
    assert storage.outbox_extend([], CLAIM) == set()


def test_the_next_due_time_counts_claims_that_expire(
    storage: PostgresStorage, dbx: SchemaDb
) -> None:
    """An item claimed by a producer that died is publishable once its claim expires:
    outbox_next_due says when, so an idle publisher sweeps then."""
    collector = Collector()
    storage.attach_eager_publisher(collector)
    storage.run_insert_many(new_runs(1))
    due = storage.outbox_next_due(ENV)
    assert due is not None
    assert CLAIM.total_seconds() - 5 < due <= CLAIM.total_seconds()
    storage.run_insert_many(new_runs(1, delay=timedelta(hours=1)))
    due = storage.outbox_next_due(ENV)
    assert due is not None
    assert due <= CLAIM.total_seconds()  # the claim expires before the delayed run is due
    dbx.run(
        "update {schema}.outbox set claim_expires_at = now() - interval '1 second' "
        "where claim_token is not null"
    )
    due = storage.outbox_next_due(ENV)
    assert due is not None
    assert due < 0
