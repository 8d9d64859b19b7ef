"""The Postgres polling lane: workers claim runs straight from Postgres."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import attrs

from runlane._limits import (
    MAX_CONNECT_TIMEOUT,
    MAX_LEASE,
    MAX_POLL_INTERVAL,
    MAX_POOL_SIZE,
    MIN_LEASE,
)
from runlane.errors import ConfigurationError
from runlane.lanes import AcquirerOptions, LaneMaintenance, LaneStatus
from runlane.maintenance import MaintenanceLimits
from runlane.postgres._acquirer import PollingAcquirer
from runlane.postgres._connections import DEFAULT_CONNECT_TIMEOUT, check_conninfo
from runlane.postgres._ends import RunEnds
from runlane.postgres._listen_hub import SharedListener
from runlane.postgres._listener import PostgresListener
from runlane.postgres._now import Clock
from runlane.postgres._pooler import POOLERS
from runlane.postgres._sql import notify_channel, validate_schema_name
from runlane.postgres._storage import PostgresStorage
from runlane.storage import MaintenanceFence, Storage
from runlane.toolkit import as_int, as_seconds, as_timedelta, shown

__all__ = [
    "PostgresOptions",
    "PostgresPollingLane",
    "check_postgres_storage_options",
    "postgres_listener",
    "postgres_polling_lane",
    "postgres_run_ends",
    "postgres_storage",
]

# delivery recovery announces queues whose delayed runs came due within this window
WAKE_WINDOW = timedelta(minutes=1)
# the shortest poll interval: below it an idle worker polls the database in a busy loop
_MIN_POLL_INTERVAL = timedelta(milliseconds=1)


class PostgresOptions(Protocol):
    """The storage options of a lane keeping its runs in Postgres (both lanes are one)."""

    @property
    def connection_string(self) -> str: ...
    @property
    def schema(self) -> str: ...
    @property
    def pool_min_size(self) -> int: ...
    @property
    def pool_max_size(self) -> int: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def listen_connection_string(self) -> str | None: ...
    @property
    def pooler(self) -> str: ...


def listen_target(options: PostgresOptions) -> tuple[str, str, bool]:
    """Where the LISTEN connection goes: its connection string, how the start line names
    it, and whether it is to check for a pooler (the lane's own string, pooler ``auto``)."""
    if options.listen_connection_string is not None:
        return options.listen_connection_string, "listen_connection_string", False
    return options.connection_string, "the lane's connection string", options.pooler == "auto"


def postgres_storage(options: PostgresOptions, clock: Clock | None = None) -> PostgresStorage:
    """The storage of a lane with these ``options``; its statements read ``clock()`` as now
    when given (a test's :class:`runlane.testing.MovableClock`)."""
    return PostgresStorage(
        connection_string=options.connection_string,
        schema=options.schema,
        pool_min_size=options.pool_min_size,
        pool_max_size=options.pool_max_size,
        connect_timeout=options.connect_timeout,
        clock=clock,
        pooler=options.pooler,
    )


def postgres_listener(
    options: PostgresOptions,
    environment: str,
    on_wake: Callable[[str | None], None],
    name: str,
) -> PostgresListener:
    """An announcement listener on the schema's ``notify_channel``, not started; every
    listener of a process on the same server shares one connection (_listen_hub.py)."""
    target, via, check_pooler = listen_target(options)
    return SharedListener(
        connection_string=target,
        channel=notify_channel(options.schema),
        environment=environment,
        on_wake=on_wake,
        name=name,
        connect_timeout=options.connect_timeout,
        via=via,
        check_pooler=check_pooler,
    )


def postgres_run_ends(options: PostgresOptions, environment: str, name: str) -> RunEnds:
    """Wake-ups on runs ending, for ``wait_for_run`` (``watch_run_ends``), LISTENing where
    the lane's workers do (``listen_target``)."""
    target, via, check_pooler = listen_target(options)
    return RunEnds(
        connection_string=target,
        schema=options.schema,
        environment=environment,
        connect_timeout=options.connect_timeout,
        name=name,
        via=via,
        check_pooler=check_pooler,
    )


@attrs.frozen
class PostgresPollingLane:
    """Where runs are stored and how they are delivered. Make it with postgres_polling_lane."""

    connection_string: str = attrs.field(repr=False)
    schema: str
    pool_min_size: int
    pool_max_size: int
    lease_duration: timedelta
    connect_timeout: float
    poll_interval: timedelta
    listen: bool
    clock: Clock | None = attrs.field(default=None, repr=False)
    listen_connection_string: str | None = attrs.field(default=None, repr=False)
    pooler: str = "auto"

    @property
    def name(self) -> str:
        return "postgres-polling"

    @property
    def drain_unsupported(self) -> str | None:
        """None: ``drain()`` works on this lane (runs are claimed straight from storage)."""
        return None

    def create_storage(self) -> PostgresStorage:
        return postgres_storage(self, self.clock)

    def prepare(self, storage: Storage, environment: str) -> None:
        """Nothing to prepare: the polling lane keeps no outbox."""

    def recover_delivery(
        self,
        storage: Storage,
        environment: str,
        limits: MaintenanceLimits,
        fence: MaintenanceFence | None,
    ) -> LaneMaintenance:
        """Announce the queues whose delayed runs came due within the last minute: nothing
        announced them (they were not due when written), and an idle worker polls only
        every ``poll_interval``. Writes nothing, so the fence is not needed."""
        limit = limits.delivery_recovery_limit
        if not limit:
            return LaneMaintenance()
        woken = storage.run_wake_due_queues(environment, WAKE_WINDOW, limit)
        return LaneMaintenance(queues_woken=len(woken))

    def status(self, storage: Storage, environment: str) -> LaneStatus:
        """The polling lane has no outbox: nothing is ever pending publication."""
        return LaneStatus(outbox_pending=0)

    def create_acquirer(
        self,
        storage: Storage,
        options: AcquirerOptions,
        on_cancel: Callable[[uuid.UUID | None], None],
    ) -> PollingAcquirer:
        """Claims from Postgres; LISTEN wake-ups (unless ``listen=False`` or draining)."""
        return PollingAcquirer(
            storage,
            options,
            on_cancel,
            poll_interval=self.poll_interval,
            make_listener=lambda on_wake, name: self.create_listener(
                options.environment, on_wake, name
            ),
        )

    def watch_run_ends(self, environment: str, name: str) -> RunEnds | None:
        """Wake-ups on runs ending for ``wait_for_run``; None in poll-only mode."""
        return postgres_run_ends(self, environment, name) if self.listen else None

    def create_listener(
        self, environment: str, on_wake: Callable[[str | None], None], name: str
    ) -> PostgresListener | None:
        """The wake-up listener of a worker, or None in poll-only mode (``listen=False``)."""
        return postgres_listener(self, environment, on_wake, name) if self.listen else None


def check_postgres_storage_options(
    *,
    connection_string: str,
    schema: str,
    pool_min_size: int,
    pool_max_size: int,
    lease_duration: timedelta,
    poll_interval: timedelta,
    connect_timeout: float,
    pooler: str = "auto",
    listen: bool = True,
    listen_connection_string: str | None = None,
) -> None:
    """The checks every lane keeping its runs in Postgres makes of its storage options
    (its ``create_runlane``-time validation): raises :class:`~runlane.ConfigurationError`
    naming the option."""
    check_conninfo(connection_string)
    validate_schema_name(schema)
    as_int("pool_min_size", pool_min_size, 0, MAX_POOL_SIZE)
    as_int("pool_max_size", pool_max_size, 1, MAX_POOL_SIZE)
    if pool_max_size < pool_min_size:
        raise ConfigurationError(
            f"pool_max_size ({pool_max_size}) must be at least pool_min_size ({pool_min_size})"
        )
    # a lease's expiry is now() + lease_duration in Postgres, and a worker waits a fraction
    # of it between extensions: beyond a day a crashed worker's runs wait that long too
    as_timedelta("lease_duration", lease_duration, MIN_LEASE, MAX_LEASE)
    as_timedelta("poll_interval", poll_interval, _MIN_POLL_INTERVAL, MAX_POLL_INTERVAL)
    # libpq counts connect_timeout in whole seconds, the pool waits it for a connection
    as_seconds("connect_timeout", connect_timeout, MAX_CONNECT_TIMEOUT)
    check_listen_options(pooler, listen, listen_connection_string)


def check_listen_options(pooler: str, listen: bool, listen_connection_string: str | None) -> None:
    """``pooler`` is one runlane knows; LISTEN has somewhere to go that can hear."""
    if pooler not in POOLERS:
        raise ConfigurationError(
            f"pooler must be one of {', '.join(map(repr, POOLERS))}, got {shown(pooler)}: "
            "'transaction' behind PgBouncer (pool_mode=transaction), RDS Proxy or pgcat"
        )
    if listen_connection_string is not None:
        if not listen:
            raise ConfigurationError(
                "listen_connection_string= is where the LISTEN connection goes, and "
                "listen=False turns that connection off: pass one or the other"
            )
        check_conninfo(listen_connection_string)
    elif listen and pooler == "transaction":
        raise ConfigurationError(
            "LISTEN cannot work through a pooler in transaction mode (the server session "
            "changes hands after each transaction): pass listen_connection_string= (straight "
            "to the primary) or listen=False (poll only)"
        )


def postgres_polling_lane(
    *,
    connection_string: str,
    schema: str = "runlane",
    pool_min_size: int = 1,
    pool_max_size: int = 10,
    lease_duration: timedelta = timedelta(seconds=30),
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    poll_interval: timedelta = timedelta(seconds=1),
    listen: bool = True,
    clock: Clock | None = None,
    listen_connection_string: str | None = None,
    pooler: str = "auto",
) -> PostgresPollingLane:
    """A lane storing runs in ``schema`` of the database at ``connection_string``.

    ``lease_duration`` is how long an attempt's lease lasts between extensions; a worker that
    stops extending (crash, freeze) loses the run to maintenance after at most this long.
    Idle workers wake on NOTIFY and also poll every ``poll_interval`` (jittered), which is
    what finds delayed runs and covers lost notifications; while LISTEN is up, polls that
    found nothing for 10 s are spaced out to ten intervals (at most 10 s, never under the
    interval) until work or a notification comes, and a worker whose last poll found a
    delayed run not yet due wakes when it comes due; ``listen=False`` polls only, every
    ``poll_interval``.
    ``listen_connection_string`` sends the one LISTEN connection somewhere else than the
    rest (straight to the primary while everything else goes through PgBouncer).
    ``pooler``: ``"auto"`` finds out from the first connection whether it goes through a
    pooler; ``"transaction"`` says it does (PgBouncer ``pool_mode=transaction``, RDS Proxy,
    pgcat: no named prepared statements, startup settings or LISTEN through it);
    ``"session"`` or ``"none"`` say session state lasts (docs/deployment.md). ``clock``: the
    time every statement of the lane's storages reads as now instead of the database's
    (tests: :class:`runlane.testing.MovableClock`, docs/testing.md).
    ``connect_timeout`` (seconds, 5 by default; a ``connect_timeout`` in the connection string
    wins) bounds making a connection: a wrong
    host, port, password or database fails the first call within it, with a
    :class:`~runlane.StorageUnavailable` naming the cause. A free pooled connection is waited
    for up to ``connect_timeout`` too: a call that starts during an outage fails within it,
    rather than after the server is back but before the pool's reconnect backoff (up to
    several seconds) has made a connection again.
    """
    if not isinstance(connection_string, str) or not connection_string:
        raise ConfigurationError("postgres_polling_lane needs a connection_string")
    check_postgres_storage_options(
        connection_string=connection_string,
        schema=schema,
        pool_min_size=pool_min_size,
        pool_max_size=pool_max_size,
        lease_duration=lease_duration,
        poll_interval=poll_interval,
        connect_timeout=connect_timeout,
        pooler=pooler,
        listen=listen,
        listen_connection_string=listen_connection_string,
    )
    return PostgresPollingLane(
        connection_string=connection_string,
        schema=schema,
        pool_min_size=pool_min_size,
        pool_max_size=pool_max_size,
        lease_duration=lease_duration,
        connect_timeout=connect_timeout,
        poll_interval=poll_interval,
        listen=listen,
        clock=clock,
        listen_connection_string=listen_connection_string,
        pooler=pooler,
    )
