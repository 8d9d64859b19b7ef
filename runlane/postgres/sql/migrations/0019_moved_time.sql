-- runlane schema version 19: the runs triggers read the time the statements read.
-- compatibility: additive
--
-- Statements read the time through the fragment now (sql/fragments.sql: the statement's
-- now parameter, else now()): a test's moved clock (runlane.testing.MovableClock) reached
-- them, but not the triggers they fire, which read the server's now(). The runs triggers
-- (runlane_runs_inserted, runlane_runs_updated) and runlane_outbox_write read
-- runlane_now(): the setting runlane.now, which the executor's cursors set to the moment
-- they pass as the statement's now, only on a lane given a clock (runlane/postgres/_now.py);
-- unset, as in production, it is now(), so nothing changes there. The insert trigger and
-- runlane_outbox_write read it once a statement; the update trigger only where it read now()
-- (resuming waiters, a run queued due), which claims and completions do not reach.
--
-- The guard trigger and the SECURITY DEFINER functions keep the server's now(): any session
-- may set runlane.now, so a time read there would let a role that may not claim make a live
-- lease look lapsed and end its attempt, or the operator stamp finish times of its choosing.
--
-- Additive for the runtimes of version 18: the same triggers and functions, the same
-- signatures, the same time when nothing sets runlane.now.

create function {schema}.runlane_now()
returns timestamptz
language sql
stable
parallel safe
as $$
    select coalesce(nullif(pg_catalog.current_setting('runlane.now', true), '')::timestamptz,
                    pg_catalog.now())
$$;

create or replace function {schema}.runlane_runs_inserted()
returns trigger
language plpgsql
as $$
declare
    claim uuid;
    announced bigint;
    moment timestamptz := {schema}.runlane_now();
begin
    perform pg_notify({channel}, n.environment || '|' || n.queue)
    from new_rows as n
    where n.status = 'queued' and n.due_at <= moment;
    if exists (select from {schema}.outbox_environments) then
        claim := nullif(current_setting('runlane.outbox_claim', true), '')::uuid;
        with items as (
            insert into {schema}.outbox (
                id, environment, run_id, queue, available_at, claim_token, claim_expires_at)
            select case when claim is not null and n.due_at <= moment
                        then md5(claim::text || n.id::text)::uuid
                        else gen_random_uuid() end,
                   n.environment, n.id, n.queue, greatest(n.due_at, moment),
                   case when claim is not null and n.due_at <= moment then claim end,
                   case when claim is not null and n.due_at <= moment
                        then moment + e.claim_seconds * interval '1 second' end
            from new_rows as n
            join {schema}.outbox_environments as e on e.environment = n.environment
            where n.status = 'queued'
            returning environment, queue, claim_token, available_at
        )
        select count(pg_notify({channel}, i.environment || '|outbox|' || i.queue)::text)
        into announced
        from items as i
        where i.claim_token is null and i.available_at <= moment;
    end if;
    return null;
end;
$$;

create or replace function {schema}.runlane_outbox_write(changed jsonb)
returns void
language plpgsql
as $$
declare
    claim uuid := nullif(current_setting('runlane.outbox_claim', true), '')::uuid;
    announced bigint;
    moment timestamptz := {schema}.runlane_now();
begin
    with rows as (
        select (r ->> 'id')::uuid as run_id, r ->> 'environment' as environment,
               r ->> 'queue' as queue, (r ->> 'due_at')::timestamptz as due_at
        from jsonb_array_elements(changed) as r
    ), items as (
        insert into {schema}.outbox (
            id, environment, run_id, queue, available_at, claim_token, claim_expires_at)
        select case when claim is not null and r.due_at <= moment
                    then md5(claim::text || r.run_id::text)::uuid
                    else gen_random_uuid() end,
               r.environment, r.run_id, r.queue, greatest(r.due_at, moment),
               case when claim is not null and r.due_at <= moment then claim end,
               case when claim is not null and r.due_at <= moment
                    then moment + e.claim_seconds * interval '1 second' end
        from rows as r
        join {schema}.outbox_environments as e on e.environment = r.environment
        returning environment, queue, claim_token, available_at
    )
    select count({schema}.runlane_announce(a.environment, 'outbox', a.queue)::text) into announced
    from (select distinct environment, queue from items
          where claim_token is null and available_at <= moment) as a;
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
        set status = 'queued', due_at = {schema}.runlane_now(), wait_kind = null,
            wait_run_id = null, updated_at = {schema}.runlane_now()
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
                           and n.due_at <= {schema}.runlane_now() then 'due' end,
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
