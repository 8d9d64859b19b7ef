"""Helpers shared by several test files: SQL on the test's schema, bounded polling, rows read
back from the database, and threads raced against one another. Helpers that only one file
uses stay in that file."""

from __future__ import annotations

import importlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, LiteralString, TypeVar

import attrs
import pika
import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from runlane import RetryPolicy, RunContext, Runlane, RunSnapshot, RunStatus, Task, task
from runlane.cli import main
from runlane.rabbitmq import ConsumerStats
from runlane.rabbitmq._amqp import queue_name
from runlane.rabbitmq._consumer import RabbitAcquirer
from runlane.storage import Storage
from runlane.worker import Worker

Conn = psycopg.Connection[Any]
T = TypeVar("T")
# ``cli(*argv)``: the exit code, stdout and stderr of ``runlane *argv``
Cli = Callable[..., tuple[int, str, str]]

HOUR_RETRY = RetryPolicy(
    max_attempts=3, initial_delay=timedelta(hours=1), max_delay=timedelta(hours=1), jitter=0.0
)
ONE_ATTEMPT = RetryPolicy(max_attempts=1)


@attrs.frozen
class Greet:
    name: str


def race_keyed_batches(runlane: Runlane, task_id: str, batches: list[list[str]]) -> list[Exception]:
    """Trigger each batch (a ``Greet`` per key, the key its idempotency key) from a thread of
    its own, all released at once; returns what the calls raised."""
    barrier = threading.Barrier(len(batches))
    errors: list[Exception] = []

    def batch(keys: list[str]) -> None:
        barrier.wait(timeout=10)
        try:
            runlane.trigger_many(task_id, [Greet(name=k) for k in keys], idempotency_keys=keys)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=batch, args=(keys,)) for keys in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


# -- the CLI and other processes ------------------------------------------------------------


def job_app(task_id: str) -> str:
    """The source of a ``cliapp`` for importable_app: one task ``task_id`` (two attempts)
    that fails on the payload "retry", fails for good on "fatal" and returns any other."""
    return f"""
import os
from runlane import NonRetryableError, RetryPolicy, create_runlane, task
from runlane.postgres import postgres_polling_lane

@task(id={task_id!r}, retry=RetryPolicy(max_attempts=2))
def job(payload, context):
    if payload == "retry":
        raise ValueError("again")
    if payload == "fatal":
        raise NonRetryableError("no")
    return payload

runlane = create_runlane(
    lane=postgres_polling_lane(
        connection_string=os.environ["APP_DATABASE_URL"], schema=os.environ["APP_SCHEMA"]
    ),
    tasks=[job],
)
"""


def fresh_app_runtime() -> Runlane:
    """The ``cliapp`` runtime of importable_app, from a fresh import (a command closes the
    one it loaded)."""
    sys.modules.pop("cliapp", None)
    runtime: Runlane = importlib.import_module("cliapp").runlane
    return runtime


