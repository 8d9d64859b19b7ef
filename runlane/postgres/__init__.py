"""PostgreSQL storage, the Postgres polling lane, and the transport toolkit.

The transport toolkit is what a lane delivering through another system (a broker) builds on
while Postgres keeps the truth: the storage's :class:`Outbox` (through :func:`outbox_of`),
the :class:`EagerPublisher` a trigger hands its items to, the announcement
:class:`PostgresListener` on the schema's :func:`notify_channel`, :class:`RunEnds` for
``wait_for_run``, :func:`check_postgres_storage_options`, and the lane's Postgres side
made once from its options (:func:`postgres_storage`, :func:`postgres_listener`,
:func:`postgres_run_ends`). See docs/lanes.md.
"""

from runlane.postgres._ends import RunEnds
from runlane.postgres._grants import (
    GRANT_JOBS,
    GRANT_LANES,
    GrantResult,
    grant_postgres_role,
    postgres_grant_sql,
)
from runlane.postgres._lane import (
    PostgresOptions,
    PostgresPollingLane,
    check_postgres_storage_options,
    postgres_listener,
    postgres_polling_lane,
    postgres_run_ends,
    postgres_storage,
)
from runlane.postgres._listener import PostgresListener
from runlane.postgres._migrations import MigrationResult, apply_postgres_storage_migrations
from runlane.postgres._sql import notify_channel
from runlane.postgres._storage import PostgresStorage
from runlane.postgres._transport import EagerPublisher, Outbox, outbox_of

__all__ = [
    "GRANT_JOBS",
    "GRANT_LANES",
    "EagerPublisher",
    "GrantResult",
    "MigrationResult",
    "Outbox",
    "PostgresListener",
    "PostgresOptions",
    "PostgresPollingLane",
    "PostgresStorage",
    "RunEnds",
    "apply_postgres_storage_migrations",
    "check_postgres_storage_options",
    "grant_postgres_role",
    "notify_channel",
    "outbox_of",
    "postgres_grant_sql",
    "postgres_listener",
    "postgres_polling_lane",
    "postgres_run_ends",
    "postgres_storage",
]
