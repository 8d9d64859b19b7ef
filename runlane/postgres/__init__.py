"""PostgreSQL storage and the Postgres polling lane."""

from runlane.postgres._grants import (
    GRANT_JOBS,
    GRANT_LANES,
    GrantResult,
    grant_postgres_role,
    postgres_grant_sql,
)
from runlane.postgres._lane import PostgresPollingLane, postgres_polling_lane
from runlane.postgres._migrations import MigrationResult, apply_postgres_storage_migrations
from runlane.postgres._storage import PostgresStorage

__all__ = [
    "GRANT_JOBS",
    "GRANT_LANES",
    "GrantResult",
    "MigrationResult",
    "PostgresPollingLane",
    "PostgresStorage",
    "apply_postgres_storage_migrations",
    "grant_postgres_role",
    "postgres_grant_sql",
    "postgres_polling_lane",
]
