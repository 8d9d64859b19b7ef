"""The rules every run insert shares, written once: the run_insert statements' parameters
and the handles of the runs a statement did not write (an idempotency key met, or the same
statement repeated after its answer was lost). Used by the runs repository (``_runs.py``)
and a transport lane's eager inserts (``_eager.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from runlane.postgres._connections import Conn
from runlane.storage import InsertedRun, NewRuns

__all__ = ["array_literal", "created", "group_handles", "insert_params", "resolved"]


def insert_params(runs: NewRuns, *, one: bool = False, keyed: bool = True) -> dict[str, Any]:
    """Parameters of the run_insert statements: one row's when ``one``, else arrays;
    idempotency keys only when ``keyed`` (the "fresh" statements take none).

    A batch's payloads go as one JSON array (each is JSON text already, so joining them is
    the whole encoding) and its ids as one array literal (uuid text needs no escaping):
    element-by-element array dumping cost more than the rest of a ``trigger_many`` call."""
    params = {
        "environment": runs.environment,
        "task_id": runs.task_id,
        "queue": runs.queue,
        "priority": runs.priority,
        "max_attempts": runs.max_attempts,
        "parent_run_id": runs.parent_run_id,
        "run_at": runs.run_at,
        "delay_seconds": runs.delay.total_seconds(),
        "trace_context": runs.trace_context,
        "concurrency_key": runs.concurrency_key,
    }
    if one:
        params["id"] = runs.ids[0]
        params["payload"] = runs.payloads[0]
        if keyed:
            params["idempotency_key"] = runs.idempotency_keys[0]
    else:
        params["ids"] = array_literal(runs.ids)
        params["payloads"] = "[" + ",".join(runs.payloads) + "]"
        if keyed:
            params["idempotency_keys"] = list(runs.idempotency_keys)
    return params


def array_literal(values: Iterable[uuid.UUID | int]) -> str:
    """A Postgres array literal of uuids or integers (their text needs no quoting): much
    cheaper to make than psycopg's element-by-element array dumping, on the hot paths."""
    return "{" + ",".join(map(str, values)) + "}"


def resolved(
    conn: psycopg.Connection[Any], find: str, runs: NewRuns, inserted: set[uuid.UUID]
) -> list[InsertedRun]:
    """The handles of ``runs``, of which a statement wrote ``inserted`` (ids of ``runs``
    only); the others met an idempotency key, or were written by the same statement before
    its answer was lost (``find``: run_find_existing reads them back)."""
    if len(inserted) == len(runs.ids):
        return created(runs)
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(
            find,
            {
                "environment": runs.environment,
                "task_id": runs.task_id,
                "ids": [i for i in runs.ids if i not in inserted],
                "idempotency_keys": [k for k in runs.idempotency_keys if k is not None],
            },
        )
        found = cur.fetchall()
    by_id: dict[uuid.UUID, str] = {}
    by_key: dict[str, tuple[uuid.UUID, str]] = {}
    for run_id, key, queue_name in found:
        by_id[run_id] = queue_name
        if key is not None:
            by_key[key] = (run_id, queue_name)
    result = []
    for run_id, key in zip(runs.ids, runs.idempotency_keys, strict=True):
        if run_id in inserted:
            result.append(InsertedRun(id=run_id, queue=runs.queue, created=True))
        elif run_id in by_id:
            # a statement retried after a lost answer finds the row it wrote
            result.append(InsertedRun(id=run_id, queue=by_id[run_id], created=True))
        elif key is not None and key in by_key:
            existing_id, existing_queue = by_key[key]
            result.append(InsertedRun(id=existing_id, queue=existing_queue, created=False))
        else:
            raise RuntimeError(
                f"run {run_id} was neither inserted nor found afterwards; runlane needs "
                "the read committed isolation level for trigger(connection=...)"
            )
    return result


def group_handles(
    conn: Conn, find: str, groups: Sequence[NewRuns], inserted: set[uuid.UUID] | None
) -> list[list[InsertedRun]]:
    """Each call's handles after a shared insert that wrote ``inserted`` (None: all)."""
    return [
        created(runs)
        if inserted is None or inserted.issuperset(runs.ids)
        else resolved(conn, find, runs, inserted.intersection(runs.ids))
        for runs in groups
    ]


def created(runs: NewRuns) -> list[InsertedRun]:
    """The handles of ``runs`` all written by this call."""
    return [InsertedRun(id=i, queue=runs.queue, created=True) for i in runs.ids]
