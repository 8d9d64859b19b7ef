-- runlane schema version 1: runs and their attempts, durable steps, wait tokens, schedules,
-- maintenance leases.
--
-- A run's current attempt and its lease live on the run row, so a claim and every fenced
-- write touch one row; finished attempts are kept in "attempts" for history. A pruned run
-- that still has children stays as a tombstone (pruned_at set, payload dropped) counting
-- its remaining children.

create table {schema}.runs (
    id                 uuid primary key,
    environment        text not null,
    task_id            text not null,
    queue              text not null,
    status             text not null,
    priority           integer not null default 0,
    payload            jsonb not null,
    output             jsonb,
    error              jsonb,
    -- number of the current (or last) attempt; 0 until the first claim; only grows
    attempt            integer not null default 0,
    -- attempts handed back unconsumed (worker shutdown, context.release): they do not
    -- count against max_attempts
    releases           integer not null default 0,
    max_attempts       integer not null,
    idempotency_key    text,
    parent_run_id      uuid,
    -- when the run may next be claimed (queued) or delivered again (retrying, released)
    due_at             timestamptz not null,
    lease_token        uuid,
    lease_expires_at   timestamptz,
    attempt_started_at timestamptz,
    created_at         timestamptz not null default now(),
    updated_at         timestamptz not null default now(),
    started_at         timestamptz,
    finished_at        timestamptz,
    -- a waiting run waits on one of: a wait token, another run, or its due time (sleep)
    wait_kind          text,
    wait_token_id      uuid,
    wait_run_id        uuid,
    -- tombstone: pruned by cleanup while children remained
    pruned_at          timestamptz,
    remaining_children integer,
    constraint runs_wait_shape check (
        (status = 'waiting') = (wait_kind is not null)
        and (wait_kind is distinct from 'token' or wait_token_id is not null)
        and (wait_kind is distinct from 'run' or wait_run_id is not null)),
    constraint runs_tombstone_shape check ((pruned_at is null) = (remaining_children is null)),
    constraint runs_status_known check (status in (
        'queued', 'running', 'retrying', 'released', 'waiting',
        'cancellation_requested', 'completed', 'failed', 'cancelled')),
    constraint runs_attempts_sane check (
        attempt >= 0 and releases >= 0 and releases <= attempt and max_attempts >= 1),
    constraint runs_lease_matches_status check (
        (status in ('running', 'cancellation_requested')) = (lease_token is not null)
        or status = 'cancellation_requested'),
    constraint runs_finished_when_terminal check (
        (status in ('completed', 'failed', 'cancelled')) = (finished_at is not null))
);

-- a second trigger with the same key returns the first run
create unique index runs_idempotency_key
    on {schema}.runs (environment, task_id, idempotency_key)
    where idempotency_key is not null;

-- claim: the next due queued runs by priority, then due time, then id
create index runs_claimable
    on {schema}.runs (environment, priority desc, due_at, id)
    include (queue)
    where status = 'queued';

-- maintenance: retries and releases that have come due
create index runs_deferred_due
    on {schema}.runs (environment, due_at)
    where status in ('retrying', 'released');

-- waits: runs to resume when their token or awaited run becomes terminal
create index runs_waiting_on_token
    on {schema}.runs (wait_token_id)
    where status = 'waiting' and wait_kind = 'token';

create index runs_waiting_on_run
    on {schema}.runs (wait_run_id)
    where status = 'waiting' and wait_kind = 'run';

-- durable sleeps that have come due
create index runs_sleeping_due
    on {schema}.runs (environment, due_at)
    where status = 'waiting' and wait_kind = 'sleep';

-- bounded queues count live leases per queue inside the claim; maintenance finds lapsed
-- leases through it too (running rows are few: one per busy worker slot)
create index runs_live_by_queue
    on {schema}.runs (environment, queue, lease_expires_at)
    where status in ('running', 'cancellation_requested');

-- cleanup: terminal runs by age, and tombstones whose children are all gone
create index runs_finished
    on {schema}.runs (environment, finished_at)
    where status in ('completed', 'failed', 'cancelled') and pruned_at is null;

create index runs_tombstones
    on {schema}.runs (environment, remaining_children)
    where pruned_at is not null;

create index runs_parent
    on {schema}.runs (parent_run_id)
    where parent_run_id is not null;

create table {schema}.attempts (
    run_id       uuid not null references {schema}.runs (id) on delete cascade,
    attempt      integer not null,
    lease_token  uuid not null,
    outcome      text not null,
    error        jsonb,
    started_at   timestamptz not null,
    finished_at  timestamptz not null default now(),
    primary key (run_id, attempt),
    constraint attempts_outcome_known check (outcome in (
        'completed', 'failed', 'retrying', 'released', 'suspended', 'cancelled', 'expired'))
);

-- Durable steps: one stored output per run and step name; the first writer wins.
create table {schema}.steps (
    run_id      uuid not null references {schema}.runs (id) on delete cascade,
    name        text not null,
    output      jsonb not null,
    attempt     integer not null,
    created_at  timestamptz not null default now(),
    primary key (run_id, name)
);

-- Wait tokens: pending, then exactly one of completed or timed_out.
create table {schema}.wait_tokens (
    id               uuid primary key,
    environment      text not null,
    status           text not null,
    output           jsonb,
    idempotency_key  text,
    timeout_at       timestamptz,
    created_at       timestamptz not null default now(),
    resolved_at      timestamptz,
    constraint wait_tokens_status_known check (status in ('pending', 'completed', 'timed_out')),
    constraint wait_tokens_resolved_when_terminal check (
        (status = 'pending') = (resolved_at is null))
);

create unique index wait_tokens_idempotency_key
    on {schema}.wait_tokens (environment, idempotency_key)
    where idempotency_key is not null;

create index wait_tokens_due
    on {schema}.wait_tokens (environment, timeout_at)
    where status = 'pending' and timeout_at is not null;

-- Schedules: the next slot each schedule waits for, and one row per slot that made a run.
-- The primary key of schedule_slots is what makes racing maintenance replicas harmless.
create table {schema}.schedules (
    environment   text not null,
    schedule_id   text not null,
    cron          text not null,
    timezone      text not null,
    next_slot_at  timestamptz not null,
    updated_at    timestamptz not null default now(),
    primary key (environment, schedule_id)
);

create table {schema}.schedule_slots (
    environment   text not null,
    schedule_id   text not null,
    slot_at       timestamptz not null,
    run_id        uuid not null,
    created_at    timestamptz not null default now(),
    primary key (environment, schedule_id, slot_at)
);

-- Maintenance ownership: one row per band. "fencing" only grows (a logged table, so a crash
-- cannot reset it); expires_at is always computed by the database.
create table {schema}.maintenance_leases (
    environment   text not null,
    band          text not null,
    owner         uuid not null,
    fencing       bigint not null,
    expires_at    timestamptz not null,
    acquired_at   timestamptz not null,
    primary key (environment, band)
);
