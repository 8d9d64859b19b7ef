"""Least-privilege grants: what an application role needs for one job in a runlane schema.

The SQL lives in ``sql/grants.sql`` (named blocks); this module renders it for a schema and a
role, and applies it in one transaction.
"""

from __future__ import annotations

import re
from typing import Any, Final

import attrs
import psycopg

from runlane.errors import ConfigurationError, SchemaNotMigrated
from runlane.postgres._connections import (
    DEFAULT_CONNECT_TIMEOUT,
    check_conninfo,
    connect_seconds,
    storage_error,
)
from runlane.postgres._sql import grant_blocks, render, validate_schema_name
from runlane.toolkit import shown

__all__ = [
    "GRANT_JOBS",
    "GRANT_LANES",
    "GrantResult",
    "grant_postgres_role",
    "postgres_grant_sql",
]

GRANT_JOBS: Final = ("producer", "worker", "maintenance", "operator")
"""The jobs a role can be granted, each with only the privileges it needs."""

GRANT_LANES: Final = ("polling", "rabbitmq")
"""The lanes grants are made for: the RabbitMQ lane adds publishing the outbox."""

# Plain role names: letters, digits and ``_ $ . @ -`` (cloud providers' ``user@server``),
# at most 63 bytes. Anything else is refused before it reaches SQL (and is quoted anyway).
_ROLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$.@-]{0,62}$")
_RESERVED_ROLES = frozenset({"public", "none", "current_role", "current_user", "session_user"})
_CONNECT_TIMEOUT = connect_seconds(DEFAULT_CONNECT_TIMEOUT)  # unless the string sets one
_PRIVILEGE_NOT_GRANTED = "01007"  # a warning: the grantor lacks the grant option


@attrs.frozen
class GrantResult:
    """What :func:`grant_postgres_role` granted: ``job`` in ``schema`` to ``role``, for
    ``lane``, by running ``sql``."""

    schema: str
    role: str
    job: str
    lane: str
    sql: str = attrs.field(repr=False)


def _check_job(job: object) -> str:
    if not isinstance(job, str) or job not in GRANT_JOBS:
        raise ConfigurationError(
            f"unknown job {shown(job)}: grant one of {', '.join(GRANT_JOBS)} "
            "(a role with several jobs is granted each of them)"
        )
    return job


def _check_lane(lane: object) -> str:
    if not isinstance(lane, str) or lane not in GRANT_LANES:
        raise ConfigurationError(f"unknown lane {shown(lane)}: use one of {', '.join(GRANT_LANES)}")
    return lane


def validate_role_name(role: object) -> str:
    """Accept plain role names only; the name is quoted as an identifier in the SQL too."""
    if not isinstance(role, str) or not _ROLE_NAME.fullmatch(role):
        raise ConfigurationError(
            f"role name {shown(role)} is not valid: use 1-63 letters, digits and _ $ . @ -, "
            "starting with a letter or underscore"
        )
    if role.lower() in _RESERVED_ROLES or role.lower().startswith("pg_"):
        raise ConfigurationError(
            f"role name {role!r} is reserved by PostgreSQL: grant to a role of your own"
        )
    return role


def postgres_grant_sql(
    *, job: str, role: str, schema: str = "runlane", lane: str = "polling"
) -> str:
    """The SQL granting ``role`` what ``job`` needs in ``schema``, without running it.

    ``job`` is one of ``producer``, ``worker``, ``maintenance`` and ``operator`` (see
    ``docs/security.md`` for what each may do). ``lane="rabbitmq"`` adds what every
    runtime of the RabbitMQ lane does whatever its job: enabling its environment's outbox
    and publishing it. Names are validated and quoted; a bad job, lane, role or schema
    name raises :class:`~runlane.ConfigurationError`. The role must exist when the SQL
    runs, and the schema must be migrated.
    """
    grants, revokes = _grant_parts(job=job, role=role, schema=schema, lane=lane)
    return _script(job, schema, lane, grants, revokes)


def _script(job: str, schema: str, lane: str, grants: str, revokes: str) -> str:
    header = f"-- runlane: the {job} job in schema {schema} ({lane} lane)"
    return "\n\n".join([header, grants, revokes]) + "\n"


