"""Loads the named SQL blocks in ``sql/`` and renders them for one schema."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

from runlane.errors import ConfigurationError

__all__ = ["load_migration_files", "render", "statements", "validate_schema_name"]

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_BLOCK_HEADER = re.compile(r"^-- name: (?P<name>[a-z_]+)\s*$", re.MULTILINE)


def validate_schema_name(schema: str) -> str:
    """Accept only plain lowercase identifiers that need no quoting tricks and are not reserved."""
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigurationError(
            f"schema name {schema!r} is not valid: use 1-63 lowercase letters, digits and "
            "underscores, starting with a letter or underscore"
        )
    if schema.startswith("pg_") or schema == "information_schema":
        raise ConfigurationError(f"schema name {schema!r} is reserved by PostgreSQL; pick another")
    return schema


def render(text: str, schema: str) -> str:
    """Substitute the quoted schema name for ``{schema}`` in ``text``."""
    validate_schema_name(schema)
    return sql.SQL(text).format(schema=sql.Identifier(schema)).as_string()


def _read(*parts: str) -> str:
    return resources.files("runlane.postgres").joinpath("sql", *parts).read_text("utf-8")


@cache
def _blocks() -> dict[str, str]:
    text = _read("queries.sql")
    headers = list(_BLOCK_HEADER.finditer(text))
    blocks: dict[str, str] = {}
    for index, header in enumerate(headers):
        end = headers[index + 1].start() if index + 1 < len(headers) else len(text)
        body = text[header.end() : end].strip()
        if header["name"] in blocks:
            raise RuntimeError(f"queries.sql defines {header['name']!r} twice")
        blocks[header["name"]] = body
    return blocks


def statements(schema: str) -> dict[str, str]:
    """Every named statement, rendered for ``schema``."""
    return {name: render(body, schema) for name, body in _blocks().items()}


@cache
def load_migration_files() -> tuple[tuple[int, str, str], ...]:
    """``(version, name, text)`` of each migration file, in version order."""
    folder = resources.files("runlane.postgres").joinpath("sql", "migrations")
    found = []
    for entry in folder.iterdir():
        match = re.match(r"^(\d{4})_([a-z0-9_]+)\.sql$", entry.name)
        if match:
            found.append((int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort()
    versions = [version for version, _, _ in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migration files are not numbered 1..n: {versions}")
    return tuple(found)
