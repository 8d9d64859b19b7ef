-- Maintenance: band leases and fences, due delivery, attempt expiry, delivery recovery,
-- cleanup.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row. Names are unique across the files of sql/.

-- name: maintenance_fence
-- First statement of a band's write transaction: the lease must still be this owner's and
-- live. FOR SHARE makes a takeover (an UPDATE of the row) wait until this transaction ends,
-- so an old owner can never write after a new one has begun.
select 1
from {schema}.maintenance_leases
where environment = %(environment)s
  and band = %(band)s
  and owner = %(owner)s
  and fencing = %(fencing)s
  and expires_at > {@clock_now}
for share;

-- name: maintenance_lease_acquire
-- Succeeds only when the band has no lease row or its lease has expired; a takeover bumps
-- the fencing number. Times come from clock_timestamp(), read after the row is locked.
insert into {schema}.maintenance_leases as l (
    environment, band, owner, fencing, expires_at, acquired_at)
values (%(environment)s, %(band)s, %(owner)s, 1,
        {@clock_now} + %(lease_seconds)s * interval '1 second', {@clock_now})
on conflict (environment, band) do update
set owner = excluded.owner,
    fencing = l.fencing + 1,
    expires_at = {@clock_now} + %(lease_seconds)s * interval '1 second',
    acquired_at = {@clock_now}
where l.expires_at <= {@clock_now}
returning fencing;

-- name: maintenance_lease_refresh
update {schema}.maintenance_leases
set expires_at = {@clock_now} + %(lease_seconds)s * interval '1 second'
where environment = %(environment)s
  and band = %(band)s
  and owner = %(owner)s
  and fencing = %(fencing)s
  and expires_at > {@clock_now}
returning fencing;

-- name: maintenance_lease_release
update {schema}.maintenance_leases
set expires_at = {@clock_now}
where environment = %(environment)s
  and band = %(band)s
  and owner = %(owner)s
  and fencing = %(fencing)s
  and expires_at > {@clock_now}
returning fencing;

-- name: maintenance_lease_list
select band, owner, fencing, expires_at, expires_at > {@clock_now} as live
from {schema}.maintenance_leases
where environment = %(environment)s
order by band;

-- name: run_deliver_due
-- Retries, releases and durable sleeps whose due time has passed become queued (and are
-- announced by the update trigger).
with due as materialized (
    select id
    from {schema}.runs
    where environment = %(environment)s
      and due_at <= {@now}
      and (status in ('retrying', 'released') or (status = 'waiting' and wait_kind = 'sleep'))
    order by due_at, id
    limit %(limit)s
    for update skip locked
)
update {schema}.runs as r
set status = 'queued', wait_kind = null, updated_at = {@now}
from due
where r.id = due.id
  and (r.status in ('retrying', 'released')
       or (r.status = 'waiting' and r.wait_kind = 'sleep'))
  and r.due_at <= {@now}
returning r.id, r.queue;

-- name: run_list_expired
-- Attempts whose lease lapsed by database time, oldest first. Only a list: the caller
-- decides each one's fate (runlane.retry.next_retry_delay) and run_expire_many writes it,
-- re-checking the lease there.
select id, task_id, attempt, attempt - releases as attempts_consumed, max_attempts,
       lease_token, lease_expires_at
from {schema}.runs
where environment = %(environment)s
  and status in ('running', 'cancellation_requested')
  and lease_expires_at < {@now}
  and lease_token is not null
order by lease_expires_at
limit %(limit)s;

