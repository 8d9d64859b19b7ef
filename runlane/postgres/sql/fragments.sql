-- Pieces of SQL several statements share, written once. A statement names one as {@name};
-- the loader (runlane.postgres._sql) puts its text in before the statement is rendered,
-- and refuses a name it does not know. A fragment's comment lines are left out.

-- fragment: claim_set
-- The columns a claim sets on each run it takes (the runs table aliased r), beside its
-- own attempt_started_at and started_at (the flow-control claim's come from its clock).
status = 'running',
attempt = r.attempt + 1,
lease_token = gen_random_uuid(),
lease_expires_at = {@now} + %(lease_seconds)s * interval '1 second',
worker_id = %(worker_id)s::uuid,
updated_at = {@now}

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
    else {@now} + i.retry_delay_seconds * interval '1 second' end,
finished_at = case
    when r.status = 'cancellation_requested' or i.retry_delay_seconds is null
        then {@now} end

-- fragment: attempt_fence
-- The fence of every write an attempt makes (the runs table aliased r, the attempt's row i:
-- id, attempt, lease_token): the run is still on this attempt, under this lease, running.
r.id = i.id
  and r.attempt = i.attempt
  and r.lease_token = i.lease_token
  and r.status in ('running', 'cancellation_requested')

-- fragment: attempt_end_input
-- The attempts a statement ends as failed or expired, one row i each, zipped by position:
-- the fence, the error and the retry delay attempt_end_set reads.
select *
from unnest(%(ids)s::uuid[], %(attempts)s::int[], %(lease_tokens)s::uuid[],
            %(errors)s::text[], %(retry_delay_seconds)s::float8[])
    as i(id, attempt, lease_token, error, retry_delay_seconds)

-- fragment: attempt_hand_back_set
-- How an attempt handed back unspent (worker shutdown, context.release, a suspension) leaves
-- its run (aliased r; the input row i names back_to, where the run goes): cancelled when
-- cancellation was requested, else back_to; the attempt is not consumed (releases counts
-- it) and its lease is gone. The statement sets due_at.
status = case when r.status = 'cancellation_requested' then 'cancelled' else i.back_to end,
finished_at = case when r.status = 'cancellation_requested' then {@now} end,
releases = r.releases + 1,
lease_token = null,
lease_expires_at = null,
updated_at = {@now}

-- fragment: attempt_record
-- Keeps each attempt a statement ended in attempts, the history: the statement's CTE ended
-- returns, for each, id, attempt, lease_token, outcome, error (jsonb or null) and the run's
-- attempt_started_at and worker_id. Each attempt ends once (the fence), so a row already
-- there was written by no runlane statement: it is left as it is rather than failing the
-- batch (one row forged through SQL stalled every completion and expiry of its batch). No
-- conflict target: naming one needs SELECT on its columns, which the worker job lacks.
recorded as (
    insert into {schema}.attempts (run_id, attempt, lease_token, outcome, error, started_at,
                                   worker_id)
    select id, attempt, lease_token, outcome, error, attempt_started_at, worker_id from ended
    on conflict do nothing
)

-- fragment: run_snapshot_columns
-- What a read of runs shows of each (runlane.postgres._storage builds a RunSnapshot from
-- these names): executing means its handler started, not only that it was claimed.
id, environment, task_id, queue, status, attempt, attempt - releases as attempts_spent,
max_attempts, priority, payload, output, error, idempotency_key, parent_run_id, created_at,
updated_at, due_at, started_at, finished_at, progress,
(status in ('running', 'cancellation_requested')
 and started_attempt is not distinct from attempt) as executing

-- fragment: run_task_queue_filter
-- An operator's filter by task and by queue (null: any), checked on the runs a walk meets.
(%(task_id)s::text is null or task_id = %(task_id)s::text)
and (%(queue)s::text is null or queue = %(queue)s::text)

-- fragment: bulk_filter
-- What a bulk action's filter keeps of the runs table (runlane.storage.BulkFilter beside
-- its statuses; postgres/_bulk.py _filter_params): created in [created_after,
-- created_before) when given, of the task and queue when given, among run_ids when given.
(%(created_after)s::timestamptz is null or created_at >= %(created_after)s)
and (%(created_before)s::timestamptz is null or created_at < %(created_before)s)
and {@run_task_queue_filter}
and (%(run_ids)s::uuid[] is null or id = any(%(run_ids)s::uuid[]))

-- fragment: outbox_claim_fence
-- The fence of a publisher's writes to its outbox items (aliased o; the input row i: id,
-- token, environment): the item's claim is still the one the publisher holds.
o.id = i.id and o.claim_token = i.token and o.environment = i.environment

-- fragment: queue_paused
-- Whether the queue of run r is paused (its queue_states row says so): claims, deliveries
-- and recovery leave such runs alone until resume_queue.
exists (select from {schema}.queue_states as s
        where s.environment = r.environment and s.queue = r.queue and s.paused)

