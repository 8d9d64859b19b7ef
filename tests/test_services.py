"""Supervised maintenance services and the durable maintenance leases behind them.

Two replicas split the bands and fail over; a frozen owner's old fence can change nothing;
failed passes reach ``on_service_error``. A stateful property test then drives acquire,
refresh, release, expiry and fenced writes by three actors in random interleavings and
checks the lease table after every step, with the process clock an hour ahead or behind and
jumping between these; real threads race for one expired band.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, ClassVar, TypeVar
from unittest import mock

import attrs
import psycopg
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from psycopg import sql

from runlane import (
    ConfigurationError,
    MaintenancePhase,
    RetryPolicy,
    RunContext,
    Runlane,
    RunlaneError,
    RunSnapshot,
    RunStatus,
    SchemaNotMigrated,
    ServiceErrorInfo,
    ServiceFailed,
    Services,
    StaleLease,
    task,
)
from runlane.maintenance._services import _BandLoop
from runlane.postgres import PostgresStorage
from runlane.postgres._sql import statements
from runlane.storage import (
    Expiration,
    MaintenanceFence,
    NewRuns,
    ScheduledRun,
    ScheduleState,
)
from runlane.testing import MovableClock
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb, run_together, storage_of, wait_until

T = TypeVar("T")

BANDS = frozenset({"schedules", "delivery", "recovery", "cleanup", "stats"})
SHORT = timedelta(seconds=1)

NO_BACKOFF = RetryPolicy(
    max_attempts=5, initial_delay=timedelta(0), max_delay=timedelta(0), jitter=0.0
)


@task(id="flaky", retry=NO_BACKOFF)
def flaky(payload: Any, context: RunContext) -> None:
    raise RuntimeError("boom")


@task(id="ok")
def ok(payload: Any, context: RunContext) -> None:
    return None


def signalled(
    replica: Services, check: Callable[[], T | None], what: str, timeout: float = 10.0
) -> T:
    """Wait until ``check`` returns something other than None/False, re-checking it at each
    progress signal of ``replica`` (a pass, an acquisition attempt, a band lost, a reported
    failure, a stop) instead of polling on a timer; fail after ``timeout``."""
    found: list[T] = []

    def holds() -> bool:
        value = check()
        if value is None or value is False:
            return False
        found.append(value)
        return True

    assert replica.wait_for(holds, timeout), f"not within {timeout}s: {what}"
    return found[-1]


class Observed:
    """An ``on_service_error`` callback that remembers what it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[BaseException, ServiceErrorInfo]] = []
        self._changed = threading.Condition()

    def __call__(self, error: BaseException, info: ServiceErrorInfo) -> None:
        with self._changed:
            self.seen.append((error, info))
            self._changed.notify_all()

    def wait_for(
        self, match: Callable[[BaseException, ServiceErrorInfo], bool], timeout: float = 10.0
    ) -> tuple[BaseException, ServiceErrorInfo]:
        with self._changed:
            found = self._changed.wait_for(
                lambda: next(((e, i) for e, i in self.seen if match(e, i)), None),
                timeout=timeout,
            )
        assert found is not None, f"no matching service error within {timeout}s: {self.seen}"
        return found


class Db(SchemaDb):
    """Maintenance leases and run statuses in the test's schema."""

    def leases(self, environment: str) -> dict[str, tuple[uuid.UUID, int, bool]]:
        rows = self.all(
            "select band, owner, fencing, expires_at > clock_timestamp() "
            "from {schema}.maintenance_leases where environment = %s",
            environment,
        )
        return {band: (owner, fencing, live) for band, owner, fencing, live in rows}

    def make_due_retry(self, run_id: uuid.UUID) -> None:
        assert self.run(
            "update {schema}.runs set status = 'retrying', due_at = now() - interval '1 second', "
            "lease_token = null, lease_expires_at = null, finished_at = null where id = %s",
            run_id,
        )

    def status(self, run_id: uuid.UUID) -> str:
        ((status,),) = self.all("select status from {schema}.runs where id = %s", run_id)
        assert isinstance(status, str)
        return status

    def expire_lease(self, band: str) -> None:
        """Move the band's lease expiry into the past, as if database time had passed it."""
        assert self.run(
            "update {schema}.maintenance_leases "
            "set expires_at = clock_timestamp() - interval '1 millisecond' where band = %s",
            band,
        )

    def break_table(self, table: str) -> None:
        """Make every update of ``table`` fail with an ordinary database error (not a schema
        error: those are fatal to the services)."""
        self.run(
            "create function {schema}.broken() returns trigger language plpgsql as "
            f"$$ begin raise exception '{table} is broken'; end $$"
        )
        self.run(
            f"create trigger broken before update on {{schema}}.{table} "
            "for each statement execute function {schema}.broken()"
        )


@pytest.fixture
def dbx(db: Conn, schema: str) -> Db:
    return Db(db, schema)


@pytest.fixture
def services() -> Iterator[Callable[[Runlane, Observed | None], Services]]:
    """Start services on a runtime with 1-second leases; every one is closed at teardown."""
    made: list[Services] = []

    def start(runtime: Runlane, observed: Observed | None) -> Services:
        started = runtime.start_services(lease_duration=SHORT, on_service_error=observed)
        made.append(started)
        return started

    yield start
    for started in made:
        started.close(timeout=10)