@contextmanager
def importable_app(
    directory: Path, source: str, database_url: str, schema: str
) -> Iterator[dict[str, str]]:
    """``cliapp:runlane`` (``source``, reading APP_DATABASE_URL and APP_SCHEMA) importable in
    this process, fresh for each import, and in subprocesses given the environment yielded."""
    (directory / "cliapp.py").write_text(source)
    env = {"APP_DATABASE_URL": database_url, "APP_SCHEMA": schema}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.path.insert(0, str(directory))
    try:
        yield {**os.environ, **env, "PYTHONPATH": str(directory)}
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop("cliapp", None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def process(
    argv: list[str], *, cwd: Path, env: Mapping[str, str], stdout: int = subprocess.DEVNULL
) -> Iterator[subprocess.Popen[str]]:
    """``argv`` started in ``cwd`` with the environment ``env`` (``stdout`` as given, stderr
    piped, text); killed at the end if it still runs."""
    with subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


@contextmanager
def cli_process(
    directory: Path,
    source: str,
    database_url: str,
    schema: str,
    *args: str,
    env: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen[str]]:
    """``python -m runlane.cli *args`` in ``directory``, where ``cliapp.py`` is ``source``
    (reading APP_DATABASE_URL and APP_SCHEMA, and ``env`` besides); stdout discarded, stderr
    piped; killed at the end if it still runs."""
    (directory / "cliapp.py").write_text(source)
    app_env = {"APP_DATABASE_URL": database_url, "APP_SCHEMA": schema, **(env or {})}
    with process(
        [sys.executable, "-m", "runlane.cli", *args],
        cwd=directory,
        env={**os.environ, **app_env},
    ) as proc:
        yield proc


@contextmanager
def ready_process(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``python -c script *args`` (stdin and stdout piped, text), once it has printed
    ``ready``; at the end its stdin is closed (its cue to finish) and it is waited for,
    killed after 30 s."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        finish_process(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def finish_process(proc: subprocess.Popen[str]) -> None:
    """Close ``proc``'s stdin (its cue to finish) and wait for it, killing it after 30 s."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def in_process_cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """``cli(*argv)`` runs ``runlane *argv`` through ``runlane.cli.main`` in this process, on a
    fresh import of ``cliapp`` (see ``importable_app``; each command closes the runtime it
    loaded); returns (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        sys.modules.pop("cliapp", None)
        capsys.readouterr()
        code = main(list(argv))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


# -- SQL on the test's schema ------------------------------------------------------------------


def drain_messages(channel: Any, queue: str, count: int) -> list[bytes]:
    """Consume and ack ``count`` messages (fewer if none comes for 5 s)."""
    bodies: list[bytes] = []
    for method, _properties, body in channel.consume(queue, inactivity_timeout=5):
        if method is None:
            break
        bodies.append(body)
        channel.basic_ack(method.delivery_tag)
        if len(bodies) >= count:
            break
    channel.cancel()
    return bodies


def q(query: LiteralString, schema: str) -> sql.Composed:
    """``query`` with ``{s}`` replaced by the quoted schema name."""
    return sql.SQL(query).format(s=sql.Identifier(schema))


class SchemaDb:
    """Set-up and reads on the test's schema through a separate connection; ``{schema}`` in
    a query stands for the quoted schema name. Test files subclass it with their own reads."""

    def __init__(self, conn: Conn, schema: str) -> None:
        self.conn = conn
        self.schema = schema

    def q(self, text: str) -> sql.Composed:
        return sql.SQL(text).format(schema=sql.Identifier(self.schema))

    def all(self, text: str, *params: Any) -> list[tuple[Any, ...]]:
        return self.conn.execute(self.q(text), params).fetchall()

    def one(self, text: str, *params: Any) -> tuple[Any, ...]:
        row: tuple[Any, ...] | None = self.conn.execute(self.q(text), params).fetchone()
        assert row is not None
        return row

    def run(self, text: str, *params: Any) -> int:
        return self.conn.execute(self.q(text), params).rowcount


# -- rows read back --------------------------------------------------------------------------


def run_row(db: Conn, schema: str, run_id: uuid.UUID) -> dict[str, Any]:
    """The run's row plus the database's ``now()`` as ``db_now``."""
    with db.cursor(row_factory=dict_row) as cur:
        cur.execute(q("select *, now() as db_now from {s}.runs where id = %s", schema), (run_id,))
        row = cur.fetchone()
    assert row is not None, f"run {run_id} is not in {schema}.runs"
    return row


def attempt_rows(db: Conn, schema: str, run_id: uuid.UUID) -> list[tuple[int, str]]:
    """``(attempt, outcome)`` of every attempt of the run, in order."""
    rows = db.execute(
        q("select attempt, outcome from {s}.attempts where run_id = %s order by attempt", schema),
        (run_id,),
    ).fetchall()
    return [(int(attempt), str(outcome)) for attempt, outcome in rows]


def statuses(db: Conn, schema: str) -> dict[str, int]:
    """How many runs there are in each status."""
    rows = db.execute(q("select status, count(*) from {s}.runs group by status", schema))
    return {str(status): int(n) for status, n in rows.fetchall()}


def count_runs(db: Conn, schema: str) -> int:
    row = db.execute(q("select count(*) from {s}.runs", schema)).fetchone()
    assert row is not None
    return int(row[0])


def elapse(db: Conn, schema: str, seconds: float, *columns: str) -> None:
    """Let ``seconds`` pass on the database's clock for the stored times named
    ``"table.column"``: each row's value is moved that much into the past, as waiting would
    have done, without the wait (the runtime reads every due time, lease and timeout
    against the database's ``now()``)."""
    for column in columns:
        table, name = column.split(".")
        db.execute(
            sql.SQL("update {}.{} set {} = {} - make_interval(secs => %s)").format(
                sql.Identifier(schema),
                sql.Identifier(table),
                sql.Identifier(name),
                sql.Identifier(name),
            ),
            (seconds,),
        )


def listener_ready(db: Conn, worker: Worker) -> bool:
    """True once the worker's listener backend exists and has run LISTEN."""
    row = db.execute(
        "select count(*) from pg_stat_activity where application_name = %s and query <> ''",
        (f"{worker.name}-listener",),
    ).fetchone()
    return row is not None and int(row[0]) > 0


def handler_key(run_id: uuid.UUID) -> str:
    """The key under which a test's journal counts the handler calls of the run."""
    return f"handler:{run_id}"


# -- bounded waits -----------------------------------------------------------------------------


def poll(predicate: Callable[[], bool], *, timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` passes (False): the one
    wall-clock poll of the suite, for what only the database or another process can answer
    (a row, a backend, a port). What the code can tell is waited for on its signal instead:
    an Event a handler sets, ``Worker.idle_signal``, ``Services.wait_for``, ``wait_for_run``;
    what waits for Postgres time is moved there (``elapse``)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    interval: float = 0.02,
    state: Callable[[], object] | None = None,
) -> None:
    """``poll``, failing the test after ``timeout``; ``state`` describes what was seen
    instead, for the failure message."""
    if not poll(predicate, timeout=timeout, interval=interval):
        seen = "" if state is None else f"; saw {state()!r}"
        pytest.fail(f"timed out after {timeout}s waiting for {what}{seen}")


@contextmanager
def logged(text: str, logger: str = "runlane") -> Iterator[threading.Event]:
    """An Event set once a record whose message holds ``text`` is logged under ``logger``
    (records below the logger's level are never made): waiting on a log line as a signal,
    instead of polling ``caplog``."""
    seen = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                seen.set()

    handler = Seen()
    target = logging.getLogger(logger)
    target.addHandler(handler)
    try:
        yield seen
    finally:
        target.removeHandler(handler)


def wait_for_status(
    rl: Runlane, run_id: uuid.UUID, wanted: RunStatus, *, timeout: float = 10.0
) -> RunSnapshot:
    """Wait until the run is ``wanted``; returns the snapshot then. A terminal status is
    waited for on the run's end announcement (``wait_for_run``), others by polling
    ``get_run``, as is a run that ended otherwise (it may be moved on)."""
    if wanted.is_terminal:
        began = time.monotonic()
        try:
            snapshot = rl.wait_for_run(run_id, timeout=timeout)
        except TimeoutError:
            pytest.fail(f"timed out after {timeout}s waiting for run {run_id} to be {wanted}")
        if snapshot.status is wanted:
            return snapshot
        timeout = max(0.0, timeout - (time.monotonic() - began))
    wait_until(
        lambda: rl.get_run(run_id).status is wanted,
        timeout=timeout,
        what=f"run {run_id} to be {wanted}",
    )
    return rl.get_run(run_id)


# -- races between real threads ------------------------------------------------------------------


def run_together(
    jobs: list[Callable[[], T]], timeout: float = 30.0, *, join_timeout: float | None = None
) -> list[T]:
    """Run each job in its own thread, released at once by a barrier; re-raise any error.

    Each thread gets ``timeout`` seconds to reach the barrier and ``join_timeout`` (by
    default ``timeout``) to finish; returns the jobs' results in order."""
    barrier = threading.Barrier(len(jobs))
    results: dict[int, T] = {}
    errors: list[BaseException] = []
    finish = timeout if join_timeout is None else join_timeout

    def runner(index: int, job: Callable[[], T]) -> None:
        try:
            barrier.wait(timeout=timeout)
            results[index] = job()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=runner, args=(i, job), name=f"racer-{i}")
        for i, job in enumerate(jobs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(finish)
        assert not thread.is_alive(), f"{thread.name} did not finish within {finish}s"
    if errors:
        raise errors[0]
    return [results[i] for i in range(len(jobs))]


def storage_of(rl: Runlane) -> Storage:
    """The runtime's storage: an internal, reached by tests that drive storage directly."""
    return rl._life.storage


# -- the RabbitMQ lane -------------------------------------------------------------------------


class Executions:
    """Handler executions counted per run and per ``(run id, attempt)``, from any thread; the
    start time of each run's first execution (``time.monotonic()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.attempts: Counter[tuple[uuid.UUID, int]] = Counter()
        self.runs: Counter[uuid.UUID] = Counter()
        self.started: dict[uuid.UUID, float] = {}

    def add(self, context: RunContext) -> None:
        with self._lock:
            self.attempts[(context.run_id, context.attempt)] += 1
            self.runs[context.run_id] += 1
            self.started.setdefault(context.run_id, time.monotonic())

    def more_than_once(self) -> dict[uuid.UUID, int]:
        with self._lock:
            return {run_id: n for run_id, n in self.runs.items() if n != 1}

    def task(self, task_id: str, **options: Any) -> Task[Any, Any]:
        """A task (``task(id=task_id, **options)``) whose handler records each execution
        here and returns its payload."""

        @task(id=task_id, **options)
        def recorded(payload: Any, context: RunContext) -> Any:
            self.add(context)
            return payload

        return recorded


def consumer_stats(worker: Worker) -> ConsumerStats:
    """The RabbitMQ consumer's delivery counters of a worker on the RabbitMQ lane."""
    acquirer = worker.acquirer
    assert isinstance(acquirer, RabbitAcquirer), f"{worker.name} is not on the RabbitMQ lane"
    return acquirer.stats


def consumer_ready(worker: Worker, timeout: float = 15.0) -> None:
    """Block until the worker's consumer is consuming and its cancel listener is connected."""
    acquirer = worker.acquirer
    assert isinstance(acquirer, RabbitAcquirer)
    deadline = time.monotonic() + timeout
    if not acquirer.consuming.wait(timeout) or not acquirer.listener.connected.wait(
        max(0.0, deadline - time.monotonic())
    ):
        pytest.fail(f"{worker.name}: its consumer was not ready within {timeout}s")


def amqp_queue(schema: str, queue: str = "default", environment: str = "default") -> str:
    """The AMQP queue the RabbitMQ lane declares for a logical queue."""
    return queue_name(schema, environment, queue)


def ready_messages(amqp_url: str, name: str) -> int:
    """Messages ready in the AMQP queue ``name`` (not counting those delivered, unacked)."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        frame = conn.channel().queue_declare(queue=name, passive=True)
        return int(frame.method.message_count)
    finally:
        conn.close()


def publish_by_hand(amqp_url: str, name: str, *bodies: bytes) -> None:
    """Publish ``bodies`` to the AMQP queue ``name`` with confirms, as another program might."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        for body in bodies:
            channel.basic_publish(
                exchange="",
                routing_key=name,
                body=body,
                properties=pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent),
                mandatory=True,
            )
    finally:
        conn.close()


def outbox_count(db: Conn, schema: str) -> int:
    row = db.execute(q("select count(*) from {s}.outbox", schema)).fetchone()
    assert row is not None
    return int(row[0])


def closed_port() -> int:
    """A loopback TCP port nothing listens on (a broker that is down)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
