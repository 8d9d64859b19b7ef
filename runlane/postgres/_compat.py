"""Expand/contract: which schema versions a runtime of this release may run on.

Each migration from version 7 on says in a header line whether runtimes of the versions
before it keep working once it is applied::

    -- compatibility: additive    (new tables, defaulted columns, indexes, compatible functions)
    -- compatibility: breaking    (drops or changes what older runtimes use)

An unmarked file counts as breaking. The ledger records each applied migration's marker
(``runlane_migrations.compatibility``), so an older runtime accepts a newer schema whose
newer migrations are all additive (with a log line) and refuses one with a breaking one
(``IncompatibleSchema``). The marker line is left out of the checksum.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import attrs

from runlane.errors import IncompatibleSchema, SchemaNotMigrated

__all__ = [
    "ADDITIVE",
    "BREAKING",
    "LedgerRow",
    "check_runtime_ledger",
    "marker_of",
    "newer_than_known",
    "without_marker",
]

ADDITIVE = "additive"
BREAKING = "breaking"
_MARKER = re.compile(r"^-- compatibility: *(\S+) *\n?", re.MULTILINE)


def marker_of(text: str) -> str:
    """The migration's marker: ``additive`` or ``breaking`` (unmarked, or anything else,
    counts as breaking)."""
    match = _MARKER.search(text)
    return ADDITIVE if match is not None and match[1] == ADDITIVE else BREAKING


def without_marker(text: str) -> str:
    """The text a checksum is computed over: the marker line removed."""
    return _MARKER.sub("", text, count=1)


@attrs.frozen
class LedgerRow:
    version: int
    name: str
    checksum: str
    compatibility: str | None  # None: recorded by a runner that predates the column


def newer_than_known(rows: Iterable[LedgerRow], latest: int, schema: str) -> list[LedgerRow]:
    """The rows above ``latest``; raises IncompatibleSchema naming the first that is not
    additive (a newer runtime's contract step: this one must not run on the schema)."""
    newer = [row for row in rows if row.version > latest]
    for row in newer:
        if row.compatibility != ADDITIVE:
            raise IncompatibleSchema(
                f"schema {schema!r} is at version {newer[-1].version}, and its migration "
                f"{row.version} ({row.name}) is marked {row.compatibility or 'breaking'}: "
                f"this runlane (schema version {latest}) cannot run on it; upgrade runlane in "
                "this application (see docs/deploying.md, 'Upgrades and rollbacks')"
            )
    return newer


def check_runtime_ledger(
    rows: list[LedgerRow], known: dict[int, str], schema: str, migrate_hint: str
) -> str | None:
    """Check a runtime's schema against this release's migrations (``known``: checksum by
    version). Returns None when the schema is exactly this release's, a note to log when it
    is newer and additive; raises SchemaNotMigrated when older, IncompatibleSchema when
    made by another release or newer and breaking."""
    latest = max(known, default=0)
    version = max((row.version for row in rows), default=0)
    if any(row.version <= latest and known.get(row.version) != row.checksum for row in rows):
        raise IncompatibleSchema(
            f"schema {schema!r} was made by another runlane release (its migration "
            "ledger's checksums differ); migrate into a fresh schema"
        )
    if version < latest:
        raise SchemaNotMigrated(
            f"schema {schema!r} is at version {version}, this runlane needs {latest}: "
            f"{migrate_hint}"
        )
    newer = newer_than_known(rows, latest, schema)
    if not newer:
        return None
    return (
        f"schema {schema!r} is at version {version}, newer than this runlane's {latest}; "
        f"migrations {', '.join(f'{r.version} ({r.name})' for r in newer)} are additive, so "
        "this runtime runs on it (expand/contract); upgrade the application to use them"
    )
