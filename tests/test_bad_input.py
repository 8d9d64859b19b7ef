"""The bad input table: what a hostile or careless caller may pass to the public API and the
CLI, each answered by a runlane error that says what to do, with nothing written.

One runtime on one migrated schema serves the whole table (a queued run and a pending wait
token are there from the start); each case counts the rows of every table of the schema
before and after. docs/bad-input.md lists the same cases with their messages.
"""

from __future__ import annotations

import contextlib
import math
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from runlane import (
    ConfigurationError,
    MaintenanceLimits,
    PayloadValidationError,
    RateLimit,
    RetentionPolicy,
    RetryPolicy,
    RunContext,
    Runlane,
    RunlaneError,
    RunNotFound,
    RunStateConflict,
    RunStatus,
    TaskNotFound,
    WaitTokenNotFound,
    create_runlane,
    queue,
    schedule,
    task,
)
from runlane._limits import (
    MAX_CLAIM_BATCH,
    MAX_CONNECT_TIMEOUT,
    MAX_LEASE,
    MAX_POLL_INTERVAL,
    MAX_POOL_SIZE,
)
from runlane.cli import EXIT_CONFIGURATION, EXIT_FAILURE, main
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.rabbitmq import rabbitmq_lane
from runlane.toolkit import INT32_MAX, MAX_DURATION
from tests.conftest import RunlaneFactory


@attrs.frozen
class Order:
    sku: str
    quantity: int


@attrs.frozen
class Refund:
    sku: str


@task(id="bad.order", schema=Order)
def order(payload: Order, context: RunContext) -> None:
    return None


@task(id="bad.free")
def free(payload: Any, context: RunContext) -> None:
    return None


@task(id="bad.order", schema=Order)
def order_lookalike(payload: Order, context: RunContext) -> None:
    """Same id as ``order``, but not the task the runtime registered."""


APP = textwrap.dedent(
    """
    import os
    import attrs
    from runlane import RunContext, create_runlane, task
    from runlane.postgres import postgres_polling_lane

    @attrs.frozen
    class Order:
        sku: str
        quantity: int

    @task(id="bad.order", schema=Order)
    def order(payload, context: RunContext):
        return None

    @task(id="bad.free")
    def free(payload, context: RunContext):
        return None

    runlane = create_runlane(
        lane=postgres_polling_lane(
            connection_string=os.environ["BAD_APP_DATABASE_URL"],
            schema=os.environ["BAD_APP_SCHEMA"],
        ),
        tasks=[order, free],
    )
    not_a_runtime = 42
    """
)
APP_SPEC = "badinput_app:runlane"


@attrs.frozen
class Env:
    rl: Runlane
    url: str
    schema: str
    queued_run: uuid.UUID
    token: uuid.UUID


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def _circular() -> dict[str, Any]:
    value: dict[str, Any] = {}
    value["self"] = value
    return value


def _runtime(url: str, **options: Any) -> Runlane:
    return create_runlane(
        lane=postgres_polling_lane(connection_string=url, schema="unused_schema"), **options
    )


def _generator_middleware(context: Any) -> Iterator[None]:
    yield  # not decorated with @contextlib.contextmanager


def _lane(url: str, **options: Any) -> Any:
    return postgres_polling_lane(connection_string=url, schema="unused_schema", **options)


def _huge_limit(name: str) -> Callable[[Env], object]:
    return lambda e: MaintenanceLimits(**{name: 10**20})


def _every_schedule(**options: Any) -> Any:
    return schedule(id="bad.schedule", task=free, cron="* * * * *", **options)


Call = Callable[[Env], object]


@attrs.frozen
class Case:
    id: str
    call: Call | None  # an API call that must raise ``error``
    argv: tuple[str, ...] | None  # or a CLI command that must exit with ``error``
    error: type[RunlaneError] | int
    needle: str  # in the message: names the problem or what to do

    @property
    def param(self) -> Any:
        return pytest.param(self, id=self.id)


def api(id: str, call: Call, error: type[RunlaneError], needle: str) -> Case:
    return Case(id, call, None, error, needle)


def cli(id: str, argv: tuple[str, ...], code: int, needle: str) -> Case:
    return Case(id, None, argv, code, needle)


BIG = "x" * 1_048_576  # 1,048,578 bytes as JSON (quotes): over the default limit
NOW = datetime.now(UTC)

