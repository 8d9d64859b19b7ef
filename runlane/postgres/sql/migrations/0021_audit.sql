-- runlane schema version 21: the operators' audit trail, and reschedule.
-- compatibility: additive
--
-- * audit_log: one row per operator action (pause/resume a queue or schedule, retry,
--   cancel, delete, bulk actions, run now, reschedule), written in the transaction of the
--   action itself, so no action commits without its record and no record without its
--   action. A bulk action writes one row per batch (its transaction), numbered by part
--   under one action_id; part 0 heads the action and is what listings page through.
--   Who: actor (the console's identity, null for the API and CLI), db_role (the database
--   role that wrote it: a default the writing role cannot set, grants.sql leaves the
--   column out of the operator's INSERT), os_user (the client's operating-system user),
--   via (api, cli or console). When: at, the database's time at the insert (likewise not
--   writable). Append-only: no role but the owner may update or delete a row; retention
--   deletes old rows through runlane_prune_audit (granted to maintenance).
-- * runlane_reschedule_runs: the operator has no UPDATE on runs, so a queued (delayed) or
--   retrying run's due time moves only through this SECURITY DEFINER function. A run that
--   is running, waiting, released or finished is left alone (one row per run found says
--   whether it moved). A retrying run moved to a time already reached becomes queued (the
--   update trigger announces it and writes its outbox item), as delivery would make it;
--   the unclaimed outbox items of a queued run move with it (a transport lane publishes
--   it at its new time).
--
-- Additive for the runtimes of version 20: they read and write neither.

create table {schema}.audit_log (
    id          uuid primary key,
    action_id   uuid not null,
    part        integer not null default 0,
    environment text not null,
    at          timestamptz not null default now(),
    via         text not null,
    actor       text,
    db_role     text not null default current_user,
    os_user     text,
    action      text not null,
    target      text,
    runs        integer,
    changed     boolean not null,
    reason      text,
    details     jsonb not null default jsonb_build_object(),
    constraint audit_log_via check (via in ('api', 'cli', 'console')),
    constraint audit_log_part check (part >= 0),
    constraint audit_log_runs check (runs is null or runs >= 0)
);

-- listings: an environment's actions newest first (their heading rows)
create index audit_log_listing on {schema}.audit_log (environment, at desc, id desc)
    where part = 0;
-- an action's batches, summed under its heading row
create unique index audit_log_parts on {schema}.audit_log (action_id, part);
-- retention: the oldest rows first, every part
create index audit_log_by_time on {schema}.audit_log (at);

create function {schema}.runlane_reschedule_runs(
    p_environment text, p_ids uuid[], p_due_at timestamptz, p_now timestamptz,
    p_skip_locked boolean)
returns table (id uuid, status text, rescheduled boolean)
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$
    with locked as (
        select unnest({schema}.runlane_lock_runs(p_environment, p_ids, p_skip_locked)) as id
    ), target as (
        select r.id, r.status
        from {schema}.runs as r
        where r.id in (select l.id from locked as l) and r.environment = p_environment
    ), moved as (
        update {schema}.runs as r
        set due_at = p_due_at,
            status = case when t.status = 'retrying' and p_due_at <= p_now then 'queued'
                          else t.status end,
            -- the server's time, as every SECURITY DEFINER function writes it: p_now (the
            -- caller's, a test's moved clock) only says whether a retrying run's new time has
            -- come, and a queued run due later waits for its due time whatever it says
            updated_at = now()
        from target as t
        where r.id = t.id and t.status in ('queued', 'retrying')
        returning r.id, r.status
    ), outbox_moved as (
        update {schema}.outbox as o
        set available_at = p_due_at
        from moved as m
        where o.run_id = m.id and m.status = 'queued' and o.claim_token is null
          and o.environment = p_environment
        returning o.id
    )
    select t.id, t.status, t.id in (select m.id from moved as m)
    from target as t;
$$;

-- Retention of the audit trail: deletes an environment's rows older than p_keep (at least
-- a day, by the server's clock: no caller's clock or argument reaches a recent record), at
-- most p_limit of them; how many it deleted. The only way any role but the owner deletes
-- audit rows.
create function {schema}.runlane_prune_audit(
    p_environment text, p_keep interval, p_limit integer)
returns bigint
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$
    with doomed as (
        select a.id from {schema}.audit_log as a
        where a.environment = p_environment
          and a.at < now() - greatest(p_keep, interval '1 day')
        order by a.at
        limit p_limit
    ), gone as (
        delete from {schema}.audit_log as a
        where a.id in (select d.id from doomed as d)
        returning 1
    )
    select count(*) from gone;
$$;

revoke execute on function {schema}.runlane_reschedule_runs(
    text, uuid[], timestamptz, timestamptz, boolean) from public;
revoke execute on function {schema}.runlane_prune_audit(text, interval, integer) from public;