def all_owned(*replicas: Services) -> tuple[dict[str, int], ...] | None:
    owned = tuple(r.owned_bands() for r in replicas)
    covered: set[str] = set().union(*owned)
    return owned if covered == BANDS else None


# -- two replicas -----------------------------------------------------------------------------


def test_two_replicas_split_the_bands_and_fail_over(
    make_runlane: RunlaneFactory,
    services: Callable[[Runlane, Observed | None], Services],
    dbx: Db,
) -> None:
    rl_a, rl_b = make_runlane(tasks=[ok]), make_runlane(tasks=[ok])
    observed = Observed()
    a, b = services(rl_a, observed), services(rl_b, observed)
    assert a.owner != b.owner
    owned_a, owned_b = signalled(a, lambda: all_owned(a, b), what="every band owned")
    assert not set(owned_a) & set(owned_b), "a band has two owners"
    # the database agrees with each replica's view, and so does status()
    rows = dbx.leases(rl_a.environment)
    assert set(rows) == BANDS
    for replica, owned in ((a, owned_a), (b, owned_b)):
        for band, fencing in owned.items():
            assert rows[band] == (replica.owner, fencing, True)
    report = {lease.band: lease for lease in rl_a.status().maintenance_leases}
    assert set(report) == BANDS
    assert all(lease.live for lease in report.values())

    # stop the replica that owns the delivery band: the other takes every band over
    first, second = (a, b) if "delivery" in owned_a else (b, a)
    old = first.owned_bands()
    first.close()
    assert first.owned_bands() == {}
    taken = signalled(
        second,
        lambda: second.owned_bands() if set(second.owned_bands()) == BANDS else None,
        what="takeover",
    )
    for band, fencing in old.items():
        assert taken[band] > fencing, "a takeover must bump the fencing number"
    rows = dbx.leases(rl_a.environment)
    assert {band: row[0] for band, row in rows.items()} == dict.fromkeys(BANDS, second.owner)

    # the stopped owner's fences can no longer write or refresh
    for band, fencing in old.items():
        fence = MaintenanceFence(rl_a.environment, band, first.owner, fencing)
        with pytest.raises(StaleLease):
            storage_of(rl_a).run_deliver_due(rl_a.environment, 10, fence=fence)
        assert not storage_of(rl_a).maintenance_lease_refresh(fence, SHORT)
    assert observed.seen == []


def test_services_do_the_work(
    make_runlane: RunlaneFactory,
    services: Callable[[Runlane, Observed | None], Services],
    dbx: Db,
) -> None:
    runtime = make_runlane(tasks=[flaky, ok])
    retry = runtime.trigger(flaky, None)
    runtime.drain()
    assert runtime.get_run(retry.id).status is RunStatus.RETRYING
    expiring = runtime.trigger(ok, None)
    (claimed,) = storage_of(runtime).run_claim(runtime.environment, ["default"], 1, SHORT)
    assert claimed.id == expiring.id
    observed = Observed()
    running = services(runtime, observed)
    # a due retry is delivered and an expired attempt finalized, without run_maintenance_once
    signalled(
        running, lambda: runtime.get_run(retry.id).status is RunStatus.QUEUED, what="delivery"
    )
    dbx.run(
        "update {schema}.runs set lease_expires_at = now() - interval '1 second' where id = %s",
        expiring.id,
    )

    def expired() -> RunSnapshot | None:
        snap = runtime.get_run(expiring.id)
        return snap if snap.status is RunStatus.RETRYING else None

    snap = signalled(running, expired, what="attempt expiry")
    assert snap.error is not None
    assert snap.error.type == "runlane.LeaseExpired"
    assert running.changed[MaintenancePhase.DUE_DELIVERY] >= 1
    assert running.changed[MaintenancePhase.ATTEMPT_EXPIRY] == 1
    # the cleanup band runs on its own thread and lease: its first pass need not have come
    # before the other bands' work (under load in CI it had not)
    signalled(running, lambda: running.passes[MaintenancePhase.CLEANUP] >= 1, what="cleanup")
    assert observed.seen == []


def test_replica_whose_refresh_fails_stops_the_band_and_reports_it(
    make_runlane: RunlaneFactory,
    services: Callable[[Runlane, Observed | None], Services],
    dbx: Db,
) -> None:
    runtime = make_runlane(tasks=[ok])
    observed = Observed()
    running = services(runtime, observed)
    # the cleanup band's first pass is done: its next fenced act is a refresh
    (owned,) = signalled(
        running,
        lambda: all_owned(running) if running.passes[MaintenancePhase.CLEANUP] else None,
        what="every band owned, cleanup passed",
    )
    fencing = owned["cleanup"]
    # another replica took the band over (as after an expiry) and holds it for two seconds
    thief = uuid.uuid4()
    assert dbx.run(
        "update {schema}.maintenance_leases set owner = %s, fencing = fencing + 1, "
        "expires_at = clock_timestamp() + interval '2 seconds' where band = 'cleanup'",
        thief,
    )
    error, info = observed.wait_for(lambda e, i: i.band == "cleanup")
    assert isinstance(error, StaleLease)
    assert (info.phase, info.operation) == (MaintenancePhase.CLEANUP, "refresh")
    assert "cleanup" not in running.owned_bands()
    assert dbx.leases(runtime.environment)["cleanup"] == (thief, fencing + 1, True)
    assert running.wait_until_closed(timeout=0.1) is False  # reported, not fatal
    # once the other owner's lease lapses, this replica competes again and wins the band back
    dbx.expire_lease("cleanup")  # rather than waiting two seconds of database time
    regained = signalled(
        running,
        lambda: running.owned_bands().get("cleanup", 0) > fencing + 1,
        what="band regained",
    )
    assert regained
    assert running.owned_bands()["cleanup"] == fencing + 2
    # the other bands were never disturbed
    for band in BANDS - {"cleanup"}:
        assert running.owned_bands()[band] == owned[band]


