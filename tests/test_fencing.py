"""Fencing rules of the Postgres storage, checked against the real database.

A stateful property test drives runs through claims, completions, failures, retries,
hand-backs, lease extensions, lapsed leases finalized by attempt expiry, and zombie writes
with every kind of stale fence, and after every step compares the database with a model.
Race tests then let real threads on separate connections fight over one lease, and several
claimers drain one queue.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, ClassVar

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg import sql

from runlane.models import RunStatus
from runlane.postgres import PostgresStorage
from runlane.storage import (
    ClaimedRun,
    Completion,
    Failure,
    FailureApplied,
    LeaseRef,
    NewRuns,
    RetryPolicyRow,
)
from tests.helpers import Conn, run_together

ENV = "env"
QUEUE = "q"
LEASE = timedelta(seconds=60)
ERROR = json.dumps({"type": "Boom", "message": "boom", "traceback": None, "retryable": True})
TERMINAL = frozenset({"completed", "failed", "cancelled"})
STALE_OPS = ("complete", "fail_retry", "fail_final", "release", "extend")


def new_runs(
    count: int, *, max_attempts: int, environment: str = ENV, first_id: int | None = None
) -> NewRuns:
    """``count`` runs due now; with ``first_id`` their ids are consecutive (so claims, which
    break ties by id, take them in a reproducible order), else random."""
    ids = (
        [uuid.uuid4() for _ in range(count)]
        if first_id is None
        else [uuid.UUID(int=first_id + i) for i in range(count)]
    )
    return NewRuns(
        environment=environment,
        task_id="t",
        queue=QUEUE,
        ids=ids,
        payloads=[json.dumps({"i": i}) for i in range(count)],
        idempotency_keys=[None] * count,
        priority=0,
        max_attempts=max_attempts,
        delay=timedelta(0),
        run_at=None,
    )


@pytest.fixture
def storage_factory(database_url: str, schema: str) -> Iterator[Callable[[], PostgresStorage]]:
    """Open storages on this test's schema, each with its own connection; closed afterwards."""
    made: list[PostgresStorage] = []

    def make() -> PostgresStorage:
        storage = PostgresStorage(
            connection_string=database_url, schema=schema, pool_min_size=1, pool_max_size=1
        )
        made.append(storage)
        storage.open()
        return storage

    yield make
    for storage in made:
        storage.close()


# -- the model --------------------------------------------------------------------------------

# Attempt expiry in these tests retries at once: no backoff, no jitter.
NO_BACKOFF = RetryPolicyRow(
    task_id="*", initial_seconds=0.0, multiplier=1.0, max_seconds=0.0, jitter=0.0
)


@attrs.define
class ModelRun:
    id: uuid.UUID
    max_attempts: int
    status: str = "queued"
    attempt: int = 0
    releases: int = 0  # attempts handed back unconsumed
    token: uuid.UUID | None = None
    expired: bool = False  # the current lease lapsed in the database
    # attempt number -> (lease token, outcome) for every finished attempt
    finished: dict[int, tuple[uuid.UUID, str]] = attrs.Factory(dict)

    @property
    def spent(self) -> bool:
        """Whether the current attempt was the last one max_attempts allows."""
        return self.attempt - self.releases >= self.max_attempts

    def finish(self, outcome: str, status: str) -> None:
        assert self.token is not None
        self.finished[self.attempt] = (self.token, outcome)
        self.status = status
        self.token = None
        self.expired = False


