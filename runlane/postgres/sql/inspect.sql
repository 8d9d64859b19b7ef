-- Inspection and operator actions: listing runs, a run's history, retrying a run.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Names are unique across the files of sql/.

-- name: run_list
-- One page newest first over every status: for each status, a walk of
-- runs_listing_by_status (environment, status, created_at desc, id desc) from the previous
-- page's last run (keyset pagination: the row comparison is an index condition; the first
-- page starts from ('infinity', the largest uuid)), each walk stopping once it fills the
-- page; the walks are merged and the page cut from them. A task or queue filter is checked
-- on the rows the walks meet, bounded by the page each must fill.
select l.*
from unnest(%(statuses)s::text[]) as s(status)
cross join lateral (
    select {@run_snapshot_columns}
    from {schema}.runs
    where environment = %(environment)s
      and status = s.status
      and (created_at, id) < (%(before_created_at)s::timestamptz, %(before_id)s::uuid)
      and {@run_task_queue_filter}
    order by created_at desc, id desc
    limit %(limit)s
) as l
order by l.created_at desc, l.id desc
limit %(limit)s;

-- name: run_list_by_status
-- The same, in one status: one walk of runs_listing_by_status.
select {@run_snapshot_columns}
from {schema}.runs
where environment = %(environment)s
  and status = %(status)s
  and (created_at, id) < (%(before_created_at)s::timestamptz, %(before_id)s::uuid)
  and {@run_task_queue_filter}
order by created_at desc, id desc
limit %(limit)s;

-- name: history_snapshot
-- The three reads of a run's history see one snapshot.
set transaction isolation level repeatable read, read only;

-- name: run_attempt_list
-- Finished attempts of a run (the attempt still holding a lease is not here yet), with the
-- host of the worker that ran each while its row is kept (cleanup removes stopped and lost
-- workers after their retention).
select a.attempt, a.outcome, a.error, a.started_at, a.finished_at, a.worker_id, w.host
from {schema}.attempts as a
join {schema}.runs as r on r.id = a.run_id
left join {schema}.workers as w on w.id = a.worker_id
where a.run_id = %(id)s and r.environment = %(environment)s
order by a.attempt;

-- name: run_step_list
select s.name, s.output, s.created_at, s.attempt
from {schema}.steps as s
join {schema}.runs as r on r.id = s.run_id
where s.run_id = %(id)s and r.environment = %(environment)s
order by s.created_at, s.name;

-- name: run_retry
-- A failed or cancelled run becomes queued, due now, with a fresh attempt budget; any other
-- run, and a pruned tombstone, is left alone (migration 14's runlane_retry_runs holds the
-- statement: the operator role may retry only through it). Keyed by ids: retry_run passes
-- one (waiting for its lock), retry_runs a batch its run_bulk_pick picked (skip_locked).
-- One row per run found: its status before, whether it is a tombstone, whether it was
-- retried.
select id, status, pruned, retried
from {schema}.runlane_retry_runs(%(environment)s, %(ids)s::uuid[], %(skip_locked)s);

-- name: run_retry_audited
-- run_retry inside an audited action (retry, bulk_retry): migration 24's overload, which
-- commits only with the action's audit record (postgres/_audit.py audited).
select id, status, pruned, retried
from {schema}.runlane_retry_runs(%(environment)s, %(ids)s::uuid[], %(skip_locked)s,
                                 %(action)s);
