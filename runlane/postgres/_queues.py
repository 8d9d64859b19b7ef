"""The queues repository: the operator's pause, resume and list.

The statements are in ``sql/queues.sql`` and the table in migration 6. The pause itself is
enforced by the claim statements (``run_claim``, ``run_claim_ids``), which leave paused
queues out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from psycopg.rows import dict_row

from runlane.postgres._connections import Conn
from runlane.postgres._executor import Executor

__all__ = ["RECENT_FINISHED", "QueueRepository", "status_queues"]

log = logging.getLogger("runlane.postgres")

# queue_list's count columns, one per unfinished status
_UNFINISHED = ("queued", "running", "cancellation_requested", "retrying", "released", "waiting")

# finished runs (the newest) whose queues queue_list lists too, when nothing else lists them
RECENT_FINISHED = 10_000

# runs given outbox items again per statement when a queue resumes on a transport lane
RESUME_BATCH = 1_000


class QueueRepository:
    """Queue operator statements."""

    def __init__(self, db: Executor) -> None:
        self._db = db
        self._sql = db.sql

    def queue_pause(self, environment: str, queue: str, reason: str | None) -> bool:
        """Pause ``queue`` with ``reason`` (replacing an earlier one); True when it was not
        paused before."""
        params = {"environment": environment, "queue": queue, "reason": reason}

        def pause(conn: Conn) -> bool:
            row = conn.execute(self._sql["queue_pause"], params).fetchone()
            return bool(row and row[0])

        return self._db.run(pause)

    def queue_resume(self, environment: str, queue: str) -> bool:
        """Resume ``queue`` and announce it; True when it was paused. On a transport lane
        (the environment has an outbox) its queued runs that lost their outbox item while it
        was paused get one again, in batches of RESUME_BATCH statements of their own (a
        resume interrupted part way is finished by repeating it, or by delivery recovery)."""
        params: dict[str, Any] = {"environment": environment, "queue": queue}

        def resume(conn: Conn) -> tuple[bool, bool]:
            row = conn.execute(self._sql["queue_resume"], params).fetchone()
            assert row is not None
            return bool(row[0]), bool(row[1])

        changed, has_outbox = self._db.run(resume)
        if has_outbox:
            written = self._db.run(lambda conn: self._write_outbox_items(conn, params))
            log.debug("runlane: queue %r resumed: %d outbox items written", queue, written)
        return changed

    def _write_outbox_items(self, conn: Conn, params: dict[str, Any]) -> int:
        """One scan of the queue's queued runs (a cursor held across commits), each batch of
        them given items in a statement of its own (connections are in autocommit)."""
        written = 0
        with conn.cursor(name="runlane_queue_resume", withhold=True) as cur:
            cur.execute(self._sql["queue_queued_ids"], params)
            while batch := cur.fetchmany(RESUME_BATCH):
                rows = conn.execute(
                    self._sql["queue_outbox_write"], {**params, "ids": [r[0] for r in batch]}
                ).fetchall()
                written += len(rows)
        return written

    def queue_known(self, environment: str, queue: str) -> bool:
        """Whether the database knows ``queue``: a queue_states row or runs of it."""
        params = {"environment": environment, "queue": queue}

        def known(conn: Conn) -> bool:
            row = conn.execute(self._sql["queue_known"], params).fetchone()
            return bool(row and row[0])

        return self._db.run(known)

    def queue_list(self, environment: str) -> list[dict[str, Any]]:
        """One mapping per queue with unfinished runs or a queue_states row (the statement
        queue_list), and per queue of the newest RECENT_FINISHED finished runs that has
        neither (queue_recent; its counts 0, not paused), by name: ``queue``, ``paused``,
        ``paused_reason``, ``paused_at``, the count of each unfinished status by its value,
        ``claimed`` (running runs whose handler has not been seen to start),
        ``live_leases``, and ``oldest_queued_age`` (seconds, None when none is due).
        status_counts reads the statement queue_list alone (see status_queues)."""
        params = {"environment": environment, "limit": RECENT_FINISHED}

        def listed(conn: Conn) -> list[dict[str, Any]]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["queue_list"], params)
                rows = {str(row["queue"]): dict(row) for row in cur.fetchall()}
                cur.execute(self._sql["queue_recent"], params)
                recent = [str(row["queue"]) for row in cur.fetchall()]
            for name in recent:
                rows.setdefault(name, _finished_only(name))
            return [rows[name] for name in sorted(rows)]

        return self._db.run(listed)


def _finished_only(name: str) -> dict[str, Any]:
    """queue_list's row for a queue whose runs have all finished and that is not paused."""
    return {
        "queue": name,
        "paused": False,
        "paused_reason": None,
        "paused_at": None,
        **dict.fromkeys(_UNFINISHED, 0),
        "claimed": 0,
        "live_leases": 0,
        "oldest_queued_age": None,
    }


def status_queues(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``status_counts``' queues from ``queue_list``'s rows: the paused queues and those with
    unfinished runs (a queue with only an unpaused queue_states row is left out), with the
    counts of QueueStatus: ``running`` the runs whose handler started (and the
    cancellation_requested ones), ``claimed`` the running runs whose handler has not been
    seen to start, ``retrying`` retrying and released runs."""
    return [
        {
            "queue": row["queue"],
            "queued": row["queued"],
            "running": row["running"] - row["claimed"] + row["cancellation_requested"],
            "claimed": row["claimed"],
            "retrying": row["retrying"] + row["released"],
            "waiting": row["waiting"],
            "live_leases": row["live_leases"],
            "paused": row["paused"],
        }
        for row in rows
        if row["paused"] or any(row[status] for status in _UNFINISHED)
    ]