def test_replica_whose_refresh_raises_stops_the_band_at_once(
    make_runlane: RunlaneFactory,
    services: Callable[[Runlane, Observed | None], Services],
    dbx: Db,
) -> None:
    """Seed: "if refresh fails, that replica stops the band" -- a refresh that raises (not
    only one refused) gives the band up before the error is reported, not at the local
    deadline."""
    runtime = make_runlane(tasks=[ok])
    owned_when_reported: list[dict[str, int]] = []
    observed = Observed()
    replica: list[Services] = []

    def observe(error: BaseException, info: ServiceErrorInfo) -> None:
        if info.band == "cleanup" and info.operation == "refresh":
            owned_when_reported.append(replica[0].owned_bands())
        observed(error, info)

    running = runtime.start_services(lease_duration=timedelta(seconds=4), on_service_error=observe)
    replica.append(running)
    try:
        (owned,) = signalled(
            running,
            lambda: all_owned(running) if running.passes[MaintenancePhase.CLEANUP] else None,
            what="every band owned, cleanup passed",
        )
        fencing = owned["cleanup"]
        # every update of the cleanup band's lease row now fails with a database error
        dbx.run(
            "create function {schema}.broken() returns trigger language plpgsql as "
            "$$ begin raise exception 'cleanup lease row is broken'; end $$"
        )
        dbx.run(
            "create trigger broken before update on {schema}.maintenance_leases "
            "for each row when (old.band = 'cleanup') execute function {schema}.broken()"
        )
        error, info = observed.wait_for(
            lambda e, i: i.band == "cleanup" and i.operation == "refresh", timeout=5
        )
        assert "cleanup lease row is broken" in str(error)
        assert info.phase is MaintenancePhase.CLEANUP
        # the band was given up before the error was reported: well inside the local
        # deadline (3.6 s after the last good refresh at a 4 s lease)
        assert "cleanup" not in owned_when_reported[0]
        assert running.wait_until_closed(timeout=0.1) is False  # reported, not fatal
        dbx.run("drop trigger broken on {schema}.maintenance_leases")
        dbx.expire_lease("cleanup")
        signalled(
            running,
            lambda: running.owned_bands().get("cleanup", 0) > fencing,
            what="band regained once its row can be written",
        )
        for band in BANDS - {"cleanup"}:
            assert running.owned_bands()[band] == owned[band]
    finally:
        running.close(timeout=10)


# -- a frozen owner ---------------------------------------------------------------------------


def test_frozen_owner_is_fenced_out_after_expiry(make_runlane: RunlaneFactory, dbx: Db) -> None:
    runtime = make_runlane(tasks=[ok])
    storage, env = storage_of(runtime), runtime.environment
    handle = runtime.trigger(ok, None)
    frozen, other = uuid.uuid4(), uuid.uuid4()
    first = storage.maintenance_lease_acquire(env, "delivery", frozen, SHORT)
    assert first == 1
    assert storage.maintenance_lease_acquire(env, "delivery", other, SHORT) is None  # live
    old = MaintenanceFence(env, "delivery", frozen, first)
    # while live, the owner's fenced writes apply
    dbx.make_due_retry(handle.id)
    assert storage.run_deliver_due(env, 10, fence=old) == 1
    assert dbx.status(handle.id) == "queued"

    # the owner freezes (no refresh); after expiry by database time another replica acquires
    dbx.expire_lease("delivery")
    taken = storage.maintenance_lease_acquire(env, "delivery", other, timedelta(minutes=1))
    assert taken == first + 1
    new = MaintenanceFence(env, "delivery", other, taken)

    # the frozen owner wakes up: every fenced write raises StaleLease and changes nothing
    dbx.make_due_retry(handle.id)
    tables = ("runs", "attempts", "schedules", "schedule_slots", "wait_tokens")
    before = {t: dbx.all(f"select x::text from {{schema}}.{t} x order by 1") for t in tables}
    expiration = Expiration(handle.id, 1, uuid.uuid4(), "{}", None)
    retention = {
        s: timedelta(0) for s in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)
    }
    slot = dbx.all("select now()")[0][0]
    writes: list[Callable[[], object]] = [
        lambda: storage.run_deliver_due(env, 10, fence=old),
        lambda: storage.run_expire_many([expiration], fence=old),
        lambda: storage.run_prune(env, retention, 10, fence=old),
        lambda: storage.wait_token_time_out_due(env, 10, fence=old),
        lambda: storage.run_resume_waiters(env, 10, fence=old),
        lambda: storage.schedule_state_reset(
            env, ScheduleState("s", "* * * * *", "UTC", slot), fence=old
        ),
        lambda: storage.schedule_fire(
            ScheduledRun(env, "s", slot, uuid.uuid4(), "ok", "default", 0, "null", 1),
            slot,
            slot,
            fence=old,
        ),
    ]
    for write in writes:
        with pytest.raises(StaleLease):
            write()
    after = {t: dbx.all(f"select x::text from {{schema}}.{t} x order by 1") for t in tables}
    assert after == before
    assert not storage.maintenance_lease_refresh(old, SHORT)
    assert not storage.maintenance_lease_release(old)
    assert dbx.leases(env)["delivery"] == (other, taken, True)
    # the new owner writes
    assert storage.run_deliver_due(env, 10, fence=new) == 1
    assert dbx.status(handle.id) == "queued"