CASES: list[Case] = [
    # -- payload shapes and types ----------------------------------------------------------
    api(
        "payload-list-for-object",
        lambda e: e.rl.trigger(order, [1, 2]),
        PayloadValidationError,
        "expected an object with the fields of Order, got a list",
    ),
    api(
        "payload-none-for-object",
        lambda e: e.rl.trigger(order, None),
        PayloadValidationError,
        "got null",
    ),
    api(
        "payload-missing-field",
        lambda e: e.rl.trigger(order, {"sku": "a"}),
        PayloadValidationError,
        "payload.quantity",
    ),
    api(
        "payload-unknown-field",
        lambda e: e.rl.trigger(order, {"sku": "a", "quantity": 1, "qty": 2}),
        PayloadValidationError,
        "qty",
    ),
    api(
        "payload-str-for-int",
        lambda e: e.rl.trigger(order, {"sku": "a", "quantity": "2"}),
        PayloadValidationError,
        "expected int @ payload.quantity",
    ),
    api(
        "payload-bool-for-int",
        lambda e: e.rl.trigger(order, {"sku": "a", "quantity": True}),
        PayloadValidationError,
        "expected int @ payload.quantity",
    ),
    api(
        "payload-int-for-str",
        lambda e: e.rl.trigger(order, {"sku": 5, "quantity": 1}),
        PayloadValidationError,
        "expected str @ payload.sku",
    ),
    api(
        "payload-other-schema-instance",
        lambda e: e.rl.trigger(order, Refund("a")),
        PayloadValidationError,
        "payload is a Refund, but the task expects Order",
    ),
    api(
        "payload-instance-with-wrong-field-type",
        lambda e: e.rl.trigger(order, Order("a", "many")),  # type: ignore[arg-type]
        PayloadValidationError,
        "payload.quantity",
    ),
    api(
        "payload-nul-in-field",
        lambda e: e.rl.trigger(order, {"sku": "a\x00b", "quantity": 1}),
        PayloadValidationError,
        "cannot contain the NUL character",
    ),
    api(
        "payload-nul-in-value",
        lambda e: e.rl.trigger(free, {"note": "\x00"}),
        PayloadValidationError,
        "cannot contain the NUL character",
    ),
    api(
        "payload-nul-in-key",
        lambda e: e.rl.trigger(free, {"a\x00": 1}),
        PayloadValidationError,
        "cannot contain the NUL character",
    ),
    api(
        "payload-lone-surrogate-in-field",
        lambda e: e.rl.trigger(order, {"sku": "\ud800", "quantity": 1}),
        PayloadValidationError,
        "lone surrogate",
    ),
    api(
        "payload-lone-surrogate-in-key",
        lambda e: e.rl.trigger(free, {"\udfff": 1}),
        PayloadValidationError,
        "lone surrogate",
    ),
    api(
        "payload-nan",
        lambda e: e.rl.trigger(free, {"ratio": math.nan}),
        PayloadValidationError,
        "NaN and infinite floats cannot be stored as JSON",
    ),
    api(
        "payload-infinity",
        lambda e: e.rl.trigger(free, [math.inf]),
        PayloadValidationError,
        "NaN and infinite floats cannot be stored as JSON",
    ),
    api(
        "payload-int-key",
        lambda e: e.rl.trigger(free, {1: "one"}),
        PayloadValidationError,
        "object keys must be strings",
    ),
    api(
        "payload-none-key",
        lambda e: e.rl.trigger(free, {"a": {None: 1}}),
        PayloadValidationError,
        "object keys must be strings",
    ),
    api(
        "payload-set",
        lambda e: e.rl.trigger(free, {1, 2}),
        PayloadValidationError,
        "not JSON serializable",
    ),
    api(
        "payload-bytes",
        lambda e: e.rl.trigger(free, b"raw"),
        PayloadValidationError,
        "not JSON serializable",
    ),
    api(
        "payload-object",
        lambda e: e.rl.trigger(free, object()),
        PayloadValidationError,
        "not JSON serializable",
    ),
    api(
        "payload-nested-too-deep",
        lambda e: e.rl.trigger(free, _nested(500)),
        PayloadValidationError,
        "nested more than 100 levels deep",
    ),
    api(
        "payload-contains-itself",
        lambda e: e.rl.trigger(free, _circular()),
        PayloadValidationError,
        "contains itself",
    ),
    api(
        "payload-huge-integer",
        lambda e: e.rl.trigger(free, 10**5000),
        PayloadValidationError,
        "send such a number as a string",
    ),
    api(
        "payload-oversized",
        lambda e: e.rl.trigger(free, BIG),
        PayloadValidationError,
        "over the limit of 1,048,576 bytes (max_payload_bytes)",
    ),
    api(
        "payload-oversized-multibyte",
        lambda e: e.rl.trigger(order, {"sku": "é" * 600_000, "quantity": 1}),
        PayloadValidationError,
        "max_payload_bytes",
    ),
    # -- trigger_many ----------------------------------------------------------------------
    api(
        "many-one-bad-item",
        lambda e: e.rl.trigger_many(order, [{"sku": "a", "quantity": 1}] * 2 + [{"sku": "b"}]),
        PayloadValidationError,
        "payloads[2] (nothing was written)",
    ),
    api(
        "many-one-oversized-item",
        lambda e: e.rl.trigger_many(free, [{}, BIG, {}]),
        PayloadValidationError,
        "payloads[1] (nothing was written): payload is 1,048,578 bytes",
    ),
    api(
        "many-a-string",
        lambda e: e.rl.trigger_many(free, "abc"),
        ConfigurationError,
        "trigger_many takes a list of payloads, got str",
    ),
    api(
        "many-a-mapping",
        lambda e: e.rl.trigger_many(free, {"a": 1}),
        ConfigurationError,
        "trigger_many takes a list of payloads, got dict",
    ),
    api(
        "many-none",
        lambda e: e.rl.trigger_many(free, None),  # type: ignore[arg-type]
        ConfigurationError,
        "trigger_many takes a list of payloads, got NoneType",
    ),
    api(
        "many-keys-count",
        lambda e: e.rl.trigger_many(free, [{}, {}], idempotency_keys=["k"]),
        ConfigurationError,
        "give one per payload",
    ),
    api(
        "many-keys-a-string",
        lambda e: e.rl.trigger_many(free, [{}], idempotency_keys="k"),
        ConfigurationError,
        "got a single string",
    ),
    # -- tasks and queues ------------------------------------------------------------------
    api(
        "unknown-task-id",
        lambda e: e.rl.trigger("bad.nope", {}),
        TaskNotFound,
        "pass it in create_runlane(tasks=[...])",
    ),
    api(
        "task-id-not-a-string",
        lambda e: e.rl.trigger(42, {}),  # type: ignore[arg-type]
        TaskNotFound,
        "is not registered with this runtime",
    ),
    api(
        "task-id-with-nul",
        lambda e: e.rl.trigger("bad.order\x00", {}),
        TaskNotFound,
        "is not registered with this runtime",
    ),
    api(
        "unregistered-task-object",
        lambda e: e.rl.trigger(order_lookalike, {"sku": "a", "quantity": 1}),
        TaskNotFound,
        "is not registered with this runtime",
    ),
    api(
        "unknown-queue",
        lambda e: e.rl.trigger(free, {}, queue="bad.nope"),
        ConfigurationError,
        "pass queue('bad.nope') in create_runlane(queues=[...])",
    ),
    api(
        "concurrency-key-without-key-limit",
        lambda e: e.rl.trigger(free, {}, concurrency_key="customer-1"),
        ConfigurationError,
        "which has no key_concurrency_limit: define the queue with queue(...",
    ),
    api(
        "concurrency-key-over-200-bytes",
        lambda e: e.rl.trigger_many(free, [{}, {}], concurrency_key="é" * 101),
        ConfigurationError,
        "concurrency_key must be at most 200 bytes in UTF-8, got 202 bytes",
    ),
    api(
        "concurrency-key-with-nul",
        lambda e: e.rl.trigger(free, {}, concurrency_key="a\x00b"),
        ConfigurationError,
        "concurrency_key must not contain the NUL character",
    ),
    api(
        "concurrency-key-empty",
        lambda e: e.rl.trigger(free, {}, concurrency_key=""),
        ConfigurationError,
        "concurrency_key must be a non-empty string or None",
    ),
    api(
        "queue-not-a-string",
        lambda e: e.rl.trigger(free, {}, queue=["default"]),  # type: ignore[arg-type]
        ConfigurationError,
        "queue must be a queue name (a string) or None",
    ),
    # -- priorities, attempts, delays, due times -------------------------------------------
    api(
        "priority-overflows-int32",
        lambda e: e.rl.trigger(free, {}, priority=2**31),
        ConfigurationError,
        "priority must be an integer from -2147483648 to 2147483647",
    ),
    api(
        "priority-underflows-int32",
        lambda e: e.rl.trigger(free, {}, priority=-(2**31) - 1),
        ConfigurationError,
        "priority must be an integer from -2147483648 to 2147483647",
    ),
    api(
        "priority-float",
        lambda e: e.rl.trigger(free, {}, priority=1.5),  # type: ignore[arg-type]
        ConfigurationError,
        "priority must be an integer",
    ),
    api(
        "priority-bool",
        lambda e: e.rl.trigger(free, {}, priority=True),
        ConfigurationError,
        "priority must be an integer",
    ),
    api(
        "max-attempts-zero",
        lambda e: e.rl.trigger(free, {}, max_attempts=0),
        ConfigurationError,
        "max_attempts must be an integer from 1 to 2147483647",
    ),
    api(
        "max-attempts-overflows-int32",
        lambda e: e.rl.trigger(free, {}, max_attempts=2**31),
        ConfigurationError,
        "max_attempts must be an integer from 1 to 2147483647",
    ),
    api(
        "max-attempts-string",
        lambda e: e.rl.trigger(free, {}, max_attempts="3"),  # type: ignore[arg-type]
        ConfigurationError,
        "max_attempts must be an integer",
    ),
    api(
        "delay-negative",
        lambda e: e.rl.trigger(free, {}, delay=-5),
        ConfigurationError,
        "delay must not be negative, got -5 seconds",
    ),
    api(
        "delay-nan",
        lambda e: e.rl.trigger(free, {}, delay=math.nan),
        ConfigurationError,
        "delay must be a finite number of seconds",
    ),
    api(
        "delay-infinite",
        lambda e: e.rl.trigger(free, {}, delay=math.inf),
        ConfigurationError,
        "delay must be a finite number of seconds",
    ),
    api(
        "delay-over-a-century",
        lambda e: e.rl.trigger(free, {}, delay=1e12),
        ConfigurationError,
        "delay must be at most 100 years",
    ),
    api(
        "delay-overflows-interval",
        lambda e: e.rl.trigger(free, {}, delay=timedelta(days=999_999_999)),
        ConfigurationError,
        "delay must be at most 100 years",
    ),
    api(
        "delay-string",
        lambda e: e.rl.trigger(free, {}, delay="5"),  # type: ignore[arg-type]
        ConfigurationError,
        "delay must be a timedelta or a number of seconds",
    ),
    api(
        "run-at-naive",
        lambda e: e.rl.trigger(free, {}, run_at=datetime.now()),  # naive: the point
        ConfigurationError,
        "run_at must be a timezone-aware datetime",
    ),
    api(
        "run-at-string",
        lambda e: e.rl.trigger(free, {}, run_at="2030-01-01T00:00:00Z"),  # type: ignore[arg-type]
        ConfigurationError,
        "run_at must be a timezone-aware datetime",
    ),
    api(
        "run-at-year-9999",
        lambda e: e.rl.trigger(free, {}, run_at=datetime(9999, 12, 31, tzinfo=UTC)),
        ConfigurationError,
        "run_at must be from 1970 to 100 years from now",
    ),
    api(
        "run-at-year-1",
        lambda e: e.rl.trigger(free, {}, run_at=datetime(1, 1, 2, tzinfo=UTC)),
        ConfigurationError,
        "run_at must be from 1970 to 100 years from now",
    ),
    api(
        "run-at-and-delay",
        lambda e: e.rl.trigger(free, {}, delay=1, run_at=NOW),
        ConfigurationError,
        "pass either delay or run_at, not both",
    ),
    # -- idempotency keys and connections --------------------------------------------------
    api(
        "idempotency-key-int",
        lambda e: e.rl.trigger(free, {}, idempotency_key=7),  # type: ignore[arg-type]
        ConfigurationError,
        "idempotency_key must be a non-empty string of at most 1000 characters, got 7",
    ),
    api(
        "idempotency-key-empty",
        lambda e: e.rl.trigger(free, {}, idempotency_key=""),
        ConfigurationError,
        "idempotency_key must be a non-empty string",
    ),
    api(
        "idempotency-key-too-long",
        lambda e: e.rl.trigger(free, {}, idempotency_key="k" * 1001),
        ConfigurationError,
        "got a string of 1,001 characters",
    ),
    api(
        # 1,000 characters, 4,000 bytes (not compressible): more than its index row holds
        "idempotency-key-too-many-bytes",
        lambda e: e.rl.trigger(
            free, {}, idempotency_key="".join(chr(0x10000 + i * 37) for i in range(1000))
        ),
        ConfigurationError,
        "at most 2,000 bytes in UTF-8",
    ),
    api(
        "idempotency-key-nul",
        lambda e: e.rl.trigger(free, {}, idempotency_key="order\x00"),
        ConfigurationError,
        "idempotency_key must not contain the NUL character",
    ),
    api(
        "idempotency-key-lone-surrogate",
        lambda e: e.rl.trigger(free, {}, idempotency_key="order\ud800"),
        ConfigurationError,
        "a lone surrogate",
    ),
    api(
        "connection-not-psycopg",
        lambda e: e.rl.trigger(free, {}, connection="postgresql://x"),
        ConfigurationError,
        "connection= takes a psycopg.Connection, got str",
    ),
    # -- run ids ---------------------------------------------------------------------------
    api(
        "run-id-malformed",
        lambda e: e.rl.get_run("not-a-uuid"),
        RunNotFound,
        "'not-a-uuid' is not a run id (a UUID)",
    ),
    api(
        "run-id-none",
        lambda e: e.rl.cancel(None),  # type: ignore[arg-type]
        RunNotFound,
        "None is not a run id (a UUID)",
    ),
    api(
        "run-id-unknown",
        lambda e: e.rl.get_run(uuid.UUID(int=1)),
        RunNotFound,
        "it was never triggered here",
    ),
    api(
        "cancel-unknown-run",
        lambda e: e.rl.cancel(uuid.UUID(int=1)),
        RunNotFound,
        "no run 00000000-0000-0000-0000-000000000001",
    ),
    api(
        "reschedule-unknown-run",
        lambda e: e.rl.reschedule_run(uuid.UUID(int=1), run_at=None),
        RunNotFound,
        "no run 00000000-0000-0000-0000-000000000001",
    ),
    api(
        "reschedule-naive-run-at",
        lambda e: e.rl.reschedule_run(e.queued_run, run_at=datetime(2030, 1, 1)),
        ConfigurationError,
        "run_at must be a timezone-aware datetime",
    ),
    api(
        "reschedule-absurd-run-at",
        lambda e: e.rl.reschedule_run(e.queued_run, run_at=datetime(3000, 1, 1, tzinfo=UTC)),
        ConfigurationError,
        "run_at must be from 1970 to 100 years from now",
    ),
    api(
        "delete-live-run",
        lambda e: e.rl.delete_run(e.queued_run),
        RunStateConflict,
        "only a completed, failed or cancelled run can be deleted; cancel it first",
    ),
    api(
        "action-reason-too-long",
        lambda e: e.rl.cancel(e.queued_run, reason="x" * 501),
        ConfigurationError,
        "reason",
    ),
    api(
        "audit-foreign-cursor",
        lambda e: e.rl.list_audit(cursor="not-a-cursor"),
        ConfigurationError,
        "is not one list_audit gave",
    ),
    api(
        "retry-unknown-run",
        lambda e: e.rl.retry_run(uuid.UUID(int=1)),
        RunNotFound,
        "no run 00000000-0000-0000-0000-000000000001",
    ),
    api(
        "retry-queued-run",
        lambda e: e.rl.retry_run(e.queued_run),
        RunStateConflict,
        "is queued",
    ),
    api(
        "history-malformed-run-id",
        lambda e: e.rl.get_run_history("42"),
        RunNotFound,
        "'42' is not a run id (a UUID)",
    ),
    api(
        "wait-for-run-negative-timeout",
        lambda e: e.rl.wait_for_run(e.queued_run, timeout=-1),
        ConfigurationError,
        "timeout must not be negative",
    ),
    # -- wait tokens -----------------------------------------------------------------------
    api(
        "token-id-malformed",
        lambda e: e.rl.get_wait_token("zzz"),
        WaitTokenNotFound,
        "'zzz' is not a wait token id (a UUID)",
    ),
    api(
        "token-id-unknown",
        lambda e: e.rl.complete_wait_token(uuid.UUID(int=2), {"ok": True}),
        WaitTokenNotFound,
        "no wait token 00000000-0000-0000-0000-000000000002",
    ),
    api(
        "token-output-nan",
        lambda e: e.rl.complete_wait_token(e.token, {"ratio": math.nan}),
        ConfigurationError,
        "the wait token's output (a dict) cannot be stored as JSON",
    ),
    api(
        "token-output-oversized",
        lambda e: e.rl.complete_wait_token(e.token, BIG),
        ConfigurationError,
        "over the limit of 1,048,576 bytes (max_output_bytes)",
    ),
    api(
        "token-timeout-negative",
        lambda e: e.rl.create_wait_token(timeout=-5),
        ConfigurationError,
        "timeout must not be negative",
    ),
    api(
        "token-timeout-over-a-century",
        lambda e: e.rl.create_wait_token(timeout=1e12),
        ConfigurationError,
        "timeout must be at most 100 years",
    ),
    api(
        "token-idempotency-key-nul",
        lambda e: e.rl.create_wait_token(idempotency_key="\x00"),
        ConfigurationError,
        "must not contain the NUL character",
    ),
    api(
        "token-idempotency-key-too-long",
        lambda e: e.rl.create_wait_token(idempotency_key="k" * 100_000),
        ConfigurationError,
        "at most 1000 characters",
    ),
    # -- listing ---------------------------------------------------------------------------
    api(
        "list-unknown-status",
        lambda e: e.rl.list_runs(status="done"),
        ConfigurationError,
        "is not a run status; use one of",
    ),
    api(
        "list-limit-zero",
        lambda e: e.rl.list_runs(limit=0),
        ConfigurationError,
        "limit must be an integer from 1 to 1000",
    ),
    api(
        "list-forged-cursor",
        lambda e: e.rl.list_runs(cursor="' or 1=1 --"),
        ConfigurationError,
        "pass the next_cursor of a RunPage",
    ),
    api(
        "list-task-with-nul",
        lambda e: e.rl.list_runs(task="bad.order\x00"),
        ConfigurationError,
        "task must not contain the NUL character",
    ),
    # -- stats (the rollup over time) ---------------------------------------------------
    api(
        "stats-since-after-until",
        lambda e: e.rl.stats(
            since=datetime(2026, 1, 2, tzinfo=UTC), until=datetime(2026, 1, 1, tzinfo=UTC)
        ),
        ConfigurationError,
        "must be before until",
    ),
    api(
        "stats-unknown-bucket",
        lambda e: e.rl.stats(bucket="2m"),
        ConfigurationError,
        "bucket must be one of 1m, 5m, 15m, 1h, 6h, 1d",
    ),
    api(
        "stats-naive-since",
        lambda e: e.rl.stats(since=datetime(2026, 1, 1)),
        ConfigurationError,
        "since must be a timezone-aware datetime",
    ),
    api(
        "stats-too-many-buckets",
        lambda e: e.rl.stats(since=datetime(2000, 1, 1, tzinfo=UTC), bucket="1m"),
        ConfigurationError,
        "at most 10080: pick a larger bucket or a shorter window",
    ),
    # -- definitions -----------------------------------------------------------------------
    api(
        "cron-never-fires",
        lambda e: schedule(id="bad.feb30", task=free, cron="0 0 30 2 *"),
        ConfigurationError,
        "'0 0 30 2 *' never fires",
    ),
    api(
        "cron-malformed",
        lambda e: schedule(id="bad.cron", task=free, cron="61 * * * *"),
        ConfigurationError,
        "is not a valid cron expression (five fields",
    ),
    api(
        "cron-words",
        lambda e: schedule(id="bad.cron", task=free, cron="every day at noon"),
        ConfigurationError,
        "is not a valid cron expression",
    ),
    api(
        "schedule-unknown-timezone",
        lambda e: _every_schedule(timezone="Mars/Olympus"),
        ConfigurationError,
        "use an IANA name such as 'UTC'",
    ),
    api(
        "schedule-priority-overflows-int32",
        lambda e: _every_schedule(priority=2**40),
        ConfigurationError,
        "priority must be an integer from -2147483648 to 2147483647",
    ),
    api(
        "schedule-queue-not-a-string",
        lambda e: _every_schedule(queue=7),
        ConfigurationError,
        "queue must be a queue name (a string) or None",
    ),
    api(
        "schedule-payload-invalid",
        lambda e: _runtime(
            e.url,
            tasks=[order],
            schedules=[schedule(id="s", task=order, cron="* * * * *", payload={"sku": 1})],
        ),
        ConfigurationError,
        "schedule 's': invalid payload for task 'bad.order'",
    ),
    api(
        "schedule-unregistered-task",
        lambda e: _runtime(e.url, schedules=[_every_schedule()]),
        ConfigurationError,
        "add it to create_runlane(tasks=[...])",
    ),
    api(
        "schema-name-injection",
        lambda e: postgres_polling_lane(connection_string=e.url, schema='x"; drop table runs; --'),
        ConfigurationError,
        "use 1-63 lowercase letters, digits and underscores",
    ),
    api(
        "migrate-schema-name-injection",
        lambda e: apply_postgres_storage_migrations(
            connection_string=e.url, schema=f"{e.schema}; drop schema {e.schema} cascade"
        ),
        ConfigurationError,
        "use 1-63 lowercase letters, digits and underscores",
    ),
    api(
        "schema-name-reserved",
        lambda e: postgres_polling_lane(connection_string=e.url, schema="pg_catalog"),
        ConfigurationError,
        "is reserved by PostgreSQL",
    ),
    api(
        "connection-string-mysql-scheme",
        lambda e: postgres_polling_lane(connection_string="mysql://app:secret@db/app"),
        ConfigurationError,
        "pass a URI such as postgresql://user@host:5432/dbname",
    ),
    api(
        "connection-string-http-scheme",
        lambda e: apply_postgres_storage_migrations(connection_string="http://db:5432/app"),
        ConfigurationError,
        "pass a URI such as postgresql://user@host:5432/dbname",
    ),
    api(
        "connection-string-not-a-string",
        lambda e: postgres_polling_lane(connection_string=b"postgresql://db/app"),  # type: ignore[arg-type]
        ConfigurationError,
        "needs a connection_string",
    ),
    api(
        "environment-with-nul",
        lambda e: _runtime(e.url, environment="prod\x00"),
        ConfigurationError,
        "use 1-200 characters from letters, digits",
    ),
    api(
        "middleware-not-callable",
        lambda e: _runtime(e.url, middleware=["sentry"]),
        ConfigurationError,
        "middleware[0] must be callable, got 'sentry'",
    ),
    api(
        "middleware-a-context-manager",
        lambda e: _runtime(e.url, middleware=[contextlib.nullcontext()]),
        ConfigurationError,
        "a new one is needed for every attempt",
    ),
    api(
        "middleware-takes-no-context",
        lambda e: _runtime(e.url, middleware=[contextlib.ExitStack]),
        ConfigurationError,
        "cannot be called with one argument (the RunContext)",
    ),
    api(
        "middleware-a-generator-function",
        lambda e: _runtime(e.url, middleware=[_generator_middleware]),
        ConfigurationError,
        "decorate it with @contextlib.contextmanager",
    ),
    api(
        "max-payload-bytes-zero",
        lambda e: _runtime(e.url, max_payload_bytes=0),
        ConfigurationError,
        "max_payload_bytes must be an integer from 1 to 67108864, got 0 (a number of bytes",
    ),
    api(
        "max-output-bytes-bool",
        lambda e: _runtime(e.url, max_output_bytes=True),
        ConfigurationError,
        "max_output_bytes must be an integer from 1 to 67108864, got True (a number of bytes",
    ),
    api(
        "max-output-bytes-over-64-mib",
        lambda e: _runtime(e.url, max_output_bytes=2**30),
        ConfigurationError,
        "store larger values elsewhere and pass a reference",
    ),
    api(
        "task-definition-id-with-nul",
        lambda e: task(id="bad\x00")(free.fn),
        ConfigurationError,
        "task id 'bad\\x00' is not valid",
    ),
    api(
        "queue-name-lone-surrogate",
        lambda e: queue("mail\ud800"),
        ConfigurationError,
        "use 1-200 characters from letters, digits",
    ),
    api(
        "queue-limit-zero",
        lambda e: queue("mail", concurrency_limit=0),
        ConfigurationError,
        "queue 'mail': concurrency_limit must be an integer from 1 to 2147483647 or None, got 0",
    ),
    api(
        "rate-limit-count-zero",
        lambda e: RateLimit(0, 1),
        ConfigurationError,
        "RateLimit count must be an integer from 1 to 2147483647",
    ),
    api(
        "rate-limit-per-zero",
        lambda e: RateLimit(10, 0),
        ConfigurationError,
        "RateLimit per must be a positive period of at most a day",
    ),
    api(
        "rate-limit-per-over-a-day",
        lambda e: RateLimit(10, timedelta(days=2)),
        ConfigurationError,
        "RateLimit per must be from 1 millisecond to 1 day",
    ),
    api(
        "rate-limit-finer-than-a-microsecond",
        lambda e: RateLimit(2_000, timedelta(milliseconds=1)),
        ConfigurationError,
        "more than one start a microsecond",
    ),
    api(
        "rate-limit-burst-over-count",
        lambda e: RateLimit(10, 1, burst=11),
        ConfigurationError,
        "RateLimit burst must be an integer from 0 to 10",
    ),
    api(
        "queue-rate-limit-not-a-rate-limit",
        lambda e: queue("mail", rate_limit=100),  # type: ignore[arg-type]
        ConfigurationError,
        "rate_limit must be a runlane.RateLimit or None",
    ),
    api(
        "queue-key-limit-zero",
        lambda e: queue("mail", key_concurrency_limit=0),
        ConfigurationError,
        "key_concurrency_limit must be an integer from 1 to 2147483647",
    ),
    api(
        "queue-limit-over-int32",
        lambda e: queue("mail", concurrency_limit=2**31),
        ConfigurationError,
        "concurrency_limit must be an integer from 1 to 2147483647 or None, got 2147483648",
    ),
    api(
        "retry-max-attempts-zero",
        lambda e: RetryPolicy(max_attempts=0),
        ConfigurationError,
        "max_attempts",
    ),
    # -- durations, counts and limits: each bounded where it is given (issue 26) ----------
    api(
        "retry-max-attempts-over-int32",
        lambda e: RetryPolicy(max_attempts=10**10),
        ConfigurationError,
        "RetryPolicy.max_attempts must be an integer from 1 to 2147483647, got 10000000000",
    ),
    api(
        "task-retry-max-attempts-over-int32",
        lambda e: task(id="bad.retrying", retry=RetryPolicy(max_attempts=2**31))(free.fn),
        ConfigurationError,
        "RetryPolicy.max_attempts must be an integer from 1 to 2147483647",
    ),
    api(
        "retry-max-attempts-huge-integer",
        lambda e: RetryPolicy(max_attempts=10**5000),
        ConfigurationError,
        "got an integer of",
    ),
    api(
        "lane-lease-duration-max",
        lambda e: _lane(e.url, lease_duration=timedelta.max),
        ConfigurationError,
        "lease_duration must be a timedelta from 1 second to 1 day",
    ),
    api(
        "lane-lease-duration-half-a-second",
        lambda e: _lane(e.url, lease_duration=timedelta(milliseconds=500)),
        ConfigurationError,
        "lease_duration must be a timedelta from 1 second to 1 day, got 0.5 seconds",
    ),
    api(
        "lane-poll-interval-max",
        lambda e: _lane(e.url, poll_interval=timedelta.max),
        ConfigurationError,
        "poll_interval must be a timedelta from 0.001 seconds to 1 day",
    ),
    api(
        "lane-poll-interval-seconds",
        lambda e: _lane(e.url, poll_interval=1),
        ConfigurationError,
        "poll_interval must be a timedelta",
    ),
    api(
        "lane-connect-timeout-inf",
        lambda e: _lane(e.url, connect_timeout=math.inf),
        ConfigurationError,
        "connect_timeout must be a number of seconds above 0 and at most 3600, got inf",
    ),
    api(
        "rabbitmq-delivery-limit-huge",
        lambda e: rabbitmq_lane(
            connection_string=e.url,
            schema="unused_schema",
            amqp_url="amqp://127.0.0.1:1/",
            delivery_limit=10**20,
        ),
        ConfigurationError,
        "delivery_limit must be an integer from 1 to 2147483647, got 100000000000000000000",
    ),
    api(
        "lane-connect-timeout-nan",
        lambda e: _lane(e.url, connect_timeout=math.nan),
        ConfigurationError,
        "connect_timeout must be a number of seconds above 0 and at most 3600, got nan",
    ),
    api(
        "lane-pool-min-size-string",
        lambda e: _lane(e.url, pool_min_size="1"),
        ConfigurationError,
        "pool_min_size must be an integer from 0 to 1000, got '1'",
    ),
    api(
        "lane-pool-max-size-float",
        lambda e: _lane(e.url, pool_max_size=2.0),
        ConfigurationError,
        "pool_max_size must be an integer from 1 to 1000, got 2.0",
    ),
    api(
        "lane-pool-max-size-huge",
        lambda e: _lane(e.url, pool_max_size=10**6),
        ConfigurationError,
        "pool_max_size must be an integer from 1 to 1000",
    ),
    api(
        "lane-pool-max-below-min",
        lambda e: _lane(e.url, pool_min_size=5, pool_max_size=2),
        ConfigurationError,
        "pool_max_size (2) must be at least pool_min_size (5)",
    ),
    api(
        "services-lease-duration-max",
        lambda e: e.rl.start_services(lease_duration=timedelta.max),
        ConfigurationError,
        "lease_duration must be a timedelta from 1 second to 1 day",
    ),
    api(
        "retention-over-a-century",
        lambda e: RetentionPolicy(completed=timedelta.max),
        ConfigurationError,
        "RetentionPolicy.completed must be a timedelta from 0 to 100 years",
    ),
    *[
        api(
            f"maintenance-limit-{field.name.replace('_', '-')}-huge",
            _huge_limit(field.name),
            ConfigurationError,
            f"MaintenanceLimits.{field.name} must be an integer from",
        )
        for field in attrs.fields(MaintenanceLimits)
    ],
    api(
        "worker-concurrency-over-the-maximum",
        lambda e: e.rl.create_delivery_worker(concurrency=10**6),
        ConfigurationError,
        "concurrency must be an integer from 1 to 1024, got 1000000",
    ),
    api(
        "worker-claim-batch-over-the-maximum",
        lambda e: e.rl.create_delivery_worker(concurrency=1, claim_batch=10**9),
        ConfigurationError,
        "claim_batch must be an integer from 1 to 10000",
    ),
    api(
        "drain-max-runs-float",
        lambda e: e.rl.drain(max_runs=1.5),  # type: ignore[arg-type]
        ConfigurationError,
        "max_runs must be an integer of at least 0, got 1.5",
    ),
    api(
        "close-timeout-nan",
        lambda e: e.rl.close(timeout=math.nan),
        ConfigurationError,
        "timeout must be None (wait as long as it takes) or a number of seconds >= 0",
    ),
    # -- the CLI ---------------------------------------------------------------------------
    cli(
        "cli-stats-unknown-bucket",
        ("stats", APP_SPEC, "--bucket", "2m"),
        EXIT_CONFIGURATION,
        "bucket must be one of 1m, 5m, 15m, 1h, 6h, 1d",
    ),
    cli(
        "cli-web-threads-zero",
        ("web", APP_SPEC, "--threads", "0"),
        EXIT_CONFIGURATION,
        "--threads must be an integer from 1 to 256, got 0",
    ),
    cli(
        "cli-demo-runs-negative",
        ("demo", "--runs", "-1"),
        EXIT_CONFIGURATION,
        "--runs must be an integer of at least 0, got -1",
    ),
    cli(
        "cli-payload-not-json",
        ("trigger", APP_SPEC, "bad.order", "--payload", "{sku: 'a'}"),
        EXIT_CONFIGURATION,
        "--payload is not valid JSON",
    ),
    cli(
        "cli-payload-nan",
        ("trigger", APP_SPEC, "bad.free", "--payload", '{"ratio": NaN}'),
        EXIT_CONFIGURATION,
        "NaN and infinite floats cannot be stored as JSON",
    ),
    cli(
        "cli-payload-invalid",
        ("trigger", APP_SPEC, "bad.order", "--payload", '{"sku": "a"}'),
        EXIT_CONFIGURATION,
        "payload.quantity",
    ),
    cli(
        "cli-unknown-task",
        ("trigger", APP_SPEC, "bad.nope", "--payload", "{}"),
        EXIT_CONFIGURATION,
        "task 'bad.nope' is not registered",
    ),
    cli(
        "cli-negative-delay",
        ("trigger", APP_SPEC, "bad.free", "--payload", "{}", "--delay", "-5"),
        EXIT_CONFIGURATION,
        "delay must not be negative",
    ),
    cli(
        "cli-unknown-queue",
        ("trigger", APP_SPEC, "bad.free", "--payload", "{}", "--queue", "nope"),
        EXIT_CONFIGURATION,
        "queue 'nope' is not registered",
    ),
    cli(
        "cli-show-malformed-run-id",
        ("runs", "show", APP_SPEC, "not-a-run"),
        EXIT_FAILURE,
        "'not-a-run' is not a run id (a UUID)",
    ),
    cli(
        "cli-cancel-unknown-run",
        ("runs", "cancel", APP_SPEC, str(uuid.UUID(int=3))),
        EXIT_FAILURE,
        "no run 00000000-0000-0000-0000-000000000003",
    ),
    cli(
        "cli-reschedule-time-without-offset",
        ("runs", "reschedule", APP_SPEC, str(uuid.UUID(int=3)), "--at", "2030-01-01T00:00"),
        EXIT_CONFIGURATION,
        "has no UTC offset",
    ),
    cli(
        "cli-audit-bad-limit",
        ("audit", APP_SPEC, "--limit", "0"),
        EXIT_CONFIGURATION,
        "--limit",
    ),
    cli(
        "cli-list-bad-status",
        ("runs", "list", APP_SPEC, "--status", "done"),
        EXIT_CONFIGURATION,
        "is not a run status",
    ),
    cli(
        "cli-app-module-missing",
        ("trigger", "no_such_module_xyz:runlane", "bad.free", "--payload", "{}"),
        EXIT_CONFIGURATION,
        "cannot import 'no_such_module_xyz'",
    ),
    cli(
        "cli-app-without-colon",
        ("runs", "list", "badinput_app"),
        EXIT_CONFIGURATION,
        "APP must look like module:attribute",
    ),
    cli(
        "cli-app-attribute-missing",
        ("runs", "list", "badinput_app:nothing_here"),
        EXIT_CONFIGURATION,
        "has no attribute 'nothing_here'",
    ),
    cli(
        "cli-app-not-a-runtime",
        ("runs", "list", "badinput_app:not_a_runtime"),
        EXIT_CONFIGURATION,
        "is a int, not a Runlane made by create_runlane",
    ),
]


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env(database_url: str) -> Iterator[Env]:
    """One migrated schema and runtime for the whole table, with a queued run and a pending
    wait token."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    apply_postgres_storage_migrations(connection_string=database_url, schema=name)
    rl = create_runlane(
        lane=postgres_polling_lane(connection_string=database_url, schema=name),
        tasks=[order, free],
    )
    try:
        queued = rl.trigger(free, {"seed": True}).id
        token = rl.create_wait_token().id
        yield Env(rl=rl, url=database_url, schema=name, queued_run=queued, token=token)
    finally:
        rl.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("badinput")
    (path / "badinput_app.py").write_text(APP)
    sys.path.insert(0, str(path))
    try:
        yield path
    finally:
        sys.path.remove(str(path))
        sys.modules.pop("badinput_app", None)


def rows_everywhere(url: str, schema: str) -> dict[str, int]:
    """The row count of every table in ``schema`` (runs, attempts, steps, wait tokens,
    schedules, outbox, ...), plus what identifies the token's state."""
    with psycopg.connect(url, autocommit=True) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "select table_name from information_schema.tables "
                "where table_schema = %s and table_type = 'BASE TABLE'",
                (schema,),
            )
        ]
        counts = {}
        for table in tables:
            row = conn.execute(
                sql.SQL("select count(*) from {}.{}").format(
                    sql.Identifier(schema), sql.Identifier(table)
                )
            ).fetchone()
            assert row is not None
            counts[table] = int(row[0])
        pending = conn.execute(
            sql.SQL("select count(*) from {}.wait_tokens where status = 'pending'").format(
                sql.Identifier(schema)
            )
        ).fetchone()
        assert pending is not None
        counts["wait_tokens pending"] = int(pending[0])
        schemas = conn.execute("select count(*) from information_schema.schemata").fetchone()
        assert schemas is not None
        counts["schemas in the database"] = int(schemas[0])
    return counts


