"""The time the statements read as now (``{@now}`` in ``sql/fragments.sql``): the
database's own, unless a test gave the lane a clock it moves
(:class:`runlane.testing.MovableClock`).

Every statement that reads the clock takes a ``now`` parameter, None in production; the
executor's cursors add it, so no caller passes it. With a clock they also set the session's
``runlane.now`` to that moment first: the triggers and functions read it (``runlane_now()``,
schema version 19), so one moment is now for a statement and what it fires."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, cast

import psycopg
from psycopg.abc import Params, Query, QueryNoTemplate

__all__ = ["NOW_PARAMETER", "Clock", "now_cursor", "set_now"]

#: A clock a test moves: the time the statements read as now.
Clock = Callable[[], datetime]

#: How a statement names the moved time (the placeholder of the fragment ``now``).
NOW_PARAMETER = "%(now)s"

#: A SET statement (after its comment lines): SET TRANSACTION must come first in its
#: transaction, so the clock is not set before one.
_SET_STATEMENT = re.compile(r"(?:\s*--[^\n]*\n)*\s*set\s", re.IGNORECASE)

_SET_NOW = "select pg_catalog.set_config('runlane.now', %s, false)"


def set_now(conn: psycopg.Connection[Any], moment: datetime) -> None:
    """Make ``moment`` now for the triggers and functions of the session (through a plain
    cursor: the connection's own would set it again)."""
    psycopg.Cursor(conn).execute(_SET_NOW, (moment.isoformat(),))


def now_cursor(clock: Clock | None) -> type[psycopg.Cursor[Any]]:
    """A cursor class that adds ``now`` (``clock()``, or None: the database's) to the
    parameters of each statement naming it."""

    def with_now(query: Query, params: Params | None, moment: datetime | None) -> Params | None:
        if not isinstance(query, str) or NOW_PARAMETER not in query:
            return params
        if params is not None and not isinstance(params, Mapping):
            raise TypeError("a statement reading the clock takes its parameters by name")
        return {**(params or {}), "now": moment}

    class NowCursor(psycopg.Cursor[Any]):
        def _moment(self, query: Query) -> datetime | None:
            if clock is None:
                return None
            moment = clock()
            # SET TRANSACTION must be its transaction's first statement
            if not (isinstance(query, str) and _SET_STATEMENT.match(query)):
                set_now(self.connection, moment)
            return moment

        def execute(
            self,
            query: Query,
            params: Params | None = None,
            *,
            prepare: bool | None = None,
            binary: bool | None = None,
        ) -> NowCursor:
            # a template query (t-string) takes no parameters and is passed on as it is
            text = cast(QueryNoTemplate, query)
            moment = self._moment(query)
            super().execute(text, with_now(query, params, moment), prepare=prepare, binary=binary)
            return self

        def executemany(
            self, query: Query, params_seq: Iterable[Params], *, returning: bool = False
        ) -> None:
            moment = self._moment(query)
            rows = [with_now(query, params, moment) or {} for params in params_seq]
            super().executemany(query, rows, returning=returning)

    return NowCursor
