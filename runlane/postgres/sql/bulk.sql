-- Bulk operator actions by filter: retry, cancel, delete; and attempt progress.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Names are unique across the files of sql/.
--
-- A bulk action walks one status at a time down runs_listing_by_status (environment,
-- status, created_at desc, id desc) from a keyset cursor, one batch per statement: each
-- batch is its own short transaction that locks its rows with SKIP LOCKED (a run a worker
-- or another action holds is left to it, never waited for) and changes them as the
-- single-run action does. The created_at bounds are index conditions; the task and queue
-- filters are checked on the rows the walk meets. A batch that returns fewer rows than
-- asked ended its status's walk. Every change re-checks the status it was selected for, so
-- a re-run (or the rest of an interrupted run) finds only what is left to do.

-- name: run_bulk_count
-- How many runs meet the filters (at most limit): one index range per status.
select count(*)
from (
    select 1
    from {schema}.runs
    where environment = %(environment)s
      and status = any(%(statuses)s::text[])
      and pruned_at is null
      and (%(created_after)s::timestamptz is null or created_at >= %(created_after)s)
      and (%(created_before)s::timestamptz is null or created_at < %(created_before)s)
      and (%(task_id)s::text is null or task_id = %(task_id)s::text)
      and (%(queue)s::text is null or queue = %(queue)s::text)
    limit %(limit)s
) as matched;

-- name: run_bulk_retry
-- retry_run (sql/inspect.sql run_retry) for a batch of failed or cancelled runs: queued,
-- due now, a fresh attempt budget (releases = attempt), error, output and finish cleared,
-- history and steps kept. The update trigger announces them (and writes their outbox items
-- in outbox environments).
with batch as materialized (
    select id, created_at
    from {schema}.runs
    where environment = %(environment)s
      and status = %(status)s
      and status in ('failed', 'cancelled')
      and pruned_at is null
      and (created_at, id) < (%(before_created_at)s::timestamptz, %(before_id)s::uuid)
      and (%(created_after)s::timestamptz is null or created_at >= %(created_after)s)
      and (%(created_before)s::timestamptz is null or created_at < %(created_before)s)
      and (%(task_id)s::text is null or task_id = %(task_id)s::text)
      and (%(queue)s::text is null or queue = %(queue)s::text)
    order by created_at desc, id desc
    limit %(batch)s
    for update skip locked
), changed as (
    update {schema}.runs as r
    set status = 'queued',
        due_at = now(),
        releases = r.attempt,
        error = null,
        output = null,
        finished_at = null,
        lease_token = null,
        lease_expires_at = null,
        wait_kind = null,
        wait_token_id = null,
        wait_run_id = null,
        updated_at = now()
    from batch as b
    where r.id = b.id
    returning r.id
), last as (
    select created_at, id from batch order by created_at, id limit 1
)
select (select count(*) from batch) as visited,
       (select count(*) from changed) as changed,
       (select created_at from last) as last_created_at,
       (select id from last) as last_id;

-- name: run_bulk_cancel
-- cancel (sql/cancel.sql run_cancel) for a batch: queued, retrying, released and waiting
-- runs are cancelled at once; running runs become cancellation_requested (their workers
-- hear it announced by the update trigger). Runs waiting on a run cancelled here are
-- resumed by the update trigger.
with batch as materialized (
    select id, created_at, status
    from {schema}.runs
    where environment = %(environment)s
      and status = %(status)s
      and status in ('queued', 'retrying', 'released', 'waiting', 'running')
      and pruned_at is null
      and (created_at, id) < (%(before_created_at)s::timestamptz, %(before_id)s::uuid)
      and (%(created_after)s::timestamptz is null or created_at >= %(created_after)s)
      and (%(created_before)s::timestamptz is null or created_at < %(created_before)s)
      and (%(task_id)s::text is null or task_id = %(task_id)s::text)
      and (%(queue)s::text is null or queue = %(queue)s::text)
    order by created_at desc, id desc
    limit %(batch)s
    for update skip locked
), changed as (
    update {schema}.runs as r
    set status = case when b.status = 'running' then 'cancellation_requested'
                      else 'cancelled' end,
        finished_at = case when b.status = 'running' then null else now() end,
        wait_kind = null,
        wait_token_id = null,
        wait_run_id = null,
        updated_at = now()
    from batch as b
    where r.id = b.id
    returning r.id
), last as (
    select created_at, id from batch order by created_at, id limit 1
)
select (select count(*) from batch) as visited,
       (select count(*) from changed) as changed,
       (select created_at from last) as last_created_at,
       (select id from last) as last_id;

-- name: run_bulk_delete
-- Deletes a batch of terminal runs as cleanup does (sql/maintenance.sql run_prune): one
-- that still has children becomes a tombstone counting them, and each deleted child
-- lowers its tombstoned parent's count (cleanup deletes a tombstone once it reaches
-- zero). A deleted run's attempts go with it; its steps through their foreign key.
with doomed as materialized (
    select id, created_at, parent_run_id
    from {schema}.runs
    where environment = %(environment)s
      and status = %(status)s
      and status in ('completed', 'failed', 'cancelled')
      and pruned_at is null
      and (created_at, id) < (%(before_created_at)s::timestamptz, %(before_id)s::uuid)
      and (%(created_after)s::timestamptz is null or created_at >= %(created_after)s)
      and (%(created_before)s::timestamptz is null or created_at < %(created_before)s)
      and (%(task_id)s::text is null or task_id = %(task_id)s::text)
      and (%(queue)s::text is null or queue = %(queue)s::text)
    order by created_at desc, id desc
    limit %(batch)s
    for update skip locked
), child_counts as (
    select c.parent_run_id as id, count(*) as n
    from {schema}.runs as c
    where c.parent_run_id in (select id from doomed)
    group by c.parent_run_id
), surviving as (
    -- children that outlive this statement: not doomed, or doomed but tombstoned themselves
    select c.parent_run_id as id, count(*) as n
    from {schema}.runs as c
    where c.parent_run_id in (select id from child_counts)
      and (c.id not in (select id from doomed) or c.id in (select id from child_counts))
    group by c.parent_run_id
), tombstoned as (
    update {schema}.runs as r
    set pruned_at = now(), remaining_children = coalesce(s.n, 0), payload = 'null'::jsonb,
        output = null, updated_at = now()
    from child_counts as cc
    left join surviving as s on s.id = cc.id
    where r.id = cc.id
    returning r.id
), deleted as (
    delete from {schema}.runs as r
    using doomed as d
    where r.id = d.id and d.id not in (select id from child_counts)
    returning r.id, r.parent_run_id
), attempts_deleted as (
    delete from {schema}.attempts as a
    using deleted as d
    where a.run_id = d.id
), parents as (
    update {schema}.runs as p
    set remaining_children = p.remaining_children - g.n, updated_at = now()
    from (select parent_run_id, count(*) as n from deleted
          where parent_run_id is not null group by parent_run_id) as g
    where p.id = g.parent_run_id and p.pruned_at is not null
    returning p.id
), last as (
    select created_at, id from doomed order by created_at, id limit 1
)
select (select count(*) from doomed) as visited,
       (select count(*) from deleted) + (select count(*) from tombstoned) as changed,
       (select created_at from last) as last_created_at,
       (select id from last) as last_id,
       (select count(*) from parents) as parents_updated;

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
where r.id = i.id
  and r.attempt = i.attempt
  and r.lease_token = i.lease_token
  and r.status in ('running', 'cancellation_requested')
returning r.id;