class FencingMachine(RuleBasedStateMachine):
    """Drives a handful of runs through the storage; the database must agree with the model."""

    storage: ClassVar[PostgresStorage]
    db: ClassVar[Conn]
    schema: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[uuid.UUID, ModelRun] = {}
        self.tokens_seen: set[uuid.UUID] = set()
        self.highest_attempt: dict[uuid.UUID, int] = {}
        self.terminal_rows: dict[uuid.UUID, str] = {}

    # -- helpers -------------------------------------------------------------------------

    def q(self, text: str) -> sql.Composed:
        return sql.SQL(text).format(schema=sql.Identifier(self.schema))

    def snapshot(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """Every row of both tables as text: a stale write must leave these byte-identical."""
        runs = self.db.execute(self.q("select r::text from {schema}.runs r order by id")).fetchall()
        attempts = self.db.execute(
            self.q("select a::text from {schema}.attempts a order by run_id, attempt")
        ).fetchall()
        return runs, attempts

    def with_status(self, *statuses: str) -> list[ModelRun]:
        return [run for run in self.runs.values() if run.status in statuses]

    def stale_refs(self, run: ModelRun) -> list[LeaseRef]:
        """Every kind of fence that is not the run's current lease: each finished attempt's
        own fence, an older token under the current attempt number, the current (or last)
        token under a wrong attempt number, a random token, and another run's live lease."""
        refs = [LeaseRef(run.id, attempt, token) for attempt, (token, _) in run.finished.items()]
        refs += [LeaseRef(run.id, run.attempt, token) for token, _ in run.finished.values()]
        last = run.token or (run.finished[max(run.finished)][0] if run.finished else None)
        if last is not None:
            refs += [LeaseRef(run.id, run.attempt + offset, last) for offset in (-1, 1)]
        refs += [
            LeaseRef(run.id, run.attempt, uuid.uuid4()),
            LeaseRef(run.id, run.attempt + 1, uuid.uuid4()),
        ]
        refs += [
            LeaseRef(run.id, other.attempt, other.token)
            for other in self.runs.values()
            if other.token is not None and other.id != run.id
        ]
        stale = [r for r in refs if not (r.attempt == run.attempt and r.lease_token == run.token)]
        assert len(stale) == len(refs)
        return stale

    def write(self, op: str, refs: list[LeaseRef]) -> set[uuid.UUID]:
        """One fenced batch write of kind ``op``; the run ids the storage says it applied."""
        if op == "complete":
            return self.storage.run_complete_many(
                [
                    Completion(r.run_id, r.attempt, r.lease_token, json.dumps(r.attempt))
                    for r in refs
                ]
            )
        if op in ("fail_retry", "fail_final"):
            delay = timedelta(0) if op == "fail_retry" else None
            failed = self.storage.run_fail_many(
                [Failure(r.run_id, r.attempt, r.lease_token, ERROR, delay) for r in refs]
            )
            assert len({f.run_id for f in failed}) == len(failed)
            return {f.run_id for f in failed}
        if op == "release":
            return self.storage.run_release_many(ENV, refs)
        assert op == "extend"
        return set(self.storage.run_extend_leases(refs, LEASE))

    def record(self, op: str, run: ModelRun) -> None:
        """Update the model for a current-lease write of kind ``op`` that applied."""
        if op == "complete":
            run.finish("completed", "completed")
        elif op == "release":
            run.finish("released", "queued")
            run.releases += 1
        elif op == "fail_retry" and not run.spent:
            run.finish("retrying", "retrying")
        elif op != "extend":
            run.finish("failed", "failed")

    # -- rules ---------------------------------------------------------------------------

    @initialize()
    def clean(self) -> None:
        self.db.execute(self.q("truncate {schema}.attempts, {schema}.runs cascade"))

    @precondition(lambda self: len(self.runs) < 5)
    @rule(max_attempts=st.integers(1, 3), count=st.integers(1, 2))
    def insert(self, max_attempts: int, count: int) -> None:
        # ids grow with insertion, so ties in due time are claimed in a reproducible order
        batch = new_runs(count, max_attempts=max_attempts, first_id=len(self.runs) + 1)
        inserted = self.storage.run_insert_many(batch)
        assert [r.id for r in inserted] == list(batch.ids)
        assert all(r.created for r in inserted)
        for run_id in batch.ids:
            self.runs[run_id] = ModelRun(run_id, max_attempts)

    @rule(limit=st.integers(1, 3))
    def claim(self, limit: int) -> None:
        queued = {run.id for run in self.with_status("queued")}
        claimed = self.storage.run_claim(ENV, [QUEUE], limit, LEASE)
        assert len(claimed) == min(limit, len(queued))
        assert len({c.id for c in claimed}) == len(claimed)
        for c in claimed:
            assert c.id in queued, "claimed a run that was not queued"
            run = self.runs[c.id]
            assert c.attempt == run.attempt + 1
            assert c.attempts_consumed == c.attempt - run.releases
            assert c.lease_token not in self.tokens_seen, "a lease token was reused"
            assert c.max_attempts == run.max_attempts
            self.tokens_seen.add(c.lease_token)
            run.status, run.attempt, run.token, run.expired = (
                "running",
                c.attempt,
                c.lease_token,
                False,
            )

    @precondition(lambda self: bool(self.with_status("running")))
    @rule(
        data=st.data(),
        op=st.sampled_from(["complete", "fail_retry", "fail_final", "release", "extend"]),
    )
    def write_current(self, data: st.DataObject, op: str) -> None:
        """The attempt holding the lease writes. A lease that lapsed but was not finalized
        may still complete, fail or release (SPEC 2: only an attempt that was finalized or
        re-leased is a zombie), but it is never extended."""
        run = data.draw(st.sampled_from(self.with_status("running")), label="run")
        assert run.token is not None
        ref = LeaseRef(run.id, run.attempt, run.token)
        before = self.snapshot()
        applied = self.write(op, [ref])
        if op == "extend" and run.expired:
            assert applied == set()
            assert self.snapshot() == before, "a refused extension wrote something"
            return
        assert applied == {run.id}
        if op == "extend":
            # a second extension, and the re-read status, agree
            assert self.storage.run_extend_leases([ref], LEASE) == {run.id: RunStatus.RUNNING}
        self.record(op, run)

    @precondition(lambda self: bool(self.runs))
    @rule(data=st.data())
    def stale_writes(self, data: st.DataObject) -> None:
        """Zombie writes: every stale fence of one run, through every fenced write, one at a
        time. None may apply, and every row of both tables stays byte-identical."""
        run = data.draw(st.sampled_from(list(self.runs.values())), label="run")
        before = self.snapshot()
        for ref in self.stale_refs(run):
            for op in STALE_OPS:
                assert self.write(op, [ref]) == set(), f"stale {op} applied: {ref} to {run}"
        assert self.snapshot() == before, f"stale writes changed rows of {run}"

    @precondition(lambda self: bool(self.with_status("running")))
    @rule(data=st.data(), op=st.sampled_from(["complete", "fail_retry", "release", "extend"]))
    def mixed_batch(self, data: st.DataObject, op: str) -> None:
        """One batch holding current fences for some running runs and stale ones for any
        runs: exactly the current ones apply."""
        running = self.with_status("running")
        current = data.draw(
            st.lists(st.sampled_from(running), min_size=1, unique_by=lambda r: r.id),
            label="current",
        )
        if op == "extend":
            current = [r for r in current if not r.expired]
        targets = data.draw(st.lists(st.sampled_from(list(self.runs.values())), max_size=4))
        refs = [LeaseRef(r.id, r.attempt, r.token) for r in current if r.token is not None]
        refs += [data.draw(st.sampled_from(self.stale_refs(r)), label="stale") for r in targets]
        refs = data.draw(st.permutations(refs), label="order")
        if not refs:
            return
        assert self.write(op, refs) == {r.id for r in current}
        for run in current:
            self.record(op, run)

    @rule()
    def deliver_due(self) -> None:
        retrying = self.with_status("retrying")
        assert self.storage.run_deliver_due(ENV, 10) == len(retrying)
        for run in retrying:
            run.status = "queued"

    @precondition(lambda self: any(not r.expired for r in self.with_status("running")))
    @rule(data=st.data())
    def lease_lapses(self, data: st.DataObject) -> None:
        """The holder froze: its lease runs out in database time (the holder becomes a
        zombie once maintenance finalizes the attempt)."""
        live = [r for r in self.with_status("running") if not r.expired]
        run = data.draw(st.sampled_from(live), label="run")
        self.lapse(run)

    def lapse(self, run: ModelRun) -> None:
        assert run.token is not None
        self.db.execute(
            self.q(
                "update {schema}.runs set lease_expires_at = now() - interval '1 second' "
                "where id = %s and status = 'running'"
            ),
            (run.id,),
        )
        run.expired = True
        # the holder's next extension is refused and writes nothing
        before = self.snapshot()
        assert self.write("extend", [LeaseRef(run.id, run.attempt, run.token)]) == set()
        assert self.snapshot() == before

    @precondition(lambda self: any(not r.expired for r in self.with_status("running")))
    @rule(data=st.data())
    def zombie(self, data: st.DataObject) -> None:
        """A holder freezes past its lease, maintenance finalizes the attempt, and the
        holder wakes up and tries every write with its old lease: none applies."""
        live = [r for r in self.with_status("running") if not r.expired]
        run = data.draw(st.sampled_from(live), label="run")
        assert run.token is not None
        ref = LeaseRef(run.id, run.attempt, run.token)
        self.lapse(run)
        self.expire_lapsed_attempts()
        before = self.snapshot()
        for op in STALE_OPS:
            assert self.write(op, [ref]) == set(), f"zombie {op} applied"
        assert self.snapshot() == before

    @rule()
    def expire_lapsed_attempts(self) -> None:
        """Maintenance's ATTEMPT_EXPIRY: lapsed attempts are finalized; live ones untouched."""
        applied = self.storage.run_expire_attempts(ENV, 10, [], NO_BACKOFF)
        expected = {
            r.id: "failed" if r.spent else "retrying"
            for r in self.with_status("running")
            if r.expired
        }
        assert {a.run_id: str(a.status) for a in applied} == expected
        for run_id, status in expected.items():
            self.runs[run_id].finish("expired", status)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def database_matches_model(self) -> None:
        rows = self.db.execute(
            self.q(
                "select id, status, attempt, lease_token, lease_expires_at, finished_at, "
                "r::text from {schema}.runs r"
            )
        ).fetchall()
        assert {row[0] for row in rows} == set(self.runs)
        for run_id, status, attempt, token, expires, finished_at, text in rows:
            run = self.runs[run_id]
            assert (status, attempt) == (run.status, run.attempt), run
            # a running run holds exactly one lease: the current attempt's
            assert token == run.token, "the lease token differs from the current attempt's"
            if status == "running":
                assert token is not None
                assert expires is not None
            else:
                assert token is None
                assert expires is None
            assert (finished_at is not None) == (status in TERMINAL)
            # attempt numbers only grow
            assert attempt >= self.highest_attempt.get(run_id, 0)
            self.highest_attempt[run_id] = attempt
            # a terminal run never changes again
            if status in TERMINAL:
                assert self.terminal_rows.setdefault(run_id, text) == text

    @invariant()
    def one_attempt_row_per_finished_attempt(self) -> None:
        rows = self.db.execute(
            self.q("select run_id, attempt, lease_token, outcome from {schema}.attempts")
        ).fetchall()
        recorded: dict[uuid.UUID, dict[int, tuple[uuid.UUID, str]]] = {}
        for run_id, attempt, token, outcome in rows:
            assert attempt not in recorded.setdefault(run_id, {})
            recorded[run_id][attempt] = (token, outcome)
        expected = {run.id: run.finished for run in self.runs.values() if run.finished}
        assert recorded == expected

    @invariant()
    def snapshots_agree(self) -> None:
        for run in self.runs.values():
            snap = self.storage.run_get(ENV, run.id)
            assert snap is not None
            assert (str(snap.status), snap.attempt) == (run.status, run.attempt)
            assert self.storage.run_get("elsewhere", run.id) is None


def test_fencing_state_machine(database_url: str, schema: str, db: Conn) -> None:
    storage = PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=2)
    storage.open()
    try:

        class Machine(FencingMachine):
            pass

        Machine.storage = storage
        Machine.db = db
        Machine.schema = schema
        run_state_machine_as_test(
            Machine,
            settings=settings(
                max_examples=60,
                stateful_step_count=25,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        storage.close()


def lapse_lease(db: Conn, schema: str, run_id: uuid.UUID) -> None:
    db.execute(
        sql.SQL(
            "update {}.runs set lease_expires_at = now() - interval '1 second' where id = %s"
        ).format(sql.Identifier(schema)),
        (run_id,),
    )


def test_released_attempts_do_not_count_against_max_attempts(
    storage_factory: Callable[[], PostgresStorage], db: Conn, schema: str
) -> None:
    """Directed example of a path the state machine reaches only rarely: a hand-back does not
    consume an attempt, for failures and for attempt expiry alike."""
    storage = storage_factory()
    batch = new_runs(1, max_attempts=2)
    storage.run_insert_many(batch)
    run_id = batch.ids[0]
    first = claim_one(storage)
    assert storage.run_release_many(ENV, [LeaseRef(run_id, 1, first.lease_token)]) == {run_id}
    second = claim_one(storage)
    assert (second.attempt, second.attempts_consumed) == (2, 1)
    lapse_lease(db, schema, run_id)
    assert storage.run_expire_attempts(ENV, 10, [], NO_BACKOFF) == [
        FailureApplied(run_id, RunStatus.RETRYING)
    ]
    assert storage.run_deliver_due(ENV, 10) == 1
    third = claim_one(storage)
    assert (third.attempt, third.attempts_consumed) == (3, 2)
    lapse_lease(db, schema, run_id)
    assert storage.run_expire_attempts(ENV, 10, [], NO_BACKOFF) == [
        FailureApplied(run_id, RunStatus.FAILED)
    ]
    outcomes = db.execute(
        sql.SQL("select attempt, outcome from {}.attempts where run_id = %s order by 1").format(
            sql.Identifier(schema)
        ),
        (run_id,),
    ).fetchall()
    assert outcomes == [(1, "released"), (2, "expired"), (3, "expired")]
    # the zombies of attempts 2 and 3 can change nothing
    for old in (second, third):
        ref = LeaseRef(run_id, old.attempt, old.lease_token)
        assert (
            storage.run_complete_many([Completion(run_id, old.attempt, old.lease_token, "1")])
            == set()
        )
        assert (
            storage.run_fail_many([Failure(run_id, old.attempt, old.lease_token, ERROR, None)])
            == []
        )
        assert storage.run_release_many(ENV, [ref]) == set()
        assert storage.run_extend_leases([ref], LEASE) == {}


# -- races between real threads ---------------------------------------------------------------


def claim_one(storage: PostgresStorage) -> ClaimedRun:
    (claimed,) = storage.run_claim(ENV, [QUEUE], 1, LEASE)
    return claimed


@pytest.mark.parametrize("current_op", ["complete", "complete_or_fail"])
def test_racing_writers_exactly_one_current_write_applies(
    storage_factory: Callable[[], PostgresStorage], db: Conn, schema: str, current_op: str
) -> None:
    writers = 8
    storages = [storage_factory() for _ in range(writers)]
    setup = storages[0]
    rounds = 20
    for round_number in range(rounds):
        batch = new_runs(1, max_attempts=10)
        setup.run_insert_many(batch)
        run_id = batch.ids[0]
        # two earlier attempts that failed and were retried: their fences are stale now
        first = claim_one(setup)
        assert setup.run_fail_many([Failure(run_id, 1, first.lease_token, ERROR, timedelta(0))])
        assert setup.run_deliver_due(ENV, 10) == 1
        second = claim_one(setup)
        assert setup.run_fail_many([Failure(run_id, 2, second.lease_token, ERROR, timedelta(0))])
        assert setup.run_deliver_due(ENV, 10) == 1
        current = claim_one(setup)
        assert current.attempt == 3

        stale = [
            LeaseRef(run_id, 1, first.lease_token),
            LeaseRef(run_id, 2, second.lease_token),
            LeaseRef(run_id, 3, uuid.uuid4()),
            LeaseRef(run_id, 2, current.lease_token),
        ]
        jobs: list[Callable[[], bool]] = []
        for index, storage in enumerate(storages):
            if index % 2 == 0:
                ref = LeaseRef(run_id, 3, current.lease_token)
                as_failure = current_op == "complete_or_fail" and index % 4 == 2
            else:
                ref = stale[index // 2]
                as_failure = index % 4 == 3
            jobs.append(_writer(storage, ref, index, fail=as_failure))
        outcomes = run_together(jobs, join_timeout=60)
        assert len(outcomes) == writers
        winners = [index for index, applied in enumerate(outcomes) if applied]
        assert len(winners) == 1, f"round {round_number}: {winners} applied"
        (winner,) = winners
        assert winner % 2 == 0, f"round {round_number}: a stale writer ({winner}) applied"

        row = db.execute(
            sql.SQL(
                "select status, attempt, output, lease_token from {}.runs where id = %s"
            ).format(sql.Identifier(schema)),
            (run_id,),
        ).fetchone()
        assert row is not None
        won_by_failure = current_op == "complete_or_fail" and winner % 4 == 2
        if won_by_failure:
            assert row[:2] == ("failed", 3)
        else:
            assert row == ("completed", 3, {"writer": winner}, None)
        attempts = db.execute(
            sql.SQL(
                "select attempt, lease_token, outcome from {}.attempts where run_id = %s "
                "order by attempt"
            ).format(sql.Identifier(schema)),
            (run_id,),
        ).fetchall()
        assert attempts == [
            (1, first.lease_token, "retrying"),
            (2, second.lease_token, "retrying"),
            (3, current.lease_token, "failed" if won_by_failure else "completed"),
        ]


def _writer(
    storage: PostgresStorage, ref: LeaseRef, index: int, *, fail: bool
) -> Callable[[], bool]:
    def write() -> bool:
        if fail:
            return bool(
                storage.run_fail_many(
                    [Failure(ref.run_id, ref.attempt, ref.lease_token, ERROR, None)]
                )
            )
        output = json.dumps({"writer": index})
        return ref.run_id in storage.run_complete_many(
            [Completion(ref.run_id, ref.attempt, ref.lease_token, output)]
        )

    return write


def test_racing_extensions_and_completion(
    storage_factory: Callable[[], PostgresStorage], db: Conn, schema: str
) -> None:
    """A holder extending its lease while a rival completes: the completion applies once and
    an extension that loses the race never brings the lease back."""
    storages = [storage_factory() for _ in range(4)]
    for _ in range(20):
        batch = new_runs(1, max_attempts=1)
        storages[0].run_insert_many(batch)
        claimed = claim_one(storages[0])
        ref = LeaseRef(claimed.id, claimed.attempt, claimed.lease_token)

        def extend(storage: PostgresStorage, ref: LeaseRef) -> Callable[[], bool]:
            return lambda: bool(storage.run_extend_leases([ref], LEASE))

        def complete(storage: PostgresStorage, ref: LeaseRef) -> Callable[[], bool]:
            def write() -> bool:
                done = storage.run_complete_many(
                    [Completion(ref.run_id, ref.attempt, ref.lease_token, "1")]
                )
                return ref.run_id in done

            return write

        jobs = [
            extend(storages[0], ref),
            complete(storages[1], ref),
            extend(storages[2], ref),
            complete(storages[3], ref),
        ]
        outcomes = run_together(jobs, join_timeout=60)
        assert [outcomes[1], outcomes[3]].count(True) == 1
        row = db.execute(
            sql.SQL(
                "select status, lease_token, lease_expires_at from {}.runs where id = %s"
            ).format(sql.Identifier(schema)),
            (claimed.id,),
        ).fetchone()
        assert row == ("completed", None, None)
        # after the completion no extension applies
        assert storages[0].run_extend_leases([ref], LEASE) == {}


def test_concurrent_claimers_claim_every_run_exactly_once(
    storage_factory: Callable[[], PostgresStorage], db: Conn, schema: str
) -> None:
    total = 200
    claimers = 4
    storages = [storage_factory() for _ in range(claimers)]
    batch = new_runs(total, max_attempts=3)
    storages[0].run_insert_many(batch)
    # a run of another environment is never claimed
    other = new_runs(1, max_attempts=1, environment="other")
    storages[0].run_insert_many(other)

    def claimer(storage: PostgresStorage, seed: int) -> Callable[[], list[ClaimedRun]]:
        def claim_all() -> list[ClaimedRun]:
            rng = random.Random(seed)
            got: list[ClaimedRun] = []
            while True:
                claimed = storage.run_claim(ENV, [QUEUE], rng.randint(1, 9), LEASE)
                if not claimed:
                    return got
                got.extend(claimed)

        return claim_all

    results = run_together([claimer(s, i) for i, s in enumerate(storages)], join_timeout=60)
    everything = [c for result in results for c in result]
    ids = [c.id for c in everything]
    assert len(ids) == len(set(ids)), "a run was claimed twice"
    assert set(ids) == set(batch.ids)
    assert all(c.attempt == 1 for c in everything)
    assert len({c.lease_token for c in everything}) == total
    assert sum(1 for result in results if result) >= 2, "the claimers did not overlap at all"

    rows = db.execute(
        sql.SQL(
            "select id, status, attempt, lease_token from {}.runs where environment = %s"
        ).format(sql.Identifier(schema)),
        (ENV,),
    ).fetchall()
    tokens = {c.id: c.lease_token for c in everything}
    assert len(rows) == total
    assert all(status == "running" and attempt == 1 for _, status, attempt, _ in rows)
    assert all(token == tokens[run_id] for run_id, _, _, token in rows)
    assert storages[0].run_claim(ENV, [QUEUE], 10, LEASE) == []
    other_row = db.execute(
        sql.SQL("select status, attempt from {}.runs where environment = 'other'").format(
            sql.Identifier(schema)
        )
    ).fetchone()
    assert other_row == ("queued", 0)
