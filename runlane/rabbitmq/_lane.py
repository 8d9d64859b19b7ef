"""The RabbitMQ lane: Postgres keeps the truth, a broker carries deliveries.

Runs live in the Postgres storage as with the polling lane. Every run that becomes queued
gets an outbox item in the same transaction (migration 3); a publisher in each runtime
publishes items with confirms (an eager trigger's right after its commit), and workers
consume from durable queues (quorum queues by default, classic ones on request),
claiming the run a message names with the polling lane's fenced claim.
See ``docs/deploying.md`` for running it past one machine.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from urllib.parse import parse_qs, urlsplit

import attrs
import pika

from runlane.contract import contract_defaults
from runlane.errors import ConfigurationError
from runlane.lanes import AcquirerOptions, LaneMaintenance
from runlane.maintenance import MaintenanceLimits
from runlane.postgres import (
    PostgresStorage,
    RunEnds,
    check_postgres_storage_options,
    outbox_of,
    postgres_listener,
    postgres_run_ends,
    postgres_storage,
)
from runlane.rabbitmq._amqp import (
    AMQP_ERRORS,
    QUEUE_TYPES,
    check_amqp_url,
    check_queue_names,
    describe,
    refusal,
)
from runlane.rabbitmq._consumer import RabbitAcquirer
from runlane.rabbitmq._health import RabbitMQStatus, queue_problems
from runlane.rabbitmq._publisher import OutboxPublisher
from runlane.storage import MaintenanceFence, Storage
from runlane.toolkit import INT32_MAX, as_int

__all__ = ["RabbitMQLane", "rabbitmq_lane"]

log = logging.getLogger("runlane.rabbitmq")

_DRAIN_UNSUPPORTED = (
    "a broker consumer cannot prove that the broker holds no message for a due run, so "
    "'no work is due' cannot be answered; run a worker instead "
    "(runlane.create_delivery_worker(...), or `runlane worker APP`) and wait for the runs "
    "you need (runlane.wait_for_run(run_id)); tests that want drain() can use "
    "postgres_polling_lane on the same schema"
)


def _publisher_of(storage: Storage) -> OutboxPublisher:
    publisher = outbox_of(storage).eager_publisher
    if not isinstance(publisher, OutboxPublisher):
        raise ConfigurationError(
            "this storage was not made by rabbitmq_lane(); build the runtime with "
            "create_runlane(lane=rabbitmq_lane(...))"
        )
    return publisher


@attrs.frozen
class RabbitMQLane:
    """Postgres storage with an outbox, deliveries through RabbitMQ. Make it with
    :func:`rabbitmq_lane`."""

    connection_string: str = attrs.field(repr=False)
    schema: str
    amqp_url: str = attrs.field(repr=False)
    pool_min_size: int
    pool_max_size: int
    lease_duration: timedelta
    connect_timeout: float
    poll_interval: timedelta
    claim_duration: timedelta
    publish_timeout: timedelta
    delivery_limit: int
    recovery_threshold: timedelta
    defer_delay: timedelta
    queue_type: str = "quorum"
    clock: Callable[[], datetime] | None = attrs.field(default=None, repr=False)
    listen_connection_string: str | None = attrs.field(default=None, repr=False)
    pooler: str = "auto"

    name = "rabbitmq"
    drain_unsupported = _DRAIN_UNSUPPORTED

    @property
    def broker(self) -> str:
        """``host:port`` of the broker (never the credentials)."""
        return describe(self._params())

    def _params(self) -> pika.URLParameters:
        params = check_amqp_url(self.amqp_url)
        params.connection_attempts = 1
        params.socket_timeout = self.connect_timeout
        if "stack_timeout" not in parse_qs(urlsplit(self.amqp_url).query):
            # the whole handshake (TCP, TLS, AMQP), not pika's 15 s: a broker that accepts
            # and never answers holds a connect no longer than connect_timeout says
            params.stack_timeout = self.connect_timeout
        params.blocked_connection_timeout = self.publish_timeout.total_seconds()
        return params

    def check_queue_names(self, environment: str, queues: Sequence[str]) -> None:
        """Called by ``create_runlane`` with the runtime's environment and queues: refuses
        (ConfigurationError) a pair whose broker queue name is longer than AMQP's 255 bytes,
        which the broker would refuse on every publish and declaration."""
        check_queue_names(self.schema, environment, queues)

    def create_storage(self) -> PostgresStorage:
        storage = postgres_storage(self, self.clock)
        storage.attach_eager_publisher(
            OutboxPublisher(
                storage,
                params=self._params(),
                schema=self.schema,
                claim=self.claim_duration,
                publish_timeout=self.publish_timeout.total_seconds(),
                delivery_limit=self.delivery_limit,
                queue_type=self.queue_type,
            )
        )
        return storage

    def prepare(self, storage: Storage, environment: str) -> None:
        """Check the broker, enable the outbox for the environment and start the runtime's
        publisher: it listens for items stored unclaimed and publishes what is pending now.

        The start-up check connects once: a broker that refuses amqp_url's credentials or
        virtual host raises :class:`ConfigurationError` (no retry would help); one that is
        down or unreachable is logged and the runtime starts all the same, since triggers
        keep their outbox items in Postgres and are published when it answers."""
        params = self._params()
        problem = _connect_problem(params, self.connect_timeout)
        if problem is not None:
            refused = refusal(problem, params)
            if refused is not None:
                raise ConfigurationError(refused)
            log.warning(
                "runlane: the RabbitMQ broker at %s does not answer at start (%s); triggers "
                "keep their outbox items in Postgres and are published once it does",
                describe(params),
                type(problem).__name__,
            )
        outbox_of(storage).outbox_enable(environment, self.claim_duration)
        publisher = _publisher_of(storage)
        publisher.serve(environment)  # its environment's items only
        listener = postgres_listener(
            self, environment, publisher.on_notify, f"{publisher.name}-listener"
        )
        publisher.add_listener(listener)
        listener.start()  # its first (re)connect wakes the publisher: pending items go

    def watch_run_ends(self, environment: str, name: str) -> RunEnds:
        """Wake-ups on runs ending for ``wait_for_run`` (runs live in Postgres here too)."""
        return postgres_run_ends(self, environment, name)

    def create_acquirer(
        self,
        storage: Storage,
        options: AcquirerOptions,
        on_cancel: Callable[[uuid.UUID | None], None],
    ) -> RabbitAcquirer:
        """One worker's consumer: its own AMQP connection, prefetch = its claim batch."""
        return RabbitAcquirer(
            outbox_of(storage),
            options,
            on_cancel,
            params=self._params(),
            schema=self.schema,
            delivery_limit=self.delivery_limit,
            queue_type=self.queue_type,
            poll_interval=self.poll_interval,
            defer_delay=self.defer_delay,
            make_listener=lambda on_wake, name: postgres_listener(
                self, options.environment, on_wake, name
            ),
        )

    def recover_delivery(
        self,
        storage: Storage,
        environment: str,
        limits: MaintenanceLimits,
        fence: MaintenanceFence | None,
    ) -> LaneMaintenance:
        """Publish one page of the environment's pending outbox items, then re-announce runs
        queued past the recovery threshold with no item (a purged queue, a dead-lettered
        message). Outbox writes are fenced by their claim tokens, so replicas may do this at
        once."""
        publisher = _publisher_of(storage)
        timeout = 2 * self.publish_timeout.total_seconds() + 5.0
        published = publisher.publish_pending(limits.outbox_publish_limit, timeout)
        recovered = 0
        if limits.delivery_recovery_limit:
            recovered = outbox_of(storage).outbox_recover(
                environment, self.recovery_threshold, limits.delivery_recovery_limit
            )
            if recovered:
                publisher.wake()
        return LaneMaintenance(outbox_published=published, deliveries_recovered=recovered)

    def status(self, storage: Storage, environment: str) -> RabbitMQStatus:
        """Pending outbox items and the oldest one's age; whether the broker answers; the
        queues it cannot serve (``broker_problems``, from the outbox's failed publishes)."""
        outbox = outbox_of(storage)
        pending = outbox.outbox_status(environment)
        failing = outbox.outbox_failing_queues(environment)
        params = self._params()
        problem = _connect_problem(params, self.connect_timeout)
        if problem is None:
            broker = f"reachable at {describe(params)}"
        else:
            broker = f"unreachable at {describe(params)} ({type(problem).__name__})"
            refused = refusal(problem, params)
            if refused is not None:  # it answered, and will not let this runtime in
                broker += f": {refused}"
        return RabbitMQStatus(
            outbox_pending=pending.pending,
            outbox_oldest_age_seconds=pending.oldest_age_seconds,
            broker=broker,
            broker_problems=tuple(queue_problems(self.schema, environment, failing)),
        )


