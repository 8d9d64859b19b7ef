-- Bulk operator actions by filter: retry, cancel, delete; and attempt progress.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Names are unique across the files of sql/.
--
-- A bulk action walks one status at a time down runs_listing_by_status (environment,
-- status, created_at desc, id desc) from a keyset cursor, one batch per transaction: each
-- batch's run_bulk_pick picks its rows and the single-run action's statement, keyed by ids,
-- locks them with SKIP LOCKED (a run a worker or another action holds is left to it, never
-- waited for) and changes them. The created_at bounds are index conditions; the task and queue
-- filters are checked on the rows the walk meets. A batch that returns fewer rows than
-- asked ended its status's walk. Every change re-checks the status it was selected for, so
-- a re-run (or the rest of an interrupted run) finds only what is left to do.
-- A selection (run_ids: the ids an operator ticked, at most MAX_RUN_IDS) is one more filter:
-- the planner reads those ids through the primary key.

-- name: run_bulk_count
-- How many runs meet the filters (at most limit): one index range per status.
select count(*)
from (
    select 1
    from {schema}.runs
    where environment = %(environment)s
      and status = any(%(statuses)s::text[])
      and pruned_at is null
      and {@bulk_filter}
    limit %(limit)s
) as matched;

-- name: run_bulk_pick
-- One batch of a bulk action: up to batch runs of one status below the cursor, newest
-- first. The caller then runs the action's single-run statement on their ids in the same
-- transaction (retry: sql/inspect.sql run_retry_audited; cancel: sql/cancel.sql
-- run_cancel_audited; delete: run_prune_ids_audited below) with skip_locked, so a run a
-- worker or another action holds is left to it; the action locks (the operator role may
-- not: it changes runs only through migration 14's functions, by migration 24's overloads
-- that commit only with the batch's audit record) and re-checks the status it applies to.
-- The last row is the cursor of the next batch.
select id, created_at
from {schema}.runs
where environment = %(environment)s
  and status = %(status)s
  and pruned_at is null
  and (created_at, id) < (%(before_created_at)s::timestamptz, %(before_id)s::uuid)
  and {@bulk_filter}
order by created_at desc, id desc
limit %(batch)s;

-- name: runs_analyze
-- Fresh statistics for runs after a bulk retry moved many runs into queued. Statistics
-- from before it say queued runs are rare, and with them the planner reads a claim's
-- queue through runs_listing_by_status and sorts it, walking the whole new backlog on
-- every claim (176 ms a claim with 300,000 retried runs due in a queue nobody serves),
-- until autovacuum analyses the table. Needs the table's owner (or, from PostgreSQL 17, the
-- MAINTAIN privilege); any other role gets a warning and changes nothing.
analyze {schema}.runs;

-- name: run_progress_many
-- context.report_progress: the last progress of each attempt that still holds its lease
-- (fenced by run id, attempt number and lease token); returns the runs written.
with input as (
    select *
    from rows from (unnest(%(ids)s::uuid[]), unnest(%(attempts)s::int[]),
                    unnest(%(lease_tokens)s::uuid[]), jsonb_array_elements(%(progress)s::jsonb))
        as i(id, attempt, lease_token, progress)
)
update {schema}.runs as r
set progress = i.progress
from input as i
where {@attempt_fence}
returning r.id;

-- name: run_prune_ids_audited
-- delete_runs' batch: cleanup's run_prune_ids (sql/maintenance.sql) through migration 24's
-- overload of runlane_delete_runs, which commits only with the batch's audit record
-- (bulk_delete). A run that is not finished is left alone.
select deleted, tombstoned, parents_updated
from {schema}.runlane_delete_runs(%(environment)s, %(ids)s::uuid[], %(skip_locked)s,
                                  %(action)s);
