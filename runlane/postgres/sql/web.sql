-- Reads of the web console (runlane.web) that the operator API does not make.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Names are unique across the files of sql/.

-- name: web_throughput
-- Runs finished per minute over the last hour (database time), by terminal status: a walk of
-- runs_finished newest first, bounded by %(cap)s rows so that an hour of millions of
-- finishes still answers fast (then the oldest minutes read are partial, and "read" says
-- how many rows were read). Pruned runs are not counted.
with recent as (
    select status, finished_at
    from {schema}.runs
    where environment = %(environment)s
      and status in ('completed', 'failed', 'cancelled')
      and pruned_at is null
      and finished_at >= date_trunc('minute', now()) - interval '59 minutes'
    order by finished_at desc
    limit %(cap)s
)
select date_trunc('minute', now()) as now_minute,
       (select count(*) from recent) as read,
       (select min(finished_at) from recent) as oldest,
       coalesce((
           select json_agg(json_build_array(m.minute, m.completed, m.failed, m.cancelled)
                           order by m.minute)
           from (
               select date_trunc('minute', finished_at) as minute,
                      count(*) filter (where status = 'completed') as completed,
                      count(*) filter (where status = 'failed') as failed,
                      count(*) filter (where status = 'cancelled') as cancelled
               from recent
               group by 1
           ) as m
       ), '[]'::json) as minutes;

-- name: web_run_extras
-- What a run's page shows beyond its snapshot: its wait, its trace context, whether it is a
-- tombstone.
select wait_kind, wait_token_id, wait_run_id, trace_context, worker_id,
       pruned_at, remaining_children
from {schema}.runs
where id = %(id)s and environment = %(environment)s;

-- name: web_run_children
-- A run's children, newest first, at most %(limit)s (runs_parent).
select id, task_id, queue, status, created_at, finished_at
from {schema}.runs
where parent_run_id = %(id)s and environment = %(environment)s
order by created_at desc, id desc
limit %(limit)s;

-- name: web_runs_estimate
-- The planner's estimate of the rows of runs (every environment): no scan.
select greatest(reltuples, 0)::bigint
from pg_catalog.pg_class
where oid = '{schema}.runs'::regclass;
