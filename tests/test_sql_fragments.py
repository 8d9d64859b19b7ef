"""Rules written once in SQL: the shared fragments of ``sql/fragments.sql`` (a claim's
columns and what it sets, how a failed or expired attempt ends its run) that the loader puts
into the statements naming them, and the claim's row read by name.

Before, the claim's ``SET ... RETURNING`` was written in claims.sql, outbox.sql and flow.sql
and read positionally (``row[0..10]``); the fail/retry/cancel ``CASE`` was written in
lifecycle.sql and maintenance.sql.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest

from runlane import RunContext, queue, task
from runlane.postgres import PostgresStorage, _sql
from runlane.postgres._storage import CLAIM_FIELDS
from runlane.storage import ClaimedRun, QueueLimits
from tests.conftest import RunlaneFactory
from tests.helpers import q

LEASE = timedelta(seconds=30)
_SQL_DIR = Path(_sql.__file__).parent / "sql"


@task(id="frag.noop")
def noop(payload: int, context: RunContext) -> None:
    pass


def test_a_fragment_is_put_where_a_statement_names_it() -> None:
    done = _sql.with_fragments(
        {"a": "update t set {@set_x} where id = 1", "b": "select 1"},
        {"set_x": "-- what is set\nx = 1,\ny = 2"},
    )
    assert done == {"a": "update t set x = 1,\ny = 2 where id = 1", "b": "select 1"}


def test_an_unknown_or_unused_fragment_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="fragment 'nope'"):
        _sql.with_fragments({"a": "select {@nope}"}, {})
    with pytest.raises(RuntimeError, match=r"no statement uses: \['spare'\]"):
        _sql.with_fragments({"a": "select 1"}, {"spare": "1"})


def test_the_shared_rules_are_written_once() -> None:
    """Each statement that claims or ends an attempt names the fragment; none spells the
    rule out again."""
    texts = {
        name: _SQL_DIR.joinpath(name).read_text("utf-8")
        for name in ("claims.sql", "outbox.sql", "flow.sql", "lifecycle.sql", "maintenance.sql")
    }
    for name in ("claims.sql", "outbox.sql", "flow.sql"):
        assert "{@claim_set}" in texts[name], name
        assert "{@claim_returning}" in texts[name], name
        assert "lease_token = gen_random_uuid()" not in texts[name], name
    for name in ("lifecycle.sql", "maintenance.sql"):
        assert "{@attempt_end_set}" in texts[name], name
        assert "else 'retrying' end" not in texts[name], name
    rendered = _sql.statements("some_schema")
    assert not any("{@" in body for body in rendered.values())


def test_a_claims_columns_are_claimed_runs_fields_by_name(
    db: psycopg.Connection[Any], schema: str
) -> None:
    """The fragment's column names are ClaimedRun's fields, in order: the storage builds
    each ClaimedRun from them."""
    returning = _sql.parse_blocks({"fragments.sql": _fragments_text()}, _sql._FRAGMENT_HEADER)[
        "claim_returning"
    ]
    body = _sql.with_fragments(
        {"probe": "select {@claim_returning}"}, {"claim_returning": returning}
    )
    cur = db.execute(q(body["probe"] + " from {s}.runs as r limit 0", schema))
    assert cur.description is not None
    assert tuple(c.name for c in cur.description) == CLAIM_FIELDS
    assert tuple(f.name for f in attrs.fields(ClaimedRun) if f.init) == CLAIM_FIELDS


def _fragments_text() -> str:
    return _SQL_DIR.joinpath(_sql.FRAGMENTS_FILE).read_text("utf-8")


def _claim_paths(storage: PostgresStorage, ids: list[uuid.UUID]) -> dict[str, ClaimedRun]:
    """One run claimed through each claim statement."""
    named = storage.run_claim_ids("default", [ids[1]], LEASE)
    plain = storage.run_claim("default", ["plain"], 1, LEASE)
    limited = storage.run_claim_limited(
        "default", "keyed", QueueLimits(key_limit=1), 1, LEASE, run_ids=None
    ).runs
    return {"run_claim": plain[0], "run_claim_ids": named[0], "run_claim_limited": limited[0]}


def test_each_claim_returns_every_field_by_name(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], database_url: str, schema: str
) -> None:
    """A run on its third attempt, one of its earlier ones released (not spent), with a
    trace context: every claim path gives the same ClaimedRun as the row says. A column in
    the wrong place (attempt, attempts spent and max attempts are all integers) fails."""
    rl = make_runlane(
        tasks=[noop], queues=[queue("plain"), queue("keyed", key_concurrency_limit=1)]
    )
    ids = [
        rl.trigger(noop, 1, queue="plain").id,
        rl.trigger(noop, 2, queue="plain").id,
        rl.trigger(noop, 3, queue="keyed", concurrency_key="k").id,
    ]
    db.execute(
        q(
            "update {s}.runs set attempt = 2, releases = 1, max_attempts = 7, "
            "trace_context = %s::jsonb, due_at = now() - interval '1 minute'",
            schema,
        ),
        ('{"traceparent": "00-1-2-01"}',),
    )
    storage = PostgresStorage(connection_string=database_url, schema=schema)
    try:
        claimed = _claim_paths(storage, ids)
    finally:
        storage.close()
    assert [c.id for c in claimed.values()] == [ids[0], ids[1], ids[2]]
    for path, run in claimed.items():
        row = db.execute(
            q(
                "select id, task_id, queue, attempt, attempt - releases, max_attempts, "
                "lease_token, payload, lease_expires_at, trace_context, due_at "
                "from {s}.runs where id = %s",
                schema,
            ),
            (run.id,),
        ).fetchone()
        assert row is not None
        fields = [f.name for f in attrs.fields(ClaimedRun) if f.init]
        assert attrs.asdict(run, filter=lambda a, _: a.init) == dict(
            zip(fields, row, strict=True)
        ), path
        assert (run.attempt, run.attempts_consumed, run.max_attempts) == (3, 2, 7), path
        assert run.trace_context == {"traceparent": "00-1-2-01"}, path