def _connect_problem(params: pika.URLParameters, connect_timeout: float) -> BaseException | None:
    """Connect to the broker once and close: None when it answered, else what failed (its
    socket timeout and whole handshake at most ``connect_timeout``, and 3 s)."""
    params.socket_timeout = min(connect_timeout, 3.0)
    params.stack_timeout = min(params.stack_timeout or connect_timeout, connect_timeout, 3.0)
    try:
        pika.BlockingConnection(params).close()
    except AMQP_ERRORS as exc:
        return exc
    return None


def _positive(name: str, value: timedelta) -> timedelta:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise ConfigurationError(f"{name} must be a positive timedelta, got {value!r}")
    return value


def rabbitmq_lane(
    *,
    connection_string: str,
    schema: str = "runlane",
    amqp_url: str,
    pool_min_size: int = 1,
    pool_max_size: int = 10,
    lease_duration: timedelta = timedelta(seconds=30),
    connect_timeout: float = 10.0,
    poll_interval: timedelta = timedelta(seconds=1),
    claim_duration: timedelta = contract_defaults.lease.duration,
    publish_timeout: timedelta = timedelta(seconds=10),
    delivery_limit: int = 20,
    recovery_threshold: timedelta = timedelta(minutes=5),
    defer_delay: timedelta = timedelta(seconds=1),
    queue_type: str = "quorum",
    listen_connection_string: str | None = None,
    pooler: str = "auto",
    clock: Callable[[], datetime] | None = None,
) -> RabbitMQLane:
    """A lane keeping runs in ``schema`` at ``connection_string`` and delivering them
    through the RabbitMQ broker at ``amqp_url`` (durable queues, one per logical queue, named
    ``runlane.<schema>.<environment>.<queue>``, with ``.`` and ``%`` in the environment written
    as ``%2E`` and ``%25``; ``create_runlane`` refuses an environment
    and queue whose name would pass AMQP's 255 bytes).

    ``claim_duration``: how long a publisher's claim on an outbox item lasts (another
    publisher takes the item after it; ``contract_defaults.lease.duration``, 5 minutes, by
    default); it must exceed ``publish_timeout``.
    ``delivery_limit``: deliveries of one message before the broker dead-letters it to
    ``runlane.<schema>.dead``. ``recovery_threshold``: how long a run may stay queued with
    no outbox item before maintenance announces it again. ``defer_delay``: how long a run
    whose bounded queue is at capacity waits before it is published again.
    ``poll_interval``: how often an idle worker looks again without a delivery.
    ``connect_timeout``: how long a connection to the broker may take, its whole handshake
    (TCP, TLS, AMQP) included, unless ``amqp_url`` sets ``stack_timeout`` (the start-up
    check and ``status()`` wait 3 s at most).
    ``queue_type``: ``"quorum"`` (the default) replicates every message to a majority of
    the cluster's nodes and delivers it once that is on disk; ``"classic"`` keeps a queue
    on one node and delivers before its disk write (runs start sooner by that write:
    about 1 ms on one local node; a message is lost with its node's disk, and its run is announced
    again after ``recovery_threshold``; no ``delivery_limit``). Every runtime of a schema
    must use the same type: the broker refuses to declare a queue with another. See
    docs/deploying.md, "Quorum or classic queues".
    ``listen_connection_string`` and ``pooler``: as
    :func:`~runlane.postgres.postgres_polling_lane`'s (the outbox publisher's LISTEN
    connection; through a transaction pooler it needs ``listen_connection_string``).
    ``clock``: as :func:`~runlane.postgres.postgres_polling_lane`'s (a test's
    :class:`runlane.testing.MovableClock`: the time every storage of the lane reads as now).
    """
    check_postgres_storage_options(
        connection_string=connection_string,
        schema=schema,
        pool_min_size=pool_min_size,
        pool_max_size=pool_max_size,
        lease_duration=lease_duration,
        poll_interval=poll_interval,
        connect_timeout=connect_timeout,
        pooler=pooler,
        listen_connection_string=listen_connection_string,
    )
    check_amqp_url(amqp_url)
    if clock is not None and not callable(clock):
        raise ConfigurationError(f"clock must be callable (a MovableClock), got {clock!r}")
    _positive("claim_duration", claim_duration)
    _positive("publish_timeout", publish_timeout)
    _positive("recovery_threshold", recovery_threshold)
    if not isinstance(defer_delay, timedelta) or defer_delay < timedelta(0):
        raise ConfigurationError(
            f"defer_delay must be a non-negative timedelta, got {defer_delay!r}"
        )
    if claim_duration <= publish_timeout:
        raise ConfigurationError(
            f"claim_duration ({claim_duration}) must be longer than publish_timeout "
            f"({publish_timeout}): a publisher still waiting for a confirm would lose its claim "
            "and the item would be published twice"
        )
    # x-delivery-limit, counted by the broker per message
    as_int("delivery_limit", delivery_limit, 1, INT32_MAX)
    if not isinstance(queue_type, str) or queue_type not in QUEUE_TYPES:
        raise ConfigurationError(
            f"queue_type must be one of {', '.join(map(repr, QUEUE_TYPES))}, got "
            f"{queue_type!r}: 'quorum' (replicated, the default) or 'classic' (one node, "
            "delivered before its disk write)"
        )
    return RabbitMQLane(
        connection_string=connection_string,
        schema=schema,
        amqp_url=amqp_url,
        pool_min_size=pool_min_size,
        pool_max_size=pool_max_size,
        lease_duration=lease_duration,
        connect_timeout=connect_timeout,
        poll_interval=poll_interval,
        claim_duration=claim_duration,
        publish_timeout=publish_timeout,
        delivery_limit=delivery_limit,
        recovery_threshold=recovery_threshold,
        defer_delay=defer_delay,
        queue_type=queue_type,
        listen_connection_string=listen_connection_string,
        pooler=pooler,
        clock=clock,
    )
