-- runlane schema version 2: announcing, and resuming the waiters of an ended run, at one
-- point each.
--
-- Statements no longer send NOTIFY themselves: the statement-level triggers on "runs" below
-- look at the rows each statement changed (its transition tables) and announce, once per
-- distinct environment and queue, on the schema's channel ({channel}). NOTIFY is delivered
-- at commit, so nothing is announced for a transaction that rolls back. Payloads:
--
--   <environment>|<queue>           runs of the queue became queued and due (inserted so,
--                                   or updated from another status into it); delayed runs
--                                   coming due are announced by delivery recovery
--   <environment>|free|<queue>      attempts of the queue stopped holding a lease (they left
--                                   running / cancellation_requested): bounded queues have
--                                   capacity again
--   <environment>|cancel|<run id>   the run's cancellation was requested while it ran
--
-- The update trigger also resumes runs waiting on a run that ended (completed, failed or
-- cancelled): they become queued and due now, each once (guarded by status = 'waiting'),
-- and their becoming queued is announced by the trigger's nested firing.

create function {schema}.runlane_announce(environment text, kind text, subject text)
returns void
language plpgsql
as $$
begin
    perform pg_notify(
        {channel},
        environment || '|'
            || case when kind = 'due' then subject else kind || '|' || subject end);
end;
$$;

create function {schema}.runlane_runs_inserted()
returns trigger
language plpgsql
as $$
begin
    perform {schema}.runlane_announce(d.environment, 'due', d.queue)
    from (select distinct environment, queue
          from new_rows
          where status = 'queued' and due_at <= now()) as d;
    return null;
end;
$$;

create function {schema}.runlane_runs_updated()
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
    end if;
    return null;
end;
$$;

create trigger runlane_runs_inserted
    after insert on {schema}.runs
    referencing new table as new_rows
    for each statement
    execute function {schema}.runlane_runs_inserted();

create trigger runlane_runs_updated
    after update on {schema}.runs
    referencing old table as old_rows new table as new_rows
    for each statement
    execute function {schema}.runlane_runs_updated();