def test_takeover_waits_for_the_old_owners_write_transaction(
    make_runlane: RunlaneFactory, dbx: Db, database_url: str, schema: str, clock: MovableClock
) -> None:
    """The fence check share-locks the lease row: a takeover that starts while the old owner's
    write transaction is open waits until it ends, so the old owner never writes after the
    new one has begun."""
    runtime = make_runlane(tasks=[ok])
    storage, env = storage_of(runtime), runtime.environment
    handle = runtime.trigger(ok, None)
    fencing = storage.maintenance_lease_acquire(env, "delivery", uuid.uuid4(), SHORT)
    assert fencing is not None
    old = dbx.leases(env)["delivery"]
    fence = MaintenanceFence(env, "delivery", old[0], fencing)
    check = statements(schema)["maintenance_fence"]
    result: dict[str, int | None] = {}
    acquired = threading.Event()

    def take_over() -> None:
        result["fencing"] = storage.maintenance_lease_acquire(
            env, "delivery", uuid.uuid4(), timedelta(minutes=1)
        )
        acquired.set()

    with psycopg.connect(database_url, application_name="old-owner") as writer:
        assert writer.execute(check, {**attrs.asdict(fence), "now": None}).fetchone() is not None
        # the lease lapses in the runtime's time while the old owner's transaction is open
        clock.advance(SHORT.total_seconds() + 1)
        taker = threading.Thread(target=take_over, name="taker")
        taker.start()
        wait_until(  # no signal reports a lock being waited on
            lambda: bool(
                dbx.all(
                    "select 1 from pg_locks l join pg_stat_activity a using (pid) "
                    "where not l.granted and a.application_name = %s",
                    f"runlane-{schema}",
                )
            ),
            timeout=10,
            what="the takeover waiting on the lease row",
        )
        assert not acquired.is_set()
        writer.execute(
            sql.SQL("update {}.runs set priority = 7 where id = %s").format(sql.Identifier(schema)),
            (handle.id,),
        )
        writer.commit()
    assert acquired.wait(10)
    taker.join(10)
    assert result["fencing"] == fencing + 1
    assert runtime.get_run(handle.id).priority == 7


# -- errors and shutdown ----------------------------------------------------------------------


def band_threads(replica: Services) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(f"{replica.name}-")]


def test_failed_passes_reach_the_callback_with_their_phase(
    make_runlane: RunlaneFactory,
    services: Callable[[Runlane, Observed | None], Services],
    dbx: Db,
) -> None:
    runtime = make_runlane(tasks=[flaky])
    observed = Observed()
    running = services(runtime, observed)
    signalled(running, lambda: all_owned(running), what="every band owned")
    dbx.break_table("wait_tokens")
    error, info = observed.wait_for(lambda e, i: i.operation == "pass")
    assert (info.phase, info.band) == (MaintenancePhase.WAIT_TOKEN_RESOLUTION, "delivery")
    assert "wait_tokens is broken" in str(error)
    assert running.wait_until_closed(timeout=0) is False  # storage failures are not fatal
    # the band keeps running its other phases, and keeps reporting the broken one
    handle = runtime.trigger(flaky, None)
    runtime.drain()
    signalled(
        running, lambda: runtime.get_run(handle.id).status is RunStatus.QUEUED, what="delivery"
    )
    observed.wait_for(lambda e, i: len(observed.seen) >= 3)
    assert {(i.phase, i.operation) for _, i in observed.seen} == {
        (MaintenancePhase.WAIT_TOKEN_RESOLUTION, "pass")
    }
    assert "delivery" in running.owned_bands()
    assert not running.closed


def test_callback_raising_does_not_stop_the_services(
    make_runlane: RunlaneFactory,
    services: Callable[[Runlane, Observed | None], Services],
    dbx: Db,
) -> None:
    runtime = make_runlane(tasks=[ok])
    calls = threading.Semaphore(0)

    def broken(error: BaseException, info: ServiceErrorInfo) -> None:
        calls.release()
        raise ValueError("the observer itself failed")

    running = runtime.start_services(lease_duration=SHORT, on_service_error=broken)
    try:
        signalled(running, lambda: all_owned(running), what="every band owned")
        dbx.break_table("wait_tokens")
        for _ in range(2):
            assert calls.acquire(timeout=10)
        assert running.wait_until_closed(timeout=0) is False
    finally:
        running.close(timeout=10)