# -- the table -------------------------------------------------------------------------------


def test_the_table_has_at_least_thirty_cases_with_unique_ids() -> None:
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids))
    assert len(CASES) >= 30
    assert sum(case.argv is not None for case in CASES) >= 4


@pytest.mark.parametrize("case", [case.param for case in CASES])
def test_bad_input_is_a_clear_runlane_error_and_writes_nothing(
    case: Case,
    env: Env,
    app_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = rows_everywhere(env.url, env.schema)
    if case.call is not None:
        assert isinstance(case.error, type)
        with pytest.raises(RunlaneError) as caught:
            case.call(env)
        assert type(caught.value) is case.error, repr(caught.value)
        assert case.needle in str(caught.value), str(caught.value)
    else:
        assert case.argv is not None
        monkeypatch.setenv("BAD_APP_DATABASE_URL", env.url)
        monkeypatch.setenv("BAD_APP_SCHEMA", env.schema)
        sys.modules.pop("badinput_app", None)  # each command closes the runtime it loaded
        capsys.readouterr()
        code = main(list(case.argv))
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == case.error, err
        assert len(lines) == 1, err
        assert lines[0].startswith("runlane: error: "), err
        assert case.needle in lines[0], err
    assert rows_everywhere(env.url, env.schema) == before


def test_the_docs_list_every_case() -> None:
    page = (Path(__file__).parent.parent / "docs" / "bad-input.md").read_text()
    missing = [case.id for case in CASES if f"`{case.id}`" not in page]
    assert not missing, f"docs/bad-input.md does not list {missing}"


def test_the_largest_value_each_bound_allows_works(make_runlane: RunlaneFactory) -> None:
    """Each bound is a value that still works against the database, not only a refusal past
    it: before, a retry budget, a retention, a lease or a maintenance limit this large was
    accepted and failed later, on every maintenance pass or claim."""

    @task(id="bound.echo", retry=RetryPolicy(max_attempts=INT32_MAX))
    def echo(payload: Any, context: RunContext) -> Any:
        return payload

    century = MAX_DURATION
    rl = make_runlane(
        tasks=[echo],
        schedules=[schedule(id="bound.every-minute", task=echo, cron="* * * * *")],
        retention=RetentionPolicy(completed=century, failed=century, cancelled=century),
        lane_options={
            "lease_duration": MAX_LEASE,
            "poll_interval": MAX_POLL_INTERVAL,  # LISTEN wakes the worker
            "connect_timeout": MAX_CONNECT_TIMEOUT,
            "pool_max_size": MAX_POOL_SIZE,
        },
    )
    limits = MaintenanceLimits(**{f.name: INT32_MAX for f in attrs.fields(MaintenanceLimits)})
    rl.run_maintenance_once(limits)
    services = rl.start_services(limits=limits, lease_duration=MAX_LEASE)
    worker = rl.create_delivery_worker(concurrency=2, claim_batch=MAX_CLAIM_BATCH)
    handle = rl.trigger(echo, {"n": 1})
    done = rl.wait_for_run(handle.id, timeout=30)
    assert (done.status, done.output, done.max_attempts) == (
        RunStatus.COMPLETED,
        {"n": 1},
        INT32_MAX,
    )
    assert services.wait_for(lambda: sum(services.passes.values()) > 0, timeout=30)
    assert not services.closed
    assert not worker.closed
    rl.close(timeout=math.inf)
    assert worker.closed
    assert services.closed
