-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row.

-- name: schema_version
select version, checksum from {schema}.runlane_migrations order by version;

-- name: run_insert_many
-- Wakes listening workers (NOTIFY is sent at commit, so only for runs that exist) when a
-- run is due now; delayed runs are found by polling.
with inserted as (
    insert into {schema}.runs as r (
        id, environment, task_id, queue, status, priority, payload, max_attempts,
        idempotency_key, parent_run_id, due_at)
    select i.id, %(environment)s, %(task_id)s, %(queue)s, 'queued', %(priority)s,
           i.payload::jsonb, %(max_attempts)s, i.idempotency_key, %(parent_run_id)s,
           coalesce(%(run_at)s::timestamptz, now() + %(delay_seconds)s * interval '1 second')
    from unnest(%(ids)s::uuid[], %(payloads)s::text[], %(idempotency_keys)s::text[])
        as i(id, payload, idempotency_key)
    -- one lock order for every caller, so batches sharing keys cannot deadlock; ids grow
    -- in payload order, so a key repeated in a batch still goes to its first payload
    order by i.idempotency_key, i.id
    -- no conflict target: an idempotency key match and a repeated id (a statement retried
    -- after its first answer was lost) both leave the existing row alone
    on conflict do nothing
    returning r.id, r.due_at <= now() as due_now
), wake as (
    select pg_notify(%(channel)s, %(environment)s || '|' || %(queue)s)
    from inserted where due_now limit 1
)
-- the scalar subquery makes the planner evaluate "wake"; it never filters a row out
select id from inserted where (select count(*) from wake) >= 0;

-- name: run_find_existing
select id, idempotency_key, queue
from {schema}.runs
where environment = %(environment)s
  and task_id = %(task_id)s
  and (id = any(%(ids)s::uuid[]) or idempotency_key = any(%(idempotency_keys)s::text[]));

-- name: run_get
select id, environment, task_id, queue, status, attempt, max_attempts, priority, payload,
       output, error, idempotency_key, parent_run_id, created_at, updated_at, due_at,
       started_at, finished_at
from {schema}.runs
where id = %(id)s and environment = %(environment)s;

-- name: run_get_many
select id, environment, task_id, queue, status, attempt, max_attempts, priority, payload,
       output, error, idempotency_key, parent_run_id, created_at, updated_at, due_at,
       started_at, finished_at
from {schema}.runs
where id = any(%(ids)s::uuid[]) and environment = %(environment)s;

-- name: run_claim
-- The next due queued runs of the given queues, by priority, then due time, then id.
-- With a concurrency_limit (a bounded queue: one queue, after queue_claim_lock in the same
-- transaction) it claims only as many as the limit leaves after the queue's live leases;
-- without one, the live count is skipped by a one-time filter.
with live as (
    select count(*) as n
    from {schema}.runs
    where %(concurrency_limit)s::int is not null
      and environment = %(environment)s
      and queue = any(%(queues)s::text[])
      and status in ('running', 'cancellation_requested')
      and lease_expires_at > now()
), candidates as materialized (
    select id
    from {schema}.runs
    where environment = %(environment)s
      and status = 'queued'
      and queue = any(%(queues)s::text[])
      and due_at <= now()
    order by priority desc, due_at, id
    limit greatest(0, least(%(limit)s,
                            coalesce(%(concurrency_limit)s::int - (select n from live),
                                     %(limit)s)))
    for update skip locked
)
update {schema}.runs as r
set status = 'running',
    attempt = r.attempt + 1,
    lease_token = gen_random_uuid(),
    lease_expires_at = now() + %(lease_seconds)s * interval '1 second',
    attempt_started_at = now(),
    started_at = coalesce(r.started_at, now()),
    updated_at = now()
from candidates as c
where r.id = c.id
returning r.id, r.task_id, r.queue, r.attempt, r.attempt - r.releases, r.max_attempts,
          r.lease_token, r.payload, r.lease_expires_at;

-- name: queue_claim_lock
-- Serialises claimers of one bounded queue until their transaction ends, so the next
-- claimer's count (a later statement, a later snapshot) sees every lease taken before it.
select pg_advisory_xact_lock(hashtext(%(lock_scope)s), hashtext(%(queue)s));

