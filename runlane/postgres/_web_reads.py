"""The web repository: the console's reads (:mod:`runlane.web`): throughput over the last
hour, a run's wait, trace context and children, and the estimated size of runs. The
statements are in ``sql/web.sql``; each is served by an index (or the catalog) whatever the
table's size.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from psycopg.rows import dict_row

from runlane.postgres._connections import Conn
from runlane.postgres._executor import Executor

__all__ = ["WebReadRepository"]


class WebReadRepository:
    """Console reads."""

    def __init__(self, db: Executor) -> None:
        self._db = db
        self._sql = db.sql

    def web_throughput(self, environment: str, cap: int) -> dict[str, Any]:
        params = {"environment": environment, "cap": cap}

        def read(conn: Conn) -> dict[str, Any]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["web_throughput"], params)
                row = cur.fetchone()
            assert row is not None
            minutes = [
                (datetime.fromisoformat(m), int(c), int(f), int(x)) for m, c, f, x in row["minutes"]
            ]
            return {"now_minute": row["now_minute"], "edge": row["edge"], "minutes": minutes}

        return self._db.run(read)

    def web_run_extras(
        self, environment: str, run_id: uuid.UUID, children_limit: int
    ) -> dict[str, Any] | None:
        params = {"environment": environment, "id": run_id, "limit": children_limit}

        def read(conn: Conn) -> dict[str, Any] | None:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["web_run_extras"], params)
                row = cur.fetchone()
                if row is None:
                    return None
                cur.execute(self._sql["web_run_children"], params)
                return {**row, "children": cur.fetchall()}

        return self._db.run(read)

    def web_runs_estimate(self) -> int:
        def read(conn: Conn) -> int:
            row = conn.execute(self._sql["web_runs_estimate"]).fetchone()
            return 0 if row is None else int(row[0])

        return self._db.run(read)
