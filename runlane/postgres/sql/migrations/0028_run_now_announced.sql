-- runlane schema version 28: a run moved to now (or to within 15 s) is announced.
-- compatibility: additive
--
-- runlane_reschedule_runs (migration 23; reschedule_run, the console's *Run now*) moved a
-- queued run's due time and announced nothing: the runs update trigger announces a run
-- that becomes queued, not a queued run whose due time moves. An idle worker, its polls
-- spaced out to 10 s (11 with their jitter), remembered the run's old due time and found
-- it up to 11 s after an operator's *Run now*. The function now announces (NOTIFY
-- env|queue, as a trigger does) the queued runs it moved to a time within 15 s, the window
-- of migration 27. A retrying run it makes queued is announced by the update trigger, as
-- before.
--
-- Additive for the runtimes of version 27: the same function, signature and result.

create or replace function {schema}.runlane_reschedule_runs(
    p_environment text, p_ids uuid[], p_due_at timestamptz, p_now timestamptz,
    p_skip_locked boolean)
returns table (id uuid, status text, rescheduled boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
begin
    if p_due_at is null or p_due_at < timestamptz '1970-01-01 00:00:00+00'
       or p_due_at > now() + interval '101 years' then
        raise exception using
            errcode = 'invalid_parameter_value',
            message = format('runlane: a run''s due time must be from 1970 to 100 years from '
                             'now, got %s', coalesce(p_due_at::text, 'null'));
    end if;
    return query
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
    -- a queued run now due within 15 s is announced, as schema 27 announces a trigger's:
    -- an idle worker whose polls are spaced out would find a "run now" up to 11 s late
    -- (the statement above moved it: this one sees it)
    perform pg_notify({channel}, p_environment || '|' || r.queue)
    from {schema}.runs as r
    where p_due_at <= now() + interval '15 seconds'
      and r.id = any(p_ids) and r.environment = p_environment
      and r.status = 'queued' and r.due_at = p_due_at;
end;
$$;