-- name: run_complete_many
with input as (
    select *
    from unnest(%(ids)s::uuid[], %(attempts)s::int[], %(lease_tokens)s::uuid[],
                %(outputs)s::text[])
        as i(id, attempt, lease_token, output)
), done as (
    update {schema}.runs as r
    set status = case when r.status = 'cancellation_requested' then 'cancelled'
                      else 'completed' end,
        -- a run cancelled while its handler ran keeps no output
        output = case when r.status = 'cancellation_requested' then null
                      else i.output::jsonb end,
        error = null,
        lease_token = null,
        lease_expires_at = null,
        finished_at = now(),
        updated_at = now()
    from input as i
    where r.id = i.id
      and r.attempt = i.attempt
      and r.lease_token = i.lease_token
      and r.status in ('running', 'cancellation_requested')
    returning r.id, r.attempt, i.lease_token, r.status, r.attempt_started_at,
              r.environment, r.queue
), recorded as (
    insert into {schema}.attempts (run_id, attempt, lease_token, outcome, started_at)
    select id, attempt, lease_token, status, attempt_started_at from done
), parents as (
    -- runs waiting on these runs resume now (each once: guarded by status = 'waiting')
    update {schema}.runs as p
    set status = 'queued', due_at = now(), wait_kind = null, wait_run_id = null,
        updated_at = now()
    where p.status = 'waiting' and p.wait_kind = 'run'
      and p.wait_run_id in (select id from done)
    returning p.environment, p.queue
), wake as (
    -- parents resumed, and bounded queues whose capacity these runs freed
    select pg_notify(%(channel)s, w.environment || '|' || w.queue)
    from (select environment, queue from parents
          union
          select environment, queue from done
          where queue = any(%(wake_queues)s::text[])) as w
)
select id from done where (select count(*) from wake) >= 0;

-- name: run_fail_many
with input as (
    select *
    from unnest(%(ids)s::uuid[], %(attempts)s::int[], %(lease_tokens)s::uuid[],
                %(errors)s::text[], %(retry_delay_seconds)s::float8[])
        as i(id, attempt, lease_token, error, retry_delay_seconds)
), done as (
    update {schema}.runs as r
    set status = case
            when r.status = 'cancellation_requested' then 'cancelled'
            when i.retry_delay_seconds is null
              or r.attempt - r.releases >= r.max_attempts then 'failed'
            else 'retrying' end,
        due_at = case
            when r.status = 'cancellation_requested'
              or i.retry_delay_seconds is null
              or r.attempt - r.releases >= r.max_attempts then r.due_at
            else now() + i.retry_delay_seconds * interval '1 second' end,
        finished_at = case
            when r.status = 'cancellation_requested'
              or i.retry_delay_seconds is null
              or r.attempt - r.releases >= r.max_attempts then now() end,
        error = i.error::jsonb,
        lease_token = null,
        lease_expires_at = null,
        updated_at = now()
    from input as i
    where r.id = i.id
      and r.attempt = i.attempt
      and r.lease_token = i.lease_token
      and r.status in ('running', 'cancellation_requested')
    returning r.id, r.attempt, i.lease_token, r.status, r.error, r.attempt_started_at,
              r.environment, r.queue
), recorded as (
    insert into {schema}.attempts (run_id, attempt, lease_token, outcome, error, started_at)
    select id, attempt, lease_token, status, error, attempt_started_at from done
), parents as (
    update {schema}.runs as p
    set status = 'queued', due_at = now(), wait_kind = null, wait_run_id = null,
        updated_at = now()
    where p.status = 'waiting' and p.wait_kind = 'run'
      and p.wait_run_id in (select id from done where status in ('failed', 'cancelled'))
    returning p.environment, p.queue
), wake as (
    select pg_notify(%(channel)s, w.environment || '|' || w.queue)
    from (select environment, queue from parents
          union
          select environment, queue from done
          where queue = any(%(wake_queues)s::text[])) as w
)
select id, status from done where (select count(*) from wake) >= 0;

-- name: run_deliver_due
-- Retries, releases and durable sleeps whose due time has passed become queued.
with due as materialized (
    select id
    from {schema}.runs
    where environment = %(environment)s
      and due_at <= now()
      and (status in ('retrying', 'released') or (status = 'waiting' and wait_kind = 'sleep'))
    order by due_at, id
    limit %(limit)s
    for update skip locked
), delivered as (
    update {schema}.runs as r
    set status = 'queued', wait_kind = null, updated_at = now()
    from due
    where r.id = due.id
      and (r.status in ('retrying', 'released')
           or (r.status = 'waiting' and r.wait_kind = 'sleep'))
      and r.due_at <= now()
    returning r.id, r.queue
), wake as (
    select pg_notify(%(channel)s, %(environment)s || '|' || q.queue)
    from (select distinct queue from delivered) as q
)
select id, queue from delivered where (select count(*) from wake) >= 0;

