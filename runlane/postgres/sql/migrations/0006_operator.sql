-- runlane schema version 6: what operators steer and see.
--
-- * queue_states: a queue's durable operator state (paused, and why). A row exists only for
--   a queue an operator touched; a queue without one is running. Claims on every path read
--   it in the claim statement itself, so a pause holds from the moment it commits.
-- * workers: one row per delivery worker (host, pid, queues, concurrency), kept fresh by
--   the heartbeat the lifecycle writer sends with its lease extensions. A row whose
--   last_seen_at is older than three heartbeat intervals is shown as lost; cleanup removes
--   stopped and lost rows after workers_retention.
-- * runs.worker_id / attempts.worker_id: which worker ran an attempt (its row gives the
--   host); runs.progress: the last progress a handler reported (fenced like its other
--   writes).
-- * schedules: each schedule's task, queue and payload are stored with its state, so that
--   operators can list, pause and fire schedules from a database URL alone.
--
-- Every change is additive: a runtime of schema version 5 ignores the new tables and
-- columns (it refuses to start on a newer schema; docs/operating.md says why and how to roll).

create table {schema}.queue_states (
    environment    text not null,
    queue          text not null,
    paused         boolean not null default false,
    paused_reason  text,
    paused_at      timestamptz,
    updated_at     timestamptz not null default now(),
    primary key (environment, queue)
);

create table {schema}.workers (
    id                 uuid primary key,
    environment        text not null,
    host               text not null,
    pid                integer not null,
    runlane_version    text not null,
    -- the queues the worker serves
    queues             text[] not null,
    concurrency        integer not null,
    -- seconds between heartbeats: a running worker unseen for three of them is lost
    heartbeat_seconds  double precision not null,
    state              text not null default 'running',
    started_at         timestamptz not null default now(),
    last_seen_at       timestamptz not null default now(),
    stopped_at         timestamptz,
    constraint workers_state_known check (state in ('running', 'stopping', 'stopped'))
);

create index workers_by_environment on {schema}.workers (environment, last_seen_at);

alter table {schema}.runs add column worker_id uuid;
alter table {schema}.runs add column progress jsonb;
alter table {schema}.attempts add column worker_id uuid;

alter table {schema}.schedules add column task_id text;
alter table {schema}.schedules add column queue text;
alter table {schema}.schedules add column payload jsonb;
alter table {schema}.schedules add column priority integer;
alter table {schema}.schedules add column max_attempts integer;
alter table {schema}.schedules add column paused boolean not null default false;
alter table {schema}.schedules add column last_fired_at timestamptz;
alter table {schema}.schedules add column last_run_id uuid;

-- trigger_schedule_now from a database URL: one run made from a schedule's stored
-- definition, due now. SECURITY DEFINER, and not executable by PUBLIC: the operator role
-- (granted EXECUTE) runs schedules as they are defined without being allowed to insert
-- runs of its own making. No row: no such schedule; a row of nulls: no stored definition.
create function {schema}.runlane_run_schedule(
    p_environment text, p_schedule_id text, p_run_id uuid, p_idempotency_key text,
    p_trace_context jsonb)
returns table (run_id uuid, task_id text, queue text, created boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    d record;
begin
    select s.task_id, s.queue, s.payload, s.priority, s.max_attempts into d
    from {schema}.schedules as s
    where s.environment = p_environment and s.schedule_id = p_schedule_id;
    if not found then
        return;
    end if;
    if d.task_id is null or d.queue is null or d.payload is null or d.priority is null
       or d.max_attempts is null then
        return query select null::uuid, null::text, null::text, null::boolean;
        return;
    end if;
    insert into {schema}.runs (
        id, environment, task_id, queue, status, priority, payload, max_attempts,
        idempotency_key, due_at, trace_context)
    values (p_run_id, p_environment, d.task_id, d.queue, 'queued', d.priority, d.payload,
            d.max_attempts, p_idempotency_key, now(), p_trace_context)
    on conflict do nothing;
    -- an idempotency key already used, or this statement retried after its answer was lost
    return query
        select r.id, r.task_id, r.queue, r.id = p_run_id
        from {schema}.runs as r
        where r.environment = p_environment and r.task_id = d.task_id
          and (r.id = p_run_id or r.idempotency_key = p_idempotency_key);
end;
$$;

revoke execute on function {schema}.runlane_run_schedule(text, text, uuid, text, jsonb)
    from public;