def test_fatal_band_failure_surfaces_as_service_failed(
    make_runlane: RunlaneFactory, dbx: Db
) -> None:
    class Fatal(BaseException):
        pass

    def fatal(error: BaseException, info: ServiceErrorInfo) -> None:
        raise Fatal("stop everything")

    runtime = make_runlane(tasks=[ok])
    running = runtime.start_services(lease_duration=SHORT, on_service_error=fatal)
    try:
        signalled(running, lambda: all_owned(running), what="every band owned")
        dbx.break_table("wait_tokens")
        with pytest.raises(ServiceFailed) as failed:
            running.wait_until_closed(timeout=10)
        assert isinstance(failed.value.__cause__, Fatal)
        assert running.closed
        assert band_threads(running) == []
    finally:
        running.close(timeout=10)


@pytest.mark.parametrize("how", ["dropped", "unmigrated"])
def test_missing_schema_stops_the_services_with_the_migrate_hint(
    make_runlane: RunlaneFactory, dbx: Db, how: str
) -> None:
    """Retrying cannot create tables: a schema error is reported once, every band stops
    (releasing its lease), and wait_until_closed() raises ServiceFailed chained to it. A
    schema never migrated fails start_services() itself, at once (its start's first
    statement checks the schema; no wait_for_database waits for a migration)."""
    observed = Observed()
    if how == "dropped":
        runtime = make_runlane(tasks=[ok])
        running = runtime.start_services(lease_duration=SHORT, on_service_error=observed)
        signalled(running, lambda: all_owned(running), what="every band owned")
        dbx.run("drop table {schema}.wait_tokens")
    else:
        never_migrated = f"t_{uuid.uuid4().hex[:16]}"  # no such schema exists
        runtime = make_runlane(tasks=[ok], schema=never_migrated)
        started = time.monotonic()
        with pytest.raises(SchemaNotMigrated, match="runlane migrate"):
            runtime.start_services(lease_duration=SHORT, on_service_error=observed)
        assert time.monotonic() - started < 5
        assert observed.seen == []
        return
    try:
        with pytest.raises(ServiceFailed, match="runlane migrate") as failed:
            running.wait_until_closed(timeout=10)
        assert isinstance(failed.value.__cause__, SchemaNotMigrated)
        assert running.closed
        assert band_threads(running) == []
        assert running.owned_bands() == {}
        assert observed.seen, "the fatal error was not reported"
        assert all(isinstance(e, SchemaNotMigrated) for e, _ in observed.seen)
        if how == "dropped":
            live = {
                band for band, (_, _, alive) in dbx.leases(runtime.environment).items() if alive
            }
            assert live == set(), "the stopped bands kept their leases"
        # close() after a failure returns at once; wait_until_closed() keeps raising
        running.close(timeout=1)
        with pytest.raises(ServiceFailed):
            running.wait_until_closed(timeout=0)
    finally:
        running.close(timeout=10)


def test_close_is_idempotent_and_stops_every_thread(make_runlane: RunlaneFactory, dbx: Db) -> None:
    runtime = make_runlane(tasks=[ok])
    running = runtime.start_services(lease_duration=SHORT)
    assert running.name.startswith("runlane-services-")
    assert sorted(band_threads(running)) == sorted(f"{running.name}-{band}" for band in BANDS)
    signalled(running, lambda: all_owned(running), what="every band owned")
    assert running.wait_until_closed(timeout=0) is False
    assert not running.closed
    running.close()
    assert running.closed
    running.close()
    running.close(timeout=1)
    assert running.wait_until_closed(timeout=0) is True
    assert band_threads(running) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("runlane-services-")]
    assert running.owned_bands() == {}
    # the leases were released at close, so another replica need not wait for their expiry
    assert {live for _, _, live in dbx.leases(runtime.environment).values()} == {False}

    with runtime.start_services(lease_duration=SHORT) as scoped:
        signalled(scoped, lambda: all_owned(scoped), what="every band owned")
    assert scoped.wait_until_closed(timeout=0) is True
    assert band_threads(scoped) == []


def test_concurrent_closes_all_return_once_closed(make_runlane: RunlaneFactory) -> None:
    runtime = make_runlane(tasks=[ok])
    running = runtime.start_services(lease_duration=SHORT)
    signalled(running, lambda: all_owned(running), what="every band owned")
    run_together([functools.partial(running.close, timeout=10) for _ in range(4)])
    assert running.closed
    assert running.wait_until_closed(timeout=0) is True
    assert band_threads(running) == []


