-- runlane schema version 3: the transactional outbox of transport lanes.
--
-- An environment delivered through a transport (RabbitMQ) has a row in outbox_environments
-- (written by the lane when its runtime starts). For such an environment, every transition
-- of a run into queued (trigger, due retry or release, resume, hand-back, schedule) writes
-- an outbox item in the same transaction, from the same statement-level triggers that
-- announce: there is one point where "a run became runnable" is handled.
--
-- An item is published by whoever holds its claim: a fresh token per item and an expiry
-- computed by the database. Results are written fenced by that token: success deletes the
-- item, failure releases it with a back-off. A publisher whose claim expired changes
-- nothing. An eager trigger (the producer publishes right after commit) stores its items
-- already claimed: the insert sets the transaction-local setting runlane.outbox_claim to
-- its token, and such an item's id is md5(token || run id), which the producer computes
-- too. Items of any other statement are stored unclaimed and announced as
-- <environment>|outbox|<queue>, so a listening publisher wakes at commit.

create table {schema}.outbox_environments (
    environment   text primary key,
    claim_seconds double precision not null check (claim_seconds > 0)
);

create table {schema}.outbox (
    id               uuid primary key,
    environment      text not null,
    run_id           uuid not null,
    queue            text not null,
    created_at       timestamptz not null default now(),
    -- not published before this (the run's due time, or a back-off after a failure)
    available_at     timestamptz not null,
    claim_token      uuid,
    claim_expires_at timestamptz,
    failures         integer not null default 0,
    last_error       text,
    constraint outbox_claim_shape check ((claim_token is null) = (claim_expires_at is null))
);

create index outbox_publishable on {schema}.outbox (available_at);
create index outbox_by_environment on {schema}.outbox (environment, created_at);
create index outbox_by_run on {schema}.outbox (run_id);

-- Write the outbox items of runs that became queued; claimed by the statement's eager
-- token when the runs are due now, else unclaimed and announced.
create function {schema}.runlane_outbox_write(changed jsonb)
returns void
language plpgsql
as $$
declare
    claim uuid := nullif(current_setting('runlane.outbox_claim', true), '')::uuid;
    announced bigint;
begin
    with rows as (
        select (r ->> 'id')::uuid as run_id, r ->> 'environment' as environment,
               r ->> 'queue' as queue, (r ->> 'due_at')::timestamptz as due_at
        from jsonb_array_elements(changed) as r
    ), items as (
        insert into {schema}.outbox (
            id, environment, run_id, queue, available_at, claim_token, claim_expires_at)
        select case when claim is not null and r.due_at <= now()
                    then md5(claim::text || r.run_id::text)::uuid
                    else gen_random_uuid() end,
               r.environment, r.run_id, r.queue, greatest(r.due_at, now()),
               case when claim is not null and r.due_at <= now() then claim end,
               case when claim is not null and r.due_at <= now()
                    then now() + e.claim_seconds * interval '1 second' end
        from rows as r
        join {schema}.outbox_environments as e on e.environment = r.environment
        returning environment, queue, claim_token, available_at
    )
    select count({schema}.runlane_announce(a.environment, 'outbox', a.queue)::text) into announced
    from (select distinct environment, queue from items
          where claim_token is null and available_at <= now()) as a;
end;
$$;

create or replace function {schema}.runlane_runs_inserted()
returns trigger
language plpgsql
as $$
begin
    perform {schema}.runlane_announce(d.environment, 'due', d.queue)
    from (select distinct environment, queue
          from new_rows
          where status = 'queued' and due_at <= now()) as d;
    if exists (select from {schema}.outbox_environments) then
        perform {schema}.runlane_outbox_write(coalesce(jsonb_agg(jsonb_build_object(
            'id', n.id, 'environment', n.environment, 'queue', n.queue,
            'due_at', n.due_at)), '[]'::jsonb))
        from new_rows as n
        where n.status = 'queued';
    end if;
    return null;
end;
$$;

create or replace function {schema}.runlane_runs_updated()
returns trigger
language plpgsql
as $$
begin
    -- a run ended: the runs waiting on it resume now (a waiting run's target is never
    -- terminal before this statement, so no need to look at the old rows)
    if exists (select from new_rows where status in ('completed', 'failed', 'cancelled')) then
        update {schema}.runs as p
        set status = 'queued', due_at = now(), wait_kind = null, wait_run_id = null,
            updated_at = now()
        where p.status = 'waiting' and p.wait_kind = 'run'
          and p.wait_run_id in (
              select id from new_rows where status in ('completed', 'failed', 'cancelled'));
    end if;
    -- most statements (claims, lease extensions) change nothing worth announcing
    if exists (select from new_rows
               where status in ('queued', 'cancellation_requested')
                  or lease_token is null) then
        perform {schema}.runlane_announce(a.environment, a.kind, a.subject)
        from (
            select distinct n.environment, k.kind, k.subject
            from new_rows as n
            join old_rows as o on o.id = n.id
            cross join lateral (values
                (case when n.status = 'queued' and o.status <> 'queued'
                           and n.due_at <= now() then 'due' end,
                 n.queue),
                (case when o.status in ('running', 'cancellation_requested')
                           and n.status not in ('running', 'cancellation_requested')
                      then 'free' end,
                 n.queue),
                (case when n.status = 'cancellation_requested'
                           and o.status <> 'cancellation_requested' then 'cancel' end,
                 n.id::text)
            ) as k(kind, subject)
            where k.kind is not null
        ) as a;
        if exists (select from {schema}.outbox_environments) then
            perform {schema}.runlane_outbox_write(coalesce(jsonb_agg(jsonb_build_object(
                'id', n.id, 'environment', n.environment, 'queue', n.queue,
                'due_at', n.due_at)), '[]'::jsonb))
            from new_rows as n
            join old_rows as o on o.id = n.id
            where n.status = 'queued' and o.status <> 'queued';
        end if;
    end if;
    return null;
end;
$$;
