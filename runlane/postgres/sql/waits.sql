-- Durable steps, suspensions (tokens, runs, sleeps), context.release, wait tokens and resumes.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row. Names are unique across the files of sql/.

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
), ended as (
    update {schema}.runs as r
    set {@attempt_hand_back_set},
        wait_kind = case when r.status = 'cancellation_requested' then null
                         else %(kind)s::text end,
        wait_token_id = case when r.status <> 'cancellation_requested'
                              and %(kind)s = 'token' then target.id end,
        wait_run_id = case when r.status <> 'cancellation_requested'
                            and %(kind)s = 'run' then target.id end,
        due_at = case when %(kind)s = 'sleep' then %(wake_at)s::timestamptz else r.due_at end
    from target,
         (select %(id)s::uuid as id, %(attempt)s::int as attempt,
                 %(lease_token)s::uuid as lease_token, 'waiting'::text as back_to) as i
    where {@attempt_fence}
    returning r.id, r.attempt, i.lease_token,
              case when r.status = 'waiting' then 'suspended' else r.status end as outcome,
              null::jsonb as error, r.attempt_started_at, r.worker_id
), {@attempt_record}
select (select count(*) from target) as target_open,
       (select count(*) from ended) as suspended;

-- name: run_release
-- context.release: the run goes back as released, due after the delay, the attempt not
-- consumed; DUE_DELIVERY makes it queued when due.
with ended as (
    update {schema}.runs as r
    set {@attempt_hand_back_set},
        due_at = {@now} + %(delay_seconds)s * interval '1 second'
    from (select %(id)s::uuid as id, %(attempt)s::int as attempt,
                 %(lease_token)s::uuid as lease_token, 'released'::text as back_to) as i
    where {@attempt_fence}
    returning r.id, r.attempt, i.lease_token, r.status as outcome, null::jsonb as error,
              r.attempt_started_at, r.worker_id
), {@attempt_record}
select count(*) from ended;

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
    set status = 'queued', due_at = {@now}, wait_kind = null, wait_token_id = null,
        wait_run_id = null, updated_at = {@now}
    from locked
    where r.id = locked.id and r.status = 'waiting'
    returning r.id
)
select id from resumed;

-- name: wait_token_insert
insert into {schema}.wait_tokens (id, environment, status, idempotency_key, timeout_at)
values (%(id)s, %(environment)s, 'pending', %(idempotency_key)s,
        {@now} + %(timeout_seconds)s::float8 * interval '1 second')
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
set status = 'completed', output = %(output)s::jsonb, resolved_at = {@now}
where id = %(id)s and environment = %(environment)s and status = 'pending'
returning id;

-- name: wait_token_time_out_due
with due as materialized (
    select id
    from {schema}.wait_tokens
    where environment = %(environment)s and status = 'pending' and timeout_at <= {@now}
    order by timeout_at
    limit %(limit)s
    for update skip locked
)
update {schema}.wait_tokens as t
set status = 'timed_out', resolved_at = {@now}
from due
where t.id = due.id and t.status = 'pending' and t.timeout_at <= {@now}
returning t.id;
