"""What every soak process shares: the settings, the side tables, the tasks and the runtime.

The handlers record what they do outside runlane, in a schema of their own written through
their own connections (application name ``soak-*``, never terminated by the storms): one
``executions`` row per handler call (started and ended by the database clock,
``clock_timestamp()``), one ``effects`` row per side effect a step performed. Whatever a
payload asks for (queue, sleep, a step, a planned failure) is derived from its number, so the
checks can recompute it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, LiteralString

import attrs
import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool, PoolTimeout

from runlane import RetryPolicy, RunContext, Runlane, create_runlane, queue, task
from runlane.postgres import postgres_polling_lane

log = logging.getLogger("soak")

MAIN_QUEUE = "main"
BOUNDED_QUEUE = "bounded"
# enough for the fault load: a planned failure, plus every kill, freeze, restart and stall a
# run can meet (the soak reports how many attempts the busiest run used)
MAX_ATTEMPTS = 25
STEP_NAME = "effect"


@attrs.frozen
class Settings:
    """One soak's settings, written to ``settings.json`` in its directory for the children."""

    lane: str
    url: str  # the database, directly
    schema: str
    side: str  # the handlers' own schema
    runs: int
    duration: float  # seconds over which triggers trickle in and faults are scheduled
    seed_fraction: float  # the share of runs triggered at once at the start
    concurrency: int
    bounded_limit: int
    lease: float  # attempt lease (seconds)
    maintenance_lease: float  # maintenance band lease (seconds)
    directory: str
    amqp_url: str | None = None

    def save(self) -> Path:
        path = Path(self.directory) / "settings.json"
        path.write_text(json.dumps(attrs.asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Settings:
        return cls(**json.loads(Path(path).read_text()))


# -- what a run does, from its number --------------------------------------------------------


def is_bounded(i: int) -> bool:
    return i % 20 == 0


def uses_step(i: int) -> bool:
    return i % 3 == 0


def fails_first(i: int) -> bool:
    """Raises on its first attempt (after its step, when it has one: the retry replays it)."""
    return i % 10 == 3


def sleep_seconds(i: int) -> float:
    if is_bounded(i):
        return (20 + (i * 7) % 30) / 1000
    # short enough on average (under 20 ms with the records) that workers claim ahead
    return (1 + (i * 7) % 10) / 1000


@attrs.frozen
class Job:
    i: int


class PlannedFailure(Exception):
    """A handler failing on purpose (its run retries)."""


# -- the side tables -------------------------------------------------------------------------

SIDE_TABLES: LiteralString = """
create schema if not exists {side};
create table if not exists {side}.executions (
    id          bigserial primary key,
    run_id      uuid not null,
    attempt     integer not null,
    lease       uuid not null,
    queue       text not null,
    proc        text not null,
    -- time.monotonic() when the handler function was entered (the clock is system-wide:
    -- compared with the soak's SIGSTOP/SIGCONT times, it tells a handler entered before its
    -- process froze from one the engine started after the process woke up)
    entered     double precision not null,
    -- time.monotonic() when the worker checked the claim's lease and started the attempt
    -- (RunContext._lease_checked_at): a pause or an outage after it is not a late start
    checked     double precision not null,
    started_at  timestamptz not null default clock_timestamp(),
    ended_at    timestamptz,
    error       text
);
create index if not exists executions_run on {side}.executions (run_id);
create table if not exists {side}.effects (
    id       bigserial primary key,
    run_id   uuid not null,
    step     text not null,
    attempt  integer not null,
    lease    uuid not null,
    proc     text not null,
    at       timestamptz not null default clock_timestamp()
);
create index if not exists effects_run on {side}.effects (run_id);
create table if not exists {side}.triggered (
    i       integer primary key,
    run_id  uuid not null,
    at      timestamptz not null default clock_timestamp()
);
create table if not exists {side}.procs (
    proc        text primary key,
    pid         integer not null,
    owner       uuid,
    skew        double precision not null,
    started_at  timestamptz not null default clock_timestamp()
);
create table if not exists {side}.api_errors (
    at     timestamptz not null,
    call   text not null,
    error  text not null
);
create table if not exists {side}.notes (
    key    text primary key,
    value  double precision not null
);
"""


def side_sql(query: LiteralString, side: str) -> sql.Composed:
    return sql.SQL(query).format(side=sql.Identifier(side))


def create_side_tables(url: str, side: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(side_sql(SIDE_TABLES, side))


class Recorder:
    """The handlers' own records, written through a small pool of this process's own.

    A write waits out an outage (it retries for up to ``patience`` seconds): a record that
    could not be written would make the checks guess."""

    def __init__(self, url: str, side: str, proc: str, size: int, patience: float = 300.0) -> None:
        self.side = side
        self.proc = proc
        self.patience = patience
        self.pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            url,
            min_size=1,
            max_size=size,
            kwargs={"autocommit": True, "application_name": f"soak-{proc}"[:63]},
            check=ConnectionPool.check_connection,
            reconnect_timeout=patience,
            open=True,
        )

    def execute(self, query: LiteralString, params: tuple[Any, ...]) -> Any:
        deadline = time.monotonic() + self.patience
        delay = 0.05
        while True:
            try:
                with self.pool.connection(timeout=10) as conn:
                    row = conn.execute(side_sql(query, self.side), params).fetchone()
                    return None if row is None else row[0]
            except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout):
                if time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def started(self, context: RunContext, entered: float) -> int:
        return int(
            self.execute(
                "insert into {side}.executions "
                "(run_id, attempt, lease, queue, proc, entered, checked) "
                "values (%s, %s, %s, %s, %s, %s, %s) returning id",
                (
                    context.run_id,
                    context.attempt,
                    lease_of(context),
                    context.queue,
                    self.proc,
                    entered,
                    context._lease_checked_at,
                ),
            )
        )

    def ended(self, execution: int, error: str | None) -> None:
        self.execute(
            "update {side}.executions set ended_at = clock_timestamp(), error = %s "
            "where id = %s returning id",
            (error, execution),
        )

    def effect(self, context: RunContext, step: str) -> int:
        return int(
            self.execute(
                "insert into {side}.effects (run_id, step, attempt, lease, proc) "
                "values (%s, %s, %s, %s, %s) returning id",
                (context.run_id, step, context.attempt, lease_of(context), self.proc),
            )
        )

    def close(self) -> None:
        self.pool.close(timeout=5)


def lease_of(context: RunContext) -> uuid.UUID:
    """The lease token of the attempt the handler runs in (the handler's proof of identity)."""
    token = context._lease_token
    if token is None:
        raise RuntimeError("the soak's handlers run only inside a worker")
    return token


# -- the tasks ---------------------------------------------------------------------------------

_recorder: Recorder | None = None
_recorder_lock = threading.Lock()


def install_recorder(recorder: Recorder) -> None:
    global _recorder  # noqa: PLW0603 - one recorder per process, set before the worker starts
    with _recorder_lock:
        _recorder = recorder


def _current() -> Recorder:
    if _recorder is None:
        raise RuntimeError("install_recorder() first")
    return _recorder


RETRY = RetryPolicy(
    max_attempts=MAX_ATTEMPTS,
    initial_delay=timedelta(milliseconds=50),
    max_delay=timedelta(seconds=1),
)


def _fail(i: int) -> None:
    raise PlannedFailure(f"run {i} fails its first attempt on purpose")


def _handle(payload: Job, context: RunContext) -> dict[str, Any]:
    entered = time.monotonic()
    recorder = _current()
    execution = recorder.started(context, entered)
    error: str | None = None
    try:
        context.cancelled.wait(sleep_seconds(payload.i))
        effect = None
        if uses_step(payload.i):
            effect = context.step(STEP_NAME, lambda: recorder.effect(context, STEP_NAME))
        if fails_first(payload.i) and context.attempt == 1:
            _fail(payload.i)
        return {
            "attempt": context.attempt,
            "lease": str(lease_of(context)),
            "proc": recorder.proc,
            "effect": effect,
        }
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
        raise
    finally:
        recorder.ended(execution, error)


@task(id="soak.work", schema=Job, queue=MAIN_QUEUE, retry=RETRY)
def work(payload: Job, context: RunContext) -> dict[str, Any]:
    return _handle(payload, context)


@task(id="soak.bounded", schema=Job, queue=BOUNDED_QUEUE, retry=RETRY)
def bounded(payload: Job, context: RunContext) -> dict[str, Any]:
    return _handle(payload, context)


def build_runtime(settings: Settings, url: str | None = None) -> Runlane:
    """A runtime on the soak's lane; ``url`` overrides the database URL (the proxied worker)."""
    connection = url or settings.url
    lease = timedelta(seconds=settings.lease)
    queues = [
        queue(MAIN_QUEUE, default=True),
        queue(BOUNDED_QUEUE, concurrency_limit=settings.bounded_limit),
    ]
    if settings.lane == "rabbitmq":
        from runlane.rabbitmq import rabbitmq_lane  # noqa: PLC0415 - needs pika

        assert settings.amqp_url is not None
        lane: Any = rabbitmq_lane(
            connection_string=connection,
            schema=settings.schema,
            amqp_url=settings.amqp_url,
            lease_duration=lease,
            connect_timeout=5.0,
            poll_interval=timedelta(milliseconds=500),
            recovery_threshold=timedelta(seconds=10),
            # an outbox item claimed by a publisher that died is taken by another after
            # claim_duration (default 5 min): a worker killed just after its publisher
            # claimed runs it had deferred (a bounded queue at capacity) holds them that long
            claim_duration=timedelta(seconds=20),
        )
    else:
        lane = postgres_polling_lane(
            connection_string=connection,
            schema=settings.schema,
            lease_duration=lease,
            connect_timeout=5.0,
            poll_interval=timedelta(milliseconds=500),
        )
    return create_runlane(lane=lane, queues=queues, tasks=[work, bounded])