-- name: run_release_many
-- Hands attempts back unconsumed (worker shutdown): the run is claimable again at once.
with input as (
    select *
    from unnest(%(ids)s::uuid[], %(attempts)s::int[], %(lease_tokens)s::uuid[])
        as i(id, attempt, lease_token)
), done as (
    update {schema}.runs as r
    set status = case when r.status = 'cancellation_requested' then 'cancelled'
                      else 'queued' end,
        finished_at = case when r.status = 'cancellation_requested' then now() end,
        due_at = now(),
        releases = r.releases + 1,
        lease_token = null,
        lease_expires_at = null,
        updated_at = now()
    from input as i
    where r.id = i.id
      and r.attempt = i.attempt
      and r.lease_token = i.lease_token
      and r.status in ('running', 'cancellation_requested')
    returning r.id, r.attempt, i.lease_token, r.status, r.queue, r.attempt_started_at
), recorded as (
    insert into {schema}.attempts (run_id, attempt, lease_token, outcome, started_at)
    select id, attempt, lease_token,
           case when status = 'queued' then 'released' else status end, attempt_started_at
    from done
), wake as (
    select pg_notify(%(channel)s, %(environment)s || '|' || q.queue)
    from (select distinct queue from done where status = 'queued') as q
)
select id from done where (select count(*) from wake) >= 0;

-- name: run_extend_leases
-- An expired lease is not revived: its queue slot may already belong to another attempt.
with input as (
    select *
    from unnest(%(ids)s::uuid[], %(attempts)s::int[], %(lease_tokens)s::uuid[])
        as i(id, attempt, lease_token)
)
update {schema}.runs as r
set lease_expires_at = now() + %(lease_seconds)s * interval '1 second'
from input as i
where r.id = i.id
  and r.attempt = i.attempt
  and r.lease_token = i.lease_token
  and r.status in ('running', 'cancellation_requested')
  and r.lease_expires_at > now()
returning r.id, r.status;

-- name: database_now
select now();

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
  and expires_at > clock_timestamp()
for share;

-- name: maintenance_lease_acquire
-- Succeeds only when the band has no lease row or its lease has expired; a takeover bumps
-- the fencing number. Times come from clock_timestamp(), read after the row is locked.
insert into {schema}.maintenance_leases as l (
    environment, band, owner, fencing, expires_at, acquired_at)
values (%(environment)s, %(band)s, %(owner)s, 1,
        clock_timestamp() + %(lease_seconds)s * interval '1 second', clock_timestamp())
on conflict (environment, band) do update
set owner = excluded.owner,
    fencing = l.fencing + 1,
    expires_at = clock_timestamp() + %(lease_seconds)s * interval '1 second',
    acquired_at = clock_timestamp()
where l.expires_at <= clock_timestamp()
returning fencing;

-- name: maintenance_lease_refresh
update {schema}.maintenance_leases
set expires_at = clock_timestamp() + %(lease_seconds)s * interval '1 second'
where environment = %(environment)s
  and band = %(band)s
  and owner = %(owner)s
  and fencing = %(fencing)s
  and expires_at > clock_timestamp()
returning fencing;

-- name: maintenance_lease_release
update {schema}.maintenance_leases
set expires_at = clock_timestamp()
where environment = %(environment)s
  and band = %(band)s
  and owner = %(owner)s
  and fencing = %(fencing)s
  and expires_at > clock_timestamp()
returning fencing;

-- name: maintenance_lease_list
select band, owner, fencing, expires_at, expires_at > clock_timestamp() as live
from {schema}.maintenance_leases
where environment = %(environment)s
order by band;

-- name: schedule_state_list
select schedule_id, cron, timezone, next_slot_at
from {schema}.schedules
where environment = %(environment)s and schedule_id = any(%(schedule_ids)s::text[]);

