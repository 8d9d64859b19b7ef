-- runlane schema version 9: runs that end are announced, for wait_for_run.
-- compatibility: additive
--
-- A statement-level trigger on "runs" sends, at commit, the ids of the runs the statement
-- moved into completed, failed or cancelled, on a channel of their own (not the workers'):
-- 'runlane-ends.' || <schema>, cut at 63 bytes like {channel}. Payload:
--
--   <environment>|<run id>,<run id>,...     at most 100 ids per notification
--
-- wait_for_run listens there only while a caller waits, and re-reads the run when its id is
-- announced (polling stays the fallback: a notification is a hint). A statement that ends
-- no run pays one scan of its transition table's rows for a terminal status.
--
-- Additive for the runtimes of version 8: they never listen on the channel, and the
-- trigger changes no row.

create function {schema}.runlane_runs_ended()
returns trigger
language plpgsql
as $$
begin
    if exists (select from new_rows where status in ('completed', 'failed', 'cancelled')) then
        perform pg_notify(
            left('runlane-ends.' || substr({channel}, 9), 63),
            e.environment || '|' || e.ids)
        from (
            select c.environment, string_agg(c.id::text, ',') as ids
            from (
                select n.environment, n.id,
                       (row_number() over (partition by n.environment order by n.id) - 1) / 100
                           as chunk
                from new_rows as n
                join old_rows as o on o.id = n.id
                where n.status in ('completed', 'failed', 'cancelled')
                  and o.status not in ('completed', 'failed', 'cancelled')
            ) as c
            group by c.environment, c.chunk
        ) as e;
    end if;
    return null;
end;
$$;

create trigger runlane_runs_ended
    after update on {schema}.runs
    referencing old table as old_rows new table as new_rows
    for each statement
    execute function {schema}.runlane_runs_ended();
