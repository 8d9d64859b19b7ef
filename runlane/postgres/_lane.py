"""The Postgres polling lane: workers claim runs straight from Postgres."""

from __future__ import annotations

from datetime import timedelta

import attrs

from runlane.errors import ConfigurationError
from runlane.postgres._sql import validate_schema_name
from runlane.postgres._storage import PostgresStorage

__all__ = ["PostgresPollingLane", "postgres_polling_lane"]


@attrs.frozen
class PostgresPollingLane:
    """Where runs are stored and how they are delivered. Make it with postgres_polling_lane."""

    connection_string: str = attrs.field(repr=False)
    schema: str
    pool_min_size: int
    pool_max_size: int
    lease_duration: timedelta
    connect_timeout: float

    def create_storage(self) -> PostgresStorage:
        return PostgresStorage(
            connection_string=self.connection_string,
            schema=self.schema,
            pool_min_size=self.pool_min_size,
            pool_max_size=self.pool_max_size,
            connect_timeout=self.connect_timeout,
        )


def postgres_polling_lane(
    *,
    connection_string: str,
    schema: str = "runlane",
    pool_min_size: int = 1,
    pool_max_size: int = 10,
    lease_duration: timedelta = timedelta(seconds=30),
    connect_timeout: float = 10.0,
) -> PostgresPollingLane:
    """A lane storing runs in ``schema`` of the database at ``connection_string``.

    ``lease_duration`` is how long an attempt's lease lasts between extensions; a worker that
    stops extending (crash, freeze) loses the run to maintenance after at most this long.
    """
    if not isinstance(connection_string, str) or not connection_string:
        raise ConfigurationError("postgres_polling_lane needs a connection_string")
    validate_schema_name(schema)
    if pool_min_size < 0 or pool_max_size < max(pool_min_size, 1):
        raise ConfigurationError(
            f"pool sizes must satisfy 0 <= pool_min_size <= pool_max_size and pool_max_size >= 1, "
            f"got {pool_min_size} and {pool_max_size}"
        )
    if lease_duration < timedelta(seconds=1):
        raise ConfigurationError(
            f"lease_duration must be at least one second, got {lease_duration}"
        )
    if connect_timeout <= 0:
        raise ConfigurationError(f"connect_timeout must be positive, got {connect_timeout}")
    return PostgresPollingLane(
        connection_string=connection_string,
        schema=schema,
        pool_min_size=pool_min_size,
        pool_max_size=pool_max_size,
        lease_duration=lease_duration,
        connect_timeout=connect_timeout,
    )