def test_close_gives_up_on_a_blocked_band_within_its_timeout(
    make_runlane: RunlaneFactory,
    database_url: str,
    dbx: Db,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A band stuck in a statement (its lease row locked by another connection) does not
    hold close() past its timeout: close() names the thread it gave up on and returns."""
    runtime = make_runlane(tasks=[ok])
    running = runtime.start_services(lease_duration=timedelta(seconds=30))
    signalled(running, lambda: all_owned(running), what="every band owned")
    blocker = psycopg.connect(database_url)
    try:
        # every fenced write share-locks its band's lease row: lock them all
        blocker.execute(
            sql.SQL("select * from {}.maintenance_leases for update").format(
                sql.Identifier(dbx.schema)
            )
        )
        wait_until(
            lambda: bool(
                dbx.all(
                    "select 1 from pg_locks l join pg_stat_activity a using (pid) "
                    "where not l.granted and a.application_name = %s",
                    f"runlane-{dbx.schema}",
                )
            ),
            timeout=10,
            what="a band waiting on its lease row",
        )
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="runlane.services"):
            running.close(timeout=0.5)
        elapsed = time.monotonic() - started
        assert elapsed < 1.5, f"close(timeout=0.5) took {elapsed:.2f}s"
        assert running.wait_until_closed(timeout=0) is True
        assert f"without waiting for {running.name}-" in caplog.text
    finally:
        blocker.rollback()
        blocker.close()
    # once the statement ends, the stuck thread finishes and exits
    for thread in [t for t in threading.enumerate() if t.name.startswith(f"{running.name}-")]:
        thread.join(10)
    assert band_threads(running) == []


def test_bad_timeouts_are_configuration_errors(make_runlane: RunlaneFactory) -> None:
    runtime = make_runlane(tasks=[ok])
    running = runtime.start_services(lease_duration=SHORT)
    try:
        for bad in (-1, -0.5, float("nan"), "1", True):
            with pytest.raises(ConfigurationError, match="timeout"):
                running.close(timeout=bad)  # type: ignore[arg-type]
            with pytest.raises(ConfigurationError, match="timeout"):
                running.wait_until_closed(timeout=bad)  # type: ignore[arg-type]
        assert not running.closed, "a rejected close() must not start closing"
    finally:
        running.close(timeout=10)
    assert running.closed


def test_lease_duration_below_a_second_is_rejected(make_runlane: RunlaneFactory) -> None:
    runtime = make_runlane(tasks=[ok])
    with pytest.raises(RunlaneError):
        runtime.start_services(lease_duration=timedelta(milliseconds=500))
    with pytest.raises(RunlaneError):
        runtime.start_services(lease_duration=5)  # type: ignore[arg-type]


# -- property tests: the lease rules under random interleavings ------------------------------

ENV = "props"
LEASE = timedelta(minutes=1)  # nothing expires by itself during an example
ACTORS = ("A", "B", "C")
BAND_NAMES = ("b1", "b2")
CLOCK_SHIFTS = (0, 3600, -3600)  # the process clock: true, an hour ahead, an hour behind


@attrs.define
class BandModel:
    fencing: int = 0  # 0: no row yet
    owner: uuid.UUID | None = None
    live: bool = False


class LeaseMachine(RuleBasedStateMachine):
    """Three actors, each on its own connection, compete for two bands."""

    storages: ClassVar[dict[str, PostgresStorage]]
    owners: ClassVar[dict[str, uuid.UUID]]
    dbx: ClassVar[Db]
    run_id: ClassVar[uuid.UUID]
    highest: ClassVar[dict[str, int]]  # the largest fencing number ever seen, per band
    # the process clock's shift from the real clock (seconds), which the test's patched
    # time.time adds, and every shift an example has run under
    start_shift: ClassVar[int]  # where each example starts
    clock_shift: ClassVar[list[int]]
    shifts_seen: ClassVar[set[int]]

    def __init__(self) -> None:
        super().__init__()
        self.bands = {band: BandModel() for band in BAND_NAMES}
        # every fence handed out, in order, with the actor it went to
        self.issued: list[tuple[str, MaintenanceFence]] = []

    def current(self, band: str) -> MaintenanceFence | None:
        model = self.bands[band]
        if not model.live or model.owner is None:
            return None
        return MaintenanceFence(ENV, band, model.owner, model.fencing)

    @initialize()
    def start(self) -> None:
        """Examples share the table (fencing numbers must keep growing across them); every
        lease starts expired. The process clock jumps through every shift once and back to
        the example's own before its steps (the random jumps below come on top: a run whose
        examples happened to draw no jump to one shift failed the coverage check)."""
        for shift in (*CLOCK_SHIFTS, self.start_shift):
            self.shift_process_clock(shift)
        self.dbx.run(
            "update {schema}.maintenance_leases "
            "set expires_at = clock_timestamp() - interval '1 millisecond' where environment = %s",
            ENV,
        )
        for band, (owner, fencing, live) in self.dbx.leases(ENV).items():
            assert not live
            self.bands[band] = BandModel(fencing, owner, False)

    @rule(shift=st.sampled_from(CLOCK_SHIFTS))
    def shift_process_clock(self, shift: int) -> None:
        """The process clock jumps an hour ahead or behind, or back: leases use database
        time only, so the model does not change."""
        self.clock_shift[0] = shift
        self.shifts_seen.add(shift)

    @rule(actor=st.sampled_from(ACTORS), band=st.sampled_from(BAND_NAMES))
    def acquire(self, actor: str, band: str) -> None:
        model = self.bands[band]
        owner = self.owners[actor]
        got = self.storages[actor].maintenance_lease_acquire(ENV, band, owner, LEASE)
        if model.live:
            assert got is None, f"{actor} acquired {band} while {model} was live"
            return
        assert got == model.fencing + 1
        self.bands[band] = BandModel(got, owner, True)
        self.issued.append((actor, MaintenanceFence(ENV, band, owner, got)))

    def pick_fence(self, data: st.DataObject) -> tuple[str, MaintenanceFence]:
        """The actor presenting a fence, and the fence: one an actor acquired at some point
        (its own, maybe stale by now), or a forged one (any owner, any band, a fencing number from
        three below the band's latest to one past it)."""
        actor = data.draw(st.sampled_from(ACTORS), label="actor")
        if self.issued:
            use_issued = data.draw(st.booleans(), label="use an issued fence")
            if use_issued:
                return data.draw(st.sampled_from(self.issued), label="issued")
        band = data.draw(st.sampled_from(BAND_NAMES), label="band")
        owner_of = data.draw(st.sampled_from(ACTORS), label="owner")
        # relative to the band's latest number, so that the drawn choices do not depend on
        # numbers left in the table by earlier examples
        back = data.draw(st.sampled_from([0, 1, -1, 0, 2, 3]), label="fencing back")
        fencing = max(0, self.bands[band].fencing - back)
        return actor, MaintenanceFence(ENV, band, self.owners[owner_of], fencing)

    @rule(data=st.data())
    def refresh(self, data: st.DataObject) -> None:
        actor, fence = self.pick_fence(data)
        refreshed = self.storages[actor].maintenance_lease_refresh(fence, LEASE)
        assert refreshed == (fence == self.current(fence.band)), fence

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        actor, fence = self.pick_fence(data)
        released = self.storages[actor].maintenance_lease_release(fence)
        assert released == (fence == self.current(fence.band)), fence
        if released:
            self.bands[fence.band].live = False

    @rule(band=st.sampled_from(BAND_NAMES))
    def expire(self, band: str) -> None:
        self.dbx.run(
            "update {schema}.maintenance_leases "
            "set expires_at = clock_timestamp() - interval '1 millisecond' "
            "where environment = %s and band = %s",
            ENV,
            band,
        )
        self.bands[band].live = False

    @rule(data=st.data(), op=st.sampled_from(["deliver", "prune", "time_out_tokens"]))
    def fenced_write(self, data: st.DataObject, op: str) -> None:
        """A write presenting some fence. Only the current live fence may write; any other
        raises StaleLease and changes nothing."""
        actor, fence = self.pick_fence(data)
        band = fence.band
        valid = fence == self.current(band)
        storage = self.storages[actor]
        self.dbx.make_due_retry(self.run_id)
        retention = {
            s: timedelta(days=1)
            for s in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)
        }
        write: dict[str, Callable[[], object]] = {
            "deliver": lambda: storage.run_deliver_due(ENV, 10, fence=fence),
            "prune": lambda: storage.run_prune(ENV, retention, 10, fence=fence),
            "time_out_tokens": lambda: storage.wait_token_time_out_due(ENV, 10, fence=fence),
        }
        if valid:
            write[op]()
            expected = "queued" if op == "deliver" else "retrying"
            assert self.dbx.status(self.run_id) == expected
        else:
            with pytest.raises(StaleLease):
                write[op]()
            assert self.dbx.status(self.run_id) == "retrying"

    @invariant()
    def database_agrees(self) -> None:
        rows = self.dbx.leases(ENV)
        for band, model in self.bands.items():
            if model.fencing == 0:
                assert band not in rows
                continue
            owner, fencing, live = rows[band]
            assert (owner, fencing, live) == (model.owner, model.fencing, model.live)
            # the fencing number never decreases
            assert fencing >= self.highest.get(band, 0)
            self.highest[band] = fencing

    @invariant()
    def only_the_current_fence_passes_the_write_check(self) -> None:
        """Per band: the live owner's current fence passes a fenced (empty) write; the same
        owner's previous fence, and another owner presenting the current number, do not."""
        storage = self.storages[ACTORS[0]]
        for band in BAND_NAMES:
            current = self.current(band)
            if current is None:
                continue
            assert storage.wait_token_time_out_due(ENV, 0, fence=current) == 0
            older = [
                f
                for _, f in self.issued
                if f.band == band and f.owner == current.owner and f.fencing < current.fencing
            ]
            if older:
                with pytest.raises(StaleLease):
                    storage.wait_token_time_out_due(ENV, 0, fence=older[-1])
            impostor = next(o for o in self.owners.values() if o != current.owner)
            with pytest.raises(StaleLease):
                storage.wait_token_time_out_due(ENV, 0, fence=attrs.evolve(current, owner=impostor))

    @invariant()
    def at_most_one_owner_per_band_at_a_database_instant(self) -> None:
        """Every fence ever handed out is checked against the table in one statement (one
        database instant): at most one per band is live, and it is the model's."""
        fences = [fence for _, fence in self.issued]
        if not fences:
            return
        rows = self.dbx.all(
            "select f.band, f.owner, f.fencing "
            "from unnest(%s::text[], %s::uuid[], %s::bigint[]) as f(band, owner, fencing) "
            "join {schema}.maintenance_leases as l on l.environment = %s "
            "and l.band = f.band and l.owner = f.owner and l.fencing = f.fencing "
            "and l.expires_at > clock_timestamp()",
            [f.band for f in fences],
            [f.owner for f in fences],
            [f.fencing for f in fences],
            ENV,
        )
        live: dict[str, list[MaintenanceFence]] = {}
        for band, owner, fencing in rows:
            live.setdefault(band, []).append(MaintenanceFence(ENV, band, owner, fencing))
        for band in BAND_NAMES:
            holders = live.get(band, [])
            assert len(holders) <= 1, f"{band} has {len(holders)} live owners: {holders}"
            current = self.current(band)
            if current is not None and current in fences:
                assert holders == [current]
            else:
                assert holders == []
            live_rows = self.dbx.all(
                "select count(*) from {schema}.maintenance_leases where environment = %s "
                "and band = %s and expires_at > clock_timestamp()",
                ENV,
                band,
            )
            assert live_rows[0][0] <= 1


