-- Pieces of SQL several statements share, written once. A statement names one as {@name};
-- the loader (runlane.postgres._sql) puts its text in before the statement is rendered,
-- and refuses a name it does not know. A fragment's comment lines are left out.

-- fragment: claim_set
-- The columns a claim sets on each run it takes (the runs table aliased r), beside its
-- own attempt_started_at and started_at (the flow-control claim's come from its clock).
status = 'running',
attempt = r.attempt + 1,
lease_token = gen_random_uuid(),
lease_expires_at = now() + %(lease_seconds)s * interval '1 second',
worker_id = %(worker_id)s::uuid,
updated_at = now()

-- fragment: claim_returning
-- What a claim returns of each run it took: one column per field of
-- runlane.storage.ClaimedRun, in its order and under its name (runlane.postgres._storage
-- builds each ClaimedRun from these names; tests/test_sql_fragments.py checks them).
r.id, r.task_id, r.queue, r.attempt, r.attempt - r.releases as attempts_consumed,
r.max_attempts, r.lease_token, r.payload, r.lease_expires_at, r.trace_context, r.due_at

-- fragment: claim_columns
-- claim_returning's names, for a statement that selects them again from its own result.
id, task_id, queue, attempt, attempts_consumed, max_attempts, lease_token, payload,
lease_expires_at, trace_context, due_at

-- fragment: attempt_end_set
-- How an attempt that failed or expired ends its run (the runs table aliased r, the input
-- row i with retry_delay_seconds from runlane.retry.next_retry_delay): cancelled when
-- cancellation was requested, failed for good without a retry delay, else retrying after
-- it.
status = case
    when r.status = 'cancellation_requested' then 'cancelled'
    when i.retry_delay_seconds is null then 'failed'
    else 'retrying' end,
due_at = case
    when r.status = 'cancellation_requested' or i.retry_delay_seconds is null
        then r.due_at
    else now() + i.retry_delay_seconds * interval '1 second' end,
finished_at = case
    when r.status = 'cancellation_requested' or i.retry_delay_seconds is null
        then now() end

-- fragment: group_insert
-- The runs of one group of concurrent trigger() calls (sql/group.sql): one JSON array of
-- one object per run (postgres/_group.py group_row, short keys: environment, task_id,
-- queue, priority, max_attempts, idempotency_key, parent_run_id, run_at, delay seconds,
-- trace context), aliased i; the statement adds its ordering and conflict rule. A payload
-- of JSON null reads as SQL NULL in json_to_recordset: it is stored as the jsonb null a
-- lone trigger stores.
insert into {schema}.runs as r (
    id, environment, task_id, queue, status, priority, payload, max_attempts,
    idempotency_key, parent_run_id, due_at, trace_context)
select i.id, i.e, i.t, i.q, 'queued', i.p, coalesce(i.payload, 'null'::jsonb), i.a, i.k, i.pr,
       coalesce(i.r, now() + i.d * interval '1 second'), i.c
from json_to_recordset(%(rows)s::json)
    as i(id uuid, e text, t text, q text, p integer, payload jsonb, a integer, k text,
         pr uuid, r timestamptz, d float8, c jsonb)

-- fragment: queue_live_leases
-- How many live leases one bounded queue holds (a claim of it counts them after
-- queue_claim_lock); nothing is read without a concurrency_limit.
select count(*) as n
from {schema}.runs
where %(concurrency_limit)s::int is not null
  and environment = %(environment)s
  and queue = %(queue)s
  and status in ('running', 'cancellation_requested')
  and lease_expires_at > now()