-- name: schedule_state_reset
-- First sighting of a schedule, or its cron/timezone changed: wait for the next slot.
insert into {schema}.schedules as s (environment, schedule_id, cron, timezone, next_slot_at)
values (%(environment)s, %(schedule_id)s, %(cron)s, %(timezone)s, %(next_slot_at)s)
on conflict (environment, schedule_id) do update
set cron = excluded.cron,
    timezone = excluded.timezone,
    next_slot_at = excluded.next_slot_at,
    updated_at = now()
where s.cron is distinct from excluded.cron or s.timezone is distinct from excluded.timezone;

-- name: schedule_fire
-- Records one slot and creates its run in one statement. The slot's primary key makes a
-- second replica firing the same slot create nothing.
with slot as (
    insert into {schema}.schedule_slots (environment, schedule_id, slot_at, run_id)
    values (%(environment)s, %(schedule_id)s, %(slot_at)s, %(run_id)s)
    on conflict do nothing
    returning run_id
), inserted as (
    insert into {schema}.runs (
        id, environment, task_id, queue, status, priority, payload, max_attempts, due_at)
    select slot.run_id, %(environment)s, %(task_id)s, %(queue)s, 'queued', %(priority)s,
           %(payload)s::jsonb, %(max_attempts)s, now()
    from slot
    returning id
), wake as (
    select pg_notify(%(channel)s, %(environment)s || '|' || %(queue)s)
    from inserted limit 1
)
select id from inserted where (select count(*) from wake) >= 0;

-- name: schedule_advance
update {schema}.schedules
set next_slot_at = %(next_slot_at)s, updated_at = now()
where environment = %(environment)s
  and schedule_id = %(schedule_id)s
  and next_slot_at = %(expected_slot_at)s;

-- name: run_expire_attempts
-- Finalizes attempts whose lease lapsed by database time: the run retries per its task's
-- policy (passed as arrays; unknown tasks use the default policy), fails when its attempts
-- are spent, and a run whose cancellation was requested becomes cancelled. The condition is
-- re-checked in the update, so an attempt that completed meanwhile is left alone.
with policies as (
    select *
    from unnest(%(task_ids)s::text[], %(initial_seconds)s::float8[],
                %(multipliers)s::float8[], %(max_seconds)s::float8[], %(jitters)s::float8[])
        as p(task_id, initial_seconds, multiplier, max_seconds, jitter)
), expired as materialized (
    select id
    from {schema}.runs
    where environment = %(environment)s
      and status in ('running', 'cancellation_requested')
      and lease_expires_at < now()
    order by lease_expires_at
    limit %(limit)s
    for update skip locked
), decided as (
    select r.id,
           r.lease_token as old_token,
           case when r.status = 'cancellation_requested' then 'cancelled'
                when r.attempt - r.releases >= r.max_attempts then 'failed'
                else 'retrying' end as new_status,
           least(coalesce(p.max_seconds, %(default_max_seconds)s),
                 coalesce(p.initial_seconds, %(default_initial_seconds)s)
                 * power(coalesce(p.multiplier, %(default_multiplier)s),
                         least(greatest(r.attempt - r.releases - 1, 0), 64)))
           * (1 + coalesce(p.jitter, %(default_jitter)s) * (2 * random() - 1)) as delay_seconds
    from expired as e
    join {schema}.runs as r on r.id = e.id
    left join policies as p on p.task_id = r.task_id
), done as (
    update {schema}.runs as r
    set status = d.new_status,
        due_at = case when d.new_status = 'retrying'
                      then now() + greatest(d.delay_seconds, 0) * interval '1 second'
                      else r.due_at end,
        finished_at = case when d.new_status <> 'retrying' then now() end,
        error = case when d.new_status = 'cancelled' then r.error
                     else jsonb_build_object(
                         'type', 'runlane.LeaseExpired',
                         'message', 'attempt ' || r.attempt || ' lost its lease (expired at '
                             || r.lease_expires_at || '): its worker crashed, froze, or lost '
                             || 'its database connection',
                         'traceback', null,
                         'retryable', true) end,
        lease_token = null,
        lease_expires_at = null,
        updated_at = now()
    from decided as d
    where r.id = d.id
      and r.status in ('running', 'cancellation_requested')
      and r.lease_expires_at < now()
    returning r.id, r.attempt, r.status, r.error, r.attempt_started_at, d.old_token
), recorded as (
    insert into {schema}.attempts (run_id, attempt, lease_token, outcome, error, started_at)
    select id, attempt, old_token, 'expired', error, attempt_started_at
    from done
), parents as (
    update {schema}.runs as p
    set status = 'queued', due_at = now(), wait_kind = null, wait_run_id = null,
        updated_at = now()
    where p.status = 'waiting' and p.wait_kind = 'run'
      and p.wait_run_id in (select id from done where status in ('failed', 'cancelled'))
    returning p.environment, p.queue
), wake as (
    select pg_notify(%(channel)s, w.environment || '|' || w.queue)
    from (select distinct environment, queue from parents) as w
)
select id, status from done where (select count(*) from wake) >= 0;

