"""Fencing rules of the Postgres storage, checked against the real database.

A stateful property test drives runs through claims, completions, failures, retries,
hand-backs, lease extensions, lapsed leases finalized by attempt expiry, durable steps,
suspensions on tokens, runs and sleeps (and their resumption), context.release, and zombie
writes with every kind of stale fence through every fenced write, and after every step
compares the database with a model.
Race tests then let real threads on separate connections fight over one lease, and several
claimers drain one queue.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
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

from runlane.flow import RateLimit
from runlane.models import RunStatus
from runlane.postgres import PostgresStorage
from runlane.retry import RetryPolicy, next_retry_delay
from runlane.storage import (
    ClaimedRun,
    Completion,
    Expiration,
    Failure,
    FailureApplied,
    LeaseRef,
    NewRuns,
    QueueLimits,
    StepStored,
    SuspendResult,
)
from runlane.tasks import queue
from tests.helpers import Conn, run_together

ENV = "env"
QUEUE = "q"
LEASE = timedelta(seconds=60)
ERROR = json.dumps({"type": "Boom", "message": "boom", "traceback": None, "retryable": True})
TERMINAL = frozenset({"completed", "failed", "cancelled"})
BATCH_OPS = ("complete", "fail_retry", "fail_final", "release", "extend")
# the single-lease writes of steps, waits and context.release
SINGLE_OPS = ("step", "suspend_token", "suspend_run", "suspend_sleep", "release_one")
STALE_OPS = BATCH_OPS + SINGLE_OPS
STEP_NAMES = ("a", "b")


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

# Failures and attempt expiry in these tests retry at once: no backoff, no jitter.
NO_BACKOFF = RetryPolicy(
    initial_delay=timedelta(0), max_delay=timedelta(0), multiplier=1.0, jitter=0.0
)


def expire_lapsed(storage: PostgresStorage) -> list[FailureApplied]:
    """Maintenance's ATTEMPT_EXPIRY on the storage: list the lapsed attempts, decide each
    one with next_retry_delay, write them (each lease re-checked in the write)."""
    return storage.run_expire_many(
        [
            Expiration(
                a.run_id,
                a.attempt,
                a.lease_token,
                ERROR,
                next_retry_delay(NO_BACKOFF, a.attempts_consumed, a.max_attempts),
            )
            for a in storage.run_list_expired(ENV, 10)
        ]
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
    # while waiting: the kind and its target (a wait token, a run, or whether the sleep is due)
    wait_kind: str | None = None
    wait_token: uuid.UUID | None = None
    wait_run: uuid.UUID | None = None
    sleep_due: bool = False
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
        # wait token id -> status
        self.wait_tokens: dict[uuid.UUID, str] = {}
        # (run id, step name) -> (output, attempt number and lease token of the writer)
        self.steps: dict[tuple[uuid.UUID, str], tuple[Any, int, uuid.UUID]] = {}
        # targets the single-lease stale writes suspend on: an open token and an open run
        self.open_token: uuid.UUID | None = None
        self.open_run: uuid.UUID | None = None

    # -- helpers -------------------------------------------------------------------------

    def q(self, text: str) -> sql.Composed:
        return sql.SQL(text).format(schema=sql.Identifier(self.schema))

    def snapshot(self) -> list[list[tuple[Any, ...]]]:
        """Every row of the runs, attempts, steps and wait_tokens tables as text: a stale
        write must leave these byte-identical."""
        return [
            self.db.execute(
                self.q(f"select t::text from {{schema}}.{table} t order by {key}")
            ).fetchall()
            for table, key in (
                ("runs", "id"),
                ("attempts", "run_id, attempt"),
                ("steps", "run_id, name"),
                ("wait_tokens", "id"),
            )
        ]

    def new_token(self) -> uuid.UUID:
        token_id = uuid.uuid4()
        token = self.storage.wait_token_create(ENV, token_id, None, None)
        assert (token.id, str(token.status)) == (token_id, "pending")
        self.wait_tokens[token_id] = "pending"
        return token_id

    def prepare_stale_targets(self) -> None:
        """Open targets for the stale suspensions, made before the snapshot is taken: a
        stale suspension must fail on its fence, not because its target is resolved."""
        pending = [t for t, status in self.wait_tokens.items() if status == "pending"]
        self.open_token = pending[0] if pending else self.new_token()
        open_runs = [r.id for r in self.runs.values() if r.status not in TERMINAL]
        self.open_run = open_runs[0] if open_runs else None

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
            # the caller decides whether attempts remain, as the engine does
            policy = NO_BACKOFF if op == "fail_retry" else None
            failed = self.storage.run_fail_many(
                [
                    Failure(
                        r.run_id,
                        r.attempt,
                        r.lease_token,
                        ERROR,
                        next_retry_delay(
                            policy,
                            r.attempt - self.runs[r.run_id].releases,
                            self.runs[r.run_id].max_attempts,
                        ),
                    )
                    for r in refs
                ]
            )
            assert len({f.run_id for f in failed}) == len(failed)
            return {f.run_id for f in failed}
        if op == "release":
            return self.storage.run_release_many(ENV, refs)
        if op == "extend":
            return {ref.run_id for ref in self.storage.run_extend_leases(refs, LEASE)}
        return {r.run_id for r in refs if self.write_one(op, r)}

    def write_one(self, op: str, ref: LeaseRef) -> bool:
        """One single-lease write of kind ``op`` (stale ones only): whether it applied."""
        if op == "step":
            stored = self.storage.step_store(ref, STEP_NAMES[0], json.dumps({"zombie": True}))
            return stored.fenced
        if op == "release_one":
            return self.storage.run_release(ref, timedelta(0))
        if op == "suspend_token":
            assert self.open_token is not None
            result = self.storage.run_suspend(ref, ENV, token_id=self.open_token)
            assert result.target_open, "the pending token was not seen as open"
        elif op == "suspend_run":
            if self.open_run is None:
                return False
            result = self.storage.run_suspend(ref, ENV, run_id=self.open_run)
            assert result.target_open, "the open run was not seen as open"
        else:
            assert op == "suspend_sleep"
            result = self.storage.run_suspend(ref, ENV, wake_at=datetime.now(UTC))
            assert result.target_open
        return result.suspended

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
        self.resume_run_waiters()

    def resume_run_waiters(self) -> None:
        """A run that ends resumes the runs waiting on it, in the same statement."""
        for parent in self.with_status("waiting"):
            if parent.wait_kind == "run":
                assert parent.wait_run is not None
                if self.runs[parent.wait_run].status in TERMINAL:
                    self.unwait(parent)

    @staticmethod
    def unwait(run: ModelRun) -> None:
        run.status = "queued"
        run.wait_kind, run.wait_token, run.wait_run, run.sleep_due = None, None, None, False

    # -- rules ---------------------------------------------------------------------------

    @initialize()
    def clean(self) -> None:
        # delete, not truncate: a truncate of these few rows cost the server 13 ms, and it
        # made every connection plan its statements on the schema again
        self.db.execute(
            self.q(
                "delete from {schema}.steps; delete from {schema}.attempts; "
                "delete from {schema}.runs; delete from {schema}.wait_tokens"
            )
        )

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
            assert self.storage.run_extend_leases([ref], LEASE) == {ref: RunStatus.RUNNING}
        self.record(op, run)

    @precondition(lambda self: bool(self.runs))
    @rule(data=st.data())
    def stale_writes(self, data: st.DataObject) -> None:
        """Zombie writes: every stale fence of one run, through every fenced write, one at a
        time. None may apply, and every row of both tables stays byte-identical."""
        run = data.draw(st.sampled_from(list(self.runs.values())), label="run")
        self.prepare_stale_targets()
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
        """Retries, releases and due sleeps become queued."""
        due = self.with_status("retrying", "released") + [
            r for r in self.with_status("waiting") if r.wait_kind == "sleep" and r.sleep_due
        ]
        assert self.storage.run_deliver_due(ENV, 10) == len(due)
        for run in due:
            self.unwait(run)

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
        self.prepare_stale_targets()
        before = self.snapshot()
        for op in STALE_OPS:
            assert self.write(op, [ref]) == set(), f"zombie {op} applied"
        assert self.snapshot() == before

    @rule()
    def expire_lapsed_attempts(self) -> None:
        """Maintenance's ATTEMPT_EXPIRY: lapsed attempts are finalized; live ones untouched."""
        applied = expire_lapsed(self.storage)
        expected = {
            r.id: "failed" if r.spent else "retrying"
            for r in self.with_status("running")
            if r.expired
        }
        assert {a.run_id: str(a.status) for a in applied} == expected
        for run_id, status in expected.items():
            self.runs[run_id].finish("expired", status)
        self.resume_run_waiters()

    # -- steps, waits and context.release with the current lease ---------------------------

    @precondition(lambda self: bool(self.with_status("running")))
    @rule(data=st.data(), name=st.sampled_from(STEP_NAMES), value=st.integers(0, 9))
    def store_step(self, data: st.DataObject, name: str, value: int) -> None:
        """The attempt holding the lease stores a step (a lapsed lease not yet finalized
        still may): the first writer of a name wins, later ones get its output back."""
        run = data.draw(st.sampled_from(self.with_status("running")), label="run")
        assert run.token is not None
        ref = LeaseRef(run.id, run.attempt, run.token)
        output = {"attempt": run.attempt, "value": value}
        first = self.steps.get((run.id, name))
        before = self.snapshot()
        stored = self.storage.step_store(ref, name, json.dumps(output))
        if first is None:
            assert stored == StepStored(fenced=True, output=output)
            self.steps[run.id, name] = (output, run.attempt, run.token)
        else:
            assert stored == StepStored(fenced=True, output=first[0])
            assert self.snapshot() == before, "a second store of a step wrote something"
        assert self.storage.step_get(run.id, name) == (True, self.steps[run.id, name][0])

    def current_lease(self, data: st.DataObject) -> tuple[ModelRun, LeaseRef]:
        run = data.draw(st.sampled_from(self.with_status("running")), label="run")
        assert run.token is not None
        return run, LeaseRef(run.id, run.attempt, run.token)

    def suspended(self, run: ModelRun, result: SuspendResult, kind: str) -> None:
        """A suspension with the current lease applied: the run waits, and the attempt is
        handed back unconsumed."""
        assert result == SuspendResult(target_open=True, suspended=True)
        run.finish("suspended", "waiting")
        run.wait_kind = kind
        run.releases += 1

    @precondition(lambda self: bool(self.with_status("running")))
    @rule(data=st.data())
    def suspend_on_token(self, data: st.DataObject) -> None:
        run, ref = self.current_lease(data)
        token_id = self.new_token()
        run.wait_token = token_id
        self.suspended(run, self.storage.run_suspend(ref, ENV, token_id=token_id), "token")

    @precondition(lambda self: bool(self.with_status("running")))
    @rule(data=st.data())
    def suspend_on_resolved_token(self, data: st.DataObject) -> None:
        """A suspension on a token already resolved writes nothing."""
        _, ref = self.current_lease(data)
        token_id = self.new_token()
        assert self.storage.wait_token_complete(ENV, token_id, "1")
        self.wait_tokens[token_id] = "completed"
        before = self.snapshot()
        result = self.storage.run_suspend(ref, ENV, token_id=token_id)
        assert result == SuspendResult(target_open=False, suspended=False)
        assert self.snapshot() == before, "a suspension on a resolved token wrote"

    @precondition(
        lambda self: (
            bool(self.with_status("running"))
            and sum(r.status not in TERMINAL for r in self.runs.values()) > 1
        )
    )
    @rule(data=st.data())
    def suspend_on_run(self, data: st.DataObject) -> None:
        run, ref = self.current_lease(data)
        targets = [r for r in self.runs.values() if r.status not in TERMINAL and r is not run]
        target = data.draw(st.sampled_from(targets), label="target")
        run.wait_run = target.id
        self.suspended(run, self.storage.run_suspend(ref, ENV, run_id=target.id), "run")

    @precondition(lambda self: bool(self.with_status("running")))
    @rule(data=st.data(), due=st.booleans())
    def suspend_to_sleep(self, data: st.DataObject, due: bool) -> None:
        run, ref = self.current_lease(data)
        wake_at = datetime.now(UTC) + timedelta(hours=-1 if due else 1)
        run.sleep_due = due
        self.suspended(run, self.storage.run_suspend(ref, ENV, wake_at=wake_at), "sleep")

    @precondition(lambda self: bool(self.with_status("running")))
    @rule(data=st.data())
    def release_current(self, data: st.DataObject) -> None:
        """context.release: the run goes back as released, the attempt not consumed."""
        run = data.draw(st.sampled_from(self.with_status("running")), label="run")
        assert run.token is not None
        assert self.storage.run_release(LeaseRef(run.id, run.attempt, run.token), timedelta(0))
        run.finish("released", "released")
        run.releases += 1

    @precondition(lambda self: "pending" in self.wait_tokens.values())
    @rule(data=st.data(), resume=st.booleans())
    def complete_token(self, data: st.DataObject, resume: bool) -> None:
        """A pending token is completed (once); with ``resume`` the eager resume pass runs."""
        pending = [t for t, status in self.wait_tokens.items() if status == "pending"]
        awaited = [t for t in pending if any(r.wait_token == t for r in self.runs.values())]
        token_id = data.draw(st.sampled_from(awaited or pending), label="token")
        assert self.storage.wait_token_complete(ENV, token_id, json.dumps({"ok": True}))
        assert not self.storage.wait_token_complete(ENV, token_id, "2")
        self.wait_tokens[token_id] = "completed"
        if resume:
            waiting = [r for r in self.with_status("waiting") if r.wait_token == token_id]
            assert self.storage.run_resume_waiters(ENV, 10, token_ids=[token_id]) == len(waiting)
            for run in waiting:
                self.unwait(run)

    @rule()
    def resume_waiters(self) -> None:
        """The maintenance resume pass: runs waiting on resolved tokens are queued."""
        ready = [
            r
            for r in self.with_status("waiting")
            if r.wait_token is not None and self.wait_tokens[r.wait_token] != "pending"
        ]
        assert self.storage.run_resume_waiters(ENV, 10) == len(ready)
        for run in ready:
            self.unwait(run)

    # -- invariants ----------------------------------------------------------------------

    # every table the invariants read, in one round trip (four statements, one execute):
    # one read a step instead of five
    TABLES = (
        "select id, status, attempt, lease_token, lease_expires_at, finished_at, r::text, "
        "wait_kind, wait_token_id, wait_run_id, releases, max_attempts from {schema}.runs r; "
        "select run_id, attempt, lease_token, outcome from {schema}.attempts; "
        "select id, status from {schema}.wait_tokens; "
        "select run_id, name, output, attempt from {schema}.steps"
    )

    @invariant()
    def database_matches_model(self) -> None:
        with self.db.cursor() as cur:
            cur.execute(self.q(self.TABLES))
            tables = [cur.fetchall()]
            while cur.nextset():
                tables.append(cur.fetchall())
        runs, attempts, tokens, steps = tables
        self.runs_match_model(runs)
        self.one_attempt_row_per_finished_attempt(attempts)
        self.waits_match_model(runs, tokens)
        self.steps_written_by_current_attempts(steps)

    def runs_match_model(self, rows: list[tuple[Any, ...]]) -> None:
        assert {row[0] for row in rows} == set(self.runs)
        for run_id, status, attempt, token, expires, finished_at, text, *_ in rows:
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
            # attempt numbers only grow (never below any seen, nor any in history)
            assert all(attempt >= finished for finished in run.finished)
            assert attempt >= self.highest_attempt.get(run_id, 0)
            self.highest_attempt[run_id] = attempt
            # a terminal run never changes again
            if status in TERMINAL:
                assert self.terminal_rows.setdefault(run_id, text) == text

    def one_attempt_row_per_finished_attempt(self, rows: list[tuple[Any, ...]]) -> None:
        recorded: dict[uuid.UUID, dict[int, tuple[uuid.UUID, str]]] = {}
        for run_id, attempt, token, outcome in rows:
            assert attempt not in recorded.setdefault(run_id, {})
            recorded[run_id][attempt] = (token, outcome)
        expected = {run.id: run.finished for run in self.runs.values() if run.finished}
        assert recorded == expected

    def waits_match_model(self, runs: list[tuple[Any, ...]], tokens: list[tuple[Any, ...]]) -> None:
        for row in runs:
            run_id, status, attempt = row[:3]
            kind, token_id, target, releases, max_attempts = row[7:]
            run = self.runs[run_id]
            assert (kind, token_id, target) == (run.wait_kind, run.wait_token, run.wait_run), run
            assert releases == run.releases, run
            # handed-back attempts (releases, suspensions) are not consumed, and a run that
            # is not terminal never has consumed more attempts than max_attempts allows
            if status not in TERMINAL:
                assert attempt - releases <= max_attempts, run
        assert dict(tokens) == self.wait_tokens

    def steps_written_by_current_attempts(self, rows: list[tuple[Any, ...]]) -> None:
        """A step row exists only if an attempt wrote it while holding the run's lease: it
        names that attempt, whose lease token is the writer's."""
        assert {(r, n): (o, a) for r, n, o, a in rows} == {
            key: (output, attempt) for key, (output, attempt, _) in self.steps.items()
        }
        for (run_id, _), (_, attempt, writer) in self.steps.items():
            run = self.runs[run_id]
            assert attempt <= run.attempt
            token = run.token if attempt == run.attempt else None
            if attempt in run.finished:
                token = run.finished[attempt][0]
            assert token == writer, "a step names an attempt whose lease did not write it"

    @invariant()
    def snapshots_agree(self) -> None:
        for run in self.runs.values():
            snap = self.storage.run_get(ENV, run.id)
            assert snap is not None
            assert (str(snap.status), snap.attempt) == (run.status, run.attempt)
            assert self.storage.run_get("elsewhere", run.id) is None


