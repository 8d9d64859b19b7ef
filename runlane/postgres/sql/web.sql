-- Reads of the web console (runlane.web) that the operator API does not make.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Names are unique across the files of sql/.

-- name: web_throughput
-- Runs finished per minute over the last hour (database time), by terminal status, in one
-- pass over runs_finished. An hour of more than %(cap)s finishes is counted from the
-- %(cap)s-th newest on ("edge": found by walking the index newest first), so that millions
-- of finishes an hour still answer fast. Pruned runs are not counted.
with bounds as (
    select date_trunc('minute', {@now}) as now_minute,
           date_trunc('minute', {@now}) - interval '59 minutes' as hour_start
), edge as (
    select finished_at
    from {schema}.runs
    where environment = %(environment)s
      and status in ('completed', 'failed', 'cancelled')
      and pruned_at is null
      and finished_at >= (select hour_start from bounds)
    order by finished_at desc
    offset %(cap)s
    limit 1
), minutes as (
    select date_trunc('minute', finished_at) as minute,
           count(*) filter (where status = 'completed') as completed,
           count(*) filter (where status = 'failed') as failed,
           count(*) filter (where status = 'cancelled') as cancelled
    from {schema}.runs
    where environment = %(environment)s
      and status in ('completed', 'failed', 'cancelled')
      and pruned_at is null
      and finished_at >= (select hour_start from bounds)
      and finished_at > coalesce((select finished_at from edge), '-infinity')
    group by 1
)
select (select now_minute from bounds) as now_minute,
       (select finished_at from edge) as edge,
       coalesce((
           select json_agg(json_build_array(minute, completed, failed, cancelled)
                           order by minute)
           from minutes
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