-- name: run_wake_due_queues
-- Delivery recovery for the polling lane: wake workers of queues whose delayed runs came due
-- within the last window (they were triggered without a wake-up because they were not due).
with recent as (
    select distinct queue
    from {schema}.runs
    where environment = %(environment)s
      and status = 'queued'
      and due_at <= now()
      and due_at > now() - %(window_seconds)s * interval '1 second'
    limit %(limit)s
)
select pg_notify(%(channel)s, %(environment)s || '|' || queue), queue from recent;

-- name: run_prune
-- Cleanup: deletes terminal runs past retention; one that still has children becomes a
-- tombstone counting them, and each deleted child lowers its tombstoned parent's count.
-- Tombstones whose count reached zero are deleted like any other run.
with doomed as materialized (
    select id, parent_run_id, pruned_at is not null as was_tombstone
    from {schema}.runs
    where environment = %(environment)s
      and ((pruned_at is null
            and status in ('completed', 'failed', 'cancelled')
            and finished_at < now() - case status
                when 'completed' then %(completed_seconds)s
                when 'failed' then %(failed_seconds)s
                else %(cancelled_seconds)s end * interval '1 second')
           or (pruned_at is not null and remaining_children <= 0))
    order by finished_at
    limit %(limit)s
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
    join doomed as d on d.id = cc.id
    left join surviving as s on s.id = cc.id
    where r.id = cc.id and not d.was_tombstone
    returning r.id
), deleted as (
    delete from {schema}.runs as r
    using doomed as d
    where r.id = d.id and d.id not in (select id from child_counts)
    returning r.id, r.parent_run_id
), parents as (
    update {schema}.runs as p
    set remaining_children = p.remaining_children - g.n, updated_at = now()
    from (select parent_run_id, count(*) as n from deleted
          where parent_run_id is not null group by parent_run_id) as g
    where p.id = g.parent_run_id and p.pruned_at is not null
    returning p.id
)
select (select count(*) from deleted) as deleted,
       (select count(*) from tombstoned) as tombstoned,
       (select count(*) from parents) as parents_updated;

-- name: status_counts
-- The "monitor progress" view: counts that must keep falling when maintenance is healthy.
select
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status = 'queued' and due_at <= now())
        as queued_due,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status = 'running') as running,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status in ('retrying', 'released')
        and due_at < now()) as deferred_past_due,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status in ('running', 'cancellation_requested')
        and lease_expires_at < now()) as expired_leases,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and status = 'cancellation_requested'
        and (lease_expires_at is null or lease_expires_at < now())) as stuck_cancellations,
    (select count(*) from {schema}.runs
      where environment = %(environment)s and pruned_at is not null
        and remaining_children > 0) as tombstones_with_children,
    (select min(due_at) from {schema}.runs
      where environment = %(environment)s and status in ('retrying', 'released')
        and due_at < now()) as oldest_deferred_due_at,
    (select count(*) from {schema}.wait_tokens
      where environment = %(environment)s and status = 'pending'
        and timeout_at < now()) as tokens_past_timeout,
    (select count(distinct r.wait_token_id) from {schema}.runs as r
      join {schema}.wait_tokens as t on t.id = r.wait_token_id
      where r.environment = %(environment)s and r.status = 'waiting'
        and r.wait_kind = 'token' and t.status <> 'pending') as resolved_tokens_with_waiting_runs;

-- name: step_get
select output from {schema}.steps where run_id = %(run_id)s and name = %(name)s;

