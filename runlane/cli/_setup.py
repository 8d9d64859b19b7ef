"""The deployment steps: ``migrate`` (install or upgrade the schema) and ``grant`` (a role's
privileges for one job). They take a database URL, not ``APP``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from runlane.cli._target import LoadApp
from runlane.errors import ConfigurationError
from runlane.postgres import (
    GRANT_JOBS,
    GRANT_LANES,
    apply_postgres_storage_migrations,
    grant_postgres_role,
    postgres_grant_sql,
)

__all__ = ["DATABASE_URL_HELP", "add_setup_commands", "given_database_url"]

DATABASE_URL_HELP = "PostgreSQL URL (default: $RUNLANE_DATABASE_URL, then $DATABASE_URL)"


def given_database_url(given: str | None) -> str | None:
    """--database-url, then $RUNLANE_DATABASE_URL, then $DATABASE_URL (None: none of them)."""
    url = given or os.environ.get("RUNLANE_DATABASE_URL") or os.environ.get("DATABASE_URL")
    return url or None


def _database_url(given: str | None) -> str:
    url = given_database_url(given)
    if not url:
        raise ConfigurationError(
            "no database URL: pass --database-url, or set RUNLANE_DATABASE_URL or DATABASE_URL"
        )
    return url


def _cmd_migrate(args: argparse.Namespace) -> int:
    result = apply_postgres_storage_migrations(
        connection_string=_database_url(args.database_url), schema=args.schema
    )
    if result.applied:
        applied = ", ".join(str(v) for v in result.applied)
        print(f"schema {result.schema}: applied {applied}; now at version {result.version}")
    else:
        print(f"schema {result.schema}: already at version {result.version}; nothing to do")
    return 0


def _cmd_grant(args: argparse.Namespace) -> int:
    if args.print_sql:
        sys.stdout.write(
            postgres_grant_sql(job=args.job, role=args.role, schema=args.schema, lane=args.lane)
        )
        return 0
    result = grant_postgres_role(
        connection_string=_database_url(args.database_url),
        job=args.job,
        role=args.role,
        schema=args.schema,
        lane=args.lane,
    )
    print(
        f"schema {result.schema}: granted the {result.job} job ({result.lane} lane) "
        f"to role {result.role}"
    )
    return 0


def add_setup_commands(commands: Any, load_app: LoadApp) -> None:
    """``migrate`` and ``grant`` (``load_app`` unused: they take no ``APP``)."""
    migrate = commands.add_parser(
        "migrate", help="install or upgrade the storage schema (a deployment step)"
    )
    migrate.add_argument("--database-url", help=DATABASE_URL_HELP)
    migrate.add_argument("--schema", default="runlane", help="schema name (default: runlane)")
    migrate.set_defaults(handler=_cmd_migrate)

    grant = commands.add_parser(
        "grant",
        help="grant a database role only what one job needs (see docs/security.md)",
        description=(
            "Grant ROLE the privileges of JOB in the schema: producer (trigger and read runs, "
            "wait tokens), worker (execute runs), maintenance (the maintenance services), "
            "operator (inspect, retry, cancel). Connect as the schema's owner; ROLE must "
            "exist. --print writes the SQL instead of running it."
        ),
    )
    grant.add_argument("job", metavar="JOB", choices=GRANT_JOBS, help=", ".join(GRANT_JOBS))
    grant.add_argument("role", metavar="ROLE", help="an existing PostgreSQL role")
    grant.add_argument("--schema", default="runlane", help="schema name (default: runlane)")
    grant.add_argument("--database-url", help=DATABASE_URL_HELP)
    grant.add_argument(
        "--lane",
        choices=GRANT_LANES,
        default="polling",
        help="polling (default), or rabbitmq: also publishing the outbox, as every runtime "
        "of the RabbitMQ lane does",
    )
    grant.add_argument(
        "--print",
        dest="print_sql",
        action="store_true",
        help="write the SQL to stdout without connecting or applying it",
    )
    grant.set_defaults(handler=_cmd_grant)
