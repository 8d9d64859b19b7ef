-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row.

-- name: schema_version
select coalesce(max(version), 0) as version from {schema}.runlane_migrations;

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

-- name: run_claim
-- Unbounded queues: the next due queued runs, by priority, then due time, then id.
with candidates as materialized (
    select id
    from {schema}.runs
    where environment = %(environment)s
      and status = 'queued'
      and queue = any(%(queues)s::text[])
      and due_at <= now()
    order by priority desc, due_at, id
    limit %(limit)s
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

-- name: run_claim_bounded
-- A bounded queue: claim only as many runs as its limit leaves after the live leases.
-- Run after queue_claim_lock in the same transaction.
with live as (
    select count(*) as n
    from {schema}.runs
    where environment = %(environment)s
      and queue = %(queue)s
      and status in ('running', 'cancellation_requested')
      and lease_expires_at > now()
), candidates as materialized (
    select id
    from {schema}.runs
    where environment = %(environment)s
      and status = 'queued'
      and queue = %(queue)s
      and due_at <= now()
    order by priority desc, due_at, id
    limit greatest(0, least(%(limit)s, %(concurrency_limit)s - (select n from live)))
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
        output = i.output::jsonb,
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
    returning r.id, r.attempt, i.lease_token, r.status, r.attempt_started_at
), recorded as (
    insert into {schema}.attempts (run_id, attempt, lease_token, outcome, started_at)
    select id, attempt, lease_token, status, attempt_started_at from done
)
select id from done;

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
    returning r.id, r.attempt, i.lease_token, r.status, r.error, r.attempt_started_at
), recorded as (
    insert into {schema}.attempts (run_id, attempt, lease_token, outcome, error, started_at)
    select id, attempt, lease_token, status, error, attempt_started_at from done
)
select id, status from done;

-- name: run_deliver_due
with due as materialized (
    select id
    from {schema}.runs
    where environment = %(environment)s
      and status in ('retrying', 'released')
      and due_at <= now()
    order by due_at, id
    limit %(limit)s
    for update skip locked
), delivered as (
    update {schema}.runs as r
    set status = 'queued', updated_at = now()
    from due
    where r.id = due.id
      and r.status in ('retrying', 'released')
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