-- name: step_store
-- The first writer wins, and only an attempt still holding its lease may write (the run row
-- is share-locked so it cannot be finalized meanwhile). "fenced" = 0 means a stale attempt.
with fence as (
    select id
    from {schema}.runs
    where id = %(id)s and attempt = %(attempt)s and lease_token = %(lease_token)s
      and status in ('running', 'cancellation_requested')
    for share
), stored as (
    insert into {schema}.steps (run_id, name, output, attempt)
    select id, %(name)s, %(output)s::jsonb, %(attempt)s from fence
    on conflict (run_id, name) do nothing
    returning output
)
select (select count(*) from fence) as fenced, (select output from stored) as output;

-- name: run_suspend
-- Suspends the attempt's run until a wait token is resolved (kind 'token'), another run of
-- the environment ends (kind 'run'), or a wake-up time passes (kind 'sleep'). The awaited
-- token or run is share-locked and must still be unresolved: a completion racing this either
-- committed first (nothing is suspended; the caller reads it again) or waits for this
-- transaction, and its resume pass then finds the run waiting. A suspension does not consume
-- an attempt. "target_open" = 0 means the target was already resolved; "suspended" = 0 with
-- an open target means the attempt lost its lease.
with token_target as (
    select id
    from {schema}.wait_tokens
    where %(kind)s = 'token' and id = %(target_id)s and environment = %(environment)s
      and status = 'pending'
    for share
), run_target as (
    select id
    from {schema}.runs
    where %(kind)s = 'run' and id = %(target_id)s and environment = %(environment)s
      and status not in ('completed', 'failed', 'cancelled')
    for share
), target as (
    select id from token_target
    union all
    select id from run_target
    union all
    select null::uuid where %(kind)s = 'sleep'
), suspended as (
    update {schema}.runs as r
    set status = case when r.status = 'cancellation_requested' then 'cancelled'
                      else 'waiting' end,
        wait_kind = case when r.status = 'cancellation_requested' then null
                         else %(kind)s::text end,
        wait_token_id = case when r.status <> 'cancellation_requested'
                              and %(kind)s = 'token' then target.id end,
        wait_run_id = case when r.status <> 'cancellation_requested'
                            and %(kind)s = 'run' then target.id end,
        due_at = case when %(kind)s = 'sleep' then %(wake_at)s::timestamptz else r.due_at end,
        finished_at = case when r.status = 'cancellation_requested' then now() end,
        releases = r.releases + 1,
        lease_token = null,
        lease_expires_at = null,
        updated_at = now()
    from target
    where r.id = %(id)s and r.attempt = %(attempt)s and r.lease_token = %(lease_token)s
      and r.status in ('running', 'cancellation_requested')
    returning r.id, r.attempt, r.status, r.attempt_started_at
), recorded as (
    insert into {schema}.attempts (run_id, attempt, lease_token, outcome, started_at)
    select id, attempt, %(lease_token)s,
           case when status = 'waiting' then 'suspended' else status end, attempt_started_at
    from suspended
)
select (select count(*) from target) as target_open,
       (select count(*) from suspended) as suspended;

-- name: run_release
-- context.release: the run goes back as released, due after the delay, the attempt not
-- consumed; DUE_DELIVERY makes it queued when due.
with done as (
    update {schema}.runs as r
    set status = case when r.status = 'cancellation_requested' then 'cancelled'
                      else 'released' end,
        due_at = now() + %(delay_seconds)s * interval '1 second',
        finished_at = case when r.status = 'cancellation_requested' then now() end,
        releases = r.releases + 1,
        lease_token = null,
        lease_expires_at = null,
        updated_at = now()
    where r.id = %(id)s and r.attempt = %(attempt)s and r.lease_token = %(lease_token)s
      and r.status in ('running', 'cancellation_requested')
    returning r.id, r.attempt, r.status, r.attempt_started_at
), recorded as (
    insert into {schema}.attempts (run_id, attempt, lease_token, outcome, started_at)
    select id, attempt, %(lease_token)s, status, attempt_started_at from done
)
select count(*) from done;