def _grant_parts(*, job: str, role: str, schema: str, lane: str) -> tuple[str, str]:
    """The job's grants, and the revokes of what earlier releases granted and no job holds."""
    _check_job(job)
    _check_lane(lane)
    validate_role_name(role)
    validate_schema_name(schema)
    blocks = grant_blocks()
    names = ["grant_common", f"grant_{job}"]
    if lane == "rabbitmq":
        names.append("grant_publisher")
    grants = "\n\n".join(render(blocks[name], schema, role=role) for name in names)
    return grants, render(blocks["revoke_stale"], schema, role=role)


def grant_postgres_role(
    *,
    connection_string: str,
    job: str,
    role: str,
    schema: str = "runlane",
    lane: str = "polling",
) -> GrantResult:
    """Grant ``role`` the privileges of ``job`` in ``schema`` (see :func:`postgres_grant_sql`),
    in one transaction.

    Connect as the schema's owner (the role that ran the migrations) or a superuser. The
    role must exist (``CREATE ROLE app_producer LOGIN PASSWORD '...'``): one that does not
    raises :class:`~runlane.ConfigurationError`, an unmigrated schema
    :class:`~runlane.SchemaNotMigrated`, a connecting role that may not grant
    :class:`~runlane.ConfigurationError`, a database that cannot be reached
    :class:`~runlane.StorageUnavailable`. Granting twice changes nothing; a role may hold
    several jobs. Run it again after a migration to a new schema version.
    """
    grants, revokes = _grant_parts(job=job, role=role, schema=schema, lane=lane)
    text = _script(job, schema, lane, grants, revokes)
    params = check_conninfo(connection_string)
    # libpq waits forever for an unreachable host unless told otherwise
    timeout: dict[str, Any] = (
        {} if "connect_timeout" in params else {"connect_timeout": _CONNECT_TIMEOUT}
    )
    try:
        with psycopg.connect(connection_string, autocommit=True, **timeout) as conn:
            # a grantor holding a privilege without its grant option gets a warning, not an
            # error, and grants nothing: collected, and the transaction rolled back
            skipped: list[str] = []
            conn.add_notice_handler(
                lambda notice: (
                    skipped.append(notice.message_primary or "")
                    if notice.sqlstate == _PRIVILEGE_NOT_GRANTED
                    else None
                )
            )
            with conn.transaction():
                _check_target(conn, role, schema)
                conn.execute(grants.encode("utf-8"))
                if skipped:
                    raise ConfigurationError(
                        f"the connected role may not grant everything the {job} job needs on "
                        f"schema {schema!r} ({skipped[0]}; {len(skipped)} such warnings); "
                        "nothing was granted: connect as the schema's owner (the role that "
                        "ran `runlane migrate`) or a superuser"
                    )
                conn.execute(revokes.encode("utf-8"))
    except psycopg.errors.InsufficientPrivilege as exc:
        raise ConfigurationError(
            f"the connected role may not grant on schema {schema!r} "
            f"({exc.diag.message_primary}): connect as the schema's owner (the role that "
            "ran `runlane migrate`) or a superuser"
        ) from exc
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction) as exc:
        raise SchemaNotMigrated(
            f"schema {schema!r} lacks what this runlane grants on "
            f"({exc.diag.message_primary}): run `runlane migrate --schema {schema}` first"
        ) from exc
    except psycopg.Error as exc:
        raise storage_error(
            exc, connection_string, f"grant the {job} job on schema {schema!r} to {role!r}"
        ) from exc
    return GrantResult(schema=schema, role=role, job=job, lane=lane, sql=text)


def _check_target(conn: psycopg.Connection[Any], role: str, schema: str) -> None:
    """The role and the schema exist; else a runlane error saying what to create."""
    row = conn.execute(
        "select exists (select from pg_roles where rolname = %s), "
        "(select min(rolname) from pg_roles where lower(rolname) = lower(%s)), "
        "exists (select from pg_namespace where nspname = %s)",
        (role, role, schema),
    ).fetchone()
    assert row is not None
    role_exists, similar, schema_exists = row
    if not role_exists:
        hint = ""
        if similar is not None:
            hint = f" (role names are case-sensitive: there is a role {similar!r})"
        raise ConfigurationError(
            f"role {role!r} does not exist{hint}: create it first, e.g. "
            f"CREATE ROLE {_quoted(role)} LOGIN PASSWORD '...', then grant again"
        )
    if not schema_exists:
        raise SchemaNotMigrated(
            f"schema {schema!r} does not exist: run `runlane migrate --schema {schema}` "
            "(as its future owner) first, then grant"
        )


def _quoted(role: str) -> str:
    return role if re.fullmatch(r"[a-z_][a-z0-9_]*", role) else '"' + role + '"'