@pytest.mark.slow
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
                max_examples=100,
                stateful_step_count=40,
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
    assert expire_lapsed(storage) == [FailureApplied(run_id, RunStatus.RETRYING)]
    assert storage.run_deliver_due(ENV, 10) == 1
    third = claim_one(storage)
    assert (third.attempt, third.attempts_consumed) == (3, 2)
    lapse_lease(db, schema, run_id)
    assert expire_lapsed(storage) == [FailureApplied(run_id, RunStatus.FAILED)]
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


# -- flow control: rate limits and per-key limits under every interleaving -----------------------

FLOW_QUEUE = "flow"
FLOW_KEYS = ("a", "b", None, None)
FLOW_PER = timedelta(hours=1)  # the rate window: time moves by rule, never by the wall clock


class FlowFencingMachine(RuleBasedStateMachine):
    """Claims by two claimers, completions, lapsed leases finalized by attempt expiry, killed
    claimers (every lease of theirs lapses at once), time moving on, and the database clock
    stepping back or forward (every stored time shifted), against one queue with a
    concurrency limit, a per-key limit and a rate limit: after every step no key holds more
    live leases than its limit, the queue no more than its own, and no window of the rate's
    period holds more starts than the rate allows."""

    storages: ClassVar[tuple[PostgresStorage, PostgresStorage]]
    db: ClassVar[Conn]
    schema: ClassVar[str]
    limits: ClassVar[QueueLimits]
    rate_bound: ClassVar[int]

    def __init__(self) -> None:
        super().__init__()
        self.db.execute(  # delete, not truncate: see FencingMachine.clean
            self.q(
                "delete from {s}.attempts; delete from {s}.runs; "
                "delete from {s}.queue_flow; delete from {s}.queue_starts"
            )
        )
        # leases held, by claimer
        self.held: tuple[list[ClaimedRun], list[ClaimedRun]] = ([], [])

    def q(self, text: str) -> sql.Composed:
        return sql.SQL(text).format(s=sql.Identifier(self.schema))

    @rule(key=st.sampled_from(FLOW_KEYS), count=st.integers(1, 4))
    def trigger(self, key: str | None, count: int) -> None:
        runs = attrs.evolve(new_runs(count, max_attempts=2), queue=FLOW_QUEUE, concurrency_key=key)
        self.storages[0].run_insert_many(runs)

    @rule(claimer=st.integers(0, 1), limit=st.integers(1, 6))
    def claim(self, claimer: int, limit: int) -> None:
        result = self.storages[claimer].run_claim_limited(
            ENV, FLOW_QUEUE, self.limits, limit, LEASE
        )
        self.held[claimer].extend(result.runs)

    @rule(claimer=st.integers(0, 1), data=st.data())
    def complete(self, claimer: int, data: st.DataObject) -> None:
        held = self.held[claimer]
        if not held:
            return
        run = held.pop(data.draw(st.integers(0, len(held) - 1)))
        self.storages[claimer].run_complete_many(
            [Completion(run.id, run.attempt, run.lease_token, "null")]
        )  # a lease that lapsed meanwhile is refused: nothing to check here

    @rule(claimer=st.integers(0, 1), data=st.data())
    def lease_lapses(self, claimer: int, data: st.DataObject) -> None:
        held = self.held[claimer]
        if not held:
            return
        run = held.pop(data.draw(st.integers(0, len(held) - 1)))
        self.lapse([run.id])

    @rule(claimer=st.integers(0, 1))
    def claimer_killed(self, claimer: int) -> None:
        self.lapse([run.id for run in self.held[claimer]])
        self.held[claimer].clear()

    def lapse(self, ids: list[uuid.UUID]) -> None:
        self.db.execute(
            self.q(
                "update {s}.runs set lease_expires_at = now() - interval '1 second' "
                "where id = any(%s) and status = 'running'"
            ),
            (ids,),
        )

    @rule()
    def expire_lapsed(self) -> None:
        expire_lapsed(self.storages[1])

    @rule(fraction=st.sampled_from([0.25, 0.5, 1.0, 1.5]))
    def time_passes(self, fraction: float) -> None:
        """Every stored time moves into the past, as if that much time had passed."""
        self.shift(-FLOW_PER * fraction)

    @rule(step=st.sampled_from([timedelta(minutes=-10), timedelta(minutes=30)]))
    def clock_steps(self, step: timedelta) -> None:
        """The database clock stepped back (stored times now lie in the future) or forward."""
        self.shift(-step)

    def shift(self, by: timedelta) -> None:
        """Shift every stored start stamp (not lease expiries: lapsing is its own rule)."""
        for statement in (
            "update {s}.runs set attempt_started_at = attempt_started_at + %s "
            "where attempt_started_at is not null",
            "update {s}.attempts set started_at = started_at + %s",
            "update {s}.queue_flow set last_start = last_start + %s, rate_tat = rate_tat + %s",
            "update {s}.queue_starts set started_at = started_at + %s",
        ):
            self.db.execute(self.q(statement), (by,) * statement.count("%s"))

    @invariant()
    def no_key_and_no_queue_over_its_limit(self) -> None:
        rows = self.db.execute(
            self.q(
                "select concurrency_key, count(*) from {s}.runs "
                "where status in ('running', 'cancellation_requested') "
                "and lease_expires_at > now() group by 1"
            )
        ).fetchall()
        live = {key: int(n) for key, n in rows}
        for key, n in live.items():
            if key is not None:
                assert n <= (self.limits.key_limit or 0), (key, n)
        assert sum(live.values()) <= (self.limits.concurrency_limit or 0)

    @invariant()
    def no_window_over_the_rate(self) -> None:
        starts = sorted(
            row[0]
            for row in self.db.execute(
                self.q(
                    "select started_at from {s}.attempts union all "
                    "select attempt_started_at from {s}.runs where status = 'running'"
                )
            )
        )
        j = 0
        for i, start in enumerate(starts):
            j = max(j, i)
            while j < len(starts) and starts[j] < start + FLOW_PER:
                j += 1
            assert j - i <= self.rate_bound, (j - i, starts[i:j])


@pytest.mark.slow
@pytest.mark.parametrize("burst", [None, 1])
def test_flow_limits_hold_under_every_interleaving(
    database_url: str, schema: str, db: Conn, burst: int | None
) -> None:
    storages = tuple(
        PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=1)
        for _ in range(2)
    )
    for storage in storages:
        storage.open()
    try:

        class Machine(FlowFencingMachine):
            pass

        rate = RateLimit(4, FLOW_PER, burst=burst)
        Machine.storages = (storages[0], storages[1])
        Machine.db = db
        Machine.schema = schema
        Machine.limits = QueueLimits.of(
            queue(FLOW_QUEUE, concurrency_limit=5, key_concurrency_limit=1, rate_limit=rate)
        )
        Machine.rate_bound = rate.count + (rate.burst or 0)
        run_state_machine_as_test(
            Machine,
            settings=settings(
                max_examples=60,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        for storage in storages:
            storage.close()