@pytest.fixture
def actor_storages(database_url: str, schema: str) -> Iterator[dict[str, PostgresStorage]]:
    made = {
        actor: PostgresStorage(
            connection_string=database_url, schema=schema, pool_min_size=1, pool_max_size=1
        )
        for actor in ACTORS
    }
    for storage in made.values():
        storage.open()
    yield made
    for storage in made.values():
        storage.close()


@pytest.mark.slow
@pytest.mark.parametrize("shift", CLOCK_SHIFTS, ids=["clock", "clock+1h", "clock-1h"])
def test_lease_rules_state_machine(
    actor_storages: dict[str, PostgresStorage], dbx: Db, shift: int
) -> None:
    """The same rules hold with the process clock an hour ahead or behind, and when it
    jumps between these mid-sequence (``shift_process_clock``): leases use database time
    only. Each test starts its examples on its own clock; together the three run 75
    examples (they ran 50 each, on a fixed clock, before the jumps were a rule: the
    process clock is no input of any lease statement, so the three explored one state
    space three times)."""
    seed = actor_storages["A"].run_insert_many(
        NewRuns(
            environment=ENV,
            task_id="t",
            queue="q",
            ids=[uuid.uuid4()],
            payloads=["null"],
            idempotency_keys=[None],
            priority=0,
            max_attempts=1,
            delay=timedelta(0),
            run_at=None,
        )
    )

    class Machine(LeaseMachine):
        pass

    Machine.storages = actor_storages
    Machine.owners = {actor: uuid.uuid4() for actor in ACTORS}
    Machine.dbx = dbx
    Machine.run_id = seed[0].id
    Machine.highest = {}
    Machine.start_shift = shift
    Machine.clock_shift = [shift]
    Machine.shifts_seen = {shift}
    real_time = time.time

    def shifted() -> float:
        return real_time() + Machine.clock_shift[0]

    with mock.patch("time.time", shifted):
        assert abs(time.time() - real_time() - shift) < 1
        run_state_machine_as_test(
            Machine,
            settings=settings(
                max_examples=25,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
                # no shrinking: with a database round trip per step it can outlast the test
                # timeout; the failing steps (at most 30) are printed as they ran
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
            ),
        )
    assert Machine.highest, "no lease was ever acquired"
    assert Machine.shifts_seen == set(CLOCK_SHIFTS), "the clock never jumped to every shift"