-- name: run_expire_many
-- Finalizes listed attempts whose lease is still the listed one and still lapsed (an
-- attempt extended, completed or re-leased meanwhile is left alone): retrying after the
-- given delay, failed when there is none, cancelled when cancellation was requested. The
-- attempt is recorded as expired. A row locked by an in-flight write (a completion racing
-- this) is skipped, not waited for: the next pass sees what that write did.
with input as (
    {@attempt_end_input}
), locked as materialized (
    select r.id
    from {schema}.runs as r
    join input as i on {@attempt_fence}
    where r.lease_expires_at < {@now}
    for update of r skip locked
), ended as (
    update {schema}.runs as r
    set {@attempt_end_set},
        error = case when r.status = 'cancellation_requested' then r.error
                     else i.error::jsonb end,
        lease_token = null,
        lease_expires_at = null,
        updated_at = {@now}
    from input as i
    join locked as l on l.id = i.id
    where {@attempt_fence}
      and r.lease_expires_at < {@now}
    returning r.id, r.attempt, i.lease_token, r.status, 'expired' as outcome, r.error,
              r.attempt_started_at, r.worker_id
), {@attempt_record}
select id, status from ended;

-- name: run_wake_due_queues
-- Delivery recovery for the polling lane: announce queues whose delayed runs came due
-- within the last window (nothing announced them: they were not due when written).
with recent as (
    select distinct queue
    from {schema}.runs
    where environment = %(environment)s
      and status = 'queued'
      and due_at <= {@now}
      and due_at > {@now} - %(window_seconds)s * interval '1 second'
      and not exists (select from {schema}.queue_states as s
                      where s.environment = %(environment)s and s.queue = runs.queue
                        and s.paused)
    limit %(limit)s
)
select {schema}.runlane_announce(%(environment)s, 'due', queue), queue from recent;

-- name: run_prune
-- Cleanup's pick: terminal runs past retention, and tombstones whose count of children
-- reached zero, locked; run_prune_ids then deletes them in the same transaction.
-- Candidates come from one index range per status (runs_finished, oldest first) and from
-- runs_tombstones, so a pass reads about limit rows whatever the table holds (one query
-- with an OR across them scanned and sorted the whole table).
with candidates as materialized (
    (select id
     from {schema}.runs
     where environment = %(environment)s and pruned_at is null and status = 'completed'
       and finished_at < {@now} - %(completed_seconds)s * interval '1 second'
     order by finished_at
     limit %(limit)s)
    union all
    (select id
     from {schema}.runs
     where environment = %(environment)s and pruned_at is null and status = 'failed'
       and finished_at < {@now} - %(failed_seconds)s * interval '1 second'
     order by finished_at
     limit %(limit)s)
    union all
    (select id
     from {schema}.runs
     where environment = %(environment)s and pruned_at is null and status = 'cancelled'
       and finished_at < {@now} - %(cancelled_seconds)s * interval '1 second'
     order by finished_at
     limit %(limit)s)
    union all
    (select id
     from {schema}.runs
     where environment = %(environment)s and pruned_at is not null
       and remaining_children <= 0
     limit %(limit)s)
)
-- lock them, the conditions checked again on the locked rows (a run retried meanwhile is
-- no longer terminal)
select r.id
from {schema}.runs as r
where r.id in (select id from candidates)
  and r.environment = %(environment)s
  and ((r.pruned_at is null
        and r.status in ('completed', 'failed', 'cancelled')
        and r.finished_at < {@now} - case r.status
            when 'completed' then %(completed_seconds)s
            when 'failed' then %(failed_seconds)s
            else %(cancelled_seconds)s end * interval '1 second')
       or (r.pruned_at is not null and r.remaining_children <= 0))
order by r.finished_at
limit %(limit)s
for update of r skip locked;

-- name: run_prune_ids
-- Deletes finished runs by id, tombstoning those that still have children (migration 14's
-- runlane_delete_runs holds the statement: no role deletes runs but through it): cleanup's
-- (run_prune picked and locked them in this transaction) and delete_runs' (a batch its
-- run_bulk_pick picked, skip_locked). A run that is not finished is left alone.
select deleted, tombstoned, parents_updated
from {schema}.runlane_delete_runs(%(environment)s, %(ids)s::uuid[], %(skip_locked)s);
