-- Reads of the web console (runlane.web) that the operator API does not make.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Names are unique across the files of sql/.

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

-- name: web_run_search
-- One window of a search (the console's find, list_runs with a prefix, key or payload
-- filter): the %(window)s newest runs below (before_created_at, before_id), walked as
-- run_list walks them (runs_listing_by_status once per status, merged), and of those the
-- ones the filters match. Each walk reads at most %(window)s index entries and their rows,
-- so a window costs the same however rare the matches are; the caller walks window after
-- window within its time budget. Rows: every match, and the window's last run (last:
-- where the next window starts), with how many runs the window walked and the database's
-- clock_timestamp() (the budget's clock). No index serves the filters themselves (a task
-- or queue prefix, a key without its task, payload containment); docs/console.md names the
-- indexes to add for a large table searched often.
with walked as materialized (
    select l.id, l.created_at, l.matched
    from unnest(%(statuses)s::text[]) as s(status)
    cross join lateral (
        select id, created_at,
               ({@run_task_queue_filter}
                and (%(task_prefix)s::text is null
                     or starts_with(task_id, %(task_prefix)s::text))
                and (%(queue_prefix)s::text is null
                     or starts_with(queue, %(queue_prefix)s::text))
                and (%(idempotency_key)s::text is null
                     or idempotency_key = %(idempotency_key)s::text)
                and (%(payload)s::jsonb is null or payload @> %(payload)s::jsonb)) as matched
        from {schema}.runs
        where environment = %(environment)s
          and status = s.status
          and (created_at, id) < (%(before_created_at)s::timestamptz, %(before_id)s::uuid)
        order by created_at desc, id desc
        limit %(window)s
    ) as l
    order by l.created_at desc, l.id desc
    limit %(window)s
), marked as (
    select id, created_at, matched, count(*) over () as walked,
           row_number() over (order by created_at desc, id desc) = count(*) over () as last
    from walked
)
select m.last, m.matched, m.walked, m.created_at as walked_created_at, m.id as walked_id,
       clock_timestamp() as clock, r.*
from marked as m
left join lateral (
    select {@run_snapshot_columns}
    from {schema}.runs
    where id = m.id and m.matched
) as r on true
where m.matched or m.last
order by m.created_at desc, m.id desc;

-- name: web_search_indexes
-- Which of the optional search indexes docs/console.md names exist in this schema:
-- runs_payload_search (gin (payload jsonb_path_ops)) and runs_key_search ((environment,
-- idempotency_key) where idempotency_key is not null). Where one exists, a search by payload
-- or by key asks it first (web_run_search_by_payload, web_run_search_by_key).
select to_regclass('{schema}.runs_payload_search') is not null as payload,
       to_regclass('{schema}.runs_key_search') is not null as key;

-- name: web_run_search_by_payload
-- A search with a payload filter through runs_payload_search (the containment is the index
-- condition; the other filters are checked on the rows it gives), newest first.
select {@run_snapshot_columns}
from {schema}.runs
where environment = %(environment)s
  and payload @> %(payload)s::jsonb
  and status = any(%(statuses)s::text[])
  and (created_at, id) < (%(before_created_at)s::timestamptz, %(before_id)s::uuid)
  and {@run_task_queue_filter}
  and (%(task_prefix)s::text is null or starts_with(task_id, %(task_prefix)s::text))
  and (%(queue_prefix)s::text is null or starts_with(queue, %(queue_prefix)s::text))
  and (%(idempotency_key)s::text is null or idempotency_key = %(idempotency_key)s::text)
order by created_at desc, id desc
limit %(limit)s;

-- name: web_run_search_by_key
-- A search with an idempotency key through runs_key_search, newest first.
select {@run_snapshot_columns}
from {schema}.runs
where environment = %(environment)s
  and idempotency_key = %(idempotency_key)s::text
  and status = any(%(statuses)s::text[])
  and (created_at, id) < (%(before_created_at)s::timestamptz, %(before_id)s::uuid)
  and {@run_task_queue_filter}
  and (%(task_prefix)s::text is null or starts_with(task_id, %(task_prefix)s::text))
  and (%(queue_prefix)s::text is null or starts_with(queue, %(queue_prefix)s::text))
  and (%(payload)s::jsonb is null or payload @> %(payload)s::jsonb)
order by created_at desc, id desc
limit %(limit)s;

-- name: web_worker_runs
-- The runs the given workers hold a lease on now, newest start first, at most %(limit)s a
-- worker: one range of runs_live_by_queue (running rows are few: one per busy worker slot).
select worker_id::text as worker_id, id, task_id, queue, status, started_at, attempt
from (
    select worker_id, id, task_id, queue, status, started_at, attempt,
           row_number() over (partition by worker_id
                              order by started_at desc nulls last, id) as n
    from {schema}.runs
    where environment = %(environment)s
      and status in ('running', 'cancellation_requested')
      and worker_id = any(%(worker_ids)s::uuid[])
) as live
where n <= %(limit)s
order by worker_id, n;