# -- races between real threads ---------------------------------------------------------------


def test_racing_acquirers_of_an_expired_band_get_one_fencing_number(
    database_url: str, schema: str, dbx: Db
) -> None:
    storages = [
        PostgresStorage(
            connection_string=database_url, schema=schema, pool_min_size=1, pool_max_size=1
        )
        for _ in range(6)
    ]
    owners = [uuid.uuid4() for _ in storages]
    for storage in storages:
        storage.open()
    try:
        for previous in range(8):
            results = run_together(
                [
                    functools.partial(s.maintenance_lease_acquire, ENV, "race", o, LEASE)
                    for s, o in zip(storages, owners, strict=True)
                ]
            )
            winners = [i for i, got in enumerate(results) if got is not None]
            assert len(winners) == 1, results
            (winner,) = winners
            assert results[winner] == previous + 1
            assert dbx.leases(ENV)["race"] == (owners[winner], previous + 1, True)
            # the band expires (its owner froze) before the next round
            dbx.run(
                "update {schema}.maintenance_leases "
                "set expires_at = clock_timestamp() - interval '1 millisecond' where band = 'race'"
            )
    finally:
        for storage in storages:
            storage.close()


def test_a_close_made_on_the_starting_thread_does_not_hang_start_services(
    make_runlane: RunlaneFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal handler runs on the main thread wherever it was: a SIGTERM whose handler
    closes the runtime while ``start_services`` starts the band threads (CI: the maintenance
    example hung). Here the close is made inside the first band thread's start."""
    runlane = make_runlane()
    real_start = threading.Thread.start
    closes: list[str] = []

    def start(thread: threading.Thread) -> None:
        target = getattr(thread, "_target", None)
        if isinstance(getattr(target, "__self__", None), _BandLoop) and not closes:
            closes.append(thread.name)
            runlane.close(timeout=5)  # what the handler does, on the starting thread
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    started: list[Services] = []
    starter = threading.Thread(
        target=lambda: started.append(runlane.start_services()), name="test-starter", daemon=True
    )
    real_start(starter)
    starter.join(10)
    assert not starter.is_alive(), "start_services hung on a close made on its own thread"
    assert closes
    assert started
    services = started[0]
    assert services.wait_until_closed(timeout=5) is True  # every band accounted for
    wait_until(
        lambda: not any(t.name.startswith(f"{services.name}-") for t in threading.enumerate()),
        timeout=5,
        what="the band threads to end",
    )
