-- Cancellation.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row. Names are unique across the files of sql/.

-- name: run_cancel
-- Queued, retrying, released and waiting runs are cancelled at once; a running run is asked
-- to stop and ends cancelled when its handler returns or its lease lapses (migration 14's
-- runlane_cancel_runs holds the statement: the operator role may cancel only through it).
-- Keyed by ids: cancel passes one (waiting for its lock), cancel_runs a batch its
-- run_bulk_pick picked (skip_locked: a run a worker or another action holds is left to it).
-- One row per run found: its status before, and after (null: not cancellable, left alone).
select id, previous, current
from {schema}.runlane_cancel_runs(%(environment)s, %(ids)s::uuid[], %(skip_locked)s);

-- name: run_cancel_audited
-- run_cancel inside an audited action (cancel, bulk_cancel): migration 24's overload, which
-- commits only with the action's audit record (postgres/_audit.py audited).
select id, previous, current
from {schema}.runlane_cancel_runs(%(environment)s, %(ids)s::uuid[], %(skip_locked)s,
                                  %(action)s);
