"""Loads the named SQL blocks of ``sql/*.sql`` and renders them for one schema.

A name is unique across the files (migrations and ``grants.sql`` are not statements: see
:func:`grant_blocks`); pieces several statements share are written once in
``fragments.sql`` and put in where a statement names them (``{@name}``).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

from runlane.errors import ConfigurationError
from runlane.toolkit import shown

__all__ = [
    "GRANTS_FILE",
    "grant_blocks",
    "load_migration_files",
    "notify_channel",
    "render",
    "statements",
    "validate_schema_name",
]

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_BLOCK_HEADER = re.compile(r"^-- name: (?P<name>[a-z_]+)\s*$", re.MULTILINE)
_FRAGMENT_HEADER = re.compile(r"^-- fragment: (?P<name>[a-z_]+)\s*$", re.MULTILINE)
_FRAGMENT_USE = re.compile(r"\{@(?P<name>[a-z_]+)\}")
# least-privilege grants: rendered with a role as well, never run by the storage
GRANTS_FILE = "grants.sql"
# the shared pieces of statements, not statements themselves
FRAGMENTS_FILE = "fragments.sql"


def validate_schema_name(schema: str) -> str:
    """Accept only plain lowercase identifiers that need no quoting tricks and are not reserved."""
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigurationError(
            f"schema name {shown(schema)} is not valid: use 1-63 lowercase letters, digits and "
            "underscores, starting with a letter or underscore"
        )
    if schema.startswith("pg_") or schema == "information_schema":
        raise ConfigurationError(f"schema name {schema!r} is reserved by PostgreSQL; pick another")
    return schema


def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel of a schema (channel names are cut at 63 bytes)."""
    return f"runlane.{schema}"[:63]


def render(text: str, schema: str, **identifiers: str) -> str:
    """Substitute the quoted schema name for ``{schema}`` in ``text``, and the schema's
    NOTIFY channel, as a string literal, for ``{channel}``; each further keyword's value,
    quoted as an identifier, for ``{keyword}``."""
    validate_schema_name(schema)
    quoted = {name: sql.Identifier(value) for name, value in identifiers.items()}
    return (
        sql.SQL(text)
        .format(
            schema=sql.Identifier(schema), channel=sql.Literal(notify_channel(schema)), **quoted
        )
        .as_string()
    )


def parse_blocks(
    files: dict[str, str], header_pattern: re.Pattern[str] = _BLOCK_HEADER
) -> dict[str, str]:
    """The named blocks of ``{file name: text}``; a name defined twice (in one file or two)
    is an error naming both places. Blocks start at ``header_pattern`` (``-- name: ...``,
    or ``-- fragment: ...`` in fragments.sql)."""
    blocks: dict[str, str] = {}
    where: dict[str, str] = {}
    for file_name in sorted(files):
        text = files[file_name]
        headers = list(header_pattern.finditer(text))
        for index, header in enumerate(headers):
            end = headers[index + 1].start() if index + 1 < len(headers) else len(text)
            name = header["name"]
            if name in blocks:
                raise RuntimeError(
                    f"statement {name!r} is defined twice: in {where[name]} and in {file_name}"
                )
            blocks[name] = text[header.end() : end].strip()
            where[name] = file_name
    return blocks


def with_fragments(blocks: dict[str, str], fragments: dict[str, str]) -> dict[str, str]:
    """``blocks`` with each ``{@name}`` replaced by fragment ``name`` (its comment lines
    left out, its own ``{@name}`` replaced in turn); a name no fragment has, or a fragment
    nothing uses, is an error."""
    texts = {
        name: "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
        for name, text in fragments.items()
    }
    used: set[str] = set()

    def put(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in texts:
            raise RuntimeError(f"a statement uses fragment {name!r}, which {FRAGMENTS_FILE} lacks")
        used.add(name)
        return _FRAGMENT_USE.sub(put, texts[name])  # a fragment may name others ({@now})

    done = {name: _FRAGMENT_USE.sub(put, body) for name, body in blocks.items()}
    unused = sorted(set(texts) - used)
    if unused:
        raise RuntimeError(f"fragments no statement uses: {unused}")
    return done


@cache
def _blocks() -> dict[str, str]:
    folder = resources.files("runlane.postgres").joinpath("sql")
    files = {
        entry.name: entry.read_text("utf-8")
        for entry in folder.iterdir()
        if entry.name.endswith(".sql")
        and entry.is_file()
        and entry.name not in {GRANTS_FILE, FRAGMENTS_FILE}
    }
    fragments = parse_blocks(
        {FRAGMENTS_FILE: folder.joinpath(FRAGMENTS_FILE).read_text("utf-8")}, _FRAGMENT_HEADER
    )
    return with_fragments(parse_blocks(files), fragments)


@cache
def grant_blocks() -> dict[str, str]:
    """The named blocks of ``grants.sql``, not rendered (``{schema}`` and ``{role}``)."""
    text = resources.files("runlane.postgres").joinpath("sql", GRANTS_FILE).read_text("utf-8")
    return parse_blocks({GRANTS_FILE: text})


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