-- fragment: outbox_announce_written
-- The end of a statement whose CTE written wrote outbox items (returning run_id,
-- environment, queue): each of their queues is announced once, so listening publishers
-- sweep now, and the runs are returned (the count makes the announcing CTE run).
told as (
    select {schema}.runlane_announce(d.environment, 'outbox', d.queue)
    from (select distinct environment, queue from written) as d
)
select run_id from written where (select count(*) from told) >= 0

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
       coalesce(i.r, {@now} + i.d * interval '1 second'), i.c
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
  and lease_expires_at > {@now}

-- fragment: now
-- The time a statement reads as now: the transaction's now(), unless the executor was given
-- a clock to move (runlane.testing.MovableClock: tests move time instead of sleeping).
-- Every statement that reads the clock names it, never now() itself.
coalesce(%(now)s::timestamptz, now())

-- fragment: clock_now
-- The same for a time read after a lock is taken (clock_timestamp(), which moves on within
-- a transaction): maintenance leases and fences, the flow-control claim's start stamps.
coalesce(%(now)s::timestamptz, clock_timestamp())

-- fragment: stats_wait_counts_summed
-- The wait histograms of the rollup's rows (aliased m) summed element by element, one sum
-- per bucket of runlane.stats.HISTOGRAM_BOUNDS (54: its 53 bounds and one above).
array[sum(m.wait_counts[1]), sum(m.wait_counts[2]), sum(m.wait_counts[3]),
sum(m.wait_counts[4]), sum(m.wait_counts[5]), sum(m.wait_counts[6]), sum(m.wait_counts[7]),
sum(m.wait_counts[8]), sum(m.wait_counts[9]), sum(m.wait_counts[10]),
sum(m.wait_counts[11]), sum(m.wait_counts[12]), sum(m.wait_counts[13]),
sum(m.wait_counts[14]), sum(m.wait_counts[15]), sum(m.wait_counts[16]),
sum(m.wait_counts[17]), sum(m.wait_counts[18]), sum(m.wait_counts[19]),
sum(m.wait_counts[20]), sum(m.wait_counts[21]), sum(m.wait_counts[22]),
sum(m.wait_counts[23]), sum(m.wait_counts[24]), sum(m.wait_counts[25]),
sum(m.wait_counts[26]), sum(m.wait_counts[27]), sum(m.wait_counts[28]),
sum(m.wait_counts[29]), sum(m.wait_counts[30]), sum(m.wait_counts[31]),
sum(m.wait_counts[32]), sum(m.wait_counts[33]), sum(m.wait_counts[34]),
sum(m.wait_counts[35]), sum(m.wait_counts[36]), sum(m.wait_counts[37]),
sum(m.wait_counts[38]), sum(m.wait_counts[39]), sum(m.wait_counts[40]),
sum(m.wait_counts[41]), sum(m.wait_counts[42]), sum(m.wait_counts[43]),
sum(m.wait_counts[44]), sum(m.wait_counts[45]), sum(m.wait_counts[46]),
sum(m.wait_counts[47]), sum(m.wait_counts[48]), sum(m.wait_counts[49]),
sum(m.wait_counts[50]), sum(m.wait_counts[51]), sum(m.wait_counts[52]),
sum(m.wait_counts[53]), sum(m.wait_counts[54])]

-- fragment: stats_run_counts_summed
-- The same for the run-time histograms.
array[sum(m.run_counts[1]), sum(m.run_counts[2]), sum(m.run_counts[3]),
sum(m.run_counts[4]), sum(m.run_counts[5]), sum(m.run_counts[6]), sum(m.run_counts[7]),
sum(m.run_counts[8]), sum(m.run_counts[9]), sum(m.run_counts[10]), sum(m.run_counts[11]),
sum(m.run_counts[12]), sum(m.run_counts[13]), sum(m.run_counts[14]), sum(m.run_counts[15]),
sum(m.run_counts[16]), sum(m.run_counts[17]), sum(m.run_counts[18]), sum(m.run_counts[19]),
sum(m.run_counts[20]), sum(m.run_counts[21]), sum(m.run_counts[22]), sum(m.run_counts[23]),
sum(m.run_counts[24]), sum(m.run_counts[25]), sum(m.run_counts[26]), sum(m.run_counts[27]),
sum(m.run_counts[28]), sum(m.run_counts[29]), sum(m.run_counts[30]), sum(m.run_counts[31]),
sum(m.run_counts[32]), sum(m.run_counts[33]), sum(m.run_counts[34]), sum(m.run_counts[35]),
sum(m.run_counts[36]), sum(m.run_counts[37]), sum(m.run_counts[38]), sum(m.run_counts[39]),
sum(m.run_counts[40]), sum(m.run_counts[41]), sum(m.run_counts[42]), sum(m.run_counts[43]),
sum(m.run_counts[44]), sum(m.run_counts[45]), sum(m.run_counts[46]), sum(m.run_counts[47]),
sum(m.run_counts[48]), sum(m.run_counts[49]), sum(m.run_counts[50]), sum(m.run_counts[51]),
sum(m.run_counts[52]), sum(m.run_counts[53]), sum(m.run_counts[54])]