-- name: run_resume_waiters
-- Runs waiting on a token or a run that has been resolved go back to queued, each once
-- (the update is guarded by status = 'waiting'). Optional id arrays narrow the search to
-- the tokens or runs just resolved (the eager pass after a completion).
with ready as (
    (select r.id
     from {schema}.runs as r
     join {schema}.wait_tokens as t on t.id = r.wait_token_id
     where r.environment = %(environment)s
       and r.status = 'waiting' and r.wait_kind = 'token'
       and t.status <> 'pending'
       and (%(token_ids)s::uuid[] is null or r.wait_token_id = any(%(token_ids)s::uuid[]))
     limit %(limit)s)
    union all
    (select r.id
     from {schema}.runs as r
     join {schema}.runs as c on c.id = r.wait_run_id
     where r.environment = %(environment)s
       and r.status = 'waiting' and r.wait_kind = 'run'
       and c.status in ('completed', 'failed', 'cancelled')
       and (%(run_ids)s::uuid[] is null or r.wait_run_id = any(%(run_ids)s::uuid[]))
     limit %(limit)s)
), locked as materialized (
    select id
    from {schema}.runs
    where id in (select id from ready) and status = 'waiting'
    limit %(limit)s
    for update skip locked
), resumed as (
    update {schema}.runs as r
    set status = 'queued', due_at = now(), wait_kind = null, wait_token_id = null,
        wait_run_id = null, updated_at = now()
    from locked
    where r.id = locked.id and r.status = 'waiting'
    returning r.id, r.queue
), wake as (
    select pg_notify(%(channel)s, %(environment)s || '|' || q.queue)
    from (select distinct queue from resumed) as q
)
select id from resumed where (select count(*) from wake) >= 0;

-- name: wait_token_insert
insert into {schema}.wait_tokens (id, environment, status, idempotency_key, timeout_at)
values (%(id)s, %(environment)s, 'pending', %(idempotency_key)s,
        now() + %(timeout_seconds)s::float8 * interval '1 second')
on conflict do nothing
returning id;

-- name: wait_token_get
select t.id, t.status, t.output, t.idempotency_key, t.timeout_at, t.created_at,
       t.resolved_at,
       (select count(*) from {schema}.runs as r
         where r.status = 'waiting' and r.wait_kind = 'token'
           and r.wait_token_id = t.id) as waiting_runs
from {schema}.wait_tokens as t
where t.environment = %(environment)s
  and (t.id = %(id)s or (%(idempotency_key)s::text is not null
                         and t.idempotency_key = %(idempotency_key)s));

-- name: wait_token_complete
-- Exactly one of completion and timeout wins: both require status = 'pending'.
update {schema}.wait_tokens
set status = 'completed', output = %(output)s::jsonb, resolved_at = now()
where id = %(id)s and environment = %(environment)s and status = 'pending'
returning id;

-- name: wait_token_time_out_due
with due as materialized (
    select id
    from {schema}.wait_tokens
    where environment = %(environment)s and status = 'pending' and timeout_at <= now()
    order by timeout_at
    limit %(limit)s
    for update skip locked
)
update {schema}.wait_tokens as t
set status = 'timed_out', resolved_at = now()
from due
where t.id = due.id and t.status = 'pending' and t.timeout_at <= now()
returning t.id;

-- name: run_cancel
-- Queued, retrying, released and waiting runs are cancelled at once; a running run is asked
-- to stop (its worker is told by NOTIFY, or by its next lease extension) and ends cancelled
-- when its handler returns or its lease lapses.
with target as (
    select id, status
    from {schema}.runs
    where id = %(id)s and environment = %(environment)s
    for update
), changed as (
    update {schema}.runs as r
    set status = case when t.status = 'running' then 'cancellation_requested'
                      else 'cancelled' end,
        finished_at = case when t.status = 'running' then null else now() end,
        wait_kind = null,
        wait_token_id = null,
        wait_run_id = null,
        updated_at = now()
    from target as t
    where r.id = t.id
      and t.status in ('queued', 'retrying', 'released', 'waiting', 'running')
    returning r.id, r.status
), parents as (
    update {schema}.runs as p
    set status = 'queued', due_at = now(), wait_kind = null, wait_run_id = null,
        updated_at = now()
    where p.status = 'waiting' and p.wait_kind = 'run'
      and p.wait_run_id in (select id from changed where status = 'cancelled')
    returning p.environment, p.queue
), told as (
    select pg_notify(%(channel)s, %(environment)s || '|cancel|' || id)
    from changed where status = 'cancellation_requested'
    union all
    select pg_notify(%(channel)s, w.environment || '|' || w.queue)
    from (select distinct environment, queue from parents) as w
)
select t.status as previous, (select status from changed) as current
from target as t
where (select count(*) from told) >= 0;
