"""PostgreSQL storage and the Postgres polling lane."""

from runlane.postgres._lane import PostgresPollingLane, postgres_polling_lane
from runlane.postgres._migrations import MigrationResult, apply_postgres_storage_migrations
from runlane.postgres._storage import PostgresStorage

__all__ = [
    "MigrationResult",
    "PostgresPollingLane",
    "PostgresStorage",
    "apply_postgres_storage_migrations",
    "postgres_polling_lane",
]
