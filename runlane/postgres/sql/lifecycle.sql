-- Lifecycle writes of an attempt holding its lease: complete, fail, hand back, extend.
--
-- Named statements of the Postgres storage. Each block starts with "-- name: <name>";
-- {schema} is replaced by the quoted schema name once, when the storage is created.
-- Parameters are psycopg named placeholders. Every write an attempt makes is fenced by
-- run id, attempt number and lease token; every maintenance write re-checks its condition
-- in the statement that changes the row. Names are unique across the files of sql/.

-- name: run_complete_many
-- Announcing freed capacity and resuming runs that wait on these ones happen in the runs
-- update trigger (migration 0002), as for every statement below.
-- Outputs come as one JSON array (parsed once), zipped by position with the fences.
with input as (
    select *
    from rows from (unnest(%(ids)s::uuid[]), unnest(%(attempts)s::int[]),
                    unnest(%(lease_tokens)s::uuid[]), jsonb_array_elements(%(outputs)s::jsonb))
        as i(id, attempt, lease_token, output)
), ended as (
    update {schema}.runs as r
    -- a handler that returns normally has completed its run, whatever stop was asked: a
    -- cancellation requested while it ran ends the run cancelled only when the handler
    -- stops (raises, suspends) or its lease lapses, never by discarding what it returned
    set status = 'completed',
        output = i.output,
        error = null,
        lease_token = null,
        lease_expires_at = null,
        finished_at = {@now},
        updated_at = {@now}
    from input as i
    where {@attempt_fence}
    returning r.id, r.attempt, i.lease_token, r.status as outcome, r.error,
              r.attempt_started_at, r.worker_id
), {@attempt_record}
select id from ended;

-- name: run_fail_many
-- The caller decides whether another attempt follows (runlane.retry.next_retry_delay): a
-- null retry delay fails the run for good, else it retries after the delay. A run whose
-- cancellation was requested becomes cancelled.
with input as (
    {@attempt_end_input}
), ended as (
    update {schema}.runs as r
    set {@attempt_end_set},
        error = i.error::jsonb,
        lease_token = null,
        lease_expires_at = null,
        updated_at = {@now}
    from input as i
    where {@attempt_fence}
    returning r.id, r.attempt, i.lease_token, r.status, r.status as outcome, r.error,
              r.attempt_started_at, r.worker_id
), {@attempt_record}
select id, status from ended;

-- name: run_release_many
-- Hands attempts back unconsumed (worker shutdown): the run is claimable again at once.
with input as (
    select *, 'queued'::text as back_to
    from unnest(%(ids)s::uuid[], %(attempts)s::int[], %(lease_tokens)s::uuid[])
        as i(id, attempt, lease_token)
), ended as (
    update {schema}.runs as r
    set {@attempt_hand_back_set},
        due_at = {@now}
    from input as i
    where {@attempt_fence}
    returning r.id, r.attempt, i.lease_token,
              case when r.status = 'queued' then 'released' else r.status end as outcome,
              null::jsonb as error, r.attempt_started_at, r.worker_id
), {@attempt_record}
select id from ended;

-- name: run_mark_started
-- The attempts whose handlers started (a worker writes them once each, in batches): the run
-- is executing, not only claimed. Fenced by run, attempt and lease token.
update {schema}.runs as r
set started_attempt = i.attempt
from unnest(%(ids)s::uuid[], %(attempts)s::int[], %(lease_tokens)s::uuid[])
    as i(id, attempt, lease_token)
where {@attempt_fence}
returning r.id;

-- name: run_extend_leases
-- An expired lease is not revived: its queue slot may already belong to another attempt.
-- A delivery worker's heartbeat rides along (worker_id not null; no leases for a heartbeat
-- alone): its row is written as registered, or made again if missing (a registration that
-- failed at start, a row cleaned up while the worker was frozen), last seen now, in the
-- state the worker is in. A stopped row stays stopped.
with beat as (
    insert into {schema}.workers as w (
        id, environment, host, pid, runlane_version, queues, concurrency, heartbeat_seconds,
        state, stopped_at)
    select %(worker_id)s::uuid, %(environment)s, %(host)s, %(pid)s, %(runlane_version)s,
           %(queues)s::text[], %(concurrency)s, %(heartbeat_seconds)s, %(worker_state)s,
           case when %(worker_state)s = 'stopped' then {@now} end
    where %(worker_id)s::uuid is not null
    on conflict (id) do update
    set last_seen_at = {@now},
        state = excluded.state,
        stopped_at = excluded.stopped_at
    where w.state <> 'stopped'
), input as (
    select *
    from unnest(%(ids)s::uuid[], %(attempts)s::int[], %(lease_tokens)s::uuid[])
        as i(id, attempt, lease_token)
)
update {schema}.runs as r
set lease_expires_at = {@now} + %(lease_seconds)s * interval '1 second'
from input as i
where {@attempt_fence}
  and r.lease_expires_at > {@now}
returning r.id, r.attempt, r.lease_token, r.status;
