-- Operator state of queues (migration 6's queue_states): pause, resume, list.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- A queue is paused while its queue_states row says so; every claim statement (run_claim,
-- run_claim_ids) leaves paused queues out, so a pause holds from its commit.

-- name: queue_pause
-- Pause the queue (a row for it, or the row set paused) with the reason given; a queue
-- already paused keeps its paused_at. Returns whether it was running before.
with before as (
    select paused
    from {schema}.queue_states
    where environment = %(environment)s and queue = %(queue)s
), upserted as (
    insert into {schema}.queue_states as s (
        environment, queue, paused, paused_reason, paused_at, updated_at)
    values (%(environment)s, %(queue)s, true, %(reason)s, {@now}, {@now})
    on conflict (environment, queue) do update
    set paused = true,
        paused_reason = excluded.paused_reason,
        paused_at = case when s.paused then s.paused_at else {@now} end,
        updated_at = {@now}
    returning s.queue
)
select not coalesce((select paused from before), false) as changed,
       (select count(*) from upserted) as written;

-- name: queue_resume
-- Resume the queue and announce it (workers of the polling lane waiting on it claim at
-- once). Returns whether it was paused, and whether the environment has an outbox (a
-- transport lane: the queue's runs need items again, see queue_outbox_ids).
with resumed as (
    update {schema}.queue_states
    set paused = false, paused_reason = null, paused_at = null, updated_at = {@now}
    where environment = %(environment)s and queue = %(queue)s and paused
    returning queue
), told as (
    select count({schema}.runlane_announce(%(environment)s, 'due', %(queue)s)::text) as n
)
select exists (select from resumed) as changed,
       exists (select from {schema}.outbox_environments
               where environment = %(environment)s) as has_outbox,
       (select n from told) as told;

-- name: queue_queued_ids
-- The queue's queued runs (read through a cursor held across the batches of
-- queue_outbox_write, so the scan is done once).
select id
from {schema}.runs
where environment = %(environment)s and status = 'queued' and queue = %(queue)s;

-- name: queue_outbox_write
-- One batch of resume on a transport lane: outbox items for the named runs that are still
-- queued in a queue that is not paused (again) and have none (a delivery made while the
-- queue was paused was acknowledged and its item is gone). Announced, so listening
-- publishers publish them now.
with written as (
    insert into {schema}.outbox (id, environment, run_id, queue, available_at)
    select gen_random_uuid(), r.environment, r.id, r.queue, greatest(r.due_at, {@now})
    from {schema}.runs as r
    where r.id = any(%(ids)s::uuid[])
      and r.environment = %(environment)s
      and r.queue = %(queue)s
      and r.status = 'queued'
      and not exists (select from {schema}.outbox as o where o.run_id = r.id)
      and not {@queue_paused}
    returning run_id, environment, queue
), {@outbox_announce_written};

-- name: queue_known
-- Whether the database knows the queue: a queue_states row, or runs of it.
select exists (select from {schema}.queue_states
               where environment = %(environment)s and queue = %(queue)s)
       or exists (select from {schema}.runs
                  where environment = %(environment)s and queue = %(queue)s);

-- name: queue_list
-- Every queue with unfinished runs or a queue_states row: its state, its unfinished runs
-- by status (terminal runs are not read: that part of the table only grows), of its
-- running runs those claimed and not started (the current attempt's handler has not been
-- seen to start: started_attempt is not attempt, as status_counts' claimed_not_started),
-- its live leases (running attempts whose lease has not lapsed: the count a bounded
-- queue's limit applies to), and how long its oldest due queued run has been due. Serves
-- list_queues (queue_list) and status() (status_counts: the paused queues and those with
-- runs). One pass over the unfinished runs, the same rows as without the split.
with counts as (
    select queue,
           count(*) filter (where status = 'queued') as queued,
           count(*) filter (where status = 'running') as running,
           count(*) filter (where status = 'running'
                              and started_attempt is distinct from attempt) as claimed,
           count(*) filter (where status = 'retrying') as retrying,
           count(*) filter (where status = 'released') as released,
           count(*) filter (where status = 'waiting') as waiting,
           count(*) filter (where status = 'cancellation_requested')
               as cancellation_requested,
           count(*) filter (where status in ('running', 'cancellation_requested')
                              and lease_expires_at > {@now}) as live_leases,
           min(due_at) filter (where status = 'queued' and due_at <= {@now}) as oldest_due
    from {schema}.runs
    where environment = %(environment)s
      and status in ('queued', 'running', 'cancellation_requested', 'retrying', 'released',
                     'waiting')
    group by queue
), states as (
    select queue, paused, paused_reason, paused_at
    from {schema}.queue_states
    where environment = %(environment)s
)
select coalesce(c.queue, s.queue) as queue,
       coalesce(s.paused, false) as paused,
       s.paused_reason,
       s.paused_at,
       coalesce(c.queued, 0) as queued,
       coalesce(c.running, 0) as running,
       coalesce(c.claimed, 0) as claimed,
       coalesce(c.retrying, 0) as retrying,
       coalesce(c.released, 0) as released,
       coalesce(c.waiting, 0) as waiting,
       coalesce(c.cancellation_requested, 0) as cancellation_requested,
       coalesce(c.live_leases, 0) as live_leases,
       extract(epoch from {@now} - c.oldest_due)::float8 as oldest_queued_age
from counts as c
full join states as s on s.queue = c.queue
order by 1;

-- name: queue_recent
-- The queues of the newest %(limit)s finished runs, each once: list_queues lists them too,
-- so a queue whose runs have all finished is not missing from it (queue_list reads
-- unfinished runs only). A bounded walk of runs_finished newest first (its
-- (environment, finished_at) entries, then each row's queue), however many runs the table
-- holds. Pruned runs are not read.
select distinct queue
from (
    select queue
    from {schema}.runs
    where environment = %(environment)s
      and status in ('completed', 'failed', 'cancelled')
      and pruned_at is null
    order by finished_at desc
    limit %(limit)s
) as recent;
