"""Rules written once in SQL: the shared fragments of ``sql/fragments.sql`` (a claim's
columns and what it sets, how a failed or expired attempt ends its run, how an attempt is
handed back unspent, an attempt's fence and its row in the attempts history, a run's
snapshot columns, an operator's task and queue filter, whether a run's queue is paused, the
announcement of written outbox items, a publisher's fence on its outbox items) that the loader
puts into the statements naming them, and the claim's row read by name.

Before, the claim's ``SET ... RETURNING`` was written in claims.sql, outbox.sql and flow.sql
and read positionally (``row[0..10]``); the fail/retry/cancel ``CASE`` was written in
lifecycle.sql and maintenance.sql; the hand-back three times (lifecycle.sql run_release_many,
waits.sql run_suspend and run_release), the insert into attempts six times.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest

from runlane import RunContext, queue, task
from runlane.postgres import PostgresStorage, _sql
from runlane.postgres._attempts import CLAIM_FIELDS
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
    statement_files = {
        path.name: path.read_text("utf-8")
        for path in _SQL_DIR.glob("*.sql")
        if path.name != _sql.FRAGMENTS_FILE
    }
    for name, text in statement_files.items():
        assert "into {schema}.attempts" not in text, name
        assert "releases = r.releases + 1" not in text, name
        assert "r.lease_token = i.lease_token" not in text, name
        assert "attempt - releases as attempts_spent" not in text, name
        assert "s.queue = r.queue" not in text, name
        assert "runlane_announce(d.environment, 'outbox'" not in text, name
        assert "%(retry_delay_seconds)s::float8[]" not in text, name
        assert "task_id = %(task_id)s::text" not in text, name
        assert "o.claim_token = i.token" not in text, name
    writes = _sql.parse_blocks({n: statement_files[n] for n in ("lifecycle.sql", "waits.sql")})
    for name in ("run_release_many", "run_suspend", "run_release"):
        assert "{@attempt_hand_back_set}" in writes[name], name
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


def test_each_statement_that_ends_an_attempt_records_it(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    """The attempts row each of the six statements writes through the shared fragment: the
    attempt, its lease token, its outcome, its own error only (a hand-back keeps none of
    the run's earlier one), when it started and on which worker."""
    rl = make_runlane(tasks=[noop], queues=[queue("plain")])
    worker = uuid.uuid4()
    texts = _sql.statements(schema)

    def run(name: str, params: dict[str, Any], *, expired: bool = False) -> tuple[Any, ...]:
        run_id = rl.trigger(noop, 1, queue="plain").id
        token = uuid.uuid4()
        db.execute(
            q(
                "update {s}.runs set status = 'running', attempt = 2, lease_token = %s, "
                "lease_expires_at = now() + case when %s then interval '-1 minute' "
                "else interval '1 minute' end, worker_id = %s, "
                "attempt_started_at = '2020-01-01T00:00:00Z', error = %s::jsonb where id = %s",
                schema,
            ),
            (token, expired, worker, '{"earlier": 1}', run_id),
        )
        fence = {"id": run_id, "attempt": 2, "lease_token": token}
        batch = {"ids": [run_id], "attempts": [2], "lease_tokens": [token]}
        db.execute(texts[name], {**fence, **batch, **params, "now": None}).fetchall()
        row: tuple[Any, ...] | None = db.execute(
            q(
                "select attempt, lease_token = %s, outcome, error, started_at, worker_id "
                "from {s}.attempts where run_id = %s",
                schema,
            ),
            (token, run_id),
        ).fetchone()
        assert row is not None, name
        return row

    failed = {"errors": ['{"now": 2}'], "retry_delay_seconds": [5.0]}
    outcomes = {
        "run_complete_many": run("run_complete_many", {"outputs": "[1]"}),
        "run_fail_many": run("run_fail_many", failed),
        "run_expire_many": run("run_expire_many", failed, expired=True),
        "run_release_many": run("run_release_many", {}),
        "run_release": run("run_release", {"delay_seconds": 5.0}),
        "run_suspend": run(
            "run_suspend",
            {
                "kind": "sleep",
                "target_id": None,
                "environment": "default",
                "wake_at": datetime.now(UTC) + timedelta(hours=1),
            },
        ),
    }
    started = outcomes["run_complete_many"][4]
    assert started.year == 2020
    expected = {
        "run_complete_many": ("completed", None),
        "run_fail_many": ("retrying", {"now": 2}),
        "run_expire_many": ("expired", {"now": 2}),
        "run_release_many": ("released", None),
        "run_release": ("released", None),
        "run_suspend": ("suspended", None),
    }
    for name, outcome in expected.items():
        assert outcomes[name] == (2, True, *outcome, started, worker), name
